"""The committed reproductions (results/cpu/) cannot silently drift from the code: the report rebuilt from a
committed study's run files gives the same table and correlations as the committed ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted(p.parent for p in (ROOT / "results" / "cpu").glob("*/correlations.csv"))


def test_reproductions_are_committed():
    names = {p.name for p in STUDIES}
    assert {"tsuzuku_mnist", "tsuzuku_cifar10", "ibayashi_mnist", "yi_mnist", "hyperparameters"} <= names, names


def _assert_frames_equal(ours: pd.DataFrame, committed: pd.DataFrame, what: str) -> None:
    assert list(ours.columns) == list(committed.columns), what
    assert len(ours) == len(committed), what
    for col in committed.columns:
        a, b = ours[col], committed[col]
        if pd.api.types.is_numeric_dtype(b) and pd.api.types.is_numeric_dtype(a):
            np.testing.assert_allclose(a.to_numpy(float), b.to_numpy(float), rtol=1e-9, atol=1e-12,
                                       equal_nan=True, err_msg=f"{what}: column {col}")
        else:
            assert a.astype(str).tolist() == b.astype(str).tolist(), f"{what}: column {col}"


@pytest.mark.parametrize("name", ["yi_mnist"])
def test_report_rebuilt_from_a_committed_study_is_the_committed_report(name, tmp_path):
    """Rebuild one committed study's report (the smallest: this runs in the suite) from its run.json and
    measures.json files and compare every number."""
    from flatbench.study.report import report_study

    exp = ROOT / "results" / "cpu" / name
    copy = tmp_path / name
    shutil.copytree(exp, copy, ignore=shutil.ignore_patterns("*.png", "*.html", "*.md", "*.csv", "*.log"))
    report_study([copy], echo=lambda _line: None, quiet=True)
    for csv in ("table.csv", "correlations.csv", "comparisons.csv"):
        committed = pd.read_csv(exp / csv)
        ours = pd.read_csv(copy / csv)
        _assert_frames_equal(ours, committed, f"{name}/{csv}")
