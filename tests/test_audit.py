"""`flatbench audit` on a tiny trained experiment: per-run audit and the population stress test."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from flatbench.cli import audit
from flatbench.config import parse_study
from flatbench.store import run_dir
from flatbench.train import train_run

MEASURES = "normalized_sharpness,matrix_normalized_sharpness,hessian_trace,frobenius_norm"


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three tiny MLPs (label noise 0, 0.5, 1) trained for 2 epochs on mnist_mini."""
    from flatbench.study.spec import save_study

    out = tmp_path_factory.mktemp("audit")
    study = parse_study({"name": "tiny_audit",
                         "data": {"dataset": "mnist_mini", "n_train": 256, "n_test": 128,
                                  "random_label_ratio": [0.0, 0.5, 1.0]},
                         "model": {"widths": [16]}, "train": {"epochs": 2},
                         "measure": {"n_examples": 96}}, out=str(out))
    save_study(study)
    for rid, cfg in study.runs:
        train_run(rid, cfg, run_dir(study.exp_dir, rid), torch.device("cpu"), progress=False,
                  echo=lambda _m: None)
    return study.exp_dir


def _invoke(*args: str):
    result = CliRunner().invoke(audit, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_run_audit_writes_table_and_heatmap(experiment: Path) -> None:
    run = min((experiment / "runs").iterdir())
    result = _invoke(str(run), "--trials", "2", "--measures", MEASURES, "--device", "cpu")
    frame = pd.read_csv(run / "audit.csv")
    assert list(frame.columns)[:6] == ["measure", "family", "trial", "value", "baseline", "rel_change"]
    assert {"declared_invariant", "status", "function_change"} <= set(frame.columns)
    # mlp without BatchNorm: bn does not apply, the other three families run twice each
    assert set(frame["family"]) == {"layer", "node", "logit_scale"}
    assert set(frame["measure"]) == set(MEASURES.split(","))
    assert len(frame) == 4 * 3 * 2 and set(frame["trial"]) == {0, 1}
    assert (frame["status"] == "ok").all() and (frame["function_change"] < 1e-8).all()
    ns = frame[(frame["measure"] == "normalized_sharpness") & frame["family"].isin(["layer", "node"])]
    assert (ns["rel_change"] < 1e-6).all() and ns["declared_invariant"].all()
    hess = frame[(frame["measure"] == "hessian_trace") & (frame["family"] == "node")]
    assert (hess["rel_change"] > 0.1).all() and not hess["declared_invariant"].any()
    png = (run / "audit.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 2000
    assert "normalized_sharpness" in result.output and "declared invariant" in result.output
    assert "bn: not applicable" in result.output
    assert "not met" not in result.output


def test_population_audit_compares_correlations(experiment: Path, tmp_path: Path) -> None:
    result = _invoke(str(experiment), "--population", "--family", "node", "--measures",
                     "normalized_sharpness,frobenius_norm", "--out", str(tmp_path), "--device", "cpu")
    corr = pd.read_csv(tmp_path / "audit_correlations.csv")
    assert list(corr.columns) == ["measure", "family", "n", "tau_original", "tau_transformed", "delta",
                                  "p_original", "p_transformed", "median_rel_change", "declared_invariant"]
    assert list(corr["measure"]) == ["normalized_sharpness", "frobenius_norm"]
    assert (corr["n"] == 3).all()
    ns = corr.set_index("measure").loc["normalized_sharpness"]
    assert ns["tau_transformed"] == pytest.approx(ns["tau_original"]) and ns["median_rel_change"] < 1e-6
    assert bool(ns["declared_invariant"])
    per_run = pd.read_csv(tmp_path / "audit_population.csv")
    assert len(per_run) == 3 * 2 and set(per_run["status"]) == {"ok"}
    assert (tmp_path / "audit_correlations.png").read_bytes().startswith(b"\x89PNG")
    assert "Kendall" in result.output


def test_audit_rejects_bad_targets(experiment: Path) -> None:
    from flatbench.errors import FlatbenchError

    with pytest.raises(FlatbenchError, match="--population"):
        CliRunner().invoke(audit, [str(experiment)], catch_exceptions=False)
    run = min((experiment / "runs").iterdir())
    with pytest.raises(FlatbenchError, match="unknown family"):
        CliRunner().invoke(audit, [str(run), "--families", "layer,rotate"], catch_exceptions=False)
