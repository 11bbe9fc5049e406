"""Hypothesis on the plugin surface (issue 30): generated plugin measures that return arbitrary Python values,
raise arbitrary exceptions (SystemExit and other BaseExceptions included) and change the model (weights,
buffers, train mode, requires_grad, a replaced parameter), between built-in measures.

Property: every entry is `ok` with finite real values (its headline among them) and info JSON can hold, or
`error` / `non_finite` with a reason; and the built-in entries around it are exactly those of a clean run
(the plugin never changes what the others see). KeyboardInterrupt is the stage's (Ctrl-C): it passes
through, with the model put back.

`FLATBENCH_FUZZ_EXAMPLES` sets the examples per property (default 40), as in tests/test_fuzz_readers.py.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from torch import nn

if os.environ.get("CI"):
    import hypothesis  # CI installs the test extra: a missing Hypothesis is a failure there, never a skip
else:
    hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import flatbench
from flatbench.api import measure_records
from flatbench.measures import registry
from flatbench.measures.registry import MeasureOutput
from flatbench.store import json_problem

EXAMPLES = int(os.environ.get("FLATBENCH_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
BUILTIN = ["frobenius_norm", "spectral_norm", "fisher_rao_norm"]
NAME = "_fuzzed"


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)


class Odd:
    """An object that JSON cannot hold and whose float() lies."""

    def __float__(self) -> float:
        return 1.0


numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.booleans(),
                    st.sampled_from([10 ** 400, -(10 ** 400), np.float32(2.5), np.int64(3), np.bool_(True),
                                     np.float64("nan"), np.array(1.5), np.array([1.0, 2.0]), 1j]))
tensors = st.sampled_from([torch.tensor(2.0), torch.tensor([3.0]), torch.tensor(float("inf")), torch.ones(2),
                           torch.tensor(True), torch.tensor(1 + 2j), torch.tensor(7)])
junk = st.one_of(st.none(), st.text(max_size=8), st.binary(max_size=4), st.just(Odd()), st.just(object()),
                 st.lists(st.floats(), max_size=3), st.just({1, 2}))
values = st.one_of(numbers, tensors, junk)
infos = st.one_of(st.dictionaries(st.text(max_size=5), st.one_of(values, st.dictionaries(st.text(max_size=3), values,
                                                                                        max_size=2)), max_size=3),
                  junk)
keys = st.one_of(st.just(NAME), st.sampled_from([f"{NAME}/detail", "other", "", NAME.upper()]), st.integers(0, 3))
returns = st.one_of(
    values,
    st.dictionaries(keys, values, max_size=3),
    st.builds(lambda h, rest: {NAME: h, **rest}, values, st.dictionaries(keys, values, max_size=2)),
    st.builds(lambda v, i: MeasureOutput(v, i), st.builds(lambda h, rest: {NAME: h, **rest}, values,
                                                           st.dictionaries(keys, values, max_size=2)), infos),
    st.builds(lambda v, i: MeasureOutput(v, i), junk, infos),
)


class Custom(BaseException):
    """A BaseException of the user's own."""


raises = st.sampled_from([ValueError("bad"), RuntimeError("cuda?"), SystemExit(0), SystemExit(3), SystemExit("bye"),
                          GeneratorExit(), Custom("mine"), MemoryError(), RecursionError(), ZeroDivisionError(),
                          KeyError("k"), StopIteration(), AssertionError(), NotImplementedError(), TypeError("t"),
                          OSError(28, "No space left on device")])


def _scale(m):
    with torch.no_grad():
        m[0].weight.mul_(2.0)


def _noise(m):
    with torch.no_grad():
        m[4].bias.add_(1e-12)


def _buffer(m):
    m[1].running_var.zero_()


def _replace(m):
    m[4].weight = nn.Parameter(torch.zeros(2, 2))


def _freeze(m):
    m[0].weight.requires_grad_(False)


def _last(m):
    with torch.no_grad():
        m[4].weight[-1, -1] += 1e-9


def _train(m):
    m.train()


def _train_one(m):
    m[3].train()


def _forward_in_train(m):
    m.train()
    m(torch.randn(16, 6))  # moves the running statistics
    m.eval()


MUTATIONS = {"none": lambda m: None, "scale": _scale, "noise": _noise, "buffer": _buffer, "replace": _replace,
             "last": _last, "freeze": _freeze, "train": _train, "train_one": _train_one, "forward_in_train": _forward_in_train}
behaviours = st.tuples(st.sampled_from(sorted(MUTATIONS)), st.one_of(st.none(), raises), returns)


@pytest.fixture(scope="module")
def clean():
    return _entries(measure_records(_model(), _data(), BUILTIN))


def _entries(records: dict) -> dict[str, tuple[str, dict | None]]:
    return {k: (r["status"], r.get("values")) for k, r in records.items()}


@FUZZ
@given(behaviours, st.integers(0, len(BUILTIN)))
@example(("none", None, {NAME: float("inf")}), 1)  # the cases each class hinges on, always tried
@example(("none", None, MeasureOutput({NAME: 1.0}, {"handle": object()})), 0)
@example(("none", None, {NAME: True}), 2)
@example(("last", None, 1.0), 1)
@example(("none", Custom("mine"), 1.0), 0)
def test_a_plugin_measure_is_a_typed_entry_and_changes_no_other(own_registry, clean, behaviour, position):
    mutation, exc, returned = behaviour
    registry.REGISTERED.pop(NAME, None)  # the previous example's

    @flatbench.register_measure(NAME, description="generated (hostile)")
    def _fuzzed(ctx):
        MUTATIONS[mutation](ctx.model)
        if exc is not None:
            raise exc
        return returned

    names = BUILTIN[:position] + [NAME] + BUILTIN[position:]
    records = measure_records(_model(), _data(), names)
    entry = records[NAME]
    assert entry["status"] in ("ok", "error", "non_finite"), entry
    assert json_problem(entry) is None
    if mutation != "none":
        assert entry["status"] == "error" and "changed the model" in entry["error"], (mutation, entry)
    elif exc is not None:
        assert entry["status"] == "error", entry
        assert (f"{type(exc).__name__}: " in entry["error"] or f"{type(exc).__name__}(" in entry["error"]), entry
    elif entry["status"] == "ok":
        assert NAME in entry["values"], entry
        given = returned.values if isinstance(returned, MeasureOutput) else returned
        given = given.values() if isinstance(given, dict) else [given]
        assert not any(isinstance(v, (bool, np.bool_, str, bytes)) for v in given), entry  # never read as numbers
        assert all(type(v) is float and math.isfinite(v) for v in entry["values"].values()), entry
    elif entry["status"] == "non_finite":
        assert f"measure '{NAME}' gave" in entry["reason"], entry
    else:
        assert entry["error"].strip() and "changed the model" not in entry["error"], entry
    assert _entries({k: r for k, r in records.items() if k != NAME}) == clean  # bit for bit, wherever it ran


def test_keyboard_interrupt_passes_through_with_the_model_put_back(own_registry):
    model = _model()
    data = _data()

    @flatbench.register_measure(NAME, description="Ctrl-C in a measure")
    def _fuzzed(ctx):
        ctx.model.train()
        with torch.no_grad():
            ctx.model[0].weight.mul_(3.0)
        raise KeyboardInterrupt

    from flatbench.measures.context import MeasureContext
    from flatbench.measures.registry import get_measure
    from flatbench.measures.runner import compute_entry

    ctx = MeasureContext(model=model, inputs=data[0], targets=data[1], num_classes=int(data[1].max()) + 1,
                         run_id="fuzz")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(KeyboardInterrupt):
        compute_entry(ctx, get_measure(NAME), {}, None)
    assert not model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
