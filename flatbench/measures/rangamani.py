"""Rangamani et al. 2019's scale-invariant flatness: the top Hessian eigenvalue in a layer-scaled metric.

    scale_invariant_rangamani = λ_max(D^{1/2} H D^{1/2}) / (2 + 2 L_S),   D = blockdiag(‖W_l‖_F² I)

with H the Hessian of the mean loss L_S over the Linear / Conv2d **weights** only (biases and BatchNorm's
affine parameters are held fixed; BatchNorm uses its running statistics, eval mode), W_l the weight
tensor of layer l.

Invariance. A layer rescaling (W_l ← α W_l, b_l ← α b_l, W_{l+1} ← W_{l+1}/α) multiplies the weight block
of layer l by α and of l+1 by 1/α: with A = blockdiag(α_l I), H ← A⁻¹ H A⁻¹ and D^{1/2} ← A D^{1/2}, and
since A and D are both constant on each block the scaled matrix D^{1/2} H D^{1/2} is *the same matrix*.
Likewise for a weight layer followed by BatchNorm (the `bn` family). So the operator, and with the same
start vector the whole power iteration, is unchanged: exactly invariant to `layer` and `bn`. It is not
invariant to `node` rescaling (D is constant per layer, not per unit).

Algorithm: power iteration on Hessian-vector products (forward-over-reverse, over the whole measurement
set in chunks, `flatbench.curvature.hvp`). *Stopping rule*: the residual of the Ritz pair,
‖Mv − λv‖ ≤ `tol`·|λ| (λ = vᵀMv, ‖v‖ = 1), as `flatbench.curvature.lanczos` does. For a symmetric M an
eigenvalue lies within the residual of λ (and within residual²/gap of it), so a converged λ is within
`tol` (relative) of an eigenvalue, and the Rayleigh quotient never exceeds λ_max. The earlier rule
(successive Rayleigh quotients within `tol`) stops far too early when the top two eigenvalues are close,
because the quotient then changes little per iteration while it is still far off: on a 40 × 40 matrix
with λ₂/λ₁ = 0.99 (tests/test_solvers.py) it stopped after 9 iterations, 0.9% below λ₁, at tol = 1e-4.
The residual rule needs 593 iterations there (then 1e-6 off); with the default budget, `max_iter` = 200
HVPs (typical trained nets here converge in 6–40), it reports `info.converged: false` with
`info.residual` (the final relative residual, 4e-3 there) and a `warning`, and λ is the last Rayleigh
quotient, a lower bound of λ_max (0.2% below it there).

Power iteration finds the eigenvalue of largest magnitude; if that is negative, or ‖Mv‖ exceeds |vᵀMv|
by more than 10% (v still mixes eigenvalues ±λ of similar size), a second run on D^{1/2} H D^{1/2} + sI
with s the magnitude found gives λ_max (`info.shifted`); its residual is the same as that of the
unshifted operator and is tested against `tol`·|λ| of the unshifted eigenvalue. `info.converged` reports
whether the (last) run met the tolerance within `max_iter` iterations.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from flatbench.curvature import hvp
from flatbench.measures.context import MeasureContext
from flatbench.measures import shared
from flatbench.measures.registry import MeasureOutput, register_measure
from flatbench.measures.sharpness import mean_loss


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
    """v ↦ D^{1/2} H D^{1/2} v on the flat vector of weights, the weight names, and D^{1/2} (flat)."""
    layers = shared.layers(ctx)
    params = {name: p.detach() for name, p in ctx.model.named_parameters()}
    names = [f"{layer.name}.weight" for layer in layers]
    names = [n for i, n in enumerate(names) if n in params and n not in names[:i]]
    sqrt_d = torch.cat([params[n].norm().expand(params[n].numel()) for n in names])
    sizes = [params[n].numel() for n in names]

    def matvec(v: Tensor) -> Tensor:
        scaled = sqrt_d * v
        vec = {k: torch.zeros_like(p) for k, p in params.items()}
        for n, part in zip(names, torch.split(scaled, sizes)):
            vec[n] = part.view_as(params[n])
        hv = hvp(ctx.model, ctx.inputs, ctx.targets, ctx.loss, vec, chunk_size=ctx.chunk_size)
        return sqrt_d * torch.cat([hv[n].reshape(-1) for n in names])

    return matvec, names, sqrt_d


def scaled_top_eigenvalue(ctx: MeasureContext, tol: float, max_iter: int) -> tuple[float, dict[str, Any]]:
    matvec, names, sqrt_d = scaled_operator(ctx)
    gen = ctx.generator("power_iteration")

    def start() -> Tensor:
        z = torch.randn(sqrt_d.shape, generator=gen, device=gen.device, dtype=sqrt_d.dtype)
        return z.to(sqrt_d.device)

    lam, iters, converged, norm, rel = power_iteration(matvec, start(), tol=tol, max_iter=max_iter)
    info: dict[str, Any] = {"method": "power_iteration", "weights": len(names), "iterations": iters,
                            "converged": converged, "residual": rel, "tol": tol, "max_iter": max_iter,
                            "shifted": False, "dominant_eigenvalue": lam}
    # ‖Mv‖ well above |vᵀMv| means v still mixes eigenvalues of both signs of similar size.
    if lam < 0 or norm > 1.1 * abs(lam):
        shift = max(abs(lam), norm)
        lam, iters2, converged, _, rel = power_iteration(matvec, start(), tol=tol, max_iter=max_iter,
                                                         shift=shift)
        info.update(shifted=True, shift=shift, iterations=iters + iters2, converged=converged, residual=rel)
    if not info["converged"]:
        info["warning"] = (f"power iteration did not converge in {max_iter} iterations: relative residual "
                           f"{rel:.2e} > tol {tol:g}; λ is a lower bound of λ_max (raise max_iter)")
    return lam, info


@register_measure(
    "scale_invariant_rangamani",
    description="Rangamani et al. 2019: λ_max(D^½ H D^½)/(2+2L_S), D = blockdiag(‖W_l‖_F² I) over the "
                "weights "
                "(power iteration on HVPs)",
    invariant_to=("layer", "bn"), cost="hessian", defaults={"tol": 1e-4, "max_iter": 200}, uses_loss=True,
    exact=False)
def scale_invariant_rangamani(ctx: MeasureContext) -> MeasureOutput:
    """λ_max of the layer-norm-scaled weight Hessian over 2 + 2 L_S (see the module docstring)."""
    lam, info = scaled_top_eigenvalue(ctx, float(ctx.settings["tol"]), int(ctx.settings["max_iter"]))
    loss = mean_loss(ctx)
    info.update(lambda_max=lam, loss=loss)
    if not math.isfinite(lam):
        raise RuntimeError("scale_invariant_rangamani: the power iteration produced a non-finite eigenvalue")
    return MeasureOutput({"scale_invariant_rangamani": lam / (2.0 + 2.0 * loss)}, info)
