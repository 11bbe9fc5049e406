"""The grouped exact Hessian diagonal of several MLPs equals each model's own exact diagonal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatbench.curvature import hessian_diagonal
from flatbench.losses import get_loss
from flatbench.measures.group import group_hessian_diagonals
from flatbench.models import MLP


def _models(g: int, widths: tuple[int, ...], bias: bool = True) -> list[nn.Module]:
    torch.manual_seed(0)
    return [MLP(12, widths, 4, bias=bias).double() for _ in range(g)]


def _assert_equal(grouped, models, inputs, targets, loss, per_model=False):
    for i, (model, result) in enumerate(zip(models, grouped)):
        x = inputs[i] if per_model else inputs
        ref = hessian_diagonal(model, x, targets[i], loss, method="exact")
        assert set(result.diag) == set(ref.diag)
        for key, value in ref.diag.items():
            torch.testing.assert_close(result.diag[key], value, rtol=1e-10, atol=1e-10 * float(value.abs().max()))
        assert result.method == "exact" and result.n == x.shape[0]


@pytest.mark.parametrize("loss_name", ["ce", "normalized_ce"])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_diagonals_equal_per_model_exact_diagonals(loss_name, bias):
    models = _models(3, (8, 6), bias=bias)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, 4, generator=gen, dtype=torch.float64)  # flattened by the MLP: 12 features
    y = torch.randint(0, 4, (3, 40), generator=gen)
    loss = get_loss(loss_name)
    _assert_equal(group_hessian_diagonals(models, x, y, loss), models, x, y, loss)


def test_per_model_inputs_and_small_chunks():
    models = _models(2, (7,))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 30, 12, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (2, 30), generator=gen)
    loss = get_loss("ce")
    grouped = group_hessian_diagonals(models, x, y, loss, per_model_inputs=True, chunk_size=7)
    _assert_equal(grouped, models, x, y, loss, per_model=True)


def test_rejects_other_architectures():
    x = torch.randn(10, 12, dtype=torch.float64)
    y = torch.zeros(2, 10, dtype=torch.long)
    loss = get_loss("ce")
    with pytest.raises(ValueError, match="identical architectures"):
        group_hessian_diagonals([MLP(12, (8,), 4).double(), MLP(12, (6,), 4).double()], x, y, loss)
    with pytest.raises(ValueError, match="Linear and ReLU"):
        group_hessian_diagonals([MLP(12, (8,), 4, batch_norm=True).double()] * 2, x, y, loss)
    with pytest.raises(ValueError, match="Linear and ReLU"):
        group_hessian_diagonals([nn.Sequential(nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 4)).double()] * 2,
                                x, y, loss)
