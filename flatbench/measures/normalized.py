"""Tsuzuku et al.'s matrix-normalized and normalized sharpness, from the exact Hessian diagonal.

For a weight layer with weights W (out × in, conv kernels reduced over their spatial axes) and the
Hessian diagonal H of the loss over the same entries (Q = W²):

**matrix_normalized_sharpness** (§4): one posterior variance s per matrix,
`min_s Σ_ij (H_ij s + Q_ij / s) = 2 ‖W‖_F sqrt(Tr H_W)`, summed over the layers. Closed form.

**normalized_sharpness** (§5): row × column variances s_ij = σ_i σ'_j,

    NS_l = min_{σ > 0, σ' > 0}  f(σ, σ') = Σ_ij H_ij σ_i σ'_j + Q_ij / (σ_i σ'_j).

f is convex in (log σ, log σ') with one flat direction (σ·t, σ'/t). `solve_normalized_sharpness` runs
the exact block updates σ_i = sqrt(B_i / A_i), A = H σ', B = Q (1/σ'), then the symmetric update of σ',
in float64, until the relative change of f over one sweep is at most `rtol` (1e-10); it starts from the
matrix-normalized optimum σ_i σ'_j = ‖W‖_F / sqrt(Tr H), so NS_l ≤ 2 ‖W‖_F sqrt(Tr H_W) from the first
iterate on, and every update can only lower f, while 2 Σ_ij |W_ij| sqrt(H_ij) ≤ NS_l always (each term
H s + Q / s ≥ 2 sqrt(HQ)). The iterations, the final relative change and the KKT residual (the relative
imbalance max_i |σ_i A_i − B_i/σ_i| / (σ_i A_i + B_i/σ_i) of the row conditions after the column update)
are reported per layer.

*Dead units.* A row or column of H (a unit that no example's loss curvature reaches, e.g. a dead ReLU) or
of Q (a unit with all-zero weights) that is zero makes the infimum unattained: its σ runs to ∞ (H row
zero) or 0 (W row zero) and its terms to 0. Such units are clamped at that limit, i.e. their terms
contribute exactly their infimum 0 and they leave the problem, which is then solved on the remaining
rows and columns (repeated until no row or column is dead, since removing a row can empty a column).
A row or column counts as zero when its sum is at most `DEAD_EPS` (1e-30) times the layer's total of
H (resp. Q): its terms could then contribute at most about sqrt(1e-30) = 1e-15 of the layer's value.
The counts are reported (`dead_rows`, `dead_cols` per layer and `dead_units` in total).

*Negative curvature.* The loss `normalized_ce` has a logit Hessian that is not positive semi-definite, so
H_ii can be negative; the measures are defined for H ≥ 0 (with a negative entry f is unbounded below),
so negative diagonal entries are clamped to 0 and counted (`negative_diagonal_clamped`). A rescaling
multiplies every H_ii by a positive factor, so clamping does not break any invariance. With `ce` the
exact diagonal is non-negative.

Biases are not included (Tsuzuku et al. define the measures on the weight matrices). Invariances:
matrix-normalized sharpness is invariant to layer-wise and BN-wise rescaling (each matrix is rescaled as
a whole); normalized sharpness also to node-wise rescaling (rows and columns are rescaled), and computed
with `normalized_ce` also to scaling the logits (`normalized_sharpness_nce`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from flatbench.measures.context import MeasureContext
from flatbench.measures.layers import weight_layers
from flatbench.measures.registry import MeasureOutput, register_measure

DEAD_EPS = 1e-30
"""A row / column of H or W² whose sum is ≤ DEAD_EPS × the layer's total is dead (see the module doc)."""

NS_DEFAULTS = {"rtol": 1e-10, "max_iter": 10000}
"""Solver settings: stop when one sweep changes the layer's value by at most rtol (relative)."""


# ---------------------------------------------------------------- the per-layer problem


def reduce_layer(h_diag: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(H, Q = W²) as float64 out × in matrices; conv kernels are summed over their spatial axes."""
    h = h_diag.detach().to(torch.float64)
    q = weight.detach().to(torch.float64).pow(2)
    if h.dim() > 2:
        dims = tuple(range(2, h.dim()))
        h, q = h.sum(dims), q.sum(dims)
    return h, q


def matrix_normalized(h: Tensor, q: Tensor) -> float:
    """min_s Σ (H s + Q / s) = 2 sqrt(ΣQ) sqrt(ΣH) (0 when either is 0)."""
    return 2.0 * math.sqrt(max(float(q.sum()), 0.0)) * math.sqrt(max(float(h.sum()), 0.0))


def lower_bound(h: Tensor, q: Tensor) -> float:
    """2 Σ_ij sqrt(H_ij Q_ij) = 2 Σ |W| sqrt(H): the value with one free variance per entry."""
    return 2.0 * float((h.clamp_min(0) * q).sqrt().sum())


@dataclass
class NSResult:
    value: float
    sigma: Tensor
    """Row variances factor (out,): +inf for rows with zero curvature, 0 for zero weight rows."""
    sigma_prime: Tensor
    """Column factor (in,), same conventions."""
    iterations: int
    rel_change: float
    kkt_residual: float
    converged: bool
    dead_rows: int
    dead_cols: int
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"value": self.value, "iterations": self.iterations, "rel_change": self.rel_change,
                "kkt_residual": self.kkt_residual, "converged": self.converged, "dead_rows": self.dead_rows,
                "dead_cols": self.dead_cols, "seconds": round(self.seconds, 6)}


def _live(h: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Masks of the live rows and columns, and the limit (inf / 0) each dead one is clamped at."""
    rows = torch.ones(h.shape[0], dtype=torch.bool)
    cols = torch.ones(h.shape[1], dtype=torch.bool)
    row_limit = torch.full((h.shape[0],), float("nan"), dtype=torch.float64)
    col_limit = torch.full((h.shape[1],), float("nan"), dtype=torch.float64)
    h_tol = DEAD_EPS * float(h.sum())
    q_tol = DEAD_EPS * float(q.sum())
    while rows.any() and cols.any():
        hs, qs = h[rows][:, cols], q[rows][:, cols]
        r_h, r_q = hs.sum(1) <= h_tol, qs.sum(1) <= q_tol
        c_h, c_q = hs.sum(0) <= h_tol, qs.sum(0) <= q_tol
        dead_r, dead_c = r_h | r_q, c_h | c_q
        if not dead_r.any() and not dead_c.any():
            break
        ri, ci = rows.nonzero().squeeze(1), cols.nonzero().squeeze(1)
        # zero curvature → σ → ∞ (its Q terms vanish); zero weights → σ → 0 (its H terms vanish)
        zero = torch.zeros((), dtype=torch.float64)
        inf = torch.full((), float("inf"), dtype=torch.float64)
        row_limit[ri[dead_r]] = torch.where(r_q[dead_r], zero, inf)
        col_limit[ci[dead_c]] = torch.where(c_q[dead_c], zero, inf)
        rows[ri[dead_r]] = False
        cols[ci[dead_c]] = False
    return rows, cols, row_limit, col_limit


def solve_normalized_sharpness(h: Tensor, q: Tensor, rtol: float = 1e-10, max_iter: int = 10000
                               ) -> NSResult:
    """min over σ, σ' > 0 of Σ H_ij σ_i σ'_j + Q_ij / (σ_i σ'_j) by exact alternating block updates.

    `h` and `q` are non-negative out × in matrices (converted to float64). See the module docstring for
    the stopping rule, dead rows / columns and the reported diagnostics.
    """
    start = time.perf_counter()
    h = h.detach().to("cpu", torch.float64).clamp_min(0)
    q = q.detach().to("cpu", torch.float64)
    rows, cols, row_limit, col_limit = _live(h, q)
    dead_rows, dead_cols = int((~rows).sum()), int((~cols).sum())
    sigma = row_limit.clone()
    sigma_p = col_limit.clone()
    if not rows.any() or not cols.any():
        sigma[rows] = float("inf")
        sigma_p[cols] = float("inf")
        return NSResult(0.0, sigma, sigma_p, 0, 0.0, 0.0, True, dead_rows, dead_cols,
                        time.perf_counter() - start)
    hs, qs = h[rows][:, cols].contiguous(), q[rows][:, cols].contiguous()
    hs_t, qs_t = hs.t().contiguous(), qs.t().contiguous()
    s0 = (float(qs.sum()) / float(hs.sum())) ** 0.25
    s = torch.full((hs.shape[0],), s0, dtype=torch.float64)
    sp = torch.full((hs.shape[1],), s0, dtype=torch.float64)
    value = float(s @ (hs @ sp) + (1 / s) @ (qs @ (1 / sp)))
    rel, iterations, converged = float("inf"), 0, False
    for iterations in range(1, max_iter + 1):
        s = torch.sqrt((qs @ (1 / sp)) / (hs @ sp))
        a_col, b_col = hs_t @ s, qs_t @ (1 / s)
        sp = torch.sqrt(b_col / a_col)
        # after the column update: f = Σ_j (a_j σ'_j + b_j / σ'_j) = 2 Σ_j sqrt(a_j b_j)
        new = float(2.0 * torch.sqrt(a_col * b_col).sum())
        rel = abs(value - new) / max(abs(new), 1e-300)
        value = new
        if rel <= rtol:
            converged = True
            break
    a_row, b_row = hs @ sp, qs @ (1 / sp)
    kkt = float(((s * a_row - b_row / s).abs() / (s * a_row + b_row / s)).max())
    sigma[rows] = s
    sigma_p[cols] = sp
    return NSResult(value, sigma, sigma_p, iterations, rel, kkt, converged, dead_rows, dead_cols,
                    time.perf_counter() - start)


# ---------------------------------------------------------------- the measures


def _context_for_loss(ctx: MeasureContext, loss_name: str) -> MeasureContext:
    if ctx.loss_name == loss_name:
        return ctx
    return ctx.for_measure(ctx.measure_name, ctx.settings, loss_name=loss_name)


def layer_problems(ctx: MeasureContext, loss_name: str | None = None
                   ) -> tuple[list[tuple[str, Tensor, Tensor]], dict[str, Any]]:
    """Per weight layer (forward order): (name, H, Q) from the exact (or estimated) Hessian diagonal.

    Returns the problems and diagnostics: the diagonal's method and the number of negative diagonal
    entries clamped to 0.
    """
    from flatbench.curvature import diagonal_for

    sub = _context_for_loss(ctx, loss_name or ctx.loss_name)
    result = diagonal_for(sub)
    layers = ctx.cached("weight_layers", lambda: weight_layers(ctx.model, ctx.inputs[:1]))
    problems, negative = [], 0
    for layer in layers:
        diag = result.diag[f"{layer.name}.weight" if layer.name else "weight"]
        negative += int((diag < 0).sum())
        h, q = reduce_layer(diag.clamp_min(0), layer.module.weight)
        problems.append((layer.name, h, q))
    info = {"loss": sub.loss_name, "diagonal_method": result.method, "negative_diagonal_clamped": negative}
    if sub.loss_name == "normalized_ce":
        info["normalized_ce_tau"] = sub.normalized_ce_tau
    return problems, info


@register_measure(
    "matrix_normalized_sharpness",
    description="Tsuzuku et al. §4: Σ_l 2‖W_l‖_F sqrt(Tr H_{W_l}), one variance per weight matrix "
                "(closed form)",
    invariant_to=("layer", "bn"), cost="hessian", uses_loss=True)
def matrix_normalized_sharpness(ctx: MeasureContext) -> MeasureOutput:
    problems, info = layer_problems(ctx)
    per_layer = {f"matrix_normalized_sharpness/{name}": matrix_normalized(h, q) for name, h, q in problems}
    return MeasureOutput({"matrix_normalized_sharpness": sum(per_layer.values()), **per_layer}, info)


def _normalized_sharpness(ctx: MeasureContext, key: str, loss_name: str) -> MeasureOutput:
    problems, info = layer_problems(ctx, loss_name)
    rtol = float(ctx.settings.get("rtol", NS_DEFAULTS["rtol"]))
    max_iter = int(ctx.settings.get("max_iter", NS_DEFAULTS["max_iter"]))
    values: dict[str, float] = {}
    layers: dict[str, Any] = {}
    for name, h, q in problems:
        res = solve_normalized_sharpness(h, q, rtol=rtol, max_iter=max_iter)
        values[f"{key}/{name}"] = res.value
        layers[name] = res.summary()
    info.update(
        rtol=rtol, layers=layers, converged=all(l["converged"] for l in layers.values()),
        iterations_max=max((l["iterations"] for l in layers.values()), default=0),
        rel_change_max=max((l["rel_change"] for l in layers.values()), default=0.0),
        dead_units=sum(l["dead_rows"] + l["dead_cols"] for l in layers.values()),
        solver_seconds=round(sum(l["seconds"] for l in layers.values()), 6))
    return MeasureOutput({key: sum(values.values()), **values}, info)


@register_measure(
    "normalized_sharpness",
    description="Tsuzuku et al. §5: Σ_l min_{σ,σ'} Σ_ij H_ij σ_iσ'_j + W_ij²/(σ_iσ'_j), cross-entropy",
    invariant_to=("layer", "node", "bn"), cost="hessian", defaults=NS_DEFAULTS)
def normalized_sharpness(ctx: MeasureContext) -> MeasureOutput:
    """Normalized sharpness with the Hessian of the cross-entropy (Tsuzuku et al. §6.2's variant)."""
    return _normalized_sharpness(ctx, "normalized_sharpness", "ce")


@register_measure(
    "normalized_sharpness_nce",
    description="Tsuzuku et al. §5.4: normalized sharpness with the normalized-softmax cross-entropy "
                "(flatbench's normalized_ce, τ = measure.normalized_ce_tau)",
    invariant_to=("layer", "node", "bn", "logit_scale"), cost="hessian",
    defaults=NS_DEFAULTS)
def normalized_sharpness_nce(ctx: MeasureContext) -> MeasureOutput:
    """Normalized sharpness with the Hessian of `normalized_ce` (the paper's §6.1 choice)."""
    return _normalized_sharpness(ctx, "normalized_sharpness_nce", "normalized_ce")
