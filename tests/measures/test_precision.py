"""`measure.dtype: auto`: exact quantities in float64, the estimates registered with `precision="float32"` in
float32, with the same values to float32 rounding and the same ordering of models (hence the same τ)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from scipy.stats import kendalltau

from cases import context
from flatbench.config import MeasureConfig
from flatbench.measures import all_measures
from flatbench.measures.registry import get_measure
from flatbench.measures.runner import compute_entry, context_in, entry_dtype, measurement_context, pending_entries
from flatbench.study.audit import Entry, measure_entry

FLOAT32 = sorted(name for name, spec in all_measures().items() if spec.precision == "float32")
POPULATION = ("mlp", "mlp_nobias", "mlp_bn", "lenet", "wrn")
"""Models of the catalogue the measures are compared on: their values span orders of magnitude."""
SMALLER = {"hessian_density": {"runs": 1, "iters": 16}}
"""The density's quadrature (5 runs × 50 Lanczos steps) was four fifths of this test's time at its defaults
(68 of 85 s of measuring, one thread), and at 2 runs × 30 steps still half of it (12 of 25 s); one run of 16
steps runs the same float32 code paths (the Lanczos recurrence, its reorthogonalization and the quadrature),
and the test compares each setting's float32 value with the float64 value of the same setting."""


def test_the_estimates_are_the_float32_measures_and_nothing_exact_is():
    assert set(FLOAT32) == {"adaptive_sharpness_avg", "adaptive_sharpness_l2", "adaptive_sharpness_linf",
                            "eps_sharpness", "hessian_density", "hessian_max_eig", "pacbayes_flatness",
                            "pacbayes_mag_flatness", "scale_invariant_rangamani"}
    assert not any(all_measures()[name].exact for name in FLOAT32)
    assert entry_dtype("auto", get_measure("hessian_trace")) == "float64"
    assert entry_dtype("auto", get_measure("pacbayes_flatness")) == "float32"
    assert entry_dtype("float64", get_measure("pacbayes_flatness")) == "float64"
    assert entry_dtype("float32", get_measure("hessian_trace")) == "float32"
    assert MeasureConfig().dtype == "auto"


def test_the_float32_twin_has_its_own_cache_and_is_made_once():
    ctx = context("mlp")
    twin = context_in(ctx, "float32")
    assert twin is context_in(ctx, "float32") and context_in(ctx, "float64") is ctx
    assert twin.dtype == torch.float32 and next(twin.model.parameters()).dtype == torch.float32
    assert twin.cache is not ctx.cache and twin.model is not ctx.model
    assert next(ctx.model.parameters()).dtype == torch.float64  # the float64 model is left as it was
    logits64 = ctx.model(ctx.inputs)
    assert torch.allclose(twin.model(twin.inputs).double(), logits64, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def values() -> dict[str, dict[str, tuple[float, float]]]:
    """Every float32 measure (ce) on every case of the population: (float64 value, float32 value)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for case_name in POPULATION:
        ctx = context(case_name)
        for name in FLOAT32:
            spec = get_measure(name)
            entry = Entry(name, name, "ce" if spec.uses_loss else None, spec.settings(SMALLER), "float32")
            pair = []
            for dtype in ("float64", "float32"):
                record = measure_entry(ctx, dataclasses.replace(entry, dtype=dtype))
                pair.append(record["values"][name] if record["status"] == "ok" else math.nan)
            out.setdefault(name, {})[case_name] = (pair[0], pair[1])
    return out


@pytest.mark.parametrize("name", FLOAT32)
def test_float32_gives_the_float64_value_to_rounding(values, name):
    for case_name, (v64, v32) in values[name].items():
        assert math.isfinite(v64) == math.isfinite(v32), (case_name, v64, v32)
        if math.isfinite(v64):
            assert v32 == pytest.approx(v64, rel=1e-4, abs=1e-9), case_name


@pytest.mark.parametrize("name", FLOAT32)
def test_float32_orders_the_models_as_float64_does(values, name):
    """The same ranking of the population, so Kendall's τ against any gap is unchanged."""
    pairs = [p for p in values[name].values() if math.isfinite(p[0])]
    assert len(pairs) >= 3
    v64, v32 = zip(*pairs)
    assert kendalltau(v64, v32).statistic == pytest.approx(1.0)


def test_a_result_records_the_dtype_it_was_computed_in_and_other_dtypes_are_stale(tmp_path):
    cfg = MeasureConfig(measures=("pacbayes_flatness", "hessian_trace"))
    assert measurement_context(cfg, get_measure("pacbayes_flatness"))["dtype"] == "float32"
    assert measurement_context(cfg, get_measure("hessian_trace"))["dtype"] == "float64"
    ctx = context("mlp")
    spec = get_measure("pacbayes_flatness")
    record = compute_entry(context_in(ctx, "float32"), spec, spec.settings(), None)
    assert record["status"] == "ok" and record["info"]["samples"] == spec.defaults["samples"]
    # a result computed in float64 (an earlier study, or measure.dtype: float64) is recomputed under auto
    stale = {**record, "context": measurement_context(dataclasses.replace(cfg, dtype="float64"), spec)}
    fresh = {**record, "context": measurement_context(cfg, spec)}

    _, todo = pending_entries(tmp_path, ["pacbayes_flatness"], cfg, results={"pacbayes_flatness": stale})
    assert [key for _, _, key in todo] == ["pacbayes_flatness"]
    _, todo = pending_entries(tmp_path, ["pacbayes_flatness"], cfg, results={"pacbayes_flatness": fresh})
    assert todo == []
