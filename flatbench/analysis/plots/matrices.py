"""Measure × measure heatmaps: agreement (Kendall τ between measures over the runs) and the paired
comparisons (τ_row − τ_col). Both take their measures in the order given, grouped by family (a thin
line between families, the family named on the right), and print every cell's value: with two decimals
up to `FULL_VALUES` measures, as hundredths ("85" for 0.85) beyond, so that 40 measures still fit the
page with readable numbers. The caller leaves out the measures that have no value."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from flatbench.analysis.plots.common import DIVERGING, DPI, PAGE_WIDTH, empty_panel, ink_on, new_figure, png_bytes
from flatbench.analysis.table import to_float

FULL_VALUES = 16
"""Up to this many rows the cells show two decimals; beyond, hundredths."""


def _cell_text(v: float, scaled: bool, signed: bool) -> str:
    if scaled:  # no "+": at 40 measures a sign character does not fit the cell (the colour says it)
        return f"{round(v * 100)}"
    return f"{v:+.2f}" if signed else f"{v:.2f}"


@dataclass
class _Layout:
    """A matrix figure laid out by hand, in inches: constrained layout misplaces an equal-aspect image
    among long tick labels (it clipped the labels), so the sizes are computed from the labels' lengths."""

    width: float
    height: float
    rect: tuple[float, float, float, float]
    cbar: tuple[float, float, float, float]
    tick_fs: float
    cell_fs: float


def _layout(labels: list[str], families: Mapping[str, str] | None, title: bool) -> _Layout:
    n = max(len(labels), 1)
    tick_fs = 7.0 if n <= FULL_VALUES else 6.0
    longest = max(len(t) for t in labels) * tick_fs / 72
    label_in, below_in = longest * 0.62 + 0.15, longest * 0.52 + 0.15  # rows: room to spare; rotated: tight
    fam_in = (max(len(f) for f in families.values()) * 0.6 * 6.5 / 72 + 0.25) if families else 0.15
    cell = min(0.42, (PAGE_WIDTH - label_in - fam_in - 0.15) / n)
    side = n * cell
    top = 0.45 if title else 0.15
    width, height = label_in + side + fam_in + 0.15, top + side + below_in + 0.85
    rect = (label_in / width, (below_in + 0.8) / height, side / width, side / height)
    cbar = (label_in / width, 0.42 / height, min(side, 4.0) / width, 0.12 / height)
    cell_fs = 6.5 if n <= FULL_VALUES else max(4.5, min(6.5, cell * 72 * 0.45))
    return _Layout(width, height, rect, cbar, tick_fs, cell_fs)


def _family_marks(ax: Any, labels: list[str], families: Mapping[str, str] | None) -> None:
    """Lines between blocks of one family and the family's name right of its block."""
    if not families:
        return
    fam = [families.get(m, "") for m in labels]
    n = len(labels)
    start = 0
    for i in range(1, n + 1):
        if i == n or fam[i] != fam[start]:
            if i < n:
                ax.axhline(i - 0.5, color="white", linewidth=1.6)
                ax.axvline(i - 0.5, color="white", linewidth=1.6)
            if fam[start]:
                ax.annotate(fam[start], (1.0, (start + i - 1) / 2), xycoords=("axes fraction", "data"),
                            xytext=(4, 0), textcoords="offset points", va="center", ha="left", fontsize=6.5,
                            annotation_clip=False)
            start = i


def _heatmap(values: np.ndarray, labels: list[str], norm: Normalize, families: Mapping[str, str] | None,
             signed: bool, plain: np.ndarray | None = None, title: str = "") -> tuple[Any, Any, Any]:
    """The shared drawing: image, ticks, family blocks and cell values (`plain[i, j]`: draw that cell's
    value in parentheses on a hatched cell). Returns (figure, colour-bar axes, image)."""
    n = len(labels)
    lay = _layout(labels, {m: families.get(m, "") for m in labels} if families else None, bool(title))
    fs = lay.cell_fs
    fig = Figure(figsize=(lay.width, lay.height), dpi=DPI)
    ax = fig.add_axes(lay.rect)
    cmap = colormaps[DIVERGING].with_extremes(bad="white")
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    tick_fs = lay.tick_fs
    ax.set_xticks(range(n), labels, rotation=90, fontsize=tick_fs)
    ax.set_yticks(range(n), labels, fontsize=tick_fs)
    ax.tick_params(length=2)
    if title:
        ax.set_title(title, fontsize=7, loc="left")
    mapper = ScalarMappable(norm=norm, cmap=DIVERGING)
    scaled = n > FULL_VALUES
    for i in range(n):
        for j in range(n):
            v = values[i, j]
            if not math.isfinite(v):
                ax.text(j, i, "–", ha="center", va="center", fontsize=fs, color="0.5")
                continue
            rgba = mapper.to_rgba(v)
            weak = plain is not None and plain[i, j]
            if weak:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1.0, 1.0, fill=False, hatch="////",
                                       edgecolor="0.55", linewidth=0.0))
            text = _cell_text(v, scaled, signed)
            ax.text(j, i, f"({text})" if weak and not scaled else text, ha="center", va="center",
                    fontsize=fs, color=ink_on(rgba), fontweight="normal" if weak else "bold" if plain is not None
                    else "normal")
    _family_marks(ax, labels, families)
    return fig, fig.add_axes(lay.cbar), image


def agreement_figure(matrix: pd.DataFrame, families: Mapping[str, str] | None = None) -> bytes:
    """Kendall τ between measures (and the gap) over the runs both have: which measures rank the runs
    alike; `families`: measure → family for the blocks."""
    n = len(matrix)
    if n == 0:
        fig = new_figure(4.0, 3.0)
        empty_panel(fig.add_subplot(), "no measures", 9)
        return png_bytes(fig)
    labels = matrix.index.astype(str).tolist()
    fig, cax, image = _heatmap(matrix.to_numpy(dtype=float), labels, Normalize(-1.0, 1.0), families, signed=False)
    unit = " (cells: τ × 100)" if n > FULL_VALUES else ""
    cbar = fig.colorbar(image, cax=cax, orientation="horizontal")
    cbar.set_label("Kendall τ between the row's and the column's measure" + unit, fontsize=7)
    cbar.ax.tick_params(labelsize=6.5)
    return png_bytes(fig)


def _comparison_cells(comparisons: pd.DataFrame, order: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """τ_row − τ_col and whether its paired interval excludes 0, per cell."""
    pos = {m: i for i, m in enumerate(order)}
    k = len(order)
    diff = np.full((k, k), np.nan)
    distinct = np.zeros((k, k), dtype=bool)
    for r in comparisons.to_dict(orient="records"):
        a, b = str(r.get("measure_a")), str(r.get("measure_b"))
        if a in pos and b in pos and a != b:
            i, j = pos[a], pos[b]
            diff[i, j] = to_float(r.get("diff"))
            lo, hi = to_float(r.get("diff_lo")), to_float(r.get("diff_hi"))
            distinct[i, j] = math.isfinite(lo) and math.isfinite(hi) and (lo > 0 or hi < 0)
    return diff, distinct


def comparison_figure(comparisons: pd.DataFrame, order: list[str] | None = None, level: float = 0.95,
                      families: Mapping[str, str] | None = None) -> bytes:
    """Heatmap of τ_row − τ_col (paired over the runs both measures have; see `stats.paired_comparisons`).

    Bold cells: the paired interval excludes 0. Hatched cells (value in parentheses when there is room):
    the interval contains 0 or there is none; on this study those two measures cannot be told apart.
    """
    if order is None:
        order = list(dict.fromkeys([*comparisons.get("measure_a", pd.Series(dtype=object)).astype(str),
                                    *comparisons.get("measure_b", pd.Series(dtype=object)).astype(str)]))
    order = [str(m) for m in order]
    if not order:
        fig = new_figure(4.0, 3.0)
        empty_panel(fig.add_subplot(), "no measures to compare", 9)
        return png_bytes(fig)
    diff, distinct = _comparison_cells(comparisons, order)
    finite = diff[np.isfinite(diff)]
    vmax = max(0.05, float(np.abs(finite).max())) if len(finite) else 1.0
    unit = " × 100" if len(order) > FULL_VALUES else ""
    title = (f"τ(row) − τ(column){unit}, paired over shared runs\nbold: the {level:.0%} paired interval excludes 0; "
             "hatched: it contains 0 or is not available")
    fig, cax, image = _heatmap(diff, order, Normalize(-vmax, vmax), families, signed=True,
                               plain=~distinct & np.isfinite(diff), title=title)
    cbar = fig.colorbar(image, cax=cax, orientation="horizontal")
    cbar.set_label("τ(row) − τ(column)", fontsize=7)
    cbar.ax.tick_params(labelsize=6.5)
    return png_bytes(fig)
