"""The tables of an invariance audit (`flatbench.study.audit`): the median relative change of each measure
under each family of function-preserving transformations, which declared invariances it breaks, and the
correlations with the gap before and after random transformations of every run (the population audit:
several draws per factor range; `normalize_correlations` also reads the files of the old single-draw
audit)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from flatbench.analysis.table import to_float

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


DELTA_TOL = 1e-12
"""A declared-invariant measure whose τ moves by more than this under a draw is flagged."""

OLD_FORMAT = "single draw (old audit)"


def normalize_correlations(corr: pd.DataFrame) -> pd.DataFrame:
    """An audit_correlations.csv in the current format (one row per measure and factor range, the
    distribution of Δτ over the draws). A file of the old audit (one transformation per run, columns
    `tau_transformed, delta, p_transformed`, no factor range recorded) becomes one row per measure with
    `n_draws = 1`, `max_factor` NaN and `audit_format` = OLD_FORMAT; a current file gets `audit_format`
    'draws'."""
    frame = corr.copy()
    if "max_factor" in frame.columns:
        frame["audit_format"] = "draws"
        return frame
    tau = frame["tau_transformed"].astype(float)
    delta = frame["delta"].astype(float)
    frame["max_factor"] = np.nan
    frame["n_draws"] = 1
    frame["n_draws_ok"] = np.isfinite(tau).astype(int)
    frame["tau_mean"] = tau
    frame["tau_draw_0"] = tau
    for column in ("delta_mean", "delta_min", "delta_max"):
        frame[column] = delta
    frame["delta_absmax"] = delta.abs()
    frame["p_transformed_max"] = frame.get("p_transformed", np.nan)
    orig = frame["tau_original"].astype(float)
    frame["status"] = np.where(~np.isfinite(orig), "no_original",
                               np.where(~np.isfinite(tau), "no_transformed", "ok"))
    frame["note"] = ""
    frame["audit_format"] = OLD_FORMAT
    return frame


def draw_columns(corr: pd.DataFrame) -> list[str]:
    """The per-draw τ columns (tau_draw_0, tau_draw_1, ...) in draw order."""
    cols = [c for c in corr.columns if c.startswith("tau_draw_") and c[len("tau_draw_"):].isdigit()]
    return sorted(cols, key=lambda c: int(c[len("tau_draw_"):]))


def factor_ranges(frame: pd.DataFrame) -> list[float]:
    """The distinct factor ranges of an audit, mild first, "not recorded" (NaN) once and last (NaN is not
    equal to itself, so a plain set or dict would keep one NaN per row)."""
    values = [float(v) for v in frame["max_factor"].astype(float)]
    finite = sorted({v for v in values if not math.isnan(v)})
    return finite + ([math.nan] if any(math.isnan(v) for v in values) else [])


def range_label(max_factor: float) -> str:
    return "F n/a" if not math.isfinite(float(max_factor)) else f"F={float(max_factor):g}"


def invariance_breaks(corr: pd.DataFrame) -> list[tuple[str, float, float]]:
    """(measure, max_factor, largest |Δτ|) of each declared-invariant measure whose τ moved in a draw."""
    return [(str(r["measure"]), float(r["max_factor"]), float(r["delta_absmax"]))
            for r in normalize_correlations(corr).to_dict(orient="records") if verdict_of(r) == "breaks"]


def verdict_of(row: dict) -> str:
    """holds | breaks | moves | unchanged | n/a: the declared invariance against the measured Δτ
    (the population audit's one rule, |Δτ| ≤ `DELTA_TOL`; the report and the printed table both use it)."""
    d = to_float(row.get("delta_absmax"))
    declared = str(row.get("declared_invariant")) in ("True", "true", "1")
    if not math.isfinite(d):
        return "n/a"
    if declared:
        return "holds" if d <= DELTA_TOL else "breaks"
    return "unchanged" if d <= DELTA_TOL else "moves"


def _fmt(v: float) -> str:
    return "n/a" if not math.isfinite(float(v)) else f"{float(v):+.3f}"


def runs_per_range(counts: list[int]) -> str:
    """The runs with a value in each factor range: one number where the ranges agree, else one per range
    ("24 / 1": every run at F = 2, one at F = 100), so that a range that lost runs is not read as the
    other's n."""
    return str(counts[0]) if len(set(counts)) <= 1 else " / ".join(map(str, counts))


def format_correlations(corr: pd.DataFrame, gap: str, family: str) -> str:
    """The printed summary: per measure, τ_original and, for each factor range, the mean Δτ over the
    draws with its [min, max]; n/a where no transformed value exists (never 0)."""
    frame = normalize_correlations(corr)
    old = (frame["audit_format"] == OLD_FORMAT).any()
    factors = factor_ranges(frame)
    draws = int(frame["n_draws"].max()) if len(frame) else 0
    width = max([len("measure")] + [len(str(m)) for m in frame["measure"]])
    cell = 26
    flagged = {(m, f) for m, f, _ in invariance_breaks(frame)}
    rows = []  # (measure, n, τ original, the range cells, the median relative changes, mark)
    for measure in dict.fromkeys(frame["measure"]):
        part = frame[frame["measure"] == measure]
        by_f = {float(r["max_factor"]): r for r in part.to_dict(orient="records")}
        first = part.iloc[0]
        cells, rels, counts = [], [], []
        mark = "*" if bool(first["declared_invariant"]) else " "
        for f in factors:
            r = by_f.get(f) if not math.isnan(f) else part.iloc[0].to_dict()
            counts.append(int(r["n"]) if r is not None else 0)
            if r is None or not math.isfinite(float(r["delta_mean"])):
                status = "n/a" if r is None else f"n/a ({r['status']})"
                cells.append(f"{status:>{cell}}")
            else:
                text = f"{_fmt(r['delta_mean'])} [{_fmt(r['delta_min'])}, {_fmt(r['delta_max'])}]"
                if int(r["n_draws_ok"]) < int(r["n_draws"]):
                    text += f" ({int(r['n_draws_ok'])}/{int(r['n_draws'])})"
                cells.append(f"{text:>{cell}}")
            if r is not None and (measure, f) in flagged:
                mark = "!"
            rel = float(r["median_rel_change"]) if r is not None else float("nan")
            rels.append("n/a" if not math.isfinite(rel) else f"{rel:.1e}")
        rows.append((measure, runs_per_range(counts), _fmt(first["tau_original"]), cells, rels, mark))
    nw = max([3] + [len(row[1]) for row in rows])
    head = (f"{'measure':{width}}  {'n':>{nw}}  {'τ original':>10}  "
            + "  ".join(f"{'Δτ ' + range_label(f) + ' mean [min, max]':>{cell}}" for f in factors)
            + "  median rel. change (per range)")
    what = (f"one {family} transformation per run ({OLD_FORMAT})" if old else
            f"{draws} {family} transformation(s) per run for each factor range "
            + ", ".join(f"[1/{f:g}, {f:g}]" for f in factors))
    lines = [f"Kendall τ with the {gap} gap, before and after {what}", head, "-" * len(head)]
    lines += [f"{measure:{width}}  {n:>{nw}}  {tau:>10}  " + "  ".join(cells) + f"  {' / '.join(rels)}{mark}"
              for measure, n, tau, cells, rels, mark in rows]
    lines.append(f"* declared invariant to {family}; ! declared invariant but τ moved by more than "
                 f"{DELTA_TOL:g} under some draw; n/a: no τ (status no_original, no_transformed), never "
                 "shown as 0; n: the runs with a value, per range where the ranges differ")
    return "\n".join(lines)
