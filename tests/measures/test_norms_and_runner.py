"""Norm measures against brute-force references, and the measure runner's bookkeeping."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from cases import case, context
from torch import nn

from flatbench.measures.context import MeasureContext
from flatbench.measures.registry import MeasureOutput, MeasureSpec, NotApplicable, all_measures
from flatbench.measures.runner import compute_entry


def _ctx(model: nn.Module, inputs: torch.Tensor) -> MeasureContext:
    targets = torch.zeros(inputs.shape[0], dtype=torch.long)
    return MeasureContext(model=model.double().eval(), inputs=inputs.double(), targets=targets, num_classes=3)


def _spec(name):
    return all_measures()[name]


def _mlp(bias: bool) -> nn.Sequential:
    """A net small enough to enumerate its paths by hand (special-purpose, not a catalogue case)."""
    torch.manual_seed(0)
    return _double(nn.Sequential(nn.Flatten(), nn.Linear(4, 5, bias=bias), nn.ReLU(), nn.Linear(5, 3, bias=bias),
                         nn.ReLU(), nn.Linear(3, 3, bias=bias)))


def _double(model: nn.Module) -> nn.Module:
    return model.double()


@pytest.mark.parametrize("name", ["mlp", "lenet", "wrn"])
def test_frobenius_sum_and_product(name):
    """Σ_l ‖W_l‖_F² and Σ_l log ‖W_l‖_F² over every Linear / Conv2d weight (biases and BatchNorm excluded),
    entry by entry in Python floats."""
    model = case(name).model
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    squares = {n: math.fsum(v * v for v in m.weight.detach().flatten().tolist()) for n, m in layers}
    out = _spec("frobenius_norm").fn(context(name))
    assert out.values["frobenius_norm"] == pytest.approx(math.fsum(squares.values()), rel=1e-12)
    for n, sq in squares.items():
        assert out.values[f"frobenius_norm/{n}"] == pytest.approx(sq, rel=1e-12)
    assert set(out.values) == {"frobenius_norm"} | {f"frobenius_norm/{n}" for n in squares}
    prod = _spec("frobenius_norm_product").fn(context(name)).values["frobenius_norm_product"]
    assert prod == pytest.approx(math.fsum(math.log(sq) for sq in squares.values()), rel=1e-12)


def test_spectral_norm_of_conv_matches_the_explicit_operator():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 3 * 3, 3)).double()
    inputs = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    ctx = _ctx(model, inputs).for_measure("spectral_norm", {"iters": 2000, "tol": 1e-12})
    out = _spec("spectral_norm").fn(ctx)
    conv = model[0]
    jac = torch.autograd.functional.jacobian(
        lambda x: torch.nn.functional.conv2d(x, conv.weight, None, 2, 1), torch.zeros(1, 2, 6, 6, dtype=torch.float64))
    matrix = jac.reshape(3 * 3 * 3, 2 * 6 * 6)
    expected_conv = float(torch.linalg.matrix_norm(matrix, 2)) ** 2
    expected_fc = float(torch.linalg.matrix_norm(model[3].weight, 2)) ** 2
    assert out.values["spectral_norm/0"] == pytest.approx(expected_conv, rel=1e-6)
    assert out.values["spectral_norm"] == pytest.approx(math.log(expected_conv) + math.log(expected_fc), rel=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_path_norm_matches_path_enumeration(bias):
    model = _mlp(bias)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    total = 0.0
    # every path from an input (or a bias, which starts a path at its layer) to an output
    dims = [4, 5, 3, 3]
    for start in range(len(linears) + 1 if bias else 1):
        first_nodes = range(dims[0]) if start == 0 else range(dims[start])
        for node in first_nodes:
            for rest in itertools.product(*(range(d) for d in dims[start + 1:])):
                nodes = (node, *rest)
                value = 1.0
                if start > 0:
                    value *= float(linears[start - 1].bias[node]) ** 2
                for layer, (a, b) in enumerate(zip(nodes, nodes[1:]), start=start):
                    value *= float(linears[layer].weight[b, a]) ** 2
                total += value
    out = _spec("path_norm").fn(_ctx(model, torch.randn(2, 4, dtype=torch.float64)))
    assert out.values["path_norm"] == pytest.approx(total, rel=1e-10)


def test_path_norm_folds_batchnorm():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2, bias=False)).double()
    model[1].running_mean.normal_()
    model[1].running_var.uniform_(0.5, 2)
    model[1].weight.data.normal_()
    model[1].bias.data.normal_()
    bn = model[1]
    a = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    b = bn.bias - a * bn.running_mean
    w1, w2 = model[0].weight.pow(2), model[3].weight.pow(2)
    expected = float((w2 @ (a.pow(2) * (w1 @ torch.ones(3, dtype=torch.float64)) + b.pow(2))).sum())
    out = _spec("path_norm").fn(_ctx(model, torch.randn(2, 3, dtype=torch.float64)))
    assert out.values["path_norm"] == pytest.approx(expected, rel=1e-10)


def _failing(ctx):
    raise ValueError("broken on purpose")


def _never(ctx):
    raise NotApplicable("only for models that do not exist")


def _lossy(ctx):
    return MeasureOutput({"_test_lossy": float(ctx.loss(ctx.model(ctx.inputs), ctx.targets)),
                          "_test_lossy/detail": 1.0}, {"loss": ctx.loss_name})


def _local_spec(name, fn, uses_loss=False):
    """A spec that is not registered, so the global registry (and the invariance matrix) never sees it."""
    return MeasureSpec(name=name, fn=fn, description="test", invariant_to=frozenset(), cost="cheap", defaults={},
                       uses_loss=uses_loss, stochastic=False, larger_is_sharper=True, exact=True)


def test_runner_records_errors_not_applicable_and_loss_suffixes():
    ctx = context("mlp")
    err = compute_entry(ctx, _local_spec("_test_failing", _failing), {}, None)
    assert err["status"] == "error" and "broken on purpose" in err["error"] and err["seconds"] >= 0
    na = compute_entry(ctx, _local_spec("_test_not_applicable", _never), {}, None)
    assert na["status"] == "not_applicable" and "do not exist" in na["reason"]
    ce = compute_entry(ctx, _local_spec("_test_lossy", _lossy, True), {}, "ce")
    nce = compute_entry(ctx, _local_spec("_test_lossy", _lossy, True), {}, "normalized_ce")
    assert set(ce["values"]) == {"_test_lossy", "_test_lossy/detail"}
    assert set(nce["values"]) == {"_test_lossy@normalized_ce", "_test_lossy@normalized_ce/detail"}
    assert nce["info"]["loss"] == "normalized_ce" and nce["settings"]["loss"] == "normalized_ce"
    assert ce["values"]["_test_lossy"] != nce["values"]["_test_lossy@normalized_ce"]


def test_every_registered_measure_is_described():
    for name, spec in all_measures().items():
        assert spec.description and spec.cost in ("cheap", "gradient", "hessian", "search"), name
