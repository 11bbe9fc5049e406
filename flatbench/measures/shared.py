"""Quantities several measures share, computed once per model (and loss) and cached in its context.

This module is the one place that knows the cache keys: measures ask `hessian_diagonal(ctx)` or
`layers(ctx)`, and the measure stage, when it computes the diagonals of several runs at once
(`prime_hessian_diagonals`), puts them where `hessian_diagonal` looks, so the measures use them as if
computed alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from flatbench.curvature import (DENSE_MAX_PARAMS, POSITIVELY_HOMOGENEOUS_OPS, DiagonalResult,
                                  group_hessian_diagonals, mlp_linears, ops_outside, traced_ops)
from flatbench.losses import get_loss
from flatbench.measures.context import MeasureContext
from flatbench.measures.layers import WeightLayer, WeightMatrix, weight_layers, weight_matrices
from flatbench.measures.layers import left_out as parameters_left_out
from flatbench.measures.registry import NotApplicable
from flatbench.seeding import probe_generator


def _diagonal_key(loss_name: str, tau: float) -> tuple:
    return ("hessian_diagonal", loss_name, tau)


def hessian_diagonal(ctx: MeasureContext, loss_name: str | None = None) -> DiagonalResult:
    """The Hessian diagonal of the context's loss (or of `loss_name`), exact where the network qualifies
    (piecewise linear, a smooth Sequential chain, or at most `DENSE_MAX_PARAMS` parameters; else
    Hutchinson), computed once per model and loss.

    The Hutchinson fallback's probes are seeded by the run's seed and the loss, not by the measure that
    asks first, so the cached value does not depend on the order of the measures."""
    loss_name = loss_name or ctx.loss_name

    def compute() -> DiagonalResult:
        gen = probe_generator(ctx.seed, "hessian_diagonal", loss_name, ctx.normalized_ce_tau, device=ctx.device)
        return ctx.hessian_of(loss_name).diagonal(max_memory_mb=ctx.max_memory_mb, generator=gen,
                                                  dense_max_params=DENSE_MAX_PARAMS)

    return ctx.cached(_diagonal_key(loss_name, ctx.normalized_ce_tau), compute)


def dense_diagonal(ctx: MeasureContext) -> DiagonalResult:
    """The Hessian diagonal by one HVP per parameter (exact for any architecture; for small models), once
    per model and loss."""
    key = ("hessian_diagonal_dense", ctx.loss_name, ctx.normalized_ce_tau)
    return ctx.cached(key, lambda: ctx.hessian.dense_diagonal(reason=f"{ctx.hessian.size} parameters"))


def hutchinson_diagonal(ctx: MeasureContext, probes: int) -> DiagonalResult:
    """Hutchinson's estimate of the diagonal with `probes` probes (even where the exact one exists)."""
    key = ("hessian_diagonal_hutchinson", ctx.loss_name, ctx.normalized_ce_tau, probes)
    return ctx.cached(key, lambda: ctx.hessian.diagonal(
        method="hutchinson", max_memory_mb=ctx.max_memory_mb, generator=ctx.generator("hutchinson"),
        hutchinson_probes=probes))


def hvp(ctx: MeasureContext, vector: dict[str, torch.Tensor] | torch.Tensor) -> Any:
    """H v of the context's loss over its measurement set, in chunks, in the model's HVP mode
    (`flatbench.curvature.use_hvp_mode`; auto falls back to double backward where forward mode fails)."""
    return ctx.hessian @ vector


def forward_ops(ctx: MeasureContext) -> dict[str, str]:
    """The aten operations the model's forward pass calls (`flatbench.curvature.traced_ops`), once per model:
    what a measure that needs a structure (a ReLU network) checks."""
    return ctx.cached("forward_ops", lambda: traced_ops(ctx.model, ctx.inputs[:1]))


def require_relu_network(ctx: MeasureContext, measure: str) -> None:
    """NotApplicable unless the forward pass calls only positively homogeneous operations (linear, conv,
    ReLU, max/average pooling, BatchNorm with running statistics, sums, shape changes)."""
    bad = ops_outside(forward_ops(ctx), POSITIVELY_HOMOGENEOUS_OPS)
    if bad:
        raise NotApplicable(f"{measure} needs a ReLU network (positively homogeneous operations only: linear, "
                            f"conv, ReLU, pooling, BatchNorm, sums); this model's forward calls {', '.join(bad[:5])}")


def layers(ctx: MeasureContext) -> list[WeightLayer]:
    """The model's Linear / Conv2d layers in forward order."""
    return ctx.cached("weight_layers", lambda: weight_layers(ctx.model, ctx.inputs[:1]))


def matrices(ctx: MeasureContext) -> list[WeightMatrix]:
    """The model's weight matrices in forward order (`flatbench.measures.layers.weight_matrices`: Linear, Conv,
    Embedding weights and an attention's q, k, v and output projections), once per model."""
    return ctx.cached("weight_matrices", lambda: weight_matrices(ctx.model, ctx.inputs[:1]))


def left_out(ctx: MeasureContext, covered: Iterable[torch.Tensor] | None = None) -> dict[str, list[str]]:
    """The parameters a measure leaves out, by group (`biases`, `normalization`, `other`; see
    `flatbench.measures.layers.left_out`): those that are none of `covered` (default: the weight matrices'
    parameters). Every measure that works over a selection of the parameters reports it as
    `info["left_out"]`, so what it does not cover is named in its result."""
    if covered is None:
        covered = [m.parameter for m in matrices(ctx)]
    return parameters_left_out(ctx.model, covered)


class NormalDraws:
    """Standard-normal vectors of `numel` entries drawn one after another from one seeded generator, in
    float64, each rounded to `dtype` (a float32 computation sees the same numbers as a float64 one): item i
    is the i-th draw of that generator whatever order the items are asked for in. Drawn on demand; kept
    when `keep` (they fit the memory budget), else drawn again when asked again, from the generator's state
    saved before each draw (so an item asked for out of order costs its own draws, never a different
    number)."""

    def __init__(self, generator: torch.Generator, numel: int, dtype: torch.dtype, device: torch.device,
                 keep: bool):
        self.generator, self.numel, self.dtype, self.device, self.keep = generator, int(numel), dtype, device, keep
        self.kept: dict[int, torch.Tensor] = {}
        self.states: dict[int, torch.Tensor] = {0: generator.get_state()}
        self.position = 0
        """The index the generator's next draw has."""
        self.drawn = 0
        """How many vectors were drawn (repeats included): what the cache saves is visible in tests."""

    def __getitem__(self, index: int) -> torch.Tensor:
        if index in self.kept:
            return self.kept[index]
        start = max(k for k in self.states if k <= index)  # the nearest state saved before a draw up to it
        if index < self.position or start > self.position:
            self.generator.set_state(self.states[start])
            self.position = start
        while True:
            if not self.keep:  # a kept draw is never drawn again: no state to go back to
                self.states.setdefault(self.position, self.generator.get_state())
            z = torch.randn(self.numel, generator=self.generator, device=self.generator.device, dtype=torch.float64)
            z = z.to(device=self.device, dtype=self.dtype)
            at, self.position = self.position, self.position + 1
            self.drawn += 1
            if self.keep:
                self.kept[at] = z
            if at == index:
                return z


def normal_draws(ctx: MeasureContext, tag: str, count: int, numel: int, dtype: torch.dtype) -> NormalDraws:
    """The standard-normal vectors a measure draws from `ctx.generator(tag)` (`count` of `numel` entries,
    each drawn in float64 and rounded to `dtype`), as `NormalDraws`, kept in `ctx.draws`: the numbers depend
    on the run's seed, the measure, the tag and the sizes only, not on the parameters' values, so every
    context of the run (its dtype twin, the audit's rescaled copies) reads the same draws instead of making
    them again. They are kept when `count` of them fit `ctx.max_memory_mb`, else drawn on demand."""
    key = ("normal_draws", ctx.seed, ctx.measure_name, tag, int(count), int(numel), dtype, str(ctx.device))
    if key not in ctx.draws:
        size = int(count) * int(numel) * torch.empty((), dtype=dtype).element_size()
        ctx.draws[key] = NormalDraws(ctx.generator(tag), numel, dtype, ctx.device,
                                     keep=size <= ctx.max_memory_mb * 2 ** 20)
    return ctx.draws[key]


def prime_hessian_diagonals(contexts: list[MeasureContext], losses: list[str] | tuple[str, ...]) -> int:
    """Compute the exact diagonals of same-architecture plain MLPs in one batched computation per loss
    (`flatbench.curvature.group`) and cache them as `hessian_diagonal` would; returns how many contexts got
    them. Contexts of other models, or groups of one, are left to compute their own."""
    groups: dict[tuple, list[MeasureContext]] = {}
    for ctx in contexts:
        try:
            shape = tuple((m.in_features, m.out_features, m.bias is not None) for m in mlp_linears(ctx.model))
        except ValueError:
            continue
        groups.setdefault((shape, tuple(ctx.inputs.shape), ctx.normalized_ce_tau), []).append(ctx)
    primed = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        first = members[0]
        inputs = torch.stack([c.inputs for c in members])
        targets = torch.stack([c.targets for c in members])
        for loss_name in dict.fromkeys(("ce", *losses)):
            try:
                results = group_hessian_diagonals([c.model for c in members], inputs, targets,
                                                  get_loss(loss_name, first.normalized_ce_tau),
                                                  per_model_inputs=True, max_memory_mb=first.max_memory_mb,
                                                  chunk_size=first.chunk_size)
            except (RuntimeError, ValueError):  # e.g. out of memory: each computes its own, as usual
                continue
            for ctx, result in zip(members, results):
                ctx.cache[_diagonal_key(loss_name, ctx.normalized_ce_tau)] = result
        primed += len(members)
    return primed


__all__: list[Any] = [
    "dense_diagonal",
    "forward_ops",
    "hessian_diagonal",
    "hutchinson_diagonal",
    "hvp",
    "layers",
    "left_out",
    "matrices",
    "normal_draws",
    "prime_hessian_diagonals",
    "require_relu_network",
]
