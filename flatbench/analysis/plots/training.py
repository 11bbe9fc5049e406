"""Training curves: accuracy and loss per epoch of every run, coloured by the random-label ratio.

Training records the running train accuracy and loss of every epoch from the first, and evaluates the
test set only every `train.eval_every` epochs. The train panels therefore start at epoch 1 (a study
that evaluates first at epoch 35 would otherwise show a flat line at 1.0), the loss panel draws the
target train loss that stops training, and each test curve is drawn through its evaluated epochs with a
marker on every one of them (a line through the missing epochs would break into invisible points)."""

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
        series = [pd.Series(c[1][panel], index=c[0]).dropna() for c in members]
        series = [s.groupby(level=0).mean() for s in series if len(s)]
        if not series:
            continue
        mean = pd.concat(series, axis=1).mean(axis=1, skipna=True).sort_index()
        ax.plot(mean.index.to_numpy(dtype=float), mean.to_numpy(dtype=float), color=cmap(RATIO_NORM(ratio)),
                linewidth=2.2, zorder=3, path_effects=[patheffects.withStroke(linewidth=3.6, foreground="black")])


PANELS = ("train accuracy (running, every epoch)", "test accuracy", "train loss (running, every epoch)", "test loss")
"""The four panels: training quantities every epoch from epoch 1 (the running values of each epoch), the
test set at the evaluated epochs (markers)."""


def epoch_curves(history: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """(epochs, [train acc, test acc, train loss, test loss]) of a history, sorted by epoch: the running
    `train_acc` / `train_loss` of every epoch (an evaluated value where a running one is missing), the test
    values where evaluated (NaN elsewhere)."""
    entries = [h for h in (history or []) if isinstance(h, Mapping)]
    epochs = np.array([to_float(h.get("epoch", i + 1)) for i, h in enumerate(entries)], dtype=float)
    bad = ~np.isfinite(epochs)
    epochs[bad] = np.flatnonzero(bad) + 1.0

    def series(key: str, fallback: str = "") -> np.ndarray:
        vals = [to_float(h.get(key)) for h in entries]
        if fallback:
            vals = [v if math.isfinite(v) else to_float(h.get(fallback)) for v, h in zip(vals, entries)]
        return np.array(vals, dtype=float)

    order = np.argsort(epochs, kind="stable")
    curves = [series("train_acc", "eval_train_acc"), series("test_acc"), series("train_loss", "eval_train_loss"),
              series("test_loss")]
    return epochs[order], [c[order] for c in curves]


def _panel(ax: Any, curves: list[tuple], ratio_values: np.ndarray, names: list[str], panel: int) -> list:
    """One panel (`PANELS`); returns the values drawn. The test panels mark every evaluated epoch."""
    cmap = colormaps[CMAP]
    lw, alpha, ms = _style(len(curves))
    seen = []
    for (epochs, series), ratio, name in zip(curves, ratio_values, names):
        y = series[panel]
        keep = np.isfinite(y) & ((y > 0) if panel >= 2 else True)
        if not keep.any():
            continue
        color = cmap(RATIO_NORM(ratio)) if math.isfinite(ratio) else "0.6"
        marker = "o" if panel in (1, 3) or keep.sum() == 1 else None
        (line,) = ax.plot(epochs[keep], y[keep], color=color, linewidth=lw, alpha=alpha, marker=marker,
                          markersize=ms, markeredgecolor="black", markeredgewidth=0.3)
        line.set_gid(name)
        seen.append(y[keep])
    if seen and len(curves) >= 20 and np.isfinite(ratio_values).any():
        _mean_curves(ax, curves, ratio_values, panel)
    return seen


def draw_training_curves(histories: Any, ratios: Any = None, target_loss: float | None = None) -> Figure:
    """The training-curves figure, not yet rendered (tests read its lines: each run's `Line2D` has the
    run's name as gid; the train panels hold every epoch from the first, the test panels the evaluated
    epochs, with a marker on each).

    `histories`: one history per run (a list of per-epoch dicts with `epoch`, `train_acc`, `train_loss`
    and, at evaluated epochs, `test_acc`, `test_loss`), as a list or a mapping run → history; `ratios`:
    each run's random-label ratio, aligned (NaN or None: drawn grey); `target_loss`: the
    `train.target_train_loss` that stops training, drawn as a dashed line on the train-loss panel. From
    20 runs on, the mean curve of each ratio is drawn on top, thick with a black outline.
    """
    names = [str(k) for k in histories] if isinstance(histories, Mapping) else []
    runs = list(histories.values()) if isinstance(histories, Mapping) else list(histories or [])
    names = names or [f"run {i}" for i in range(len(runs))]
    given = [] if ratios is None else list(ratios.values()) if isinstance(ratios, Mapping) else list(ratios)
    ratio_values = np.array([to_float(r) for r in given[:len(runs)]] + [math.nan] * (len(runs) - len(given)),
                            dtype=float)
    curves = [epoch_curves(h) for h in runs]
    fig = new_figure(9.0, 5.6)
    axes = fig.subplots(2, 2, squeeze=False).ravel()
    for panel, ax in enumerate(axes):
        ax.set_title(PANELS[panel], fontsize=9)
        drawn = _panel(ax, curves, ratio_values, names, panel)
        if not drawn:
            empty_panel(ax, f"no {PANELS[panel].split(' (')[0]} recorded", 8)
            continue
        ax.set_xlabel("epoch (from 1" + ("; markers: evaluated epochs)" if panel in (1, 3) else ")"), fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(which="both", labelsize=7.5)
        ax.grid(True, linewidth=0.3, alpha=0.5)
        if panel < 2:
            ax.set_ylim(-0.02, 1.02)
        else:
            ax.set_yscale("log")
        if panel == 2 and target_loss is not None and math.isfinite(to_float(target_loss)):
            ax.axhline(float(target_loss), color="black", linestyle="--", linewidth=1.0)
            ax.annotate(f"target train loss {float(target_loss):g}", (0.99, float(target_loss)),
                        xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=7)
    axes[0].set_ylabel("accuracy" + (" (thick: mean per ratio)" if len(curves) >= 20 else ""), fontsize=8)
    axes[2].set_ylabel("cross-entropy (log)", fontsize=8)
    if np.isfinite(ratio_values).any():
        ratio_colorbar(fig, list(axes), 8, shrink=0.85, ratios=ratio_values)
    fig.suptitle(f"training curves of {len(curves)} run{'s' if len(curves) != 1 else ''}", fontsize=9)
    return fig


def training_curves_figure(histories: Any, ratios: Any = None, target_loss: float | None = None) -> bytes:
    """`draw_training_curves` as PNG bytes."""
    return png_bytes(draw_training_curves(histories, ratios, target_loss))
