"""One catalogue of small trained float64 models, shared by the measure, rescaling and invariance tests.

    from cases import CASES, case, context

    c = case("mlp")                   # Case(name, model, inputs, targets, num_classes, config)
    ctx = context("mlp")              # a MeasureContext on the case's measurement set
    out = measure("mlp", "path_norm") # a registered measure on the case (MeasureOutput)

Every case is a flatbench model (`flatbench.models`) trained briefly (full-batch Adam, seeded, float64) on
a seeded balanced subset of mnist_mini's training rows, so that it is not at initialization (non-trivial
curvature, BatchNorm running statistics that are not 0 and 1) yet cheap; its measurement set is the
training set it was trained on, with the true labels. A case is built once per test session
(`functools.cache`) and shared: **never modify `case(name).model`**; use `case(name).copy()` (a deep
copy) to change weights. Building does not touch the global torch RNG (it runs under `fork_rng`).

The cases (`CASES`), chosen so that every measure and rescaling family meets the structures it treats
differently:

- `mlp`        — MLP 49 → 16 → 12 → 10 with biases, on 7×7 inputs (mnist_mini average-pooled by 4);
- `mlp_nobias` — the same widths without biases (unequal hidden widths: the psi measures say why not);
- `mlp_bn`     — MLP 49 → 16 → 12 → 10 with BatchNorm after each hidden Linear (eval mode);
- `mlp_psi`    — bias-free MLP 16 → 5 → 5 → 10 with equal hidden widths on 4×4 inputs (pooled by 7): the
  case the basis-path (psi) measures are defined for, small enough for a full Hessian over its basis paths;
- `lenet`      — LeNet-5 on 28×28 inputs;
- `wrn`        — WRN-10-1 (pre-activation residual blocks, BatchNorm → ReLU → conv junctions) on 7×7 inputs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn

from flatbench.config import DataConfig
from flatbench.data import load_dataset
from flatbench.measures import MeasureOutput, all_measures
from flatbench.measures.context import MeasureContext
from flatbench.models import MLP, LeNet5, WideResNet

DTYPE = torch.float64
N_EXAMPLES = 64


@dataclass(frozen=True)
class Spec:
    """How a case is built: the architecture, its input resolution, and the training run."""

    arch: str
    """mlp, lenet or wrn."""
    pool: int = 1
    """mnist_mini images average-pooled by this factor (28 → 28 / pool pixels a side)."""
    widths: tuple[int, ...] = ()
    bias: bool = True
    batch_norm: bool = False
    steps: int = 40
    lr: float = 5e-3
    seed: int = 0
    n: int = N_EXAMPLES


SPECS: dict[str, Spec] = {
    "mlp": Spec("mlp", pool=4, widths=(16, 12)),
    "mlp_nobias": Spec("mlp", pool=4, widths=(16, 12), bias=False, seed=1),
    "mlp_bn": Spec("mlp", pool=4, widths=(16, 12), batch_norm=True, seed=2),
    "mlp_psi": Spec("mlp", pool=7, widths=(5, 5), bias=False, seed=3, steps=60, lr=1e-2),
    "lenet": Spec("lenet", seed=4, steps=30, lr=3e-3),
    "wrn": Spec("wrn", pool=4, seed=5, steps=30, lr=3e-3),
}
CASES: tuple[str, ...] = tuple(SPECS)
NUM_CLASSES = 10

FAMILIES_OF: dict[str, frozenset[str]] = {
    "mlp": frozenset({"layer", "node", "logit_scale"}),
    "mlp_nobias": frozenset({"layer", "node", "logit_scale"}),
    "mlp_bn": frozenset({"layer", "node", "bn", "logit_scale"}),
    "mlp_psi": frozenset({"layer", "node", "logit_scale"}),
    "lenet": frozenset({"layer", "node", "logit_scale"}),
    "wrn": frozenset({"layer", "node", "bn", "logit_scale"}),
}
"""The rescaling families that apply to each case (known without building it, for parametrizing tests;
tests/test_rescale.py checks it against `flatbench.rescale.applicable_families`)."""


@dataclass(frozen=True)
class Case:
    name: str
    model: nn.Module
    """The trained model, float64, eval mode. Shared by every test: do not modify (see `copy`)."""
    inputs: Tensor
    targets: Tensor
    num_classes: int
    config: dict[str, Any] = field(default_factory=dict)
    """The build spec (architecture, widths, input shape, training steps, learning rate, seed)."""

    def copy(self) -> nn.Module:
        """A deep copy of the model, to modify freely."""
        return copy.deepcopy(self.model)


@cache
def _mnist_mini(n: int, pool: int) -> tuple[Tensor, Tensor]:
    ds = load_dataset(DataConfig(dataset="mnist_mini", n_train=n, n_test=10), seed=0)
    x = ds.x_train.to(DTYPE)
    if pool > 1:
        x = nn.functional.avg_pool2d(x, pool)
    return x, ds.y_train


def _build(spec: Spec, shape: tuple[int, ...]) -> nn.Module:
    if spec.arch == "mlp":
        return MLP(shape[0] * shape[1] * shape[2], spec.widths, NUM_CLASSES, bias=spec.bias,
                   batch_norm=spec.batch_norm)
    if spec.arch == "lenet":
        return LeNet5(shape[0], shape[1], NUM_CLASSES)
    return WideResNet(shape[0], NUM_CLASSES, depth=10, width=1)


@cache
def case(name: str) -> Case:
    """The trained case `name` (one of CASES), built once per session."""
    if name not in SPECS:
        raise KeyError(f"unknown case '{name}' (cases: {', '.join(CASES)})")
    spec = SPECS[name]
    x, y = _mnist_mini(spec.n, spec.pool)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = _build(spec, tuple(x.shape[1:])).to(DTYPE)
        opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
        model.train()
        for _ in range(spec.steps):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    config = {"arch": spec.arch, "widths": spec.widths, "bias": spec.bias, "batch_norm": spec.batch_norm,
              "input_shape": tuple(x.shape[1:]), "n": spec.n, "steps": spec.steps, "lr": spec.lr,
              "seed": spec.seed, "data": f"mnist_mini train rows, avg-pooled by {spec.pool}"}
    return Case(name, model, x, y, NUM_CLASSES, config)


def context(which: str | Case, model: nn.Module | None = None, **kwargs: Any) -> MeasureContext:
    """A MeasureContext on a case's measurement set (its model, or `model`, e.g. a transformed copy)."""
    c = case(which) if isinstance(which, str) else which
    return MeasureContext(model=c.model if model is None else model, inputs=c.inputs, targets=c.targets,
                          num_classes=c.num_classes, run_id=f"case-{c.name}", **kwargs)


def measure(which: str | Case, name: str, model: nn.Module | None = None, loss: str = "ce",
            ctx: MeasureContext | None = None, **settings: Any) -> MeasureOutput:
    """Registered measure `name` on a case with its defaults updated by `settings` (a dict result is
    wrapped in a MeasureOutput). NotApplicable propagates."""
    spec = all_measures()[name]
    ctx = ctx if ctx is not None else context(which, model)
    out = spec.fn(ctx.for_measure(name, {**spec.defaults, **settings}, loss_name=loss))
    return out if isinstance(out, MeasureOutput) else MeasureOutput(dict(out))


def solver_problem(out_n: int, in_n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random normalized-sharpness problem (h, w²) for one layer: the solver tests' and
    scripts/bench_solvers.py's."""
    gen = torch.Generator().manual_seed(seed)
    # heavy-tailed positive curvature and weights spread over orders of magnitude, like trained layers
    h = torch.exp(2.0 * torch.randn(out_n, in_n, generator=gen, dtype=torch.float64))
    h = h * torch.exp(torch.randn(out_n, 1, generator=gen, dtype=torch.float64))
    w = torch.randn(out_n, in_n, generator=gen, dtype=torch.float64) * torch.exp(
        torch.randn(1, in_n, generator=gen, dtype=torch.float64))
    return h, w.pow(2)
