"""The report's figures, drawn with matplotlib's object API on the Agg canvas.

No pyplot: figures are plain `Figure` objects rendered to PNG bytes and cleared, so a report over
hundreds of measures leaves no global figure state behind and runs on a headless cluster node.

Readability rules (print in black and white, small sizes): colour encodes only the random-label ratio
(and, in the heatmaps, the value of the cell), on a perceptually uniform map (cividis) whose lightness
alone orders the values; models and measures are told apart by marker shape and line style, never by hue
alone; every marker has a dark edge.

Figures: each measure against the gap (`measure_figure`, optional ±1 Monte-Carlo standard-error bars),
all of them on one page (`overview_figure`), the ranking with intervals and permutation p-values
(`ranking_figure`), measures against the random-label ratio (`vs_ratio_figure`), agreement between
measures (`agreement_figure`), paired differences of τ between measures (`comparison_figure`), training
curves coloured by ratio (`training_curves_figure`) and τ against the training-loss level at which the
models were snapshotted (`tau_by_level_figure`).
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
from matplotlib.ticker import MaxNLocator

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
                  markers: Mapping[str, str], title: str, small: bool = False,
                  se_column: str | None = None) -> None:
    """Measure (y) against the gap (x), colour = random-label ratio, marker = model; with `se_column`,
    vertical bars of ±1 standard error (grey, behind the markers) where it is finite."""
    fs = 7 if small else 9
    y = frame[key].to_numpy(dtype=float) if key in frame.columns else np.zeros(0)
    x = frame[gap_col].to_numpy(dtype=float) if len(frame) else np.zeros(0)
    ok = np.isfinite(x) & np.isfinite(y)
    ax.set_title(title, fontsize=fs)
    if not ok.any():
        _empty(ax, "no finite values", fs)
        return
    log = use_log(y[ok])
    if se_column is not None and se_column in frame.columns:
        se = np.abs(pd.to_numeric(frame[se_column], errors="coerce").to_numpy(dtype=float))
        bar = ok & np.isfinite(se)
        if bar.any():
            lower = se[bar]
            if log:  # a bar reaching 0 or below would vanish on a log axis: stop it just above 0
                lower = np.minimum(lower, y[bar] * (1.0 - 1e-3))
            ax.errorbar(x[bar], y[bar], yerr=[lower, se[bar]], fmt="none", ecolor="0.35",
                        elinewidth=0.8, capsize=2, zorder=1)
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
                       norm=RATIO_NORM, plotnonfinite=True, zorder=2, **kwargs)
        else:
            ax.scatter(x[sel], y[sel], color="0.5", zorder=2, **kwargs)
    if log:
        ax.set_yscale("log")
    ax.tick_params(labelsize=fs - 1)
    ax.grid(True, linewidth=0.3, alpha=0.5)


def _tau_text(row: Mapping[str, Any] | None) -> str:
    if row is None or not math.isfinite(float(row.get("kendall_tau", math.nan))):
        note = (row or {}).get("note") or "no correlation"
        return f"τ: n/a ({note.split(';')[0]})"
    lo, hi = _float(row.get("kendall_tau_lo")), _float(row.get("kendall_tau_hi"))
    ci = f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    p = _float(row.get("kendall_p"))
    p_txt = f", p = {_p_text(p)}" if math.isfinite(p) else ""
    return f"Kendall τ = {float(row['kendall_tau']):.2f}{ci}{p_txt}, n = {int(row['n'])}"


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _p_text(p: float) -> str:
    """A p-value as printed: two significant digits below 0.01 (0.0001), else three decimals (0.017)."""
    if not math.isfinite(p):
        return "n/a"
    if p >= 1.0:
        return "1"
    return f"{p:.2g}" if p < 0.01 else f"{p:.3f}"


def _add_ratio_colorbar(fig: Figure, ax: Any, frame: pd.DataFrame, fs: float) -> None:
    if _ratios(frame) is None:
        return
    cbar = fig.colorbar(ScalarMappable(norm=RATIO_NORM, cmap=CMAP), ax=ax)
    cbar.set_label("random-label ratio", fontsize=fs)
    cbar.ax.tick_params(labelsize=fs - 1)


def measure_figure(frame: pd.DataFrame, key: str, gap: str, gap_col: str, labels: pd.Series,
                   row: Mapping[str, Any] | None, larger_is_sharper: bool,
                   se_column: str | None = None) -> bytes:
    """One measure against the gap, Kendall τ (oriented, with its CI when there is one, and its
    permutation p-value) in the title; `se_column` adds ±1 Monte-Carlo standard-error bars."""
    fig = Figure(figsize=(5.0, 3.8), layout="constrained")
    ax = fig.add_subplot()
    markers = _marker_map(labels)
    scatter_panel(ax, frame, key, gap_col, labels, markers, f"{key}\n{_tau_text(row)}",
                  se_column=se_column)
    ax.set_xlabel(gap_label(gap), fontsize=9)
    ylabel = key + ("" if larger_is_sharper else "  (smaller = sharper)")
    if se_column is not None and se_column in frame.columns:
        ylabel += "\n(bars: ±1 Monte-Carlo standard error)"
    ax.set_ylabel(ylabel, fontsize=9)
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
    ax.set_ylim(-0.7, n - 0.3)
    if "kendall_p" in corr.columns:
        right = ax.twinx()
        right.set_ylim(ax.get_ylim())
        right.set_yticks(y)
        right.set_yticklabels([f"p = {_p_text(p)}" if math.isfinite(p) else ""
                               for p in corr["kendall_p"].to_numpy(dtype=float)], fontsize=7)
        right.tick_params(axis="y", length=0)
    ax.set_xlabel("Kendall τ with the gap (95% bootstrap CI where n allows; p: permutation test)"
                  "; > 0 = tracks the gap", fontsize=8)
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


# ------------------------------------------------------------------------------------- paired comparisons

def comparison_figure(comparisons: pd.DataFrame, order: list[str] | None = None,
                      level: float = 0.95) -> bytes:
    """Heatmap of τ_row − τ_col (paired over the runs both measures have; see `stats.paired_comparisons`).

    Cells whose paired interval contains 0, or that have no interval (too few shared runs), are hatched
    and their value is printed in parentheses: on this study those two measures cannot be told apart.
    """
    if order is None:
        order = list(dict.fromkeys([*comparisons.get("measure_a", pd.Series(dtype=object)).astype(str),
                                    *comparisons.get("measure_b", pd.Series(dtype=object)).astype(str)]))
    order = [str(m) for m in order]
    k = len(order)
    size = min(max(3.4, 0.45 * k + 2.2), 16.0)
    fig = Figure(figsize=(size + 1.2, size + 0.3), layout="constrained")
    ax = fig.add_subplot()
    if k == 0:
        _empty(ax, "no measures to compare", 9)
        return png_bytes(fig)
    pos = {m: i for i, m in enumerate(order)}
    diff = np.full((k, k), np.nan)
    distinct = np.zeros((k, k), dtype=bool)
    for r in comparisons.to_dict(orient="records"):
        a, b = str(r.get("measure_a")), str(r.get("measure_b"))
        if a not in pos or b not in pos or a == b:
            continue
        i, j = pos[a], pos[b]
        diff[i, j] = _float(r.get("diff"))
        lo, hi = _float(r.get("diff_lo")), _float(r.get("diff_hi"))
        distinct[i, j] = math.isfinite(lo) and math.isfinite(hi) and (lo > 0 or hi < 0)
    finite = diff[np.isfinite(diff)]
    vmax = max(0.05, float(np.abs(finite).max())) if len(finite) else 1.0
    norm = Normalize(-vmax, vmax)
    cmap = colormaps[CMAP].with_extremes(bad="white")
    image = ax.imshow(np.ma.masked_invalid(diff), cmap=cmap, norm=norm)
    fs = 8 if k <= 12 else 6
    ax.set_xticks(range(k))
    ax.set_yticks(range(k))
    ax.set_xticklabels(order, rotation=60, ha="right", fontsize=fs)
    ax.set_yticklabels(order, fontsize=fs)
    mapper = ScalarMappable(norm=norm, cmap=CMAP)
    from matplotlib.patches import Rectangle

    for i in range(k):
        for j in range(k):
            v = diff[i, j]
            if i == j or not math.isfinite(v):
                if k <= 20:
                    ax.text(j, i, "–", ha="center", va="center", fontsize=fs - 1, color="0.4")
                continue
            r, g, b, _ = mapper.to_rgba(v)
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
            ink = "white" if dark else "black"
            if not distinct[i, j]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1.0, 1.0, fill=False, hatch="///",
                                       edgecolor="0.85" if dark else "0.25", linewidth=0.0))
            if k <= 20:
                text = f"{v:+.2f}" if distinct[i, j] else f"({v:+.2f})"
                ax.text(j, i, text, ha="center", va="center", fontsize=fs - 1, color=ink,
                        fontweight="bold" if distinct[i, j] else "normal",
                        bbox=None if distinct[i, j] else {"boxstyle": "square,pad=0.05", "fc": (r, g, b),
                                                           "ec": "none"})
    ax.set_title(f"τ(row) − τ(column), paired over shared runs\nhatched, (…): the {level:.0%} paired "
                 "interval contains 0 or is not available", fontsize=8)
    cbar = fig.colorbar(image, ax=ax, shrink=0.8)
    cbar.set_label("τ(row) − τ(column)", fontsize=8)
    cbar.ax.tick_params(labelsize=7)
    return png_bytes(fig)


# ---------------------------------------------------------------------------------------- training curves

def _history_curves(history: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(epochs, train accuracy, test accuracy, whether train came from the evaluation pass) of a history.

    The train curve is `eval_train_acc` (accuracy measured in evaluation mode after the epoch) when the
    run recorded it on any epoch, else `train_acc` (the running accuracy during the epoch): one run's
    curve never mixes the two. Missing or non-finite values are NaN (gaps in the line).
    """
    entries = [h for h in (history or []) if isinstance(h, Mapping)]
    epochs = np.array([_float(h.get("epoch", i + 1)) for i, h in enumerate(entries)], dtype=float)
    use_eval = any(math.isfinite(_float(h.get("eval_train_acc"))) for h in entries)
    train = np.array([_float(h.get("eval_train_acc" if use_eval else "train_acc")) for h in entries])
    test = np.array([_float(h.get("test_acc")) for h in entries])
    bad = ~np.isfinite(epochs)
    epochs[bad] = np.flatnonzero(bad) + 1.0
    order = np.argsort(epochs, kind="stable")
    return epochs[order], train[order].astype(float), test[order].astype(float), use_eval


def training_curves_figure(histories: Any, ratios: Any = None) -> bytes:
    """Train (left) and test (right) accuracy per epoch of every run, coloured by random-label ratio.

    `histories`: one history per run (a list of per-epoch dicts with `epoch`, `train_acc` and optionally
    `eval_train_acc`, `test_acc`), as a list or a mapping run → history; `ratios`: each run's random-label
    ratio, aligned (NaN or None: drawn grey). Line width and opacity shrink with the number of runs; from
    20 runs on, the mean curve of each ratio is drawn on top as a thick line with a black outline, so 200
    runs stay readable in black and white.
    """
    from matplotlib import patheffects

    runs = list(histories.values()) if isinstance(histories, Mapping) else list(histories or [])
    given = [] if ratios is None else list(ratios.values()) if isinstance(ratios, Mapping) else list(ratios)
    ratio_values = np.array([_float(r) for r in given[:len(runs)]] + [math.nan] * (len(runs) - len(given)),
                            dtype=float)
    curves = [_history_curves(h) for h in runs]
    fig = Figure(figsize=(8.6, 3.6), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True, squeeze=False).ravel()
    n = len(curves)
    lw = 1.4 if n <= 8 else 0.9 if n <= 40 else 0.5
    alpha = 1.0 if n <= 20 else 0.55 if n <= 60 else 0.35
    cmap = colormaps[CMAP]
    any_eval = any(c[3] for c in curves)
    titles = ["train accuracy" + (" (evaluation pass where recorded)" if any_eval else ""),
              "test accuracy"]
    values_seen: list[np.ndarray] = []
    for panel, ax in enumerate(axes):
        ax.set_title(titles[panel], fontsize=9)
        drew = False
        for (epochs, train, test, _), ratio in zip(curves, ratio_values):
            y = train if panel == 0 else test
            if not np.isfinite(y).any():
                continue
            color = cmap(RATIO_NORM(ratio)) if math.isfinite(ratio) else "0.6"
            few = np.isfinite(y).sum() <= 3
            ax.plot(epochs, y, color=color, linewidth=lw, alpha=alpha, marker="o" if few else None,
                    markersize=4, markeredgecolor="black", markeredgewidth=0.4)
            values_seen.append(y[np.isfinite(y)])
            drew = True
        if drew and n >= 20 and np.isfinite(ratio_values).any():
            for ratio in np.unique(ratio_values[np.isfinite(ratio_values)]):
                members = [c for c, r in zip(curves, ratio_values) if r == ratio]
                frame = pd.concat([pd.Series(c[1] if panel == 0 else c[2], index=c[0]) for c in members],
                                  axis=1)
                frame = frame.groupby(level=0).mean()
                mean = frame.mean(axis=1, skipna=True)
                if not np.isfinite(mean.to_numpy(dtype=float)).any():
                    continue
                ax.plot(mean.index.to_numpy(dtype=float), mean.to_numpy(dtype=float),
                        color=cmap(RATIO_NORM(ratio)), linewidth=2.2, zorder=3,
                        path_effects=[patheffects.withStroke(linewidth=3.6, foreground="black")])
        if not drew:
            _empty(ax, "no " + ("train" if panel == 0 else "test") + " accuracy recorded", 8)
            continue
        ax.set_xlabel("epoch", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        ax.grid(True, linewidth=0.3, alpha=0.5)
    seen = np.concatenate(values_seen) if values_seen else np.zeros(0)
    if len(seen) and seen.min() >= 0.0 and seen.max() <= 1.0:
        axes[0].set_ylim(-0.02, 1.02)
    axes[0].set_ylabel("accuracy" + (" (thick: mean per ratio)" if n >= 20 else ""), fontsize=9)
    if np.isfinite(ratio_values).any():
        cbar = fig.colorbar(ScalarMappable(norm=RATIO_NORM, cmap=CMAP), ax=list(axes), shrink=0.85)
        cbar.set_label("random-label ratio" + (" (grey: unknown)" if (~np.isfinite(ratio_values)).any()
                                               else ""), fontsize=8)
        cbar.ax.tick_params(labelsize=7)
    fig.suptitle(f"training curves of {n} run{'s' if n != 1 else ''}", fontsize=9)
    return png_bytes(fig)


# --------------------------------------------------------------------------------- τ by training level

FINAL_LEVEL = "final"


def _level_value(level: Any) -> float | str | None:
    """A level as a float (a train-loss value), "final", or None when it is neither."""
    if isinstance(level, str) and level.strip().lower() == FINAL_LEVEL:
        return FINAL_LEVEL
    value = _float(level)
    return value if math.isfinite(value) else None


def tau_by_level_figure(frame: pd.DataFrame) -> bytes:
    """Kendall τ of each measure against the train-loss level at which the models were snapshotted.

    `frame`: columns measure, level (a float train-loss level, or "final" for the final models),
    kendall_tau, kendall_tau_lo, kendall_tau_hi, n. The x axis runs from high to low loss (training goes
    on to the right), logarithmic when every float level is positive; "final" sits half a decade beyond
    the lowest level, past a dotted separator. Bars are the intervals where the row has one. Up to four
    measures share one panel (told apart by marker and line style, in greys); more get one small panel
    each, with shared axes. Tick labels carry the number of runs at each level (the largest n there).
    """
    from matplotlib.ticker import NullLocator

    data = frame.copy() if frame is not None else pd.DataFrame()
    for col in ("measure", "level", "kendall_tau", "kendall_tau_lo", "kendall_tau_hi", "n"):
        if col not in data.columns:
            data[col] = np.nan
    data["lv"] = [_level_value(v) for v in data["level"]]
    data = data[data["lv"].notna()]
    measures = list(dict.fromkeys(data["measure"].astype(str)))
    floats = sorted({v for v in data["lv"] if v != FINAL_LEVEL}, reverse=True)
    has_final = any(v == FINAL_LEVEL for v in data["lv"])
    log = bool(floats) and min(floats) > 0
    if floats:
        if log:
            final_x = min(floats) / 10 ** 0.5
        else:
            span = (max(floats) - min(floats)) or 1.0
            final_x = min(floats) - 0.2 * span
    else:
        final_x = 0.0
    data["x"] = [final_x if v == FINAL_LEVEL else float(v) for v in data["lv"]]

    single = len(measures) <= 4
    nrows, ncols = (1, 1) if single else _grid(len(measures), max_cols=4)
    fig = Figure(figsize=(6.0, 3.8) if single else (2.6 * ncols + 0.6, 2.2 * nrows + 0.8),
                 layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True).ravel()
    if not measures:
        _empty(axes[0], "no τ per level", 9)
        return png_bytes(fig)
    greys = ("0.0", "0.45", "0.0", "0.45")
    fs = 8 if single else 7
    for idx, measure in enumerate(measures):
        ax = axes[0] if single else axes[idx]
        style = idx if single else 0
        part = data[data["measure"].astype(str) == measure].sort_values("x", ascending=False)
        x = part["x"].to_numpy(dtype=float)
        if single and len(measures) > 1:  # dodge sideways so that the bars of different measures separate
            shift = (idx - (len(measures) - 1) / 2) * 0.035
            if log:
                x = x * 10 ** shift
            else:
                x = x + shift * (((max(floats) - min(floats)) or 1.0) if floats else 1.0)
        tau = pd.to_numeric(part["kendall_tau"], errors="coerce").to_numpy(dtype=float)
        lo = pd.to_numeric(part["kendall_tau_lo"], errors="coerce").to_numpy(dtype=float)
        hi = pd.to_numeric(part["kendall_tau_hi"], errors="coerce").to_numpy(dtype=float)
        is_final = (part["lv"] == FINAL_LEVEL).to_numpy()
        ok = np.isfinite(tau)
        color, marker = greys[style % len(greys)], MARKERS[style % len(MARKERS)]
        line = LINESTYLES[style % len(LINESTYLES)]
        ci = ok & np.isfinite(lo) & np.isfinite(hi)
        if ci.any():
            yerr = [np.maximum(tau[ci] - lo[ci], 0), np.maximum(hi[ci] - tau[ci], 0)]
            ax.errorbar(x[ci], tau[ci], yerr=yerr,
                        fmt="none", ecolor=color, elinewidth=0.8, capsize=2, alpha=0.8)
        curve = ok & ~is_final
        if curve.any():
            ax.plot(x[curve], tau[curve], linestyle=line, color=color, linewidth=1.1, marker=marker,
                    markersize=4.5, markerfacecolor="white" if style % 2 else color, markeredgecolor="black",
                    markeredgewidth=0.6, label=measure if single else None)
        fin = ok & is_final
        if fin.any():
            if curve.any():
                last = np.flatnonzero(curve)[-1]
                ax.plot([x[last], x[fin][0]], [tau[last], tau[fin][0]], linestyle=":", color=color,
                        linewidth=0.8)
            ax.plot(x[fin], tau[fin], linestyle="none", marker=marker, markersize=5.5,
                    markerfacecolor="white" if style % 2 else color, markeredgecolor="black",
                    markeredgewidth=0.6, label=measure if single and not curve.any() else None)
        if not single:
            ax.set_title(measure, fontsize=7)
            if not ok.any():
                ax.text(0.5, 0.5, "τ n/a", ha="center", va="center", transform=ax.transAxes, fontsize=7,
                        color="0.3")
    # Shared axis layout.
    positions = sorted(set(data["x"]), reverse=True)
    n_at = data.assign(n=pd.to_numeric(data["n"], errors="coerce")).groupby("x")["n"].max()
    labels = []
    for pos_x in positions:
        text = FINAL_LEVEL if (has_final and pos_x == final_x) else f"{pos_x:g}"
        n_here = n_at.get(pos_x, math.nan)
        labels.append(text + (f"\nn={int(n_here)}" if math.isfinite(n_here) else ""))
    for ax in axes[:1 if single else len(measures)]:
        if log:
            ax.set_xscale("log")
        if len(positions) <= 12:
            ax.set_xticks(positions)
            ax.set_xticklabels(labels, fontsize=fs - 1)
            ax.xaxis.set_minor_locator(NullLocator())
        if log:
            left, right = max(positions) * 10 ** 0.25, min(positions) / 10 ** 0.25
        else:
            span = (max(positions) - min(positions)) or 1.0
            left, right = max(positions) + 0.1 * span, min(positions) - 0.1 * span
        ax.set_xlim(left, right)  # high loss on the left: training goes on to the right
        if has_final and floats:
            sep = math.sqrt(min(floats) * final_x) if log else (min(floats) + final_x) / 2
            ax.axvline(sep, color="0.5", linewidth=0.6, linestyle=":")
        ax.axhline(0.0, color="0.4", linewidth=0.8, linestyle="--")
        ax.set_ylim(-1.05, 1.05)
        ax.tick_params(labelsize=fs - 1)
        ax.grid(True, axis="y", linewidth=0.3, alpha=0.5)
    if not single:
        for ax in axes[len(measures):]:
            ax.set_visible(False)
    xlabel, ylabel = "train-loss level of the snapshot (training goes on →)", "Kendall τ with the gap"
    if single:
        axes[0].set_xlabel(xlabel, fontsize=fs + 1)
        axes[0].set_ylabel(ylabel, fontsize=fs + 1)
    else:
        fig.supxlabel(xlabel, fontsize=fs + 1)
        fig.supylabel(ylabel, fontsize=fs + 1)
    if single:
        handles, names = axes[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, names, loc="outside lower center", ncols=min(len(names), 2), fontsize=7)
    return png_bytes(fig)


# ----------------------------------------------------------------------------------------- audit figures

HEATMAP_FLOOR = 1e-16
"""Relative changes below this (including exact zeros) are drawn at this value on the log scale."""


def audit_heatmap_figure(summary: Any, title: str = "") -> bytes:
    """Measure × family heatmap of the median relative change under function-preserving transformations
    (log colour scale; red frame: declared invariant); `summary` is an `analysis.audit_tables.Summary`."""
    import matplotlib
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    med = summary.median
    n_rows, n_cols = med.shape
    data = med.to_numpy(dtype=float)
    shown = np.where(np.isnan(data), np.nan, np.clip(data, HEATMAP_FLOOR, None))
    finite = shown[np.isfinite(shown)]
    vmax = max(1.0, float(finite.max())) if finite.size else 1.0
    fig = Figure(figsize=(2.0 + 1.25 * max(n_cols, 1), 1.2 + 0.38 * max(n_rows, 1)), layout="constrained")
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("#d9d9d9")
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


def audit_correlations_figure(corr: pd.DataFrame, gap: str, family: str) -> bytes:
    """Paired bars: each measure's Kendall τ with the gap before and after one transformation per run."""

    n = len(corr)
    fig = Figure(figsize=(6.4, 1.0 + 0.42 * max(n, 1)), layout="constrained")
    ax = fig.add_subplot()
    y = np.arange(n)
    before = corr["tau_original"].to_numpy(dtype=float)
    after = corr["tau_transformed"].to_numpy(dtype=float)
    ax.barh(y - 0.2, np.nan_to_num(before), height=0.38, color="#4d4d4d", label="original")
    ax.barh(y + 0.2, np.nan_to_num(after), height=0.38, color="#bdbdbd", edgecolor="black", hatch="//",
            label=f"after {family} transformation")
    labels = [f"{m}{' *' if d else ''}" for m, d in zip(corr["measure"], corr["declared_invariant"])]
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlim(-1, 1)
    ax.set_xlabel(f"Kendall τ with the {gap} gap (* declared invariant to {family})", fontsize=8)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside upper center", ncols=2)
    return png_bytes(fig)
