"""Study configs: YAML → validated frozen dataclasses (`flatbench.config.schema`), `key=value` overrides,
sweep expansion.

A study config has the sections `data`, `model`, `train` (what a run is), `measure` and `report` (what is
done with the trained runs), plus `name`, `seed` and `out`. Any field of `seed`, `data`, `model` and
`train` may be given as a list: the study is the cartesian product of all such lists, one run each.
A field whose value is itself a list (`model.widths`) is swept with a list of lists.
`data.random_label_ratio` also accepts `{uniform: N}`: N ratios drawn uniformly in [0, 1] from the study's
(first) seed, as Tsuzuku et al. draw one ratio per model.
A `sample` section draws n configurations as a Latin hypercube (`flatbench.config.sample`), crossed with
the seeds and the grid lists like one more axis.
"""

from __future__ import annotations

import copy
import itertools
import math
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import yaml

from flatbench import strict_yaml
from flatbench.config.sample import check_axes, draw, parse_sample, resolve_hidden
from flatbench.config.schema import (EXECUTION_ONLY_KEYS, SECTIONS, TOP_LEVEL, DataConfig, MeasureConfig,
                                     ModelConfig, ReportConfig, RunConfig, Study, TrainConfig,
                                     snapshot_folder_name)
from flatbench.errors import ConfigError, did_you_mean
from flatbench.seeding import make_generator
from flatbench.store import gap_column

# ---------------------------------------------------------------- type checking


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`, converting YAML-isms (ints for floats, '1e-3')."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: expected {type_name(tp)}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected {type_name(tp)}, got {value!r}")
        return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                raise ConfigError(f"{where}: expected a finite number, got {value!r}") from None
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            if "\x00" in value:
                raise ConfigError(f"{where}: a NUL byte is not allowed in {value!r}")
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if tp is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    raise ConfigError(f"{where}: unsupported type {tp}")


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _is_list_typed(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple


def _check_keys(section: str, given: dict, cls: type) -> None:
    valid = [f.name for f in fields(cls)]
    for key in given:
        if key not in valid:
            raise ConfigError(f"unknown key '{section}.{key}'{did_you_mean(key, valid)} (valid keys in "
                              f"'{section}': {', '.join(valid)})")


# ---------------------------------------------------------------- loading


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = strict_yaml.load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start:exc.start + 1]!r}): "
                          "a study config is a YAML text file") from None
    except RecursionError:
        raise ConfigError(f"invalid YAML in {path}: nested too deeply") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}{strict_yaml.describe(exc)}") from None
    if raw is None or raw == {}:
        raise ConfigError(f"{path} is empty: a study config needs at least one section (data, model, "
                          "train, measure, report); see configs/quickstart.yaml")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of sections, got {type(raw).__name__}")
    return raw


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply `section.key=value` overrides (value parsed as YAML) to a raw config dict."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.epochs=5)")
        key, text = item.split("=", 1)
        key = key.strip()
        try:
            value = strict_yaml.load(text) if text.strip() else None
        except (yaml.YAMLError, RecursionError):
            raise ConfigError(f"override '{item}': the value is not valid YAML") from None
        parts = key.split(".")
        if parts[:2] == ["sample", "axes"] and len(parts) > 3:  # an axis name is itself dotted: train.lr
            parts = [*parts[:2], ".".join(parts[2:4]), *parts[4:]]
        if parts[0] not in TOP_LEVEL:
            raise ConfigError(f"unknown key '{parts[0]}' in override '{item}'{did_you_mean(parts[0], TOP_LEVEL)}"
                              f" (valid top-level keys: {', '.join(TOP_LEVEL)})")
        if len(parts) >= 2 and parts[0] in SECTIONS:
            _check_keys(parts[0], {parts[1]: None}, SECTIONS[parts[0]])
        node = raw
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return raw


MAX_UNIFORM_RATIOS = 100_000
"""The most ratios `data.random_label_ratio: {uniform: N}` may draw."""


def _check_text(node: Any, where: str = "") -> None:
    """No NUL byte in any key or text of a config: it cannot be part of a file name and is never meant."""
    if isinstance(node, str):
        if "\x00" in node:
            raise ConfigError(f"{where or 'config'}: a NUL byte is not allowed in {node!r}")
    elif isinstance(node, dict):
        for key, value in node.items():
            inner = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and "\x00" in key:
                raise ConfigError(f"a NUL byte is not allowed in the key {inner!r}")
            _check_text(value, inner)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _check_text(value, f"{where}[{i}]")


def _ratio_values(value: Any, seeds: list[int]) -> list[float]:
    """`random_label_ratio` as a list of ratios: a number, a list, or `{uniform: N}`."""
    where = "data.random_label_ratio"
    if isinstance(value, dict):
        if set(value) != {"uniform"}:
            raise ConfigError(f"{where}: a mapping must be {{uniform: N}}, got {value!r}")
        n = _coerce(value["uniform"], int, f"{where}.uniform")
        if not 1 <= n <= MAX_UNIFORM_RATIOS:
            raise ConfigError(f"{where}.uniform must be in [1, {MAX_UNIFORM_RATIOS}], got {n}")
        gen = make_generator("random_label_ratio", "uniform", seeds[0])
        draws = torch.rand(n, generator=gen, dtype=torch.float64)
        return [round(float(r), 4) for r in draws]
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ConfigError(f"{where}: an empty list sweeps over nothing")
    out = [_coerce(v, float, where) for v in values]
    for r in out:
        if not 0.0 <= r <= 1.0:
            raise ConfigError(f"{where} must be in [0, 1], got {r}")
    return out


def _axis_values(section: str, key: str, value: Any, tp: Any) -> list[Any]:
    """The list of values a sweepable field takes (a one-element list when it is not swept)."""
    where = f"{section}.{key}" if section else key
    if _is_list_typed(tp):
        swept = isinstance(value, list) and value and all(isinstance(v, list) for v in value)
        values = value if swept else [value]
    else:
        values = value if isinstance(value, list) else [value]
    if not values:
        raise ConfigError(f"{where}: an empty list sweeps over nothing")
    return [_coerce(v, tp, where) for v in values]


def parse_vectorize(value: Any) -> int | str:
    """`train.vectorize` in its one typed form: "auto", "off" or a group size N ≥ 1 (an int).

    YAML reads a bare `off` as false (and `on` as true), so booleans are accepted as off / auto; "8" is 8.
    """
    where = "train.vectorize"
    if isinstance(value, bool):
        return "auto" if value else "off"
    if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value >= 1:
        return value
    raise ConfigError(f"{where} must be auto, off or a group size N ≥ 1, got {value!r}")


def _validate_choices(run: RunConfig) -> None:
    """Values and ranges of one run's fields. Dataset and model names are checked where runs are built
    (`flatbench.study.check_study`), which knows the registries; this module imports neither."""
    choices = {"data.random_label_scheme": (run.data.random_label_scheme, ("uniform", "shuffle", "wrong")),
               "train.optimizer": (run.train.optimizer, ("adam", "sgd")),
               "train.schedule": (run.train.schedule, ("none", "cosine", "step", "inverse_time")),
               "train.precision": (run.train.precision, ("fp32", "bf16"))}
    for where, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{where}: unknown value '{value}'{did_you_mean(value, allowed)} (choose one of: "
                              f"{', '.join(allowed)})")
    positive = {"train.lr": run.train.lr, "train.batch_size": run.train.batch_size,
                "train.epochs": run.train.epochs, "train.eval_batch_size": run.train.eval_batch_size,
                "train.eval_every": run.train.eval_every, "train.workers": run.train.workers,
                "train.checkpoint_every": run.train.checkpoint_every}
    for where, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{where} must be positive, got {value}")
    _check_upper_bounds(run)
    for where, value in {"data.n_train": run.data.n_train, "data.n_test": run.data.n_test}.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{where} must be positive, got {value}")
    for where, value in {"train.weight_decay": run.train.weight_decay, "train.lr_decay": run.train.lr_decay,
                         "model.dropout": run.model.dropout}.items():
        if value < 0:
            raise ConfigError(f"{where} must be non-negative, got {value}")
    for where, value in {"train.step_size": run.train.step_size, "train.gamma": run.train.gamma,
                         "model.width": run.model.width, "model.depth": run.model.depth}.items():
        if not value > 0:
            raise ConfigError(f"{where} must be positive, got {value}")
    if run.train.test_every < 0:
        raise ConfigError(f"train.test_every must be 0 (at every evaluation) or a positive number of epochs, got "
                          f"{run.train.test_every}")
    if run.train.momentum < 0:
        raise ConfigError(f"train.momentum must be non-negative, got {run.train.momentum}")
    if not run.train.lazy_eval >= 0:
        raise ConfigError(f"train.lazy_eval must be 0 (off) or a positive factor, got {run.train.lazy_eval}")
    if run.model.dropout >= 1:
        raise ConfigError(f"model.dropout must be below 1, got {run.model.dropout}")
    if any(w <= 0 for w in run.model.widths):
        raise ConfigError(f"model.widths must be positive integers, got {list(run.model.widths)}")
    if run.model.name == "wrn" and ((run.model.depth - 4) % 6 or run.model.depth < 10):
        raise ConfigError(f"model.depth for wrn must be 6k+4 (10, 16, 22, 28, ...), got {run.model.depth}")
    if run.train.target_train_acc is not None and not 0 < run.train.target_train_acc <= 1:
        raise ConfigError(f"train.target_train_acc must be in (0, 1], got {run.train.target_train_acc}")
    if run.train.target_train_loss is not None and not run.train.target_train_loss > 0:
        raise ConfigError(f"train.target_train_loss must be positive, got {run.train.target_train_loss}")
    _validate_endpoint(run.train)
    for level in run.train.snapshot_losses:
        if not level > 0:
            raise ConfigError(f"train.snapshot_losses must be positive losses, got {level}")
    if len(set(run.train.snapshot_losses)) != len(run.train.snapshot_losses):
        raise ConfigError(f"train.snapshot_losses lists a level twice: {list(run.train.snapshot_losses)}")
    folders: dict[str, float] = {}
    for level in run.train.snapshot_losses:
        folder = snapshot_folder_name(level)
        if folder in folders:
            raise ConfigError(f"train.snapshot_losses: {folders[folder]!r} and {level!r} would share the snapshot "
                              f"folder {folder} (levels must differ in their first 6 significant digits)")
        folders[folder] = level


def _validate_endpoint(train: TrainConfig) -> None:
    """The step-level endpoint's settings: a tolerance in (0, 1) on a loss target, and its other settings only
    with it (they would change the run's id and do nothing)."""
    if train.endpoint_tolerance is None:
        for key, default in (("endpoint_check_steps", 1), ("endpoint_scale_step", True)):
            if getattr(train, key) != default:
                raise ConfigError(f"train.{key} has no effect without train.endpoint_tolerance (e.g. 0.05)")
        return
    if not 0 < train.endpoint_tolerance < 1:
        raise ConfigError(f"train.endpoint_tolerance must be in (0, 1) (0.05: within 5% below the target), got "
                          f"{train.endpoint_tolerance}")
    if train.target_train_loss is None:
        raise ConfigError("train.endpoint_tolerance needs train.target_train_loss: the tolerance is a band below "
                          "the loss target")
    if train.target_train_acc is not None:
        raise ConfigError("train.endpoint_tolerance applies to train.target_train_loss alone: with "
                          "train.target_train_acc a run could stop at the accuracy, outside the band")
    if train.endpoint_check_steps < 1:
        raise ConfigError(f"train.endpoint_check_steps must be at least 1, got {train.endpoint_check_steps}")


UPPER_BOUNDS = {"train.epochs": 100_000, "train.batch_size": 10**7, "train.eval_batch_size": 10**7,
                "train.eval_every": 100_000, "train.test_every": 100_000, "train.workers": 1024,
                "train.endpoint_check_steps": 10**7,
                "train.step_size": 100_000,
                "model.width": 10**6, "model.depth": 10_000, "data.n_train": 10**9, "data.n_test": 10**9,
                "measure.n_examples": 10**9, "measure.chunk_size": 10**9, "measure.max_memory_mb": 10**8,
                "measure.workers": 1024}
"""Sane upper bounds of sizes and counts: a value above is a typo or a unit slip (`train.epochs=10**30`),
refused in one line instead of running for ever."""


def _refuse_above(where: str, value: Any) -> None:
    if value is not None and value > UPPER_BOUNDS[where]:
        raise ConfigError(f"{where} must be at most {UPPER_BOUNDS[where]:,}, got {value}")


def _check_upper_bounds(run: RunConfig) -> None:
    """Every bounded field of a run's config (`UPPER_BOUNDS`) within its bound."""
    for where in UPPER_BOUNDS:
        section, key = where.split(".")
        if section != "measure":
            _refuse_above(where, getattr(getattr(run, section), key))
    for w in run.model.widths:
        if w > UPPER_BOUNDS["model.width"]:
            raise ConfigError(f"model.widths must be at most {UPPER_BOUNDS['model.width']:,} each, got {w}")


def _validate_report(cfg: ReportConfig) -> None:
    gap_column(cfg.gap, "report.gap")
    if not 0.0 <= cfg.min_train_acc <= 1.0:
        raise ConfigError(f"report.min_train_acc must be in [0, 1], got {cfg.min_train_acc}")
    if not cfg.max_train_loss > 0:
        raise ConfigError(f"report.max_train_loss must be positive, got {cfg.max_train_loss}")
    if not cfg.max_loss_span >= 1:
        raise ConfigError(f"report.max_loss_span must be at least 1, got {cfg.max_loss_span}")


MAX_TIMEOUT_S = 7 * 24 * 3600
"""The longest `measure.timeout_s`: a week for one measure entry."""


def _validate_measure(cfg: MeasureConfig) -> None:
    builtin = ("ce", "normalized_ce", "mse")
    for loss in cfg.losses:
        if loss not in builtin and not (":" in loss and not loss.startswith(":") and not loss.endswith(":")):
            raise ConfigError(f"measure.losses: unknown loss '{loss}'{did_you_mean(loss, builtin)} (choose from: "
                              f"{', '.join(builtin)}, or a function file.py:function / pkg.module:function)")
    if not cfg.losses:
        raise ConfigError("measure.losses must name at least one loss (ce, normalized_ce, mse)")
    if cfg.dtype not in ("auto", "float64", "float32"):
        raise ConfigError(f"measure.dtype must be auto, float64 or float32, got '{cfg.dtype}'")
    if cfg.hvp_mode not in ("auto", "rev_fwd", "fwd_rev", "double_backward"):
        raise ConfigError(f"measure.hvp_mode must be auto, rev_fwd, fwd_rev or double_backward, got '{cfg.hvp_mode}'")
    if cfg.group_runs not in ("auto", "on", "off"):
        raise ConfigError(f"measure.group_runs must be auto, on or off, got '{cfg.group_runs}'")
    if cfg.workers < 1:
        raise ConfigError(f"measure.workers must be at least 1, got {cfg.workers}")
    if cfg.n_examples is not None and cfg.n_examples <= 0:
        raise ConfigError(f"measure.n_examples must be positive, got {cfg.n_examples}")
    if cfg.normalized_ce_tau <= 0:
        raise ConfigError(f"measure.normalized_ce_tau must be positive, got {cfg.normalized_ce_tau}")
    if not cfg.measures:
        raise ConfigError("measure.measures must name at least one measure (or all)")
    if cfg.chunk_size <= 0 or cfg.max_memory_mb <= 0:
        raise ConfigError(f"measure.chunk_size and measure.max_memory_mb must be positive, got {cfg.chunk_size} "
                          f"and {cfg.max_memory_mb}")
    for key in ("n_examples", "chunk_size", "max_memory_mb", "workers"):
        _refuse_above(f"measure.{key}", getattr(cfg, key))
    if not 0 < cfg.timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(f"measure.timeout_s must be in (0, {MAX_TIMEOUT_S}] seconds, got {cfg.timeout_s!r}")
    for name, settings in cfg.settings.items():
        if not isinstance(settings, dict):
            raise ConfigError(f"measure.settings.{name} must be a mapping of setting: value")
        for key, value in settings.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"measure.settings.{name}.{key}: expected a finite number, got {value!r}")


def sampled_cells(raw: dict) -> list[tuple[int | None, dict[str, Any]]]:
    """The configurations of the config's `sample` section (`flatbench.config.sample`) as (cell index,
    {"section.key": value}) pairs, the values checked against the fields' types; [(None, {})] without one."""
    if "sample" not in raw:
        return [(None, {})]
    spec = parse_sample(raw["sample"])
    kinds = {f"{s}.{k}": t for s in ("data", "model", "train") for k, t in field_types(SECTIONS[s]).items()}
    check_axes(spec, raw, kinds, EXECUTION_ONLY_KEYS)
    widths = (raw.get("model") or {}).get("widths") or list(ModelConfig().widths)
    cells: list[tuple[int | None, dict[str, Any]]] = []
    first: dict[str, int] = {}
    for i, cell in enumerate(draw(spec)):
        values = {k: _coerce(v, kinds[k], f"sample.axes.{k}") for k, v in resolve_hidden(cell, widths).items()}
        key = repr(sorted(values.items()))
        if key in first:
            raise ConfigError(f"sample: cells {first[key]} and {i} drew the same values ({values}): n = {spec.n} is "
                              "more configurations than the axes' choices give; lower n or add a range axis")
        first[key] = i
        cells.append((i, values))
    return cells


def _expand(axes: list[tuple[str, str, list[Any]]],
            cells: list[tuple[int | None, dict[str, Any]]]) -> list[tuple[str, RunConfig]]:
    """The runs of a study: the sampled cells crossed with the cartesian product of the grid axes (a cell's
    values win over a one-value grid axis of the same field, `model.widths` under `model.hidden_depth`)."""
    runs: list[tuple[str, RunConfig]] = []
    seen: dict[str, RunConfig] = {}
    for combo in itertools.product(*(values for _, _, values in axes)):
        for cell_index, cell in cells:
            per_section: dict[str, dict] = {"data": {}, "model": {}, "train": {}}
            seed = 0
            for (section, key, _), value in zip(axes, combo):
                if section:
                    per_section[section][key] = value
                else:
                    seed = value
            for name, value in cell.items():
                section, key = name.split(".", 1)
                per_section[section][key] = value
            run = RunConfig(seed=seed, data=DataConfig(**per_section["data"]),
                            model=ModelConfig(**per_section["model"]), train=TrainConfig(**per_section["train"]),
                            sample_cell=cell_index)
            _validate_choices(run)
            rid = run.run_id()
            if rid in seen:
                if seen[rid].identity() == run.identity():
                    continue  # the same run twice (e.g. {uniform: N} drew one ratio twice at 4 decimals)
                raise ConfigError(f"two runs of the sweep would share the id '{rid}'")
            seen[rid] = run
            runs.append((rid, run))
    if not runs:
        raise ConfigError("the sweep has no runs")
    return runs


def parse_study(raw: dict, default_name: str = "study", out: str | None = None, source: str | None = None) -> Study:
    """Validate a raw config dict and expand its sweep into runs. `source`: the file it was read from, named
    where the file itself has the wrong shape."""
    for key in raw:
        if key not in TOP_LEVEL:
            raise ConfigError(f"unknown key '{key}'{did_you_mean(key, TOP_LEVEL)} (valid top-level keys: "
                              f"{', '.join(TOP_LEVEL)})")
    for section, cls in SECTIONS.items():
        value = raw.get(section, {}) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"{source + ': ' if source else ''}'{section}' must be a mapping of keys (valid keys: "
                              f"{', '.join(f.name for f in fields(cls))}), got {value!r}")
        _check_keys(section, value, cls)

    _check_text(raw)
    name = _coerce(raw.get("name", default_name), str, "name")
    if not name.strip() or "/" in name or "\\" in name or name.strip() in (".", ".."):
        raise ConfigError(f"name must be a plain folder name (no '/', not '.' or '..'), got {name!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ConfigError(f"name must be a plain folder name without control characters (a newline, a tab ...), "
                          f"got {name!r}")
    out_dir = out or _coerce(raw.get("out", "results"), str, "out")
    if not out_dir:
        raise ConfigError("out must be a folder, got ''")

    seeds = _axis_values("", "seed", raw.get("seed", 0), int)
    axes: list[tuple[str, str, list[Any]]] = [("", "seed", seeds)]
    for section in ("data", "model", "train"):
        cls = SECTIONS[section]
        given = raw.get(section) or {}
        types = field_types(cls)
        for key, value in given.items():
            if section == "data" and key == "random_label_ratio":
                values = _ratio_values(value, seeds)
            elif section == "train" and key == "vectorize":
                values = [parse_vectorize(v) for v in (value if isinstance(value, list) else [value])]
                if not values:
                    raise ConfigError("train.vectorize: an empty list sweeps over nothing")
            else:
                values = _axis_values(section, key, value, types[key])
            axes.append((section, key, values))

    cells = sampled_cells(raw)
    swept = tuple(f"{s}.{k}" if s else k for s, k, v in axes if len(v) > 1)
    swept += tuple(k for k in cells[0][1] if len(cells) > 1 and k not in swept)
    runs = _expand(axes, cells)

    mraw = dict(raw.get("measure") or {})
    mtypes = field_types(MeasureConfig)
    for key in ("measures", "losses", "snapshot_measures", "plugins"):
        if isinstance(mraw.get(key), str):
            mraw[key] = [mraw[key]]
    measure = MeasureConfig(**{k: _coerce(v, mtypes[k], f"measure.{k}") for k, v in mraw.items()})
    _validate_measure(measure)
    rraw = raw.get("report") or {}
    rtypes = field_types(ReportConfig)
    report = ReportConfig(**{k: _coerce(v, rtypes[k], f"report.{k}") for k, v in rraw.items()})
    _validate_report(report)
    return Study(name=name, out=out_dir, runs=tuple(runs), measure=measure, report=report,
                 sweep_axes=swept, raw=raw)


def load_study(path: str | Path, overrides: list[str] | tuple[str, ...] = (), out: str | None = None) -> Study:
    """Read, override, validate and expand a study config file. A plugin file in `measure.plugins` that is
    not where flatbench runs but beside the config is taken from there (as an absolute path)."""
    raw = apply_overrides(load_yaml(path), overrides)
    measure = raw.get("measure")
    if isinstance(measure, dict) and isinstance(measure.get("plugins"), list):
        here = Path(path).resolve().parent
        measure["plugins"] = [str(here / p) if isinstance(p, str) and p.endswith(".py") and not Path(p).is_absolute()
                              and not Path(p).is_file() and (here / p).is_file() else p for p in measure["plugins"]]
    return parse_study(raw, default_name=Path(path).stem, out=out, source=str(path))


def run_config_from_dict(d: dict) -> RunConfig:
    """Rebuild a RunConfig from the `config` stored in run.json (or a model file); a config of the wrong
    shape is a one-line `ConfigError`."""
    if not isinstance(d, dict):
        raise ConfigError(f"the stored config is not a mapping (got {type(d).__name__})")

    def build(section: str, cls: type) -> Any:
        values = d.get(section, {})
        if not isinstance(values, dict):
            raise ConfigError(f"the stored config's '{section}' is not a mapping (got {type(values).__name__})")
        types = field_types(cls)
        values = dict(values)
        if cls is TrainConfig and "vectorize" in values:
            values["vectorize"] = parse_vectorize(values["vectorize"])
        return cls(**{k: _coerce(v, types[k], f"{section}.{k}") for k, v in values.items() if k in types})

    cell = d.get("sample_cell")
    return RunConfig(seed=_coerce(d.get("seed", 0), int, "seed"), data=build("data", DataConfig),
                     model=build("model", ModelConfig), train=build("train", TrainConfig),
                     sample_cell=None if cell is None else _coerce(cell, int, "sample_cell"))



"""Every identity field at its default (fields at their default are left out of a run's identity)."""
