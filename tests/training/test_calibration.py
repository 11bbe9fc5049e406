"""The temperature-calibrated cross-entropy (issue 42's secondary target): the fitted temperature is the
minimum of the test cross-entropy (against a brute-force grid), calibration removes the logit scale, the
cross-fitted CE is each half scored at the other half's temperature, every trained run records it, and
`flatbench train` adds it to a run trained before flatbench recorded it without retraining the run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flatbench.config import load_study
from flatbench.store import RUN_JSON, read_json, atomic_write_json
from flatbench.study.train import train_study
from flatbench.training.calibration import BETA_MAX, cross_fitted_ce, fit_beta, mean_ce
from tests.conftest import in_process


def _logits(n: int = 400, seed: int = 0, right: float = 0.7) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a classifier that is right on a `right` share of `n` images, confidently either way."""
    g = torch.Generator().manual_seed(seed)
    z = 4 * torch.randn(n, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (n,), generator=g)
    k = int(right * n)
    y[:k] = z[:k].argmax(1)
    return z, y


@pytest.mark.parametrize("seed", range(4))
def test_the_fitted_temperature_is_the_minimum_of_the_cross_entropy(seed):
    z, y = _logits(seed=seed, right=0.3 + 0.15 * seed)
    beta = fit_beta(z, y)
    grid = torch.linspace(1e-3, 3.0, 3001, dtype=torch.float64)
    brute = [F.cross_entropy(z * g, y).item() for g in grid]
    best = int(torch.tensor(brute).argmin())
    assert abs(beta - float(grid[best])) < 2e-3
    assert mean_ce(z, y, beta) <= min(brute) + 1e-12


def test_calibration_removes_the_logit_scale():
    """Why the target exists: the calibrated CE of the network with its logits scaled by c is the same for
    every c (the loss gap is not: it grows with the scale the weight norms set)."""
    z, y = _logits(seed=7)
    reference = mean_ce(z, y, fit_beta(z, y))
    for c in (0.01, 0.3, 5.0, 80.0):
        assert fit_beta(z * c, y) == pytest.approx(fit_beta(z, y) / c, rel=1e-9)
        assert mean_ce(z * c, y, fit_beta(z * c, y)) == pytest.approx(reference, abs=1e-12)
        assert cross_fitted_ce(z * c, y) == pytest.approx(cross_fitted_ce(z, y), abs=1e-12)
    assert mean_ce(z * 80.0, y, 1.0) > 10 * reference  # uncalibrated, the scale is everything


def test_the_edges_of_the_search():
    z, y = _logits(right=1.0)
    assert fit_beta(z, y) == BETA_MAX  # every image right: the CE falls all the way to β → ∞
    assert fit_beta(torch.zeros(50, 10, dtype=torch.float64), torch.randint(0, 10, (50,))) == 0.0
    assert math.isnan(fit_beta(z[:0], y[:0])) and math.isnan(cross_fitted_ce(z[:1], y[:1]))


def test_the_cross_fitted_ce_scores_each_half_at_the_other_halfs_temperature():
    z, y = _logits(n=301, seed=3)
    even, odd = slice(0, None, 2), slice(1, None, 2)
    by_hand = (F.cross_entropy(z[odd] * fit_beta(z[even], y[even]), y[odd], reduction="sum")
               + F.cross_entropy(z[even] * fit_beta(z[odd], y[odd]), y[even], reduction="sum")).item() / 301
    assert cross_fitted_ce(z, y) == pytest.approx(by_hand, abs=1e-12)
    assert cross_fitted_ce(z, y) >= mean_ce(z, y, fit_beta(z, y))  # out of sample never beats in sample here


def test_a_trained_run_records_it_and_train_adds_it_to_an_older_run(write_config, tmp_path):
    config = write_config({"train": {"epochs": 3, "batch_size": 64, "lr": 0.003, "snapshot_losses": [2.0]}})
    study = load_study(config, out=str(tmp_path / "out"))
    train_study(study, torch.device("cpu"), quiet=True)
    run = sorted((study.exp_dir / "runs").iterdir())[0]
    info = read_json(run / RUN_JSON)
    cal = info["calibration"]
    assert cal["temperature"] > 0
    assert cal["gap_calibrated"] == pytest.approx(cal["test_loss_calibrated"] - cal["train_loss_calibrated"])
    assert cal["test_loss_calibrated"] <= info["test_loss"] + 0.05  # calibrating cannot hurt much out of sample
    (snap,) = info["snapshots"]
    assert read_json(run / snap["path"] / "snapshot.json")["calibration"] == snap["calibration"]

    older = {k: v for k, v in info.items() if k not in ("calibration", "snapshots")}  # as flatbench wrote it
    older["snapshots"] = [{k: v for k, v in snap.items() if k != "calibration"}]      # before
    atomic_write_json(run / RUN_JSON, older)
    atomic_write_json(run / snap["path"] / "snapshot.json",
                      {k: v for k, v in snap.items() if k not in ("calibration", "path")})
    lines: list[str] = []
    outcome = train_study(study, torch.device("cpu"), echo=lines.append)
    again = read_json(run / RUN_JSON)
    assert outcome.trained == [] and again["history"] == info["history"]  # not retrained
    assert again["model_sha256"] == info["model_sha256"]
    assert again["calibration"] == pytest.approx(cal, abs=1e-6)
    assert again["snapshots"][0]["calibration"] == pytest.approx(snap["calibration"], abs=1e-6)
    assert "calibration" in read_json(run / snap["path"] / "snapshot.json")
    assert any("calibrated cross-entropy to 1 finished run" in line for line in lines), lines

    assert in_process("measure", str(config), "--out", str(tmp_path / "out"), "--quiet").returncode == 0
    out = tmp_path / "report"
    result = in_process("report", str(study.exp_dir), "--gap", "calibrated", "--out", str(out), "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    table = (out / "table.csv").read_text().splitlines()[0].split(",")
    assert "gap_calibrated" in table and "temperature" in table
    assert "temperature-calibrated" in (out / "report.md").read_text()

    for path in (study.exp_dir / "runs").iterdir():  # runs that never recorded it: one line saying what to do
        atomic_write_json(path / RUN_JSON, {k: v for k, v in read_json(path / RUN_JSON).items() if k != "calibration"})
    result = in_process("report", str(study.exp_dir), "--gap", "calibrated", "--out", str(out), "--quiet")
    assert result.returncode == 2 and "no gap_calibrated recorded" in result.stderr
    assert "`flatbench train` on its config adds it" in result.stderr
