"""Kendall τ within strata: the headline τ compares runs of one data draw only (issue 42).

Why. Runs of one data draw share their training subset, test subset, label corruption and
initialization streams, so every configuration of a draw shares a per-draw offset of the gap. A pooled τ
over all pairs of runs scores a measure partly on whether it follows that offset: on the natural study's
accuracy gap 58% of the variance is such an offset, and a measure that misses it but orders the
configurations within each draw is ranked low (the verdict reversed when compared within draws). The
question a generalization measure answers is "which of these trained networks generalizes worse", asked
of networks trained on the same data. So the headline τ counts only pairs inside one draw:

    τ_strat = Σ_d (C_d − D_d) / sqrt(Σ_d Tx_d · Σ_d Ty_d),

C_d − D_d the concordant minus discordant pairs of draw d, Tx_d, Ty_d its pairs untied in the measure and
in the gap (τ-b's denominator, pooled over the strata). With one stratum it is τ-b itself, computed by the
same `kendall_batch` (the one-draw numbers are the pooled ones, exactly). With strata = configurations the
same formula is the **within-cell τ**: pairs of runs that share every hyperparameter and differ only in
their seed or draw (what a measure says about the noise of training, not about the hyperparameters).

The bootstrap of τ_strat (`blocked_pair_sums`) uses the two-way cluster bootstrap's weights of pairs of
distinct copies (`bootstrap.TwoWay.pair_sums`) on the within-draw pairs only: draw by draw, a quadratic
form in the configuration weights (a fifth of the dense work on 5 draws), equal to `TwoWay.pair_sums` of
the matrix masked to pairs of one draw (a test checks it).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata

from flatbench.analysis.stats.bootstrap import TwoWay
from flatbench.analysis.stats.kernels import kendall_batch, strata_pairs, tau_from_parts

CHUNK_ELEMENTS = 4_000_000


def stratified_kendall(x: np.ndarray, y: np.ndarray, strata: np.ndarray | None) -> np.ndarray:
    """τ_strat (module doc) of each row of x (R, n) with y (n,) or (R, n); NaN where a row is non-finite or
    no within-stratum pair is untied in x or in y. `strata` None or a single stratum: τ-b (`kendall_batch`)."""
    x = np.atleast_2d(np.asarray(x, dtype=float))
    y = np.broadcast_to(np.atleast_2d(np.asarray(y, dtype=float)), x.shape)
    if strata is None or len(np.unique(strata)) <= 1:
        return kendall_batch(x, y)
    i, j = strata_pairs(strata)
    out = np.full(len(x), np.nan)
    finite = np.flatnonzero(np.isfinite(x).all(axis=1) & np.isfinite(y).all(axis=1))
    chunk = max(1, CHUNK_ELEMENTS // max(len(i), 1))
    for start in range(0, len(finite), chunk):
        sel = finite[start:start + chunk]
        xr, yr = rankdata(x[sel], method="dense", axis=1), rankdata(y[sel], method="dense", axis=1)
        sx, sy = np.sign(xr[:, i] - xr[:, j]), np.sign(yr[:, i] - yr[:, j])
        out[sel] = tau_from_parts((sx * sy).sum(axis=1), np.count_nonzero(sx, axis=1).astype(float),
                                  np.count_nonzero(sy, axis=1).astype(float))
    return out


def blocked_pair_sums(boot: TwoWay, matrix: np.ndarray) -> np.ndarray:
    """(n_boot,) Σ P_ij·M_ij over the pairs i < j of one draw, with the two-way bootstrap's pair weights
    P_ij (`TwoWay.pair_sums`); equal to `boot.pair_sums(matrix ∘ [d(i) = d(j)])`, draw by draw."""
    m = np.asarray(matrix, dtype=float)
    out = np.zeros(boot.weights.shape[0])
    for d in np.unique(boot.draws):
        idx = np.flatnonzero(boot.draws == d)
        md = m[np.ix_(idx, idx)]
        md = md - np.diag(np.diag(md))
        w = boot.cell_weights[:, boot.cells[idx]]
        s = np.einsum("bi,bi->b", w @ md, w)
        same = boot.cells[idx][:, None] == boot.cells[idx][None, :]
        np.fill_diagonal(same, False)
        if same.any():  # pairs of one configuration: α·w_c instead of w_c² (pairs of distinct copies)
            s -= (w * w - boot.alpha * w) @ (md * same).sum(axis=1)
        out += boot.beta * boot.draw_weights[:, d] * 0.5 * s
    return out


def blocked_boot_tau(boot: TwoWay, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """τ_strat* (by draw) of x against y on every resample of `boot` (NaN where undefined)."""
    sx = np.sign(x[:, None] - x[None, :])
    sy = np.sign(y[:, None] - y[None, :])
    key = ("blocked_y", y.tobytes())
    if key not in boot.cache:
        boot.cache[key] = blocked_pair_sums(boot, np.abs(sy))
    if "blocked_all" not in boot.cache:
        boot.cache["blocked_all"] = blocked_pair_sums(boot, np.ones_like(sx))
    dx = blocked_pair_sums(boot, np.abs(sx)) if (sx == 0).sum() > len(x) else boot.cache["blocked_all"]
    return tau_from_parts(blocked_pair_sums(boot, sx * sy), dx, boot.cache[key])
