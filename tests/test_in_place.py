"""`flatbench.measure` on the caller's model itself (`measures/in_place.py`): the same values as on a copy, and
the model put back exactly (every tensor bit for bit, the modes, the `requires_grad` flags, the gradients),
also when the measurement fails half-way; and a copy wherever measuring in place would change the model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import flatbench
import flatbench.api as api
from flatbench.measures.registry import all_measures

SLOW = {"hessian_max_eig", "hessian_density"}  # Lanczos: seconds each, and nothing they do is not done by others


def _model() -> nn.Module:
    """BatchNorm (buffers, a mode that matters), dropout, a frozen first layer, a gradient left by training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3)).double()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    model.train()
    for p in model[0].parameters():
        p.requires_grad_(False)
    model[4].weight.grad = torch.full_like(model[4].weight, 7.0)
    return model


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (32,), generator=g)


def _state(model: nn.Module) -> dict:
    return {"tensors": {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()},
            "ids": [id(p) for p in model.parameters()], "modes": [m.training for m in model.modules()],
            "flags": [p.requires_grad for p in model.parameters()],
            "grads": [(id(p.grad), p.grad.clone()) if p.grad is not None else None for p in model.parameters()],
            "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                         for m in model.modules())}


def _assert_same(model: nn.Module, before: dict) -> None:
    after = _state(model)
    for key, value in before["tensors"].items():  # bit for bit (NaN, -0.0)
        assert torch.equal(after["tensors"][key].view(torch.int64) if value.is_floating_point() else after["tensors"][key],
                           value.view(torch.int64) if value.is_floating_point() else value), key
    assert after["ids"] == before["ids"] and after["modes"] == before["modes"] and after["flags"] == before["flags"]
    assert after["hooks"] == before["hooks"]
    for now, then in zip(after["grads"], before["grads"]):
        assert (now is None) == (then is None)
        if now is not None:
            assert now[0] == then[0] and torch.equal(now[1], then[1])  # the same gradient tensor, not added to


def _values(df) -> dict[str, tuple[float | None, str, str]]:
    return {k: (None if math.isnan(v) else v, s, r) for k, v, s, r in zip(df["key"], df["value"], df["status"],
                                                                       df["reason"])}


def test_built_in_measures_run_in_place_with_the_values_of_a_copy_and_leave_the_model_exactly(monkeypatch):
    names = [n for n in all_measures() if all_measures()[n].origin == "builtin" and n not in SLOW]
    hooked = _model()
    hooked[4].register_forward_hook(lambda *_: None)  # a hook of the caller's: measured on a copy
    on_copy = flatbench.measure(hooked, _data(), names)

    model = _model()
    before = _state(model)
    monkeypatch.setattr(api, "copy_model", lambda m: pytest.fail("the model was copied, not measured in place"))
    in_place = flatbench.measure(model, _data(), names)
    assert (in_place["status"].isin(["ok", "not_applicable"])).all(), in_place[in_place["status"] == "error"]
    assert (in_place["status"] == "ok").sum() > 25
    assert _values(in_place) == _values(on_copy)
    _assert_same(model, before)


def test_a_failure_half_way_still_puts_the_model_back(monkeypatch):
    model = _model()
    before = _state(model)

    def fails(ctx, *args, **kwargs):
        assert ctx.model is model and not ctx.model.training and all(p.requires_grad for p in model.parameters())
        loss = ctx.model(ctx.inputs).sum()
        loss.backward()  # a gradient on every parameter, the caller's 7.0s included were they not set aside
        raise RuntimeError("a measure's failure outside its guard")

    monkeypatch.setattr(api, "compute_records", fails)
    with pytest.raises(RuntimeError, match="outside its guard"):
        flatbench.measure(model, _data(), ["frobenius_norm"])
    _assert_same(model, before)


@pytest.mark.parametrize("case", ["dtype", "hvp_mode", "hook", "plugin_loss"])
def test_a_copy_is_measured_where_in_place_would_change_the_model(case, monkeypatch):
    model = _model()
    if case == "hook":
        model[0].register_forward_pre_hook(lambda *_: None)
    before = _state(model)
    copies = []
    real_copy = api.copy_model
    monkeypatch.setattr(api, "copy_model", lambda m: copies.append(m) or real_copy(m))
    kwargs = {"dtype": {"dtype": torch.float32}, "hvp_mode": {"hvp_mode": "double_backward"}, "hook": {},
              "plugin_loss": {"loss": lambda logits, y: nn.functional.cross_entropy(logits, y, reduction="none")}}
    df = flatbench.measure(model, _data(), ["hessian_trace", "frobenius_norm"], **kwargs[case])
    assert (df["status"] == "ok").all(), df
    assert copies == [model]
    _assert_same(model, before)
    assert next(model.parameters()).dtype == torch.float64
