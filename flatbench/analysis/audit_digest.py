"""The rescaling audits of a study, as the report shows them.

`flatbench audit EXPERIMENT --population` writes `audit_correlations.csv` into the experiment folder or
into `--out` (the committed studies keep later audits in subfolders such as `audit_draws/`). The report
reads every such file in the folder and its direct subfolders and says, per measure and transformation
family: τ before and after, Δτ (mean and range over the draws), the number of runs, and whether a
measure declared invariant holds its invariance (|Δτ| ≤ `DELTA_TOL` in every draw). A measure with no
transformed value is "n/a" with the audit's status, never Δτ = 0.

Where several audits cover one measure and family, the measured invariance in the verdict table comes
from the audits with several draws (the current format) and falls back to a single-draw audit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from flatbench.analysis.audit_tables import DELTA_TOL, OLD_FORMAT, normalize_correlations, verdict_of
from flatbench.analysis.table import to_float

AUDIT_CSV = "audit_correlations.csv"


@dataclass
class Audit:
    """One audit_correlations.csv: where it is (relative to the experiment folder), normalized rows."""

    where: str
    frame: pd.DataFrame

    @property
    def old(self) -> bool:
        return bool((self.frame["audit_format"] == OLD_FORMAT).any())

    @property
    def families(self) -> list[str]:
        return sorted(set(self.frame["family"].astype(str)))

    def describe(self) -> str:
        """"node rescaling, 3 draws per run in [1/2, 2] and [1/100, 100]"."""
        fams = ", ".join(self.families)
        if self.old:
            return f"{fams} rescaling, one draw per run (single-draw audit, factor range not recorded)"
        ranges = sorted({float(f) for f in self.frame["max_factor"] if math.isfinite(to_float(f))})
        draws = int(self.frame["n_draws"].max()) if len(self.frame) else 0
        return (f"{fams} rescaling, {draws} draw(s) per run in "
                + " and ".join(f"[1/{f:g}, {f:g}]" for f in ranges))


def find_audits(exp_dirs: list[Path]) -> list[Audit]:
    """Every readable audit_correlations.csv in the folders and their direct subfolders (not runs/)."""
    out = []
    for exp in exp_dirs:
        paths = [exp / AUDIT_CSV, *sorted(p / AUDIT_CSV for p in exp.iterdir() if p.is_dir() and p.name != "runs"
                                                      and not p.name.startswith("."))]
        for path in paths:
            if not path.is_file():
                continue
            try:
                frame = normalize_correlations(pd.read_csv(path))
            except (OSError, ValueError, KeyError, pd.errors.ParserError):
                continue  # an unreadable audit file is left out of the report, never guessed at
            where = path.relative_to(exp).as_posix() if len(exp_dirs) == 1 else f"{exp.name}/{path.relative_to(exp)}"
            out.append(Audit(where, frame))
    return out


def delta_text(row: dict) -> str:
    """"+0.012 [−0.004, +0.030]" (mean over the draws, range), or n/a with the reason."""
    mean = to_float(row.get("delta_mean"))
    if not math.isfinite(mean):
        status = str(row.get("status") or "")
        reason = {"no_transformed": "no transformed value", "no_original": "no untransformed τ"}.get(status, status)
        return f"n/a ({reason})" if reason else "n/a"
    lo, hi = to_float(row.get("delta_min")), to_float(row.get("delta_max"))
    if int(to_float(row.get("n_draws")) or 1) > 1 and math.isfinite(lo) and math.isfinite(hi):
        return f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    return f"{mean:+.3f}"


@dataclass
class Measured:
    """The measured invariance of one measure under one family: the largest |Δτ| over the draws and
    ranges of the audits chosen, their verdict, and the runs per draw."""

    family: str
    absmax: float
    verdict: str
    n: int
    where: str


def measured_invariance(audits: list[Audit]) -> dict[str, list[Measured]]:
    """measure → one `Measured` per audited family (multi-draw audits first, see the module doc)."""
    best: dict[tuple[str, str], tuple[bool, list[dict], str]] = {}
    for audit in audits:
        for (measure, family), part in audit.frame.groupby(["measure", "family"], sort=False):
            key = (str(measure), str(family))
            rows = part.to_dict(orient="records")
            have = best.get(key)
            if have is None or (have[0] and not audit.old):
                best[key] = (audit.old, rows, audit.where)
            elif have[0] == audit.old:
                best[key] = (audit.old, have[1] + rows, have[2] + ", " + audit.where)
    out: dict[str, list[Measured]] = {}
    for (measure, family), (_, rows, where) in best.items():
        values = [to_float(r.get("delta_absmax")) for r in rows]
        finite = [v for v in values if math.isfinite(v)]
        worst = max(finite) if finite else math.nan
        verdicts = {verdict_of(r) for r in rows}
        verdict = next((v for v in ("breaks", "moves", "holds", "unchanged") if v in verdicts), "n/a")
        n = min(int(to_float(r.get("n")) or 0) for r in rows)
        out.setdefault(measure, []).append(Measured(family, worst, verdict, n, where))
    return out


def measured_text(items: list[Measured] | None) -> str:
    """The verdict table's cell: "node: holds", "node: moves 0.088" (the largest |Δτ|), or "not audited"."""
    if not items:
        return "not audited"
    parts = []
    for m in sorted(items, key=lambda m: m.family):
        size = "n/a" if not math.isfinite(m.absmax) else f"{m.absmax:.2g}" if m.absmax > DELTA_TOL else "0"
        parts.append(f"{m.family}: {m.verdict}" + (f" {size}" if m.verdict in ("moves", "breaks") else ""))
    return "; ".join(parts)
