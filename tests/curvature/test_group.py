"""The grouped exact Hessian diagonal of several MLPs equals each model's own exact diagonal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatbench.curvature import hessian_diagonal
from flatbench.losses import get_loss
from flatbench.curvature.group import group_hessian_diagonals
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


def test_grouped_measure_stage_gives_the_same_results_as_run_by_run(tmp_path, monkeypatch):
    """`measure.group_runs: on` (what `auto` does on CUDA) must not change a single measure value."""
    import json

    import flatbench.measures.shared as group
    from flatbench.config import parse_study
    from flatbench.study.measure import measure_study
    from flatbench.study.train import train_study

    raw = {"name": "g", "seed": 0,
           "data": {"dataset": "mnist_mini", "n_train": 200, "n_test": 100, "random_label_ratio": [0.0, 0.5, 1.0]},
           "model": {"widths": [16, 16]}, "train": {"epochs": 2, "batch_size": 50},
           "measure": {"measures": ["hessian_trace", "normalized_sharpness", "minimum_sharpness",
                                    "frobenius_norm"], "n_examples": 100, "losses": ["ce", "normalized_ce"]}}
    calls = []
    real = group.group_hessian_diagonals

    def counting(models, *args, **kwargs):
        calls.append(len(models))
        return real(models, *args, **kwargs)

    monkeypatch.setattr(group, "group_hessian_diagonals", counting)
    values = {}
    for mode in ("off", "on"):
        study = parse_study({**raw, "measure": {**raw["measure"], "group_runs": mode}}, out=str(tmp_path / mode))
        train_study(study, torch.device("cpu"), quiet=True, echo=lambda m: None)
        measure_study(study, torch.device("cpu"), quiet=True, echo=lambda m: None)
        values[mode] = {rid: {k: e.get("values", {}) for k, e in json.loads(
            (study.exp_dir / "runs" / rid / "measures.json").read_text()).items()} for rid in study.run_ids()}
    assert calls == [3, 3]  # one grouped call per loss, all three runs, only in "on" mode
    assert values["on"].keys() == values["off"].keys()
    for rid, entries in values["off"].items():
        assert entries.keys() == values["on"][rid].keys()
        for key, vals in entries.items():
            for name, value in vals.items():
                assert values["on"][rid][key][name] == pytest.approx(value, rel=1e-9, abs=1e-12), (rid, name)
