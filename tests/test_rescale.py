"""Function-preserving transformations (flatbench.rescale): every family × model keeps the function."""

from __future__ import annotations

import pytest
import torch
from cases import CASES, FAMILIES_OF, case
from torch import nn

from flatbench import rescale


def _build(name: str) -> tuple[nn.Module, torch.Tensor]:
    """A catalogue case (tests/cases.py: trained, float64, eval mode) and its inputs. Not to be modified."""
    c = case(name)
    return c.model, c.inputs


MODELS = CASES
APPLICABLE = FAMILIES_OF  # which families each case supports (the others must say why not)


@pytest.mark.parametrize("model_name", MODELS)
def test_applicable_families(model_name: str) -> None:
    model, _ = _build(model_name)
    verdict = rescale.applicable_families(model)
    assert set(verdict) == set(rescale.FAMILIES)
    for family, ok in verdict.items():
        if family in APPLICABLE[model_name]:
            assert ok is True
        else:
            assert isinstance(ok, str) and ok


@pytest.mark.parametrize("family", rescale.FAMILIES)
@pytest.mark.parametrize("model_name", MODELS)
def test_function_preserved(model_name: str, family: str) -> None:
    model, x = _build(model_name)
    if family not in APPLICABLE[model_name]:
        with pytest.raises(ValueError, match="does not apply"):
            rescale.transform(model, family, torch.Generator().manual_seed(0))
        return
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(x)
    for seed in range(3):
        out = rescale.transform(model, family, torch.Generator().manual_seed(seed), 0.1, 10.0)
        with torch.no_grad():
            new = out(x)
        changed = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(),
                                                                 out.state_dict().values())
                      if a.is_floating_point())
        assert changed > 1e-3, "the transformation changed no parameter"
        if family == "logit_scale":
            ratio = new / logits
            c = float(ratio.median())
            assert 0.1 <= c <= 10.0
            assert torch.allclose(new, c * logits, rtol=1e-10, atol=1e-12)
            assert torch.equal(new.argmax(1), logits.argmax(1))
        else:
            rel = float((new - logits).abs().max() / logits.abs().max())
            assert rel < 1e-5, f"{family} changed the logits of {model_name} by {rel:.2e}"
        assert rescale.function_change(model, out, x, family) < 1e-10
    for k, v in model.state_dict().items():  # the original is never modified
        assert torch.equal(v, before[k]), k


def test_factors_are_log_uniform_in_range_and_seeded() -> None:
    f = rescale.log_uniform(20000, torch.Generator().manual_seed(0), 0.1, 10.0)
    assert f.dtype == torch.float64
    assert float(f.min()) >= 0.1 and float(f.max()) <= 10.0
    logs = f.log10()
    assert abs(float(logs.mean())) < 0.03 and abs(float((logs < 0).double().mean()) - 0.5) < 0.02
    again = rescale.log_uniform(20000, torch.Generator().manual_seed(0), 0.1, 10.0)
    assert torch.equal(f, again)
    model, _ = _build("mlp")
    a = rescale.transform(model, "node", torch.Generator().manual_seed(5))
    b = rescale.transform(model, "node", torch.Generator().manual_seed(5))
    for (ka, va), (_, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(va, vb), ka


def test_node_family_rescales_each_unit_independently() -> None:
    model, _ = _build("mlp_nobias")
    out = rescale.transform(model, "node", torch.Generator().manual_seed(0))
    ratio = (out[1].weight / model[1].weight).detach()          # row i scaled by c_i
    per_row = ratio[:, 0].detach()
    assert torch.allclose(ratio, per_row[:, None].expand_as(ratio))
    assert float(per_row.max() / per_row.min()) > 2.0
    # the next layer: column j ÷ c_j, and its own rows × d_i (it is the producer of the next junction)
    rows = out[3].weight * per_row[None, :] / model[3].weight
    assert torch.allclose(rows, rows[:, :1].expand_as(rows))


def test_bn_family_scales_running_statistics_and_eps() -> None:
    model, _ = _build("mlp_bn")
    out = rescale.transform(model, "bn", torch.Generator().manual_seed(0))
    c = float((out[1].weight / model[1].weight).flatten()[0])
    assert torch.allclose(out[1].weight, c * model[1].weight)
    assert torch.allclose(out[2].running_mean, c * model[2].running_mean)
    assert torch.allclose(out[2].running_var, c * c * model[2].running_var)
    assert out[2].eps == pytest.approx(c * c * model[2].eps)
    assert torch.equal(out[2].weight, model[2].weight)          # the affine part is untouched


def test_unsupported_models_say_why() -> None:
    tanh_net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    verdict = rescale.applicable_families(tanh_net)
    assert all(isinstance(v, str) and "Tanh" in v for v in verdict.values())

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    assert all("unsupported architecture" in v for v in rescale.applicable_families(Custom()).values())
    linear = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    verdict = rescale.applicable_families(linear)
    assert "no hidden layer" in verdict["node"] and verdict["logit_scale"] is True
