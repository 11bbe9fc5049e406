"""PAC-Bayes flatness (Jiang et al. 2020, "Fantastic generalization measures", eqs. 53 and 61).

    pacbayes_flatness     = 1 / σ'²,  σ' the largest σ with  E_{u ~ N(0, σ² I)} [acc(θ) − acc(θ+u)] ≤ 0.1
    pacbayes_mag_flatness = 1 / σ'²,  same with u_i ~ N(0, σ² θ_i² + ε²), ε = 1e-3

σ is a standard deviation. In the magnitude-aware version σ²θ_i² + ε² is the **variance** of u_i
(`u_i = sqrt(σ²θ_i² + ε²) · z_i`, z standard normal); a widely copied port passes it to `torch.normal`
as the standard deviation, which is a different measure. Accuracy is measured on the measurement set with
the labels the model was trained on, in eval mode. **All parameters** are perturbed (Linear / Conv2d
weights and biases, BatchNorm's affine weight and bias); BatchNorm running statistics are buffers and
stay fixed.

The search is Jiang et al.'s bisection (their public code's defaults: σ in [0, 2], depth 15, 10
Monte-Carlo perturbations per σ, stop when the mean drop is within 0.01 of the target 0.1). Refinements:
the same 10 standard-normal draws z_m (common random numbers, from the run's seeded generator) are used
at every σ, so the estimated drop is a deterministic function of σ and the search is reproducible; the
upper end is doubled (at most `max_expansions` times) until the drop exceeds the target, and a model
whose accuracy never drops by the target raises an error that says so
instead of returning a meaningless σ; a model that does not fit its data (training accuracy below the target
drop, or within it of chance) is not applicable, with the reason. If the tolerance is not met within the depth, σ' is the largest σ
whose drop was at most the target (the lower end of the final bracket) and `info.met_target` is False.

The draws z_m depend on the run's seed and the parameters' shapes only, so they are kept in the context's
`draws`, shared by every context of the run (the audit's rescaled copies read them instead of drawing
them again). Optionally (`rtol` > 0; default 0, the fixed 10 draws) the draws at each σ stop once the mean
drop's standard error is at most rtol × |mean drop|, from `min_samples` draws on: far from the target
(drops near 0 or near 0.9) a few draws settle the bisection's comparison, near it all `samples` are used;
each evaluation then records its draws, and info the total (`draws`) against the fixed-size search's
(`draws_fixed`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from flatbench.measures.builtin import JIANG
from flatbench.measures.plugin import MeasureContext, MeasureOutput, NotApplicable, register_measure
from flatbench.measures.registry import setting_range


class SearchFailed(RuntimeError):
    """A search could not bracket its target; the message says why (recorded as the measure's error)."""


def standard_normals(params: dict[str, Tensor], generator: torch.Generator) -> dict[str, Tensor]:
    """z ~ N(0, 1) per entry of every parameter, drawn in parameter order from `generator`. They are drawn
    in float64 whatever the parameters' dtype and then rounded to it, so a float32 computation perturbs the
    model by the same numbers as a float64 one (not by another random stream)."""
    return {name: torch.randn(p.shape, generator=generator, device=generator.device, dtype=torch.float64)
            .to(device=p.device, dtype=p.dtype) for name, p in params.items()}


def scale_perturbation(params: dict[str, Tensor], sigma: float, z: dict[str, Tensor],
                       magnitude_eps: float | None = None) -> dict[str, Tensor]:
    """u = σ·z, or sqrt(σ²θ² + ε²)·z when `magnitude_eps` = ε is given (variance, not std)."""
    if magnitude_eps is None:
        return {name: sigma * z[name] for name in params}
    return {name: torch.sqrt(sigma ** 2 * p ** 2 + magnitude_eps ** 2) * z[name]
            for name, p in params.items()}


def draw_perturbation(params: dict[str, Tensor], sigma: float, generator: torch.Generator,
                      magnitude_eps: float | None = None) -> dict[str, Tensor]:
    """u ~ N(0, σ²) per entry, or N(0, σ²θ² + ε²) when `magnitude_eps` = ε is given (variance, not std)."""
    return scale_perturbation(params, sigma, standard_normals(params, generator), magnitude_eps)


def accuracy(ctx: MeasureContext, params: dict[str, Tensor] | None = None) -> float:
    """Fraction of the measurement set classified as its (training) label, at `params` or the model's own;
    NotApplicable on regression targets (floating point), where there is no accuracy to drop."""
    if ctx.regression:
        raise NotApplicable(f"{ctx.measure_name or 'PAC-Bayes flatness'} searches for the noise that drops the "
                            "accuracy, which regression targets (floating point) do not have")
    correct = 0
    with torch.no_grad():
        for x, y in ctx.chunks():
            out = ctx.model(x) if params is None else functional_call(ctx.model, params, (x,))
            correct += int((out.argmax(dim=1) == y).sum())
    return correct / ctx.n


def accuracy_drops(ctx: MeasureContext, sigma: float, generators: list[torch.Generator | None],
                   base_accuracy: float, magnitude_eps: float | None = None,
                   normals: list[dict[str, Tensor]] | None = None) -> Tensor:
    """acc(θ) − acc(θ + u_m) for one perturbation u_m per generator (float64 tensor); `normals` are the
    standard-normal draws of those generators when already drawn (the same numbers, reused across σ)."""
    params = {name: p.detach() for name, p in ctx.model.named_parameters()}
    drops = []
    for m, gen in enumerate(generators):
        z = normals[m] if normals is not None else standard_normals(params, gen)
        noise = scale_perturbation(params, sigma, z, magnitude_eps)
        drops.append(base_accuracy - accuracy(ctx, {k: params[k] + noise[k] for k in params}))
    return torch.tensor(drops, dtype=torch.float64)


def _check_fit(ctx: MeasureContext, base: float, target: float, tol: float,
               reached: tuple[float, float] | None = None) -> None:
    """NotApplicable for a model that does not fit its data: training accuracy below the target drop, or
    (`reached` = (σ, drop): the largest noise tried did not drop it by the target) within it of chance."""
    if base < target:
        raise NotApplicable(f"the model does not fit its data: training accuracy {base:.4f} is below the target "
                            f"accuracy drop {target}, so no noise level σ can be bracketed (train the model first)")
    if reached is not None and base - 1.0 / ctx.num_classes < target + tol:
        raise NotApplicable(f"the model does not fit its data: training accuracy {base:.4f} is within the target "
                            f"drop {target} of chance (1/{ctx.num_classes}), and noise up to σ = {reached[0]:g} drops "
                            f"it by only {reached[1]:.4f} (train the model first)")


def run_normals(ctx: MeasureContext, params: dict[str, Tensor], samples: int) -> list[dict[str, Tensor]] | None:
    """The draws z_0 .. z_{samples−1} (`standard_normals` from the generators `sample0`, `sample1`, ...), or
    None when they do not fit the memory budget. They depend on the run's seed, the measure and the
    parameters' shapes only, so they are kept in `ctx.draws`, which every context of the run shares: a
    rescaled copy of the model (the population audit's) reads the numbers it would draw alone."""
    size = samples * sum(p.numel() * p.element_size() for p in params.values())
    if size > ctx.max_memory_mb * 2 ** 20:
        return None
    shapes = tuple((name, tuple(p.shape), p.dtype, str(p.device)) for name, p in params.items())
    out = []
    for m in range(samples):
        key = ("standard_normals", ctx.seed, ctx.measure_name, f"sample{m}", shapes)
        if key not in ctx.draws:
            ctx.draws[key] = standard_normals(params, ctx.generator(f"sample{m}"))
        out.append(ctx.draws[key])
    return out


def _search_info(sigma: float, bracket: tuple[float, float], drops: tuple[float, float], drop: float,
                 drop_se: float, base: float, met: bool, steps: int, expansions: int,
                 evaluations: list[dict[str, float]], s: dict[str, Any]) -> dict[str, Any]:
    """What the σ search reports, with the delta-method standard error of 1/σ'² from the drop's Monte-Carlo
    error and the bracket's slope."""
    (lo, hi), (d_lo, d_hi) = bracket, drops
    slope = (d_hi - d_lo) / (hi - lo) if hi > lo else float("nan")
    sigma_se = drop_se / slope if slope and slope > 0 else float("inf")
    rtol, samples = float(s.get("rtol", 0.0)), int(s["samples"])
    info = {"method": "bisection", "sigma": sigma, "accuracy": base, "accuracy_drop": drop,
            "accuracy_drop_stderr": drop_se, "target_drop": float(s["target_drop"]),
            "tolerance": float(s["tolerance"]), "met_target": met, "bracket": [lo, hi],
            "iterations": len(evaluations), "bisection_steps": steps, "upper_expansions": expansions,
            "samples": samples, "stderr": 2.0 * sigma_se / sigma ** 3, "evaluations": evaluations}
    if rtol > 0:
        info.update(rtol=rtol, min_samples=int(s.get("min_samples", 3)),
                    draws=sum(e["samples"] for e in evaluations), draws_fixed=samples * len(evaluations))
    return info


def sigma_search(ctx: MeasureContext, magnitude_eps: float | None) -> tuple[float, dict[str, Any]]:
    s = ctx.settings
    target, tol = float(s["target_drop"]), float(s["tolerance"])
    samples, depth = int(s["samples"]), int(s["search_depth"])
    rtol, min_samples = float(s.get("rtol", 0.0)), int(s.get("min_samples", 3))
    base = accuracy(ctx)
    evaluations: list[dict[str, float]] = []
    # Common random numbers: the same draws z_m (from generators with fixed seeds) at every σ. They are
    # drawn once and kept when they fit the memory budget (drawing them dominated the search's time on the
    # CPU); otherwise drawn again at each σ from fresh generators, which gives the same numbers.
    params = {name: p.detach() for name, p in ctx.model.named_parameters()}
    normals = run_normals(ctx, params, samples)

    def drop_at(sigma: float) -> tuple[float, float]:
        # draw m's accuracy drop, m = 0, 1, ...: all `samples` of them, or (rtol > 0) until the mean drop's
        # standard error is at most rtol × |mean drop| (from min_samples draws on)
        drops: list[float] = []
        for m in range(samples):
            z = normals[m] if normals is not None else standard_normals(params, ctx.generator(f"sample{m}"))
            noise = scale_perturbation(params, sigma, z, magnitude_eps)
            drops.append(base - accuracy(ctx, {k: params[k] + noise[k] for k in params}))
            if rtol > 0 and min_samples <= len(drops) < samples:
                d = torch.tensor(drops, dtype=torch.float64)
                if float(d.std(unbiased=True)) / math.sqrt(len(drops)) <= rtol * abs(float(d.mean())):
                    break
        d = torch.tensor(drops, dtype=torch.float64)
        k = len(drops)
        mean = float(d.mean())
        se = float(d.std(unbiased=True)) / math.sqrt(k) if k > 1 else float("nan")
        evaluations.append({"sigma": sigma, "drop": mean, "stderr": se, **({"samples": k} if rtol > 0 else {})})
        return mean, se

    _check_fit(ctx, base, target, tol)
    lo, hi = 0.0, float(s["sigma_max"])
    d_lo, se_lo = 0.0, 0.0
    if magnitude_eps is not None:
        d_lo, se_lo = drop_at(0.0)
        if d_lo >= target - tol:
            raise SearchFailed(f"{ctx.measure_name}: the ε = {magnitude_eps} noise alone drops the accuracy "
                               f"by "
                               f"{d_lo:.4f}, within {tol} of the target {target} or above; σ' would be 0 "
                               f"(not bracketed)")
    d_hi, se_hi = drop_at(hi)
    expansions = 0
    while d_hi < target - tol and expansions < int(s["max_expansions"]):
        lo, d_lo, se_lo = hi, d_hi, se_hi
        hi *= 2.0
        d_hi, se_hi = drop_at(hi)
        expansions += 1
    if d_hi < target - tol:
        _check_fit(ctx, base, target, tol, (hi, d_hi))
        raise SearchFailed(f"{ctx.measure_name}: could not bracket σ: the accuracy drop at σ = {hi:g} is "
                           f"only "
                           f"{d_hi:.4f} < target {target} (training accuracy {base:.4f}, "
                           f"{expansions} doublings of the upper end)")
    met = abs(d_hi - target) <= tol
    sigma, drop, drop_se = hi, d_hi, se_hi
    steps = 0
    while not met and steps < depth:
        mid = 0.5 * (lo + hi)
        d_mid, se_mid = drop_at(mid)
        steps += 1
        if abs(d_mid - target) <= tol:
            met, sigma, drop, drop_se = True, mid, d_mid, se_mid
        elif d_mid > target:
            hi, d_hi, se_hi = mid, d_mid, se_mid
        else:
            lo, d_lo, se_lo = mid, d_mid, se_mid
    if not met:
        if lo <= 0.0:
            raise SearchFailed(f"{ctx.measure_name}: no σ > 0 with accuracy drop ≤ {target} found down to "
                               f"σ = {hi:g} after {steps} bisection steps (not bracketed from below)")
        sigma, drop, drop_se = lo, d_lo, se_lo
    info = _search_info(sigma, (lo, hi), (d_lo, d_hi), drop, drop_se, base, met, steps, expansions, evaluations,
                        s)
    if magnitude_eps is not None:
        info["magnitude_eps"] = magnitude_eps
    return sigma, info


_DEFAULTS = {"target_drop": 0.1, "tolerance": 0.01, "samples": 10, "search_depth": 15, "sigma_max": 2.0,
             "max_expansions": 10, "rtol": 0.0, "min_samples": 3}
_ADDED = ("rtol", "min_samples")
"""Settings added after the committed results: their defaults (rtol 0) are the fixed-size search."""
_HELP = {"target_drop": "the accuracy drop σ' is searched for (Jiang et al.: 0.1); in (0, 1)",
         "tolerance": "the search stops when the mean drop is within this of target_drop; > 0",
         "samples": "noise draws per σ (the same draws at every σ; the most drawn when rtol > 0); integer ≥ 1",
         "rtol": "at each σ, stop drawing once the mean drop's standard error is at most rtol × |mean drop| (from "
                 "min_samples draws on; a draw is a forward pass over the measurement set); 0: always `samples` "
                 "draws (Jiang et al.'s fixed 10, the default); ≥ 0",
         "min_samples": "rtol > 0: the fewest draws at a σ before its standard error is trusted; integer ≥ 2",
         "search_depth": "bisection steps at most; integer ≥ 1",
         "sigma_max": "the upper end of the first bracket [0, sigma_max]; > 0",
         "max_expansions": "doublings of the upper end at most, while the drop there is below the target; "
                           "integer ≥ 0",
         "eps": "ε of the magnitude-aware noise N(0, σ²θ² + ε²); ≥ 0"}
_RULES = {"target_drop": ("gt", 0), "tolerance": ("gt", 0), "samples": ("min", 1), "search_depth": ("min", 1),
          "sigma_max": ("gt", 0), "max_expansions": ("min", 0), "eps": ("min", 0), "rtol": ("min", 0),
          "min_samples": ("min", 2)}


@register_measure(
    "pacbayes_flatness", family="PAC-Bayes",
    papers=(JIANG, "Dziugaite, Drouin, Neal, Rajkumar, Caballero, Wang, Mitliagkas, Roy. In search of "
            "robust measures of generalization. NeurIPS 2020"),
    description="Jiang et al. 2020 eq. 53: 1/σ'², σ' the largest σ with E_u~N(0,σ²I) acc drop ≤ 0.1 "
                "(bisection)",
    invariant_to=(), cost="search", defaults=dict(_DEFAULTS), stochastic=True, precision="float32",
    fixed_loss="accuracy (the 0-1 loss)", settings_help={k: v for k, v in _HELP.items() if k in _DEFAULTS},
    check=lambda s: setting_range("pacbayes_flatness", s, _RULES), added_settings=_ADDED)
def pacbayes_flatness(ctx: MeasureContext) -> MeasureOutput:
    """1/σ'² for isotropic Gaussian weight noise (all parameters perturbed, BatchNorm buffers fixed)."""
    sigma, info = sigma_search(ctx, None)
    return MeasureOutput({"pacbayes_flatness": 1.0 / sigma ** 2}, info)


@register_measure(
    "pacbayes_mag_flatness", family="PAC-Bayes", papers=(JIANG,),
    description="Jiang et al. 2020 eq. 61: 1/σ'² with magnitude-aware noise u_i ~ N(0, σ'²θ_i² + ε²) "
                "(bisection)",
    invariant_to=(), cost="search", defaults={**_DEFAULTS, "eps": 1e-3}, stochastic=True, precision="float32",
    fixed_loss="accuracy (the 0-1 loss)", settings_help=_HELP,
    check=lambda s: setting_range("pacbayes_mag_flatness", s, _RULES), added_settings=_ADDED)
def pacbayes_mag_flatness(ctx: MeasureContext) -> MeasureOutput:
    """1/σ'² for magnitude-aware noise of variance σ²θ_i² + ε² (all parameters, BatchNorm buffers fixed).

    Not declared invariant to node/layer rescaling: the additive ε² breaks it (with ε = 0 it would hold).
    """
    sigma, info = sigma_search(ctx, float(ctx.settings["eps"]))
    return MeasureOutput({"pacbayes_mag_flatness": 1.0 / sigma ** 2}, info)
