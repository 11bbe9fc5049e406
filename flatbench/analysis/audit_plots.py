"""The population audit's figure (`flatbench audit EXPERIMENT --population`, `audit_correlations.png`).

One row per measure, τ on a horizontal axis: the untransformed τ (black diamond) and, for each factor
range, one marker per draw (the τ of the population of that draw's transformed copies) on a thin band
from the smallest to the largest. The ranges are told apart by marker shape as well as colour (so the
figure reads in black and white); a measure that declares itself invariant to the family sits on a grey
band and carries a `*`. A range (or the untransformed τ) with no value is written "n/a" next to the row,
never drawn at 0. The other audit figure (the run audit's heatmap) is `plots.audit_heatmap_figure`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from flatbench.analysis.audit_tables import (
    OLD_FORMAT,
    draw_columns,
    factor_ranges,
    normalize_correlations,
    range_label,
)
from flatbench.analysis.plots import png_bytes

RANGE_STYLES = (("#2166ac", "o"), ("#d6604d", "^"), ("#1b7837", "s"), ("#762a83", "D"))
"""(colour, marker) of the first, second, ... factor range (mild first when sorted)."""


def audit_correlations_figure(corr: pd.DataFrame, gap: str, family: str) -> bytes:
    """Per measure: τ_original and every draw's τ_transformed for each factor range (old single-draw
    audit files are drawn as one range)."""
    frame = normalize_correlations(corr)
    measures = list(dict.fromkeys(frame["measure"].astype(str)))
    factors = factor_ranges(frame)
    draws = draw_columns(frame)
    n = len(measures)
    k = max(len(factors), 1)
    fig = Figure(figsize=(8.4, 1.6 + 0.22 * max(n, 1) * max(1.0, 0.6 * k)), layout="constrained")
    ax = fig.add_subplot()
    band = 0.8 / k
    for i, measure in enumerate(measures):
        part = frame[frame["measure"].astype(str) == measure]
        declared = bool(part["declared_invariant"].iloc[0])
        if declared:
            ax.axhspan(i - 0.5, i + 0.5, color="#e6e6e6", zorder=0, linewidth=0)
        tau0 = float(part["tau_original"].iloc[0])
        if math.isfinite(tau0):
            ax.plot([tau0], [i], marker="D", color="black", markersize=5, linestyle="none", zorder=4)
        else:
            ax.annotate("n/a: no untransformed τ", (1.0, i), xycoords=("axes fraction", "data"),
                        xytext=(4, 0), textcoords="offset points", ha="left", va="center", fontsize=6.5,
                        color="#4d4d4d", annotation_clip=False)
            continue
        for j, factor in enumerate(factors):
            colour, marker = RANGE_STYLES[j % len(RANGE_STYLES)]
            y = i + (j - (k - 1) / 2) * band
            rows = part[part["max_factor"].astype(float).isin([factor])] if not math.isnan(factor) \
                else part[part["max_factor"].isna()]
            values = rows[draws].to_numpy(dtype=float).ravel() if len(rows) else np.array([])
            values = values[np.isfinite(values)]
            if not values.size:
                status = str(rows["status"].iloc[0]) if len(rows) else "not audited"
                status = {"no_transformed": "no transformed value", "no_original": "no untransformed τ"}.get(status,
                                                                                                              status)
                where = "" if math.isnan(factor) else f"{range_label(factor)}: "
                ax.annotate(f"n/a ({where}{status})", (1.0, y),
                            xycoords=("axes fraction", "data"), xytext=(4, 0), textcoords="offset points",
                            ha="left", va="center", fontsize=6.5, color=colour, annotation_clip=False)
                continue
            lo, hi = float(min(values.min(), tau0)), float(max(values.max(), tau0))
            ax.plot([lo, hi], [y, y], color=colour, linewidth=0.8, alpha=0.6, zorder=2)
            ax.plot(values, np.full(values.size, y), marker=marker, color=colour, markeredgecolor="black",
                    markeredgewidth=0.5, markersize=4.5, linestyle="none", alpha=0.85, zorder=3)
    labels = [f"{m} *" if bool(frame[frame["measure"].astype(str) == m]["declared_invariant"].iloc[0]) else m
              for m in measures]
    ax.set_yticks(range(n), labels, fontsize=7.5)
    ax.set_ylim(n - 0.5, -0.5)
    ax.axvline(0, color="black", linewidth=0.6, zorder=1)
    ax.set_xlim(-1.05, 1.05)
    ax.grid(axis="x", color="#cccccc", linewidth=0.5)
    ax.tick_params(axis="x", labelsize=7.5)
    old = (frame["audit_format"] == OLD_FORMAT).any()
    n_draws = int(frame["n_draws"].max()) if len(frame) else 0
    ax.set_xlabel(f"Kendall τ with the {gap} gap", fontsize=8)
    ax.set_title(f"τ before and after {family} rescaling: "
                 + ("one draw per run (old audit)" if old else f"{n_draws} draw(s) per run and factor range")
                 + f"\n* and grey band: declared invariant to {family}", fontsize=8)
    handles = [Line2D([], [], marker="D", color="black", linestyle="none", markersize=5, label="τ original")]
    for j, factor in enumerate(factors):
        colour, marker = RANGE_STYLES[j % len(RANGE_STYLES)]
        what = "after one transformation (range not recorded)" if math.isnan(factor) else \
            f"draws, factors in [1/{factor:g}, {factor:g}]"
        handles.append(Line2D([], [], marker=marker, color=colour, markeredgecolor="black", linestyle="none",
                              markersize=5, label=what))
    handles.append(Patch(color="#e6e6e6", label=f"declared {family}-invariant"))
    fig.legend(handles=handles, fontsize=7, loc="outside upper center", ncols=2)
    return png_bytes(fig)
