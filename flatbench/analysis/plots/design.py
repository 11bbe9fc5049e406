"""The design figures: the gap and the leading measures against one swept axis, one figure per axis (the
page offers a select to switch between them; print shows them all).

A point is a run (jittered within its axis value; colour: the random-label ratio where that varies and
is not the axis itself; marker: the model), so the hover shows its whole configuration. The black bar at
each axis value is the mean of the runs there, and the tick label says how many runs it pools (every
other axis and seed at that value). A measure's panel title gives its ψ along this axis, the τ among runs
that differ in this axis only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.lines import Line2D

from flatbench.analysis.plots.common import (
    CMAP,
    RATIO_NORM,
    Drawn,
    gap_label,
    grid_shape,
    marker_map,
    new_figure,
    ratio_colorbar,
    ratios_of,
    render_with_points,
    set_value_scale,
    wrap_key,
)
from flatbench.analysis.table import RATIO_COLUMN, to_float

COLS = 4


def _levels(series: pd.Series) -> list[Any]:
    """The axis's values in order: numerically where they are numbers, else as text."""
    values = list(dict.fromkeys(series.dropna().tolist()))
    numbers = [to_float(v) for v in values]
    if all(math.isfinite(v) for v in numbers):
        return [v for _, v in sorted(zip(numbers, values), key=lambda t: t[0])]
    return sorted(values, key=str)


def _psi_title(row: Mapping[str, Any] | None, axis: str) -> str:
    row = row or {}
    psi = to_float(row.get(f"psi_{axis}"))
    p = to_float(row.get(f"p_psi_holm_{axis}"))
    if not math.isfinite(psi):
        return f"τ {to_float(row.get('kendall_tau')):.2f}, ψ n/a"
    star = "*" if math.isfinite(p) and p < 0.05 else ""
    return f"τ {to_float(row.get('kendall_tau')):.2f}, ψ here {psi:+.2f}{star}"


def axis_figure(frame: pd.DataFrame, axis: str, keys: list[str], gap: str, gap_col: str, labels: pd.Series,
                rows: Mapping[str, Mapping[str, Any]], flipped: Mapping[str, bool] | None = None) -> Drawn:
    """The gap and each of `keys` against `axis` (see the module doc); hover points for every run."""
    panels = [gap_col, *keys]
    nrows, _ = grid_shape(len(panels), COLS)
    fig = new_figure(10.0, 2.3 * nrows + 1.0)
    axes = list(fig.subplots(nrows, COLS, squeeze=False).ravel())
    levels = _levels(frame[axis])
    index = {str(v): i for i, v in enumerate(levels)}
    pos = np.array([index.get(str(v), -1) for v in frame[axis]], dtype=float)
    jitter = ((np.arange(len(frame)) * 0.618034) % 1.0 - 0.5) * 0.36
    x = pos + jitter
    counts = [int((pos == i).sum()) for i in range(len(levels))]
    ratios = ratios_of(frame) if axis != RATIO_COLUMN and RATIO_COLUMN in frame.columns \
        and frame[RATIO_COLUMN].nunique() > 1 else None
    markers = marker_map(labels)
    groups = []
    for panel, (ax, key) in enumerate(zip(axes, panels)):
        y = pd.to_numeric(frame[key], errors="coerce").to_numpy(dtype=float)
        ok = np.isfinite(y) & (pos >= 0)
        title = gap_label(gap).replace("generalization ", "") if key == gap_col else \
            f"{wrap_key(key + (' (−)' if (flipped or {}).get(key) else ''), 34)}\n{_psi_title(rows.get(key), axis)}"
        ax.set_title(title, fontsize=6.5, loc="left")
        for model, marker in markers.items():
            sel = ok & (labels.to_numpy() == model)
            if not sel.any():
                continue
            color = colormaps[CMAP](RATIO_NORM(ratios[sel])) if ratios is not None else "0.55"
            ax.scatter(x[sel], y[sel], marker=marker, s=12, c=color, edgecolors="black", linewidths=0.3, zorder=2,
                       alpha=0.85)
        for i in range(len(levels)):
            at = ok & (pos == i)
            if at.any():
                ax.plot([i - 0.3, i + 0.3], [np.mean(y[at])] * 2, color="black", linewidth=1.8, zorder=3)
        set_value_scale(ax, y[ok])
        ax.set_xticks(range(len(levels)), [f"{_short(v)}\n(n {c})" for v, c in zip(levels, counts)], fontsize=5.5)
        ax.tick_params(axis="y", labelsize=5.5)
        ax.grid(True, axis="y", linewidth=0.3, alpha=0.5)
        idx = np.flatnonzero(ok)
        groups.append((ax, x[idx], y[idx], idx, panel))
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if len(markers) > 1:
        handles = [Line2D([], [], marker=m, color="0.6", markeredgecolor="black", markeredgewidth=0.4,
                          linestyle="none", markersize=5, label=name) for name, m in markers.items()]
        fig.legend(handles=handles, loc="outside upper center", ncols=min(len(markers), 6), fontsize=7,
                   title="marker: model", title_fontsize=7, frameon=False)
    fig.supxlabel(f"{axis}: a point is a run; black bar: the mean of the n runs at that value (pooling every other "
                  "axis and seed)" + ("; colour: random-label ratio" if ratios is not None else ""), fontsize=7.5)
    if ratios is not None:
        ratio_colorbar(fig, axes[:len(panels)], 7, shrink=0.6, ratios=ratios)
    return render_with_points(fig, groups, [str(p) for p in panels])


def _short(value: Any) -> str:
    v = to_float(value)
    if math.isfinite(v):
        return f"{v:g}"
    text = str(value)
    return text if len(text) <= 14 else text[:13] + "…"
