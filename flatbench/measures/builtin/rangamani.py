"""Rangamani et al. 2019's scale-invariant flatness: the top Hessian eigenvalue in a layer-scaled metric.

    scale_invariant_rangamani = λ_max(D^{1/2} H D^{1/2}) / (2 + 2 L_S),   D = blockdiag(‖W_l‖_F² I)

with H the Hessian of the mean loss L_S over the **weight matrices** only, W_l the l-th of them: every weight
matrix of `flatbench.measures.layers.weight_matrices` (Linear, Conv, Embedding weights; an attention's query,
key, value and output projections, each its own block of D, so that scaling one of them as a whole leaves the
operator unchanged as below). Biases, BatchNorm's and the other normalization layers' affine parameters and
any other parameter (a raw positional embedding) are held fixed, and named in `info["left_out"]`; BatchNorm
uses its running statistics (eval mode).

Invariance. A layer rescaling (W_l ← α W_l, b_l ← α b_l, W_{l+1} ← W_{l+1}/α) multiplies the weight block
of layer l by α and of l+1 by 1/α: with A = blockdiag(α_l I), H ← A⁻¹ H A⁻¹ and D^{1/2} ← A D^{1/2}, and
since A and D are both constant on each block the scaled matrix D^{1/2} H D^{1/2} is *the same matrix*.
Likewise for a weight layer followed by BatchNorm (the `bn` family). So the operator, and with the same
start vector the whole Lanczos iteration, is unchanged: exactly invariant to `layer` and `bn`. It is not
invariant to `node` rescaling (D is constant per layer, not per unit).

Algorithm: Lanczos with full reorthogonalization on Hessian-vector products in the scaled metric
(`flatbench.curvature.lanczos_operator`; the HVPs are forward-over-reverse over the whole measurement set
in chunks). It stops when the Ritz pair's residual ‖My − θy‖ ≤ `tol`·|θ|: an eigenvalue lies within the
residual of θ (and within residual²/gap of it), and θ never exceeds λ_max, so a converged value is within
`tol` (relative) of λ_max. Lanczos replaced the earlier power iteration (kept in this module,
`power_iteration`, for reference and its tests): power iteration converges at the rate λ₂/λ₁, and with the
honest residual rule a trained LeNet-5 needed up to its 200-product budget (43 s on 1,000 examples on the
2-core CPU), while Lanczos gets the same residual in a few dozen products. `info.converged: false` (with
`info.residual` and a `warning`) says when `max_iter` products did not reach the tolerance; λ is then a
lower bound of λ_max.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flatbench.curvature import lanczos_operator
from flatbench.measures import shared
from flatbench.measures.builtin.sharpness import mean_loss
from flatbench.measures.plugin import MeasureContext, MeasureOutput, register_measure
from flatbench.measures.registry import setting_range


def power_iteration(matvec: Callable[[Tensor], Tensor], start: Tensor, *, tol: float, max_iter: int,
                    shift: float = 0.0) -> tuple[float, int, bool, float, float]:
    """Dominant eigenvalue (largest magnitude) of the symmetric operator `matvec` + `shift`·I.

    Returns (λ − shift, iterations, converged, ‖(M + shift) v‖, relative residual ‖Mv − λv‖ / |λ − shift|):
    converged when that residual is at most `tol` (module doc).
    """
    v = start / start.norm()
    lam, norm, rel = 0.0, 0.0, float("inf")
    for it in range(1, max_iter + 1):
        w = matvec(v)
        if shift:
            w = w + shift * v
        lam, norm = float(v @ w), float(w.norm())
        if norm == 0.0:
            return -shift, it, True, 0.0, 0.0
        residual = float((w - lam * v).norm())
        rel = residual / abs(lam - shift) if lam != shift else float("inf")
        if rel <= tol:
            return lam - shift, it, True, norm, rel
        v = w / norm
    return lam - shift, max_iter, False, norm, rel


def scaled_operator(ctx: MeasureContext) -> tuple[Callable[[Tensor], Tensor], list[str], Tensor]:
    """v ↦ D^{1/2} H D^{1/2} v on the flat vector of the weight matrices (`shared.matrices`), their names, and
    D^{1/2} (flat)."""
    matrices = shared.matrices(ctx)
    params = {name: p.detach() for name, p in ctx.model.named_parameters()}
    sqrt_d = torch.cat([m.weight.norm().expand(m.weight.numel()) for m in matrices])
    sizes = [m.weight.numel() for m in matrices]

    def matvec(v: Tensor) -> Tensor:
        scaled = sqrt_d * v.to(sqrt_d.dtype)
        vec = {k: torch.zeros_like(p) for k, p in params.items()}
        for m, part in zip(matrices, torch.split(scaled, sizes)):
            m.part(vec[m.param]).copy_(part.view_as(m.weight))
        hv = ctx.hessian @ vec
        return sqrt_d * torch.cat([m.part(hv[m.param]).reshape(-1) for m in matrices])

    return matvec, [m.name for m in matrices], sqrt_d


def scaled_top_eigenvalue(ctx: MeasureContext, tol: float, max_iter: int) -> tuple[float, dict[str, Any]]:
    """λ_max of D^{1/2} H D^{1/2} by Lanczos (`flatbench.curvature.lanczos_operator`): converged when the
    Ritz pair's residual is at most `tol`·|λ| (module doc)."""
    matvec, names, sqrt_d = scaled_operator(ctx)
    out = lanczos_operator(matvec, int(sqrt_d.numel()), device=sqrt_d.device, k=1, iters=max_iter,
                           generator=ctx.generator("power_iteration"), tol=tol)
    lam = out["eigenvalues"][0]
    rel = out["residuals"][0] / max(abs(lam), 1e-300)
    info: dict[str, Any] = {"method": "lanczos", "weights": len(names), "iterations": out["iterations"],
                            "converged": out["converged"], "residual": rel, "tol": tol, "max_iter": max_iter,
                            "left_out": shared.left_out(ctx)}
    if not out["converged"]:
        info["warning"] = (f"Lanczos did not converge in {max_iter} iterations: relative residual "
                           f"{rel:.2e} > tol {tol:g}; λ is a lower bound of λ_max (raise max_iter)")
    return lam, info


@register_measure(
    "scale_invariant_rangamani", family="rescaled curvature",
    papers=("Rangamani, Nguyen, Kumar, Tran, Tran. A scale invariant flatness "
            "measure for deep network minima. 2019",),
    description="Rangamani et al. 2019: λ_max(D^½ H D^½)/(2+2L_S), D = blockdiag(‖W_l‖_F² I) over the "
                "weight matrices (Lanczos on HVPs)",
    invariant_to=("layer", "bn"), cost="hessian", defaults={"tol": 1e-4, "max_iter": 200}, uses_loss=True,
    exact=False, precision="float32",
    settings_help={"tol": "Lanczos stops when the Ritz pair's residual is at most tol × |λ|; > 0",
                   "max_iter": "maximum Lanczos steps (HVPs); stopped by it first: status not_converged; "
                               "integer ≥ 1"},
    check=lambda s: setting_range("scale_invariant_rangamani", s, {"tol": ("gt", 0), "max_iter": ("min", 1)}))
def scale_invariant_rangamani(ctx: MeasureContext) -> MeasureOutput:
    """λ_max of the layer-norm-scaled weight Hessian over 2 + 2 L_S (see the module docstring), over every weight
    matrix (an attention's q, k, v and output projections each its own block of D); the parameters held fixed
    are named in `info["left_out"]`."""
    lam, info = scaled_top_eigenvalue(ctx, float(ctx.settings["tol"]), int(ctx.settings["max_iter"]))
    loss = mean_loss(ctx)
    info.update(lambda_max=lam, loss=loss)
    if not math.isfinite(lam):
        raise RuntimeError("scale_invariant_rangamani: the power iteration produced a non-finite eigenvalue")
    return MeasureOutput({"scale_invariant_rangamani": lam / (2.0 + 2.0 * loss)}, info,
                         not_converged=None if info["converged"] else info["warning"])
