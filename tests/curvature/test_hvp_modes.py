"""No derivative mode is trusted unchecked (`flatbench.curvature.modes`).

In torch 2.14.1 reverse-over-forward (`grad(jvp(L))`) is wrong through LayerNorm and InstanceNorm. These tests
hold the engine to the dense Hessian of `torch.autograd.functional.hessian` (reverse over reverse) on tiny
float64 nets with those layers: `auto` is double backward, a torch.func mode is checked against it on its
first product and replaced where it disagrees, and the entry's info says which mode computed it. The
planted-bug tests show the wrong mode really is wrong here, so the tests above them can fail.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import flatbench
from flatbench.curvature import (AUTO_MODE, HessianOperator, check_tolerance, hvp, hvp_log,
                                 use_hvp_mode)
from flatbench.curvature import modes
from flatbench.losses import get_loss

from cases import dense_hessian

HVP = importlib.import_module("flatbench.curvature.hvp")
"""The module (`flatbench.curvature.hvp` the name is the function, re-exported)."""


def _ln_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).double().eval()


def _in_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.InstanceNorm1d(3, affine=True), nn.Flatten(),
                         nn.Linear(12, 3)).double().eval()


NETS = {"layer_norm": (_ln_net, (5,)), "instance_norm": (_in_net, (2, 4))}


def _data(shape: tuple[int, ...], n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, *shape, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen)


def dense(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∇²_θ L by reverse over reverse (`cases.dense_hessian`), the reference."""
    return dense_hessian(net, x, y, get_loss("ce"))


@pytest.mark.parametrize("net", sorted(NETS))
@pytest.mark.parametrize("mode", ["auto", "rev_fwd", "fwd_rev", "double_backward"])
def test_every_mode_gives_the_dense_hessians_product(net: str, mode: str) -> None:
    build, shape = NETS[net]
    model = build()
    x, y = _data(shape)
    h = dense(model, x, y)
    v = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with hvp_log() as log:
        got = hvp(model, x, y, get_loss("ce"), v, chunk_size=4, mode=mode)
    assert torch.allclose(got, h @ v, rtol=1e-10, atol=1e-12), float((got - h @ v).norm() / (h @ v).norm())
    info = log.info()
    if mode == "rev_fwd":  # wrong through both layers in this torch: checked, replaced, and said
        assert info["mode"] == "double_backward" and info["asked"] == "rev_fwd"
        assert "disagreed with double backward" in info["fallback"]
        assert info["checks"][0]["relative_difference"] > 0.01
    elif mode == "auto":
        assert info["mode"] == AUTO_MODE == "double_backward" and "asked" not in info
    else:
        assert info["mode"] == mode and "fallback" not in info


@pytest.mark.parametrize("net", sorted(NETS))
def test_planted_bug_trusting_rev_fwd_gives_a_wrong_product(net: str, monkeypatch) -> None:
    """The bug the check exists for: with the check made to pass, reverse-over-forward is used, and the
    product is far from the dense Hessian's. (Without this, the test above could pass for a wrong reason.)"""
    build, shape = NETS[net]
    model = build()
    x, y = _data(shape)
    h = dense(model, x, y)
    v = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    monkeypatch.setattr(HVP, "check_mode", lambda *a, **k: modes.ModeCheck("rev_fwd", True, 0.0, 1e-8))
    got = hvp(model, x, y, get_loss("ce"), v, mode="rev_fwd")
    assert float((got - h @ v).norm() / (h @ v).norm()) > 0.05


def test_a_layernorm_transformer_top_eigenvalue_and_trace_are_right_in_every_mode() -> None:
    """The issue's case, shrunk: a pre-LN attention block on integer tokens. λ_max by Lanczos and the trace by
    the dense diagonal agree with the dense Hessian whatever mode is asked for."""
    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.ln1, self.ln2 = nn.LayerNorm(4), nn.LayerNorm(4)
            self.att = nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = nn.Linear(4, 3)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.emb(tokens)
            a = self.ln1(h)
            h = h + self.att(a, a, a, need_weights=False)[0]
            return self.head(self.ln2(h).mean(1))

    model = Tiny().double().eval()
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 7, (6, 4), generator=gen), torch.randint(0, 3, (6,), generator=gen)
    h = dense(model, x, y)
    top = float(torch.linalg.eigvalsh(h)[-1])
    for mode in ("auto", "rev_fwd", "fwd_rev"):
        use_hvp_mode(model, mode)
        op = HessianOperator(model, x, y, get_loss("ce"))
        res = op.top_eigenvalues(k=1, iters=200, tol=1e-12, generator=torch.Generator().manual_seed(0))
        assert res["eigenvalues"][0] == pytest.approx(top, rel=1e-10), mode
        assert float(sum(d.sum() for d in op.dense_diagonal().diag.values())) == pytest.approx(
            float(h.trace()), rel=1e-10)


def test_the_check_runs_once_per_model_and_loss(monkeypatch) -> None:
    model = _ln_net()
    x, y = _data((5,))
    calls = []
    real = HVP.check_mode

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(HVP, "check_mode", counted)
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    for _ in range(3):
        hvp(model, x, y, get_loss("ce"), v, mode="fwd_rev")
    assert len(calls) == 1
    hvp(model, x, y, get_loss("mse"), v, mode="fwd_rev")  # another loss: checked again
    assert len(calls) == 2
    hvp(_ln_net(), x, y, get_loss("ce"), v, mode="fwd_rev")  # another model: checked again
    assert len(calls) == 3


def test_the_tolerance_follows_the_dtype_and_a_float32_model_is_checked_in_float32() -> None:
    assert check_tolerance(torch.float64) == pytest.approx(1.49e-8, rel=1e-2)
    assert check_tolerance(torch.float32) == pytest.approx(3.45e-4, rel=1e-2)
    model = _ln_net().float()
    x, y = _data((5,))
    with hvp_log() as log:
        hvp(model, x.float(), y, get_loss("ce"), torch.randn(sum(p.numel() for p in model.parameters())),
            mode="rev_fwd")
    (check,) = log.info()["checks"]
    assert check["tolerance"] == pytest.approx(3.45e-4, rel=1e-2) and not check["passed"]
    clean = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).eval()
    with hvp_log() as log:
        hvp(clean, x.float(), y, get_loss("ce"), torch.randn(sum(p.numel() for p in clean.parameters())),
            mode="rev_fwd")
    assert log.info()["mode"] == "rev_fwd" and log.info()["checks"][0]["passed"]


def test_compare_products_handles_zero_products() -> None:
    zero = torch.zeros(3, dtype=torch.float64)
    assert modes.compare_products("rev_fwd", zero, zero).passed
    assert not modes.compare_products("rev_fwd", torch.ones(3, dtype=torch.float64), zero).passed


def test_a_measure_entry_records_the_mode_and_the_fallback() -> None:
    """Through the API: the LayerNorm net's λ_max asked for in rev_fwd is right (the dense Hessian's) and its
    info says rev_fwd was replaced; measures that make no products record nothing of them."""
    model = _ln_net()
    x, y = _data((5,), n=12)
    top = float(torch.linalg.eigvalsh(dense(model, x, y))[-1])
    df = flatbench.measure(model, (x, y), ["hessian_max_eig", "frobenius_norm"], hvp_mode="rev_fwd",
                           settings={"hessian_max_eig": {"tol": 1e-12, "iters": 200}})
    assert df.set_index("key").loc["hessian_max_eig", "value"] == pytest.approx(top, rel=1e-10)
    info = df.attrs["info"]["hessian_max_eig"]["hvp"]
    assert info["mode"] == "double_backward" and info["asked"] == "rev_fwd" and info["products"] > 1
    assert "hvp" not in df.attrs["info"]["frobenius_norm"]
    default = flatbench.measure(model, (x, y), ["hessian_max_eig"]).attrs["info"]["hessian_max_eig"]["hvp"]
    assert set(default) == {"mode", "products"} and default["mode"] == "double_backward"


def test_fisher_rao_checks_its_forward_mode(monkeypatch) -> None:
    """A forward-mode JVP that is wrong (planted: twice the true one) is caught by the check against two
    reverse passes, and the norm is the right one."""
    from flatbench.measures.builtin import fisher_rao

    model = _ln_net()
    x, y = _data((5,), n=12)
    right = flatbench.measure(model, (x, y), ["fisher_rao_norm"])
    real = fisher_rao.jvp

    def doubled(*args, **kwargs):
        out, tangent = real(*args, **kwargs)
        return out, 2 * tangent

    monkeypatch.setattr(fisher_rao, "jvp", doubled)
    caught = flatbench.measure(_ln_net(), (x, y), ["fisher_rao_norm"])
    assert caught.loc[0, "value"] == pytest.approx(right.loc[0, "value"], rel=1e-12)
    assert caught.attrs["info"]["fisher_rao_norm"]["method"] == "reverse_along_theta"
    assert right.attrs["info"]["fisher_rao_norm"]["method"] == "jvp_along_theta"
