"""A study as the stages see it: read from a config or an experiment folder, checked, sliced into shards.

`read_saved_study` is the one reader of an experiment's study.yaml. Everything a stage can check before it
works is checked here (`check_study`, `check_data`, `check_output_dir`), so that bad input is one line and
an exit code before any folder is created or any model trained.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml

from flatbench.config import Study, apply_overrides, did_you_mean, load_study, parse_study
from flatbench.errors import ConfigError, FlatbenchError
from flatbench.store import (STUDY_FILE, atomic_write_text, list_run_dirs)

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
