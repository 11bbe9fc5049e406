"""What a measure plugin needs, in one module (also exported at the top: `from flatbench import ...`).

    from flatbench.measures.plugin import MeasureContext, NotApplicable, register_measure

    @register_measure("weight_l1", description="Σ |θ| over all parameters", cost="cheap")
    def weight_l1(ctx: MeasureContext) -> dict[str, float]:
        return {"weight_l1": sum(float(p.abs().sum()) for p in ctx.model.parameters())}

- `register_measure(name, description=..., invariant_to=(...), cost=..., defaults={...}, uses_loss=...,
  stochastic=..., larger_is_sharper=..., exact=..., settings_help={...}, family=..., papers=(...))`
  registers a function `(ctx) -> dict | MeasureOutput`; `settings_help` gives each setting's meaning and
  valid range, which `flatbench describe NAME --plugin FILE` prints with the defaults; `family` is the
  report's grouping (default: the plugin's name), `papers` are listed on its reference page.
  The key equal to the name is the headline value (the one the report ranks); keys `name/detail` are
  details; a bare number is the headline value. `invariant_to` declares rescaling families (`FAMILIES`):
  `flatbench check-measure NAME` checks them on a catalogue of trained models.
- `MeasureContext` (`ctx`): `ctx.model` (eval mode, the measure dtype), `ctx.inputs`, `ctx.targets`,
  `ctx.loss` (a loss on the logits: `ctx.loss(logits, targets)` is the mean), `ctx.settings` (the
  measure's defaults with the user's `measure.settings`), `ctx.generator(tag)` (a seeded generator),
  `ctx.chunks()`, and `ctx.cached(key, fn)`, a cache shared by every measure of the model.
- `NotApplicable(reason)`: raise it when the model lacks a structure the measure needs.
- `MeasureOutput(values, info)`: values plus information (method, iterations; a stochastic measure puts
  its standard error in `info["stderr"]`).
- Shared quantities, computed once per model and loss and reused by every measure that asks:
  `hessian_diagonal(ctx)` (exact for piecewise-linear networks and smooth Sequential chains, else a
  bounded Hutchinson estimate; a `DiagonalResult` with `.diag`, `.trace()`, `.method`),
  `weight_layers(ctx)` (Linear/Conv2d layers in forward order), `weight_matrices(ctx)` (every weight
  matrix: Linear, Conv, Embedding weights and an attention's q, k, v and output projections, each with its
  parameter's name and rows), `left_out(ctx, covered)` (the parameters that are none of `covered`, by group
  `biases`, `normalization`, `other`: what a measure over a selection of parameters reports as
  `info["left_out"]`), `hvp(ctx, vector)` (a Hessian-vector product of the context's loss).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from flatbench.measures.context import MeasureContext
from flatbench.measures.registry import FAMILIES, MeasureOutput, NotApplicable, register_measure
from flatbench.measures.shared import hessian_diagonal, hutchinson_diagonal
from flatbench.measures.shared import hvp as product_in_mode
from flatbench.measures.shared import layers as weight_layers
from flatbench.measures.shared import left_out
from flatbench.measures.shared import matrices as weight_matrices


def hvp(ctx: MeasureContext, vector: dict[str, Tensor] | Tensor) -> Any:
    """H v of the context's loss over its measurement set (`vector` keyed like `named_parameters()`, or
    flat); forward-over-reverse where the model allows it, else double backward."""
    return product_in_mode(ctx, vector)


__all__ = ["FAMILIES", "MeasureContext", "MeasureOutput", "NotApplicable", "hessian_diagonal", "hutchinson_diagonal",
           "hvp", "left_out", "register_measure", "weight_layers", "weight_matrices"]
