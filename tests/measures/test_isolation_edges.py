"""Isolation edges that issue 30's planted-bug round found untested: a change to one element far into a
tensor, a measure that catches `Exception` around its own time-out, a value cached by a measure that
changed the model, and stale plugin entries decided by the plugin loaded now."""

from __future__ import annotations

import json
import time

import torch
from torch import nn

import flatbench
from flatbench.api import measure_records


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 40), nn.ReLU(), nn.Linear(40, 3)).eval()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g)


def test_a_change_to_the_last_element_of_a_weight_is_seen_and_undone(own_registry):
    @flatbench.register_measure("_last", description="nudges the last element of the first weight")
    def _last(ctx):
        with torch.no_grad():
            ctx.model[0].weight[-1, -1] += 1e-9
        return 1.0

    alone = measure_records(_model(), _data(), ["frobenius_norm"])["frobenius_norm"]["values"]
    records = measure_records(_model(), _data(), ["_last", "frobenius_norm"])
    assert records["_last"]["status"] == "error" and "parameter 0.weight" in records["_last"]["error"]
    assert records["frobenius_norm"]["values"] == alone


def test_a_measure_that_catches_exception_still_times_out(own_registry):
    @flatbench.register_measure("_stubborn", description="catches every Exception around a long sleep")
    def _stubborn(ctx):
        try:
            time.sleep(20)
        except Exception:  # noqa: BLE001 - what a careless plugin does
            return 1.0
        return 2.0

    start = time.monotonic()
    records = measure_records(_model(), _data(), ["_stubborn"], timeout_s=0.3)
    assert time.monotonic() - start < 10
    assert records["_stubborn"]["status"] == "error" and records["_stubborn"]["error"] == "timed out after 0.3 s"


def test_a_value_cached_on_a_changed_model_is_never_handed_to_the_next_measure(own_registry):
    def weight_sum(ctx):
        return ctx.cached("_weight_sum", lambda: float(sum(p.detach().sum() for p in ctx.model.parameters())))

    @flatbench.register_measure("_poisoner", description="doubles the weights, then caches a value of them")
    def _poisoner(ctx):
        with torch.no_grad():
            for p in ctx.model.parameters():
                p.mul_(2.0)
        weight_sum(ctx)
        return 1.0

    @flatbench.register_measure("_reader", description="reads the shared cached value")
    def _reader(ctx):
        return weight_sum(ctx)

    alone = measure_records(_model(), _data(), ["_reader"])["_reader"]["values"]["_reader"]
    records = measure_records(_model(), _data(), ["_poisoner", "_reader"])
    assert records["_poisoner"]["status"] == "error"
    assert records["_reader"]["values"]["_reader"] == alone


PLUGIN = '''
from flatbench import register_measure

@register_measure("_versioned_unit", description="a plugin measure")
def _versioned_unit(ctx):
    return VERSION
'''


def test_stale_is_decided_by_the_plugin_loaded_now_and_keeps_a_run_from_counting_as_measured(tmp_path, own_registry):
    from flatbench.userspec import file_sha256 as _sha256
    from flatbench.measures.registry import load_plugins
    from flatbench.measures.stale import stale_reason
    from flatbench.study.status import _measure_state

    old, new = tmp_path / "v1.py", tmp_path / "v2.py"
    old.write_text("VERSION = 1.0\n" + PLUGIN)
    new.write_text("VERSION = 2.0\n" + PLUGIN)
    load_plugins([str(new)])  # the study loads v2 now; v1 still lies where its entries say
    run = tmp_path / "run"
    run.mkdir()
    entry = {"status": "ok", "values": {"_versioned_unit": 1.0}, "plugin": {"source": str(old), "sha256": _sha256(old)}}
    assert "now" in stale_reason("_versioned_unit", entry)
    (run / "measures.json").write_text(json.dumps({"_versioned_unit": entry}))
    assert _measure_state(run, ["_versioned_unit"]) == (False, None, ["_versioned_unit"])
    current = {**entry, "plugin": {"source": str(new), "sha256": _sha256(new)}}
    assert stale_reason("_versioned_unit", current) is None
    (run / "measures.json").write_text(json.dumps({"_versioned_unit": current}))
    assert _measure_state(run, ["_versioned_unit"]) == (True, None, [])


def test_a_bool_is_never_a_value_bare_in_a_dict_or_in_a_measure_output():
    import numpy as np
    import pytest

    from flatbench.measures.registry import MeasureOutput, MeasureOutputError, as_output

    for bad in (True, {"m": True}, {"m": 1.0, "m/x": False}, {"m": np.bool_(False)},
                MeasureOutput({"m": True}), torch.tensor(True), {"m": torch.tensor(False)}):
        with pytest.raises(MeasureOutputError, match="measure 'm'"):
            as_output(bad, "m")


def test_nan_and_inf_are_non_finite_and_info_json_cannot_hold_is_an_error(own_registry):
    from flatbench.measures.registry import MeasureOutput

    for name, value in (("_inf", float("inf")), ("_ninf", -float("inf")), ("_nan", float("nan"))):
        flatbench.register_measure(name, description="a non-finite value")(lambda ctx, v=value: {ctx.measure_name: v})
    flatbench.register_measure("_handle", description="info JSON cannot hold")(
        lambda ctx: MeasureOutput({"_handle": 1.0}, {"handle": object()}))
    records = measure_records(_model(), _data(), ["_inf", "_ninf", "_nan", "_handle"])
    for name in ("_inf", "_ninf", "_nan"):
        assert records[name]["status"] == "non_finite" and f"gave {name} = " in records[name]["reason"], records[name]
    assert records["_handle"]["status"] == "error" and "JSON cannot hold" in records["_handle"]["error"]


def test_the_guard_compares_bits_sees_non_persistent_buffers_and_puts_a_moved_tensor_back():
    """The guard compares each tensor bit for bit against its copy (issue 29 replaced the hashes by the
    comparison): -0.0 over 0.0 is a change, NaN over the same NaN is not; a non-persistent buffer (not in
    the state dict) is guarded too; a tensor replaced by one of another dtype is put back as it was."""
    from flatbench.measures.isolation import ModelGuard, guarded_call

    net = _model()
    net.register_buffer("scratch", torch.tensor([0.0, float("nan"), 1.0]), persistent=False)
    net[2].bias.data[0] = 0.0
    weight = net[0].weight

    def negative_zero():
        with torch.no_grad():
            net[2].bias[0] = -0.0

    _, _, change = guarded_call(net, negative_zero)
    assert change == "parameter 2.bias" and not torch.signbit(net[2].bias[0])

    def same_nan():
        net.scratch.copy_(torch.tensor([0.0, float("nan"), 1.0]))

    assert guarded_call(net, same_nan)[2] is None

    def scratch():
        net.scratch[2] = 5.0

    assert guarded_call(net, scratch)[2] == "buffer scratch" and float(net.scratch[2]) == 1.0

    def to_double():
        net[0].weight = nn.Parameter(weight.detach().double())

    guard = ModelGuard(net)
    to_double()
    assert guard.change(net) == "parameter 0.weight"
    guard.restore(net)
    assert net[0].weight.dtype == torch.float32 and torch.equal(net[0].weight, weight)
    assert guard.change(net) is None


def test_the_api_skips_its_copy_of_the_callers_model_only_when_nothing_of_the_callers_runs(own_registry):
    """`_CallerState` (a copy of the caller's model to put back) is needed only when a plugin measure or a
    loss of the caller's can hold the caller's model; a plugin that changes the caller's model through a
    reference is undone."""
    from flatbench.api import _only_flatbench_code

    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    @flatbench.register_measure("_reach", description="changes the caller's model through a closure")
    def _reach(ctx):
        with torch.no_grad():
            model[0].weight.mul_(2)
        return 1.0

    assert _only_flatbench_code(["frobenius_norm", "hessian_trace"], "ce")
    assert not _only_flatbench_code(["frobenius_norm", "_reach"], "ce")
    assert not _only_flatbench_code(["frobenius_norm"], lambda logits, y: logits.sum(1))
    measure_records(model, _data(), ["_reach", "frobenius_norm"])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _SelfWriting(nn.Module):
    """A model of the caller's whose forward writes into its own weight through `.data`: a write the version
    counters do not see."""

    def __init__(self):
        super().__init__()
        self.body = _model()

    def forward(self, x):
        self.body[0].weight.data[0, 0] += 1.0
        return self.body(x)


def test_the_version_counters_stand_in_for_the_bytes_only_where_flatbench_and_torch_code_alone_run(own_registry):
    """`known_code`: torch.nn and flatbench modules without hooks. There a guard without `bitwise` takes an
    unchanged version counter for unchanged bytes (a change through torch is still seen and undone, a change
    put back exactly is none); a write through `.data`, which only code of the caller's can make, is seen
    only bit for bit, so a model of the caller's class or a plugin measure is always compared bit for bit."""
    from flatbench.measures.isolation import ModelGuard, known_code

    net = _model()
    assert known_code(net)
    assert not known_code(_SelfWriting())
    handle = net[2].register_forward_hook(lambda *_: None)
    assert not known_code(net)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        assert not known_code(net)
    finally:
        handle.remove()
    assert known_code(net)

    weight = net[0].weight.detach().clone()
    guard = ModelGuard(net, bitwise=False)
    with torch.no_grad():
        net[0].weight.mul_(2.0)
    assert guard.change(net) == "parameter 0.weight"
    guard.restore(net)
    assert torch.equal(net[0].weight, weight)

    guard = ModelGuard(net, bitwise=False)
    with torch.no_grad():
        net[0].weight.mul_(2.0).div_(2.0)  # the counter moves; the bytes are compared and found the same
    assert net[0].weight._version > 0 and torch.equal(net[0].weight, weight) and guard.change(net) is None

    guard = ModelGuard(net, bitwise=False)  # new data under a parameter moves no counter, but is seen
    net[0].weight.data = net[0].weight.data * 2
    assert guard.change(net) == "parameter 0.weight"
    guard.restore(net)
    net.double()
    assert guard.change(net) == "parameter 0.bias, parameter 0.weight, parameter 2.bias and 1 more"
    guard.restore(net)
    assert net[0].weight.dtype == torch.float32 and torch.equal(net[0].weight, weight)

    for bitwise, seen in ((False, False), (True, True)):
        guard = ModelGuard(net, bitwise=bitwise)
        net[0].weight.data[0, 0] += 1.0
        assert (guard.change(net) is not None) is seen
        net[0].weight.data.copy_(weight)

    # Through the measure stage: a built-in measure on a model whose own forward writes through `.data` is an
    # error (compared bit for bit), as is a plugin measure writing through `.data` on a torch.nn model.
    records = measure_records(_SelfWriting(), _data(), ["hessian_trace"])
    assert records["hessian_trace"]["status"] == "error" and "changed the model" in records["hessian_trace"]["error"]

    @flatbench.register_measure("_through_data", description="writes through .data")
    def _through_data(ctx):
        ctx.model[0].weight.data[0, 0] += 1.0
        return 1.0

    records = measure_records(_model(), _data(), ["_through_data", "frobenius_norm"])
    assert records["_through_data"]["status"] == "error" and "changed the model" in records["_through_data"]["error"]
    assert records["frobenius_norm"]["status"] == "ok"
