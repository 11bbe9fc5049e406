"""Issue 29's rough edges: every bad argument of `flatbench.measure` is one line (a `FlatbenchError`) raised
before any work, and the statuses say what happened (`not_converged` with its residual, a fixed-loss measure
given another loss, PAC-Bayes on a model that does not fit its data). The caller's train/eval mode and
`requires_grad` flags are restored after measuring: tests/test_isolation.py
(`test_the_api_measures_in_eval_mode_with_every_parameter_and_leaves_the_callers_model_as_it_was`, a
train-mode BatchNorm + Dropout model with a frozen layer)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import flatbench
from flatbench.errors import FlatbenchError


from cases import small_data as _data, small_tanh_mlp as _mlp  # noqa: E402


def _one_line(match: str, *args, **kwargs) -> str:
    with pytest.raises(FlatbenchError, match=match) as info:
        flatbench.measure(*args, **kwargs)
    assert isinstance(info.value, ValueError) or isinstance(info.value, FlatbenchError)
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


class Wrapper(nn.Module):
    """An MLP class that wraps its nn.Sequential."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_bad_arguments_are_one_line_before_any_work(monkeypatch) -> None:
    calls = []
    import flatbench.api as api

    real = api.compute_records
    monkeypatch.setattr(api, "compute_records", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, (x, y) = _mlp(), _data()
    _one_line(r"inputs of shape \(5,\).*mat1 and mat2", model, (torch.randn(12, 5), y), ["hessian_trace"])
    if not torch.cuda.is_available():
        _one_line("CUDA is not available on this machine", model, (x, y), ["hessian_trace"], device="cuda")
    _one_line("device must be", model, (x, y), ["hessian_trace"], device="gpu0")
    _one_line("dtype must be torch.float64 or torch.float32", model, (x, y), ["path_norm"], dtype=torch.int64)
    _one_line("inputs are torch.int64.*x.float", model, ((x * 10).long(), y), ["path_norm"])
    _one_line("hvp_mode must be one of auto, rev_fwd", model, (x, y), ["hessian_trace"], hvp_mode="bogus")
    _one_line("chunk_size must be a positive integer", model, (x, y), ["hessian_trace"], chunk_size=0)
    _one_line("measure.settings.hessian_max_eig.iters: must be at least 1", model, (x, y), ["hessian_max_eig"],
              settings={"hessian_max_eig": {"iters": 0}})
    _one_line("hessian_trace.method: must be one of auto, exact", model, (x, y), ["hessian_trace"],
              settings={"hessian_trace": {"method": "bogus"}})
    _one_line("hessian_max_eig.per: must be one of none, layer, block", model, (x, y), ["hessian_max_eig"],
              settings={"hessian_max_eig": {"per": "tensor"}})
    _one_line("hessian_max_eig.iters: expected an integer", model, (x, y), ["hessian_max_eig"],
              settings={"hessian_max_eig": {"iters": "many"}})
    _one_line("unknown setting 'iter' for measure 'hessian_max_eig' \\(did you mean 'iters'", model, (x, y),
              ["hessian_max_eig"], settings={"hessian_max_eig": {"iter": 5}})
    text = _one_line("returned a scalar", model, (x, y), ["hessian_trace"],
                     loss=lambda f, t: nn.functional.cross_entropy(f, t))
    assert "reduction='none'" in text
    assert not calls  # every refusal came before the first measure


def test_minimum_sharpness_on_a_wrapped_sequential_says_what_to_do() -> None:
    x, y = _data()
    df = flatbench.measure(Wrapper(), (x, y), ["minimum_sharpness"])
    row = df.iloc[0]
    assert row["status"] == "not_applicable"
    assert "flatbench.measure(model.net, ...)" in row["reason"] and "\n" not in row["reason"]
    inner = flatbench.measure(Wrapper().net, (x, y), ["minimum_sharpness"])
    assert inner.iloc[0]["status"] == "ok"


def test_a_module_extended_by_backpack_is_measured_through_its_forward() -> None:
    backpack = pytest.importorskip("backpack")
    x, y = _data()
    plain = flatbench.measure(_mlp(), (x, y), ["hessian_trace"])
    model = backpack.extend(_mlp())
    model(x)  # BackPACK's hooks store input0 / output on the modules
    df = flatbench.measure(model, (x, y), ["hessian_trace"])
    assert df.iloc[0]["status"] == "ok"
    assert df.iloc[0]["value"] == pytest.approx(plain.iloc[0]["value"], rel=1e-12)
    assert hasattr(model[1], "input0") and len(model[1]._forward_hooks) == 1  # the caller's model keeps them


def test_not_converged_is_a_status_with_its_residual_and_the_estimate_in_info() -> None:
    x, y = _data()
    df = flatbench.measure(_mlp(), (x, y), ["hessian_max_eig", "hessian_trace"],
                           settings={"hessian_max_eig": {"iters": 2},
                                     "hessian_trace": {"method": "hutchpp", "max_hvps": 8, "sketch": 2,
                                                       "rtol": 1e-6}})
    rows = {r["measure"]: r for _, r in df.iterrows()}
    eig = rows["hessian_max_eig"]
    assert eig["status"] == "not_converged" and math.isnan(eig["value"])
    assert "stopped at iters = 2 with relative residual" in eig["reason"]
    assert df.attrs["info"]["hessian_max_eig"]["values"]["hessian_max_eig"] > 0  # the estimate, kept in info
    trace = rows["hessian_trace"]
    assert trace["status"] == "not_converged" and "budget of 8 HVPs" in trace["reason"]
    converged = flatbench.measure(_mlp(), (x, y), ["hessian_max_eig"])
    assert converged.iloc[0]["status"] == "ok"


def test_not_converged_counts_as_failed_and_is_a_valid_measures_json_entry() -> None:
    from flatbench.measures.runner import FAILED
    from flatbench.store import measure_entry_problem

    assert "not_converged" in FAILED
    assert measure_entry_problem({"status": "not_converged", "reason": "r", "info": {"values": {"a": 1.0}}}) is None


def test_a_fixed_loss_measure_given_another_loss_says_so() -> None:
    x, y = _data()
    df = flatbench.measure(_mlp(), (x, y), ["fisher_rao_norm", "normalized_sharpness", "hessian_trace"], loss="mse")
    rows = {r["measure"]: r for _, r in df[~df["key"].str.contains("/")].iterrows()}
    assert "computed with ce" in rows["fisher_rao_norm"]["reason"] and "(mse)" in rows["fisher_rao_norm"]["reason"]
    assert "computed with ce" in rows["normalized_sharpness"]["reason"]
    assert rows["hessian_trace"]["reason"] == "" and rows["hessian_trace"]["key"] == "hessian_trace@mse"
    plain = flatbench.measure(_mlp(), (x, y), ["fisher_rao_norm"])
    assert plain.iloc[0]["reason"] == ""


def test_pacbayes_on_an_untrained_model_is_not_applicable() -> None:
    x, y = _data(30)
    df = flatbench.measure(_mlp(), (x, y), ["pacbayes_flatness"],
                           settings={"pacbayes_flatness": {"samples": 2, "max_expansions": 2}})
    row = df.iloc[0]
    assert row["status"] == "not_applicable" and "does not fit its data" in row["reason"]
