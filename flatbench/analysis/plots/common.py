"""What every report figure shares: the canvas, the colours and markers, the axis rules, and the map from
data points to PNG pixels that the HTML report's hover reads.

No pyplot: figures are plain `Figure` objects rendered to PNG bytes and cleared, so a report over
hundreds of measures leaves no global figure state behind and runs on a headless cluster node.

Readability rules (print in black and white, small sizes): colour encodes the random-label ratio on a
perceptually uniform map (cividis) whose lightness alone orders the values, and signed statistics (τ, ψ,
differences of τ in the heatmaps) on a diverging map centred at 0 (`DIVERGING`); models and measures are told apart by marker shape and line style, never by hue
alone; every marker has a dark edge. Figures are at most `PAGE_WIDTH` inches wide, so that the HTML page
shows them at their own size (one PNG pixel per CSS pixel) and no text is scaled below its point size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import BoundaryNorm, ListedColormap, Normalize
from matplotlib.figure import Figure

from flatbench.analysis.fmt import p_phrase
from flatbench.analysis.table import RATIO_COLUMN, to_float
from flatbench.figure_png import DPI, PAGE_WIDTH, encode as _encode, new_figure, png_bytes  # noqa: F401 (re-exported)

CMAP = "cividis"
"""The random-label ratio (sequential: lightness orders the values)."""
DIVERGING = "RdBu"
"""Signed statistics centred at 0 (τ, ψ, differences of τ): red below 0, white at 0, blue above."""
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")
LINESTYLES = ("-", "--", ":", "-.")
RATIO_NORM = Normalize(vmin=0.0, vmax=1.0)
"""Ratios always span [0, 1]: the same colour means the same ratio in every figure."""
@dataclass
class Drawn:
    """A rendered figure and, for hover, where its data points landed: `points` rows are
    (x pixel, y pixel from the top, run index, panel index) in the PNG's own pixels."""

    png: bytes
    width: int = 0
    height: int = 0
    points: list[list[float]] = field(default_factory=list)
    panels: list[str] = field(default_factory=list)


def render_with_points(fig: Figure, groups: list[tuple[Any, np.ndarray, np.ndarray, np.ndarray, int]],
                       panels: list[str]) -> Drawn:
    """Draw the figure, map each group (axes, x, y, run indices, panel) to the pixels of that drawing,
    and encode the same drawing as the PNG, so the pixels match the image the page shows."""
    fig.set_dpi(DPI)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    width, height = canvas.get_width_height()
    points: list[list[float]] = []
    for ax, x, y, idx, panel in groups:
        if not len(x):
            continue
        xy = ax.transData.transform(np.column_stack([x, y]))
        for (px, py), i in zip(xy, idx):
            if math.isfinite(px) and math.isfinite(py):
                points.append([round(float(px), 1), round(float(height - py), 1), int(i), int(panel)])
    return Drawn(_encode(canvas, fig), width, height, points, panels)


def gap_label(gap: str) -> str:
    return ("generalization gap (train acc − test acc)" if gap == "acc"
            else "generalization gap (test loss − train loss)")


def use_log(values: np.ndarray) -> bool:
    """Log axis when every value is positive and they span more than two decades."""
    finite = values[np.isfinite(values)]
    return bool(len(finite) >= 2 and finite.min() > 0 and finite.max() / finite.min() > 100.0)


def set_value_scale(ax: Any, values: np.ndarray, axis: str = "y") -> str:
    """Log scale when every value is positive and they span more than two decades (`use_log`), symmetric log
    when values of both signs (or zeros) span more than two decades in size (e.g. PSI-flatness, 1e11 to
    1e14 with a negative run), linear otherwise; returns the scale set."""
    finite = values[np.isfinite(values)]
    setter = ax.set_yscale if axis == "y" else ax.set_xscale
    if use_log(finite):
        setter("log")
        return "log"
    size = np.abs(finite[finite != 0])
    if len(size) >= 2 and size.max() / size.min() > 100.0:
        setter("symlog", linthresh=float(np.quantile(size, 0.1)))
        return "symlog"
    return "linear"


def model_labels(frame: pd.DataFrame) -> pd.Series:
    """The 'model' of each run, for markers and lines: the model and dataset fields that vary, joined
    (e.g. "lenet cifar10"); the experiment folder when combined folders differ in something else."""
    def varies(col: str) -> bool:
        return col in frame.columns and frame[col].astype(str).nunique() > 1

    parts = [c for c in frame.columns if (c.startswith("model.") or c == "data.dataset") and varies(c)]
    if not parts and varies("experiment"):
        parts = ["experiment"]
    if not parts or frame.empty:
        name = frame["model.name"] if "model.name" in frame.columns else pd.Series("model", index=frame.index)
        return name.astype(str)

    def label(row: pd.Series) -> str:
        out = []
        for col in parts:
            value = row[col]
            out.append(str(value) if col in ("model.name", "data.dataset", "experiment")
                       else f"{col.split('.', 1)[1]}={value}")
        return " ".join(out)

    return frame.apply(label, axis=1).astype(str)


def marker_map(labels: pd.Series) -> dict[str, str]:
    return {m: MARKERS[i % len(MARKERS)] for i, m in enumerate(sorted(set(labels)))}


def ratios_of(frame: pd.DataFrame) -> np.ndarray | None:
    """Each run's random-label ratio, or None when the table has none."""
    for col in (RATIO_COLUMN, "labels.ratio"):
        if col in frame.columns:
            values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=float)
            if np.isfinite(values).any():
                return values
    return None


def empty_panel(ax: Any, text: str, fontsize: float) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=fontsize, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def grid_shape(n: int, max_cols: int = 4) -> tuple[int, int]:
    """(rows, columns) of a grid of n small panels, at most `max_cols` wide."""
    cols = max(1, min(max_cols, n))
    return math.ceil(max(n, 1) / cols), cols


def study_ratios(ratios: Any) -> list[float]:
    """The distinct finite random-label ratios among `ratios` (one per run), sorted."""
    values = np.asarray([] if ratios is None else ratios, dtype=float).ravel()
    return sorted({float(v) for v in values[np.isfinite(values)]})


def ratio_colorbar(fig: Figure, axes: Any, fontsize: float, shrink: float = 1.0, ratios: Any = None) -> Any:
    """The ratio's colour key: one swatch per ratio the study has (`ratios`: each run's ratio), each in the
    colour `RATIO_NORM` gives it (the same colour for the same ratio in every figure), labelled with the
    ratio; a study with ratios 0 and 0.5 gets two swatches, not a bar from 0 to 1 that suggests values in
    between. Without `ratios` (or without a finite one), the continuous bar over [0, 1]."""
    levels = study_ratios(ratios)
    if not levels:
        cbar = fig.colorbar(ScalarMappable(norm=RATIO_NORM, cmap=CMAP), ax=axes, shrink=shrink)
    else:
        cmap = ListedColormap([colormaps[CMAP](RATIO_NORM(v)) for v in levels])
        bounds = np.arange(len(levels) + 1, dtype=float)
        mapper = ScalarMappable(norm=BoundaryNorm(bounds, len(levels)), cmap=cmap)
        cbar = fig.colorbar(mapper, ax=axes, shrink=shrink * min(1.0, 0.25 + 0.15 * len(levels)),
                            ticks=bounds[:-1] + 0.5, boundaries=bounds)
        cbar.ax.set_yticklabels([f"{v:g}" for v in levels])
        cbar.ax.minorticks_off()
    cbar.set_label("random-label ratio", fontsize=fontsize)
    cbar.ax.tick_params(labelsize=fontsize - 1)
    return cbar


def tau_text(row: Any, short: bool = False) -> str:
    """"Kendall τ = 0.85 [0.78, 0.93], p < 0.001, n = 24" (the interval only where there is one);
    `short`: "τ 0.85 [0.78, 0.93], p < 0.001" for a small panel's title."""
    row = row or {}
    tau = to_float(row.get("kendall_tau"))
    if not math.isfinite(tau):
        note = str(row.get("note") or "no correlation")
        return f"τ: n/a ({note.split(';')[0]})"
    lo, hi = to_float(row.get("kendall_tau_lo")), to_float(row.get("kendall_tau_hi"))
    ci = f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    p = to_float(row.get("kendall_p"))
    p_txt = f", {p_phrase(p)}" if math.isfinite(p) else ""
    if short:
        return f"τ {tau:.2f}{ci}{p_txt}"
    return f"Kendall τ = {tau:.2f}{ci}{p_txt}, n = {int(to_float(row.get('n')))}"


def ink_on(rgba: tuple[float, ...]) -> str:
    """Black or white text, whichever reads on a cell of this colour."""
    r, g, b = rgba[:3]
    return "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"


def wrap_key(key: str, width: int = 30) -> str:
    """A long measure key on two lines, broken before its "@loss" or ":variant" (so that small panels'
    titles never run into their neighbours)."""
    if len(key) <= width:
        return key
    for mark in ("@", ":"):
        cut = key.rfind(mark)
        if cut > 0:
            return key[:cut] + "\n" + key[cut:]
    return key[:width] + "\n" + key[width:]
