"""scripts/results_tables.py, the generator of docs/results' tables: what a row says is what the files hold.
The audit table's n per factor range where the ranges differ (a range that lost runs is not read as the
other's n), and the published/exact ratio's median a true median (the mean of the two middle ratios)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pandas as pd
from project_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _audit_row(measure: str, factor: float, n: int, delta: float | None, status: str = "ok", note: str = "") -> dict:
    ok = delta is not None
    return dict(measure=measure, family="node", max_factor=factor, n_draws=3, n_draws_ok=3 if ok else 0, n=n,
                tau_original=0.5, p_original=0.01, tau_mean=0.5 + delta if ok else math.nan,
                delta_mean=delta if ok else math.nan, delta_min=delta if ok else math.nan,
                delta_max=delta if ok else math.nan, delta_absmax=abs(delta) if ok else math.nan,
                median_rel_change=0.1 if ok else math.nan, declared_invariant=False, status=status, note=note)


def test_the_audit_table_gives_n_per_range_where_the_ranges_differ(tmp_path):
    rows = [_audit_row("a", 2.0, 24, -0.1), _audit_row("a", 100.0, 1, None, "no_transformed", "error on 63 of 72 copies"),
            _audit_row("b", 2.0, 24, 0.0), _audit_row("b", 100.0, 24, 0.05)]
    pd.DataFrame(rows).to_csv(tmp_path / "audit_correlations.csv", index=False)
    table = load_script("results_tables").audit(tmp_path)
    line = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[1:-1]] for r in table.splitlines()
            if r.startswith("| `")}
    assert line["`a`"][1] == "24 / 1" and "error on 63 of 72 copies" in line["`a`"][4], line
    assert line["`b`"][1] == "24", line
    assert "per range (F = 2 / F = 100) where they differ" in table


def test_the_solver_table_median_is_the_median_of_the_committed_ratios():
    """On a committed study (an even number of runs): the printed median is statistics.median of the
    published/exact ratios read straight from every run's measures.json."""
    exp = ROOT / "results" / "cpu" / "tsuzuku_mnist"
    ratios = []
    for path in sorted((exp / "runs").glob("*/measures.json")):
        entries = json.loads(path.read_text())
        exact, published = entries.get("normalized_sharpness", {}), entries.get("normalized_sharpness:published", {})
        if exact.get("status") == published.get("status") == "ok":
            ratios.append(published["values"]["normalized_sharpness:published"] / exact["values"]["normalized_sharpness"])
    assert len(ratios) % 2 == 0 and len(ratios) >= 2
    row = next(r for r in load_script("results_tables").solvers(exp).splitlines() if r.startswith("| `normalized_sharpness` "))
    assert row.split("|")[4].strip() == f"{statistics.median(ratios):.3g}"


def test_the_printed_audit_gives_n_per_range_where_the_ranges_differ():
    """`flatbench audit --population`'s printed table (audit.log) says n the same way as the docs table."""
    from flatbench.analysis.audit_tables import format_correlations

    rows = [_audit_row("a", 2.0, 24, -0.1), _audit_row("a", 100.0, 0, None, "no_transformed"),
            _audit_row("b", 2.0, 24, 0.0), _audit_row("b", 100.0, 24, 0.05)]
    text = format_correlations(pd.DataFrame(rows), "acc", "node")
    cells = {line.split()[0]: " ".join(line.split("  +")[0].split()[1:]) for line in text.splitlines()
             if line.startswith(("a ", "b "))}
    assert cells == {"a": "24 / 0", "b": "24"}, text
