"""`flatbench.verify` / `flatbench verify`: a model's curvature against its dense Hessian, and
`check-measure --factory`: the invariance contract on a model of one's own.

The planted bugs (a torch.func mode trusted unchecked, a wrong Lanczos eigenvalue) must turn a check into
FAIL and the command's exit code into 1; otherwise a verify that always passes would pass these tests too.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import flatbench
from conftest import cli_one_line_error, in_process
from flatbench.curvature import modes
from flatbench.verification import SlicedModel, choose_slice, reference_hessian
from flatbench.losses import get_loss

HVP = importlib.import_module("flatbench.curvature.hvp")

FACTORY = '''
from torch import nn


def layernorm_mlp(input_shape, num_classes):
    size = 1
    for s in input_shape:
        size *= s
    return nn.Sequential(nn.Flatten(), nn.AvgPool1d(49), nn.Linear(size // 49, 6), nn.LayerNorm(6), nn.GELU(),
                         nn.Linear(6, num_classes))


def relu_mlp(input_shape, num_classes):
    size = 1
    for s in input_shape:
        size *= s
    return nn.Sequential(nn.Flatten(), nn.AvgPool1d(49), nn.Linear(size // 49, 6), nn.ReLU(), nn.Linear(6, 5),
                         nn.ReLU(), nn.Linear(5, num_classes))
'''


def _ln_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))


def _data(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def test_a_small_layernorm_net_passes_and_the_wrong_mode_is_named() -> None:
    df = flatbench.verify(_ln_net(), _data(), hvp_mode="rev_fwd")
    assert df.attrs["failed"] == 0, df.to_string()
    rows = df.set_index("check")
    assert rows.loc["HVP, rev_fwd as torch computes it", "verdict"] == "wrong"
    assert rows.loc["HVP, rev_fwd as torch computes it", "rel_error"] > 0.05
    assert "double_backward" in rows.loc["HVP as flatbench computes it (hvp_mode rev_fwd)", "note"]
    assert df.attrs["slice"].startswith("all 69 parameters")
    for check in ("hessian_trace on the model", "hessian_max_eig on the model, eigenvalue 1",
                  "Hessian diagonal (shared by the measures)"):
        assert rows.loc[check, "verdict"] == "ok" and rows.loc[check, "rel_error"] < 1e-10, check


def test_planted_bug_a_mode_trusted_unchecked_fails_the_verify(monkeypatch) -> None:
    monkeypatch.setattr(HVP, "check_mode", lambda *a, **k: modes.ModeCheck("rev_fwd", True, 0.0, 1e-8))
    df = flatbench.verify(_ln_net(), _data(), hvp_mode="rev_fwd")
    failed = set(df[df["verdict"] == "FAIL"]["check"])
    assert "HVP as flatbench computes it (hvp_mode rev_fwd)" in failed
    assert "hessian_max_eig on the model, eigenvalue 1" in failed


def test_planted_bug_a_wrong_lanczos_eigenvalue_fails_the_verify(monkeypatch) -> None:
    from flatbench.curvature import operator

    real = operator.lanczos_operator

    def off(*args, **kwargs):
        out = real(*args, **kwargs)
        return {**out, "eigenvalues": [e * (1 + 1e-4) for e in out["eigenvalues"]]}

    monkeypatch.setattr(operator, "lanczos_operator", off)
    df = flatbench.verify(_ln_net(), _data())
    assert "hessian_max_eig on the model, eigenvalue 1" in set(df[df["verdict"] == "FAIL"]["check"])


def test_a_larger_model_is_cut_to_a_slice_of_every_tensor() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 40), nn.LayerNorm(40), nn.SiLU(), nn.Linear(40, 3))
    df = flatbench.verify(model, _data(), max_params=30)
    assert df.attrs["failed"] == 0, df.to_string()
    assert df.attrs["slice"].startswith("30 of 443 parameters, from 6 of 6 tensors")
    assert "hessian_trace on the slice" in set(df["check"])


def test_the_slice_hessian_is_the_diagonal_block_of_the_full_hessian() -> None:
    model = _ln_net().double().eval()
    x, y = _data()
    x = x.double()
    loss = get_loss("ce")
    full = reference_hessian(model, x, y, loss)
    selection = choose_slice(model, 20, torch.Generator().manual_seed(3))
    flat_index = []
    offset = 0
    for name, p in model.named_parameters():
        if name in selection:
            flat_index += [offset + int(i) for i in selection[name]]
        offset += p.numel()
    index = torch.tensor(flat_index)
    block = reference_hessian(SlicedModel(model, selection), x, y, loss)
    assert torch.allclose(block, full[index][:, index], rtol=1e-12, atol=1e-14)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=8), budget=st.integers(1, 120),
       seed=st.integers(0, 1000))
def test_the_slice_has_the_budget_and_reaches_every_tensor_it_can(sizes: list[int], budget: int, seed: int) -> None:
    model = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in sizes])
    chosen = choose_slice(model, budget, torch.Generator().manual_seed(seed))
    total = sum(sizes)
    assert sum(i.numel() for i in chosen.values()) == min(budget, total)
    if budget >= len(sizes):
        assert len(chosen) == len(sizes)
    for name, idx in chosen.items():
        size = dict(model.named_parameters())[name].numel()
        assert idx.unique().numel() == idx.numel() and int(idx.min()) >= 0 and int(idx.max()) < size


def test_verify_refuses_bad_arguments_in_one_line() -> None:
    with pytest.raises(flatbench_error(), match="max_params must be a positive integer"):
        flatbench.verify(_ln_net(), _data(), max_params=0)
    with pytest.raises(flatbench_error(), match="hvp_mode must be one of"):
        flatbench.verify(_ln_net(), _data(), hvp_mode="bogus")


def flatbench_error() -> type:
    from flatbench.errors import FlatbenchError

    return FlatbenchError


def test_the_command_line_passes_and_exits_1_on_a_planted_bug(tmp_path, monkeypatch) -> None:
    (tmp_path / "factories.py").write_text(FACTORY)
    spec = f"{tmp_path / 'factories.py'}:layernorm_mlp"
    ok = in_process("verify", spec, "--data", "mnist_mini", "--n-examples", "10", "--params", "40",
                    "--hvp-mode", "rev_fwd")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "passed: flatbench's curvature agrees" in ok.stdout and "40 of " in ok.stdout
    monkeypatch.setattr(HVP, "check_mode", lambda *a, **k: modes.ModeCheck("rev_fwd", True, 0.0, 1e-8))
    bad = in_process("verify", spec, "--data", "mnist_mini", "--n-examples", "10", "--params", "40",
                     "--hvp-mode", "rev_fwd")
    assert bad.returncode == 1 and "FAILED:" in bad.stdout
    cli_one_line_error(in_process("verify", f"{tmp_path / 'factories.py'}:nothing", "--data", "mnist_mini"),
                       "nothing")


def test_check_measure_on_a_factory_of_ones_own(tmp_path) -> None:
    (tmp_path / "factories.py").write_text(FACTORY)
    spec = f"{tmp_path / 'factories.py'}:relu_mlp"
    out = in_process("check-measure", "path_norm", "--factory", spec, "--data", "mnist_mini", "--n-examples", "32")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("own:")]
    assert {line.split()[1] for line in lines} >= {"-", "layer", "node"}, out.stdout
    assert all(" ok" in line for line in lines if line.split()[1] in ("layer", "node"))
    assert "on 1 trained models" in out.stdout
    both = in_process("check-measure", "frobenius_norm", "--factory", spec, "--data", "mnist_mini", "--cases", "mlp")
    assert both.returncode == 0 and "on 2 trained models" in both.stdout
    cli_one_line_error(in_process("check-measure", "path_norm", "--factory", spec), "--factory and --data go together")
