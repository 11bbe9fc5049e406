"""The stages of a study over all its runs: check, train, measure.

The CLI is a thin layer over these functions, and so are cluster jobs (a shard of a sweep is the same
call on a slice of the runs), so every path through flatbench trains and measures a run the same way.

Everything a stage can check before it works is checked first (`check_study`, `check_data`,
`check_output_dir`, the run folders' identities), so that bad input is one line and an exit code before
any folder is created or any model trained.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from flatbench.config import Study, apply_overrides, did_you_mean, load_study, parse_study
from flatbench.errors import ConfigError, FlatbenchError
from flatbench.store import (RUN_JSON, STUDY_FILE, RunLocked, atomic_write_text, is_finished, list_run_dirs,
                             run_dir)

Echo = Callable[[str], None]


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """`I/N` → (I, N) with 0 ≤ I < N."""
    if text is None:
        return None
    try:
        i, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard must look like I/N (e.g. 0/4), got '{text}'") from None
    if n < 1 or not 0 <= i < n:
        raise ConfigError(f"--shard {text}: need 0 ≤ I < N")
    return i, n


def shard_runs(study: Study, shard: tuple[int, int] | None) -> list[tuple[str, object]]:
    """The I-th of N disjoint, round-robin slices of the sweep (all runs when shard is None)."""
    runs = list(study.runs)
    return runs if shard is None else runs[shard[0]::shard[1]]


# ---------------------------------------------------------------- reading and checking a study


def save_study(study: Study) -> Path:
    """Write the resolved study config into the experiment folder, for `measure` and `report` to read."""
    path = study.exp_dir / STUDY_FILE
    raw = dict(study.raw)
    raw["name"] = study.name
    raw.pop("out", None)
    atomic_write_text(path, yaml.safe_dump(raw, sort_keys=False))
    return path


def read_saved_study(exp_dir: str | Path, overrides: tuple[str, ...] = ()) -> Study:
    """The study saved in an experiment folder (its study.yaml), named after the folder wherever it is."""
    exp_dir = Path(exp_dir)
    if not exp_dir.exists():
        raise FlatbenchError(f"experiment folder {exp_dir} does not exist")
    saved = exp_dir / STUDY_FILE
    if not saved.is_file():
        hint = " (it is a file)" if exp_dir.is_file() else ""
        raise FlatbenchError(f"{exp_dir} is not a flatbench experiment folder{hint}: no {STUDY_FILE} in it")
    try:
        raw = yaml.safe_load(saved.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError:
        raise FlatbenchError(f"{saved} is not valid YAML; restore it or re-run `flatbench train` with the "
                             "study's config") from None
    raw = apply_overrides(raw, overrides)
    raw["name"] = exp_dir.name  # the folder may have been moved or renamed since
    return parse_study(raw, default_name=exp_dir.name, out=str(exp_dir.parent))


def study_from_target(target: str | Path, overrides: tuple[str, ...] = (), out: str | None = None) -> Study:
    """A study from a config file, or from an experiment folder's saved study.yaml."""
    target = Path(target)
    if target.is_dir():
        return read_saved_study(target, overrides)
    return load_study(target, overrides, out=out)


def check_study(study: Study, measures: list[str] | None = None) -> list[str]:
    """Every name of the study (datasets, models, measures and their settings) exists; returns the
    resolved measure names. One clear line (with the closest valid name) otherwise, before any work."""
    from flatbench.data import DATASETS
    from flatbench.measures.registry import resolve_names
    from flatbench.measures.runner import check_settings
    from flatbench.models import MODELS

    for _, run in study.runs:
        if run.data.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset '{run.data.dataset}'{did_you_mean(run.data.dataset, DATASETS)} "
                              f"(available: {', '.join(sorted(DATASETS))})")
        if run.model.name not in MODELS:
            raise ConfigError(f"unknown model '{run.model.name}'{did_you_mean(run.model.name, MODELS)} "
                              f"(available: {', '.join(sorted(MODELS))})")
    names = resolve_names(list(study.measure.measures))
    if study.measure.snapshot_measures is not None:
        resolve_names(list(study.measure.snapshot_measures))
    check_settings(names, study.measure)
    return resolve_names(measures) if measures else names


def names_for(target: Any, chosen: list[str], study: Study, given: list[str] | None) -> list[str]:
    """The measures of one target: the chosen ones, or for a snapshot `measure.snapshot_measures` when the
    study sets it and no measures were named on the command line."""
    from flatbench.measures.registry import resolve_names

    if getattr(target, "level", None) is None or given or study.measure.snapshot_measures is None:
        return chosen
    return resolve_names(list(study.measure.snapshot_measures))


def check_data(study: Study, runs: list[tuple[str, Any]] | None = None) -> None:
    """Read every dataset the runs need (once per process), so a missing one is an error before anything
    is created."""
    from flatbench.data import dataset_root, load_raw

    seen = set()
    for _, run in (runs if runs is not None else study.runs):
        key = (run.data.dataset, run.data.root, run.data.download)
        if key not in seen:
            seen.add(key)
            load_raw(run.data.dataset, dataset_root(run.data.root), run.data.download)


def check_output_dir(path: str | Path, what: str = "output folder") -> Path:
    """Make sure `path` is (or can become) a folder we can write into; one clear line otherwise.

    Tried for real (a folder created, a temporary file written and removed): permission bits say nothing
    when running as root, and a path under a file or on a read-only file system fails only when used.
    """
    path = Path(path)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == path else f"lies under the file {probe}"
        raise FlatbenchError(f"{what} {path} {where}; give a folder (--out)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise FlatbenchError(f"cannot write to the {what} {path} ({exc.strerror or exc}); give another --out")
    return path


def stale_run_ids(study: Study) -> list[str]:
    """Run folders in the experiment that are not runs of the study's current config (left by an earlier
    version of it): `report` lists them as not in this study and leaves them out."""
    current = set(study.run_ids())
    return [p.name for p in list_run_dirs(study.exp_dir) if p.name not in current]


def show_progress(quiet: bool) -> bool:
    """Progress bars only for a person at a terminal: never in --quiet mode or a redirected log."""
    return not quiet and sys.stdout.isatty()


# ---------------------------------------------------------------- train


def train_study(study: Study, device: torch.device, *, shard: tuple[int, int] | None = None,
                quiet: bool = False, echo: Echo = print, run_ids: list[str] | None = None) -> dict[str, list[str]]:
    """Train every unfinished run of the (shard of the) study; returns run ids by outcome.

    Runs that `train.vectorize` groups (see `flatbench.vectorized`) train at once, the others one after
    another; both write the same files. `run_ids` restricts the study to those runs (cluster tasks).
    Before anything is written: the names, the datasets, the output folder and every existing run folder
    (its stored config must be the run's, its model.pt the one it wrote) are checked.
    """
    from flatbench.train import Preempted, check_run_dir, train_run
    from flatbench.vectorized import plan_groups, train_group

    check_study(study)
    outcome: dict[str, list[str]] = {"trained": [], "skipped": [], "locked": [], "failed": []}
    runs = shard_runs(study, shard)
    if run_ids is not None:
        wanted = set(run_ids)
        runs = [(rid, cfg) for rid, cfg in runs if rid in wanted]
    pending = []
    for rid, cfg in runs:
        if check_run_dir(run_dir(study.exp_dir, rid), rid, cfg) == "finished":
            outcome["skipped"].append(rid)
        else:
            pending.append((rid, cfg))
    check_data(study, pending)
    check_output_dir(study.exp_dir, "experiment folder")
    save_study(study)
    done = len(outcome["skipped"])
    progress = show_progress(quiet)
    for group in plan_groups(pending, device):
        ids = [rid for rid, _ in group]
        if not quiet:
            what = f"training {ids[0]}" if len(ids) == 1 else f"training {len(ids)} runs at once: {', '.join(ids)}"
            echo(f"[{done + 1}/{len(runs)}] {what}" if len(ids) == 1 else
                 f"[{done + 1}-{done + len(ids)}/{len(runs)}] {what}")
        done += len(ids)
        try:
            if len(group) == 1:
                rid, cfg = group[0]
                train_run(rid, cfg, run_dir(study.exp_dir, rid), device, sweep_axes=study.sweep_axes,
                          progress=progress, echo=echo)
                outcome["trained"].append(rid)
            else:
                result = train_group(group, study.exp_dir, device, sweep_axes=study.sweep_axes,
                                     progress=progress, echo=echo)
                for key, values in result.items():
                    outcome[key].extend(values)
        except RunLocked as exc:
            echo(f"skipping {ids[0]}: {exc}")
            outcome["locked"].append(ids[0])
        except (FlatbenchError, Preempted, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - one broken run must not stop the sweep
            for rid in ids:
                path = run_dir(study.exp_dir, rid)
                if not is_finished(path):
                    _mark_failed(path, exc)
                    echo(f"run {rid} failed: {type(exc).__name__}: {exc}")
                    outcome["failed"].append(rid)
    return outcome


def _mark_failed(path: Path, exc: BaseException) -> None:
    from flatbench.store import atomic_write_json, read_json

    info = read_json(path / RUN_JSON) if (path / RUN_JSON).is_file() else {"run_id": path.name}
    info.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    atomic_write_json(path / RUN_JSON, info)


# ---------------------------------------------------------------- measure


GROUP_SIZE = 16
"""Runs whose Hessian diagonals are computed together (`measure.group_runs`)."""


def group_diagonal_contexts(targets: list, names: list[str], cfg, device: torch.device,
                            force: bool) -> dict[Any, object]:
    """Contexts of the measure targets with their exact Hessian diagonals computed as groups.

    Targets that still need a curvature measure and are plain MLPs of one architecture with measurement
    sets of one shape share one batched computation (`flatbench.measures.group`), for `ce` and every
    configured loss; the results go into each context's cache under the key `curvature.diagonal_for`
    reads, so the measures use them as if computed alone. Other targets get no context here.
    """
    from flatbench.losses import get_loss
    from flatbench.measures.group import group_hessian_diagonals, mlp_linears
    from flatbench.measures.runner import build_context, pending_entries

    contexts = {}
    for target in targets:
        _, todo = pending_entries(target, names, cfg, force)
        if any(spec.cost == "hessian" for spec, _, _ in todo):
            try:
                contexts[target] = build_context(target, cfg, device)
            except FlatbenchError:
                continue  # measured alone, where the error is recorded
    groups: dict[tuple, list] = {}
    for target, ctx in contexts.items():
        try:
            shape = tuple((m.in_features, m.out_features, m.bias is not None) for m in mlp_linears(ctx.model))
        except ValueError:
            continue
        groups.setdefault((shape, tuple(ctx.inputs.shape)), []).append(target)
    for members in groups.values():
        if len(members) < 2:
            continue
        ctxs = [contexts[p] for p in members]
        inputs = torch.stack([c.inputs for c in ctxs])
        targets_ = torch.stack([c.targets for c in ctxs])
        for loss_name in dict.fromkeys(("ce", *cfg.losses)):
            try:
                results = group_hessian_diagonals([c.model for c in ctxs], inputs, targets_,
                                                  get_loss(loss_name, cfg.normalized_ce_tau), per_model_inputs=True,
                                                  max_memory_mb=cfg.max_memory_mb, chunk_size=cfg.chunk_size)
            except (RuntimeError, ValueError):  # e.g. out of memory: each run computes its own, as usual
                continue
            for ctx, result in zip(ctxs, results):
                ctx.cache[("hessian_diagonal", loss_name, cfg.normalized_ce_tau)] = result
    return contexts


@dataclass
class MeasureCounts:
    """What a measure pass did (for the CLI's last line and its exit code)."""

    measured: int = 0
    """Models (final or snapshot) measured or found complete."""
    not_trained: int = 0
    errors: int = 0
    """Measure entries that failed."""
    failed_runs: dict[str, str] = field(default_factory=dict)
    """Runs that could not be measured at all (corrupt or replaced model.pt, another config): the reason."""
    damaged_files: list[str] = field(default_factory=list)
    """measures.json files that were damaged (their readable entries were kept)."""

    def __getitem__(self, key: str) -> Any:  # the dict-style access older callers use
        return getattr(self, key)


def measure_study(study: Study, device: torch.device, *, names: list[str] | None = None, force: bool = False,
                  shard: tuple[int, int] | None = None, quiet: bool = False, echo: Echo = print,
                  run_ids: list[str] | None = None) -> MeasureCounts:
    """Compute the configured (or given) measures on every finished run of the study (of the shard, or of
    `run_ids`), and on the snapshots they kept when `measure.snapshots` is on.

    A run whose model cannot be used (corrupt, replaced, another config) gets its error recorded in every
    pending entry, and the pass goes on with the other runs; the caller exits non-zero at the end.
    """
    from flatbench.measures.runner import measure_run, measure_targets

    chosen = check_study(study, names)
    counts = MeasureCounts()
    targets = []
    for rid, cfg in shard_runs(study, shard):
        if run_ids is not None and rid not in run_ids:
            continue
        path = run_dir(study.exp_dir, rid)
        if not is_finished(path):
            counts.not_trained += 1
            continue
        targets.extend(measure_targets(path, snapshots=study.measure.snapshots))
    plan = {target: names_for(target, chosen, study, names) for target in targets}
    bar = _MeasureBar(plan, study.measure, force) if show_progress(quiet) else None
    use_groups = study.measure.group_runs == "on" or (study.measure.group_runs == "auto" and device.type == "cuda")
    step = GROUP_SIZE if use_groups else 1
    try:
        for start in range(0, len(targets), step):
            batch = targets[start:start + step]
            contexts = group_diagonal_contexts(batch, chosen, study.measure, device, force) if use_groups else {}
            for target in batch:
                t0 = time.perf_counter()
                report = measure_run(target, plan[target], study.measure, device, force=force,
                                     echo=None if quiet else (bar.write if bar else echo),
                                     ctx=contexts.pop(target, None), on_entry=bar.advance if bar else None)
                counts.measured += 1
                counts.errors += report.errors
                if report.damaged:
                    counts.damaged_files.append(report.damaged)
                if report.failure:
                    counts.failed_runs[target.label] = report.failure
                if quiet:
                    echo(f"{target.label}: {report.entries} measure entries ({time.perf_counter() - t0:.1f}s)"
                         + (f"; FAILED: {report.failure}" if report.failure else ""))
    finally:
        if bar is not None:
            bar.close()
    return counts


class _MeasureBar:
    """One progress bar over every (model, measure entry) still to compute; lines go above it."""

    def __init__(self, plan: dict, cfg: Any, force: bool):
        from tqdm.auto import tqdm

        from flatbench.measures.runner import pending_entries

        total = 0
        for target, names in plan.items():
            try:
                total += len(pending_entries(target, names, cfg, force)[1])
            except FlatbenchError:
                continue
        self.bar = tqdm(total=total, unit="measure", dynamic_ncols=True, leave=False, desc="measuring")

    def write(self, line: str) -> None:
        self.bar.write(line)

    def advance(self, label: str, key: str) -> None:
        self.bar.set_description_str(f"{label} {key}"[-60:])
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
