"""`flatbench.measure` on models flatbench did not build: torchvision's ResNet-18 (CIFAR-sized inputs) and
a small attention network with LayerNorm and GELU. Every measure gives a finite value or says why it does
not apply; the Hessian measures use the exact diagonal on ResNet-18 (its residual blocks are traced to be
piecewise linear) and a bounded Hutch++ estimate (100 HVPs here; HVPs with attention in its plain form,
falling back to double backward where forward mode is missing) on the attention network. Four ResNet and
eight attention examples, 10 steps of fitting first so that the accuracy-based searches have something to
perturb; reduced settings for the iterative searches."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

import flatbench
from flatbench.measures import resolve_names

FAST = {"hessian_max_eig": {"iters": 3}, "hessian_trace": {"max_hvps": 100}, "scale_invariant_rangamani": {"max_iter": 3},
        "spectral_norm": {"iters": 10, "tol": 1e-3}, "eps_sharpness": {"iters": 2},
        "adaptive_sharpness_l2": {"iters": 2}, "adaptive_sharpness_linf": {"iters": 2},
        "adaptive_sharpness_avg": {"samples": 2}, "pacbayes_flatness": {"samples": 2, "search_depth": 10},
        "pacbayes_mag_flatness": {"samples": 2, "search_depth": 10}}
CAPPED = {"hessian_max_eig", "hessian_trace", "scale_invariant_rangamani"}
"""Iterative estimates that FAST stops early: `ok`, or `not_converged` with the residual reached."""
NOT_APPLICABLE = {
    "resnet18": {"minimum_sharpness": "layer-wise rescaling", "psi_flatness": "bias-free ReLU MLP",
                 "psi_path_ratio": "bias-free ReLU MLP"},
    "attention": {"minimum_sharpness": "layer-wise rescaling", "psi_flatness": "bias-free ReLU MLP",
                  "psi_path_ratio": "bias-free ReLU MLP", "path_norm": "needs a ReLU network"},
}


class TinyViT(nn.Module):
    """Patch embedding, one pre-norm transformer block (nn.MultiheadAttention, GELU MLP), mean pooling."""

    def __init__(self, dim: int = 16, classes: int = 10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, stride=8)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)
        h = self.norm1(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        t = t + self.mlp(self.norm2(t))
        return self.head(t.mean(dim=1))


def _fitted(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from torchvision.models import resnet18

    gen = torch.Generator().manual_seed(0)
    n = 4 if name == "resnet18" else 8
    x = torch.randn(n, 3, 32, 32, generator=gen)
    y = torch.arange(n) % 10
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = resnet18(num_classes=10) if name == "resnet18" else TinyViT()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(10):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model.eval(), x, y


@pytest.mark.parametrize("name,dtype", [pytest.param("resnet18", torch.float32, marks=pytest.mark.slow),
                                        ("attention", torch.float64)])
def test_every_measure_is_finite_or_not_applicable_on_models_of_ones_own(name: str, dtype: torch.dtype) -> None:
    model, x, y = _fitted(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    start = time.perf_counter()
    df = flatbench.measure(model, (x, y), "all", dtype=dtype, settings=FAST)
    seconds = time.perf_counter() - start
    assert list(df.columns) == ["measure", "key", "value", "status", "reason", "seconds"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the user's model is untouched
    heads = df[~df["key"].str.contains("/")].set_index("measure")
    assert set(heads.index) == set(resolve_names(["all"]))
    bad = [(m, r["status"], r["reason"][:100]) for m, r in heads.iterrows()
           if (r["status"] != "not_applicable") == (m in NOT_APPLICABLE[name]) or (r["status"] == "error")
           or (r["status"] == "not_converged" and m not in CAPPED)]
    assert not bad, bad
    for measure, row in heads.iterrows():
        if measure in NOT_APPLICABLE[name]:
            assert row["status"] == "not_applicable" and NOT_APPLICABLE[name][measure] in row["reason"], (measure, row)
        elif row["status"] == "not_converged":
            assert measure in CAPPED and "did not converge" in row["reason"], (measure, row["reason"])
        else:
            assert row["status"] == "ok", (measure, row["reason"])
            assert math.isfinite(row["value"]), (measure, row["value"])
    info = df.attrs["info"]
    if name == "resnet18":
        assert info["hessian_trace"]["method"] == "exact"  # the residual blocks were traced as piecewise linear
    else:
        assert info["hessian_trace"]["method"] == "hutchpp" and info["hessian_trace"]["hvps"] <= 100
    slowest = heads["seconds"].sort_values(ascending=False).head(3)
    print(f"{name}: {len(heads)} measures in {seconds:.1f}s (slowest: "
          + ", ".join(f"{m} {v:.1f}s" for m, v in slowest.items()) + ")")


def test_data_loaders_losses_and_bad_input() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from flatbench.errors import FlatbenchError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3))
    x, y = torch.randn(20, 3, 4), torch.arange(20) % 3
    pair = flatbench.measure(model, (x, y), ["hessian_trace", "path_norm"], n_examples=10)
    loader = flatbench.measure(model, DataLoader(TensorDataset(x, y), batch_size=4), "hessian_trace,path_norm",
                               n_examples=10)
    assert pair["value"].tolist() == pytest.approx(loader["value"].tolist(), rel=1e-12)
    mse = flatbench.measure(model, (x, y), ["hessian_trace"], loss="mse")
    assert mse.loc[0, "key"] == "hessian_trace@mse" and mse.loc[0, "status"] == "ok"
    custom = flatbench.measure(model, (x, y), ["hessian_trace"],
                               loss=lambda f, t: nn.functional.cross_entropy(f, t, reduction="none"))
    ce = flatbench.measure(model, (x, y), ["hessian_trace"])
    assert custom.loc[0, "value"] == pytest.approx(ce.loc[0, "value"], rel=1e-12)
    with pytest.raises(FlatbenchError, match="unknown measure"):
        flatbench.measure(model, (x, y), ["no_such_measure"])
    with pytest.raises(FlatbenchError, match="targets must lie in 0..2"):
        flatbench.measure(model, (x, y + 5), ["path_norm"])
    with pytest.raises(FlatbenchError, match="pair of tensors or a DataLoader"):
        flatbench.measure(model, x, ["path_norm"])


def test_where_forward_mode_is_missing_hvps_and_fisher_rao_fall_back_to_double_backward(monkeypatch) -> None:
    """The error torch gives for an operator without a forward-mode derivative (the fused attention kernel,
    `aten::_native_multi_head_attention`), planted in torch.func.jvp: an HVP asked for in `rev_fwd` mode fails
    its check, is computed by double backward for that model and gives the same product, and the entry says
    so; fisher_rao_norm's JVP along θ falls back to two reverse passes likewise."""
    import importlib

    from flatbench.curvature import hvp, hvp_log, use_hvp_mode
    from flatbench.losses import get_loss
    from flatbench.measures.builtin import fisher_rao

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double().eval()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.arange(6) % 2
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    expected = hvp(model, x, y, get_loss("ce"), v, mode="double_backward")
    fisher = flatbench.measure(model, (x, y), ["fisher_rao_norm"]).loc[0, "value"]

    def no_forward_ad(*args, **kwargs):
        raise NotImplementedError("Trying to use forward AD with _native_multi_head_attention that does not "
                                  "support it because it has not been implemented yet.")

    monkeypatch.setattr(importlib.import_module("flatbench.curvature.hvp"), "jvp", no_forward_ad)
    monkeypatch.setattr(fisher_rao, "jvp", no_forward_ad)
    fresh = copy_of(model)
    use_hvp_mode(fresh, "rev_fwd")
    with hvp_log() as log:
        got = hvp(fresh, x, y, get_loss("ce"), v)
    assert log.info()["mode"] == "double_backward" and log.info()["asked"] == "rev_fwd"
    assert "forward-mode derivative" in log.info()["fallback"]
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-14)
    df = flatbench.measure(model, (x, y), ["fisher_rao_norm", "hessian_max_eig"], hvp_mode="fwd_rev")
    assert df.loc[0, "value"] == pytest.approx(fisher, rel=1e-12)
    assert df.attrs["info"]["fisher_rao_norm"]["method"] == "reverse_along_theta"
    assert "two reverse passes" in df.attrs["info"]["fisher_rao_norm"]["fallback"]
    assert df.attrs["info"]["hessian_max_eig"]["hvp"]["mode"] == "double_backward"


def copy_of(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def test_the_frame_is_the_one_pandas_builds_from_the_rows(monkeypatch) -> None:
    """`records_to_frame` builds its six columns directly (the API's overhead); the frame, dtypes included, is
    the one `pd.DataFrame(rows, columns=COLUMNS)` gives, and so is the fallback for another pandas."""
    import pandas as pd

    from flatbench import api

    records = {"a": {"measure": "a", "status": "ok", "seconds": 0.1, "values": {"a": 1.5, "a/w": -2.0}, "info": {"k": 1}},
               "b": {"measure": "b", "status": "error", "seconds": 0.25, "error": "boom"},
               "c": {"measure": "c", "status": "not_applicable", "seconds": 0.0, "reason": "no ReLU"},
               "d": {"measure": "d", "status": "ok", "seconds": 1.0, "values": {"d": 3.0}, "reason": "computed with ce"}}
    rows = [("a", "a", 1.5, "ok", "", 0.1), ("a", "a/w", -2.0, "ok", "", 0.1), ("b", "b", math.nan, "error", "boom", 0.25),
            ("c", "c", math.nan, "not_applicable", "no ReLU", 0.0), ("d", "d", 3.0, "ok", "computed with ce", 1.0)]
    expected = pd.DataFrame(rows, columns=list(api.COLUMNS))
    df = api.records_to_frame(records)
    pd.testing.assert_frame_equal(df, expected)
    assert df.attrs["info"] == {"a": {"k": 1}}
    monkeypatch.delattr(pd.DataFrame, "_from_arrays")
    pd.testing.assert_frame_equal(api.records_to_frame(records), expected)
