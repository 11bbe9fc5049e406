"""The ranking (`ranking_figure`: τ per measure with its interval and p) and Dziugaite et al.'s robust
view (`sign_error_figure`: the distribution of sign errors over environments)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import colormaps

from flatbench.analysis.fmt import p_phrase
from flatbench.analysis.plots.common import CMAP, empty_panel, new_figure, png_bytes
from flatbench.analysis.table import to_float


def ranking_figure(corr: pd.DataFrame) -> bytes:
    """Kendall τ per measure (the rows given, best at the top) with its interval where there is one;
    the permutation p-value on the right, in the report's one p format."""
    n = len(corr)
    fig = new_figure(7.6, 0.24 * max(n, 1) + 1.2)
    ax = fig.add_subplot()
    if n == 0:
        empty_panel(ax, "no measure has a τ", 9)
        return png_bytes(fig)
    y = np.arange(n)[::-1]
    tau = pd.to_numeric(corr["kendall_tau"], errors="coerce").to_numpy(dtype=float)
    lo = pd.to_numeric(corr["kendall_tau_lo"], errors="coerce").to_numpy(dtype=float)
    hi = pd.to_numeric(corr["kendall_tau_hi"], errors="coerce").to_numpy(dtype=float)
    has_ci = np.isfinite(lo) & np.isfinite(hi) & np.isfinite(tau)
    if has_ci.any():
        ax.errorbar(tau[has_ci], y[has_ci], xerr=[tau[has_ci] - lo[has_ci], hi[has_ci] - tau[has_ci]],
                    fmt="none", ecolor="black", elinewidth=1.0, capsize=2.5)
    ok = np.isfinite(tau)
    ax.scatter(tau[ok], y[ok], marker="o", s=26, color="black", zorder=3)
    for yi in y[~ok]:
        ax.text(0.0, yi, "n/a", ha="center", va="center", fontsize=7, color="0.3")
    ax.axvline(0.0, color="0.4", linewidth=0.8, linestyle="--")
    ax.set_yticks(y, corr["measure"].astype(str).tolist(), fontsize=7)
    ax.set_xlim(-1.05, 1.05)
    ax.set_ylim(-0.7, n - 0.3)
    if "kendall_p" in corr.columns:
        right = ax.twinx()
        right.set_ylim(ax.get_ylim())
        right.set_yticks(y, [p_phrase(p) if np.isfinite(to_float(p)) else "" for p in corr["kendall_p"]],
                         fontsize=6.5)
        right.tick_params(axis="y", length=0)
    ax.set_xlabel("Kendall τ with the gap (> 0: tracks the gap)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(True, axis="x", linewidth=0.3, alpha=0.5)
    return png_bytes(fig)


def sign_error_figure(environments: pd.DataFrame, order: list[str] | None = None, max_measures: int = 12) -> bytes:
    """Dziugaite et al.-style cumulative plot: per measure, the share of environments whose sign error is at
    most x (a step function), the worst environment marked with a dot. At most `max_measures` measures, in
    the order given (the ranking), so the figure stays readable; the legend sits beside the axes."""
    fig = new_figure(8.6, 4.2)
    ax = fig.add_subplot()
    if environments is None or not len(environments):
        empty_panel(ax, "no environment (no hyperparameter axis varies)", 9)
        return png_bytes(fig)
    present = set(environments["measure"])
    names = [m for m in (order or list(dict.fromkeys(environments["measure"]))) if m in present][:max_measures]
    cmap = colormaps[CMAP]
    for k, m in enumerate(names):
        e = np.sort(environments.loc[environments["measure"] == m, "sign_error"].to_numpy(dtype=float))
        e = e[np.isfinite(e)]
        if not len(e):
            continue
        steps = np.arange(1, len(e) + 1) / len(e)
        color = cmap(0.85 * k / max(1, len(names) - 1))
        ax.step(np.concatenate([[0.0], e, [1.0]]), np.concatenate([[0.0], steps, [1.0]]), where="post",
                color=color, linestyle=["-", "--", ":", "-."][k % 4], linewidth=1.3,
                label=f"{m} (mean {e.mean():.2f})")
        ax.plot([e[-1]], [1.0], "o", color=color, markersize=4, markeredgecolor="black", markeredgewidth=0.4)
    ax.axvline(0.5, color="0.5", linewidth=0.8, linestyle=":")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(0, 1.03)
    ax.set_xlabel("sign error of an environment (0: every pair ordered like the gap; 0.5: chance)", fontsize=8)
    ax.set_ylabel("share of environments with at most that error", fontsize=8)
    ax.tick_params(labelsize=7)
    n_env = environments.groupby("measure").size().max()
    ax.set_title(f"Sign error over environments (up to {n_env} per measure; top {len(names)} by τ)", fontsize=8)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, fontsize=6.5, loc="outside right upper", frameon=False)
    return png_bytes(fig)
