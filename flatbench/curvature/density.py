"""The spectral density of H by stochastic Lanczos quadrature (SLQ; Ghorbani, Krishnan & Xiao 2019, as in
PyHessian's `density()` and curvlinops' `lanczos_approximate_spectrum`).

For a unit vector v, m Lanczos steps from v give a tridiagonal T = Y diag(θ) Yᵀ, and the Gauss quadrature
with nodes θ_i and weights w_i = Y[0, i]² satisfies Σ_i w_i f(θ_i) = vᵀ f(H) v exactly for every
polynomial f of degree ≤ 2m − 1. With v = z/√d for a Rademacher z, E[vᵀ f(H) v] = Tr f(H) / d, so
averaging over `runs` start vectors estimates the spectral measure (1/d) Σ_j δ(t − λ_j): its moments up
to degree 2m − 1 without bias, its extreme eigenvalues by the extreme nodes (Lanczos finds these first),
and its mass on an interval by the weights of the nodes inside. The density on a grid is that measure
broadened by a Gaussian of standard deviation σ = `sigma` × (spectrum width): what is plotted. When the
Krylov space is exhausted (m ≥ the number of distinct eigenvalues) the nodes are the eigenvalues.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flatbench.curvature.lanczos import lanczos_tridiagonal

DENSITY_DEFAULTS: dict[str, Any] = {"runs": 5, "iters": 50, "grid": 200, "sigma": 0.01}
"""Start vectors, Lanczos steps per run (HVPs: runs × iters), grid points, broadening relative to the
spectrum's width."""


def quadrature(alphas: Tensor, betas: Tensor) -> tuple[Tensor, Tensor]:
    """(nodes θ, weights w) of the Gauss quadrature of a Lanczos tridiagonal: its eigenvalues and the
    squared first components of its eigenvectors (they add up to 1)."""
    tri = torch.diag(alphas)
    if betas.numel():
        tri = tri + torch.diag(betas, 1) + torch.diag(betas, -1)
    theta, vecs = torch.linalg.eigh(tri)
    return theta, vecs[0] ** 2


def slq(matvec: Callable[[Tensor], Tensor], size: int, *, runs: int, iters: int, generator: torch.Generator,
        device: torch.device | str = "cpu") -> list[tuple[Tensor, Tensor]]:
    """The quadrature (nodes, weights) of each of `runs` Rademacher start vectors, `iters` Lanczos steps each
    (fewer where the Krylov space is exhausted). Deterministic given the generator's state."""
    out = []
    for _ in range(max(1, int(runs))):
        bits = torch.randint(0, 2, (size,), generator=generator, device=generator.device)
        v = ((bits * 2 - 1).to(torch.float64) / math.sqrt(size)).to(device)
        out.append(quadrature(*lanczos_tridiagonal(matvec, v, iters)))
    return out


def _moment_stats(quad: list[tuple[Tensor, Tensor]], k: int) -> tuple[float, float]:
    """(mean over runs of Σ w θ^k, its standard error over runs: the sample standard deviation with ddof 1
    over √runs; NaN with one run)."""
    per_run = torch.tensor([float((w * t ** k).sum()) for t, w in quad], dtype=torch.float64)
    se = float(per_run.std() / math.sqrt(len(quad))) if len(quad) > 1 else float("nan")
    return float(per_run.mean()), se


def student_interval(mean: float, stderr: float, runs: int, level: float = 0.95) -> tuple[float, float] | None:
    """The `level` confidence interval of a mean of `runs` independent values from their standard error:
    mean ± t_{(1+level)/2, runs−1} · stderr (Student's t; None with one run).

    Why not mean ± 1.96 · stderr: the standard error is right on average (its mean square is m1's
    variance: ddof 1, nothing left out), but with few runs it is itself estimated from a handful of values,
    and it is too small more often than too large (the per-run values vᵀHv are skewed: their median standard
    error was 0.83-0.91× m1's spread at 5 runs, 0.60-0.67× at 2). On the density test's networks
    (scripts/density_stderr_calibration.py: the exact Tr H / d of the dense Hessian, 2,000 seeds)
    m1 ± 1.96 · stderr held the exact value in 86-88% of the seeds with 5 runs (68-69% with 2); this t
    interval in 93-96% (t_{0.975, 4} = 2.78), and 200 seeds through the measure's own HessianOperator
    path likewise (85% and 87% before, 91.5% and 95% after). Where one eigenvalue dominates (vᵀHv is then
    close to a scaled χ²₁) 5 runs cannot see their own spread and the t interval still holds only 84% (77%
    before); more runs help slowly (87% at 10, 91% at 30)."""
    if runs < 2 or not math.isfinite(stderr):
        return None
    from scipy.stats import t as student_t  # lazy: scipy.stats costs a few hundred ms to import

    half = float(student_t.ppf(0.5 + level / 2, runs - 1)) * stderr
    return mean - half, mean + half


def spectral_density(quad: list[tuple[Tensor, Tensor]], *, grid: int = 200, sigma: float = 0.01) -> dict[str, Any]:
    """The SLQ estimate from the quadratures of several runs: `grid` and `density` (the Gaussian-broadened
    measure, integrating to 1), `sigma` (absolute), `moments` m1..m4 (mean eigenvalue, ...), `m1_stderr` (over
    the runs, ddof 1), `m1_ci95` (m1's 95% interval by Student's t with runs − 1 degrees of freedom:
    `student_interval`; None with one run),
    `lambda_min`/`lambda_max` (extreme nodes), `negative_mass` (the weight of nodes below −σ: eigenvalues
    within the resolution of zero, e.g. a cluster of exact zeros that a short quadrature places on either
    side, are not counted as negative) and `mass(a, b)`, the estimated fraction of eigenvalues in [a, b)."""
    nodes = torch.cat([t for t, _ in quad])
    weights = torch.cat([w for _, w in quad]) / len(quad)
    lo, hi = float(nodes.min()), float(nodes.max())
    width = hi - lo if hi > lo else max(abs(hi), 1e-12)
    s = float(sigma) * width
    t = torch.linspace(lo - 0.05 * width - 3 * s, hi + 0.05 * width + 3 * s, max(2, int(grid)), dtype=torch.float64)
    kernel = torch.exp(-0.5 * ((t[:, None] - nodes[None, :]) / s) ** 2) / (s * math.sqrt(2 * math.pi))
    moments = [_moment_stats(quad, k) for k in (1, 2, 3, 4)]

    def mass(a: float, b: float) -> float:
        return float(weights[(nodes >= a) & (nodes < b)].sum())

    return {"grid": t.tolist(), "density": (kernel @ weights).tolist(), "sigma": s,
            "moments": [m for m, _ in moments], "m1_stderr": moments[0][1],
            "m1_ci95": student_interval(moments[0][0], moments[0][1], len(quad)), "lambda_min": lo, "lambda_max": hi,
            "negative_mass": float(weights[nodes < -s].sum()), "mass": mass}
