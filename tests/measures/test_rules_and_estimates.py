"""The classes of planted bugs that survived issue 30's round, each against a brute-force reference:

- the check-measure decision rule (`measures/contract.py`) on near misses: the relative change of values
  below 1, which tolerance a measure's class gets (a stochastic one above all), the standard-error rule of a
  stochastic measure, and what a variant declares (nothing: its invariances are its base's claim, not its);
- the standard error of a batch-averaged Monte-Carlo measure with several batches, against the per-batch
  formula recomputed from fresh draws;
- the Lanczos residual that is reported and used to stop, against ‖Ay − θy‖ of the Ritz pair of the
  Krylov space built independently (QR of the Krylov matrix).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from flatbench.measures import contract
from flatbench.measures.registry import MeasureOutput, get_measure


def _spec(**changes):
    return dataclasses.replace(get_measure("frobenius_norm"), **changes)


def _out(value: float, stderr: float | None = None) -> MeasureOutput:
    return MeasureOutput({"frobenius_norm": value}, {} if stderr is None else {"stderr": stderr})


# ---------------------------------------------------------------- the decision rule


def test_the_relative_change_of_values_below_1_is_relative():
    for v0 in (3e-7, 2e-3, 0.5, 7.0, -4e-5):
        for rel in (1e-11, 1e-8, 0.3):
            v1 = v0 * (1 + rel)
            assert contract.rel_change(v0, v1) == pytest.approx(rel, rel=1e-4), (v0, rel)
    assert contract.rel_change(0.0, 0.0) == 0.0


def test_each_class_gets_its_tolerance_and_a_stochastic_measure_its_own_first():
    assert contract.tolerance(_spec(stochastic=False, exact=True)) == (contract.EXACT_RTOL, "exact closed form")
    assert contract.tolerance(_spec(name="minimum_sharpness", stochastic=False, exact=True))[0] == contract.SOLVER_RTOL
    assert contract.tolerance(_spec(stochastic=False, exact=False))[1] == "deterministic iterative search"
    for exact in (True, False):  # stochastic wins over every other flag, a solver's name included
        for name in ("frobenius_norm", "minimum_sharpness"):
            tol, why = contract.tolerance(_spec(name=name, stochastic=True, exact=exact))
            assert (tol, why) == (contract.STOCHASTIC_RTOL, "stochastic, common random numbers")


@pytest.mark.parametrize("v0", [4e-4, 0.2, 30.0])
def test_a_declared_invariance_on_a_near_miss_either_side_of_the_tolerance(v0):
    for stochastic, exact in ((False, True), (False, False), (True, False)):
        spec = _spec(stochastic=stochastic, exact=exact)
        tol = contract.tolerance(spec)[0]
        se = abs(v0) if stochastic else None  # a standard error that never decides here
        inside = contract.within_declared(spec, _out(v0, se), _out(v0 * (1 + 0.9 * tol), se))
        outside = contract.within_declared(spec, _out(v0, se), _out(v0 * (1 + 1.1 * tol), se))
        assert inside[0] and inside[2] == tol and inside[1] == pytest.approx(0.9 * tol, rel=1e-3)
        assert not outside[0] and outside[1] == pytest.approx(1.1 * tol, rel=1e-3), (stochastic, exact, v0)


def test_a_stochastic_measure_must_also_agree_within_three_standard_errors():
    spec = _spec(stochastic=True, exact=False)
    tol = contract.tolerance(spec)[0]
    v0, v1 = 0.25, 0.25 * (1 + 0.5 * tol)
    diff = abs(v1 - v0)
    se_edge = diff / (contract.STDERRS * math.sqrt(2))  # 3·hypot(se, se) == diff
    assert contract.within_declared(spec, _out(v0, se_edge * 1.01), _out(v1, se_edge * 1.01))[0]
    assert not contract.within_declared(spec, _out(v0, se_edge * 0.99), _out(v1, se_edge * 0.99))[0]
    # the standard errors combine in quadrature: one of them alone must be √2 larger
    assert not contract.within_declared(spec, _out(v0, se_edge * 1.4), _out(v1, 0.0))[0]
    assert contract.within_declared(spec, _out(v0, se_edge * 1.42), _out(v1, 0.0))[0]
    # a per-key standard error (a dict) is read for the headline key
    assert contract.stderr_of(MeasureOutput({"m": 1.0}, {"stderr": {"m": 0.5, "m/x": 9.0}}), "m") == 0.5
    assert contract.stderr_of(MeasureOutput({"m": 1.0}, {"stderr": float("nan")}), "m") == 0.0
    # the deterministic classes ignore a standard error
    assert not contract.within_declared(_spec(), _out(v0, 1.0), _out(v0 * (1 + 2 * contract.EXACT_RTOL), 1.0))[0]


def test_a_variant_declares_nothing_its_base_declares(own_registry):
    from flatbench.measures.registry import register_measure

    @register_measure("_sq_weights", description="Σθ² (not node-invariant), claiming node invariance",
                      invariant_to=("node",), defaults={"power": 2.0}, variants={"cube": {"power": 3.0}})
    def _sq_weights(ctx):
        p = float(ctx.settings["power"])
        return sum(float(w.detach().abs().pow(p).sum()) for w in ctx.model.parameters())

    base = contract.check_measure("_sq_weights", cases=("mlp",), families=("node", "layer"))
    variant = contract.check_measure("_sq_weights:cube", cases=("mlp",), families=("node", "layer"))
    rows = {r.family: r for r in base.rows}
    assert rows["node"].declared and rows["node"].verdict == "FAIL" and not rows["layer"].declared
    assert any("declared invariant to node" in p for p in base.problems)
    vrows = {r.family: r for r in variant.rows}
    assert not vrows["node"].declared and vrows["node"].verdict == "breaks" and not variant.problems
    brute = sum(float(w.abs().pow(3).sum()) for w in contract.transformed("mlp", "node").parameters())
    assert vrows["node"].after == pytest.approx(brute, rel=1e-12)


# ---------------------------------------------------------------- Monte-Carlo over several batches


def test_the_standard_error_over_several_batches_is_the_per_batch_formula():
    from flatbench.measures.builtin.sharpness import adaptive_average_case
    from flatbench.measures.context import MeasureContext

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double().eval()
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(50, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (50,), generator=gen)
    rho, samples, size = 0.3, 4, 16  # batches of 16, 16, 16 and 2: unequal weights
    ctx = MeasureContext(model=model, inputs=x, targets=y, num_classes=3, run_id="se").for_measure(
        "adaptive_sharpness_avg", {"rho": rho, "samples": samples, "batch_size": size}, loss_name="ce")
    value, info = adaptive_average_case(ctx, rho=rho, samples=samples, batch_size=size)

    fresh = MeasureContext(model=model, inputs=x, targets=y, num_classes=3, run_id="se").for_measure(
        "adaptive_sharpness_avg", {"rho": rho, "samples": samples, "batch_size": size}, loss_name="ce")
    draws = fresh.generator("average_case")
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    twin = __import__("copy").deepcopy(model)
    means, variances, weights = [], [], []
    with torch.no_grad():
        for start in range(0, 50, size):
            xb, yb = x[start:start + size], y[start:start + size]
            base = nn.functional.cross_entropy(model(xb), yb).item()
            d = []
            for _ in range(samples):
                noise = torch.randn(theta.shape, generator=draws, dtype=torch.float64)
                torch.nn.utils.vector_to_parameters(theta + rho * theta.abs() * noise, twin.parameters())
                d.append(nn.functional.cross_entropy(twin(xb), yb).item() - base)
            means.append(np.mean(d))
            variances.append(np.var(d, ddof=1))
            weights.append(len(yb) / 50)
    w = np.array(weights)
    assert len(w) == 4 and info["samples"] == 16
    assert value == pytest.approx(float(w @ np.array(means)), rel=1e-10)
    assert info["stderr"] == pytest.approx(math.sqrt(float((w ** 2 * np.array(variances)).sum() / samples)), rel=1e-10)


# ---------------------------------------------------------------- Lanczos residuals


def _reference_ritz(a: np.ndarray, start: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest Ritz values of `a` on the Krylov space K_m(start) and ‖Ay − θy‖ of their Ritz vectors,
    from a QR factorization of the Krylov matrix (no Lanczos recurrence)."""
    cols = [start / np.linalg.norm(start)]
    for _ in range(m - 1):
        v = a @ cols[-1]
        cols.append(v / np.linalg.norm(v))
    q, _ = np.linalg.qr(np.stack(cols, axis=1))
    theta, s = np.linalg.eigh(q.T @ a @ q)
    order = np.argsort(theta)[::-1][:k]
    ys = q @ s[:, order]
    return theta[order], np.linalg.norm(a @ ys - ys * theta[order][None, :], axis=0)


def test_the_lanczos_residual_is_the_ritz_pairs_and_decides_the_stop():
    from flatbench.curvature.lanczos import lanczos_operator

    rng = np.random.default_rng(0)
    basis, _ = np.linalg.qr(rng.normal(size=(40, 40)))
    eigs = np.concatenate([[9.0, 8.5, 8.2], rng.uniform(-2.0, 6.0, size=37)])
    a = basis @ np.diag(eigs) @ basis.T
    a = (a + a.T) / 2
    op = torch.from_numpy(a)
    start = torch.randn(40, generator=torch.Generator().manual_seed(11), dtype=torch.float64).numpy()
    for m in (3, 6, 9):
        out = lanczos_operator(lambda v: op @ v, 40, k=2, iters=m, tol=1e-15,
                               generator=torch.Generator().manual_seed(11))
        theta, resid = _reference_ritz(a, start, m, 2)
        assert out["iterations"] == m and not out["converged"]
        assert out["eigenvalues"] == pytest.approx(theta, rel=1e-9)
        assert out["residuals"] == pytest.approx(resid, rel=1e-6, abs=1e-9), m
    # the stop: the first step whose residuals are all within tol·|θ_max|
    steps = {m: _reference_ritz(a, start, m, 1) for m in range(1, 15)}
    target = 7
    tol = steps[target][1][0] / abs(steps[target][0][0]) * (1 + 1e-6)
    first = next(m for m in range(1, 15) if steps[m][1][0] <= tol * abs(steps[m][0][0]))
    out = lanczos_operator(lambda v: op @ v, 40, k=1, iters=30, tol=tol, generator=torch.Generator().manual_seed(11))
    assert out["converged"] and out["iterations"] == first
