"""The run audit's heatmap (`flatbench audit RUN_DIR`, `audit.png`): measure × transformation family, the
median relative change of each measure under function-preserving transformations, declared invariances
framed. The population audit's figure is `analysis.audit_plots`."""

from __future__ import annotations

import math
from typing import Any

import matplotlib
import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from flatbench.analysis.plots.common import png_bytes

HEATMAP_FLOOR = 1e-16
"""Relative changes below this (including exact zeros) are drawn at this value on the log scale."""


def audit_heatmap_figure(summary: Any, title: str = "") -> bytes:
    """Measure × family heatmap of the median relative change under function-preserving transformations
    (log colour scale; red frame: declared invariant); `summary` is an `analysis.audit_tables.Summary`."""
    med = summary.median
    n_rows, n_cols = med.shape
    data = med.to_numpy(dtype=float)
    shown = np.where(np.isnan(data), np.nan, np.clip(data, HEATMAP_FLOOR, None))
    finite = shown[np.isfinite(shown)]
    vmax = max(1.0, float(finite.max())) if finite.size else 1.0
    fig = Figure(figsize=(2.0 + 1.25 * max(n_cols, 1), 1.2 + 0.38 * max(n_rows, 1)), layout="constrained")
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")
    image = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=LogNorm(vmin=HEATMAP_FLOOR, vmax=vmax),
                      aspect="auto")
    for i in range(n_rows):
        for j in range(n_cols):
            v = data[i, j]
            text = "n/a" if math.isnan(v) else ("0" if v == 0 else f"{v:.0e}")
            # viridis is dark at the low end: white text there, black on the bright end and on grey n/a
            position = 0.0 if math.isnan(v) else (math.log10(shown[i, j] / HEATMAP_FLOOR)
                                                   / math.log10(vmax / HEATMAP_FLOOR))
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    color="white" if not math.isnan(v) and position < 0.6 else "black")
            if summary.declared.iloc[i, j]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#e41a1c",
                                       linewidth=2))
    ax.set_xticks(range(n_cols), list(med.columns), fontsize=8)
    ax.set_yticks(range(n_rows), list(med.index), fontsize=8)
    ax.set_xlabel("transformation family (red frame: declared invariant)", fontsize=8)
    fig.colorbar(image, ax=ax, label="median |Δ| / |baseline|")
    if title:
        ax.set_title(title, fontsize=9)
    return png_bytes(fig)
