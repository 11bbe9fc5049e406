"""Run folders → one table, one row per run.

Every row carries the run's identity (`run_id`, `experiment`, `status`), every hyperparameter of its
resolved config as a dotted column (`data.random_label_ratio`, `model.widths` as "512x512", ...), the
final metrics and gaps, timings, and every value a measure wrote (headline keys such as
`hessian_trace@normalized_ce` and per-layer details such as `hessian_trace/layers.0.weight`), NaN where a
measure is missing, failed or does not apply. Unfinished runs are kept (with their status) so the report
can list them instead of silently dropping them.

Monte-Carlo measures report the standard error of their headline value as `info.stderr` in
measures.json; it becomes a column `<key>#se` (e.g. `adaptive_sharpness_avg@normalized_ce#se`) for every
headline key with a finite standard error on at least one run, NaN on the other runs. These columns are
not measures (never ranked, never in `measure_columns`); `stderr_columns` maps each key to its column.

The table remembers which columns are measures, which hold standard errors and which config fields the
study swept in `DataFrame.attrs`; all of it can also be recovered from the column names alone, so a
`table.csv` read back from disk works with the statistics too.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from flatbench import store
from flatbench.errors import FlatbenchError

RATIO_COLUMN = "data.random_label_ratio"
BASE_COLUMNS = ("run_id", "experiment", "status")
METRIC_COLUMNS = ("train_acc", "train_loss", "test_acc", "test_loss", "gap_acc", "gap_loss", "epochs",
                  "reached_target",
                  "train_seconds", "measure_seconds", "device")
CALIBRATION_COLUMNS = ("temperature", "train_loss_calibrated", "test_loss_calibrated", "gap_calibrated")
"""run.json's `calibration` (`training.calibration`): columns of a table only where some run records them, so
the tables of runs trained before flatbench recorded it keep their columns."""
FACT_COLUMNS = ("dataset.num_classes", "dataset.n_train", "dataset.n_test", "labels.scheme",
                "labels.ratio", "labels.n_corrupted", "labels.n_changed")
CONFIG_SECTIONS = ("seed", "data", "model", "train")
SE_SUFFIX = "#se"
"""`<key>#se` holds the Monte-Carlo standard error of headline value `<key>` ("#" never occurs in a key)."""
NON_MODEL_FIELDS = frozenset({"data.root", "data.download", "train.eval_batch_size"})
"""Config fields that do not change the trained model: never a reason to treat folders as different."""


@dataclass
class RunRecord:
    """One run folder as read from disk: what the table and the timing summary are built from."""

    experiment: str
    run_id: str
    path: Path
    info: dict[str, Any]
    measures: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    """Files that could not be read; reported instead of crashing the whole report."""

    @property
    def status(self) -> str:
        return str(self.info.get("status", "unknown"))


def to_float(value: Any) -> float:
    """A stored value as a float, NaN when it is none: the one number parser of the analysis.

    flatbench stores non-finite floats as the strings "nan", "inf", "-inf"; a boolean is never a number
    (JSON true is not 1.0); numpy scalars from a pandas row are numbers."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return math.nan
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return math.nan
    return math.nan


def _experiment_labels(exp_dirs: list[Path]) -> list[str]:
    """Folder names, made unique with their parents when two combined folders share a name."""
    labels = [p.name or str(p) for p in exp_dirs]
    if len(set(labels)) == len(labels):
        return labels
    out = []
    for path in exp_dirs:
        parts = path.resolve().parts
        out.append("/".join(parts[-2:]) if len(parts) >= 2 else str(path))
    if len(set(out)) != len(out):
        out = [str(p) for p in exp_dirs]
    return out


def load_records(exp_dirs: list[Path]) -> list[RunRecord]:
    """Read every run folder of every experiment; unreadable files become recorded problems."""
    exp_dirs = [Path(p) for p in exp_dirs]
    for path in exp_dirs:
        if not path.is_dir():
            raise FlatbenchError(f"experiment folder {path} does not exist; pass the folder that holds "
                                 f"'{store.RUNS_DIR}/' (e.g. results/<name>)")
    records: list[RunRecord] = []
    for exp, label in zip(exp_dirs, _experiment_labels(exp_dirs)):
        for run_path in store.list_run_dirs(exp):
            problems: list[str] = []
            try:
                info = store.load_run_info(run_path)  # its shape checked: damage is damage
            except FlatbenchError as exc:
                info = {"status": "unreadable"}
                problems.append(str(exc))
            measures, problem = read_measures_file(run_path / store.MEASURES_JSON)
            if problem:
                problems.append(problem)
            records.append(RunRecord(experiment=label, run_id=str(info.get("run_id", run_path.name)),
                                     path=run_path, info=info, measures=measures, problems=problems))
    return records


def read_measures_file(path: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """A measures.json's entries and, if it is damaged (unreadable, not an object, or an entry of the wrong
    shape: `store.measure_entry_problem`), what is wrong; no file is no entries and no problem."""
    if not path.is_file():
        return {}, None
    try:
        raw = store.read_json(path)
    except FlatbenchError as exc:
        return {}, str(exc)
    if not isinstance(raw, dict):
        return {}, f"{path} is damaged (a {type(raw).__name__}, not a JSON object)"
    bad = {str(k): why for k, why in ((k, store.measure_entry_problem(v)) for k, v in raw.items()) if why}
    if bad:
        key, why = next(iter(bad.items()))
        return {}, f"{path} is damaged ({len(bad)} entr{'y' if len(bad) == 1 else 'ies'} of the wrong shape, e.g. {key!r}: {why})"
    return {str(k): v for k, v in raw.items()}, None


def snapshot_records(records: list[RunRecord]) -> dict[float, list[RunRecord]]:
    """Per train-loss level, each run's snapshot at that level as a record of its own: the run's identity
    and config, the snapshot's accuracies, losses and gaps, and the snapshot's measures."""
    levels: dict[float, list[RunRecord]] = {}
    for rec in records:
        for snap in rec.info.get("snapshots") or []:
            folder = rec.path / str(snap.get("path", ""))
            measures, problem = read_measures_file(folder / store.MEASURES_JSON)
            problems = [problem] if problem else []
            info = {**{k: v for k, v in rec.info.items() if k not in ("snapshots", "history")},
                    **{k: snap.get(k) for k in ("train_acc", "train_loss", "test_acc", "test_loss", "gap_acc",
                                                "gap_loss", "calibration", "epoch")},
                    "epochs": snap.get("epoch")}
            levels.setdefault(float(snap["level"]), []).append(
                RunRecord(experiment=rec.experiment, run_id=rec.run_id, path=folder, info=info,
                          measures=measures, problems=problems))
    return dict(sorted(levels.items(), reverse=True))


@dataclass(frozen=True)
class ReportInputs:
    """What a report is built from, each read once (`report_inputs`): the runs (`records`) and their table,
    the snapshots' records per train-loss level (`snapshots`) and their tables (`level_tables`), the runs left
    out as not in the study (`stale`, listed as such) and the measures' descriptions (`measure_info`: name →
    an object with `description`, `cost`, `invariant_to`, e.g. the registry's specs; None: "not registered")."""

    records: list[RunRecord]
    table: pd.DataFrame
    snapshots: dict[float, list[RunRecord]]
    level_tables: dict[float, pd.DataFrame]
    stale: list[RunRecord] = field(default_factory=list)
    measure_info: dict[str, Any] | None = None


def report_inputs(exp_dirs: list[Path], records: list[RunRecord] | None = None,
                  snapshots: dict[float, list[RunRecord]] | None = None, stale: list[RunRecord] | None = None,
                  measure_info: dict[str, Any] | None = None) -> ReportInputs:
    """The report's inputs: the records (read from the folders when None; the report stage passes them
    checked and filtered), their snapshots (read from the runs when None) and the tables of both, built
    here once so that the statistics and the document read the same ones."""
    records = load_records(exp_dirs) if records is None else records
    snapshots = snapshot_records(records) if snapshots is None else snapshots
    return ReportInputs(records, build_table(exp_dirs, records=records), snapshots, level_tables(snapshots),
                        list(stale or []), measure_info)


def level_tables(snapshots: Mapping[float, list[RunRecord]]) -> dict[float, pd.DataFrame]:
    """The table of each snapshot level's records (`snapshot_records`)."""
    return {level: build_table([], records=recs) for level, recs in snapshots.items()}


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config → dotted keys; lists become "512x512" so that they group and print as one value."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            if value:
                out.update(flatten_config(value, name + "."))
            else:
                out[name] = ""
        elif isinstance(value, (list, tuple)):
            out[name] = "x".join(_format_scalar(v) for v in value)
        else:
            out[name] = value
    return out


def _format_scalar(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return "(" + "x".join(_format_scalar(v) for v in value) + ")"
    return str(value)


def _measure_values(entry: Mapping[str, Any]) -> dict[str, float]:
    values = entry.get("values")
    if not isinstance(values, Mapping):
        return {}
    return {str(k): to_float(v) for k, v in values.items()}


def _entry_stderr(name: str, entry: Mapping[str, Any],
                  values: Mapping[str, float]) -> tuple[str, float] | None:
    """(headline key, standard error) of a measures.json entry with a finite `info.stderr`, else None.

    The standard error belongs to the entry's headline value, whose key is the entry's key; an entry
    whose key is not among its values but that has exactly one headline value is read as that value's.
    """
    info = entry.get("info")
    if not isinstance(info, Mapping):
        return None
    se = to_float(info.get("stderr"))
    if not math.isfinite(se):
        return None
    if name in values:
        return name, se
    heads = [k for k in values if "/" not in k]
    return (heads[0], se) if len(heads) == 1 else None


def _is_config_column(col: str) -> bool:
    return col == "seed" or ("." in col and col.split(".", 1)[0] in CONFIG_SECTIONS[1:])


def _key_order(key: str) -> tuple[str, int, str]:
    """Headline keys first, each followed by its per-layer details."""
    head = key.split("/", 1)[0]
    return (head, int("/" in key), key)


def _config_order(col: str) -> tuple[int, str]:
    section = col.split(".", 1)[0]
    return (CONFIG_SECTIONS.index(section) if section in CONFIG_SECTIONS else len(CONFIG_SECTIONS), col)


def _run_facts(info: Mapping[str, Any]) -> dict[str, Any]:
    """The dataset and label-corruption facts run.json records (`dataset.n_train`, `labels.n_changed`, ...)."""
    out = {}
    for section, keys in (("dataset", ("num_classes", "n_train", "n_test")),
                          ("labels", ("scheme", "ratio", "n_corrupted", "n_changed"))):
        facts = info.get(section)
        if isinstance(facts, Mapping):
            out.update({f"{section}.{key}": facts[key] for key in keys if key in facts})
    return out


def build_table(exp_dirs: list[Path] | list[str], records: list[RunRecord] | None = None) -> pd.DataFrame:
    """One row per run of the given experiment folders (finished or not), measures as columns.

    `records` lets a caller that already loaded the folders (the report) avoid reading them twice.
    """
    if records is None:
        records = load_records([Path(p) for p in exp_dirs])
    rows: list[dict[str, Any]] = []
    config_cols: set[str] = set()
    measure_keys: set[str] = set()
    directions: dict[str, bool] = {}
    """Each headline key's direction, as its measures.json entry records it (larger = sharper?)."""
    se_keys: set[str] = set()
    for rec in records:
        info = rec.info
        row: dict[str, Any] = {"run_id": rec.run_id, "experiment": rec.experiment, "status": rec.status}
        config = info.get("config")
        if isinstance(config, Mapping):
            flat = flatten_config(config)
            config_cols.update(flat)
            row.update(flat)
        for col in ("train_acc", "train_loss", "test_acc", "test_loss", "gap_acc", "gap_loss"):
            row[col] = to_float(info.get(col))
        if math.isnan(row["gap_acc"]):
            row["gap_acc"] = row["train_acc"] - row["test_acc"]
        if math.isnan(row["gap_loss"]):
            row["gap_loss"] = row["test_loss"] - row["train_loss"]
        row["epochs"] = to_float(info.get("epochs"))
        row["reached_target"] = info.get("reached_target")
        row["train_seconds"] = to_float(info.get("seconds"))
        row["device"] = info.get("device")
        row.update(_run_facts(info))
        calibration = info.get("calibration")
        if isinstance(calibration, Mapping):
            row.update({col: to_float(calibration.get(col)) for col in CALIBRATION_COLUMNS})
        seconds = 0.0
        for name, entry in rec.measures.items():
            values = _measure_values(entry)
            row.update(values)
            measure_keys.update(values)
            se = _entry_stderr(name, entry, values)
            if se is not None:
                row[se[0] + SE_SUFFIX] = se[1]
                se_keys.add(se[0])
            if not any("/" not in k for k in values):
                # A measure that failed or does not apply still gets its (empty) column, so the ranking
                # shows it with n = 0 instead of leaving it out.
                measure_keys.add(name)
            if isinstance(entry.get("larger_is_sharper"), bool):
                for key in [*values, name]:
                    if "/" not in key:
                        directions[key] = entry["larger_is_sharper"]
            sec = to_float(entry.get("seconds"))
            if math.isfinite(sec):
                seconds += sec
        row["measure_seconds"] = seconds if rec.measures else math.nan
        rows.append(row)

    reserved = set(BASE_COLUMNS) | set(METRIC_COLUMNS) | set(CALIBRATION_COLUMNS) | set(FACT_COLUMNS)
    config_list = sorted(config_cols - reserved, key=_config_order)
    measure_list = sorted(measure_keys - reserved - set(config_list), key=_key_order)
    se_map = {key: key + SE_SUFFIX for key in sorted(se_keys, key=_key_order)}
    value_columns: list[str] = []
    for key in measure_list:  # each standard error right after its value
        value_columns.append(key)
        if key in se_map:
            value_columns.append(se_map[key])
    value_columns += [c for k, c in se_map.items() if k not in measure_keys]
    columns = [*BASE_COLUMNS, *config_list, *METRIC_COLUMNS,
               *[c for c in (*CALIBRATION_COLUMNS, *FACT_COLUMNS) if any(c in r for r in rows)], *value_columns]
    table = pd.DataFrame(rows, columns=columns)
    for col in value_columns:
        table[col] = pd.to_numeric(table[col], errors="coerce").astype(float)
    table.attrs["measure_columns"] = list(measure_list)
    table.attrs["directions"] = {k: v for k, v in directions.items() if k in measure_list}
    table.attrs["stderr_columns"] = dict(se_map)
    table.attrs["sweep_axes"] = _sweep_axes(records, table, config_list)
    return table


def _sweep_axes(records: list[RunRecord], table: pd.DataFrame, config_cols: list[str]) -> list[str]:
    """The hyperparameter axes of the study: what run.json says varied, plus `experiment` if needed.

    Folders that differ in something other than their own axes (dataset, model, epochs, ...) are
    different studies: `experiment` then becomes an axis so that granulated Kendall compares runs across
    folders only where everything else is equal.
    """
    axes: list[str] = []
    declared = False
    for rec in records:
        listed = rec.info.get("sweep_axes")
        if isinstance(listed, (list, tuple)):
            declared = True
            for axis in listed:
                if str(axis) in table.columns and str(axis) not in axes:
                    axes.append(str(axis))
    if not declared:
        return _infer_axes(table, config_cols)
    return _with_experiment_axis(table, config_cols, axes)


def _infer_axes(table: pd.DataFrame, config_cols: list[str]) -> list[str]:
    """Axes for a table without declared ones: model-relevant fields that vary within a folder."""
    axes: list[str] = []
    if len(table):
        for _, part in table.groupby("experiment", sort=False):
            for col in config_cols:
                if col not in NON_MODEL_FIELDS and col not in axes and _n_distinct(part[col]) > 1:
                    axes.append(col)
    return _with_experiment_axis(table, config_cols, axes)


def _with_experiment_axis(table: pd.DataFrame, config_cols: list[str], axes: list[str]) -> list[str]:
    """Add `experiment` when combined folders differ in a fixed (non-axis) field such as the dataset."""
    if len(table) == 0 or table["experiment"].nunique() < 2:
        return axes
    fixed = [c for c in config_cols if c not in axes and c not in NON_MODEL_FIELDS]
    per_exp = table.groupby("experiment", sort=False)
    if any(_n_distinct(table[c]) > 1 and per_exp[c].agg(_n_distinct).max() <= 1 for c in fixed):
        return [*axes, "experiment"]
    return axes


def _n_distinct(series: pd.Series) -> int:
    return int(series.astype(str).nunique(dropna=False))


def measure_columns(table: pd.DataFrame) -> list[str]:
    """Every measure value column (headline and per-layer), from attrs or else from the column names."""
    listed = table.attrs.get("measure_columns")
    if listed is not None:
        return [c for c in listed if c in table.columns]
    reserved = set(BASE_COLUMNS) | set(METRIC_COLUMNS) | set(CALIBRATION_COLUMNS) | set(FACT_COLUMNS)
    return [c for c in table.columns if c not in reserved and not _is_config_column(c)
            and not str(c).endswith(SE_SUFFIX)]


def headline_columns(table: pd.DataFrame) -> list[str]:
    """Measure keys that enter the statistics: `name` or `name@loss`, never a per-layer `a/b` detail
    nor a `<key>#se` standard error."""
    return [c for c in measure_columns(table) if "/" not in c and not str(c).endswith(SE_SUFFIX)]


def stderr_columns(table: pd.DataFrame) -> dict[str, str]:
    """Headline key → its standard-error column, from attrs or else from the `<key>#se` column names."""
    listed = table.attrs.get("stderr_columns")
    if isinstance(listed, Mapping):
        return {str(k): str(c) for k, c in listed.items() if c in table.columns}
    return {str(c)[:-len(SE_SUFFIX)]: str(c) for c in table.columns
            if str(c).endswith(SE_SUFFIX) and len(str(c)) > len(SE_SUFFIX)}


def sweep_axes(table: pd.DataFrame) -> list[str]:
    """The study's axes: from attrs, else every model-relevant config field (or folder) that varies."""
    listed = table.attrs.get("sweep_axes")
    if listed is not None:
        return [a for a in listed if a in table.columns]
    if "experiment" not in table.columns:
        return []
    return _infer_axes(table, [c for c in table.columns if _is_config_column(c)])
