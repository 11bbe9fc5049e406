"""The report's figures, drawn with matplotlib's object API on the Agg canvas.

No pyplot: figures are plain `Figure` objects rendered to PNG bytes and cleared, so a report over
hundreds of measures leaves no global figure state behind and runs on a headless cluster node.

Readability rules (print in black and white, small sizes): colour encodes only the random-label ratio,
on a perceptually uniform map (cividis) whose lightness alone orders the values; models are told apart by
marker shape and line style, never by hue alone; every marker has a dark edge.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from flatbench.analysis.table import RATIO_COLUMN

CMAP = "cividis"
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")
LINESTYLES = ("-", "--", ":", "-.")
RATIO_NORM = Normalize(vmin=0.0, vmax=1.0)
"""Ratios always span [0, 1]: the same colour means the same ratio in every figure."""
DPI = 110


def png_bytes(fig: Figure) -> bytes:
    """Render to PNG and free the figure's artists (the report can hold hundreds of plots)."""
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    fig.clear()
    return buf.getvalue()


def gap_label(gap: str) -> str:
    return ("generalization gap (train acc − test acc)" if gap == "acc"
            else "generalization gap (test loss − train loss)")


def use_log(values: np.ndarray) -> bool:
    """Log axis when every value is positive and they span more than two decades."""
    finite = values[np.isfinite(values)]
    return bool(len(finite) >= 2 and finite.min() > 0 and finite.max() / finite.min() > 100.0)


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
            if col in ("model.name", "data.dataset", "experiment"):
                out.append(str(value))
            else:
                out.append(f"{col.split('.', 1)[1]}={value}")
        return " ".join(out)

    return frame.apply(label, axis=1).astype(str)


def _marker_map(labels: pd.Series) -> dict[str, str]:
    return {m: MARKERS[i % len(MARKERS)] for i, m in enumerate(sorted(set(labels)))}


def _ratios(frame: pd.DataFrame) -> np.ndarray | None:
    for col in (RATIO_COLUMN, "labels.ratio"):
        if col in frame.columns:
            values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=float)
            if np.isfinite(values).any():
                return values
    return None


def _empty(ax: Any, text: str, fontsize: float) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=fontsize,
            wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def scatter_panel(ax: Any, frame: pd.DataFrame, key: str, gap_col: str, labels: pd.Series,
                  markers: Mapping[str, str], title: str, small: bool = False) -> None:
    """Measure (y) against the gap (x), colour = random-label ratio, marker = model."""
    fs = 7 if small else 9
    y = frame[key].to_numpy(dtype=float) if key in frame.columns else np.zeros(0)
    x = frame[gap_col].to_numpy(dtype=float) if len(frame) else np.zeros(0)
    ok = np.isfinite(x) & np.isfinite(y)
    ax.set_title(title, fontsize=fs)
    if not ok.any():
        _empty(ax, "no finite values", fs)
        return
    ratios = _ratios(frame)
    for model, marker in markers.items():
        sel = ok & (labels.to_numpy() == model)
        if not sel.any():
            continue
        kwargs: dict[str, Any] = {"marker": marker, "s": 16 if small else 30, "edgecolors": "black",
                                  "linewidths": 0.4, "label": model if len(markers) > 1 else None}
        if ratios is not None:
            # A run without a ratio is drawn grey rather than as ratio 0.
            ax.scatter(x[sel], y[sel], c=ratios[sel], cmap=colormaps[CMAP].with_extremes(bad="0.6"),
                       norm=RATIO_NORM, plotnonfinite=True, **kwargs)
        else:
            ax.scatter(x[sel], y[sel], color="0.5", **kwargs)
    if use_log(y[ok]):
        ax.set_yscale("log")
    ax.tick_params(labelsize=fs - 1)
    ax.grid(True, linewidth=0.3, alpha=0.5)


def _tau_text(row: Mapping[str, Any] | None) -> str:
    if row is None or not math.isfinite(float(row.get("kendall_tau", math.nan))):
        note = (row or {}).get("note") or "no correlation"
        return f"τ: n/a ({note.split(';')[0]})"
    lo, hi = float(row["kendall_tau_lo"]), float(row["kendall_tau_hi"])
    ci = f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    return f"Kendall τ = {row['kendall_tau']:.2f}{ci}, n = {int(row['n'])}"


def _add_ratio_colorbar(fig: Figure, ax: Any, frame: pd.DataFrame, fs: float) -> None:
    if _ratios(frame) is None:
        return
    cbar = fig.colorbar(ScalarMappable(norm=RATIO_NORM, cmap=CMAP), ax=ax)
    cbar.set_label("random-label ratio", fontsize=fs)
    cbar.ax.tick_params(labelsize=fs - 1)


def measure_figure(frame: pd.DataFrame, key: str, gap: str, gap_col: str, labels: pd.Series,
                   row: Mapping[str, Any] | None, larger_is_sharper: bool) -> bytes:
    """One measure against the gap, Kendall τ (oriented, with its CI) in the title."""
    fig = Figure(figsize=(5.0, 3.8), layout="constrained")
    ax = fig.add_subplot()
    markers = _marker_map(labels)
    scatter_panel(ax, frame, key, gap_col, labels, markers, f"{key}\n{_tau_text(row)}")
    ax.set_xlabel(gap_label(gap), fontsize=9)
    ax.set_ylabel(key + ("" if larger_is_sharper else "  (smaller = sharper)"), fontsize=9)
    if len(markers) > 1 and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, title="model", title_fontsize=7, loc="best", framealpha=0.8)
    _add_ratio_colorbar(fig, ax, frame, 9)
    return png_bytes(fig)


def _grid(n: int, max_cols: int = 5) -> tuple[int, int]:
    cols = max(1, min(max_cols, math.ceil(math.sqrt(max(n, 1)))))
    return math.ceil(max(n, 1) / cols), cols


def overview_figure(frame: pd.DataFrame, keys: list[str], gap: str, gap_col: str, labels: pd.Series,
                    rows: Mapping[str, Mapping[str, Any]]) -> bytes:
    """All measures' scatter plots on one page, in ranking order, with one shared colour bar."""
    nrows, ncols = _grid(len(keys))
    fig = Figure(figsize=(2.7 * ncols + 1.0, 2.3 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    markers = _marker_map(labels)
    if not keys:
        _empty(axes[0], "no measure values", 9)
    for ax, key in zip(axes, keys):
        row = rows.get(key)
        tau = row.get("kendall_tau") if row else math.nan
        tau_txt = f"τ = {tau:.2f}" if tau is not None and math.isfinite(tau) else "τ n/a"
        scatter_panel(ax, frame, key, gap_col, labels, markers, f"{key}\n{tau_txt}", small=True)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    fig.supxlabel(gap_label(gap), fontsize=9)
    if _ratios(frame) is not None and keys:
        cbar = fig.colorbar(ScalarMappable(norm=RATIO_NORM, cmap=CMAP), ax=list(axes[:len(keys)]),
                            shrink=0.6)
        cbar.set_label("random-label ratio", fontsize=8)
        cbar.ax.tick_params(labelsize=7)
    if len(markers) > 1 and keys:
        handles = [axes[0].scatter([], [], marker=m, color="0.6", edgecolors="black", linewidths=0.4)
                   for m in markers.values()]
        fig.legend(handles, list(markers), loc="outside upper center", ncols=min(len(markers), 4),
                   fontsize=7, title="model", title_fontsize=7)
    return png_bytes(fig)


def ranking_figure(corr: pd.DataFrame) -> bytes:
    """Kendall τ per measure with its 95% bootstrap interval, best at the top."""
    n = len(corr)
    fig = Figure(figsize=(6.0, 0.32 * max(n, 1) + 1.3), layout="constrained")
    ax = fig.add_subplot()
    if n == 0:
        _empty(ax, "no measures", 9)
        return png_bytes(fig)
    y = np.arange(n)[::-1]
    tau = corr["kendall_tau"].to_numpy(dtype=float)
    lo = corr["kendall_tau_lo"].to_numpy(dtype=float)
    hi = corr["kendall_tau_hi"].to_numpy(dtype=float)
    has_ci = np.isfinite(lo) & np.isfinite(hi) & np.isfinite(tau)
    if has_ci.any():
        ax.errorbar(tau[has_ci], y[has_ci], xerr=[tau[has_ci] - lo[has_ci], hi[has_ci] - tau[has_ci]],
                    fmt="none", ecolor="black", elinewidth=1.0, capsize=3)
    ok = np.isfinite(tau)
    ax.scatter(tau[ok], y[ok], marker="o", s=36, color="black", zorder=3)
    for yi in y[~ok]:
        ax.text(0.0, yi, "n/a", ha="center", va="center", fontsize=8, color="0.3")
    ax.axvline(0.0, color="0.4", linewidth=0.8, linestyle="--")
    ax.set_yticks(y)
    ax.set_yticklabels(corr["measure"].astype(str).tolist(), fontsize=8)
    ax.set_xlim(-1.05, 1.05)
    ax.set_xlabel("Kendall τ with the gap (95% bootstrap CI); > 0 = tracks the gap", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="x", linewidth=0.3, alpha=0.5)
    return png_bytes(fig)


def vs_ratio_figure(frame: pd.DataFrame, keys: list[str], gap: str, gap_col: str,
                    labels: pd.Series) -> bytes:
    """Gap and every measure against the random-label ratio: mean ± std over seeds, one line per model."""
    panels = [gap_col, *keys]
    nrows, ncols = _grid(len(panels))
    fig = Figure(figsize=(2.7 * ncols + 0.6, 2.3 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    ratios = _ratios(frame)
    models = sorted(set(labels))
    # Spaced along viridis but short of its pale yellow end, which vanishes on white paper.
    colors = [colormaps["viridis"](v) for v in np.linspace(0.0, 0.8, max(len(models), 1))]
    for ax, key in zip(axes, panels):
        title = gap_label(gap).replace("generalization ", "") if key == gap_col else key
        ax.set_title(title, fontsize=7)
        if ratios is None:
            _empty(ax, "no random-label ratio", 7)
            continue
        y_all = frame[key].to_numpy(dtype=float)
        drew = False
        for i, model in enumerate(models):
            sel = (labels.to_numpy() == model) & np.isfinite(y_all) & np.isfinite(ratios)
            if not sel.any():
                continue
            stats = pd.DataFrame({"r": ratios[sel], "y": y_all[sel]}).groupby("r")["y"].agg(["mean", "std"])
            ax.errorbar(stats.index.to_numpy(), stats["mean"].to_numpy(),
                        yerr=np.nan_to_num(stats["std"].to_numpy(), nan=0.0),
                        marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)],
                        color=colors[i], markeredgecolor="black", markeredgewidth=0.4, markersize=4,
                        linewidth=1.0, capsize=2, label=model)
            drew = True
        if not drew:
            _empty(ax, "no finite values", 7)
            continue
        if use_log(y_all[np.isfinite(y_all)]):
            ax.set_yscale("log")
        ax.tick_params(labelsize=6)
        ax.grid(True, linewidth=0.3, alpha=0.5)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.supxlabel("random-label ratio (mean ± std over seeds)", fontsize=9)
    if len(models) > 1:
        handles, names = axes[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, names, loc="outside upper center", ncols=min(len(models), 4), fontsize=7)
    return png_bytes(fig)


def agreement_figure(matrix: pd.DataFrame) -> bytes:
    """Heatmap of Kendall τ between measures (and the gap): which measures rank the runs alike."""
    n = len(matrix)
    size = min(max(3.2, 0.42 * n + 2.0), 16.0)
    fig = Figure(figsize=(size + 1.0, size), layout="constrained")
    ax = fig.add_subplot()
    if n == 0:
        _empty(ax, "no measures", 9)
        return png_bytes(fig)
    values = matrix.to_numpy(dtype=float)
    image = ax.imshow(np.ma.masked_invalid(values), cmap=colormaps[CMAP].with_extremes(bad="white"),
                      vmin=-1.0, vmax=1.0)
    fs = 8 if n <= 12 else 6
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xticklabels(matrix.columns.astype(str).tolist(), rotation=60, ha="right", fontsize=fs)
    ax.set_yticklabels(matrix.index.astype(str).tolist(), fontsize=fs)
    if n <= 20:
        mapper = ScalarMappable(norm=Normalize(-1.0, 1.0), cmap=CMAP)
        for i in range(n):
            for j in range(n):
                v = values[i, j]
                if not math.isfinite(v):
                    ax.text(j, i, "–", ha="center", va="center", fontsize=fs - 1, color="0.4")
                    continue
                r, g, b, _ = mapper.to_rgba(v)
                dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=fs - 1,
                        color="white" if dark else "black")
    cbar = fig.colorbar(image, ax=ax, shrink=0.8)
    cbar.set_label("Kendall τ", fontsize=8)
    cbar.ax.tick_params(labelsize=7)
    return png_bytes(fig)
