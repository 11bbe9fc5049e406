"""Each measure against the gap: one measure on its own (`measure_figure`, a file per measure for a
paper), many measures in a grid of small panels with one shared legend (`scatter_grid`, what the report
page shows, with the pixel position of every point for the page's hover), and every measure against the
random-label ratio (`vs_ratio_figure`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.lines import Line2D

from flatbench.analysis.plots.common import (
    CMAP,
    LINESTYLES,
    MARKERS,
    PAGE_WIDTH,
    RATIO_NORM,
    Drawn,
    empty_panel,
    gap_label,
    grid_shape,
    marker_map,
    new_figure,
    png_bytes,
    ratio_colorbar,
    ratios_of,
    render_with_points,
    set_value_scale,
    tau_text,
    use_log,
    wrap_key,
)

GRID_COLS = 3
"""Panels per row: a 42-character measure name (`matrix_normalized_sharpness@normalized_ce`) fits a panel's title at 7 pt."""


def _values(frame: pd.DataFrame, col: str | None) -> np.ndarray:
    if col is None or col not in frame.columns or not len(frame):
        return np.full(len(frame), np.nan)
    return pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=float)


def _error_bars(ax: Any, x: np.ndarray, y: np.ndarray, se: np.ndarray, ok: np.ndarray, log: bool) -> None:
    """±1 standard error, grey, behind the markers; on a log axis a bar stops just above 0."""
    bar = ok & np.isfinite(se)
    if not bar.any():
        return
    lower = np.abs(se[bar])
    if log:
        lower = np.minimum(lower, y[bar] * (1.0 - 1e-3))
    ax.errorbar(x[bar], y[bar], yerr=[lower, np.abs(se[bar])], fmt="none", ecolor="0.35", elinewidth=0.8,
                capsize=2, zorder=1)


def scatter_panel(ax: Any, frame: pd.DataFrame, key: str, gap_col: str, labels: pd.Series,
                  markers: Mapping[str, str], title: str, small: bool = False,
                  se_column: str | None = None) -> np.ndarray:
    """Measure (y) against the gap (x), colour = random-label ratio (grey where a run has none), marker =
    model; `se_column` adds ±1 standard-error bars. Returns the mask of the runs drawn."""
    fs = 7 if small else 9
    y, x = _values(frame, key), _values(frame, gap_col)
    ok = np.isfinite(x) & np.isfinite(y)
    ax.set_title(title, fontsize=fs, loc="left")
    if not ok.any():
        empty_panel(ax, "no finite values", fs)
        return ok
    log = use_log(y[ok])
    if se_column is not None:
        _error_bars(ax, x, y, _values(frame, se_column), ok, log)
    set_value_scale(ax, y[ok])
    ratios = ratios_of(frame)
    for model, marker in markers.items():
        sel = ok & (labels.to_numpy() == model)
        if not sel.any():
            continue
        kwargs: dict[str, Any] = {"marker": marker, "s": 22 if small else 30, "edgecolors": "black",
                                  "linewidths": 0.4, "label": model if len(markers) > 1 else None}
        if ratios is not None:
            ax.scatter(x[sel], y[sel], c=ratios[sel], cmap=colormaps[CMAP].with_extremes(bad="0.6"),
                       norm=RATIO_NORM, plotnonfinite=True, zorder=2, **kwargs)
        else:
            ax.scatter(x[sel], y[sel], color="0.5", zorder=2, **kwargs)
    ax.tick_params(labelsize=fs - 1.5 if small else fs - 1)
    ax.grid(True, linewidth=0.3, alpha=0.5)
    return ok


def measure_figure(frame: pd.DataFrame, key: str, gap: str, gap_col: str, labels: pd.Series,
                   row: Mapping[str, Any] | None, larger_is_sharper: bool,
                   se_column: str | None = None) -> bytes:
    """One measure against the gap, Kendall τ (oriented, with its interval where there is one, and its
    permutation p-value) in the title; `se_column` adds ±1 Monte-Carlo standard-error bars."""
    fig = new_figure(5.4, 4.0)
    ax = fig.add_subplot()
    markers = marker_map(labels)
    scatter_panel(ax, frame, key, gap_col, labels, markers, f"{key}\n{tau_text(row)}", se_column=se_column)
    ax.set_xlabel(gap_label(gap), fontsize=9)
    ylabel = key + ("" if larger_is_sharper else "  (smaller = sharper)")
    if se_column is not None and se_column in frame.columns:
        ylabel += "\n(bars: ±1 Monte-Carlo standard error)"
    ax.set_ylabel(ylabel, fontsize=9)
    if len(markers) > 1 and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, title="model", title_fontsize=7, loc="best", framealpha=0.8)
    ratios = ratios_of(frame)
    if ratios is not None:
        ratio_colorbar(fig, ax, 9, ratios=ratios)
    return png_bytes(fig)


def _shared_legend(fig: Any, frame: pd.DataFrame, markers: Mapping[str, str], axes: list[Any]) -> None:
    """One legend for the whole grid: the models' markers, and the ratio's colour bar."""
    if len(markers) > 1:
        handles = [Line2D([], [], marker=m, color="0.6", markeredgecolor="black", markeredgewidth=0.4,
                          linestyle="none", markersize=5, label=name) for name, m in markers.items()]
        fields = sorted({part.split("=")[0] for name in markers for part in str(name).split() if "=" in part})
        fig.legend(handles=handles, loc="outside upper center", ncols=min(len(markers), 6), fontsize=7,
                   title="marker: " + (", ".join(f"model {f}" for f in fields) if fields else "model"),
                   title_fontsize=7, frameon=False)
    ratios = ratios_of(frame)
    if ratios is not None:
        ratio_colorbar(fig, axes, 7, shrink=0.5 if len(axes) > GRID_COLS else 0.9, ratios=ratios)


def scatter_grid(frame: pd.DataFrame, keys: list[str], gap: str, gap_col: str, labels: pd.Series,
                 rows: Mapping[str, Mapping[str, Any]], flipped: Mapping[str, bool] | None = None,
                 se_columns: Mapping[str, str] | None = None) -> Drawn:
    """Measures against the gap in a grid (`GRID_COLS` wide, in the order given), titles with τ, its
    interval and p; one shared legend. Returns the PNG and every point's pixel position (for hover).
    `flipped[key]`: the measure's smaller values are the sharper ones (marked "(−)" in its title);
    `se_columns[key]`: its Monte-Carlo standard errors, drawn as ±1 SE bars."""
    nrows, ncols = grid_shape(len(keys), GRID_COLS)
    ncols = GRID_COLS  # the same panel size in every grid, however few measures a family has
    fig = new_figure(PAGE_WIDTH, 2.5 * nrows + 0.9)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).ravel())
    markers = marker_map(labels)
    groups = []
    x = _values(frame, gap_col)
    for panel, (ax, key) in enumerate(zip(axes, keys)):
        name = key + (" (−)" if (flipped or {}).get(key) else "")
        ok = scatter_panel(ax, frame, key, gap_col, labels, markers,
                           f"{name}\n{tau_text(rows.get(key), short=True)}", small=True,
                           se_column=(se_columns or {}).get(key))
        idx = np.flatnonzero(ok)
        groups.append((ax, x[idx], _values(frame, key)[idx], idx, panel))
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    fig.supxlabel(gap_label(gap), fontsize=8)
    _shared_legend(fig, frame, markers, axes[:len(keys)])
    return render_with_points(fig, groups, list(keys))


def _ratio_means(ratios: np.ndarray, y: np.ndarray, sel: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({"r": ratios[sel], "y": y[sel]}).groupby("r")["y"].agg(["mean", "std"])


def vs_ratio_figure(frame: pd.DataFrame, keys: list[str], gap: str, gap_col: str,
                    labels: pd.Series) -> bytes:
    """The gap and every measure against the random-label ratio: mean ± std over seeds, one line (marker
    and line style) per model. Measures without a finite value are the caller's to leave out."""
    panels = [gap_col, *keys]
    nrows, ncols = grid_shape(len(panels), GRID_COLS + 1)
    fig = new_figure(PAGE_WIDTH, 2.0 * nrows + 0.8)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    ratios = ratios_of(frame)
    models = sorted(set(labels))
    colors = [colormaps["viridis"](v) for v in np.linspace(0.0, 0.8, max(len(models), 1))]
    for ax, key in zip(axes, panels):
        ax.set_title(gap_label(gap).replace("generalization ", "") if key == gap_col else wrap_key(key, 32),
                     fontsize=6.5, loc="left")
        if ratios is None:
            empty_panel(ax, "no random-label ratio", 7)
            continue
        y_all = _values(frame, key)
        for i, model in enumerate(models):
            sel = (labels.to_numpy() == model) & np.isfinite(y_all) & np.isfinite(ratios)
            if sel.any():
                stats = _ratio_means(ratios, y_all, sel)
                ax.errorbar(stats.index.to_numpy(), stats["mean"].to_numpy(),
                            yerr=np.nan_to_num(stats["std"].to_numpy(), nan=0.0), marker=MARKERS[i % len(MARKERS)],
                            linestyle=LINESTYLES[i % len(LINESTYLES)], color=colors[i], markeredgecolor="black",
                            markeredgewidth=0.4, markersize=3.5, linewidth=1.0, capsize=2, label=model)
        set_value_scale(ax, y_all)
        ax.tick_params(labelsize=5.5)
        ax.grid(True, linewidth=0.3, alpha=0.5)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.supxlabel("random-label ratio (mean ± std over the runs of each model at each ratio: seeds and, where other "
                  "axes vary, their values too)", fontsize=8)
    handles, names = axes[0].get_legend_handles_labels()
    if len(models) > 1 and handles:
        fig.legend(handles, names, loc="outside upper center", ncols=min(len(models), 6), fontsize=7, frameon=False)
    return png_bytes(fig)
