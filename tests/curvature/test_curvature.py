"""The curvature engine against brute force: full Hessians of tiny float64 nets.

Each net has at most a few hundred parameters and the data 20 examples, so
`torch.autograd.functional.hessian` of the loss as a function of the flat parameter vector is cheap and
is the ground truth for the exact diagonal, HVPs, Hutchinson and Lanczos.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from torch import Tensor, nn


from flatbench.curvature import (DiagonalResult, HessianOperator, exact_applicable, hessian_diagonal, hvp,
                                 per_layer_traces)
from flatbench.measures.shared import hessian_diagonal as diagonal_for
from flatbench.losses import get_loss
from flatbench.measures.context import MeasureContext
from flatbench.measures.registry import get_measure
from flatbench.measures.runner import compute_entry

from cases import TINY_CLASSES as C
from cases import dense_hessian, tiny_network

N = 20


@lru_cache(maxsize=None)
def _case(name: str, loss_name: str, labels: str) -> tuple[nn.Module, Tensor, Tensor, Tensor]:
    """(model, x, y, full Hessian) for one net, loss and labelling; cached across tests."""
    net, shape = tiny_network(name)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(N, *shape, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        clean = net(x).argmax(1)
    y = clean if labels == "clean" else torch.randint(0, C, (N,), generator=gen)
    return net, x, y, dense_hessian(net, x, y, get_loss(loss_name))


def _flat(result: dict[str, Tensor], net: nn.Module) -> Tensor:
    return torch.cat([result[k].reshape(-1) for k, _ in net.named_parameters()])


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


DIAG_RTOL = 1e-11
"""Per-element tolerance of the exact diagonal against the brute-force Hessian (both float64).

Measured over every net, loss, labelling, backward mode and chunking of the tests below: the worst element
is 1.7e-12 (mlp_bn, normalized_ce, random labels: an element 1e-7 of the largest, where the signed
per-example terms of the indefinite logit Hessian cancel), the next worst 9e-13 (conv_variants, alike),
the median element of every case ≤ 1.4e-15; so the float64 headroom is about 6× on the worst element. A
genuine error is far larger: dropping BatchNorm's eps (1e-5 against running variances ~1) moves elements
by ~1e-5 and fails every BatchNorm case here (the former test, max error over max element < 1e-6,
missed it in 5 of the 8 BatchNorm cases)."""

DIAG_FLOOR = 1e-10
"""Elements smaller than this fraction of the largest |H_kk| (exact zeros of dead units among them) are
compared against that floor instead of their own magnitude."""


def _assert_diag_close(ours: Tensor, ref: Tensor, rtol: float = DIAG_RTOL) -> None:
    """|ours_k − ref_k| ≤ rtol · max(|ref_k|, DIAG_FLOOR · max_j |ref_j|) for every element k."""
    floor = DIAG_FLOOR * float(ref.abs().max())
    err = (ours - ref).abs() / ref.abs().clamp_min(floor)
    worst = int(err.argmax())
    assert float(err[worst]) <= rtol, (f"element {worst}: {float(ours[worst]):.17g} vs "
                                       f"{float(ref[worst]):.17g} (relative error {float(err[worst]):.2e})")


@pytest.fixture(params=["default", "batched", "conv_stream", "conv_stacked"])
def backward_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every strategy of the exact diagonal on every net: one backward pass per factor (the default) or
    one vmapped pass over all factors, and for Conv2d either choice of `_conv_streams` for every layer
    (the default picks per layer)."""
    import flatbench.curvature.diagonal as curvature

    monkeypatch.setattr(curvature, "_BATCHED_BACKWARD", request.param == "batched")
    if request.param in ("conv_stream", "conv_stacked"):
        monkeypatch.setattr(curvature, "_conv_streams", lambda conv, num_f: request.param == "conv_stream")
    return request.param


@pytest.mark.parametrize("labels", ["clean", "random"])
@pytest.mark.parametrize("loss_name", ["ce", "normalized_ce"])
@pytest.mark.parametrize("name", ["mlp", "mlp_bn", "lenet", "resnet"])
def test_exact_diagonal_matchesdense_hessian(name: str, loss_name: str, labels: str, backward_mode: str
                                             ) -> None:
    net, x, y, hess = _case(name, loss_name, labels)
    assert exact_applicable(net)[0]
    result = hessian_diagonal(net, x, y, get_loss(loss_name), chunk_size=7)
    assert result.method == "exact" and result.stderr is None
    assert all(result.diag[k].shape == p.shape and result.diag[k].dtype == torch.float64
               for k, p in net.named_parameters())
    _assert_diag_close(_flat(result.diag, net), hess.diagonal())
    assert result.trace() == pytest.approx(float(hess.trace()), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name", ["conv_variants", "linear_3d"])
def test_exact_diagonal_layer_variants(name: str, backward_mode: str) -> None:
    net, x, y, hess = _case(name, "normalized_ce", "random")
    result = hessian_diagonal(net, x, y, get_loss("normalized_ce"))
    assert result.method == "exact"
    _assert_diag_close(_flat(result.diag, net), hess.diagonal())


def test_exact_diagonal_under_tiny_memory_budget_and_no_grad(backward_mode: str) -> None:
    """A zero budget forces one example per chunk and sub-chunk; autograd off outside must not matter,
    and the parameters' requires_grad flags are restored."""
    net, x, y, hess = _case("lenet", "ce", "random")
    net[0].weight.requires_grad_(False)
    try:
        with torch.no_grad():
            result = hessian_diagonal(net, x, y, get_loss("ce"), max_memory_mb=0)
        assert not net[0].weight.requires_grad
    finally:
        net[0].weight.requires_grad_(True)
    _assert_diag_close(_flat(result.diag, net), hess.diagonal())


def test_logit_hessian_factors_are_exact() -> None:
    """Σ_k s_k v_k v_kᵀ rebuilds every logit Hessian: Cholesky rows (ce), rows where Cholesky fails
    (saturated softmax: numerically singular) and indefinite rows (normalized_ce) alike, also when the
    rows' scales differ by many orders of magnitude."""
    from flatbench.curvature.diagonal import _scaled_factors
    from flatbench.curvature.diagonal import logit_factors as _logit_factors

    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(30, C, generator=gen, dtype=torch.float64)
    logits[:5] *= 200  # saturated
    logits[5:8] = logits[5:8] * 1e-9 + 0.3  # nearly equal logits: normalized_ce's Hessian is ~1e18 there
    y = torch.randint(0, C, (30,), generator=gen)
    for loss_name in ("ce", "normalized_ce"):
        loss = get_loss(loss_name)
        hess = loss.logit_hessian(logits, y)
        vecs, signs = _scaled_factors(loss, logits, y)
        assert vecs.shape == (30, C, C - 1)  # shift invariance: one factor fewer than classes
        s = torch.ones(30, C - 1, dtype=torch.float64) if signs is None else signs
        rebuilt = torch.einsum("nk,nck,ndk->ncd", s, vecs, vecs)
        # Saturated rows hold ~1e-38 entries computed with absolute rounding errors of ~1e-16 (p − p² at
        # p ≈ 1), so they are only exact relative to the batch's scale; the others are exact row by row.
        err = (rebuilt - hess).abs()
        assert float(err.max() / hess.abs().max()) < 1e-13, loss_name
        assert float((err[5:] / hess[5:].abs().amax((1, 2), keepdim=True)).max()) < 1e-13, loss_name
        if loss_name == "ce":  # positive semidefinite: no negative signs, except where rounding dominates
            assert _scaled_factors(loss, logits[5:], y[5:])[1] is None
        else:
            assert signs is not None and bool((signs[5:] < 0).any())
        lam, u = _logit_factors(loss, logits, y)
        assert torch.equal(torch.einsum("nk,nck,ndk->ncd", lam, u, u), rebuilt)


def test_per_layer_traces_sum_blocks_of_the_diagonal() -> None:
    net, x, y, hess = _case("mlp", "ce", "clean")
    traces = per_layer_traces(hessian_diagonal(net, x, y, get_loss("ce")))
    assert list(traces) == [k for k, _ in net.named_parameters()]
    offset = 0
    for k, p in net.named_parameters():
        block = hess.diagonal()[offset:offset + p.numel()].sum()
        assert traces[k] == pytest.approx(float(block), rel=1e-12, abs=1e-15)
        offset += p.numel()


def test_applicability_says_no_and_falls_back_to_hutchinson() -> None:
    (gelu, _), (bn_train, _) = tiny_network("custom_gelu"), tiny_network("mlp_bn_train")
    torch.manual_seed(0)
    x = torch.randn(N, 6, dtype=torch.float64)
    y = torch.randint(0, C, (N,))
    for net, word in ((gelu, "CustomGelu"), (bn_train, "train mode")):
        ok, reason = exact_applicable(net)
        assert not ok and word in reason
        stats = [b.clone() for b in net.buffers()]
        result = hessian_diagonal(net, x, y, get_loss("ce"), hutchinson_probes=5,
                                  generator=torch.Generator().manual_seed(0))
        assert result.method == "hutchinson" and result.probes == 5 and word in result.reason
        assert result.stderr is not None and result.total_trace_stderr is not None
        assert all(torch.equal(a, b) for a, b in zip(stats, net.buffers()))  # running stats untouched
    with pytest.raises(ValueError, match="not applicable"):
        hessian_diagonal(gelu, x, y, get_loss("ce"), method="exact")


def test_hutchinson_diagonal_is_unbiased_on_a_smooth_net() -> None:
    net, _ = tiny_network("tanh")
    torch.manual_seed(0)
    x = torch.randn(N, 6, dtype=torch.float64)
    y = torch.randint(0, C, (N,))
    hess = dense_hessian(net, x, y, get_loss("ce"))
    result = hessian_diagonal(net, x, y, get_loss("ce"), hutchinson_probes=200, method="hutchinson",
                              generator=torch.Generator().manual_seed(3))
    assert abs(result.trace() - float(hess.trace())) < 3 * result.total_trace_stderr
    z = (_flat(result.diag, net) - hess.diagonal()) / _flat(result.stderr, net).clamp_min(1e-12)
    assert float((z.abs() < 4).double().mean()) > 0.95


def test_unknown_modules_and_weight_sharing_are_not_exact() -> None:
    ok, reason = exact_applicable(tiny_network("custom_gelu")[0])
    assert not ok and "container" in reason
    net, _ = tiny_network("shared_weights")
    x = torch.randn(N, 4, dtype=torch.float64)
    y = torch.randint(0, 4, (N,))
    result = hessian_diagonal(net, x, y, get_loss("ce"), hutchinson_probes=2)
    assert result.method == "hutchinson" and "more than once" in result.reason


def test_flatbench_models_are_recognized() -> None:
    from flatbench.config import ModelConfig
    from flatbench.models import build_model

    for cfg, shape in ((ModelConfig(name="mlp", widths=(8,), batch_norm=True), (1, 6, 6)),
                       (ModelConfig(name="lenet"), (1, 28, 28)),
                       (ModelConfig(name="wrn", depth=10, width=1), (3, 8, 8))):
        model = build_model(cfg, shape, 10)
        assert exact_applicable(model.eval())[0], cfg.name
        if cfg.name != "lenet":
            assert not exact_applicable(model.train())[0], cfg.name


@pytest.mark.parametrize("mode", ["rev_fwd", "fwd_rev", "double_backward"])
@pytest.mark.parametrize("name", ["mlp_bn", "resnet"])
def test_hvp_matchesdense_hessian(name: str, mode: str) -> None:
    net, x, y, hess = _case(name, "normalized_ce", "random")
    v = torch.randn(hess.shape[0], generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    hv = hvp(net, x, y, get_loss("normalized_ce"), v, chunk_size=6, mode=mode)
    assert isinstance(hv, Tensor) and _rel(hv, hess @ v) < 1e-10
    pieces = torch.split(v, [p.numel() for p in net.parameters()])
    as_dict = {k: t.view_as(p) for (k, p), t in zip(net.named_parameters(), pieces)}
    hv_dict = hvp(net, x, y, get_loss("normalized_ce"), as_dict, mode=mode)
    assert _rel(_flat(hv_dict, net), hess @ v) < 1e-10


@pytest.mark.parametrize("name", ["mlp_bn", "resnet", "conv_variants"])
def test_hessian_operator_is_thedense_hessian(name: str) -> None:
    """HessianOperator answers every question from the same matrix: H @ v (flat and dict), its flat
    float64 matvec, its size, its diagonal (exact here) and its top eigenvalues all equal the full
    Hessian's, whatever the chunking."""
    net, x, y, hess = _case(name, "normalized_ce", "random")
    H = HessianOperator(net, x, y, get_loss("normalized_ce"), chunk_size=5)
    assert H.size == hess.shape[0]
    v = torch.randn(H.size, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    assert _rel(H @ v, hess @ v) < 1e-10 and _rel(H.flat_matvec()(v), hess @ v) < 1e-10
    pieces = torch.split(v, [p.numel() for p in net.parameters()])
    as_dict = {k: t.view_as(p) for (k, p), t in zip(net.named_parameters(), pieces)}
    assert _rel(_flat(H @ as_dict, net), hess @ v) < 1e-10
    diag = H.diagonal()
    assert diag.method == "exact" and _rel(_flat(diag.diag, net), torch.diagonal(hess)) < 1e-10
    top = H.top_eigenvalues(k=1, iters=200, tol=1e-10, generator=torch.Generator().manual_seed(3))
    assert top["eigenvalues"][0] == pytest.approx(float(torch.linalg.eigvalsh(hess)[-1]), rel=1e-6)
    estimate = H.hutchinson_diagonal(generator=torch.Generator().manual_seed(4), probes=100)
    assert abs(estimate.trace() - float(torch.trace(hess))) < 4 * estimate.total_trace_stderr


def test_hutchinson_trace_within_three_standard_errors() -> None:
    net, x, y, hess = _case("lenet", "ce", "random")
    exact = hessian_diagonal(net, x, y, get_loss("ce")).trace()
    out = HessianOperator(net, x, y, get_loss("ce")).trace(generator=torch.Generator().manual_seed(5), probes=100)
    assert out["probes"] == 100 and out["stderr"] > 0
    assert abs(out["mean"] - exact) < 3 * out["stderr"]
    first = HessianOperator(net, x, y, get_loss("ce")).trace(generator=torch.Generator().manual_seed(5), probes=10)
    again = HessianOperator(net, x, y, get_loss("ce")).trace(generator=torch.Generator().manual_seed(5), probes=10)
    assert again == first  # deterministic given the generator
    adaptive = HessianOperator(net, x, y, get_loss("ce")).trace(generator=torch.Generator().manual_seed(6),
                                                                rtol=0.1, max_probes=500)
    assert adaptive["probes"] < 500 and adaptive["stderr"] <= 0.1 * abs(adaptive["mean"])


@pytest.mark.parametrize("loss_name", ["ce", "normalized_ce"])
def test_lanczos_top_eigenvalues(loss_name: str) -> None:
    net, x, y, hess = _case("resnet", loss_name, "random")
    evals = torch.linalg.eigvalsh(hess)
    out = HessianOperator(net, x, y, get_loss(loss_name)).top_eigenvalues(
        k=2, iters=100, tol=1e-8, generator=torch.Generator().manual_seed(7))
    assert out["converged"] and out["iterations"] <= 100
    assert out["eigenvalues"][0] == pytest.approx(float(evals[-1]), rel=1e-4)
    assert out["eigenvalues"][1] == pytest.approx(float(evals[-2]), rel=1e-4)
    again = HessianOperator(net, x, y, get_loss(loss_name)).top_eigenvalues(
        k=2, iters=100, tol=1e-8, generator=torch.Generator().manual_seed(7))
    assert again == out


def test_measures_through_the_registry() -> None:
    net, x, y, _ = _case("mlp_bn", "ce", "random")
    ctx = MeasureContext(model=net, inputs=x, targets=y, num_classes=C, chunk_size=7)
    for loss_name in ("ce", "normalized_ce"):
        hess = dense_hessian(net, x, y, get_loss(loss_name))
        suffix = "" if loss_name == "ce" else "@normalized_ce"
        spec = get_measure("hessian_trace")
        entry = compute_entry(ctx, spec, dict(spec.defaults), loss_name)
        assert entry["status"] == "ok", entry
        assert entry["info"]["method"] == "exact"
        assert entry["values"][f"hessian_trace{suffix}"] == pytest.approx(float(hess.trace()), rel=1e-8)
        assert f"hessian_trace{suffix}/0.weight" in entry["values"]
        spec = get_measure("hessian_max_eig")
        entry = compute_entry(ctx, spec, {**spec.defaults, "tol": 1e-8}, loss_name)
        assert entry["status"] == "ok", entry
        assert entry["values"][f"hessian_max_eig{suffix}"] == pytest.approx(
            float(torch.linalg.eigvalsh(hess)[-1]), rel=1e-4)
        assert entry["info"]["converged"] and entry["info"]["iterations"] >= 1
    # the diagonal is computed once per loss and shared through the cache
    first = diagonal_for(ctx.for_measure("x", {}, loss_name="ce"))
    assert isinstance(first, DiagonalResult)
    assert diagonal_for(ctx.for_measure("y", {}, loss_name="ce")) is first
    assert diagonal_for(ctx.for_measure("y", {}, loss_name="normalized_ce")) is not first


def test_hessian_trace_hutchinson_setting_and_not_applicable() -> None:
    net, _ = tiny_network("custom_gelu")
    torch.manual_seed(0)
    x = torch.randn(N, 6, dtype=torch.float64)
    y = torch.randint(0, C, (N,))
    ctx = MeasureContext(model=net, inputs=x, targets=y, num_classes=C)
    spec = get_measure("hessian_trace")
    entry = compute_entry(ctx, spec, {**spec.defaults, "method": "exact", "exact_max_params": 0}, "ce")
    assert entry["status"] == "not_applicable" and "gelu" in entry["reason"]
    entry = compute_entry(ctx, spec, {**spec.defaults, "method": "hutchinson", "probes": 20}, "ce")
    assert entry["status"] == "ok" and entry["info"]["method"] == "hutchinson"
    assert entry["info"]["probes"] == 20 and entry["info"]["stderr"] > 0


def test_lanczos_on_an_exhausted_krylov_space() -> None:
    """One example through a bias-free linear layer: H = (diag p − ppᵀ) ⊗ xxᵀ has rank 2, so the Krylov
    space is invariant after two steps; the third wanted eigenvalue is 0 and comes from a restart."""
    net, _ = tiny_network("linear_bias_free")
    torch.manual_seed(0)
    x = torch.randn(1, 3, dtype=torch.float64)
    y = torch.tensor([0])
    p = torch.softmax(net(x), 1)[0].detach()
    evals = torch.linalg.eigvalsh(torch.kron(torch.diag(p) - torch.outer(p, p), torch.outer(x[0], x[0])))
    out = HessianOperator(net, x, y, get_loss("ce")).top_eigenvalues(k=3, iters=20,
                                                                     generator=torch.Generator().manual_seed(0))
    assert out["converged"] and out["iterations"] <= 4
    assert out["eigenvalues"][:2] == pytest.approx(evals[-2:].flip(0).tolist(), rel=1e-10)
    assert abs(out["eigenvalues"][2]) < 1e-12
