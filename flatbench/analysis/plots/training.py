"""Training curves: train and test accuracy per epoch of every run, coloured by the random-label ratio.

Studies evaluate the whole training and test sets only every `train.eval_every` epochs, so a run's
history has values at some epochs and none at the others. Each curve is drawn through the epochs that
have a value, with a marker on every one of them: a line through the missing epochs would break into
single points that no line style shows (which left the committed studies' curves blank)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps, patheffects
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from flatbench.analysis.plots.common import (
    CMAP,
    RATIO_NORM,
    empty_panel,
    new_figure,
    png_bytes,
    ratio_colorbar,
)
from flatbench.analysis.table import to_float


def history_curves(history: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(epochs, train accuracy, test accuracy, whether train came from the evaluation pass) of a history.

    The train curve is `eval_train_acc` (accuracy measured in evaluation mode after the epoch) when the
    run recorded it on any epoch, else `train_acc` (the running accuracy during the epoch): one run's
    curve never mixes the two. Missing or non-finite values are NaN.
    """
    entries = [h for h in (history or []) if isinstance(h, Mapping)]
    epochs = np.array([to_float(h.get("epoch", i + 1)) for i, h in enumerate(entries)], dtype=float)
    use_eval = any(math.isfinite(to_float(h.get("eval_train_acc"))) for h in entries)
    train = np.array([to_float(h.get("eval_train_acc" if use_eval else "train_acc")) for h in entries])
    test = np.array([to_float(h.get("test_acc")) for h in entries])
    bad = ~np.isfinite(epochs)
    epochs[bad] = np.flatnonzero(bad) + 1.0
    order = np.argsort(epochs, kind="stable")
    return epochs[order], train[order].astype(float), test[order].astype(float), use_eval


def _style(n: int) -> tuple[float, float, float]:
    """(line width, opacity, marker size) for n runs: thinner and lighter as runs are added."""
    if n <= 8:
        return 1.4, 1.0, 3.5
    if n <= 40:
        return 0.9, 0.8, 2.6
    return 0.5, 0.45, 1.8


def _mean_curves(ax: Any, curves: list[tuple], ratio_values: np.ndarray, panel: int) -> None:
    """From 20 runs on: the mean curve of each ratio over its runs' evaluated epochs, thick and outlined."""
    cmap = colormaps[CMAP]
    for ratio in np.unique(ratio_values[np.isfinite(ratio_values)]):
        members = [c for c, r in zip(curves, ratio_values) if r == ratio]
        series = [pd.Series(c[1 + panel], index=c[0]).dropna() for c in members]
        series = [s.groupby(level=0).mean() for s in series if len(s)]
        if not series:
            continue
        mean = pd.concat(series, axis=1).mean(axis=1, skipna=True).sort_index()
        ax.plot(mean.index.to_numpy(dtype=float), mean.to_numpy(dtype=float), color=cmap(RATIO_NORM(ratio)),
                linewidth=2.2, zorder=3, path_effects=[patheffects.withStroke(linewidth=3.6, foreground="black")])


def _panel(ax: Any, curves: list[tuple], ratio_values: np.ndarray, names: list[str], panel: int) -> list:
    """One panel (0: train, 1: test); returns the values drawn."""
    cmap = colormaps[CMAP]
    lw, alpha, ms = _style(len(curves))
    seen = []
    for (epochs, train, test, _), ratio, name in zip(curves, ratio_values, names):
        y = train if panel == 0 else test
        keep = np.isfinite(y)
        if not keep.any():
            continue
        color = cmap(RATIO_NORM(ratio)) if math.isfinite(ratio) else "0.6"
        (line,) = ax.plot(epochs[keep], y[keep], color=color, linewidth=lw, alpha=alpha, marker="o",
                          markersize=ms, markeredgecolor="black", markeredgewidth=0.3)
        line.set_gid(name)
        seen.append(y[keep])
    if seen and len(curves) >= 20 and np.isfinite(ratio_values).any():
        _mean_curves(ax, curves, ratio_values, panel)
    return seen


def draw_training_curves(histories: Any, ratios: Any = None) -> Figure:
    """The training-curves figure, not yet rendered (tests read its lines: each run's `Line2D` has the
    run's name as gid and one point per evaluated epoch).

    `histories`: one history per run (a list of per-epoch dicts with `epoch`, `train_acc` and optionally
    `eval_train_acc`, `test_acc`), as a list or a mapping run → history; `ratios`: each run's random-label
    ratio, aligned (NaN or None: drawn grey). From 20 runs on, the mean curve of each ratio is drawn on
    top as a thick line with a black outline, so 200 runs stay readable in black and white.
    """
    names = [str(k) for k in histories] if isinstance(histories, Mapping) else []
    runs = list(histories.values()) if isinstance(histories, Mapping) else list(histories or [])
    names = names or [f"run {i}" for i in range(len(runs))]
    given = [] if ratios is None else list(ratios.values()) if isinstance(ratios, Mapping) else list(ratios)
    ratio_values = np.array([to_float(r) for r in given[:len(runs)]] + [math.nan] * (len(runs) - len(given)),
                            dtype=float)
    curves = [history_curves(h) for h in runs]
    fig = new_figure(9.0, 3.6)
    axes = fig.subplots(1, 2, sharey=True, squeeze=False).ravel()
    any_eval = any(c[3] for c in curves)
    titles = ["train accuracy" + (" (evaluation pass)" if any_eval else ""), "test accuracy"]
    values: list[np.ndarray] = []
    for panel, ax in enumerate(axes):
        ax.set_title(titles[panel], fontsize=9)
        drawn = _panel(ax, curves, ratio_values, names, panel)
        if not drawn:
            empty_panel(ax, "no " + ("train" if panel == 0 else "test") + " accuracy recorded", 8)
            continue
        values.extend(drawn)
        ax.set_xlabel("epoch (markers: evaluated epochs)", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7.5)
        ax.grid(True, linewidth=0.3, alpha=0.5)
    seen = np.concatenate(values) if values else np.zeros(0)
    if len(seen) and seen.min() >= 0.0 and seen.max() <= 1.0:
        axes[0].set_ylim(-0.02, 1.02)
    axes[0].set_ylabel("accuracy" + (" (thick: mean per ratio)" if len(curves) >= 20 else ""), fontsize=8)
    if np.isfinite(ratio_values).any():
        ratio_colorbar(fig, list(axes), 8, shrink=0.85)
    fig.suptitle(f"training curves of {len(curves)} run{'s' if len(curves) != 1 else ''}", fontsize=9)
    return fig


def training_curves_figure(histories: Any, ratios: Any = None) -> bytes:
    """`draw_training_curves` as PNG bytes."""
    return png_bytes(draw_training_curves(histories, ratios))
