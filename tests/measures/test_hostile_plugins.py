"""Issue 44 part A, "nothing silently wrong": a plugin (or a forward pass) that changes the caller's tensors, the
model's hooks or code, or the process, is an error entry and everything is put back; a forward pass without
a graph is an error, never a curvature of 0; a plugin cannot escape its time limit; check-measure runs a
measure as the stage does (guarded, with a time limit)."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import flatbench
from flatbench.api import measure_records
from flatbench.measures import contract


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3)).eval()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(20, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (20,), generator=g)


def _scale_input(ctx):
    ctx.inputs.mul_(0.5)


def _module_hook(ctx):
    next(iter(ctx.model.modules())).register_forward_hook(lambda m, i, o: o * 2)


def _gradient_hook(ctx):
    next(ctx.model.parameters()).register_hook(lambda g: g * 0)


def _global_hook(ctx):
    nn.modules.module.register_module_forward_hook(lambda m, i, o: o * 2 if isinstance(o, torch.Tensor) else o)


def _patch_forward(ctx):
    first = ctx.model[0]
    first.forward = lambda x: nn.functional.linear(x, first.weight * 3, first.bias)


def _patch_class_forward(ctx):
    nn.Linear.forward = lambda self, x: nn.functional.linear(x, self.weight * 3, self.bias)


def _patch_torch_function(ctx):
    torch.relu = lambda x: x  # F.relu calls torch.relu: every later ReLU network would be linear


def _patch_tensor_method(ctx):
    torch.Tensor.relu = lambda self: self


def _half_default(ctx):
    torch.set_default_dtype(torch.float16)


def _threads(ctx):
    torch.set_num_threads(torch.get_num_threads() + 1)


def _weights_from_a_thread(ctx):
    def spoil():
        time.sleep(0.05)
        with torch.no_grad():
            for p in ctx.model.parameters():
                p.mul_(1.5)

    threading.Thread(target=spoil, daemon=True).start()
    time.sleep(0.2)  # returns after the thread changed the weights: the guard must see it


HOSTILE = {"changes the caller's inputs": _scale_input, "registers a module hook": _module_hook,
           "registers a gradient hook on a weight": _gradient_hook,
           "registers a global forward hook": _global_hook, "patches forward on the instance": _patch_forward,
           "patches forward on the class": _patch_class_forward,
           "replaces torch.relu": _patch_torch_function, "replaces Tensor.relu": _patch_tensor_method, "sets the default dtype to half": _half_default,
           "changes the number of threads": _threads, "changes the weights from a thread": _weights_from_a_thread}
"""What a plugin must not do (each an error entry, put back). Ignoring SIGALRM is put back by the time limit
itself, silently: see test_a_plugin_that_ignores_sigalrm_still_times_out_and_the_alarm_works_for_the_next."""


def _register(name: str, action) -> None:
    @flatbench.register_measure(name, description="a hostile plugin (tests)")
    def hostile(ctx):
        action(ctx)
        return 1.0


@pytest.mark.parametrize("action", sorted(HOSTILE))
def test_each_hostile_change_is_an_error_and_put_back(action):
    _check_put_back([action])


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(sorted(HOSTILE)), min_size=2, max_size=4, unique=True))
def test_a_plugin_that_changes_caller_or_process_state_is_an_error_and_all_is_put_back(actions):
    _check_put_back(actions)


def _check_put_back(actions):
    """Run a plugin doing `actions`, then two measures: it is an error; they equal their values alone; the
    caller's inputs, torch's settings, the global hooks, nn.Linear and SIGALRM's handler are as before."""
    from flatbench.measures import registry

    saved = dict(registry.REGISTERED)
    try:
        _register("_hostile", lambda ctx: [HOSTILE[a](ctx) for a in actions])
        x, y = _data()
        x0, threads, dtype = x.clone(), torch.get_num_threads(), torch.get_default_dtype()
        alone = measure_records(_model(), (x.clone(), y), ["hessian_trace", "frobenius_norm"])
        records = measure_records(_model(), (x, y), ["_hostile", "hessian_trace", "frobenius_norm"])
        assert records["_hostile"]["status"] == "error", (actions, records["_hostile"])
        for name in ("hessian_trace", "frobenius_norm"):
            assert records[name]["status"] == "ok" and records[name]["values"] == alone[name]["values"], actions
        assert torch.equal(x, x0) and torch.get_num_threads() == threads and torch.get_default_dtype() == dtype
        assert not nn.modules.module._global_forward_hooks
        assert nn.Linear.__dict__["forward"].__module__ == "torch.nn.modules.linear"
        assert not isinstance(torch.relu, type(lambda: 0)) and "relu" not in vars(torch.Tensor)
        assert signal.getsignal(signal.SIGALRM) is not signal.SIG_IGN
    finally:
        registry.REGISTERED.clear()
        registry.REGISTERED.update(saved)


def test_a_plugin_that_mutates_the_input_no_longer_moves_the_hessian_trace(own_registry):
    _register("_mutate", _scale_input)
    x, y = _data()
    before = measure_records(_model(), (x, y), ["hessian_trace"])["hessian_trace"]["values"]["hessian_trace"]
    records = measure_records(_model(), (x, y), ["_mutate", "hessian_trace"])
    assert records["_mutate"]["status"] == "error" and "measurement inputs" in records["_mutate"]["error"]
    assert records["hessian_trace"]["values"]["hessian_trace"] == before
    assert measure_records(_model(), (x, y), ["hessian_trace"])["hessian_trace"]["values"]["hessian_trace"] == before


class _NoGradForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x):
        with torch.no_grad():
            return self.net(x)


GRAPH_MEASURES = ["hessian_trace", "hessian_max_eig", "fisher_rao_norm", "normalized_sharpness",
                  "scale_invariant_rangamani", "eps_sharpness"]


def test_a_forward_pass_without_a_graph_is_an_error_never_a_curvature_of_0():
    records = measure_records(_NoGradForward(), _data(), GRAPH_MEASURES)
    for name in GRAPH_MEASURES:
        assert records[name]["status"] == "error" and "autograd" in records[name]["error"], (name, records[name])


class _Scaled(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.net, self.scale = _model(), scale

    def forward(self, x):
        return self.net(x) * self.scale


@settings(max_examples=15, deadline=None)
@given(st.floats(min_value=-10, max_value=10, allow_nan=False).filter(lambda c: abs(c) > 1e-3))
def test_a_constant_scale_is_an_edge_of_every_path(scale):
    """path_norm(f · c) = c² · path_norm(f): the constant is a weight on every path (× −1 is no nan)."""
    base = measure_records(_model(), _data(), ["path_norm"])["path_norm"]
    scaled = measure_records(_Scaled(scale), _data(), ["path_norm"])["path_norm"]
    assert scaled["status"] == "ok", scaled
    assert math.isclose(scaled["values"]["path_norm"], scale ** 2 * base["values"]["path_norm"], rel_tol=1e-9)


def test_a_plugin_that_ignores_sigalrm_still_times_out_and_the_alarm_works_for_the_next(own_registry):
    @flatbench.register_measure("_deaf", description="ignores SIGALRM, then sleeps")
    def _deaf(ctx):
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(30)
        return 1.0

    @flatbench.register_measure("_sleeper", description="sleeps")
    def _sleeper(ctx):
        time.sleep(30)
        return 1.0

    start = time.monotonic()
    records = measure_records(_model(), _data(), ["_deaf", "_sleeper"], timeout_s=0.5)
    assert time.monotonic() - start < 8
    assert records["_deaf"]["status"] == "error" and "timed out" in records["_deaf"]["error"]
    assert records["_sleeper"]["status"] == "error" and "timed out" in records["_sleeper"]["error"]
    assert signal.getsignal(signal.SIGALRM) is not signal.SIG_IGN
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_plugin_that_swallows_its_timeout_once_is_still_an_error(own_registry):
    @flatbench.register_measure("_swallow", description="catches BaseException once, then returns")
    def _swallow(ctx):
        try:
            time.sleep(30)
        except BaseException:  # noqa: BLE001 - the hostile part
            pass
        return 1.0

    start = time.monotonic()
    records = measure_records(_model(), _data(), ["_swallow"], timeout_s=0.3)
    assert time.monotonic() - start < 8
    assert records["_swallow"]["status"] == "error" and "timed out" in records["_swallow"]["error"]


def test_check_measure_fails_a_plugin_that_mutates_the_model_and_limits_a_sleeping_one(own_registry):
    @flatbench.register_measure("_mutator", description="scales the first weight by 2")
    def _mutator(ctx):
        with torch.no_grad():
            next(ctx.model.parameters()).mul_(2)
        return float(sum(p.abs().sum() for p in ctx.model.parameters()))

    @flatbench.register_measure("_napper", description="sleeps")
    def _napper(ctx):
        time.sleep(20)
        return 1.0

    report = contract.check_measure("_mutator", cases=contract.CASES[:1], families=("layer",))
    assert report.problems and any("changed the model" in p for p in report.problems), report.problems
    start = time.monotonic()
    report = contract.check_measure("_napper", cases=contract.CASES[:1], families=("layer",), timeout_s=0.3)
    assert time.monotonic() - start < 10
    assert report.problems and any("timed out" in p for p in report.problems), report.problems


_PROFILE_AFTER_A_TIMEOUT = """
import signal, sys, time
from flatbench.measures.isolation import MeasureTimeout, time_limit
for deaf in (False, True):
    try:
        with time_limit(0.2, "sleeper"):
            if deaf:
                signal.signal(signal.SIGALRM, signal.SIG_IGN)
            time.sleep(5)
    except MeasureTimeout:
        pass
sys.setprofile(lambda *args: None)
(lambda: sum(range(1000)))()
sys.setprofile(None)
print("done")
"""


def test_a_timed_out_measure_leaves_no_interrupt_pending_for_a_profiler_after_it():
    """Clearing the watchdog's pending time-out with `PyThreadState_SetAsyncExc(id, NULL)` left CPython 3.11's
    eval breaker signalled for good: the next call under `sys.setprofile` looped forever (the suite hung in
    CI in a test that walks calls with a profiler, after this file's time-outs). In a child process, so
    that the bug fails the test instead of hanging the suite."""
    done = subprocess.run([sys.executable, "-c", _PROFILE_AFTER_A_TIMEOUT], capture_output=True, text=True,
                          timeout=90, check=False)
    assert done.stdout.strip() == "done", done.stderr[-2000:]
