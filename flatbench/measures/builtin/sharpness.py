"""Worst- and average-case sharpness: Keskar's ε-sharpness and Kwon / Andriushchenko's adaptive sharpness.

All of them perturb **every parameter** of the model (Linear / Conv2d weights and biases, BatchNorm's
affine weight and bias); buffers (BatchNorm running mean and variance) are never perturbed, and the model
is evaluated in eval mode, so BatchNorm uses its running statistics. Perturbed parameters are evaluated
with `torch.func.functional_call`: the model itself is never modified.

**The ascent.** Every worst-case measure maximizes a loss over a perturbation set of the form

    δ = c ⊙ u,   ‖u‖_p ≤ ρ,   p ∈ {2, ∞}

with a fixed positive (or zero) scale vector c: `c_i = ε(|θ_i| + 1)`, ρ = 1, p = ∞ for ε-sharpness (the
box of Keskar et al.), `c_i = |θ_i|` for adaptive sharpness. The search runs in the normalized coordinates
u with APGD (Croce & Hein 2020: steepest-ascent steps for the norm, sign of the gradient for ℓ∞ and the
normalized gradient for ℓ2, momentum 0.75, first step size 2ρ, step halved at the APGD checkpoints when
too few steps improved the objective, restart from the best point). It starts from u = 0 and uses no
randomness. The gradient in u is `c ⊙ ∇_δ L`; for adaptive sharpness and a rescaling θ' = Tθ by a
positive diagonal T that leaves the network function unchanged (layer-, node- and BN-wise rescaling)
the gradient in u, the constraint and hence the whole search path are the same, so adaptive sharpness
is exactly invariant to those rescalings (not only to first order), up to floating-point rounding.

The ascent is `ascend(objective, scale, rho=, norm=, iters=)` on any objective `δ ↦ (value, ∇value)`,
so it can be checked on closed-form toy losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from flatbench.curvature.common import require_graph
from flatbench.measures import shared
from flatbench.measures.builtin import ADAPTIVE, JIANG
from flatbench.measures.plugin import MeasureContext, MeasureOutput, register_measure
from flatbench.measures.registry import setting_range


APGD_MOMENTUM = 0.75
"""Weight of the new step in APGD's momentum update (Croce & Hein 2020)."""
APGD_SUCCESS_RATIO = 0.75
"""APGD halves the step at a checkpoint when fewer than this fraction of the steps since the last one
improved the best value."""


# ---------------------------------------------------------------- parameters as one flat vector


def param_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters (detached), keyed like `named_parameters()`; buffers are not included."""
    return {name: p.detach() for name, p in model.named_parameters()}


def flatten(tensors: dict[str, Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors.values()])


def unflatten(flat: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    out, offset = {}, 0
    for name, ref in like.items():
        out[name] = flat[offset:offset + ref.numel()].view_as(ref)
        offset += ref.numel()
    return out


def mean_loss(ctx: MeasureContext, params: dict[str, Tensor] | None = None) -> float:
    """L_S at `params` (default: the model's own), over the whole measurement set in chunks."""
    total = 0.0
    with torch.no_grad():
        for x, y in ctx.chunks():
            out = ctx.model(x) if params is None else functional_call(ctx.model, params, (x,))
            total += float(ctx.loss.per_example(out, y).sum())
    return total / ctx.n


def loss_and_grad(model: nn.Module, batches: list[tuple[Tensor, Tensor]], loss: Any,
                  params: dict[str, Tensor], n: int) -> tuple[float, Tensor]:
    """Mean loss over `batches` (n examples in all) at `params` and its gradient as a flat vector."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    grads = [torch.zeros_like(v) for v in leaves.values()]
    total = 0.0
    with torch.enable_grad():
        for x, y in batches:
            value = require_graph(loss.per_example(functional_call(model, leaves, (x,)), y).sum() / n)
            for acc, g in zip(grads, torch.autograd.grad(value, list(leaves.values()), allow_unused=True)):
                if g is not None:
                    acc += g
            total += float(value.detach())
    return total, torch.cat([g.reshape(-1) for g in grads])


# ---------------------------------------------------------------- APGD ascent


@dataclass
class AscentResult:
    u: Tensor
    """The best normalized perturbation found (δ = scale ⊙ u), flat."""
    value: float
    """The objective at the best perturbation."""
    base: float
    """The objective at δ = 0."""
    iterations: int
    step_reductions: int
    final_step: float
    converged: bool
    """The best value improved by at most `rtol` × (value − base) over the last fifth of the iterations."""
    last_gain: float


def apgd_checkpoints(iters: int) -> list[int]:
    """Iterations after which APGD checks its progress: ⌈p_j N⌉ with p_0 = 0, p_1 = 0.22,
    p_{j+1} = p_j + max(p_j − p_{j−1} − 0.03, 0.06)."""
    p = [0.0, 0.22]
    while p[-1] < 1.0:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
    return sorted({math.ceil(q * iters) for q in p[1:] if 0 < math.ceil(q * iters) <= iters})


def _project(u: Tensor, rho: float, norm: str) -> Tensor:
    if norm == "linf":
        return u.clamp(-rho, rho)
    size = float(u.norm())
    return u * (rho / size) if size > rho else u


def _direction(g_u: Tensor, norm: str) -> Tensor:
    if norm == "linf":
        return g_u.sign()
    size = float(g_u.norm())
    return g_u / size if size > 0 else torch.zeros_like(g_u)


def ascend(objective: Callable[[Tensor], tuple[float, Tensor]], scale: Tensor, *, rho: float, norm: str,
           iters: int, rtol: float = 1e-3) -> AscentResult:
    """Maximize `objective(δ)` over δ = scale ⊙ u, ‖u‖_norm ≤ rho, by APGD from u = 0.

    `objective` returns the value and its gradient with respect to δ (flat). Each iteration costs one
    objective evaluation; the best point seen is returned. Deterministic.
    """
    if norm not in ("l2", "linf"):
        raise ValueError(f"norm must be l2 or linf, got {norm!r}")
    if rho <= 0 or iters < 1:
        raise ValueError(f"need rho > 0 and iters ≥ 1 (got rho={rho}, iters={iters})")
    u = torch.zeros_like(scale)
    base, grad = objective(scale * u)
    best_value, best_u, best_grad = base, u, grad
    step = 2.0 * rho
    checkpoints = set(apgd_checkpoints(iters))
    u_prev = u
    successes, last_checkpoint, reductions = 0, 0, 0
    best_at_checkpoint, reduced_at_last = base, False
    history = [base]
    for k in range(iters):
        z = _project(u + step * _direction(scale * grad, norm), rho, norm)
        if k == 0:
            u_new = z
        else:
            u_new = _project(u + APGD_MOMENTUM * (z - u) + (1 - APGD_MOMENTUM) * (u - u_prev), rho, norm)
        u_prev, u = u, u_new
        value, grad = objective(scale * u)
        if value > best_value:
            best_value, best_u, best_grad = value, u, grad
            successes += 1
        history.append(best_value)
        if k + 1 in checkpoints:
            too_few = successes < APGD_SUCCESS_RATIO * (k + 1 - last_checkpoint)
            stalled = (not reduced_at_last) and best_value == best_at_checkpoint
            reduced_at_last = too_few or stalled
            if reduced_at_last:
                step /= 2.0
                reductions += 1
                u, u_prev, grad = best_u, best_u, best_grad
            successes, last_checkpoint, best_at_checkpoint = 0, k + 1, best_value
    window = max(1, iters // 5)
    last_gain = history[-1] - history[-1 - window]
    total_gain = best_value - base
    converged = last_gain <= rtol * total_gain if total_gain > 0 else last_gain == 0
    return AscentResult(u=best_u, value=best_value, base=base, iterations=iters, step_reductions=reductions,
                        final_step=step, converged=bool(converged), last_gain=float(last_gain))


def _model_objective(ctx: MeasureContext, batches: list[tuple[Tensor, Tensor]], theta: dict[str, Tensor]
                     ) -> Callable[[Tensor], tuple[float, Tensor]]:
    n = sum(int(x.shape[0]) for x, _ in batches)
    flat_theta = flatten(theta)

    def objective(delta: Tensor) -> tuple[float, Tensor]:
        return loss_and_grad(ctx.model, batches, ctx.loss, unflatten(flat_theta + delta, theta), n)

    return objective


def _batches(ctx: MeasureContext, size: int) -> list[tuple[Tensor, Tensor]]:
    size = max(1, int(size))
    return [(ctx.inputs[i:i + size], ctx.targets[i:i + size]) for i in range(0, ctx.n, size)]


# ---------------------------------------------------------------- ε-sharpness (Keskar et al. 2017)

SEARCH_HELP = {
    "eps": "the box's half-width relative to |θ_i| + 1 (Keskar et al.: 1e-3); > 0",
    "iters": "APGD steps of the search (a lower bound of the maximum; more steps, a larger value); integer ≥ 1",
    "rho": "the radius ρ of the adaptive ball (worst case) or of the noise N(0, ρ² diag θ²) (average case); > 0",
    "batch_size": "examples per batch: each batch gets its own perturbation (m-sharpness with m = batch_size), the "
                  "batches are averaged; integer ≥ 1",
    "samples": "Monte-Carlo noise draws per batch (the standard error is in info); the most drawn when rtol > 0; "
               "integer ≥ 1",
    "rtol": "stop drawing once the estimate's standard error is at most rtol × |estimate| (checked after each "
            "round of one draw per batch, from min_samples rounds on; info says whether it was met); 0: always "
            "`samples` draws (the fixed-size estimate, the default); ≥ 0",
    "min_samples": "rtol > 0: the fewest draws per batch before the standard error is trusted; integer ≥ 2"}
SEARCH_RULES = {"eps": ("gt", 0), "iters": ("min", 1), "rho": ("gt", 0), "batch_size": ("min", 1),
                "samples": ("min", 1), "rtol": ("min", 0), "min_samples": ("min", 2)}


def _help(keys: tuple[str, ...]) -> dict[str, str]:
    return {k: SEARCH_HELP[k] for k in keys}


@register_measure(
    "eps_sharpness", family="sharpness",
    papers=("Keskar, Mudigere, Nocedal, Smelyanskiy, Tang. On large-batch training for deep "
            "learning: generalization gap and sharp minima. ICLR 2017", JIANG),
    description="Keskar et al. 2017: 100·(max_{|z_i| ≤ ε(|θ_i|+1)} L(θ+z) − L(θ))/(1+L(θ)), APGD on the box",
    invariant_to=(), cost="search", defaults={"eps": 1e-3, "iters": 20}, uses_loss=True, exact=False,
    precision="float32", settings_help=_help(("eps", "iters")),
    check=lambda s: setting_range("eps_sharpness", s, SEARCH_RULES))
def eps_sharpness(ctx: MeasureContext) -> MeasureOutput:
    """ε-sharpness over the full parameter space (all parameters; BatchNorm buffers fixed), one
    perturbation for the whole measurement set, found by APGD (`iters` steps) on the box. The result is a
    lower bound of the true maximum; `info.converged` says whether the last fifth of the steps still
    improved it."""
    eps = float(ctx.settings["eps"])
    theta = param_dict(ctx.model)
    scale = eps * (flatten(theta).abs() + 1.0)
    result = ascend(_model_objective(ctx, ctx.chunks(), theta), scale, rho=1.0, norm="linf",
                    iters=int(ctx.settings["iters"]))
    value = 100.0 * (result.value - result.base) / (1.0 + result.base)
    return MeasureOutput({"eps_sharpness": value}, {
        "method": "apgd_box", "loss": result.base, "max_loss": result.value, "iterations": result.iterations,
        "step_reductions": result.step_reductions, "converged": result.converged,
        "last_gain": result.last_gain})


# ---------------------------------------------------------------- adaptive sharpness


def adaptive_worst_case(ctx: MeasureContext, *, rho: float, norm: str, iters: int, batch_size: int,
                        adaptive: bool = True, keep_deltas: bool = False
                        ) -> tuple[float, dict[str, Any], list[Tensor]]:
    """Average over batches of max_{‖δ/c‖_p ≤ ρ} L_B(θ+δ) − L_B(θ), c = |θ| (or 1 if not adaptive).

    Each batch of `batch_size` examples gets its own perturbation (Andriushchenko et al.'s m-sharpness
    with m = batch_size); batches are weighted by their size. Returns the value, the info and, with
    `keep_deltas`, the perturbations δ found (flat, one per batch; else an empty list).
    """
    theta = param_dict(ctx.model)
    flat = flatten(theta)
    scale = flat.abs() if adaptive else torch.ones_like(flat)
    total, deltas = 0.0, []
    iterations = reductions = converged = 0
    batches = _batches(ctx, batch_size)
    for batch in batches:
        result = ascend(_model_objective(ctx, [batch], theta), scale, rho=rho, norm=norm, iters=iters)
        total += (result.value - result.base) * int(batch[0].shape[0])
        if keep_deltas:
            deltas.append(scale * result.u)
        iterations += result.iterations
        reductions += result.step_reductions
        converged += int(result.converged)
    info = {"method": f"apgd_{norm}", "rho": rho, "batches": len(batches), "batch_size": int(batch_size),
            "iterations": iterations, "step_reductions": reductions, "batches_converged": converged,
            "converged": converged == len(batches)}
    return total / ctx.n, info, deltas


class AverageCaseLogits:
    """The logits the average case needs, per batch of the measurement set: at θ, and at θ + δ_m for the
    draws δ_m = ρ |θ| ⊙ z_m, z_m ~ N(0, I) (so δ_m ~ N(0, ρ² diag θ²)), fresh noise for every batch:
    batch b's draw m is draw b·samples + m of the measure's seeded generator (`shared.normal_draws`, in
    float64 and rounded to the parameters' dtype, so a float32 computation sees the same random numbers).
    The perturbed logits are computed on demand, in order, and kept: a Monte-Carlo estimate stopped at its
    standard error computes only the draws it uses."""

    def __init__(self, ctx: MeasureContext, rho: float, samples: int, batch_size: int):
        self.model, self.rho, self.samples = ctx.model, float(rho), int(samples)
        self.theta = param_dict(ctx.model)
        self.flat = flatten(self.theta)
        self.batches = _batches(ctx, batch_size)
        self.draws = shared.normal_draws(ctx, "average_case", self.samples * len(self.batches),
                                         int(self.flat.numel()), self.flat.dtype)
        self._base: dict[int, Tensor] = {}
        self._perturbed: list[list[Tensor]] = [[] for _ in self.batches]

    def base(self, b: int) -> Tensor:
        if b not in self._base:
            with torch.no_grad():
                self._base[b] = functional_call(self.model, self.theta, (self.batches[b][0],))
        return self._base[b]

    def perturbed(self, b: int, m: int) -> Tensor:
        """The logits of batch b at θ + δ_m (m < samples)."""
        done = self._perturbed[b]
        with torch.no_grad():
            while len(done) <= m:
                noise = self.draws[b * self.samples + len(done)]
                delta = self.rho * self.flat.abs() * noise
                done.append(functional_call(self.model, unflatten(self.flat + delta, self.theta),
                                            (self.batches[b][0],)))
        return done[m]


def average_case_logits(ctx: MeasureContext, *, rho: float, samples: int, batch_size: int) -> AverageCaseLogits:
    """The `AverageCaseLogits` of the context's model, kept in its cache: the draws do not depend on the loss,
    so the measure's entry for a second loss (`@normalized_ce`) evaluates its loss on the same logits instead
    of running the same forward passes again. The draws themselves are the run's (`ctx.draws`): a rescaled
    copy of the model perturbs its parameters by the same z_m without drawing them again."""
    key = ("average_case_logits", ctx.measure_name, float(rho), int(samples), int(batch_size))
    return ctx.cached(key, lambda: AverageCaseLogits(ctx, rho, samples, batch_size))


def _mc_estimate(diffs: list[list[float]], weights: list[float], m: int) -> tuple[float, float]:
    """The size-weighted mean over batches of the per-batch sample means of `m` draws, and its standard
    error (NaN from one draw)."""
    total, variance = 0.0, 0.0
    for d_list, weight in zip(diffs, weights):
        d = torch.tensor(d_list[:m], dtype=torch.float64)
        total += weight * float(d.mean())
        if m > 1:
            variance += weight ** 2 * float(d.var(unbiased=True)) / m
    return total, math.sqrt(variance) if m > 1 else float("nan")


def adaptive_average_case(ctx: MeasureContext, *, rho: float, samples: int, batch_size: int, rtol: float = 0.0,
                          min_samples: int = 2) -> tuple[float, dict[str, Any]]:
    """E_{δ ~ N(0, ρ² diag θ²)} [L_B(θ+δ)] − L_B(θ), averaged over batches (fresh noise per batch).

    Monte-Carlo with `samples` draws per batch from `ctx.generator()` (`average_case_logits`, shared by the
    losses); the standard error is that of the size-weighted mean of the per-batch sample means. With
    `rtol` > 0 the draws are taken one round at a time (draw m of every batch) and sampling stops after the
    first round m ≥ `min_samples` at which the standard error is at most `rtol` × |estimate| (at most
    `samples` rounds); the rounds used, the tolerance and whether it was met are in info. `rtol` = 0 (the
    default) takes all `samples` draws: the fixed-size estimate.
    """
    logits = average_case_logits(ctx, rho=rho, samples=samples, batch_size=batch_size)
    weights = [int(y.shape[0]) / ctx.n for _, y in logits.batches]
    diffs: list[list[float]] = [[] for _ in logits.batches]
    with torch.no_grad():
        bases = [float(ctx.loss(logits.base(b), y)) for b, (_, y) in enumerate(logits.batches)]
        m = 0
        while m < samples:
            for b, (_, y) in enumerate(logits.batches):
                diffs[b].append(float(ctx.loss(logits.perturbed(b, m), y)) - bases[b])
            m += 1
            if rtol > 0 and min_samples <= m < samples:
                value, se = _mc_estimate(diffs, weights, m)
                if se <= rtol * abs(value):
                    break
    total, stderr = _mc_estimate(diffs, weights, m)
    info: dict[str, Any] = {"method": "monte_carlo", "rho": rho, "samples": m * len(logits.batches),
                            "samples_per_batch": m, "batch_size": int(batch_size), "stderr": stderr}
    if rtol > 0:
        met = bool(stderr <= rtol * abs(total)) if m > 1 else False
        info.update(rtol=rtol, min_samples=int(min_samples), max_samples_per_batch=int(samples),
                    rel_stderr=stderr / abs(total) if total else float("inf"), met_rtol=met)
    return total, info


def _register_adaptive_worst_case(norm: str, symbol: str, rho: float) -> None:
    """Register `adaptive_sharpness_<norm>`: the worst case in the ℓ2 or ℓ∞ adaptive ball."""
    name = f"adaptive_sharpness_{norm}"

    def measure(ctx: MeasureContext) -> MeasureOutput:
        value, info, _ = adaptive_worst_case(ctx, rho=float(ctx.settings["rho"]), norm=norm,
                                             iters=int(ctx.settings["iters"]),
                                             batch_size=int(ctx.settings["batch_size"]))
        return MeasureOutput({name: value}, info)

    measure.__name__ = name
    measure.__doc__ = (f"Worst-case {symbol} adaptive sharpness (Kwon et al. 2021; Andriushchenko et al. 2023 "
                       "defaults: ρ from their ResNet grid, 20 APGD steps, batches of 128). All parameters are "
                       "perturbed, BatchNorm buffers are fixed; parameters equal to zero are never perturbed "
                       "(c = |θ|).")
    register_measure(
        name, family="sharpness", papers=(ADAPTIVE,),
        description=f"worst-case adaptive sharpness max_{{‖δ/|θ|‖{symbol[1:]} ≤ ρ}} L_B(θ+δ) − L_B(θ), "
                          "APGD per batch, averaged",
        invariant_to=("layer", "node", "bn"), cost="search",
        defaults={"rho": rho, "iters": 20, "batch_size": 128}, uses_loss=True, exact=False,
        precision="float32", settings_help=_help(("rho", "iters", "batch_size")),
        check=lambda s: setting_range(name, s, SEARCH_RULES))(measure)


_register_adaptive_worst_case("l2", "ℓ₂", 0.5)
_register_adaptive_worst_case("linf", "ℓ∞", 0.002)


@register_measure(
    "adaptive_sharpness_avg", family="sharpness", papers=(ADAPTIVE,),
    description="average-case adaptive sharpness E_{δ~N(0, ρ² diag θ²)} L_B(θ+δ) − L_B(θ), Monte-Carlo "
                "per batch",
    invariant_to=("layer", "node", "bn"), cost="gradient",
    defaults={"rho": 0.1, "samples": 20, "batch_size": 128, "rtol": 0.0, "min_samples": 5}, uses_loss=True,
    stochastic=True, precision="float32",
    settings_help=_help(("rho", "samples", "batch_size", "rtol", "min_samples")),
    check=lambda s: setting_range("adaptive_sharpness_avg", s, SEARCH_RULES), added_settings=("rtol", "min_samples"))
def adaptive_sharpness_avg(ctx: MeasureContext) -> MeasureOutput:
    """Average-case adaptive sharpness (Andriushchenko et al. 2023: ρ from their ResNet grid, 20 draws
    per batch of 128). All parameters are perturbed, BatchNorm buffers are fixed. Noise comes from the
    run's seeded generator, so a re-run gives the same value; `info.stderr` is its Monte-Carlo error.
    `rtol` > 0 stops drawing at that relative standard error (`samples` draws at most)."""
    value, info = adaptive_average_case(ctx, rho=float(ctx.settings["rho"]),
                                        samples=int(ctx.settings["samples"]),
                                        batch_size=int(ctx.settings["batch_size"]),
                                        rtol=float(ctx.settings.get("rtol", 0.0)),
                                        min_samples=int(ctx.settings.get("min_samples", 5)))
    return MeasureOutput({"adaptive_sharpness_avg": value}, info)
