"""What a study is: the frozen dataclasses of a config's sections, a run's identity and id.

`RunConfig` is everything that determines one trained model; its `identity()` (every field except those
that only say how it is executed, and those at their default) is what the run id's hash covers, so that a
later version that adds a field with a default keeps every existing run's id. `Study` is a whole sweep:
its runs plus the measure and report settings shared by all of them. Parsing YAML into these classes is
`flatbench.config.parse`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

@dataclass(frozen=True)
class DataConfig:
    dataset: str = "mnist_mini"
    """mnist_mini | mnist | fashion_mnist | cifar10, or one's own: a `.npz` file with the arrays x_train,
    y_train, x_test, y_test (labels 0..C-1)."""
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
    seed: int | None = None
    """The data draw: the seed of the training subset, the test subset and the random labels (default: the
    run's `seed`). Give it to decouple the data from the initialization and batch order, which the run's
    `seed` keeps: runs with one `data.seed` and different seeds see the same data; runs with one seed and
    different `data.seed` start from the same weights. The analysis treats the draw as the replicate unit."""
    augment: bool = False
    """Random crop (padding 4 for 32×32, 2 for 28×28) and, for CIFAR-10, horizontal flip, on tensors."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "mlp"
    """mlp | lenet | wrn, or a factory of one's own: `models.py:build` (a file, relative to where flatbench
    runs) or `mypkg.models:build`, called with `kwargs` and (where it takes them) `input_shape` and
    `num_classes`."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of a model factory."""

    def __hash__(self) -> int:  # kwargs is a dict: hash the canonical JSON of every field
        return hash(json.dumps(to_plain(self), sort_keys=True, default=str))
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
    """mlp: dropout after each hidden ReLU; wrn: dropout inside the blocks (the random-label studies use
    none). In [0, 1); training only: every measure sees the model in eval mode, where dropout is the
    identity."""


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
    this, checked every `eval_every` epochs (every `endpoint_check_steps` optimizer steps near the target with
    `endpoint_tolerance`): every run of a study then ends at the same loss (see docs/guide/endpoint.md)."""
    endpoint_tolerance: float | None = None
    """With `target_train_loss` T: stop at the first optimizer step (checked every `endpoint_check_steps`
    steps) at which the whole training set's loss is at most T, and record the endpoint as met when that loss
    is at least (1 − tolerance)·T (e.g. 0.05: within 5% of T). The epoch in which the loss crossed T, found by
    the epoch-end check, is replayed from its start step by step (docs/guide/endpoint.md). Default (null): the
    run stops at the first evaluated epoch whose loss is at most T, wherever below T that is."""
    endpoint_check_steps: int = 1
    """`endpoint_tolerance`: optimizer steps between checks of the training-set loss in the epoch in which it
    crossed the target; a check that finds it below the tolerance band goes back to the previous check and
    steps one at a time from there."""
    endpoint_scale_step: bool = True
    """`endpoint_tolerance`: when one optimizer step takes the loss from above the target to below
    (1 − tolerance)·target, take that step with its learning rate scaled down (the weights moved a fraction
    s of the step, found by bisection, s recorded in run.json) so that the run ends within the tolerance;
    false: keep the full step and record the run as having missed its endpoint (the report excludes it)."""
    snapshot_losses: tuple[float, ...] = ()
    """Keep a copy of the model the first time its whole-training-set loss is at most each of these levels
    (e.g. [0.1, 0.01, 0.001]); `measure` and `report` then give each measure's τ at every level."""
    eval_every: int = 1
    """Epochs between evaluations of the whole training set (eval mode) and the test set; the target loss
    and the snapshots are checked then, and the training curves plot these points."""
    lazy_eval: float = 30.0
    """Skip an evaluation epoch's whole-set evaluations while the epoch's running training loss is above
    `lazy_eval` times the next loss level to check (the largest `snapshot_losses` level not reached yet, else
    `target_train_loss`); epochs 1, 2, 4, 8, ... and the last are always evaluated, so the curves keep their
    early points. The endpoint is then the first evaluated epoch whose training-set loss is at most the
    target: the same epoch as with every evaluation done unless the loss reached the target while the running
    loss was above 30x it (the five CPU studies' largest ratio at an endpoint or snapshot was 7.3). 0:
    evaluate at every evaluation epoch. No effect without a loss target or snapshot levels."""
    test_every: int = 0
    """0: the test set is evaluated with the training set at every evaluation. K > 0: only at epochs 1, 2, 4,
    8, ..., every K-th, the last, and where the run stops or keeps a snapshot (the test set stops nothing;
    a study whose test set is much larger than its training set spends most of its evaluation time on it).
    The trained model and run.json's results are the same either way; the history has fewer test points
    (not part of the run's identity)."""
    checkpoint_every: int = 1
    """Epochs between epoch checkpoints (a preempted or killed run resumes from the last one, replaying the
    epochs after it exactly). Writing one costs about as much as an epoch of a small MLP on 500 images, so
    studies of many tiny runs write fewer; no effect on the trained model (not part of the run's identity)."""
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
    """Conv nets: train and evaluate in the channels_last memory format (faster convolutions on CUDA and on
    the CPU); no effect on nets without Conv2d. Same model, other order of summation."""
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
    """Losses for the loss-based measures: ce | normalized_ce | mse (on one-hot targets) | a function of
    one's own, `file.py:function` or `pkg.module:function` (one result key per loss: `name@loss`, a
    function by its name)."""
    normalized_ce_tau: float = 1.0
    """τ of the normalized cross-entropy surrogate."""
    dtype: str = "auto"
    """auto | float64 | float32: precision of the measure computations. auto: exact quantities and solvers
    in float64, the measures registered with `precision="float32"` (Monte-Carlo estimates, searches, the
    Lanczos eigenvalue baseline) in float32; float64 / float32: every measure in that dtype. Each result
    records the dtype it was computed in."""
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
    plugins: tuple[str, ...] = ()
    """Measure plugins: Python files (`my_measures.py`, relative to where flatbench runs or to the config) or importable
    modules (`mypkg.measures`) that register measures; each result of a plugin measure records the
    plugin's sha256, so an edited plugin recomputes its entries."""
    hvp_mode: str = "auto"
    """auto | rev_fwd | fwd_rev | double_backward: how Hessian-vector products are computed (auto: double
    backward; a torch.func mode is checked against double backward on its first product on a model and
    replaced where it disagrees, as reverse-over-forward does through LayerNorm and InstanceNorm in torch
    2.14.1: `curvature.modes`)."""
    timeout_s: float = 3600.0
    """Seconds one measure entry may take; one that takes longer is an `error` entry ("timed out")."""


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
    sample_cell: int | None = None
    """The run's configuration in a sampled study (`sample`): its index 0..n-1 in the design, the same for
    every seed, so that an analysis groups the runs of a cell by one number. A label, not part of the run's
    identity (`DESIGN_LABEL_KEYS`): the sampled values themselves are in the run's fields; a run trained by
    another study with the same values keeps that study's index."""

    def to_dict(self) -> dict:
        """Plain dict (what run.json stores); `sample_cell` only in a sampled study's runs."""
        out = to_plain(self)
        if out["sample_cell"] is None:
            del out["sample_cell"]
        return out

    @property
    def data_seed(self) -> int:
        """The seed of the run's data draw (subsets, random labels): `data.seed`, else the run's seed."""
        return self.seed if self.data.seed is None else self.data.seed

    def identity(self) -> dict[str, Any]:
        """The fields that make this run what it is: every config field, dotted, except those that only
        say how it is executed (`EXECUTION_ONLY_KEYS`) and those at their default value (so a later
        version that adds a key with a default keeps every existing run's id)."""
        return {k: v for k, v in dotted(self.to_dict()).items()
                if k not in EXECUTION_ONLY_KEYS and k not in DESIGN_LABEL_KEYS
                and v != _DEFAULT_IDENTITY.get(k, _MISSING)}

    def config_hash(self) -> str:
        """sha256 of `identity()` (canonical JSON), 16 hex digits: stored in run.json and checkpoints."""
        text = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def run_id(self) -> str:
        """`<model>-<dataset>-r<ratio>-s<seed>-<hash>`: readable, and determined by the full config."""
        core = [_slug(self.model.name), _slug(self.data.dataset), f"r{_fmt_ratio(self.data.random_label_ratio)}",
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


EXECUTION_ONLY_KEYS = frozenset({"data.root", "data.download", "train.eval_batch_size", "train.checkpoint_every",
                                 "train.test_every",
                                 "train.vectorize",
                                 "train.compile", "train.channels_last", "train.workers"})
"""Fields that change where the data come from or how a run is executed, never the model it trains:
not part of a run's identity (a run may be resumed or moved with other values)."""
DESIGN_LABEL_KEYS = frozenset({"sample_cell"})
"""Fields that say where a run sits in its study's design, never what it trains: not part of its identity."""
RUN_ID_HASH_CHARS = 8
"""Hex digits of the config hash in a run id (a collision is detected, see `train.check_run_dir`)."""
_MISSING = object()

SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig,
            "measure": MeasureConfig, "report": ReportConfig}
SWEEPABLE = ("seed", "data", "model", "train")
TOP_LEVEL = ("name", "out", "seed", *SECTIONS, "sample")


def to_plain(obj: Any) -> Any:
    """Dataclasses → dicts, tuples → lists (what YAML and JSON want)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def dotted(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested plain dict → {"section.key": value}."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and key in ("data", "model", "train"):
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _slug(name: str) -> str:
    """A model or dataset name as a run-id part: built-in names as they are; a factory or a file
    (`models.py:build`, `data/mine.npz`) by its last part (`build`, `mine`)."""
    if all(c.isalnum() or c in "_-." for c in name) and not name.endswith(".npz"):
        return name
    tail = name.replace("\\", "/").rstrip("/").rsplit(":", 1)[-1].rsplit("/", 1)[-1]
    tail = tail.removesuffix(".npz")
    slug = "".join(c if c.isalnum() or c in "_-" else "_" for c in tail).strip("_.")
    return slug or "custom"


def _fmt_ratio(value: float) -> str:
    text = f"{value:.2f}"
    return text if float(text) == value else f"{value:.4f}".rstrip("0")


def snapshot_folder_name(level: float) -> str:
    """The folder (under a run's snapshots/) of the model kept at a train-loss level."""
    return f"loss_{level:g}"


_DEFAULT_IDENTITY = dotted(to_plain(RunConfig()))
