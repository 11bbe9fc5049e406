"""The invariance test matrix: every registered measure × every family it declares × every model.

A measure joins by registering (`invariant_to=` in `register_measure`). For each declared family and each
model the family applies to, the trained model is transformed once with factors log-uniform in
[1/10, 10] (`flatbench.rescale`), the function is checked to be unchanged, and the measure's headline
value must not move:

- exact measures (`exact=True`): relative change < 1e-4;
- stochastic measures: |Δ| ≤ 3 standard errors of the difference (from `info["stderr"]` of both runs),
  plus the 1e-4 relative floor;
- deterministic iterative approximations (`exact=False`): relative change < 1e-4 as well (they declare
  exact invariance of their search path).

The curvature baselines `hessian_trace` and `hessian_max_eig` must change by more than 10% under
`layer` and `node` (the papers' point); that check uses its own transformation with factors
log-uniform in [3, 10], so that a pass cannot come from factors that happen to lie near 1 (with
[1/10, 10] two layer factors of 0.47 and 0.85 move λ_max of the BatchNorm MLP by only 7%).

A measure that is not applicable to a model is skipped with its reason. Measures run with the
cross-entropy (`uses_loss` measures are not re-run with normalized_ce here). Models: small float64 nets
trained a few dozen Adam steps on 64 mnist_mini examples so they are not at initialization: an MLP with
biases, a bias-free MLP, an MLP with BatchNorm (eval mode), LeNet-5 and a WRN-10-1 on 7×7 inputs
(node / layer rescaling through its BatchNorm → ReLU → conv junctions).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

from flatbench import rescale
from flatbench.config import DataConfig
from flatbench.data import load_dataset
from flatbench.measures import MeasureOutput, NotApplicable, all_measures
from flatbench.measures.context import MeasureContext
from flatbench.models import MLP, LeNet5, WideResNet

N_EXAMPLES = 64
MUST_CHANGE = {"hessian_trace": ("layer", "node"), "hessian_max_eig": ("layer", "node")}
CHANGE_AT_LEAST = 0.10
EXACT_RTOL = 1e-4
APPROX_RTOL = 1e-4
STDERRS = 3.0

TEST_SETTINGS: dict[str, dict[str, Any]] = {
    # small but meaningful settings for the expensive measures (only keys a measure has are used)
    "hessian_max_eig": {"iters": 40, "tol": 1e-5},
    "adaptive_sharpness_l2": {"iters": 10, "batch_size": N_EXAMPLES},
    "adaptive_sharpness_linf": {"iters": 10, "batch_size": N_EXAMPLES},
    "adaptive_sharpness_avg": {"samples": 8, "batch_size": N_EXAMPLES},
    "scale_invariant_rangamani": {"max_iter": 60},
    "pacbayes_flatness": {"samples": 4, "search_depth": 8},
    "pacbayes_mag_flatness": {"samples": 4, "search_depth": 8},
    "eps_sharpness": {"iters": 10},
}

MODELS = ("mlp", "mlp_nobias", "mlp_bn", "lenet", "wrn")


@cache
def _data(name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    ds = load_dataset(DataConfig(dataset="mnist_mini", n_train=N_EXAMPLES, n_test=10), seed=0)
    x = ds.x_train.to(torch.float64)
    if name == "wrn":  # 7×7 inputs keep the residual net cheap
        x = nn.functional.avg_pool2d(x, 4)
    return x, ds.y_train


@cache
def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = {
        "mlp": lambda: MLP(784, (16, 16), 10),
        "mlp_nobias": lambda: MLP(784, (12, 12), 10, bias=False),
        "mlp_bn": lambda: MLP(784, (16, 16), 10, batch_norm=True),
        "lenet": lambda: LeNet5(1, 28, 10),
        "wrn": lambda: WideResNet(1, 10, depth=10, width=1),
    }[name]().to(torch.float64)
    x, y = _data(name)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


FACTORS = {"invariance": (0.1, 10.0), "change": (3.0, 10.0)}


@cache
def _context(name: str, family: str | None, factors: str = "invariance") -> MeasureContext:
    """One context (and cache) per model and transformation, shared by every measure."""
    model = _model(name)
    x, y = _data(name)
    if family is not None:
        seed = 1000 + MODELS.index(name) * 10 + rescale.FAMILIES.index(family)
        seed += 0 if factors == "invariance" else 5
        low, high = FACTORS[factors]
        transformed = rescale.transform(model, family, torch.Generator().manual_seed(seed), low, high)
        change = rescale.function_change(model, transformed, x, family)
        assert change < 1e-10, f"{family} changed the function of {name} by {change:.2e}"
        model = transformed
    return MeasureContext(model=model, inputs=x, targets=y, num_classes=10, run_id=f"invariance-{name}")


_OUTPUTS: dict[tuple[str, str, str | None, str], MeasureOutput | NotApplicable] = {}


def _output(measure: str, name: str, family: str | None, factors: str = "invariance") -> MeasureOutput:
    key = (measure, name, family, factors)
    if key not in _OUTPUTS:
        spec = all_measures()[measure]
        extra = TEST_SETTINGS.get(measure, {})
        settings = {**spec.defaults, **{k: v for k, v in extra.items() if k in spec.defaults}}
        try:
            out = spec.fn(_context(name, family, factors).for_measure(measure, settings, loss_name="ce"))
            _OUTPUTS[key] = out if isinstance(out, MeasureOutput) else MeasureOutput(dict(out))
        except NotApplicable as exc:
            _OUTPUTS[key] = exc
    result = _OUTPUTS[key]
    if isinstance(result, NotApplicable):
        pytest.skip(f"{measure} not applicable to {name}: {result}")
    return result


def _stderr(out: MeasureOutput, measure: str) -> float:
    se = out.info.get("stderr")
    if isinstance(se, dict):
        se = se.get(measure)
    return float(se) if se is not None and math.isfinite(float(se)) else 0.0


def _cases() -> list[Any]:
    cases = []
    for measure, spec in all_measures().items():
        families = set(spec.invariant_to) | set(MUST_CHANGE.get(measure, ()))
        for family in rescale.FAMILIES:
            if family not in families:
                continue
            for name in MODELS:
                cases.append(pytest.param(measure, family, name, id=f"{measure}-{family}-{name}"))
    return cases


@pytest.mark.parametrize("measure,family,model_name", _cases())
def test_invariance_matrix(measure: str, family: str, model_name: str) -> None:
    verdict = rescale.applicable_families(_model(model_name))[family]
    if verdict is not True:
        pytest.skip(f"{family} does not apply to {model_name}: {verdict}")
    spec = all_measures()[measure]
    before = _output(measure, model_name, None)
    v0 = before.values[measure]
    if family in spec.invariant_to:
        after = _output(measure, model_name, family)
        v1 = after.values[measure]
        assert math.isfinite(v0) and math.isfinite(v1), (v0, v1)
        rel = abs(v1 - v0) / max(abs(v0), 1e-300)
        if spec.stochastic:
            allowed = (STDERRS * math.hypot(_stderr(before, measure), _stderr(after, measure))
                       + EXACT_RTOL * abs(v0))
            assert abs(v1 - v0) <= allowed, (
                f"{measure} is declared invariant to {family} but moved {v0:.6g} → {v1:.6g} on {model_name} "
                f"(allowed ±{allowed:.3g} = {STDERRS:g} standard errors)")
        else:
            tol = EXACT_RTOL if spec.exact else APPROX_RTOL
            assert rel < tol, (f"{measure} is declared invariant to {family} but changed by {rel:.2e} "
                               f"({v0:.10g} → {v1:.10g}) on {model_name}")
    if family in MUST_CHANGE.get(measure, ()):
        v1 = _output(measure, model_name, family, "change").values[measure]
        rel = abs(v1 - v0) / max(abs(v0), 1e-300)
        assert rel > CHANGE_AT_LEAST, (f"{measure} should be scale-dependent under {family} but changed "
                                       f"only by {rel:.2%} on {model_name}")


def test_curvature_baselines_are_in_the_matrix() -> None:
    registered = all_measures()
    for name in MUST_CHANGE:
        assert name in registered, f"{name} is not registered"
        assert not registered[name].invariant_to
