"""The invariance test matrix: every registered measure × every rescaling family × every catalogue case.

No measure stays outside: a measure joins by registering (`register_measure(..., invariant_to=...)`), and
for every family of `flatbench.rescale` it is either

- **declared** invariant (`family in spec.invariant_to`): on every case of tests/cases.py the family
  applies to (and the measure applies to), the trained model is transformed once with factors
  log-uniform in [1/10, 10], the function is checked to be unchanged (< 1e-10 relative), and the
  measure's headline value must not move by more than its tolerance (`tolerance`, set from the measured
  float64 rounding, see there); stochastic measures must also stay within 3 standard errors (the
  contract's rule). A declared family that does not hold fails with the measure, family, case, values
  and tolerance; or
- **not declared**: the measure must be *shown* to change, by more than `CHANGE_REL` relative, on at least
  one case (cheap cases first). Stochastic measures draw their noise from the run's seeded generator
  (common random numbers: the same draws before and after), so such a change is the measure's, not
  Monte-Carlo noise (an invariant stochastic measure moves by ~1e-15 under the same scheme).

Every measure also runs on every case (`test_measure_on_case`): it gives a finite value, or raises
`NotApplicable` with the reason listed in `NOT_APPLICABLE` (the list of which measures do not apply to
which case, and why). The curvature baselines `hessian_trace` and `hessian_max_eig` must moreover change
by more than 10% under `layer` and `node` on every case (the papers' point); that check uses factors
log-uniform in [3, 10], so that a pass cannot come from factors that happen to lie near 1.

Measures run with the cross-entropy (`uses_loss` measures are not re-run with normalized_ce here), with
the reduced settings of `TEST_SETTINGS` for the expensive ones.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import pytest
from cases import CASES, FAMILIES_OF, case
from torch import nn

from flatbench import rescale
from flatbench.measures import MeasureOutput, NotApplicable, all_measures, contract

TEST_SETTINGS: dict[str, dict[str, Any]] = {
    # small but meaningful settings for the expensive measures (only keys a measure has are used)
    "hessian_max_eig": {"iters": 40, "tol": 1e-5},
    "hessian_density": {"runs": 2, "iters": 20},
    "adaptive_sharpness_l2": {"iters": 10, "batch_size": 64},
    "adaptive_sharpness_linf": {"iters": 10, "batch_size": 64},
    "adaptive_sharpness_avg": {"samples": 8, "batch_size": 64},
    "scale_invariant_rangamani": {"max_iter": 60},
    "pacbayes_flatness": {"samples": 4, "search_depth": 8},
    "pacbayes_mag_flatness": {"samples": 4, "search_depth": 8},
    "eps_sharpness": {"iters": 10},
}

NOT_APPLICABLE: dict[tuple[str, str], str] = {
    # (measure, case): a part of the reason it must give. Every other pair must give a finite value.
    ("minimum_sharpness", "mlp_bn"): "BatchNorm follows a weight layer",
    ("minimum_sharpness", "wrn"): "BatchNorm follows a weight layer",
    **{(psi, name): reason for psi in ("psi_flatness", "psi_path_ratio") for name, reason in (
        ("mlp", "has a bias"), ("mlp_bn", "has a bias"), ("mlp_nobias", "equal hidden widths"),
        ("lenet", "Linear and ReLU only"), ("wrn", "not a plain Sequential"))},
}

# ---------------------------------------------------------------- tolerances
#
# Worst relative change of a declared-invariant headline value under the [1/10, 10] transformations of
# this catalogue, measured in float64 on the CPU over all 151 declared measure × family × case
# combinations that apply, per class (`tolerance`), with the tolerance set and its headroom:
#   exact closed forms (path_norm, fisher_rao_norm, relative_flatness[_normalized], psi_path_ratio,
#     psi_flatness, matrix_normalized_sharpness): 3.3e-15 (fisher_rao_norm, node, lenet)
#     → EXACT_RTOL 1e-10, headroom 3e4;
#   exact solvers (minimum_sharpness, normalized_sharpness[_nce]; they stop at a relative change of
#     1e-10 and 1e-14): 4.4e-16 (normalized_sharpness_nce, node, mlp_psi) → SOLVER_RTOL 1e-9, the
#     normalized-sharpness solver's own rtol 1e-10 with a factor 10 on top;
#   deterministic iterative searches that follow the same path in scale-free coordinates
#     (adaptive_sharpness_l2/linf: APGD in u = δ/|θ|; scale_invariant_rangamani: power iteration on
#     D H D from the same seeded start): 5.8e-14 (adaptive_sharpness_linf, layer, mlp)
#     → ITERATIVE_RTOL 1e-9, headroom 1.7e4. Their stopping tests compare quantities that are themselves
#     invariant, so they never stop at another step here; their solver tolerances (APGD: none, a fixed
#     number of steps; power iteration: 1e-4) would only bound a change if they did;
#   the stochastic adaptive_sharpness_avg (common random numbers: the same seeded draws, scaled by |θ|):
#     8.9e-15 (node, mlp) → STOCHASTIC_RTOL 1e-9, headroom 1.1e5, on top of the contract's 3 standard
#     errors (which alone would let a 10% change pass on these cases).
# Every class catches a bug that breaks an invariance by one part in a million: a planted factor
# 1 + 1e-6·log Σθ² on path_norm, normalized_sharpness, adaptive_sharpness_linf, adaptive_sharpness_avg and
# scale_invariant_rangamani (relative changes 7e-8 to 5e-6, all under the former 1e-4) failed every one of
# their 64 declared combinations.
# The values and the class rule are the package's (`flatbench.measures.contract`, one home, also used by
# `flatbench check-measure`).
EXACT_RTOL, STDERRS, CHANGE_REL = contract.EXACT_RTOL, contract.STDERRS, contract.CHANGE_REL


def tolerance(measure: str) -> tuple[float, str]:
    """The relative tolerance of a declared invariance, and the class it comes from."""
    return contract.tolerance(measure)


CHANGE_ORDER = ("mlp_psi", "mlp", "mlp_nobias", "mlp_bn", "lenet", "wrn")
"""The order in which cases are tried to show a change (cheapest first)."""
MUST_CHANGE = {"hessian_trace": ("layer", "node"), "hessian_max_eig": ("layer", "node")}
CHANGE_AT_LEAST = 0.10

FACTORS = contract.FACTORS
CHANGE_FACTORS = {
    # pacbayes_mag_flatness perturbs θ_i by N(0, σ²θ_i² + ε²): the σ part scales with θ, so only the
    # additive ε = 1e-3 breaks its invariance to every family, and on these cases that shows only once a
    # rescaling brings weights near ε (with [1/10, 10] factors its bisection lands on the same σ'; with
    # factors in [1/1000, 1/100] the ε noise alone drops the accuracy by more than the target).
    "pacbayes_mag_flatness": "shrink",
}


# ---------------------------------------------------------------- transformed cases and cached outputs


def _model(name: str, family: str | None, factors: str = "invariance") -> nn.Module:
    return contract.transformed(name, family, factors)


Result = contract.Result


@cache
def _output(measure: str, name: str, family: str | None, factors: str = "invariance") -> Result:
    return contract.run_measure(all_measures()[measure], contract.shared_context(name, family, factors),
                                TEST_SETTINGS.get(measure, {}))


def _value(out: Result, measure: str, where: str) -> float:
    if isinstance(out, Exception):
        raise AssertionError(f"{measure} failed on {where}: {type(out).__name__}: {out}") from out
    value = out.values[measure]
    assert isinstance(value, float) and math.isfinite(value), f"{measure} on {where}: {value!r}"
    return value


def _stderr(out: MeasureOutput, measure: str) -> float:
    return contract.stderr_of(out, measure)


def _rel(v0: float, v1: float) -> float:
    return contract.rel_change(v0, v1)


# ---------------------------------------------------------------- the matrix


def _declared_cases() -> list[Any]:
    return [pytest.param(measure, family, name, id=f"{measure}-{family}-{name}")
            for measure, spec in all_measures().items()
            for family in rescale.FAMILIES if family in spec.invariant_to
            for name in CASES if family in FAMILIES_OF[name]]


def _undeclared() -> list[Any]:
    return [pytest.param(measure, family, id=f"{measure}-{family}")
            for measure, spec in all_measures().items()
            for family in rescale.FAMILIES if family not in spec.invariant_to]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("measure", list(all_measures()))
def test_measure_on_case(measure: str, name: str) -> None:
    """Every measure gives a finite value on every case, or is not applicable for the listed reason."""
    out = _output(measure, name, None)
    expected = NOT_APPLICABLE.get((measure, name))
    if isinstance(out, NotApplicable):
        assert expected is not None, (f"{measure} is not applicable to case {name} ({out}); the matrix "
                                      "expects a value: list it in NOT_APPLICABLE with its reason, or fix it")
        assert expected in str(out), f"{measure} on {name}: expected a reason with {expected!r}, got {out}"
        return
    assert expected is None, f"{measure} now applies to {name}: remove the NOT_APPLICABLE entry"
    _value(out, measure, name)


@pytest.mark.parametrize("measure,family,name", _declared_cases())
def test_declared_invariance(measure: str, family: str, name: str) -> None:
    spec = all_measures()[measure]
    before = _output(measure, name, None)
    if isinstance(before, NotApplicable):
        pytest.skip(f"{measure} is not applicable to {name}: {before}")
    v0 = _value(before, measure, name)
    after = _output(measure, name, family)
    v1 = _value(after, measure, f"{name} after {family} rescaling")
    ok, rel, tol = contract.within_declared(spec, before, after)
    kind = tolerance(measure)[1]
    assert rel <= tol, (f"{measure} is declared invariant to {family} but changed by {rel:.2e} relative "
                        f"({v0:.15g} → {v1:.15g}) on case {name} (tolerance {tol:g}, {kind})")
    allowed = STDERRS * math.hypot(_stderr(before, measure), _stderr(after, measure))
    assert ok, (f"{measure} is declared invariant to {family} but moved {v0:.6g} → {v1:.6g} on {name} "
                f"(allowed ±{allowed:.3g} = {STDERRS:g} standard errors)")


@pytest.mark.parametrize("measure,family", _undeclared())
def test_undeclared_family_is_shown_to_change(measure: str, family: str) -> None:
    factors = CHANGE_FACTORS.get(measure, "invariance")
    seen: list[str] = []
    for name in CHANGE_ORDER:
        if family not in FAMILIES_OF[name]:
            continue
        before = _output(measure, name, None)
        if isinstance(before, NotApplicable):
            seen.append(f"{name}: not applicable")
            continue
        v0 = _value(before, measure, name)
        after = _output(measure, name, family, factors)
        if isinstance(after, Exception):
            seen.append(f"{name}: {type(after).__name__} after rescaling")
            continue
        rel = _rel(v0, _value(after, measure, f"{name} after {family} rescaling"))
        if rel > CHANGE_REL:
            return
        seen.append(f"{name}: {rel:.1e}")
    if seen and all(s.endswith("not applicable") for s in seen):
        pytest.skip(f"{measure} applies to no case that {family} rescaling applies to")
    pytest.fail(f"{measure} does not declare {family} invariance, but no case shows it changing by more "
                f"than {CHANGE_REL:g} ({'; '.join(seen) or 'no case'}): declare it (the matrix then checks "
                "it) or add a case that shows the dependence")


@pytest.mark.parametrize("measure,family,name", [
    pytest.param(m, f, n, id=f"{m}-{f}-{n}") for m, fams in MUST_CHANGE.items() for f in fams for n in CASES])
def test_curvature_baselines_are_scale_dependent(measure: str, family: str, name: str) -> None:
    v0 = _value(_output(measure, name, None), measure, name)
    v1 = _value(_output(measure, name, family, "change"), measure, f"{name} after {family}")
    assert _rel(v0, v1) > CHANGE_AT_LEAST, (f"{measure} should be scale-dependent under {family} but "
                                            f"changed only by {_rel(v0, v1):.2%} on {name}")


def test_no_measure_outside_the_matrix() -> None:
    """Every (measure, family) pair is in the matrix, and every declared family is checked on a case."""
    declared = {(p.values[0], p.values[1]) for p in _declared_cases()}
    undeclared = {tuple(p.values) for p in _undeclared()}
    for measure, spec in all_measures().items():
        assert not spec.invariant_to - set(rescale.FAMILIES)
        for family in rescale.FAMILIES:
            assert ((measure, family) in declared) != ((measure, family) in undeclared), (measure, family)
            if family in spec.invariant_to:
                checked = [n for n in CASES if family in FAMILIES_OF[n]
                           and not isinstance(_output(measure, n, None), NotApplicable)]
                assert checked, f"{measure} declares {family} but applies to no case where {family} applies"
    for name in MUST_CHANGE:
        assert not all_measures()[name].invariant_to


# ---------------------------------------------------------------- invariances the registry cannot declare

LAYER_INVARIANT_WITHOUT_BATCHNORM = ("frobenius_norm_product", "spectral_norm")
"""log Π_l ‖W_l‖²: a layer rescaling multiplies one weight layer by α and the next by 1/α (biases, which
these norms ignore, are scaled too), so the product is unchanged on nets without BatchNorm. With
BatchNorm, `layer` puts α into the BatchNorm's affine parameters (which these norms do not see) and 1/α
into the next weight layer, so the product moves: `layer` is not declared (a declaration holds for every
architecture), and this test checks both halves."""


@pytest.mark.parametrize("measure", LAYER_INVARIANT_WITHOUT_BATCHNORM)
def test_norm_products_are_layer_invariant_exactly_without_batchnorm(measure: str) -> None:
    assert "layer" not in all_measures()[measure].invariant_to
    for name in CASES:
        v0 = _value(_output(measure, name, None), measure, name)
        rel = _rel(v0, _value(_output(measure, name, "layer"), measure, f"{name} after layer"))
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in case(name).model.modules())
        if has_bn:
            assert rel > CHANGE_REL, f"{measure} on {name} (BatchNorm): layer rescaling moved it only {rel:.1e}"
        else:
            assert rel <= EXACT_RTOL, f"{measure} on {name}: layer rescaling changed it by {rel:.2e}"
