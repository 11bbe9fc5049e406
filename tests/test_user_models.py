"""Models and data of one's own: a study trains a model from a factory file on an .npz dataset through the
whole machinery (train, measure, report, resume); `flatbench measure-model` measures a factory's model
from a checkpoint; bad factories and datasets are one line."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch
import yaml
from conftest import cli_ok, cli_one_line_error, run_cli

FACTORY = '''
from torch import nn

def build(input_shape, num_classes, hidden=8):
    features = 1
    for d in input_shape:
        features *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
'''


def _npz(path, n_train=150, n_test=60, dim=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, dim)) * 3
    y_train, y_test = rng.integers(0, classes, n_train), rng.integers(0, classes, n_test)
    np.savez(path, x_train=(centers[y_train] + rng.normal(size=(n_train, dim))).astype(np.float32), y_train=y_train,
             x_test=(centers[y_test] + rng.normal(size=(n_test, dim))).astype(np.float32), y_test=y_test)
    return path


def test_a_study_trains_a_factory_model_on_npz_data(tmp_path):
    (tmp_path / "mine.py").write_text(textwrap.dedent(FACTORY))
    (tmp_path / "losses.py").write_text("import torch.nn.functional as F\n\ndef half_ce(logits, targets):\n"
                                        "    return 0.5 * F.cross_entropy(logits, targets, reduction='none')\n")
    _npz(tmp_path / "blobs.npz")
    config = {"name": "own", "seed": 0, "out": "results",
              "data": {"dataset": "blobs.npz", "random_label_ratio": [0.0, 0.5, 1.0]},
              "model": {"name": "mine.py:build", "kwargs": {"hidden": 12}},
              "train": {"epochs": 3, "batch_size": 32, "lr": 0.01},
              "measure": {"measures": ["frobenius_norm", "path_norm", "hessian_trace"],
                          "losses": ["ce", "mse", "losses.py:half_ce"]},
              "report": {"min_train_acc": 0.0}}
    (tmp_path / "own.yaml").write_text(yaml.safe_dump(config))
    cli_ok(run_cli("run", "own.yaml", "--quiet", cwd=tmp_path))
    runs = sorted((tmp_path / "results" / "own" / "runs").iterdir())
    assert [r.name.rsplit("-", 1)[0] for r in runs] == ["build-blobs-r0.00-s0", "build-blobs-r0.50-s0",
                                                        "build-blobs-r1.00-s0"]
    info = json.loads((runs[1] / "run.json").read_text())
    assert info["config"]["model"]["kwargs"] == {"hidden": 12}
    assert info["labels"]["n_corrupted"] == 75  # the random-label machinery on the user's data
    entries = json.loads((runs[1] / "measures.json").read_text())
    assert {"frobenius_norm", "path_norm", "hessian_trace", "hessian_trace@mse"} <= set(entries)
    assert all(entries[k]["status"] == "ok" for k in ("path_norm", "hessian_trace", "hessian_trace@mse"))
    assert entries["hessian_trace"]["info"]["method"] == "exact"
    half = entries["hessian_trace@half_ce"]["values"]["hessian_trace@half_ce"]  # a loss of one's own
    assert abs(half - 0.5 * entries["hessian_trace"]["values"]["hessian_trace"]) <= 1e-10 * abs(half)
    assert (tmp_path / "results" / "own" / "report.md").is_file()
    again = cli_ok(run_cli("train", "own.yaml", cwd=tmp_path))  # resume: every run is found finished
    assert "0 trained, 3 already finished" in again


def test_measure_model_from_a_factory_file_and_a_checkpoint(tmp_path):
    factory = tmp_path / "mine.py"
    factory.write_text(textwrap.dedent(FACTORY))
    data = _npz(tmp_path / "blobs.npz")
    torch.manual_seed(3)
    from torch import nn
    weights = nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).state_dict()
    torch.save(weights, tmp_path / "ckpt.pt")
    out = cli_ok(run_cli("measure-model", f"{factory}:build", "--checkpoint", str(tmp_path / "ckpt.pt"), "--data",
                      str(data), "--n-examples", "30", "--measures", "frobenius_norm,path_norm,psi_flatness",
                      "--out", str(tmp_path / "out")))
    expected = sum(float(v.double().pow(2).sum()) for k, v in weights.items() if k.endswith("weight"))
    line = next(row for row in out.splitlines() if row.startswith("frobenius_norm "))
    assert abs(float(line.split()[1]) - expected) <= 1e-3 * expected
    assert "psi_flatness" in out and "not applicable" in out
    entries = json.loads((tmp_path / "out" / "measures.json").read_text())
    assert entries["frobenius_norm"]["values"]["frobenius_norm"] == pytest.approx(expected, rel=1e-12)
    assert entries["psi_flatness"]["status"] == "not_applicable"
    assert "path_norm" in (tmp_path / "out" / "table.csv").read_text()


def test_bad_factories_and_datasets_are_one_line(tmp_path, write_config):
    (tmp_path / "mine.py").write_text(textwrap.dedent(FACTORY))
    np.savez(tmp_path / "half.npz", x_train=np.zeros((4, 2), np.float32), y_train=np.zeros(4, np.int64))
    cli_one_line_error(run_cli("measure-model", "mine.py:nope", "--data", "mnist_mini", cwd=tmp_path),
                    "has no 'nope'", "build")
    cli_one_line_error(run_cli("measure-model", "mine.py:build", "--data", "half.npz", cwd=tmp_path),
                    "lacks the array(s) x_test, y_test")
    config = write_config({"model": {"name": "mlp", "kwargs": {"hidden": 3}}}, name="kw.yaml")
    from flatbench.errors import FlatbenchError
    from flatbench.study.spec import check_study, study_from_target

    with pytest.raises(FlatbenchError, match="model.kwargs is for a model factory"):
        check_study(study_from_target(config))


def test_the_checks_behind_those_lines(tmp_path):
    from flatbench.data import check_dataset_name
    from flatbench.errors import FlatbenchError
    from flatbench.losses import check_loss_name
    from flatbench.models import check_model_name

    (tmp_path / "mine.py").write_text(textwrap.dedent(FACTORY))
    with pytest.raises(FlatbenchError, match="missing.py does not exist"):
        check_model_name(str(tmp_path / "missing.py") + ":build")
    with pytest.raises(FlatbenchError, match="'no_such_pkg_xyz' cannot be found"):
        check_model_name("no_such_pkg_xyz.models:build")
    with pytest.raises(FlatbenchError, match="unknown model 'mpl' \\(did you mean 'mlp'\\?\\)"):
        check_model_name("mpl")
    with pytest.raises(FlatbenchError, match="absent.npz does not exist"):
        check_dataset_name(str(tmp_path / "absent.npz"))
    with pytest.raises(FlatbenchError, match="has no 'no_loss'"):
        check_loss_name(f"{tmp_path / 'mine.py'}:no_loss")
    check_model_name(f"{tmp_path / 'mine.py'}:build")
    check_loss_name("mse")


def test_factories_get_the_shape_and_classes_by_name_or_position():
    import sys
    import types

    from torch import nn

    from flatbench.models import build_from_factory

    factories = types.ModuleType("factories_for_test")

    def named(input_shape, num_classes, hidden=4):
        return nn.Linear(input_shape[0], num_classes if hidden == 4 else hidden)

    def positional(shape, classes):
        return nn.Linear(shape[0], classes)

    def bare():
        return nn.Linear(5, 2)

    factories.named, factories.positional, factories.bare = named, positional, bare
    factories.nothing = lambda: "not a module"
    sys.modules["factories_for_test"] = factories
    try:
        assert build_from_factory("factories_for_test:named", (5,), 3).out_features == 3
        assert build_from_factory("factories_for_test:named", (5,), 3, {"hidden": 7}).out_features == 7
        assert build_from_factory("factories_for_test:positional", (5,), 3).out_features == 3
        assert build_from_factory("factories_for_test:bare", (5,), 3).out_features == 2
        from flatbench.errors import FlatbenchError

        with pytest.raises(FlatbenchError, match="returned a str, not a torch.nn.Module"):
            build_from_factory("factories_for_test:nothing", (5,), 3)
        with pytest.raises(FlatbenchError, match="unexpected keyword argument 'depth'"):
            build_from_factory("factories_for_test:bare", (5,), 3, {"depth": 2})
    finally:
        del sys.modules["factories_for_test"]
