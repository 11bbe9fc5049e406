"""The report's endpoint rule (issue 42): a run whose run.json endpoint record (`train.endpoint_tolerance`)
says it missed its endpoint is out of the statistics and named, with its reason, in the terminal, report.md
and the excluded list; it stays in table.csv. Runs without the record (every committed study) are not
judged: their report is the one without the rule."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from test_report import write_experiment

from flatbench.analysis.report import write_report

MISSED = {"mlp-mnist_mini-r0.25-s1": {"final": 0.0019},   # overshot: below the band
          "mlp-mnist_mini-r0.75-s0": {"final": 0.031, "reached": False}}   # never reached the target


def _endpoint(final: float, reached: bool = True) -> dict:
    return {"target": 0.01, "tolerance": 0.05, "final": final, "reached": reached,
            "within_tolerance": 0.0095 <= final <= 0.01, "steps": 640, "epochs": 20, "check_steps": 1, "checks": 12,
            "scaled_step": None}


def _with_endpoints(exp, missed):
    """Give every run an endpoint record: within the band, except the runs of `missed`."""
    for run in sorted((exp / "runs").iterdir()):
        info = json.loads((run / "run.json").read_text())
        spec = missed.get(run.name, {"final": 0.0097})
        info["endpoint"] = _endpoint(spec["final"], spec.get("reached", True))
        info["train_loss"] = spec["final"]
        (run / "run.json").write_text(json.dumps(info))
    return exp


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("endpoint")
    judged = _with_endpoints(write_experiment(root, "judged"), MISSED)
    lines: list[str] = []
    summary = write_report([judged], judged, n_boot=200, echo=lines.append)
    without = root / "without"  # the same study with the two runs' folders removed
    shutil.copytree(judged, without, ignore=shutil.ignore_patterns("*.csv", "*.md", "*.html", "plots"))
    for rid in MISSED:
        shutil.rmtree(without / "runs" / rid)
    removed = write_report([without], without, n_boot=200, echo=lambda m: None)
    return judged, summary, "\n".join(lines), removed


def test_a_run_that_missed_its_endpoint_is_out_of_the_statistics_and_named(reports):
    exp, summary, terminal, removed = reports
    assert summary.n_included == 6 and summary.n_runs == 8
    reasons = {e["run_id"]: e["reason"] for e in summary.excluded}
    assert set(reasons) == set(MISSED)
    assert "below the endpoint's band [0.0095, 0.01]" in reasons["mlp-mnist_mini-r0.25-s1"]
    assert "did not reach train loss 0.01" in reasons["mlp-mnist_mini-r0.75-s0"]
    assert all(r.startswith("missed the training endpoint: ") for r in reasons.values())
    markdown = (exp / "report.md").read_text()
    for rid in MISSED:
        assert rid in terminal and rid in markdown
    assert "2 run(s) missed the common training endpoint" in markdown
    assert "WARNING: 2 run(s) missed the common training endpoint" in terminal
    assert len(pd.read_csv(exp / "table.csv")) == 8  # still in the table
    # the statistics are those of the study without the two runs
    ours, theirs = pd.read_csv(exp / "correlations.csv"), pd.read_csv(removed.out_dir / "correlations.csv")
    pd.testing.assert_frame_equal(ours, theirs)


def test_runs_without_an_endpoint_record_are_reported_as_before(tmp_path):
    """The rule reads only the record: the same study without it (as every committed run.json) uses every
    run, and a record without a tolerance judges nothing."""
    plain = write_experiment(tmp_path, "plain")
    summary = write_report([plain], plain, n_boot=200, echo=lambda m: None)
    assert summary.n_included == 8 and not summary.excluded
    untouched = write_experiment(tmp_path, "untouched")
    for run in (untouched / "runs").iterdir():
        info = json.loads((run / "run.json").read_text())
        info["endpoint"] = {"target": 0.01, "final": 0.0001}
        (run / "run.json").write_text(json.dumps(info))
    again = write_report([untouched], untouched, n_boot=200, echo=lambda m: None)
    assert again.n_included == 8
    pd.testing.assert_frame_equal(pd.read_csv(plain / "correlations.csv"), pd.read_csv(untouched / "correlations.csv"))
