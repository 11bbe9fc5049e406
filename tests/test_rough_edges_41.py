"""Issue 41's rough edges: the HVP mode from `measure-model` and a study's config, integer token inputs kept
as integers, regression targets with `loss="mse"`, dict batches through `batch_fn`, `hessian_max_eig`'s
residuals under names that say what they are (the density's interval: tests/curvature/test_density.py)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import in_process
from torch import nn

import flatbench
from flatbench.errors import FlatbenchError

PROBE = '''
from flatbench import MeasureOutput, register_measure
from flatbench.curvature import HVP_MODES, hvp_mode_of


@register_measure("hvp_mode_probe", description="which HVP mode the measured model's products use")
def hvp_mode_probe(ctx):
    mode = hvp_mode_of(ctx.model)
    return MeasureOutput({"hvp_mode_probe": float(HVP_MODES.index(mode))}, {"hvp_mode": mode})
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """The probe plugin, one file for the module (a measure's name is registered once per process)."""
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return path


def _one_line(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(FlatbenchError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


# ---------------------------------------------------------------- 1. the HVP mode


def test_a_study_configs_hvp_mode_override_reaches_the_measured_model(tmp_path, write_config, probe) -> None:
    """`flatbench run CONFIG measure.hvp_mode=double_backward`: the model every measure sees makes its HVPs
    in that mode (a plugin measure reads it off the model it is given)."""
    cfg = write_config({"train": {"epochs": 1},
                        "measure": {"measures": ["hvp_mode_probe"], "plugins": [str(probe)],
                                    "n_examples": 50}})
    run = in_process("run", str(cfg), "--out", str(tmp_path / "out"), "--device", "cpu", "--quiet",
                     "measure.hvp_mode=double_backward")
    assert run.returncode == 0, run.stdout + run.stderr
    entries = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("measures.json")]
    assert len(entries) == 3 and {e["hvp_mode_probe"]["info"]["hvp_mode"] for e in entries} == {"double_backward"}


@pytest.fixture()
def blobs(tmp_path: Path) -> Path:
    (tmp_path / "mine.py").write_text(textwrap.dedent('''
        from torch import nn

        def build(input_shape, num_classes):
            return nn.Sequential(nn.Linear(input_shape[0], 5), nn.Tanh(), nn.Linear(5, num_classes))
        '''))
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 40)
    x = (rng.normal(size=(3, 4))[y] + rng.normal(size=(40, 4))).astype(np.float32)
    np.savez(tmp_path / "blobs.npz", x_train=x, y_train=y, x_test=x[:10], y_test=y[:10])
    return tmp_path


def test_measure_model_takes_the_hvp_mode(blobs, probe) -> None:
    base = ("measure-model", f"{blobs / 'mine.py'}:build", "--data", str(blobs / "blobs.npz"), "--measures",
            "hvp_mode_probe", "--plugin", str(probe))
    for mode in ("double_backward", "fwd_rev"):
        run = in_process(*base, "--hvp-mode", mode, "--out", str(blobs / mode))
        assert run.returncode == 0, run.stdout + run.stderr
        entry = json.loads((blobs / mode / "measures.json").read_text())["hvp_mode_probe"]
        assert entry["info"]["hvp_mode"] == mode and entry["context"]["hvp_mode"] == mode
    wrong = in_process(*base, "--hvp-mode", "fastest")
    assert wrong.returncode == 2 and "--hvp-mode" in wrong.stderr and "double_backward" in wrong.stderr
    refused = in_process(*base, "--set", "hvp_mode=double_backward")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("error: ") and "give it as --hvp-mode double_backward" in line


def test_the_api_passes_the_hvp_mode_to_the_measured_model(blobs, probe) -> None:
    from flatbench.api import measure_model

    df, _ = measure_model(f"{blobs / 'mine.py'}:build", str(blobs / "blobs.npz"), measures=["hvp_mode_probe"],
                          plugins=[str(probe)], hvp_mode="double_backward")
    assert df.attrs["info"]["hvp_mode_probe"]["hvp_mode"] == "double_backward"
    model = nn.Sequential(nn.Linear(4, 3))
    data = (torch.randn(6, 4), torch.arange(6) % 3)
    df = flatbench.measure(model, data, ["hvp_mode_probe"], hvp_mode="fwd_rev")
    assert df.attrs["info"]["hvp_mode_probe"]["hvp_mode"] == "fwd_rev"


# ---------------------------------------------------------------- 6. Lanczos residuals


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 3))


def _data(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 4, generator=g), torch.arange(n) % 3


def test_hessian_max_eig_names_its_relative_and_absolute_residuals() -> None:
    """info["relative_residual"] is ‖Hy − θy‖ / |θ|, the number the not_converged reason gives;
    info["absolute_residual"] is ‖Hy − θy‖ itself (no bare "residual" whose meaning one would guess)."""
    x, y = _data()
    df = flatbench.measure(_mlp(), (x, y), ["hessian_max_eig"],
                           settings={"hessian_max_eig": {"iters": 2, "k": 2, "per": "layer"}})
    row, info = df.iloc[0], df.attrs["info"]["hessian_max_eig"]
    assert row["status"] == "not_converged"
    assert "residual" not in info and "residuals" not in info
    top = info["values"]["hessian_max_eig"]
    assert info["relative_residual"] == pytest.approx(info["absolute_residual"] / abs(top), rel=1e-12)
    assert info["relative_residuals"] == pytest.approx([a / abs(v) for a, v in zip(info["absolute_residuals"],
                                                                                   info["eigenvalues"])], rel=1e-12)
    rule = max(info["absolute_residuals"]) / max(abs(v) for v in info["eigenvalues"])  # k = 2: the stopping rule's
    assert f"on H stopped at iters = 2 with relative residual {rule:.3g} >" in row["reason"]
    for name, block in info["per_layer"].items():
        assert "residual" not in block
        assert block["relative_residual"] == pytest.approx(block["absolute_residual"] / abs(block["eigenvalue"]))
        if not block["converged"]:
            assert f"layer {name} stopped at iters = 2 with relative residual {block['relative_residual']:.3g}" \
                in row["reason"]
    one = flatbench.measure(_mlp(), (x, y), ["hessian_max_eig"], settings={"hessian_max_eig": {"iters": 2}})
    info = one.attrs["info"]["hessian_max_eig"]
    assert f"relative residual {info['relative_residual']:.3g} > tol" in one.iloc[0]["reason"]
    done = flatbench.measure(_mlp(), (x, y), ["hessian_max_eig"], settings={"hessian_max_eig": {"tol": 1e-8}})
    info = done.attrs["info"]["hessian_max_eig"]
    assert done.iloc[0]["status"] == "ok" and info["relative_residual"] <= 1e-8 and info["converged"]
