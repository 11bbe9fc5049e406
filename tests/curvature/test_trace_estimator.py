"""`hessian_trace` beyond the structural exact diagonals: the dense diagonal of small models of any
architecture (an LSTM, attention with a positional embedding) against the materialized Hessian, and the
adaptive Hutch++ estimator (`curvature.trace`) against exact traces: its reported standard error, its
stopping rule, its budget, and its deflation."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from flatbench.curvature import HessianOperator, hutchpp_trace, math_attention
from flatbench.losses import get_loss
from flatbench.measures.context import MeasureContext
from flatbench.measures.registry import get_measure
from flatbench.measures.runner import compute_entry

C, N = 3, 16


class TinyLSTM(nn.Module):
    """LSTM over 4 steps, a Linear head on the last hidden state (218 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(3, 5, batch_first=True), nn.Linear(5, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class TinyAttention(nn.Module):
    """Token embedding plus a learned positional embedding (a bare nn.Parameter), LayerNorm,
    nn.MultiheadAttention, a GELU MLP, mean pooling (675 parameters)."""

    def __init__(self, d: int = 8, tokens: int = 4) -> None:
        super().__init__()
        self.embed, self.pos = nn.Linear(3, d), nn.Parameter(0.5 * torch.randn(tokens, d))
        self.norm, self.attn = nn.LayerNorm(d), nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp, self.head = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)), nn.Linear(d, C)

    def forward(self, x: Tensor) -> Tensor:
        t = self.embed(x) + self.pos
        h = self.norm(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        return self.head((t + self.mlp(t)).mean(1))


def case(cls: type[nn.Module]) -> tuple[nn.Module, Tensor, Tensor, Tensor]:
    """(model, x, y, dense Hessian of the mean ce loss), float64."""
    torch.manual_seed(0)
    net = cls().double().eval()
    x, y = torch.randn(N, 4, 3, dtype=torch.float64), torch.arange(N) % C
    params = {k: p.detach() for k, p in net.named_parameters()}

    def f(flat: Tensor) -> Tensor:
        d, offset = {}, 0
        for k, p in params.items():
            d[k] = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return get_loss("ce")(functional_call(net, d, (x,)), y)

    with math_attention():
        hess = torch.autograd.functional.hessian(f, torch.cat([p.reshape(-1) for p in params.values()]))
    return net, x, y, hess


def trace_entry(net: nn.Module, x: Tensor, y: Tensor, **settings) -> dict:
    spec = get_measure("hessian_trace")
    ctx = MeasureContext(model=net, inputs=x, targets=y, num_classes=C, measure_name="hessian_trace")
    return compute_entry(ctx, spec, {**spec.defaults, **settings}, "ce")


@pytest.mark.parametrize("cls", [TinyLSTM, TinyAttention])
def test_small_models_of_any_architecture_are_exact(cls: type[nn.Module]) -> None:
    net, x, y, hess = case(cls)
    diag = HessianOperator(net, x, y, get_loss("ce"), chunk_size=10).dense_diagonal().diag
    flat = torch.cat([diag[k].reshape(-1) for k, _ in net.named_parameters()])
    assert float((flat - hess.diagonal()).abs().max()) <= 1e-12 * float(hess.diagonal().abs().max())
    entry = trace_entry(net, x, y)
    assert entry["status"] == "ok" and entry["info"]["method"] == "exact" and "dense" in entry["info"]["reason"]
    op = HessianOperator(net, x, y, get_loss("ce"))
    assert op.diagonal(dense_max_params=op.size, hutchinson_probes=2).reason.startswith("dense")
    assert op.diagonal(dense_max_params=op.size - 1, hutchinson_probes=2).method == "hutchinson"
    assert entry["values"]["hessian_trace"] == pytest.approx(float(hess.trace()), rel=1e-12)
    assert entry["values"]["hessian_trace/pos" if cls is TinyAttention else "hessian_trace/lstm.weight_hh_l0"] != 0


def test_dense_diagonal_without_batched_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where an operator has no batching rule (a RuntimeError from the batched backward pass), the rows are
    taken one at a time, with the same result."""
    net, x, y, hess = case(TinyLSTM)
    real = torch.autograd.grad

    def unbatched(*args, **kwargs):
        if kwargs.get("is_grads_batched"):
            raise RuntimeError("Batching rule not implemented")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", unbatched)
    diag = HessianOperator(net, x, y, get_loss("ce")).dense_diagonal().diag
    flat = torch.cat([diag[k].reshape(-1) for k, _ in net.named_parameters()])
    assert float((flat - hess.diagonal()).abs().max()) <= 1e-12 * float(hess.diagonal().abs().max())


def test_the_shared_diagonal_is_dense_for_small_models() -> None:
    """What normalized_sharpness and the other diagonal measures share: exact (dense) up to
    DENSE_MAX_PARAMS parameters for any architecture, Hutchinson above."""
    from flatbench.curvature import DENSE_MAX_PARAMS
    from flatbench.measures.shared import hessian_diagonal as shared_diagonal

    net, x, y, hess = case(TinyLSTM)
    ctx = MeasureContext(model=net, inputs=x, targets=y, num_classes=C)
    result = shared_diagonal(ctx)
    flat = torch.cat([result.diag[k].reshape(-1) for k, _ in net.named_parameters()])
    assert result.method == "exact" and DENSE_MAX_PARAMS >= 3000
    assert float((flat - hess.diagonal()).abs().max()) <= 1e-12 * float(hess.diagonal().abs().max())


def test_hutchpp_measure_reaches_its_standard_error_and_is_within_it() -> None:
    """Above `exact_max_params`: Hutch++ stops at the requested relative standard error, and the exact
    trace lies within a few of its reported standard errors; per-tensor traces add up to the total."""
    net, x, y, hess = case(TinyAttention)
    exact = float(hess.trace())
    entry = trace_entry(net, x, y, exact_max_params=100, rtol=0.05)
    info, values = entry["info"], entry["values"]
    assert entry["status"] == "ok" and info["method"] == "hutchpp" and "exact_max_params" in info["reason"]
    assert info["converged"] and info["rel_stderr"] <= 0.05 and info["hvps"] == 2 * info["sketch"] + info["probes"]
    assert abs(values["hessian_trace"] - exact) <= 4 * info["stderr"]
    parts = sum(v for k, v in values.items() if "/" in k)
    assert parts == pytest.approx(values["hessian_trace"], rel=1e-10)
    capped = trace_entry(net, x, y, exact_max_params=100, rtol=1e-4, max_hvps=50)["info"]
    assert not capped["converged"] and capped["hvps"] == 50 and capped["rel_stderr"] > 1e-4
    assert trace_entry(net, x, y, method="exact", exact_max_params=100)["status"] == "not_applicable"


def _spiked(size: int = 60, seed: int = 0) -> Tensor:
    """A symmetric indefinite matrix with five large eigenvalues: where deflation pays."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(size, size, generator=gen, dtype=torch.float64))
    lam = torch.randn(size, generator=gen, dtype=torch.float64) * 0.3
    lam[:5] = torch.tensor([50.0, 30.0, 20.0, -10.0, 8.0], dtype=torch.float64)
    return q @ torch.diag(lam) @ q.t()


def test_hutchpp_error_is_calibrated_and_deflation_pays() -> None:
    """Over 40 seeds on a fixed matrix: |error| ≤ 3 reported standard errors in ≥ 90% of the runs; with
    a sketch of 10 the standard error after the same 60 HVPs is far below plain Hutchinson's (sketch 0);
    a sketch as large as the matrix is exact with standard error 0."""
    mat = _spiked()
    exact = float(mat.trace())
    matvec = lambda v: mat @ v  # noqa: E731 - an operator for the estimator
    within, ratios = 0, []
    for seed in range(40):
        kw = {"rtol": 1e-9, "max_hvps": 60, "min_probes": 2}
        out = hutchpp_trace(matvec, 60, generator=torch.Generator().manual_seed(seed), sketch=10,
                            blocks=[20, 40], **kw)
        plain = hutchpp_trace(matvec, 60, generator=torch.Generator().manual_seed(seed), sketch=0, **kw)
        within += abs(out["trace"] - exact) <= 3 * out["stderr"]
        ratios.append(out["stderr"] / plain["stderr"])
        assert sum(out["block_traces"]) == pytest.approx(out["trace"], rel=1e-12)
        assert out["hvps"] == 60 and plain["hvps"] == 60
    assert within >= 36 and max(ratios) < 0.2
    full = hutchpp_trace(matvec, 60, generator=torch.Generator().manual_seed(0), sketch=60, max_hvps=200)
    assert full["trace"] == pytest.approx(exact, rel=1e-12) and full["stderr"] == 0 and full["converged"]


@pytest.mark.parametrize("cls", [TinyLSTM, TinyAttention])
def test_lstm_and_attention_traces_reach_one_percent_and_are_within_it(cls: type[nn.Module]) -> None:
    """Issue 29's criterion: on the LSTM and the ViT-like attention network (recurrent weights and the
    positional embedding included), Hutch++ at its default rtol reaches a 1% relative standard error, and
    its error against the materialized Hessian is within it (and within three of its standard errors). The
    attention network's trace (4.3) is small beside its Frobenius norm: with the default sketch of 20 its
    2000-HVP budget ends at 1.2% (status not_converged, checked below); a sketch of 100 reaches 1% in ~400."""
    net, x, y, hess = case(cls)
    exact = float(hess.trace())
    if cls is TinyAttention:
        stuck = trace_entry(net, x, y, exact_max_params=0)
        assert stuck["status"] == "not_converged" and "budget of 2000 HVPs" in stuck["reason"]
    sketch = 100 if cls is TinyAttention else 20
    entry = trace_entry(net, x, y, exact_max_params=0, sketch=sketch)  # force the estimator on these small models
    info, value = entry["info"], entry["values"]["hessian_trace"]
    assert entry["status"] == "ok" and info["method"] == "hutchpp" and info["rtol"] == 0.01
    assert info["converged"] and info["rel_stderr"] <= 0.01
    assert abs(value - exact) <= min(3 * info["stderr"], 0.01 * abs(exact)), (value, exact, info["stderr"])
    name = "hessian_trace/pos" if cls is TinyAttention else "hessian_trace/lstm.weight_hh_l0"
    assert entry["values"][name] != 0
