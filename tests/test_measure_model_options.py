"""`flatbench measure-model` with settings (`--set MEASURE.KEY=VALUE`), a loss (`--loss`), a density plot
(`--plot PATH`), and a warning line when a factory is measured without `--checkpoint` (issue 29); bad
settings are one line, as in a study config. The density plot itself (`measures.density_plot`)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch
from conftest import in_process

FACTORY = '''
from torch import nn

def build(input_shape, num_classes):
    features = 1
    for d in input_shape:
        features *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 5), nn.Tanh(), nn.Linear(5, num_classes))
'''


@pytest.fixture()
def factory(tmp_path):
    (tmp_path / "mine.py").write_text(textwrap.dedent(FACTORY))
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 60)
    x = (rng.normal(size=(3, 4))[y] + rng.normal(size=(60, 4))).astype(np.float32)
    np.savez(tmp_path / "blobs.npz", x_train=x, y_train=y, x_test=x[:20], y_test=y[:20])
    return tmp_path


def _args(where, *extra: str) -> tuple[str, ...]:
    return ("measure-model", f"{where / 'mine.py'}:build", "--data", str(where / "blobs.npz"), "--n-examples", "30",
            "--dtype", "float64", *extra)


def test_settings_loss_plot_and_the_no_checkpoint_warning(factory) -> None:
    out = factory / "out"
    run = in_process(*_args(factory, "--measures", "hessian_max_eig,fisher_rao_norm", "--set",
                            "hessian_max_eig.iters=2", "--set", "hessian_max_eig.per=layer", "--loss", "mse",
                            "--plot", str(factory / "density.png"), "--set", "hessian_density.runs=2",
                            "--set", "hessian_density.iters=10", "--out", str(out)))
    assert run.returncode == 1, run.stdout + run.stderr  # iters=2 cannot converge: a failed entry
    entries = json.loads((out / "measures.json").read_text())
    eig = entries["hessian_max_eig@mse"]
    assert eig["status"] == "not_converged" and eig["settings"]["iters"] == 2 and eig["settings"]["loss"] == "mse"
    assert set(eig["info"]["per_layer"]) == {"1", "3"}
    assert "computed with ce" in entries["fisher_rao_norm"]["reason"]
    assert entries["hessian_density@mse"]["info"]["runs"] == 2
    assert (factory / "density.png").read_bytes()[:4] == b"\x89PNG" and "density.png" in run.stdout
    assert "failed:" in run.stderr and "hessian_max_eig@mse" in run.stderr
    warning = [line for line in run.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "no --checkpoint" in warning[0] and "random initialization" in warning[0]


def test_bad_settings_are_one_line_before_any_work(factory) -> None:
    for item, part in (("hessian_max_eig.iter=5", "did you mean 'iters'"),
                       ("hessian_max_eig.iters=0", "must be at least 1"),
                       ("hessian_max_eig.tol=abc", "expected a number"),
                       ("no_such.k=1", "unknown measure 'no_such'"),
                       ("iters=5", "MEASURE.KEY=VALUE")):
        run = in_process(*_args(factory, "--measures", "hessian_max_eig", "--set", item))
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), run.stderr
        assert part in lines[0], lines[0]
    run = in_process(*_args(factory, "--measures", "hessian_trace", "--loss", "bogus"))
    assert run.returncode == 2 and "unknown loss 'bogus'" in run.stderr


def test_the_device_option_says_where_to_measure() -> None:
    run = in_process("measure-model", "--help")
    assert "Where to measure." in run.stdout and "Where to train" not in run.stdout


def test_plot_density_draws_an_entry_and_refuses_one_without_a_density(tmp_path) -> None:
    import flatbench
    from flatbench.errors import FlatbenchError
    from flatbench.measures.density_plot import density_summary, plot_density

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    x, y = torch.randn(20, 4), torch.arange(20) % 3
    df = flatbench.measure(model, (x, y), ["hessian_density"], settings={"hessian_density": {"runs": 2, "iters": 8}})
    info = df.attrs["info"]["hessian_density"]
    path = plot_density({"info": info, "values": dict(zip(df["key"], df["value"]))}, tmp_path / "d.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    lines = density_summary({"info": info, "values": dict(zip(df["key"], df["value"]))})
    assert lines[0].startswith("m1 = ") and any(line.startswith("λmax = ") for line in lines)
    with pytest.raises(FlatbenchError, match="no spectral density"):
        plot_density({"info": {"method": "exact"}}, tmp_path / "e.png")
