"""Study configs: YAML → validated frozen dataclasses, `key=value` overrides, sweep expansion.

A study config has the sections `data`, `model`, `train` (what a run is), `measure` and `report` (what is
done with the trained runs), plus `name`, `seed` and `out`. Any field of `seed`, `data`, `model` and
`train` may be given as a list: the study is the cartesian product of all such lists, one run each.
A field whose value is itself a list (`model.widths`) is swept with a list of lists.
`data.random_label_ratio` also accepts `{uniform: N}`: N ratios drawn uniformly in [0, 1] from the study's
(first) seed, as Tsuzuku et al. draw one ratio per model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml

from flatbench.errors import ConfigError
from flatbench.seeding import make_generator


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "mnist_mini"
    """mnist_mini | mnist | fashion_mnist | cifar10."""
    root: str | None = None
    """Folder holding the dataset files; default $FLATBENCH_DATA, else ~/.cache/flatbench."""
    download: bool = True
    """Download with torchvision when the files are missing and the network allows."""
    n_train: int | None = None
    """Seeded class-balanced subset of the training set (default: all of it)."""
    n_test: int | None = None
    """Seeded class-balanced subset of the test set (default: all of it)."""
    random_label_ratio: float = 0.0
    """Fraction r of training examples whose label is redrawn (exactly round(r·n) examples)."""
    random_label_scheme: str = "uniform"
    """uniform (drawn from all C classes, may equal the true one) | shuffle | wrong."""
    augment: bool = False
    """Random crop (padding 4 for 32×32, 2 for 28×28) and, for CIFAR-10, horizontal flip, on tensors."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "mlp"
    """mlp | lenet | wrn."""
    widths: tuple[int, ...] = (512, 512)
    """mlp: hidden layer widths."""
    bias: bool = True
    """mlp: biases in the linear layers."""
    batch_norm: bool = False
    """mlp: BatchNorm1d after each hidden linear layer."""
    depth: int = 16
    """wrn: depth (6k+4)."""
    width: int = 4
    """wrn: widening factor."""
    dropout: float = 0.0
    """wrn: dropout inside the blocks (the random-label studies use none)."""


@dataclass(frozen=True)
class TrainConfig:
    optimizer: str = "adam"
    """adam | sgd."""
    lr: float = 1e-3
    """Learning rate (the papers: Adam, 1e-3)."""
    momentum: float = 0.9
    """sgd only."""
    nesterov: bool = False
    """sgd only."""
    weight_decay: float = 0.0
    """L2 weight decay (coupled, as torch's Adam and SGD apply it)."""
    batch_size: int = 128
    """Training minibatch size."""
    epochs: int = 50
    """Maximum number of epochs."""
    schedule: str = "none"
    """none | cosine | step | inverse_time (lr/(1 + lr_decay·t) after t minibatch steps, Ibayashi et al.)."""
    step_size: int = 30
    """step schedule: epochs between learning-rate decays."""
    gamma: float = 0.1
    """step schedule: decay factor."""
    lr_decay: float = 1e-4
    """inverse_time schedule: the decay per minibatch step."""
    target_train_acc: float | None = None
    """Stop early once the epoch's running train accuracy reaches this value."""
    target_train_loss: float | None = None
    """Stop once the cross-entropy on the whole training set (eval mode, the labels trained on) is at most
    this, checked every `eval_every` epochs: every run of a study then ends at the same loss (see README,
    Training endpoint)."""
    snapshot_losses: tuple[float, ...] = ()
    """Keep a copy of the model the first time its whole-training-set loss is at most each of these levels
    (e.g. [0.1, 0.01, 0.001]); `measure` and `report` then give each measure's τ at every level."""
    eval_every: int = 1
    """Epochs between evaluations of the whole training set (eval mode) and the test set; the target loss
    and the snapshots are checked then, and the training curves plot these points."""
    eval_batch_size: int = 2000
    """Batch size for evaluating accuracy and loss (no effect on the result)."""
    vectorize: int | str = "auto"
    """auto | off | N: train up to N runs of a sweep at once as one vectorized model (torch.func.vmap). Only
    runs that differ in nothing but seed and random labels are grouped, and only mlp without batch norm
    and lenet; each run keeps its own init, labels and batch order and gets the same files as when trained
    alone (equal weights up to float rounding). auto: groups of 16 on CUDA, off on the CPU (slower there)."""
    precision: str = "fp32"
    """fp32 | bf16: bf16 autocast for forward pass and loss; weights, gradients and optimizer state stay fp32."""
    compile: bool = False
    """torch.compile the training forward pass (pays off on CUDA for long runs; same math, other rounding)."""
    channels_last: bool = True
    """Conv nets on CUDA: channels_last memory format (faster convolutions); no effect elsewhere."""
    workers: int = 1
    """Train up to this many runs (or vectorized groups) at once, each in its own process on the same device
    (the CPU's threads are divided among them); each run's files are those it gets when trained alone."""


@dataclass(frozen=True)
class MeasureConfig:
    measures: tuple[str, ...] = ("all",)
    """Registry names, or `all`."""
    n_examples: int | None = None
    """Size of the measurement set (a seeded subset of the training set); default all of it."""
    losses: tuple[str, ...] = ("ce",)
    """Losses for the loss-based measures: ce | normalized_ce (one result key per loss)."""
    normalized_ce_tau: float = 1.0
    """τ of the normalized cross-entropy surrogate."""
    dtype: str = "float64"
    """float64 | float32: precision of the measure computations."""
    max_memory_mb: int = 1024
    """Memory budget for chunked computations (per-example gradients)."""
    chunk_size: int = 2000
    """Examples per chunk for full-data passes."""
    settings: dict = field(default_factory=dict)
    """Per-measure settings, e.g. {eps_sharpness: {eps: 5e-4}}."""
    group_runs: str = "auto"
    """auto | on | off: compute the exact Hessian diagonal of up to 16 same-architecture MLP runs at once
    (auto: on CUDA only, where it is 4-9x faster; on a CPU it is slower)."""
    snapshots: bool = True
    """Also measure the models kept at `train.snapshot_losses` (each level costs one more measure pass)."""
    workers: int = 1
    """Measure up to this many models at once, each in its own process on the same device (no grouped
    Hessian diagonals then); each model's results are those it gets when measured alone."""
    snapshot_measures: tuple[str, ...] | None = None
    """The measures computed on the snapshots (default: the same as `measures`); e.g. only the curvature
    measures, whose dependence on the training endpoint the levels are meant to show."""


@dataclass(frozen=True)
class ReportConfig:
    gap: str = "acc"
    """acc | loss: the generalization gap the measures are correlated with."""
    min_train_acc: float = 0.9
    """Runs with a lower final train accuracy did not fit their labels; they are excluded and listed."""
    max_train_loss: float = 0.01
    """The report warns when a run ended above this train loss (it is not at a minimum, so its curvature
    measures are not comparable with the others')."""
    max_loss_span: float = 10.0
    """The report warns when the runs' final train losses span more than this factor."""
    include_stale: bool = False
    """Also count runs left in runs/ by an earlier version of the study (listed as not in this study)."""


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines one trained model."""

    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return to_plain(self)

    def identity(self) -> dict[str, Any]:
        """The fields that make this run what it is: every config field, dotted, except those that only
        say how it is executed (`EXECUTION_ONLY_KEYS`) and those at their default value (so a later
        version that adds a key with a default keeps every existing run's id)."""
        return {k: v for k, v in _dotted(self.to_dict()).items()
                if k not in EXECUTION_ONLY_KEYS and v != _DEFAULT_IDENTITY.get(k, _MISSING)}

    def config_hash(self) -> str:
        """sha256 of `identity()` (canonical JSON), 16 hex digits: stored in run.json and checkpoints."""
        text = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def run_id(self) -> str:
        """`<model>-<dataset>-r<ratio>-s<seed>-<hash>`: readable, and determined by the full config."""
        core = [self.model.name, self.data.dataset, f"r{_fmt_ratio(self.data.random_label_ratio)}",
                f"s{self.seed}"]
        return "-".join(core) + "-" + self.config_hash()[:RUN_ID_HASH_CHARS]


def identity_diff(stored: "RunConfig", expected: "RunConfig") -> list[str]:
    """`key: stored X, expected Y` for every identity field in which two run configs differ."""
    a, b = stored.identity(), expected.identity()
    out = []
    for key in sorted(set(a) | set(b)):
        va = a.get(key, _DEFAULT_IDENTITY.get(key))
        vb = b.get(key, _DEFAULT_IDENTITY.get(key))
        if va != vb:
            out.append(f"{key}: stored {json.dumps(va)}, expected {json.dumps(vb)}")
    return out


@dataclass(frozen=True)
class Study:
    """A whole study: its runs plus the measure and report settings shared by all of them."""

    name: str
    out: str
    runs: tuple[tuple[str, RunConfig], ...]
    measure: MeasureConfig
    report: ReportConfig
    sweep_axes: tuple[str, ...]
    raw: dict

    @property
    def exp_dir(self) -> Path:
        return Path(self.out) / self.name

    def run_ids(self) -> list[str]:
        return [rid for rid, _ in self.runs]


EXECUTION_ONLY_KEYS = frozenset({"data.root", "data.download", "train.eval_batch_size", "train.vectorize",
                                 "train.compile", "train.channels_last", "train.workers"})
"""Fields that change where the data come from or how a run is executed, never the model it trains:
not part of a run's identity (a run may be resumed or moved with other values)."""
RUN_ID_HASH_CHARS = 8
"""Hex digits of the config hash in a run id (a collision is detected, see `train.check_run_dir`)."""
_MISSING = object()

SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig,
            "measure": MeasureConfig, "report": ReportConfig}
SWEEPABLE = ("seed", "data", "model", "train")
TOP_LEVEL = ("name", "out", "seed", *SECTIONS)


def to_plain(obj: Any) -> Any:
    """Dataclasses → dicts, tuples → lists (what YAML and JSON want)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def _dotted(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested plain dict → {"section.key": value}."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and key in ("data", "model", "train"):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _fmt_ratio(value: float) -> str:
    text = f"{value:.2f}"
    return text if float(text) == value else f"{value:.4f}".rstrip("0")


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
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
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


def did_you_mean(word: str, choices: Any) -> str:
    """' (did you mean 'x'?)' for the closest of `choices`, or '' when none is close."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


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
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"invalid YAML in {path}{where}: {problem}") from None
    if raw is None or raw == {}:
        raise ConfigError(f"{path} is empty: a study config needs at least one section (data, model, "
                          "train, measure, report); see configs/quickstart.yaml")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of sections, got {type(raw).__name__}")
    return raw


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply `section.key=value` overrides (value parsed as YAML) to a raw config dict."""
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.epochs=5)")
        key, text = item.split("=", 1)
        key = key.strip()
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"override '{item}': the value is not valid YAML") from None
        parts = key.split(".")
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


def _ratio_values(value: Any, seeds: list[int]) -> list[float]:
    """`random_label_ratio` as a list of ratios: a number, a list, or `{uniform: N}`."""
    where = "data.random_label_ratio"
    if isinstance(value, dict):
        if set(value) != {"uniform"}:
            raise ConfigError(f"{where}: a mapping must be {{uniform: N}}, got {value!r}")
        n = _coerce(value["uniform"], int, f"{where}.uniform")
        if n < 1:
            raise ConfigError(f"{where}.uniform must be at least 1, got {n}")
        gen = make_generator("random_label_ratio", "uniform", seeds[0])
        draws = torch.rand(n, generator=gen, dtype=torch.float64)
        return [round(float(r), 4) for r in draws]
    values = value if isinstance(value, list) else [value]
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
                "train.eval_every": run.train.eval_every, "train.workers": run.train.workers}
    for where, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{where} must be positive, got {value}")
    for where, value in {"data.n_train": run.data.n_train, "data.n_test": run.data.n_test}.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{where} must be positive, got {value}")
    for where, value in {"train.weight_decay": run.train.weight_decay, "train.lr_decay": run.train.lr_decay,
                         "model.dropout": run.model.dropout}.items():
        if value < 0:
            raise ConfigError(f"{where} must be non-negative, got {value}")
    if run.model.dropout >= 1:
        raise ConfigError(f"model.dropout must be below 1, got {run.model.dropout}")
    if any(w <= 0 for w in run.model.widths):
        raise ConfigError(f"model.widths must be positive integers, got {list(run.model.widths)}")
    if run.model.name == "wrn" and (run.model.depth - 4) % 6:
        raise ConfigError(f"model.depth for wrn must be 6k+4 (10, 16, 22, 28, ...), got {run.model.depth}")
    if run.train.target_train_acc is not None and not 0 < run.train.target_train_acc <= 1:
        raise ConfigError(f"train.target_train_acc must be in (0, 1], got {run.train.target_train_acc}")
    if run.train.target_train_loss is not None and not run.train.target_train_loss > 0:
        raise ConfigError(f"train.target_train_loss must be positive, got {run.train.target_train_loss}")
    for level in run.train.snapshot_losses:
        if not level > 0:
            raise ConfigError(f"train.snapshot_losses must be positive losses, got {level}")
    if len(set(run.train.snapshot_losses)) != len(run.train.snapshot_losses):
        raise ConfigError(f"train.snapshot_losses lists a level twice: {list(run.train.snapshot_losses)}")


def _validate_report(cfg: ReportConfig) -> None:
    if cfg.gap not in ("acc", "loss"):
        raise ConfigError(f"report.gap must be acc or loss, got '{cfg.gap}'")
    if not 0.0 <= cfg.min_train_acc <= 1.0:
        raise ConfigError(f"report.min_train_acc must be in [0, 1], got {cfg.min_train_acc}")
    if not cfg.max_train_loss > 0:
        raise ConfigError(f"report.max_train_loss must be positive, got {cfg.max_train_loss}")
    if not cfg.max_loss_span >= 1:
        raise ConfigError(f"report.max_loss_span must be at least 1, got {cfg.max_loss_span}")


def _validate_measure(cfg: MeasureConfig) -> None:
    for loss in cfg.losses:
        if loss not in ("ce", "normalized_ce"):
            raise ConfigError(f"measure.losses: unknown loss '{loss}'{did_you_mean(loss, ('ce', 'normalized_ce'))}"
                              " (choose from: ce, normalized_ce)")
    if not cfg.losses:
        raise ConfigError("measure.losses must name at least one loss (ce, normalized_ce)")
    if cfg.dtype not in ("float64", "float32"):
        raise ConfigError(f"measure.dtype must be float64 or float32, got '{cfg.dtype}'")
    if cfg.group_runs not in ("auto", "on", "off"):
        raise ConfigError(f"measure.group_runs must be auto, on or off, got '{cfg.group_runs}'")
    if cfg.workers < 1:
        raise ConfigError(f"measure.workers must be at least 1, got {cfg.workers}")
    if cfg.n_examples is not None and cfg.n_examples <= 0:
        raise ConfigError(f"measure.n_examples must be positive, got {cfg.n_examples}")
    if cfg.normalized_ce_tau <= 0:
        raise ConfigError(f"measure.normalized_ce_tau must be positive, got {cfg.normalized_ce_tau}")
    for name, settings in cfg.settings.items():
        if not isinstance(settings, dict):
            raise ConfigError(f"measure.settings.{name} must be a mapping of setting: value")


def run_id_for(run: RunConfig, axes: tuple[str, ...] = ()) -> str:
    """The run's id (see `RunConfig.run_id`); `axes` is accepted for old callers and ignored: an id
    depends on the full config, never on which fields a study sweeps."""
    return run.run_id()


def parse_study(raw: dict, default_name: str = "study", out: str | None = None) -> Study:
    """Validate a raw config dict and expand its sweep into runs."""
    for key in raw:
        if key not in TOP_LEVEL:
            raise ConfigError(f"unknown key '{key}'{did_you_mean(key, TOP_LEVEL)} (valid top-level keys: "
                              f"{', '.join(TOP_LEVEL)})")
    for section, cls in SECTIONS.items():
        value = raw.get(section, {}) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"'{section}' must be a mapping of keys (valid keys: "
                              f"{', '.join(f.name for f in fields(cls))}), got {value!r}")
        _check_keys(section, value, cls)

    name = _coerce(raw.get("name", default_name), str, "name")
    if not name or "/" in name:
        raise ConfigError(f"name must be a non-empty folder name, got {name!r}")
    out_dir = out or _coerce(raw.get("out", "results"), str, "out")

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
            else:
                values = _axis_values(section, key, value, types[key])
            axes.append((section, key, values))

    swept = tuple(f"{s}.{k}" if s else k for s, k, v in axes if len(v) > 1)
    runs: list[tuple[str, RunConfig]] = []
    seen: dict[str, RunConfig] = {}
    for combo in itertools.product(*(values for _, _, values in axes)):
        per_section: dict[str, dict] = {"data": {}, "model": {}, "train": {}}
        seed = 0
        for (section, key, _), value in zip(axes, combo):
            if section:
                per_section[section][key] = value
            else:
                seed = value
        run = RunConfig(seed=seed, data=DataConfig(**per_section["data"]),
                        model=ModelConfig(**per_section["model"]), train=TrainConfig(**per_section["train"]))
        _validate_choices(run)
        rid = run.run_id()
        if rid in seen:
            if seen[rid].identity() == run.identity():
                continue  # the same run twice (e.g. {uniform: N} drew one ratio twice at 4 decimals)
            raise ConfigError(f"two runs of the sweep would share the id '{rid}'")
        seen[rid] = run
        runs.append((rid, run))

    mraw = dict(raw.get("measure") or {})
    mtypes = field_types(MeasureConfig)
    for key in ("measures", "losses", "snapshot_measures"):
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
    """Read, override, validate and expand a study config file."""
    raw = apply_overrides(load_yaml(path), overrides)
    return parse_study(raw, default_name=Path(path).stem, out=out)


def run_config_from_dict(d: dict) -> RunConfig:
    """Rebuild a RunConfig from the `config` stored in run.json."""
    def build(cls: type, values: dict) -> Any:
        types = field_types(cls)
        values = dict(values)
        if cls is TrainConfig and "vectorize" in values:
            values["vectorize"] = parse_vectorize(values["vectorize"])
        return cls(**{k: _coerce(v, types[k], k) for k, v in values.items() if k in types})

    return RunConfig(seed=int(d.get("seed", 0)), data=build(DataConfig, d.get("data", {})),
                     model=build(ModelConfig, d.get("model", {})), train=build(TrainConfig, d.get("train", {})))


_DEFAULT_IDENTITY = _dotted(to_plain(RunConfig()))
"""Every identity field at its default (fields at their default are left out of a run's identity)."""
