"""`hessian_density` (stochastic Lanczos quadrature, `curvature.density`) against the exact eigenvalues of
a small network's dense Hessian (138 parameters, float64): the quadrature weights, the mass in each bin,
the extreme eigenvalues and the moments."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
from torch import Tensor, nn

from flatbench.curvature import HessianOperator
from flatbench.losses import get_loss
from flatbench.measures import resolve_names
from flatbench.measures.context import MeasureContext
from flatbench.measures.registry import get_measure
from flatbench.measures.runner import compute_entry

from cases import dense_hessian

RUNS = 12
EDGES = [-math.inf, -1e-3, 1e-3, 1e-2, 5e-2, math.inf]
"""Bins of the spectrum (no eigenvalue of the network lies within 1e-5 of an edge)."""


@cache
def network() -> tuple[nn.Module, Tensor, Tensor, Tensor, Tensor]:
    """(net, x, y, eigenvalues, eigenvectors) of an untrained Tanh/ReLU net: many negative eigenvalues."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4)).double().eval()
    x, y = torch.randn(24, 6, dtype=torch.float64), torch.randint(0, 4, (24,))
    evals, evecs = torch.linalg.eigh(dense_hessian(net, x, y, get_loss("ce")))
    return net, x, y, evals, evecs


def starts(seed: int, size: int) -> list[Tensor]:
    """The start vectors `slq` draws from a generator seeded `seed` (Rademacher / √size)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 2, (size,), generator=gen) * 2 - 1).double() / math.sqrt(size) for _ in range(RUNS)]


def test_full_krylov_quadrature_is_the_exact_spectrum() -> None:
    """With as many steps as parameters the Krylov space is exhausted: every node is an eigenvalue, each
    bin's weight is exactly Σ_{λ_i in bin} (q_iᵀv)² for the start vector v, and the bin masses averaged
    over the runs are the exact fractions within their sampling error (≤ √(2p/(d·runs)) per bin)."""
    net, x, y, evals, evecs = network()
    d = evals.numel()
    out = HessianOperator(net, x, y, get_loss("ce")).spectral_density(generator=torch.Generator().manual_seed(5),
                                                                       runs=RUNS, iters=d)
    scale = float(evals.abs().max())
    for (nodes, weights), v in zip(out["quadrature"], starts(5, d)):
        assert float((nodes[:, None] - evals[None, :]).abs().min(1).values.max()) < 1e-9 * scale
        proj = (evecs.t() @ v) ** 2
        for a, b in zip(EDGES[:-1], EDGES[1:]):
            inside = (nodes >= a) & (nodes < b)
            assert float(weights[inside].sum()) == pytest.approx(float(proj[(evals >= a) & (evals < b)].sum()),
                                                                 abs=1e-9)
    for a, b in zip(EDGES[:-1], EDGES[1:]):
        exact = float(((evals >= a) & (evals < b)).double().mean())
        assert abs(out["mass"](a, b) - exact) <= 4 * math.sqrt(2 * exact / (d * RUNS)) + 1e-12, (a, b)
    grid, density = torch.tensor(out["grid"]), torch.tensor(out["density"])
    assert float(torch.trapezoid(density, grid)) == pytest.approx(1.0, abs=1e-6)


def test_few_steps_find_the_extremes_and_the_moments() -> None:
    """30 steps (of 138): the extreme Ritz values are the extreme eigenvalues; m1 and m2 (degree ≤ 2·30 − 1)
    are exactly the averages of vᵀHv and vᵀH²v over the start vectors, within 4 standard errors of
    Tr H / d, and the measure reports them."""
    net, x, y, evals, evecs = network()
    d = evals.numel()
    hess = evecs @ torch.diag(evals) @ evecs.t()
    out = HessianOperator(net, x, y, get_loss("ce")).spectral_density(generator=torch.Generator().manual_seed(7),
                                                                       runs=RUNS, iters=30)
    assert out["lambda_max"] == pytest.approx(float(evals[-1]), rel=1e-8)
    assert out["lambda_min"] == pytest.approx(float(evals[0]), rel=1e-8)
    vs = starts(7, d)
    assert out["moments"][0] == pytest.approx(sum(float(v @ hess @ v) for v in vs) / RUNS, rel=1e-10)
    assert out["moments"][1] == pytest.approx(sum(float((hess @ v).norm() ** 2) for v in vs) / RUNS, rel=1e-10)
    assert abs(out["moments"][0] - float(evals.mean())) <= 4 * out["m1_stderr"]
    assert out["hvps"] == RUNS * 30
    ctx = MeasureContext(model=net, inputs=x, targets=y, num_classes=4, measure_name="hessian_density")
    spec = get_measure("hessian_density")
    entry = compute_entry(ctx, spec, {**spec.defaults, "runs": 4, "iters": 30}, "ce")
    values, info = entry["values"], entry["info"]
    assert entry["status"] == "ok" and len(info["grid"]) == len(info["density"]) == spec.defaults["grid"]
    assert values["hessian_density/lambda_max"] == pytest.approx(float(evals[-1]), rel=1e-8)
    below = float((evals < -info["sigma"]).double().mean())  # eigenvalues that are negative beyond the resolution
    assert values["hessian_density/negative_mass"] == pytest.approx(below, abs=0.1)
    assert info["hvps"] == 4 * 30 and info["stderr"] > 0
    lo, hi = info["ci95"]  # m1 ± t_{0.975, 3} · stderr
    assert (hi - lo) / 2 == pytest.approx(3.182446305 * info["stderr"], rel=1e-8)
    assert (lo + hi) / 2 == pytest.approx(values["hessian_density"], rel=1e-12)


def test_m1s_reported_interval_is_calibrated_with_few_runs() -> None:
    """m1 (the mean of vᵀHv over `runs` start vectors) against the exact Tr H / d of the dense Hessian, over
    400 seeds of the default 5 runs: the reported 95% interval (Student's t, 4 degrees of freedom) holds it
    in about 95% of them; m1 ± 1.96 · stderr, what was reported before, in about 88% (the standard error of 5
    runs is itself an estimate from 5 values, too small about as often as too large, and t_{0.975,4} = 2.78).
    The quadrature's m1 depends on the start vector only, so two Lanczos steps on the dense matrix suffice."""
    from flatbench.curvature import slq, spectral_density

    net, x, y, evals, evecs = network()
    hess = evecs @ torch.diag(evals) @ evecs.t()
    exact, seeds, runs = float(evals.mean()), 400, 5
    inside = naive = 0
    for seed in range(seeds):
        quad = slq(lambda v: hess @ v, hess.shape[0], runs=runs, iters=2, generator=torch.Generator().manual_seed(seed))
        out = spectral_density(quad)
        lo, hi = out["m1_ci95"]
        inside += lo <= exact <= hi
        naive += abs(out["moments"][0] - exact) <= 1.96 * out["m1_stderr"]
    assert 0.93 <= inside / seeds <= 0.97, inside / seeds
    assert naive / seeds <= 0.90, naive / seeds
    assert spectral_density(slq(lambda v: hess @ v, hess.shape[0], runs=1, iters=2,
                                generator=torch.Generator().manual_seed(0)))["m1_ci95"] is None


def test_density_is_asked_for_by_name_not_by_all() -> None:
    assert "hessian_density" not in resolve_names(["all"])
    assert resolve_names(["all", "hessian_density"])[-1] == "hessian_density"
