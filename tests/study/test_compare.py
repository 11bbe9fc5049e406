"""`flatbench compare`: several studies' reports side by side, from their correlations.csv."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from click.testing import CliRunner

from flatbench.analysis.report import write_report
from flatbench.cli import cli
from tests.analysis.test_report import write_experiment


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    root = tmp_path_factory.mktemp("studies")
    a = write_experiment(root, "small", seed=1)
    b = write_experiment(root, "other", seed=2)
    for exp in (a, b):
        write_report([exp], exp, n_boot=50, echo=lambda _: None)
    corr = pd.read_csv(b / "correlations.csv")
    corr[corr["measure"] != "noise"].to_csv(b / "correlations.csv", index=False)  # `other` never measured noise
    return root, a, b


def test_compare_writes_csv_png_html(studies):
    root, a, b = studies
    out = root / "cmp"
    result = CliRunner().invoke(cli, ["compare", str(a), str(b), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "compared 2 studies" in result.output
    frame = pd.read_csv(out / "comparison.csv")
    assert frame["measure"].is_unique and "noise" in set(frame["measure"])
    for study in ("small", "other"):
        for col in ("tau", "tau_lo", "tau_hi", "p", "n", "best_group"):
            assert f"{study}:{col}" in frame.columns
    by = frame.set_index("measure")
    own = pd.read_csv(a / "correlations.csv").set_index("measure")
    assert by.loc["tracks", "small:tau"] == pytest.approx(own.loc["tracks", "kendall_tau"])  # the study's number
    assert by.loc["noise", "other:best_group"] == "not measured" and math.isnan(by.loc["noise", "other:tau"])
    assert by.loc["tracks", "small:best_group"] in ("highest τ (cannot compare)", "cannot compare")  # 8 runs
    assert (out / "plots" / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    html = (out / "comparison.html").read_text()
    assert "data:image/png;base64," in html and "http://" not in html and "https://" not in html
    assert 'href="../small/report.html"' in html and 'href="comparison.csv"' in html


def test_compare_needs_reports(tmp_path):
    exp = write_experiment(tmp_path, "unreported")
    result = CliRunner().invoke(cli, ["compare", str(exp), "--out", str(tmp_path / "c")])
    assert result.exit_code != 0
    assert "run `flatbench report" in (result.output + str(result.exception))
