"""The stages of a study over all its runs: train, measure, report.

The CLI is a thin layer over these functions, and so are cluster jobs (a shard of a sweep is the same
call on a slice of the runs), so every path through flatbench trains and measures a run the same way.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
import yaml

from flatbench.config import Study, apply_overrides, load_study, parse_study
from flatbench.errors import ConfigError, FlatbenchError
from flatbench.store import STUDY_FILE, RunLocked, atomic_write_text, is_finished, run_dir

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


def save_study(study: Study) -> Path:
    """Write the resolved study config into the experiment folder, for `measure` and `report` to read."""
    path = study.exp_dir / STUDY_FILE
    raw = dict(study.raw)
    raw["name"] = study.name
    raw.pop("out", None)
    atomic_write_text(path, yaml.safe_dump(raw, sort_keys=False))
    return path


def study_from_target(target: str | Path, overrides: tuple[str, ...] = (), out: str | None = None) -> Study:
    """A study from a config file, or from an experiment folder's saved study.yaml."""
    target = Path(target)
    if target.is_dir():
        saved = target / STUDY_FILE
        if not saved.is_file():
            raise FlatbenchError(f"{target} is not a flatbench experiment folder (no {STUDY_FILE})")
        raw = yaml.safe_load(saved.read_text())
        raw = apply_overrides(raw, overrides)
        raw["name"] = target.name  # the folder may have been moved or renamed since
        return parse_study(raw, default_name=target.name, out=str(target.parent))
    return load_study(target, overrides, out=out)


def train_study(study: Study, device: torch.device, *, shard: tuple[int, int] | None = None,
                quiet: bool = False, echo: Echo = print, run_ids: list[str] | None = None) -> dict[str, list[str]]:
    """Train every unfinished run of the (shard of the) study; returns run ids by outcome.

    Runs that `train.vectorize` groups (see `flatbench.vectorized`) train at once, the others one after
    another; both write the same files. `run_ids` restricts the study to those runs (cluster tasks).
    """
    from flatbench.train import Preempted, train_run
    from flatbench.vectorized import plan_groups, train_group

    save_study(study)
    outcome: dict[str, list[str]] = {"trained": [], "skipped": [], "locked": [], "failed": []}
    runs = shard_runs(study, shard)
    if run_ids is not None:
        wanted = set(run_ids)
        runs = [(rid, cfg) for rid, cfg in runs if rid in wanted]
    pending = []
    for rid, cfg in runs:
        if is_finished(run_dir(study.exp_dir, rid)):
            outcome["skipped"].append(rid)
        else:
            pending.append((rid, cfg))
    done = len(outcome["skipped"])
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
                          progress=not quiet, echo=echo)
                outcome["trained"].append(rid)
            else:
                result = train_group(group, study.exp_dir, device, sweep_axes=study.sweep_axes,
                                     progress=not quiet, echo=echo)
                for key, values in result.items():
                    outcome[key].extend(values)
        except RunLocked as exc:
            echo(f"skipping {ids[0]}: {exc}")
            outcome["locked"].append(ids[0])
        except (FlatbenchError, Preempted):
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
    from flatbench.store import RUN_JSON, atomic_write_json, read_json

    info = read_json(path / RUN_JSON) if (path / RUN_JSON).is_file() else {"run_id": path.name}
    info.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    atomic_write_json(path / RUN_JSON, info)


GROUP_SIZE = 16
"""Runs whose Hessian diagonals are computed together (`measure.group_runs`)."""


def group_diagonal_contexts(paths: list[Path], names: list[str], cfg, device: torch.device,
                            force: bool) -> dict[Path, object]:
    """Contexts of the runs in `paths` with their exact Hessian diagonals computed as groups.

    Runs that still need a curvature measure and are plain MLPs of one architecture with measurement sets
    of one shape share one batched computation (`flatbench.measures.group`), for `ce` and every configured
    loss; the results go into each context's cache under the key `curvature.diagonal_for` reads, so the
    measures use them as if computed alone. Other runs get no context here and are measured as usual.
    """
    from flatbench.losses import get_loss
    from flatbench.measures.group import group_hessian_diagonals, mlp_linears
    from flatbench.measures.runner import build_context, pending_entries

    contexts = {}
    for path in paths:
        _, todo = pending_entries(path, names, cfg, force)
        if any(spec.cost == "hessian" for spec, _, _ in todo):
            contexts[path] = build_context(path, cfg, device)
    groups: dict[tuple, list[Path]] = {}
    for path, ctx in contexts.items():
        try:
            shape = tuple((m.in_features, m.out_features, m.bias is not None) for m in mlp_linears(ctx.model))
        except ValueError:
            continue
        groups.setdefault((shape, tuple(ctx.inputs.shape)), []).append(path)
    for members in groups.values():
        if len(members) < 2:
            continue
        ctxs = [contexts[p] for p in members]
        inputs = torch.stack([c.inputs for c in ctxs])
        targets = torch.stack([c.targets for c in ctxs])
        for loss_name in dict.fromkeys(("ce", *cfg.losses)):
            try:
                results = group_hessian_diagonals([c.model for c in ctxs], inputs, targets,
                                                  get_loss(loss_name, cfg.normalized_ce_tau), per_model_inputs=True,
                                                  max_memory_mb=cfg.max_memory_mb, chunk_size=cfg.chunk_size)
            except (RuntimeError, ValueError):  # e.g. out of memory: each run computes its own, as usual
                continue
            for ctx, result in zip(ctxs, results):
                ctx.cache[("hessian_diagonal", loss_name, cfg.normalized_ce_tau)] = result
    return contexts


def measure_study(study: Study, device: torch.device, *, names: list[str] | None = None, force: bool = False,
                  shard: tuple[int, int] | None = None, quiet: bool = False, echo: Echo = print,
                  run_ids: list[str] | None = None) -> dict:
    """Compute the configured (or given) measures on every finished run (of the shard, or of `run_ids`);
    returns counts."""
    from flatbench.measures.registry import resolve_names
    from flatbench.measures.runner import check_settings, measure_run

    chosen = resolve_names(names or list(study.measure.measures))
    check_settings(chosen, study.measure)
    counts = {"measured": 0, "not_trained": 0, "errors": 0}
    paths = []
    for rid, _cfg in shard_runs(study, shard):
        if run_ids is not None and rid not in run_ids:
            continue
        path = run_dir(study.exp_dir, rid)
        if not is_finished(path):
            counts["not_trained"] += 1
            continue
        paths.append(path)
    use_groups = study.measure.group_runs == "on" or (study.measure.group_runs == "auto" and device.type == "cuda")
    step = GROUP_SIZE if use_groups else 1
    for start in range(0, len(paths), step):
        batch = paths[start:start + step]
        contexts = group_diagonal_contexts(batch, chosen, study.measure, device, force) if use_groups else {}
        for path in batch:
            t0 = time.perf_counter()
            results = measure_run(path, chosen, study.measure, device, force=force,
                                  echo=None if quiet else echo, ctx=contexts.pop(path, None))
            counts["measured"] += 1
            counts["errors"] += sum(1 for r in results.values() if r.get("status") == "error")
            if quiet:
                echo(f"{path.name}: {len(results)} measure entries ({time.perf_counter() - t0:.1f}s)")
    return counts
