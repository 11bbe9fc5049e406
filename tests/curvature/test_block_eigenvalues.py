"""`hessian_max_eig` with `per: layer | block`: the top eigenvalue of each layer's and each block's diagonal
block of H, against the dense Hessian of a tiny nested network (float64, `torch.func.hessian`): a
Sequential body, a head, and a parameter the model holds itself (like a ViT's positional embedding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flatbench
from flatbench.losses import get_loss
from flatbench.measures.builtin.hessian import parameter_groups

from cases import dense_hessian


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(0.1 * torch.randn(5))
        self.body = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.GELU())
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x + self.shift))


def _setup():
    torch.manual_seed(0)
    net = Nested().double()
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.arange(16) % 3
    return net, x, y, dense_hessian(net, x, y, get_loss("ce"))


def _reference(net: nn.Module, hess: torch.Tensor, groups: dict[str, list[str]]) -> dict[str, float]:
    offsets, start = {}, 0
    for name, p in net.named_parameters():
        offsets[name] = (start, start + p.numel())
        start += p.numel()
    out = {}
    for group, members in groups.items():
        idx = torch.cat([torch.arange(*offsets[m]) for m in members])
        out[group] = float(torch.linalg.eigvalsh(hess[idx][:, idx]).max())
    return out


@pytest.mark.parametrize("per,expected", [("layer", {"shift", "body.0", "body.2", "head"}),
                                          ("block", {"shift", "body", "head"})])
def test_per_layer_and_per_block_top_eigenvalues_match_the_dense_blocks(per: str, expected: set[str]) -> None:
    net, x, y, hess = _setup()
    groups = parameter_groups(net, per)
    assert set(groups) == expected
    df = flatbench.measure(net, (x, y), ["hessian_max_eig"], dtype=torch.float64,
                           settings={"hessian_max_eig": {"per": per, "iters": 200, "tol": 1e-10}})
    assert df.iloc[0]["status"] == "ok", df.iloc[0]["reason"]
    info = df.attrs["info"]["hessian_max_eig"]
    assert df.iloc[0]["value"] == pytest.approx(float(torch.linalg.eigvalsh(hess).max()), rel=1e-9)
    reference = _reference(net, hess, groups)
    for group, value in reference.items():
        assert info[f"per_{per}"][group]["converged"]
        assert info[f"per_{per}"][group]["eigenvalue"] == pytest.approx(value, rel=1e-8, abs=1e-12), group
