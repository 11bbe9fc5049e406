"""The real CLI: an end-to-end tiny study, re-runs, and every bad input as one line with exit code 2."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest

from conftest import run_cli

RUN_IDS = ["mlp-mnist_mini-r0.00-s0", "mlp-mnist_mini-r1.00-s0"]


@pytest.fixture(scope="module")
def finished_study(tmp_path_factory):
    """One tiny study run end to end through `flatbench run` (shared by the tests below)."""
    import yaml

    from conftest import TINY

    root = tmp_path_factory.mktemp("e2e")
    cfg = root / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    result = run_cli("run", str(cfg), "--out", str(root / "out"), "--device", "cpu", "--quiet")
    assert result.returncode == 0, result.stderr
    return cfg, root / "out" / "tiny", result


def test_run_writes_every_file_and_column(finished_study):
    _cfg, exp, result = finished_study
    for rid in RUN_IDS:
        run = exp / "runs" / rid
        assert (run / "run.json").is_file() and (run / "model.pt").is_file()
        assert (run / "measures.json").is_file()
    for name in ("table.csv", "correlations.csv", "report.md", "study.yaml"):
        assert (exp / name).is_file(), name
    assert (exp / "plots").is_dir() and list((exp / "plots").glob("*.png"))
    table = pd.read_csv(exp / "table.csv")
    assert sorted(table["run_id"]) == RUN_IDS
    for column in ("data.random_label_ratio", "model.widths", "train_acc", "test_acc", "train_loss", "test_loss",
                   "gap_acc", "frobenius_norm", "spectral_norm", "path_norm"):
        assert column in table.columns, column
    corr = pd.read_csv(exp / "correlations.csv")
    assert {"measure", "kendall_tau", "spearman_rho", "pearson_r", "n"} <= set(corr.columns)
    assert "frobenius_norm" in result.stdout


def test_rerun_skips_finished_runs_and_measures(finished_study):
    cfg, exp, _ = finished_study
    run = exp / "runs" / RUN_IDS[0]
    before = ((run / "model.pt").stat().st_mtime_ns, (run / "measures.json").read_text())
    again = run_cli("run", str(cfg), "--out", str(exp.parent), "--device", "cpu", "--quiet")
    assert again.returncode == 0, again.stderr
    assert ((run / "model.pt").stat().st_mtime_ns, (run / "measures.json").read_text()) == before


def test_measure_on_experiment_folder_with_force_and_subset(finished_study):
    _cfg, exp, _ = finished_study
    result = run_cli("measure", str(exp), "--measures", "frobenius_norm", "--force", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "measured 2 runs" in result.stdout


def test_list_measures_shows_the_registry():
    result = run_cli("list-measures")
    assert result.returncode == 0
    for name in ("frobenius_norm", "spectral_norm", "path_norm"):
        assert name in result.stdout


def _assert_one_line_error(result, fragment):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize("changes, fragment", [
    ({"trian": {"epochs": 1}}, "unknown key 'trian'"),
    ({"train": {"epochs": "three"}}, "expected an integer"),
    ({"data": {"random_label_ratio": 2}}, "must be in [0, 1]"),
    ({"model": {"name": "resnet"}}, "unknown model 'resnet'"),
    ({"data": {"dataset": "svhn"}}, "unknown dataset 'svhn'"),
    ({"measure": {"measures": ["sharpiness"]}}, "unknown measure 'sharpiness'"),
])
def test_bad_config_is_one_line_and_exit_2(write_config, tmp_path, changes, fragment):
    result = run_cli("run", str(write_config(changes)), "--out", str(tmp_path / "o"), "--device", "cpu")
    _assert_one_line_error(result, fragment)


def test_missing_and_invalid_config_files(tmp_path):
    _assert_one_line_error(run_cli("train", str(tmp_path / "none.yaml")), "config file not found")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {dataset: mnist_mini\n")
    _assert_one_line_error(run_cli("train", str(bad)), "invalid YAML")


def test_unknown_measure_on_the_command_line(finished_study):
    _cfg, exp, _ = finished_study
    _assert_one_line_error(run_cli("measure", str(exp), "--measures", "nope"), "unknown measure 'nope'")


def test_corrupt_checkpoint_is_one_line_and_loses_nothing(finished_study, tmp_path):
    _cfg, exp, _ = finished_study
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    model = copy / "runs" / RUN_IDS[0] / "model.pt"
    model.write_bytes(b"not a checkpoint")
    other = (copy / "runs" / RUN_IDS[1] / "measures.json").read_text()
    result = run_cli("measure", str(copy), "--force", "--measures", "frobenius_norm", "--device", "cpu")
    _assert_one_line_error(result, "corrupt")
    assert model.read_bytes() == b"not a checkpoint"
    assert (copy / "runs" / RUN_IDS[1] / "measures.json").read_text() == other


def test_corrupt_training_checkpoint(write_config, tmp_path):
    cfg = write_config({"data": {"random_label_ratio": 0.0}})
    run = tmp_path / "o" / "tiny" / "runs" / "mlp-mnist_mini-r0.00-s0"
    run.mkdir(parents=True)
    from flatbench.config import load_study
    from flatbench.store import atomic_write_json

    _, run_cfg = load_study(cfg).runs[0]
    atomic_write_json(run / "run.json", {"run_id": run.name, "status": "running",
                                         "config_hash": run_cfg.config_hash()})
    (run / "checkpoint.pt").write_bytes(b"\x00garbage")
    result = run_cli("train", str(cfg), "--out", str(tmp_path / "o"), "--device", "cpu")
    _assert_one_line_error(result, "checkpoint.pt is corrupt")
    assert (run / "checkpoint.pt").read_bytes() == b"\x00garbage"


def test_report_on_a_folder_that_is_not_an_experiment(tmp_path):
    _assert_one_line_error(run_cli("report", str(tmp_path)), "not a flatbench experiment folder")
