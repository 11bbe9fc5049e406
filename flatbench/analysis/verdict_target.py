"""The three things the verdict's headline must name before any ranking: its target, its blocking, its
baseline (issue 42).

Why. A referee recomputing the natural study found the headline ranked measures on the loss gap while the
text read like the accuracy gap; that 58% of the accuracy gap's variance was a per-draw offset shared by
every configuration of a draw (so a pooled τ partly scored that offset); and that a lookup of the
configurations' gaps beat the best measure. So the headline says which gap is the target (`target_text`),
that τ compares runs within a data draw and how large the draw offset is (`blocking_text`, from
`stats.anova`), and how the measures stand against `ref.hyperparameters` (`baseline_text`, the rule of
`stats.baselines`).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from flatbench.analysis.fmt import ci_text, num
from flatbench.analysis.stats.baselines import HYPERPARAMETERS
from flatbench.analysis.table import to_float


def target_text(gap: str) -> str:
    if gap == "acc":
        return "the accuracy gap (train accuracy − test accuracy)"
    if gap == "calibrated":
        return ("the temperature-calibrated loss gap (test − train cross-entropy of the logits divided by the "
                "temperature that minimizes the test cross-entropy, cross-fitted on the test set's halves)")
    return "the loss gap (test cross-entropy − train cross-entropy)"


def n_draws(analysis: Any) -> int:
    design = getattr(analysis, "design", None)
    return design.n_draws if design is not None else 1


def tau_name(analysis: Any) -> str:
    """What the headline τ is called: "τ within draws" when the study has several draws, else "τ"."""
    return "τ within draws" if n_draws(analysis) > 1 else "τ"


def variance_text(variance: pd.DataFrame) -> str:
    """"the draw's main effect is 0.9% of the variance; the configurations' partial ω² 0.88 (F 39.8, df 107,
    428)" from variance.csv's rows."""
    if variance is None or not len(variance):
        return ""
    rows = variance.set_index("effect")
    parts = []
    if "draw" in rows.index and to_float(rows.at["draw", "df"]) > 0:
        parts.append(f"the draw's main effect is {100 * to_float(rows.at['draw', 'share']):.1f}% of the gap's variance")
    if "cell" in rows.index and math.isfinite(to_float(rows.at["cell", "F"])):
        block = " with draws as a block" if parts else ""
        parts.append(f"the configurations' partial ω²{block} is {num(rows.at['cell', 'partial_omega2'])} (F "
                     f"{to_float(rows.at['cell', 'F']):.2f}, df {int(rows.at['cell', 'df'])}, "
                     f"{int(rows.at['residual', 'df'])})")
    return "; ".join(parts)


def blocking_text(analysis: Any) -> str:
    d = n_draws(analysis)
    decomposition = variance_text(getattr(analysis, "variance", None))
    tail = f" (gap ~ draw + configuration: {decomposition}; variance.csv)" if decomposition else ""
    if d <= 1:
        return f"**Blocking:** one data draw, so τ compares every pair of runs{tail}."
    return (f"**Blocking:** τ compares runs within each of the {d} data draws (pairs of one draw, pooled over "
            f"the draws), because every configuration of a draw shares that draw's offset of the gap{tail}; the "
            "pooled τ over all pairs is the second τ column.")


def baseline_text(analysis: Any, rows: list[dict[str, Any]]) -> str:
    """The baseline's τ and how many measures beat it (`stats.baselines`: the interval of τ − τ_baseline
    above 0)."""
    refs = getattr(analysis, "references", None)
    if refs is None or not len(refs) or HYPERPARAMETERS not in set(refs["measure"]):
        return ""
    base = refs[refs["measure"] == HYPERPARAMETERS].iloc[0].to_dict()
    if not math.isfinite(to_float(base.get("kendall_tau"))):
        return f"**Baseline:** `{HYPERPARAMETERS}` has no τ here ({str(base.get('note') or '').split('; ')[0]})."
    how = "in the other data draws" if n_draws(analysis) > 1 else "over its other runs (one data draw)"
    beats = [r["measure"] for r in rows if bool(r.get("beats_hyperparameters"))]
    above = [r["measure"] for r in rows if to_float(r.get("vs_hyperparameters")) > 0 and r["measure"] not in beats]
    named = f" ({', '.join(f'`{m}`' for m in beats)})" if beats else ""
    more = f"; {len(above)} more above it within noise" if above else ""
    return (f"**Baseline:** `{HYPERPARAMETERS}` (each run's configuration's mean gap {how}) scores "
            f"{tau_name(analysis)} {ci_text(base, 'kendall_tau')}; {len(beats)} of {len(rows)} measures beat it "
            f"(95% interval of τ − τ_baseline above 0){named}{more}.")


def beats_cell(stats: dict[str, Any]) -> str:
    """"beats +0.12" / "no −0.05": the label and Δτ against ref.hyperparameters ("" without a comparison); its
    interval is in correlations.csv (`vs_hyperparameters_lo`, `_hi`), kept out of the cell so that the verdict
    table fits a 1440 px screen."""
    diff = to_float(stats.get("vs_hyperparameters"))
    if not math.isfinite(diff):
        return ""
    return f"{'beats' if bool(stats.get('beats_hyperparameters')) else 'no'} {'+' if diff >= 0 else ''}{num(diff)}"
