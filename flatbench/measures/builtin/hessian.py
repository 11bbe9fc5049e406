"""Curvature baselines: the trace and the largest eigenvalue of the loss Hessian, and its spectral density.

Both are scale-dependent (no function-preserving transformation leaves them unchanged: scaling one layer
up and the next down changes the curvature), so they declare no invariance; they are the baselines the
invariant measures of the three papers are compared with. Both use the configured loss (`ce` or
`normalized_ce`) and the measurement set in chunks (`flatbench.curvature`).
"""

from __future__ import annotations

import math
from typing import Any

from flatbench.curvature import (DEFAULT_HUTCHINSON_PROBES, DENSE_MAX_PARAMS, DENSITY_DEFAULTS, HUTCHPP_DEFAULTS,
                                 DiagonalResult, per_layer_traces)
from flatbench.errors import FlatbenchError
from flatbench.measures import shared
from flatbench.measures.builtin import JIANG
from flatbench.measures.plugin import MeasureContext, MeasureOutput, NotApplicable, register_measure
from flatbench.measures.registry import setting_range


TRACE_DEFAULTS: dict[str, Any] = {"method": "auto", "probes": DEFAULT_HUTCHINSON_PROBES,
                                 "exact_max_params": DENSE_MAX_PARAMS,
                                 **{k: HUTCHPP_DEFAULTS[k] for k in ("rtol", "max_hvps", "sketch", "max_sketch")}}
TRACE_METHODS = ("auto", "exact", "hutchinson", "hutchpp")
MAX_EIG_DEFAULTS: dict[str, Any] = {"iters": 100, "tol": 1e-6, "k": 1, "per": "none"}
PER_CHOICES = ("none", "layer", "block")
TRACE_HELP = {
    "method": "auto (exact where it can be, else Hutch++) | exact (not applicable where no exact path applies) "
              "| hutchpp | hutchinson",
    "probes": "Rademacher probes of method hutchinson (full-data HVPs); integer ≥ 1",
    "exact_max_params": "up to this many parameters the trace is exact for any architecture (one second-order "
                        "backward pass per parameter); integer ≥ 0, 0 turns it off",
    "rtol": "Hutch++ stops when its standard error is at most rtol × |estimate|; > 0",
    "max_hvps": "Hutch++ budget in HVPs, all counted: the initial sketch (2 × sketch), one per vector a growth "
                "adds, every probe (discarded ones included); integer ≥ 1; reached first: status not_converged, "
                "converged false in info",
    "sketch": "Hutch++ initial deflation vectors (the top of the spectrum whose trace is computed exactly); the "
              "sketch grows from there while that is predicted to cost fewer HVPs than more probes (up to "
              "max_sketch); integer ≥ 0, 0 starts as plain Hutchinson",
    "max_sketch": "the largest the Hutch++ sketch may grow to; integer ≥ 0, at most sketch (e.g. 0 with sketch 0: "
                  "plain Hutchinson) keeps it fixed; growth also stops where the sketch's vectors (2 × 8 bytes × "
                  "parameters × sketch) would pass measure.max_memory_mb"}
MAX_EIG_HELP = {
    "iters": "maximum Lanczos steps (= full-data HVPs); integer ≥ 1",
    "tol": "stop when every wanted Ritz pair's residual ‖Hy − θy‖ is at most tol × max |θ|; > 0",
    "k": "how many top eigenvalues to report in info (the value is the largest); integer ≥ 1",
    "per": "none | layer (also λ_max of each layer's diagonal block of H: the parameters a module holds itself, "
           "e.g. a Linear's weight and bias) | block (of each top-level child module's block: a Sequential's "
           "items, a ResNet's stages, a transformer's blocks; parameters held by the model itself each on their "
           "own), in info `per_layer` / `per_block`; iters and tol apply to each"}


TRACE_RULES = {"method": ("in", TRACE_METHODS), "probes": ("min", 1), "exact_max_params": ("min", 0),
               "rtol": ("gt", 0), "max_hvps": ("min", 1), "sketch": ("min", 0), "max_sketch": ("min", 0)}
MAX_EIG_RULES = {"iters": ("min", 1), "tol": ("gt", 0), "k": ("min", 1), "per": ("in", PER_CHOICES)}
DENSITY_RULES = {"runs": ("min", 1), "iters": ("min", 1), "grid": ("range", (2, 100_000)), "sigma": ("gt", 0)}


def check_density(settings: dict[str, Any]) -> None:
    """DENSITY_RULES, and a broadening no finer than the grid's spacing: sampled more coarsely than its σ, the
    Gaussian-broadened density no longer integrates to 1 (its peaks fall between grid points)."""
    setting_range("hessian_density", settings, DENSITY_RULES)
    grid = int(settings.get("grid", DENSITY_DEFAULTS["grid"]))
    sigma = float(settings.get("sigma", DENSITY_DEFAULTS["sigma"]))
    finest = 1.1 / (grid - 7) if grid > 7 else 1.0  # the spacing (1.1 width + 6σ) / (grid − 1) ≤ σ·width
    if sigma < finest:
        raise FlatbenchError(f"measure.settings.hessian_density.sigma: {sigma:g} is finer than the grid's spacing "
                             f"({grid} points need sigma ≥ {finest:.3g}): the density would not integrate to 1; "
                             "raise sigma or grid")


def _setting(ctx: MeasureContext, defaults: dict[str, Any], key: str) -> Any:
    """ctx.settings[key]; the runner merges the registered defaults in, direct callers may not."""
    return ctx.settings[key] if key in ctx.settings else defaults[key]


def _finite(x: float | None) -> float | None:
    """JSON-safe float (NaN, e.g. a standard error from one probe, becomes None)."""
    return None if x is None or not math.isfinite(x) else float(x)


@register_measure(
    "hessian_trace", family="curvature",
    papers=("Meyer, Musco, Musco, Woodruff. Hutch++: optimal stochastic trace estimation. SOSA 2021",),
    description="Tr H of the loss on the measurement set: exact from the Hessian diagonal for "
                "piecewise-linear networks, smooth Sequential chains and small models, else Hutch++ to a "
                "requested relative standard error; also per parameter tensor",
    invariant_to=(), cost="hessian", uses_loss=True, defaults=TRACE_DEFAULTS, settings_help=TRACE_HELP,
    check=lambda s: setting_range("hessian_trace", s, TRACE_RULES))
def hessian_trace(ctx: MeasureContext) -> MeasureOutput:
    """Settings: `method` auto (exact where it can be: the shared cached diagonal of piecewise-linear
    networks and smooth Sequential chains, else one HVP per parameter up to `exact_max_params` parameters;
    else Hutch++) | exact (not applicable where none of the exact paths applies) | hutchpp (always Hutch++:
    stop at relative standard error `rtol`, at most `max_hvps` HVPs, `sketch` deflation vectors to start
    with, grown up to `max_sketch` while that saves HVPs) | hutchinson (`probes` Rademacher probes)."""
    method = _setting(ctx, TRACE_DEFAULTS, "method")
    if method not in TRACE_METHODS:
        raise ValueError(f"hessian_trace: method must be one of {', '.join(TRACE_METHODS)}, got {method!r}")
    if method == "hutchinson":
        return _diagonal_output(ctx, shared.hutchinson_diagonal(ctx, int(_setting(ctx, TRACE_DEFAULTS, "probes"))))
    reason = "hutchpp requested"
    if method != "hutchpp":
        applies, reason = ctx.hessian.exact_diagonal_applies()
        limit = int(_setting(ctx, TRACE_DEFAULTS, "exact_max_params"))
        if applies or ctx.hessian.size <= min(limit, DENSE_MAX_PARAMS):  # the shared diagonal is exact then
            result: DiagonalResult = shared.hessian_diagonal(ctx)
            if result.method == "exact":
                return _diagonal_output(ctx, result)
            reason = result.reason
        if ctx.hessian.size <= limit:
            return _diagonal_output(ctx, shared.dense_diagonal(ctx))
        reason = f"{reason}; {ctx.hessian.size} parameters > exact_max_params ({limit})"
        if method == "exact":
            raise NotApplicable(f"exact Hessian diagonal not applicable: {reason}")
    return _hutchpp_output(ctx, reason)


def _diagonal_output(ctx: MeasureContext, result: DiagonalResult) -> MeasureOutput:
    """The trace and per-tensor traces of a diagonal (exact, or Hutchinson's with its standard errors)."""
    per_param = per_layer_traces(result)
    values = {"hessian_trace": sum(per_param.values())}
    values.update({f"hessian_trace/{name}": v for name, v in per_param.items()})
    info: dict[str, Any] = {"method": result.method, "reason": result.reason, "loss": ctx.loss_name,
                            "n_examples": result.n}
    if result.method == "hutchinson":
        info.update(probes=result.probes, stderr=_finite(result.total_trace_stderr),
                    stderr_per_param={k: _finite(v) for k, v in (result.trace_stderr or {}).items()})
    if ctx.loss_name == "normalized_ce":
        info["normalized_ce_tau"] = ctx.normalized_ce_tau
    return MeasureOutput(values, info)


def _hutchpp_output(ctx: MeasureContext, reason: str) -> MeasureOutput:
    """Hutch++ until the relative standard error is `rtol` (`curvature.trace`): the estimate, the error
    it reached, its cost in HVPs and whether it converged within `max_hvps`."""
    rtol, max_hvps = float(_setting(ctx, TRACE_DEFAULTS, "rtol")), int(_setting(ctx, TRACE_DEFAULTS, "max_hvps"))
    sketch = int(_setting(ctx, TRACE_DEFAULTS, "sketch"))
    max_sketch = int(_setting(ctx, TRACE_DEFAULTS, "max_sketch"))
    if not rtol > 0 or max_hvps < 1 or sketch < 0 or max_sketch < 0:
        raise ValueError(f"hessian_trace: rtol must be > 0, max_hvps ≥ 1, sketch ≥ 0 and max_sketch ≥ 0 (got {rtol}, "
                         f"{max_hvps}, {sketch}, {max_sketch})")
    out = ctx.hessian.hutchpp_trace(generator=ctx.generator("hutchpp"), rtol=rtol, max_hvps=max_hvps, sketch=sketch,
                                    max_sketch=max_sketch, max_memory_mb=ctx.max_memory_mb)
    values = {"hessian_trace": out["trace"]}
    values.update({f"hessian_trace/{name}": v for name, v in out["per_param"].items()})
    info: dict[str, Any] = {"method": "hutchpp", "reason": reason, "loss": ctx.loss_name, "n_examples": ctx.n,
                            "stderr": _finite(out["stderr"]), "rel_stderr": _finite(out["rel_stderr"]),
                            "rtol": rtol, "converged": out["converged"], "hvps": out["hvps"],
                            "probes": out["probes"], "probes_total": out["probes_total"], "sketch": out["sketch"],
                            "sketch_sizes": out["sketch_sizes"], "sketch_rounds": out["sketch_rounds"],
                            "max_sketch": out["max_sketch"],
                            "stderr_per_param": {k: _finite(v) for k, v in out["stderr_per_param"].items()}}
    if ctx.loss_name == "normalized_ce":
        info["normalized_ce_tau"] = ctx.normalized_ce_tau
    stuck = None if out["converged"] else (f"Hutch++ spent its budget of {max_hvps} HVPs at relative standard "
                                           f"error {out['rel_stderr']:.3g} > rtol {rtol:g} (raise max_hvps)")
    return MeasureOutput(values, info, not_converged=stuck)


@register_measure(
    "hessian_max_eig", family="curvature", papers=("Keskar et al. ICLR 2017 (sharpness as λ_max)", JIANG),
    description="λ_max(H) of the loss on the measurement set by Lanczos with full reorthogonalization",
    invariant_to=(), cost="hessian", uses_loss=True, defaults=MAX_EIG_DEFAULTS, exact=False, precision="float32",
    settings_help=MAX_EIG_HELP, check=lambda s: setting_range("hessian_max_eig", s, MAX_EIG_RULES))
def hessian_max_eig(ctx: MeasureContext) -> MeasureOutput:
    """Settings: `iters` (maximum Lanczos steps = full-data HVPs), `tol` (relative residual), `k` (how many
    top eigenvalues to report in info; the value is the largest), `per` (none | layer | block: also the
    top eigenvalue of each layer's or block's diagonal block of H, in info). Stopped by `iters` before
    `tol`: status not_converged, with the relative residual reached.

    Info: `eigenvalues` (the k largest Ritz values), `relative_residual` (the top Ritz pair's
    ‖Hy − θy‖ / |θ|: for k = 1 the number `tol` bounds and the not_converged reason gives; for k > 1 the
    reason gives the stopping rule's number, the largest residual of the k pairs over the largest |θ|) and
    `absolute_residual` (‖Hy − θy‖ itself), `relative_residuals` / `absolute_residuals` (the same for each
    of the k pairs), `iterations`, `converged`; with `per`, the same names per layer or block."""
    k = int(_setting(ctx, MAX_EIG_DEFAULTS, "k"))
    iters = int(_setting(ctx, MAX_EIG_DEFAULTS, "iters"))
    tol = float(_setting(ctx, MAX_EIG_DEFAULTS, "tol"))
    per = str(_setting(ctx, MAX_EIG_DEFAULTS, "per"))
    out = ctx.hessian.top_eigenvalues(k=k, iters=iters, tol=tol, generator=ctx.generator("lanczos"))
    info: dict[str, Any] = {"relative_residual": _finite(_relative(out["residuals"][0], out["eigenvalues"][0])),
                            "absolute_residual": out["residuals"][0], "iterations": out["iterations"],
                            "converged": out["converged"], "eigenvalues": out["eigenvalues"],
                            "relative_residuals": [_finite(_relative(r, v)) for r, v in zip(out["residuals"],
                                                                                              out["eigenvalues"])],
                            "absolute_residuals": out["residuals"], "loss": ctx.loss_name}
    # the stopping rule's number: the largest residual of the k pairs relative to the largest |θ| (k = 1: the
    # top pair's relative residual)
    rule = _relative(max(out["residuals"]), max(abs(v) for v in out["eigenvalues"]))
    stuck = [] if out["converged"] else [_unconverged("H", rule, iters, tol)]
    if per != "none":
        blocks = ctx.hessian.block_top_eigenvalues(parameter_groups(ctx.model, per), iters=iters, tol=tol,
                                                   generator=ctx.generator(f"lanczos_{per}"))
        info[f"per_{per}"] = {name: _named_residuals(b) for name, b in blocks.items()}
        stuck += [_unconverged(f"{per} {name}", _relative(b["residual"], b["eigenvalue"]), iters, tol)
                  for name, b in blocks.items() if not b["converged"]]
    if ctx.loss_name == "normalized_ce":
        info["normalized_ce_tau"] = ctx.normalized_ce_tau
    not_converged = "; ".join(stuck[:3]) + (f" (and {len(stuck) - 3} more)" if len(stuck) > 3 else "") if stuck \
        else None
    return MeasureOutput({"hessian_max_eig": out["eigenvalues"][0]}, info, not_converged=not_converged)


def _relative(residual: float, value: float) -> float:
    """A Ritz pair's residual ‖Hy − θy‖ relative to |θ| (what `tol` bounds; inf for θ = 0 with a residual)."""
    return residual / abs(value) if value else (0.0 if residual == 0 else math.inf)


def _named_residuals(block: dict[str, Any]) -> dict[str, Any]:
    """One block's Lanczos result with its residual under names that say what they are: `relative_residual`
    (‖Hy − θy‖ / |θ|, what `tol` bounds) and `absolute_residual` (‖Hy − θy‖)."""
    out = {k: v for k, v in block.items() if k != "residual"}
    out.update(relative_residual=_finite(_relative(block["residual"], block["eigenvalue"])),
               absolute_residual=block["residual"])
    return out


def _unconverged(what: str, relative_residual: float, iters: int, tol: float) -> str:
    """Why a Lanczos run is not converged: the cap it stopped at and the relative residual it reached."""
    return (f"Lanczos on {what} stopped at iters = {iters} with relative residual {relative_residual:.3g} > tol "
            f"{tol:g} (raise iters)")


def parameter_groups(model: Any, per: str) -> dict[str, list[str]]:
    """The parameters by layer (each module's own parameters: `fc1` -> [fc1.weight, fc1.bias]) or by block
    (each top-level child's parameters; a parameter the model holds itself is a group of its own), in
    `named_parameters` order."""
    groups: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        key = (owner or leaf) if per == "layer" else name.split(".", 1)[0]
        groups.setdefault(key, []).append(name)
    return groups


DENSITY_HELP = {
    "runs": "start vectors (Rademacher); the moments' standard error and m1's 95% interval (Student's t, runs − 1 "
            "degrees of freedom) are over them; integer ≥ 1",
    "iters": "Lanczos steps per run (HVPs: runs × iters; fewer where the Krylov space is exhausted); moments up "
             "to degree 2·iters − 1 are unbiased; integer ≥ 1",
    "grid": "points of the density's grid (from below λ_min to above λ_max); integer in [2, 100000]",
    "sigma": "Gaussian broadening, a fraction of the spectrum's width λ_max − λ_min; > 0, and at least "
             "1.1 / (grid − 7): no finer than the grid's spacing"}


@register_measure(
    "hessian_density", family="curvature",
    papers=("Ghorbani, Krishnan, Xiao. An investigation into neural net optimization via Hessian "
            "eigenvalue density. ICML 2019",),
    description="Spectral density of H by stochastic Lanczos quadrature (Ghorbani et al. 2019): the mean "
                "eigenvalue (headline), moments, extreme eigenvalues and negative mass as values, the "
                "Gaussian-broadened density on a grid in info; asked for by name (not in `all`)",
    invariant_to=(), cost="hessian", uses_loss=True, defaults=DENSITY_DEFAULTS, stochastic=True,
    precision="float32", settings_help=DENSITY_HELP, in_all=False,
    check=check_density)
def hessian_density(ctx: MeasureContext) -> MeasureOutput:
    """The eigenvalue distribution of H, (1/d) Σ_j δ(t − λ_j), by `runs` Lanczos quadratures of `iters` steps
    (`curvature.density`). Values: `hessian_density` the mean eigenvalue Tr H / d, `/m2` the mean squared
    eigenvalue, `/lambda_min` and `/lambda_max` the extreme Ritz values, `/negative_mass` the estimated
    fraction of eigenvalues below −σ (the broadening: zero up to the resolution is not negative). Info:
    `grid` and `density` (what PyHessian's `density()` plots),
    `sigma`, `moments` (m1..m4), `stderr` (of m1 over the runs: their standard deviation, ddof 1, over
    √runs), `ci95` (m1's 95% interval, m1 ± t_{0.975, runs−1} · stderr: with the default 5 runs 2.78 standard
    errors, not 1.96, since 5 runs estimate their own spread poorly; None with one run), `hvps`."""
    runs, iters = int(_setting(ctx, DENSITY_DEFAULTS, "runs")), int(_setting(ctx, DENSITY_DEFAULTS, "iters"))
    grid, sigma = int(_setting(ctx, DENSITY_DEFAULTS, "grid")), float(_setting(ctx, DENSITY_DEFAULTS, "sigma"))
    if runs < 1 or iters < 1 or grid < 2 or not sigma > 0:
        raise ValueError(f"hessian_density: runs ≥ 1, iters ≥ 1, grid ≥ 2 and sigma > 0 (got {runs}, {iters}, "
                         f"{grid}, {sigma})")
    out = ctx.hessian.spectral_density(generator=ctx.generator("slq"), runs=runs, iters=iters, grid=grid,
                                       sigma=sigma)
    values = {"hessian_density": out["moments"][0], "hessian_density/m2": out["moments"][1],
              "hessian_density/lambda_min": out["lambda_min"], "hessian_density/lambda_max": out["lambda_max"],
              "hessian_density/negative_mass": out["negative_mass"]}
    info: dict[str, Any] = {"grid": out["grid"], "density": out["density"], "sigma": out["sigma"],
                            "moments": out["moments"], "stderr": _finite(out["m1_stderr"]),
                            "ci95": None if out["m1_ci95"] is None else [float(v) for v in out["m1_ci95"]],
                            "hvps": out["hvps"],
                            "runs": runs, "iters": iters, "loss": ctx.loss_name}
    if ctx.loss_name == "normalized_ce":
        info["normalized_ce_tau"] = ctx.normalized_ce_tau
    return MeasureOutput(values, info)
