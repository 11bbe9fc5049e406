"""A study as the stages see it: read from a config or an experiment folder, checked, sliced into shards.

`read_saved_study` is the one reader of an experiment's study.yaml. Everything a stage can check before it
works is checked here (`check_study`, `check_data`, `check_output_dir`), so that bad input is one line and
an exit code before any folder is created or any model trained.
"""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from flatbench import strict_yaml
from flatbench.config import Study, apply_overrides, load_study, parse_study
from flatbench.data import check_dataset_name, dataset_root, load_raw
from flatbench.errors import ConfigError, FlatbenchError
from flatbench.losses import check_loss_name
from flatbench.measures.keys import loss_tag, loss_tag_clash
from flatbench.measures.plugin_import import is_file_spec
from flatbench.measures.registry import get_measure, load_plugins, resolve_names
from flatbench.measures.runner import check_settings
from flatbench.models import check_model_name
from flatbench.store import (STUDY_FILE, atomic_write_text, file_problem, list_run_dirs)



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
    atomic_write_text(path, study_text(study))
    return path


def study_text(study: Study) -> str:
    """The study.yaml of a study: its resolved config, named, without the output folder."""
    raw = dict(study.raw)
    raw["name"] = study.name
    raw.pop("out", None)
    return yaml.safe_dump(raw, sort_keys=False)


def read_saved_study(exp_dir: str | Path, overrides: tuple[str, ...] = ()) -> Study:
    """The study saved in an experiment folder (its study.yaml), named after the folder wherever it is."""
    exp_dir = Path(exp_dir)
    if not exp_dir.exists():
        raise FlatbenchError(f"experiment folder {exp_dir} does not exist")
    saved = exp_dir / STUDY_FILE
    fix = "restore it or re-run `flatbench train` with the study's config"
    problem = file_problem(saved)
    if problem:
        raise FlatbenchError(f"{saved} is damaged ({problem}); {fix}")
    if not saved.is_file():
        hint = " (it is a file)" if exp_dir.is_file() else ""
        raise FlatbenchError(f"{exp_dir} is not a flatbench experiment folder{hint}: no {STUDY_FILE} in it")
    try:
        raw = strict_yaml.load(saved.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise FlatbenchError(f"{saved} is damaged (not UTF-8 text at byte {exc.start}); {fix}") from None
    except RecursionError:
        raise FlatbenchError(f"{saved} is damaged (not valid YAML); {fix}") from None
    except yaml.YAMLError as exc:
        raise FlatbenchError(f"{saved} is damaged (not valid YAML{strict_yaml.describe(exc)}); {fix}") from None
    if raw is None or raw == {}:
        raise FlatbenchError(f"{saved} is damaged (empty); {fix}")
    if not isinstance(raw, dict):
        raise FlatbenchError(f"{saved} is damaged (a {type(raw).__name__}, not a mapping of sections); {fix}")
    raw["name"] = exp_dir.name  # the folder may have been moved or renamed since
    try:
        saved_study = parse_study(raw, default_name=exp_dir.name, out=str(exp_dir.parent))
    except ConfigError as exc:
        raise FlatbenchError(f"{saved} is damaged ({exc}); {fix}") from None
    if not overrides:
        return saved_study
    raw = apply_overrides(raw, overrides)
    raw["name"] = exp_dir.name
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
    for _, run in study.runs:
        check_dataset_name(run.data.dataset)
        check_model_name(run.model.name)
        if run.model.kwargs and ":" not in run.model.name:
            raise ConfigError(f"model.kwargs is for a model factory (file.py:function or pkg.module:function); "
                              f"'{run.model.name}' is built in (its settings are model.widths, model.depth, ...)")
    for loss in study.measure.losses:
        check_loss_name(loss)
    clash = loss_tag_clash(study.measure.losses)
    if clash:
        raise ConfigError(f"measure.losses: {clash[0]} and {clash[1]} would share their results' keys "
                          f"(@{loss_tag(clash[0])}: a loss of one's own is keyed by its function's name); rename "
                          "one of the functions")
    _check_measurement_size(study)
    _check_setting_types(study.measure.settings)
    load_plugins(study.measure.plugins)  # the registry's checks last: what is read of the study is read above
    names = resolve_names(list(study.measure.measures))
    if study.measure.snapshot_measures is not None:
        resolve_names(list(study.measure.snapshot_measures))
    check_settings(names, study.measure)
    return resolve_names(measures) if measures else names


def _check_measurement_size(study: Study) -> None:
    """`measure.n_examples` above a run's `data.n_train` is refused, not silently capped (a dataset's own
    size, where n_train is null, is checked by `check_data` when the data are read)."""
    for _, run in study.runs:
        if run.data.n_train is not None:
            _refuse_more_examples_than(study.measure.n_examples, run.data.n_train, run)


def _refuse_more_examples_than(n_examples: int | None, n_train: int, run: Any) -> None:
    """The one rule: at most as many measurement examples as the run has training examples."""
    if n_examples is not None and n_examples > n_train:
        raise ConfigError(f"measure.n_examples={n_examples} is more than the {n_train} training examples of "
                          f"run {run.run_id()}; give at most {n_train} (or null: all of them)")


def with_plugins(study: Study, plugins: tuple[str, ...] | list[str]) -> Study:
    """The study with `plugins` (`--plugin`) added to its `measure.plugins`, in its config too (so that the
    saved study.yaml, worker processes and cluster tasks load them)."""
    if not plugins:
        return study
    given = [str(Path(p).expanduser().resolve()) if is_file_spec(p) and Path(p).expanduser().is_file() else p
             for p in plugins]  # absolute: the saved study is read from anywhere
    merged = tuple(dict.fromkeys((*study.measure.plugins, *given)))
    raw = dict(study.raw)
    raw["measure"] = {**(raw.get("measure") or {}), "plugins": list(merged)}
    return replace(study, measure=replace(study.measure, plugins=merged), raw=raw)


MAX_COUNT = 10**7
"""The largest integer measure setting (iterations, probes, samples, steps, batch sizes): above it a value is
a typo or a unit slip, and the measure would run for days."""


def _check_setting_types(settings: dict) -> None:
    """Each value of `measure.settings` has the type of the measure's default (a finite number where the
    default is a number), so that a bad value is one line before any work, not an error entry per model."""
    for name, given in settings.items():
        defaults = get_measure(name).defaults
        for key, value in given.items():
            default = defaults.get(key)
            where = f"measure.settings.{name}.{key}"
            if isinstance(default, bool) or default is None:
                if isinstance(default, bool) and not isinstance(value, bool):
                    raise ConfigError(f"{where}: expected true or false, got {value!r}")
            elif isinstance(default, (int, float)):
                try:
                    number = float(value) if not isinstance(value, bool) else math.nan
                except (TypeError, ValueError, OverflowError):
                    number = math.nan
                if not math.isfinite(number):
                    raise ConfigError(f"{where}: expected a finite number, got {value!r}")
                if isinstance(default, int) and not number.is_integer():
                    raise ConfigError(f"{where}: expected an integer, got {value!r}")
                if isinstance(default, int) and number > MAX_COUNT:
                    raise ConfigError(f"{where} must be at most {MAX_COUNT:,}, got {value!r}")
                if isinstance(default, int) and default >= 1 and number < 1:
                    raise ConfigError(f"{where} must be at least 1, got {value!r}")
                if isinstance(default, float) and default > 0 and not number > 0 and "decay" not in key:
                    raise ConfigError(f"{where} must be positive, got {value!r}")
                if number < 0:
                    raise ConfigError(f"{where} must be non-negative, got {value!r}")
            elif isinstance(default, str) and not isinstance(value, str):
                raise ConfigError(f"{where}: expected a string, got {value!r}")


def check_data(study: Study, runs: list[tuple[str, Any]] | None = None) -> None:
    """Read every dataset the runs of the study (or `runs`) need, so a missing one is an error before
    anything is created (`check_runs_data`)."""
    check_runs_data(list(runs if runs is not None else study.runs), study.measure.n_examples)


def check_runs_data(runs: list[tuple[str, Any]], n_examples: int | None) -> None:
    """Read every dataset the runs need (once per process), so a missing one is an error before anything
    is created; each run must have the examples it asks for and the `n_examples` it is measured on."""
    seen: dict[tuple, Any] = {}
    for _, run in runs:
        key = (run.data.dataset, run.data.root, run.data.download)
        if key not in seen:
            seen[key] = load_raw(run.data.dataset, dataset_root(run.data.root), run.data.download)
        raw = seen[key]
        if raw.y_train.is_floating_point():
            raise ConfigError(f"dataset '{run.data.dataset}' has floating-point (regression) targets: a study trains "
                              "classifiers (cross-entropy, accuracy, the generalization gap); measure a regression "
                              "model with `flatbench measure-model ... --loss mse` or flatbench.measure(..., "
                              "loss='mse')")
        _refuse_an_empty_split(run.data.dataset, len(raw.y_train), len(raw.y_test))
        sizes = {"data.n_train": (run.data.n_train, len(raw.y_train), "training"),
                 "data.n_test": (run.data.n_test, len(raw.y_test), "test")}
        for where, (asked, available, which) in sizes.items():
            if asked is not None and asked > available:
                raise ConfigError(f"{where}={asked} is more than the {available} {which} examples of "
                                  f"'{run.data.dataset}'; give at most {available} (or null: all of them)")
        n_train = run.data.n_train if run.data.n_train is not None else len(raw.y_train)
        _refuse_more_examples_than(n_examples, n_train, run)


def _refuse_an_empty_split(dataset: str, n_train: int, n_test: int) -> None:
    """A dataset without training or test examples is refused before training: with no test examples the
    test accuracy and so the generalization gap are undefined (never a test accuracy of 0)."""
    for count, which in ((n_train, "training"), (n_test, "test")):
        if count == 0:
            raise ConfigError(f"dataset '{dataset}' has 0 {which} examples: the generalization gap (train minus "
                              f"test accuracy) is undefined; give a dataset with both splits")


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
