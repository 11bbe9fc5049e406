"""One catalogue of small trained float64 models, shared by the measure, rescaling and invariance tests.

    from cases import CASES, case, context

    c = case("mlp")                   # Case(name, model, inputs, targets, num_classes, config)
    ctx = context("mlp")              # a MeasureContext on the case's measurement set
    out = measure("mlp", "path_norm") # a registered measure on the case (MeasureOutput)

The catalogue itself lives in the package (`flatbench.measures.contract`, where `flatbench check-measure`
uses it too); this module re-exports it for the tests and adds their helpers.

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

`tiny_network(name)` is the second catalogue: untrained float64 nets of a few hundred parameters
(`TINY_NETWORKS`), small enough for the full Hessian of `torch.autograd.functional.hessian`, which the
curvature tests take as ground truth.

tests/modern_layers.py (`layer_case(name)`, `MODERN_LAYERS`) is the third, beside this module: tiny float64
models of modern layers (LayerNorm transformers pre- and post-LN, RMSNorm, GroupNorm, InstanceNorm,
BatchNorm in eval mode, nn.MultiheadAttention fused and math, Embedding on integer tokens, residual blocks,
SiLU / GELU / Softplus, losses of one's own), each with its data and loss, and their reference Hessian by
reverse over reverse (`reference_hessian`; `dense_hessian` below is torch.func's forward over reverse);
tests/curvature/test_modern_layers.py checks every curvature measure on them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flatbench.curvature import register_piecewise_linear_container
from flatbench.measures import MeasureOutput, all_measures
from flatbench.measures.context import MeasureContext
from flatbench.measures.contract import (  # noqa: F401
    CASES,
    DTYPE,
    FAMILIES_OF,
    N_EXAMPLES,
    NUM_CLASSES,
    SPECS,
    Case,
    Spec,
    case,
    context,
)


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


# ---------------------------------------------------------------- tiny networks for brute-force Hessians

TINY_CLASSES = 4
"""Classes of every tiny network (their logits)."""
C = TINY_CLASSES
TINY_NETWORKS = ("mlp", "mlp_bn", "lenet", "resnet", "conv_variants", "linear_3d", "tanh", "mlp_bn_train",
                 "custom_gelu", "shared_weights", "linear_bias_free")
"""The curvature tests' untrained nets, small enough for `torch.autograd.functional.hessian`: one per
structure the exact diagonal treats differently (BatchNorm, pooling, residual additions, conv variants,
3-D Linear inputs, smooth activations) or refuses (batch statistics, unknown containers, shared weights)."""


@register_piecewise_linear_container
class TinyResNet(nn.Module):
    """conv-BN-ReLU-conv-BN plus a 1×1-conv shortcut, an inplace ReLU after the add, global pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(3)
        self.shortcut = nn.Conv2d(2, 3, 1, stride=1)
        self.head = nn.Sequential(nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(3, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return self.head(self.bn2(self.conv2(h)) + self.shortcut(x))


def small_tanh_mlp() -> nn.Module:
    """A seeded float32 Flatten-Linear-Tanh-Linear net on (3, 4) inputs, 3 classes: the API tests' model."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 3))


def small_data(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` seeded (3, 4) inputs and balanced labels for `small_tanh_mlp`."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 4, generator=g), torch.arange(n) % 3


def eval_bn(model: nn.Module, gen: torch.Generator | None = None) -> nn.Module:
    """Random running statistics and affine parameters, so BatchNorm is not close to the identity."""
    gen = gen if gen is not None else torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen))
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
            m.weight.data.copy_(torch.randn(m.weight.shape, generator=gen))
            m.bias.data.copy_(torch.randn(m.bias.shape, generator=gen))
    return model


def tiny_network(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """(a float64 net in eval mode, its input shape per example) of the tiny catalogue `TINY_NETWORKS`:
    a few hundred parameters at most, so the full Hessian of its loss is cheap. Seeded: the same weights at
    every call (a fresh module each time, so a test may change it)."""
    torch.manual_seed(0)
    if name == "mlp":
        net = nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 7), nn.ReLU(),
                            nn.Linear(7, C))
        shape: tuple[int, ...] = (6,)
    elif name == "mlp_bn":
        net = eval_bn(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True),
                                     nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, C)))
        shape = (6,)
    elif name == "lenet":
        net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, C))
        shape = (1, 10, 10)
    elif name == "resnet":
        net, shape = eval_bn(TinyResNet()), (2, 5, 5)
    elif name == "conv_variants":  # stride, dilation, groups, reflect and 'same' padding, avg-pool
        net = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1, padding_mode="reflect"), nn.ReLU(),
                            nn.Conv2d(4, 4, 3, dilation=2, groups=2, padding="same"), nn.ReLU(),
                            nn.AvgPool2d(2), nn.Flatten(), nn.Linear(16, C))
        shape = (2, 9, 9)
    elif name == "linear_3d":  # a Linear on (n, tokens, features): per-example gradients are not rank one
        net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Flatten(), nn.Linear(15, C))
        shape = (3, 4)
    elif name == "tanh":  # smooth: exact by the smooth-chain recursion (curvature.smooth), not the GGN
        net, shape = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, C)), (6,)
    elif name == "mlp_bn_train":  # BatchNorm with batch statistics: not piecewise linear per parameter
        net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, C))
        return net.double().train(), (6,)
    elif name == "custom_gelu":  # an unregistered container whose forward calls F.gelu
        net, shape = _CustomGelu(), (6,)
    elif name == "shared_weights":  # one Linear applied twice
        shared = nn.Linear(4, 4)
        net, shape = nn.Sequential(shared, nn.ReLU(), shared), (4,)
    elif name == "linear_bias_free":  # H of rank 2 on one example: an exhausted Krylov space
        net, shape = nn.Sequential(nn.Linear(3, 3, bias=False)), (3,)
    else:
        raise KeyError(f"no tiny network {name!r} (choose one of {', '.join(TINY_NETWORKS)})")
    return net.double().eval(), shape


class _CustomGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.gelu(self.a(x)))


def dense_hessian(net: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Any) -> torch.Tensor:
    """The brute-force reference of every exact curvature test: ∇²_θ L of the mean loss over the flat
    parameter vector by reverse over reverse (`torch.autograd.functional.hessian`), under the math attention
    kernel (float64 nets: exact to rounding). Not `torch.func.hessian`: that is forward over reverse, which
    in torch 2.14.1 is wrong through InstanceNorm (issue 41), so it cannot be the reference."""
    from torch.autograd.functional import hessian
    from torch.func import functional_call

    from flatbench.curvature import math_attention

    params = {k: p.detach() for k, p in net.named_parameters()}
    buffers = dict(net.named_buffers())

    def f(flat: torch.Tensor) -> torch.Tensor:
        d, offset = {}, 0
        for k, p in params.items():
            d[k] = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return loss(functional_call(net, (d, buffers), (x,)), y)

    with math_attention():
        return hessian(f, torch.cat([p.reshape(-1) for p in params.values()]))
