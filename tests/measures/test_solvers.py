"""The solvers behind minimum sharpness, normalized sharpness and Rangamani's flatness: stopping rules,
the published (SGD) solver and its registered variants."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from torch import nn

from flatbench.errors import FlatbenchError
from flatbench.measures import NotApplicable, all_measures
from flatbench.measures.context import MeasureContext
from flatbench.measures.builtin.minimum_sharpness import solve_minimum_sharpness, solve_minimum_sharpness_published
from flatbench.measures.builtin.normalized import (KKT_TOL, layer_problems, solve_normalized_sharpness,
                                           solve_normalized_sharpness_published)
from flatbench.measures.builtin.rangamani import power_iteration
from flatbench.measures.registry import get_measure
from flatbench.measures.runner import compute_entry
from flatbench.models import MLP

PUBLISHED_MEASURES = ("minimum_sharpness", "normalized_sharpness", "normalized_sharpness_nce")


# ---------------------------------------------------------------- helpers


def _data(n: int, d: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=gen, dtype=torch.float64),
            torch.randint(0, classes, (n,), generator=gen))


def _trained(bias: bool, seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x, y = _data(96, 20, 4, seed)
    model = MLP(20, (12, 10), 4, bias=bias).double()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), x, y


@pytest.fixture(scope="module")
def mlp():
    return _trained(True, 0)


@pytest.fixture(scope="module")
def mlp_nobias():
    return _trained(False, 1)


def _ctx(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> MeasureContext:
    return MeasureContext(model=model, inputs=x, targets=y, num_classes=4, run_id="solvers")


def _run(name: str, model_xy, loss: str = "ce", **settings):
    """Run a measure (or a variant `name:variant`) with its settings; returns the MeasureOutput."""
    spec = get_measure(name)
    return spec.fn(_ctx(*model_xy).for_measure(spec.name, {**spec.settings(), **settings}, loss_name=loss))


def _near_decomposable(m1: int, n1: int, m2: int, n2: int, coupling: float, seed: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """H, W² block-diagonal (two blocks of very different scales) plus `coupling` × a dense positive part."""
    gen = torch.Generator().manual_seed(seed)

    def pos(m: int, n: int) -> torch.Tensor:
        return torch.exp(torch.randn(m, n, generator=gen, dtype=torch.float64))

    h, q = coupling * pos(m1 + m2, n1 + n2), coupling * pos(m1 + m2, n1 + n2)
    h[:m1, :n1], q[:m1, :n1] = pos(m1, n1), pos(m1, n1)
    h[m1:, n1:], q[m1:, n1:] = 5.0 * pos(m2, n2), 0.01 * pos(m2, n2)
    return h, q


def _reference_ns(h: torch.Tensor, q: torch.Tensor) -> float:
    """The optimum by scipy's exact-Hessian trust region in (log σ, log σ'), log σ'_0 = 0 fixing the flat
    direction; independent of flatbench's solver."""
    hn, qn = h.numpy(), q.numpy()
    m, n = hn.shape
    keep = [i for i in range(m + n) if i != m]

    def parts(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        u, v = z[:m], np.concatenate([[0.0], z[m:]])
        e = np.exp(u[:, None] + v[None, :])
        return hn * e, qn / e

    def fun(z):
        a, b = parts(z)
        return float(a.sum() + b.sum())

    def jac(z):
        a, b = parts(z)
        g = a - b
        return np.concatenate([g.sum(1), g.sum(0)])[keep]

    def hess(z):
        a, b = parts(z)
        p = a + b
        k = np.block([[np.diag(p.sum(1)), p], [p.T, np.diag(p.sum(0))]])
        return k[np.ix_(keep, keep)]

    res = minimize(fun, np.zeros(m + n - 1), jac=jac, hess=hess, method="trust-exact",
                   options={"gtol": 1e-13, "maxiter": 500})
    z = res.x
    for _ in range(5):  # trust-exact stalls when f no longer changes in float64; finish on the gradient
        z = z - np.linalg.solve(hess(z), jac(z))
    assert np.abs(jac(z)).max() <= 1e-12 * fun(z)
    return fun(z)


# ---------------------------------------------------------------- minimum sharpness with normalized_ce


def test_minimum_sharpness_not_applicable_with_normalized_ce(mlp, mlp_nobias) -> None:
    for model_xy in (mlp, mlp_nobias):
        for name in ("minimum_sharpness", "minimum_sharpness:published"):
            with pytest.raises(NotApplicable, match="normalized_ce"):
                _run(name, model_xy, loss="normalized_ce")
    spec = get_measure("minimum_sharpness")
    record = compute_entry(_ctx(*mlp), spec, spec.settings(), "normalized_ce")
    assert record["status"] == "not_applicable" and "degenerate" in record["reason"]
    assert compute_entry(_ctx(*mlp), spec, spec.settings(), "ce")["status"] == "ok"


# ---------------------------------------------------------------- normalized sharpness: the stopping rule


@pytest.mark.parametrize("blocks,coupling,seed", [
    ((5, 7, 6, 4), 1e-8, 0),     # the change rule stops after a few sweeps, ~1e-7 above the optimum
    ((5, 7, 6, 4), 1e-4, 1),     # ... or after ~1,500 sweeps, ~1e-8 above it
    ((8, 3, 7, 2), 1e-6, 2),     # out > in: the Newton step eliminates the other block
])
def test_kkt_rule_on_a_nearly_decomposable_problem(blocks, coupling: float, seed: int) -> None:
    h, q = _near_decomposable(*blocks, coupling, seed)
    ref = _reference_ns(h, q)
    # the old rule (relative change only) declares convergence well away from the optimum
    old = solve_normalized_sharpness(h, q, kkt_tol=math.inf, newton_after=10**9, max_iter=10**5)
    assert old.converged and (old.value - ref) / ref > 1e-9
    assert old.kkt_residual > 1e-7
    res = solve_normalized_sharpness(h, q)
    assert res.converged and res.kkt_residual <= KKT_TOL and res.rel_change <= 1e-10
    assert res.value == pytest.approx(ref, rel=1e-10) and res.value >= ref * (1 - 1e-13)
    assert res.newton_steps >= 1 and res.iterations < 100
    value_at = float(res.sigma @ h @ res.sigma_prime + (1 / res.sigma) @ q @ (1 / res.sigma_prime))
    assert value_at == pytest.approx(res.value, rel=1e-12)


def test_kkt_rule_without_newton_steps_runs_the_sweeps_to_the_optimum() -> None:
    """The stopping rule alone (no Newton steps) keeps sweeping until the optimum, or says it did not."""
    h, q = _near_decomposable(5, 7, 6, 4, 1e-4, 0)
    ref = _reference_ns(h, q)
    plain = solve_normalized_sharpness(h, q, newton_after=10**9, max_iter=20000)
    assert plain.converged and plain.newton_steps == 0 and plain.iterations > 1000
    assert plain.value == pytest.approx(ref, rel=1e-10)
    short = solve_normalized_sharpness(h, q, newton_after=10**9, max_iter=200)
    assert not short.converged and short.iterations == 200 and short.kkt_residual > KKT_TOL


def test_newton_steps_from_the_start_and_on_an_exactly_decomposable_problem() -> None:
    for coupling in (0.0, 0.3):
        h, q = _near_decomposable(5, 7, 6, 4, coupling, 0)
        plain = solve_normalized_sharpness(h, q)
        newton = solve_normalized_sharpness(h, q, newton_after=0)
        assert plain.converged and newton.converged and newton.newton_steps >= 1
        assert newton.value == pytest.approx(plain.value, rel=1e-12)


def test_kkt_rule_on_trained_layers(mlp) -> None:
    out = _run("normalized_sharpness", mlp)
    assert out.info["solver"] == "exact" and out.info["converged"]
    assert out.info["kkt_residual_max"] <= KKT_TOL and out.info["newton_steps"] == 0
    for layer in out.info["layers"].values():
        assert layer["iterations"] <= 30 and layer["kkt_residual"] <= KKT_TOL


# ---------------------------------------------------------------- Rangamani: power iteration


def _matrix(eigenvalues: list[float], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(len(eigenvalues), len(eigenvalues), generator=gen,
                                           dtype=torch.float64))
    return basis @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ basis.t()


def test_power_iteration_never_claims_convergence_with_close_eigenvalues() -> None:
    """λ₂/λ₁ = 0.99: the Rayleigh-quotient change rule stopped ~1% off; the residual rule does not."""
    gen = torch.Generator().manual_seed(1)
    rest = (0.9 * torch.rand(38, generator=gen, dtype=torch.float64)).tolist()
    mat = _matrix([2.0, 1.98] + rest)
    start = torch.randn(40, generator=gen, dtype=torch.float64)
    tol = 1e-4
    # the old rule, for the record: successive quotients within tol → a large error
    v, prev = start / start.norm(), None
    for _ in range(1000):
        w = mat @ v
        lam = float(v @ w)
        if prev is not None and abs(lam - prev) <= tol * abs(lam):
            break
        v, prev = w / w.norm(), lam
    assert abs(lam - 2.0) / 2.0 > 1e-3
    for max_iter in (50, 100, 200, 5000):
        lam, iters, converged, _, residual = power_iteration(lambda x: mat @ x, start, tol=tol,
                                                             max_iter=max_iter)
        if converged:
            assert residual <= tol and abs(lam - 2.0) / 2.0 <= tol
        else:
            assert iters == max_iter and residual > tol
            assert lam <= 2.0 * (1 + 1e-12)  # a Rayleigh quotient: a lower bound of λ_max
    assert converged  # 5000 iterations suffice (about log(1e4)/log(1/0.99) ≈ 900)


def test_power_iteration_with_a_shift_finds_the_top_eigenvalue() -> None:
    mat = _matrix([-3.0, 1.0, 0.5, 0.2, -0.1], seed=2)
    start = torch.ones(5, dtype=torch.float64)
    lam, _, converged, _, _ = power_iteration(lambda x: mat @ x, start, tol=1e-8, max_iter=500)
    assert converged and lam == pytest.approx(-3.0, rel=1e-8)
    top, _, converged, _, residual = power_iteration(lambda x: mat @ x, start, tol=1e-8, max_iter=2000,
                                                     shift=3.0)
    assert converged and residual <= 1e-8 and top == pytest.approx(1.0, rel=1e-8)


def test_rangamani_reports_non_convergence(mlp) -> None:
    out = _run("scale_invariant_rangamani", mlp, max_iter=3)
    info = out.info
    assert not info["converged"] and info["iterations"] >= 3 and info["residual"] > info["tol"]
    assert "did not converge" in info["warning"]
    full = _run("scale_invariant_rangamani", mlp)
    assert full.info["converged"] and full.info["residual"] <= 1e-4 and "warning" not in full.info
    assert info["lambda_max"] <= full.info["lambda_max"] * (1 + 1e-4)


# ---------------------------------------------------------------- the published solver


def _reference_sgd(objective, params: torch.Tensor, steps: int, lr: float, decay: float) -> float:
    """The published procedure written with autograd and torch.optim: normalized objective, SGD, LambdaLR."""
    x = params.clone().requires_grad_(True)
    f0 = float(objective(x.detach()))
    opt = torch.optim.SGD([x], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + decay * t))
    value = 1.0
    for _ in range(steps):
        loss = objective(x) / f0
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        value = loss.item()
    return value * f0


def test_published_minimum_sharpness_reproduces_the_sgd_procedure() -> None:
    tw, tb = [0.8, 3.5, 12.0, 2.0], [0.05, 0.2, 0.4, 0.1]

    def objective(a: torch.Tensor) -> torch.Tensor:
        total, cum = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for l in range(3):
            cum = cum + a[l]
            total = total + tw[l] * torch.exp(-2 * a[l]) + tb[l] * torch.exp(-2 * cum)
        return total + tw[3] * torch.exp(2 * cum) + tb[3]

    for lr, decay in ((1e-3, 1e-3), (0.3, 1e-2)):
        ref = _reference_sgd(objective, torch.zeros(3, dtype=torch.float64), 300, lr, decay)
        pub = solve_minimum_sharpness_published(tw, tb, steps=300, lr=lr, decay=decay)
        assert pub.value == pytest.approx(ref, rel=1e-12)
        assert pub.start == pytest.approx(sum(tw) + sum(tb), rel=1e-15)


def test_published_normalized_sharpness_reproduces_the_sgd_procedure() -> None:
    gen = torch.Generator().manual_seed(3)
    h = torch.rand(6, 9, generator=gen, dtype=torch.float64) ** 3
    q = torch.randn(6, 9, generator=gen, dtype=torch.float64) ** 2

    def objective(z: torch.Tensor) -> torch.Tensor:
        u, v = z[:6], z[6:]
        e = torch.exp(u[:, None] + v[None, :])
        return (h * e).sum() + (q / e).sum()

    for lr, decay in ((1e-3, 1e-3), (0.5, 1e-2)):
        ref = _reference_sgd(objective, torch.zeros(15, dtype=torch.float64), 300, lr, decay)
        pub = solve_normalized_sharpness_published(h, q, steps=300, lr=lr, decay=decay)
        assert pub.value == pytest.approx(ref, rel=1e-12)
        # the steps in float32 (the measure's default, `published_dtype`): the same procedure to rounding
        pub32 = solve_normalized_sharpness_published(h, q, steps=300, lr=lr, decay=decay, dtype=torch.float32)
        assert pub32.value == pytest.approx(ref, rel=1e-5) and pub32.value != ref


def test_published_normalized_sharpness_in_float32_on_a_trained_layer_size(mlp) -> None:
    """On the problem of a real layer (a trained MLP's Hessian diagonal and weights), the float32 steps give
    the float64 procedure's value to 1e-6, and the measure records the dtype it used."""
    spec = get_measure("normalized_sharpness:published")
    assert spec.settings()["published_dtype"] == "float32"
    ctx = _ctx(*mlp)
    (_, h, q), *_ = layer_problems(ctx, "ce")[0]
    values = [solve_normalized_sharpness_published(h, q, dtype=dt).value for dt in (torch.float64, torch.float32)]
    assert values[1] == pytest.approx(values[0], rel=1e-6)
    record = compute_entry(ctx, spec, spec.settings(), None)
    assert record["status"] == "ok" and record["info"]["published_dtype"] == "float32"
    exact64 = compute_entry(ctx, spec, {**spec.settings(), "published_dtype": "float64"}, None)
    assert record["values"]["normalized_sharpness:published"] == pytest.approx(
        exact64["values"]["normalized_sharpness:published"], rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_published_solvers_are_upper_bounds(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tw = torch.exp(2 * torch.randn(4, generator=gen, dtype=torch.float64)).tolist()
    tb = (0.1 * torch.rand(4, generator=gen, dtype=torch.float64)).tolist()
    for biases in (None, tb):
        exact = solve_minimum_sharpness(tw, biases)
        pub = solve_minimum_sharpness_published(tw, biases)
        assert exact.converged and pub.value >= exact.value * (1 - 1e-12)
        assert pub.relative <= 1.0
    h, q = _near_decomposable(4, 5, 3, 6, 0.3, seed)
    exact_ns = solve_normalized_sharpness(h, q)
    pub_ns = solve_normalized_sharpness_published(h, q)
    assert pub_ns.value >= exact_ns.value * (1 - 1e-12) and pub_ns.relative < 1.0


def test_exact_solver_closed_form_and_published_gap_on_a_bias_free_net(mlp_nobias) -> None:
    exact = _run("minimum_sharpness", mlp_nobias)
    tw = list(exact.info["weight_traces"].values())
    closed = len(tw) * math.prod(tw) ** (1 / len(tw))
    assert exact.info["solver"] == "exact" and exact.values["minimum_sharpness"] == pytest.approx(closed,
                                                                                                 rel=1e-12)
    pub = _run("minimum_sharpness:published", mlp_nobias)
    value = pub.values["minimum_sharpness"]
    assert pub.info["solver"] == "published" and pub.info["published_steps"] == 10000
    assert pub.info["exact_value"] == pytest.approx(closed, rel=1e-12)
    assert 0 < pub.info["final_relative_objective"] < 1  # the normalized objective fell below 1 ...
    assert value > closed * (1 + 1e-6)                   # ... but stopped above the optimum
    assert pub.info["gap_to_exact"] == pytest.approx(value / closed - 1, rel=1e-9)


def test_published_minimum_sharpness_runs_through_compute_entry(mlp) -> None:
    spec = get_measure("minimum_sharpness:published")
    settings = spec.settings()
    assert settings["solver"] == "published" and settings["published_steps"] == 10000
    record = compute_entry(_ctx(*mlp), spec, settings, None)
    assert record["status"] == "ok", record
    assert set(record["values"]) == {"minimum_sharpness:published"}
    info = record["info"]
    assert info["solver"] == "published" and info["published_lr"] == 1e-3 and info["published_decay"] == 1e-3
    value = record["values"]["minimum_sharpness:published"]
    assert value == pytest.approx(info["final_relative_objective"] * info["objective_start"], rel=1e-12)
    assert value >= info["exact_value"] and info["final_relative_objective"] < 1
    base = compute_entry(_ctx(*mlp), get_measure("minimum_sharpness"),
                         get_measure("minimum_sharpness").settings(), None)
    assert base["values"]["minimum_sharpness"] == pytest.approx(info["exact_value"], rel=1e-12)


@pytest.mark.parametrize("name", ["normalized_sharpness", "normalized_sharpness_nce"])
def test_published_normalized_sharpness_variant(mlp, name: str) -> None:
    spec = get_measure(f"{name}:published")
    record = compute_entry(_ctx(*mlp), spec, spec.settings(), None)
    assert record["status"] == "ok", record
    layers = ("1", "3", "5")
    assert set(record["values"]) == {f"{name}:published"} | {f"{name}:published/{n}" for n in layers}
    info = record["info"]
    assert info["solver"] == "published" and info["published_steps"] == 10000
    assert set(info["final_relative_objective"]) == set(layers)
    exact = _run(name, mlp)
    assert exact.info["loss"] == ("normalized_ce" if name.endswith("nce") else "ce")
    for n in layers:
        layer = info["layers"][n]
        assert 0 < layer["final_relative_objective"] < 1
        assert layer["exact_value"] == pytest.approx(exact.values[f"{name}/{n}"], rel=1e-12)
        assert record["values"][f"{name}:published/{n}"] >= layer["exact_value"] * (1 - 1e-12)
    assert info["exact_value"] == pytest.approx(exact.values[name], rel=1e-12)


def test_variants_are_registered_but_not_in_the_invariance_matrix() -> None:
    registered = all_measures()
    assert not any(":" in name for name in registered)  # test_invariance iterates over these only
    for name in PUBLISHED_MEASURES:
        spec = registered[name]
        assert spec.variants == {"published": {"solver": "published"}}
        assert spec.defaults["solver"] == "exact"
        assert {"published_steps": 10000, "published_lr": 1e-3,
                "published_decay": 1e-3}.items() <= spec.defaults.items()
        variant = get_measure(f"{name}:published")
        assert variant.settings({name: {"solver": "exact"}})["solver"] == "published"


def test_unknown_solver_is_a_user_error(mlp) -> None:
    for name in PUBLISHED_MEASURES:
        with pytest.raises(FlatbenchError, match="solver"):
            _run(name, mlp, solver="sgd")
