"""The tables of an invariance audit (`flatbench.study.audit`): the median relative change of each measure
under each family of function-preserving transformations, which declared invariances it breaks, and the
correlations with the gap before and after a transformation of every run."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

INVARIANCE_RTOL = 1e-4
"""A declared-invariant measure whose median relative change exceeds this is flagged."""


@dataclass
class Summary:
    median: pd.DataFrame
    """measure × family median relative change (NaN where not computed)."""
    declared: pd.DataFrame
    """measure × family: declared invariant (bool)."""
    violations: list[tuple[str, str, float]]


def summarize(frame: pd.DataFrame, measures: list[str], families: list[str],
              declared_invariant: Callable[[str, str], bool]) -> Summary:
    """The median relative change per measure and family, and the declared invariances it breaks
    (`declared_invariant(result key, family)`)."""
    median = pd.DataFrame(np.nan, index=measures, columns=families, dtype=float)
    declared = pd.DataFrame(False, index=measures, columns=families)
    for m in measures:
        for f in families:
            declared.loc[m, f] = declared_invariant(m, f)
    if len(frame):
        ok = frame[frame["status"] == "ok"]
        for (m, f), group in ok.groupby(["measure", "family"]):
            if m in median.index and f in median.columns:
                median.loc[m, f] = float(np.median(group["rel_change"].to_numpy(dtype=float)))
    violations = [(m, f, float(median.loc[m, f])) for m in measures for f in families
                  if declared.loc[m, f] and not math.isnan(median.loc[m, f])
                  and not median.loc[m, f] < INVARIANCE_RTOL]
    return Summary(median, declared, violations)


def format_summary(summary: Summary) -> str:
    med, dec = summary.median, summary.declared
    width = max([len("measure")] + [len(m) for m in med.index])
    head = f"{'measure':{width}}  " + "  ".join(f"{f:>12}" for f in med.columns)
    lines = [head, "-" * len(head)]
    flagged = {(m, f) for m, f, _ in summary.violations}
    for m in med.index:
        cells = []
        for f in med.columns:
            v = med.loc[m, f]
            text = "n/a" if math.isnan(v) else f"{v:.1e}"
            mark = "*" if dec.loc[m, f] else " "
            if (m, f) in flagged:
                mark = "!"
            cells.append(f"{text:>11}{mark}")
        lines.append(f"{m:{width}}  " + "  ".join(cells))
    lines.append("median relative change; * declared invariant; ! declared invariant but changed by "
                 f"≥ {INVARIANCE_RTOL:g}")
    if summary.violations:
        lines.append(f"{len(summary.violations)} declared invariance(s) not met: "
                     + ", ".join(f"{m} under {f} ({v:.1e})" for m, f, v in summary.violations))
    return "\n".join(lines)


def format_correlations(corr: pd.DataFrame, gap: str, family: str) -> str:
    width = max([len("measure")] + [len(m) for m in corr["measure"]])
    head = (f"{'measure':{width}}  {'n':>3}  {'τ original':>11}  {'τ ' + family:>11}  {'Δτ':>7}  "
            "median rel. change")
    lines = [f"Kendall τ with the {gap} gap, before and after one {family} transformation per run", head,
             "-" * len(head)]
    def fmt(v: float) -> str:
        return "n/a" if not math.isfinite(v) else f"{v:+.3f}"

    for _, r in corr.iterrows():
        mark = "*" if r["declared_invariant"] else " "
        rel = r["median_rel_change"]
        lines.append(f"{r['measure']:{width}}  {r['n']:>3}  {fmt(r['tau_original']):>11}  "
                     f"{fmt(r['tau_transformed']):>11}  {fmt(r['delta']):>7}  "
                     f"{'n/a' if not math.isfinite(rel) else f'{rel:.1e}'}{mark}")
    lines.append(f"* declared invariant to {family}")
    return "\n".join(lines)
