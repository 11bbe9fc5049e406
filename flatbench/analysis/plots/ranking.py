"""The ranking (`ranking_figure`: τ per measure with its interval and p) and Dziugaite et al.'s robust
view (`sign_error_figure`: the distribution of sign errors over environments)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import colormaps

from flatbench.analysis.fmt import p_phrase
from flatbench.analysis.plots.common import CMAP, empty_panel, new_figure, png_bytes, wrap_key
from flatbench.analysis.table import to_float


def _references(ax: object, references: pd.DataFrame | None) -> None:
    """The floor (`ref.random`: its 95% band, shaded) and the ceiling (`ref.replicate_gap`: a line)."""
    if references is None or not len(references):
        return
    rows = {str(r["measure"]): r for r in references.to_dict(orient="records")}
    floor, ceiling = rows.get("ref.random"), rows.get("ref.replicate_gap")
    if floor is not None and np.isfinite(to_float(floor.get("kendall_tau_lo"))):
        ax.axvspan(to_float(floor["kendall_tau_lo"]), to_float(floor["kendall_tau_hi"]), color="#f4a582", alpha=0.35,
                   zorder=0, label="floor: pure noise, 95% band")
    if ceiling is not None and np.isfinite(to_float(ceiling.get("kendall_tau"))):
        ax.axvline(to_float(ceiling["kendall_tau"]), color="#2166ac", linewidth=1.2, linestyle="-.",
                   label="ceiling: the replicate gap")
    ax.legend(fontsize=6.5, loc="lower left", framealpha=0.85)


def ranking_figure(corr: pd.DataFrame, references: pd.DataFrame | None = None) -> bytes:
    """Kendall τ per measure (the rows given, best at the top) with its interval where there is one;
    the permutation p-value on the right, in the report's one p format; the floor and ceiling
    (`references`: the rows ref.random and ref.replicate_gap) drawn behind."""
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
    _references(ax, references)
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


def _cdf(errors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    e = np.sort(errors[np.isfinite(errors)])
    steps = np.arange(1, len(e) + 1) / max(len(e), 1)
    return np.concatenate([[0.0], e, [1.0]]), np.concatenate([[0.0], steps, [1.0]])


def sign_error_figure(environments: pd.DataFrame, order: list[str] | None = None, max_measures: int = 36,
                      floor: float | None = None) -> bytes:
    """Dziugaite et al.'s robust view, one small panel per measure (in the order given, the ranking): the
    cumulative share of environments whose sign error is at most x, against the ceiling (the replicate
    gap `ref.replicate_gap`'s curve, grey, where the environments hold it) and the floor (`floor`: the
    pure-noise reference's mean sign error, a dashed line; 0.5 is chance). Separate panels instead of
    overplotted lines: the measures' curves are often near-identical."""
    envs = environments if environments is not None else pd.DataFrame(columns=["measure", "sign_error"])
    present = set(envs["measure"]) if len(envs) else set()
    names = [m for m in (order or list(dict.fromkeys(envs["measure"]))) if m in present and not str(m).startswith("ref.")]
    names = names[:max_measures]
    if not names:
        fig = new_figure(8.6, 2.0)
        empty_panel(fig.add_subplot(), "no environment (no hyperparameter axis varies)", 9)
        return png_bytes(fig)
    ncols = min(6, len(names))
    nrows = -(-len(names) // ncols)
    fig = new_figure(10.0, 1.35 * nrows + 0.7)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True).ravel()
    ceiling = envs.loc[envs["measure"] == "ref.replicate_gap", "sign_error"].to_numpy(dtype=float)
    cmap = colormaps[CMAP]
    for ax, m in zip(axes, names):
        errors = envs.loc[envs["measure"] == m, "sign_error"].to_numpy(dtype=float)
        errors = errors[np.isfinite(errors)]
        if len(ceiling):
            ax.step(*_cdf(ceiling), where="post", color="0.6", linewidth=1.0, linestyle=":")
        if floor is not None and np.isfinite(floor):
            ax.axvline(floor, color="#b2182b", linewidth=0.9, linestyle="--")
        if len(errors):
            ax.step(*_cdf(errors), where="post", color=cmap(0.1), linewidth=1.4)
            ax.plot([errors.max()], [1.0], "o", color=cmap(0.1), markersize=3, markeredgecolor="black",
                    markeredgewidth=0.3)
        ax.set_title(f"{wrap_key(str(m), 30)}\nmean {errors.mean():.2f}, worst {errors.max():.2f} (n {len(errors)})"
                     if len(errors) else str(m), fontsize=5.5, loc="left")
        ax.tick_params(labelsize=5.5)
        ax.grid(True, linewidth=0.3, alpha=0.5)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    ax0 = axes[0]
    ax0.set_xlim(-0.02, 1.02)
    ax0.set_ylim(0, 1.05)
    fig.supxlabel("sign error of an environment (0: every pair ordered like the gap; 0.5: chance); share of "
                  "environments at most that error, the dot: the worst", fontsize=7)
    fig.suptitle("Sign error per measure (blue) against the ceiling (grey dotted: the replicate gap) and the floor "
                 "(red dashed: pure-noise measures' mean)", fontsize=8)
    return png_bytes(fig)
