"""τ against the train-loss level at which the models were snapshotted (`tau_by_level_figure`): how much
a verdict depends on how far training went. Only the measures given are drawn: the caller passes those
that have a τ at some snapshot level (a measure computed on the final models only has nothing to show)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.ticker import NullLocator

from flatbench.analysis.plots.common import (
    LINESTYLES,
    MARKERS,
    empty_panel,
    grid_shape,
    new_figure,
    png_bytes,
    wrap_key,
)
from flatbench.analysis.table import to_float

FINAL_LEVEL = "final"
GREYS = ("0.0", "0.45", "0.0", "0.45")


def _level_value(level: Any) -> float | str | None:
    """A level as a float (a train-loss value), "final", or None when it is neither."""
    if isinstance(level, str) and level.strip().lower() == FINAL_LEVEL:
        return FINAL_LEVEL
    value = to_float(level)
    return value if math.isfinite(value) else None


def _positions(data: pd.DataFrame) -> tuple[pd.DataFrame, list[float], bool, float]:
    """The x of every row: the level itself, "final" half a decade beyond the lowest level (a fifth of the
    span on a linear axis). Returns (data with `lv` and `x`, the float levels, log axis?, final x)."""
    data["lv"] = [_level_value(v) for v in data["level"]]
    data = data[data["lv"].notna()].copy()
    floats = sorted({v for v in data["lv"] if v != FINAL_LEVEL}, reverse=True)
    log = bool(floats) and min(floats) > 0
    if not floats:
        final_x = 0.0
    elif log:
        final_x = min(floats) / 10 ** 0.5
    else:
        final_x = min(floats) - 0.2 * ((max(floats) - min(floats)) or 1.0)
    data["x"] = [final_x if v == FINAL_LEVEL else float(v) for v in data["lv"]]
    return data, floats, log, final_x


def _draw_measure(ax: Any, part: pd.DataFrame, style: int, dodge: float, log: bool, span: float,
                  label: str | None) -> None:
    """One measure's τ per level (line), its final τ (a marker past the separator) and the intervals."""
    x = part["x"].to_numpy(dtype=float)
    x = x * 10 ** dodge if log else x + dodge * span
    tau, lo, hi = (pd.to_numeric(part[c], errors="coerce").to_numpy(dtype=float)
                   for c in ("kendall_tau", "kendall_tau_lo", "kendall_tau_hi"))
    is_final = (part["lv"] == FINAL_LEVEL).to_numpy()
    ok = np.isfinite(tau)
    color, marker, line = GREYS[style % 4], MARKERS[style % len(MARKERS)], LINESTYLES[style % len(LINESTYLES)]
    face = "white" if style % 2 else color
    ci = ok & np.isfinite(lo) & np.isfinite(hi)
    if ci.any():
        ax.errorbar(x[ci], tau[ci], yerr=[np.maximum(tau[ci] - lo[ci], 0), np.maximum(hi[ci] - tau[ci], 0)],
                    fmt="none", ecolor=color, elinewidth=0.8, capsize=2, alpha=0.8)
    curve = ok & ~is_final
    if curve.any():
        ax.plot(x[curve], tau[curve], linestyle=line, color=color, linewidth=1.1, marker=marker, markersize=4.5,
                markerfacecolor=face, markeredgecolor="black", markeredgewidth=0.6, label=label)
    fin = ok & is_final
    if fin.any():
        if curve.any():
            last = np.flatnonzero(curve)[-1]
            ax.plot([x[last], x[fin][0]], [tau[last], tau[fin][0]], linestyle=":", color=color, linewidth=0.8)
        ax.plot(x[fin], tau[fin], linestyle="none", marker=marker, markersize=5.5, markerfacecolor=face,
                markeredgecolor="black", markeredgewidth=0.6, label=label if not curve.any() else None)


def _axis_layout(ax: Any, data: pd.DataFrame, floats: list[float], log: bool, final_x: float, fs: float) -> None:
    """Shared x axis: high loss on the left (training goes on to the right), tick labels with the number
    of runs at each level, a dotted separator before "final"; τ from −1 to 1."""
    positions = sorted(set(data["x"]), reverse=True)
    has_final = (data["lv"] == FINAL_LEVEL).any()
    n_at = data.assign(n=pd.to_numeric(data["n"], errors="coerce")).groupby("x")["n"].max()
    labels = []
    for pos in positions:
        text = FINAL_LEVEL if (has_final and pos == final_x) else f"{pos:g}"
        n_here = n_at.get(pos, math.nan)
        labels.append(text + (f"\nn={int(n_here)}" if math.isfinite(n_here) else ""))
    if log:
        ax.set_xscale("log")
    if len(positions) <= 12:
        ax.set_xticks(positions, labels, fontsize=fs - 1)
        ax.xaxis.set_minor_locator(NullLocator())
    if log:
        left, right = max(positions) * 10 ** 0.25, min(positions) / 10 ** 0.25
    else:
        span = (max(positions) - min(positions)) or 1.0
        left, right = max(positions) + 0.1 * span, min(positions) - 0.1 * span
    ax.set_xlim(left, right)
    if has_final and floats:
        ax.axvline(math.sqrt(min(floats) * final_x) if log else (min(floats) + final_x) / 2, color="0.5",
                   linewidth=0.6, linestyle=":")
    ax.axhline(0.0, color="0.4", linewidth=0.8, linestyle="--")
    ax.set_ylim(-1.05, 1.05)
    ax.tick_params(labelsize=fs - 1)
    ax.grid(True, axis="y", linewidth=0.3, alpha=0.5)


def tau_by_level_figure(frame: pd.DataFrame) -> bytes:
    """Kendall τ of each measure against the train-loss level at which the models were snapshotted.

    `frame`: columns measure, level (a float train-loss level, or "final" for the final models),
    kendall_tau, kendall_tau_lo, kendall_tau_hi, n. The x axis runs from high to low loss, logarithmic when
    every float level is positive. Up to four measures share one panel (told apart by marker and line
    style, in greys); more get one small panel each, with shared axes.
    """
    data = frame.copy() if frame is not None else pd.DataFrame()
    for col in ("measure", "level", "kendall_tau", "kendall_tau_lo", "kendall_tau_hi", "n"):
        if col not in data.columns:
            data[col] = np.nan
    data, floats, log, final_x = _positions(data)
    measures = list(dict.fromkeys(data["measure"].astype(str)))
    single = len(measures) <= 4
    nrows, ncols = (1, 1) if single else grid_shape(len(measures), 4)
    fig = new_figure(6.4, 3.8) if single else new_figure(9.6, 2.0 * nrows + 0.9)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True).ravel()
    if not measures:
        empty_panel(axes[0], "no τ per level", 9)
        return png_bytes(fig)
    fs = 8 if single else 7
    span = ((max(floats) - min(floats)) or 1.0) if floats else 1.0
    for idx, measure in enumerate(measures):
        ax = axes[0] if single else axes[idx]
        part = data[data["measure"].astype(str) == measure].sort_values("x", ascending=False)
        dodge = (idx - (len(measures) - 1) / 2) * 0.035 if single and len(measures) > 1 else 0.0
        _draw_measure(ax, part, idx if single else 0, dodge, log, span, measure if single else None)
        if not single:
            ax.set_title(wrap_key(measure, 30), fontsize=7, loc="left")
    for ax in axes[:1 if single else len(measures)]:
        _axis_layout(ax, data, floats, log, final_x, fs)
    for ax in axes[(1 if single else len(measures)):]:
        ax.set_visible(False)
    xlabel, ylabel = "train-loss level of the snapshot (training goes on →)", "Kendall τ with the gap"
    (axes[0].set_xlabel if single else fig.supxlabel)(xlabel, fontsize=fs + 1)
    (axes[0].set_ylabel if single else fig.supylabel)(ylabel, fontsize=fs + 1)
    handles, names = axes[0].get_legend_handles_labels()
    if single and handles:
        fig.legend(handles, names, loc="outside lower center", ncols=min(len(names), 2), fontsize=7)
    return png_bytes(fig)
