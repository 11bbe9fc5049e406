"""Curvature baselines: the trace and the largest eigenvalue of the loss Hessian.

Both are scale-dependent (no function-preserving transformation leaves them unchanged: scaling one layer
up and the next down changes the curvature), so they declare no invariance; they are the baselines the
invariant measures of the three papers are compared with. Both use the configured loss (`ce` or
`normalized_ce`) and the measurement set in chunks (`flatbench.curvature`).
"""

from __future__ import annotations

import math
from typing import Any

from flatbench.curvature import DEFAULT_HUTCHINSON_PROBES, DiagonalResult, per_layer_traces
from flatbench.measures import shared
from flatbench.measures.plugin import MeasureContext, MeasureOutput, NotApplicable, register_measure

TRACE_DEFAULTS: dict[str, Any] = {"method": "auto", "probes": DEFAULT_HUTCHINSON_PROBES}
MAX_EIG_DEFAULTS: dict[str, Any] = {"iters": 100, "tol": 1e-6, "k": 1}


def _setting(ctx: MeasureContext, defaults: dict[str, Any], key: str) -> Any:
    """ctx.settings[key]; the runner merges the registered defaults in, direct callers may not."""
    return ctx.settings[key] if key in ctx.settings else defaults[key]


def _finite(x: float | None) -> float | None:
    """JSON-safe float (NaN, e.g. a standard error from one probe, becomes None)."""
    return None if x is None or not math.isfinite(x) else float(x)


@register_measure(
    "hessian_trace",
    description="Tr H of the loss on the measurement set: exact from the Hessian diagonal for "
                "piecewise-linear networks and smooth Sequential chains, else Hutchinson (Rademacher probes); "
                "also per parameter tensor",
    invariant_to=(), cost="hessian", uses_loss=True, defaults=TRACE_DEFAULTS)
def hessian_trace(ctx: MeasureContext) -> MeasureOutput:
    """Settings: `method` auto (exact where applicable, the shared cached diagonal) | exact (not applicable
    when the premise fails) | hutchinson (always estimate; `probes` Rademacher probes)."""
    method = _setting(ctx, TRACE_DEFAULTS, "method")
    if method not in ("auto", "exact", "hutchinson"):
        raise ValueError(f"hessian_trace: method must be auto, exact or hutchinson, got {method!r}")
    probes = int(_setting(ctx, TRACE_DEFAULTS, "probes"))
    if method == "hutchinson":
        result: DiagonalResult = shared.hutchinson_diagonal(ctx, probes)
    else:
        result = shared.hessian_diagonal(ctx)
        if method == "exact" and result.method != "exact":
            raise NotApplicable(f"exact Hessian diagonal not applicable: {result.reason}")
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


@register_measure(
    "hessian_max_eig",
    description="λ_max(H) of the loss on the measurement set by Lanczos with full reorthogonalization",
    invariant_to=(), cost="hessian", uses_loss=True, defaults=MAX_EIG_DEFAULTS, exact=False, precision="float32")
def hessian_max_eig(ctx: MeasureContext) -> MeasureOutput:
    """Settings: `iters` (maximum Lanczos steps = full-data HVPs), `tol` (relative residual), `k` (how many
    top eigenvalues to report in info; the value is the largest)."""
    k = int(_setting(ctx, MAX_EIG_DEFAULTS, "k"))
    iters = int(_setting(ctx, MAX_EIG_DEFAULTS, "iters"))
    tol = float(_setting(ctx, MAX_EIG_DEFAULTS, "tol"))
    out = ctx.hessian.top_eigenvalues(k=k, iters=iters, tol=tol, generator=ctx.generator("lanczos"))
    info: dict[str, Any] = {"residual": out["residuals"][0], "iterations": out["iterations"],
                            "converged": out["converged"], "eigenvalues": out["eigenvalues"],
                            "residuals": out["residuals"], "loss": ctx.loss_name}
    if ctx.loss_name == "normalized_ce":
        info["normalized_ce_tau"] = ctx.normalized_ce_tau
    return MeasureOutput({"hessian_max_eig": out["eigenvalues"][0]}, info)
