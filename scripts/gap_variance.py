"""How much of a study's generalization gap each swept axis explains: the check behind "the random-label
studies vary only label noise".

    python scripts/gap_variance.py results/cpu/hyperparameters [results/cpu/yi_mnist ...] [--gap acc]

For every study (its committed table.csv; the runs the report uses: finished, train accuracy at least the
report's 0.9) it prints the share of the gap's total sum of squares that lies between the cells of each
hyperparameter axis alone (one-way), between the cells of every hyperparameter together (the design's
cells) and within the cells (what is left to the seed: replicates). A share of 0.97 for the ratio means that
a measure that only grows with the fraction of random labels can reach a high τ without ordering any two
runs that share their ratio; the per-axis ψ and the sign errors of the report are the statistics that look
inside those cells.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbench.analysis.stats import design_of, gap_column  # noqa: E402
from flatbench.analysis.table import sweep_axes  # noqa: E402
from flatbench.store import read_json  # noqa: E402


def between_share(gap: pd.Series, keys: pd.DataFrame) -> float:
    """Between-group sum of squares over the total, for the groups of equal `keys` rows."""
    total = float(((gap - gap.mean()) ** 2).sum())
    if total == 0:
        return float("nan")
    groups = gap.groupby([keys[c] for c in keys.columns]) if len(keys.columns) else [(0, gap)]
    between = sum(len(g) * (g.mean() - gap.mean()) ** 2 for _, g in groups)
    return float(between) / total


def study_gap(exp: Path) -> str:
    """The gap a study's report correlates with: its study.yaml's report.gap (acc where it has none)."""
    import yaml

    study = exp / "study.yaml"
    raw = (yaml.safe_load(study.read_text()) or {}) if study.is_file() else {}
    report = raw.get("report") or (raw.get("config") or {}).get("report") or {}
    return str(report.get("gap", "acc"))


def shares(exp: Path, gap: str) -> tuple[int, list[tuple[str, float]]]:
    table = pd.read_csv(exp / "table.csv")
    table = table[(table["status"] == "finished") & (table["train_acc"] >= 0.9)].reset_index(drop=True)
    study = exp / "study.yaml"
    axes = sweep_axes(table)
    if study.is_file():
        import yaml

        listed = (yaml.safe_load(study.read_text()) or {}).get("sweep_axes")
        if listed:
            axes = [a for a in listed if a in table.columns]
    if not axes:  # study.yaml keeps the raw config: take every run.json's sweep_axes
        runs = sorted((exp / "runs").glob("*/run.json"))
        if runs:
            axes = [a for a in read_json(runs[0]).get("sweep_axes", []) if a in table.columns]
    design = design_of(table, axes)
    codes = design.codes
    y = table[gap_column(gap)].astype(float)
    rows = [(f"{a} alone", between_share(y, codes[[a]])) for a in design.axes]
    rows.append(("all hyperparameters (the cells)", between_share(y, codes[design.axes])))
    rows.append(("within cells (seed replicates)", 1.0 - rows[-1][1]))
    rows.append(("all hyperparameters, net of replicate noise (ω²)", net_share(y, codes[design.axes])))
    return len(table), rows


def net_share(gap: pd.Series, keys: pd.DataFrame) -> float:
    """The cells' share of the gap's variance net of replicate noise, ω² = (SS_between − (C − 1)·MS_within)
    / (SS_total + MS_within): the between-cell sum of squares holds (C − 1)·σ² of replicate noise even when
    the configurations do not differ, so the plain share overstates what the hyperparameters move. 0 when
    the cells differ by no more than noise; nan without replicates."""
    total = float(((gap - gap.mean()) ** 2).sum())
    groups = list(gap.groupby([keys[c] for c in keys.columns])) if len(keys.columns) else [(0, gap)]
    n, c = len(gap), len(groups)
    within = sum(float(((g - g.mean()) ** 2).sum()) for _, g in groups)
    if n <= c or total == 0:
        return float("nan")
    ms_within = within / (n - c)
    between = total - within
    return max(0.0, (between - (c - 1) * ms_within) / (total + ms_within))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiments", nargs="+")
    p.add_argument("--gap", default=None, choices=["acc", "loss"],
                   help="the gap (default: the study's report.gap, from its study.yaml)")
    args = p.parse_args()
    for exp in map(Path, args.experiments):
        gap = args.gap or study_gap(exp)
        n, rows = shares(exp, gap)
        print(f"{exp.name} ({n} runs): share of the variance of gap_{gap}")
        for what, share in rows:
            print(f"  {what:45s} {share:.4f}")


if __name__ == "__main__":
    main()
