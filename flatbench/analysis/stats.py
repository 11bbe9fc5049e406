"""Does a measure track the generalization gap? Rank statistics with honest uncertainty.

For every headline measure (a `name` or `name@loss` column of the table) against the gap:

* Kendall τ-b, Spearman ρ and Pearson r over the runs where the measure has a value (n).
* A permutation p-value for Kendall τ (`kendall_p`, see `kendall_permutation_pvalues`): two-sided, H0 =
  no association between the measure and the gap. The statistic is |C − D| (the numerator of τ-b; its
  denominator does not change when the gap is permuted, so this is the same test as |τ-b|). When
  n! ≤ `n_perm` every permutation of the gap is enumerated and p = #{π : |τ(π)| ≥ |τ_obs|} / n! (the
  observed order is one of the n!, e.g. a perfectly monotone n = 5 gives p = 2/120); otherwise
  p = (b + 1) / (m + 1) over m = `n_perm` random permutations, b of which reach |τ_obs| (Phipson & Smyth
  2010, "Permutation p-values should never be zero"). The permutations come from
  `np.random.default_rng(seed).permuted(np.tile(np.arange(n), (m, 1)), axis=1)`, so a p-value depends
  only on the data and the seed.
* 95% percentile-bootstrap intervals for τ, ρ and r, but only from `MIN_CI_RUNS` runs on (see there
  for why); below it the interval is NaN and the note says "n < 10: no interval; see the p-value". The
  bootstrap resamples runs with replacement from `np.random.default_rng(seed).integers(0, n,
  size=(n_boot, n))` (see `bootstrap_ci`), so a report is reproducible.
* Paired comparisons between measures (`paired_comparisons`): τ_A − τ_B over the runs where both have a
  value, with a paired-bootstrap 95% interval and p-value; `vs_best` says whether each measure is
  distinguishable from the best one on this study.
* For Monte-Carlo measures (a `<key>#se` column in the table, see `table.stderr_columns`): the median
  standard error over the runs (`se_median`) and its ratio to the spread of the measure between runs
  (`se_ratio`); from `SE_NOTE_RATIO` on, a note says the ranking is partly Monte-Carlo noise.
* Jiang et al. (2020, "Fantastic generalization measures and where to find them", §4) granulated Kendall
  coefficient: for each hyperparameter axis i, the mean over all combinations of the other axes' values
  of Kendall's τ among the runs that differ only in axis i; Ψ is the mean over axes. Within a group τ is
  Jiang et al.'s definition, the mean of sign(Δmeasure)·sign(Δgap) over pairs (τ-a: a tie scores 0).
* Jiang et al.'s conditional-mutual-information score (§5; the PGDL competition's metric): over ordered
  pairs of runs, V_g = sign(Δgap) and V_μ = sign(Δmeasure); conditioning on the pair's values U_S of a set
  S of axes, Î = I(V_μ; V_g | U_S) / H(V_g | U_S), and the score is the minimum over sets S of two axes.
  Conditioning on *every* varying axis leaves nothing to explain (each cell is one pair), so when exactly
  two axes vary the sets are the single axes. It needs at least two varying axes; it ignores the sign.

Direction: a measure whose registry entry says `larger_is_sharper=False` is negated before any
statistic, so that a positive number always means "tracks the gap".

Exclusions: runs that are not finished, have a train accuracy below `min_train_acc`, or a non-finite
loss or gap are left out of every statistic and returned with a reason, never silently dropped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import rankdata

from flatbench.analysis.table import headline_columns, stderr_columns, sweep_axes

MIN_RUNS = 3
"""Correlations over fewer runs than this are not reported (two points always have |τ| = 1)."""
MIN_CI_RUNS = 10
"""Bootstrap intervals (τ, ρ, r and the paired differences) are given from this many runs on; below, NaN.

Why 10. A bootstrap resample of n runs holds on average only n(1 − (1 − 1/n)^n) ≈ 0.63·n distinct runs
(3.4 at n = 5), so for small n the bootstrap distribution of τ is a handful of atoms, and whenever the
sample happens to be perfectly ordered every resample is too: the interval is [1, 1] however weak the
evidence. Percentile intervals of correlation coefficients are known to undercover in small samples
(Hall, Martin & Schucany 1989, "Better nonparametric bootstrap confidence intervals for the correlation
coefficient", J. Stat. Comput. Simul. 33:161-172), and n = 10 is the smallest sample Long & Cliff (1997,
"Confidence intervals for Kendall's tau", Br. J. Math. Stat. Psychol. 50:31-41) studied. Our own check
(bivariate normal runs, 400 samples per cell, 1000 resamples, this module's `bootstrap_ci`): nominal 95%
coverage of the true τ was 55% at n = 5 and 88% at n = 8 for τ = 0.85 (45% and 12% of the intervals
collapsed to a point), 80% at n = 5 for τ = 0.71, and 95-98% from n = 10 on for τ ∈ {0, 0.33, 0.71, 0.85}
(3.5% collapsed at n = 10, τ = 0.85). Below 10 runs the permutation p-value, which is exact for n ≤ 7
and valid for any n, is the honest summary. The intervals that do not use the bootstrap (Fisher z with
Fieller's variance, Long & Cliff's consistent-variance interval) also collapse to a point when every
pair of runs is concordant, so none of them is used instead.
"""
CI_LEVEL = 0.95
N_PERM = 9999
"""Random permutations for the Kendall τ p-value (all n! of them when n! ≤ N_PERM, i.e. n ≤ 7)."""
SE_NOTE_RATIO = 0.5
"""A measure whose median Monte-Carlo standard error is at least this fraction of its between-run standard
deviation gets a note. At 0.5 the noise variance is a quarter of the observed variance (reliability
≈ 0.75), which by Spearman's attenuation formula shrinks a correlation by a factor of about
√0.75 ≈ 0.87: enough to reorder measures whose τ differ by less than that."""
_PAIRWISE_LIMIT = 400
"""Above this many runs the bootstrap uses an O(n log n) τ per resample instead of the n×n sign arrays."""
_CHUNK_ELEMENTS = 4_000_000


# --------------------------------------------------------------------------------------------- direction

def directions(keys: list[str], notes: list[str] | None = None,
               known: Mapping[str, bool] | None = None) -> dict[str, bool]:
    """`larger_is_sharper` for every result key, as its measures.json entry records it (`known`, from the
    table's attrs); a key without a recorded direction reads as larger = sharper, with a note."""
    known = known or {}
    out = {key: bool(known.get(key, True)) for key in keys}
    unknown = [key for key in keys if key not in known]
    if unknown and notes is not None and known:
        notes.append(f"no recorded direction for {', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}: "
                     "read as larger = sharper")
    return out


# ----------------------------------------------------------------------------------- correlation kernels

def _constant(x: np.ndarray) -> np.ndarray:
    """Rows of a (B, n) array whose values are all equal (exactly: no floating-point tolerance)."""
    return np.ptp(x, axis=-1) == 0


def pearson_batch(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of each row pair of two (B, n) arrays; NaN (no warning) for a constant row."""
    x = np.atleast_2d(np.asarray(x, dtype=float))
    y = np.atleast_2d(np.asarray(y, dtype=float))
    bad = _constant(x) | _constant(y)
    xc = x - x.mean(axis=1, keepdims=True)
    yc = y - y.mean(axis=1, keepdims=True)
    # Scaling by the max keeps huge (1e30) or tiny measure values from overflowing the sums of squares.
    xc = xc / np.where(bad, 1.0, np.abs(xc).max(axis=1))[:, None]
    yc = yc / np.where(bad, 1.0, np.abs(yc).max(axis=1))[:, None]
    num = (xc * yc).sum(axis=1)
    den = np.sqrt((xc * xc).sum(axis=1) * (yc * yc).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(bad | (den == 0), np.nan, num / np.where(den == 0, 1.0, den))
    return np.clip(r, -1.0, 1.0)


def spearman_batch(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman ρ: Pearson r of the average ranks (ties share their mean rank, as scipy does)."""
    x = np.atleast_2d(np.asarray(x, dtype=float))
    y = np.atleast_2d(np.asarray(y, dtype=float))
    return pearson_batch(rankdata(x, axis=1), rankdata(y, axis=1))


def kendall_batch(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Kendall τ-b of each row pair: (C − D) / sqrt((pairs untied in x)(pairs untied in y)).

    Written over the n(n−1)/2 pairwise signs (of dense integer ranks, which have the same signs as the
    values) so that a thousand bootstrap resamples are one array operation; NaN when either row is
    constant or holds a non-finite value.
    """
    x = np.atleast_2d(np.asarray(x, dtype=float))
    y = np.atleast_2d(np.asarray(y, dtype=float))
    b, n = x.shape
    out = np.full(b, np.nan)
    if n < 2:
        return out
    finite = np.isfinite(x).all(axis=1) & np.isfinite(y).all(axis=1)
    if n > _PAIRWISE_LIMIT:
        for i in np.flatnonzero(finite):
            out[i] = _kendall_sorted(x[i], y[i])
        return out
    iu, ju = np.triu_indices(n, 1)
    chunk = max(1, _CHUNK_ELEMENTS // len(iu))
    rows = np.flatnonzero(finite)
    for start in range(0, len(rows), chunk):
        sel = rows[start:start + chunk]
        xr = rankdata(x[sel], method="dense", axis=1).astype(np.int16)
        yr = rankdata(y[sel], method="dense", axis=1).astype(np.int16)
        sx = np.sign(xr[:, iu] - xr[:, ju]).astype(np.int8)
        sy = np.sign(yr[:, iu] - yr[:, ju]).astype(np.int8)
        num = (sx * sy).sum(axis=1, dtype=np.int64)
        dx = np.count_nonzero(sx, axis=1).astype(float)
        dy = np.count_nonzero(sy, axis=1).astype(float)
        ok = (dx > 0) & (dy > 0)
        out[sel] = np.where(ok, num / np.sqrt(np.where(ok, dx * dy, 1.0)), np.nan)
    return out


def _kendall_sorted(x: np.ndarray, y: np.ndarray) -> float:
    """τ-b for large n via scipy's O(n log n) algorithm, with our constant-input rule (NaN, no warning)."""
    from scipy.stats import kendalltau

    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(kendalltau(x, y).statistic)


def kendall_tau_a(x: np.ndarray, y: np.ndarray) -> float:
    """Jiang et al.'s τ: mean over unordered pairs of sign(Δx)·sign(Δy); ties score 0. NaN for n < 2."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n = len(x)
    if n < 2:
        return math.nan
    sx = np.sign(x[:, None] - x[None, :])
    sy = np.sign(y[:, None] - y[None, :])
    return float((sx * sy).sum() / (n * (n - 1)))


STATISTICS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "kendall_tau": kendall_batch,
    "spearman_rho": spearman_batch,
    "pearson_r": pearson_batch,
}


def bootstrap_ci(x: np.ndarray, y: np.ndarray, statistic: Callable[[np.ndarray, np.ndarray], np.ndarray],
                 n_boot: int = 1000, seed: int = 0, level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic`, resampling the (x, y) pairs with replacement.

    Exactly: idx = `np.random.default_rng(seed).integers(0, n, size=(n_boot, n))`, values =
    statistic(x[idx], y[idx]) without its non-finite entries, and the interval is `np.quantile(values,
    [a, 1 − a])` with a = (1 − level) / 2 (numpy's default linear interpolation). The generator is seeded
    afresh per call, so an interval depends only on the data and the seed (not on which other measures
    were analysed first), and measures with the same n share their resamples. Resamples on which the
    statistic is undefined (a constant resample) are dropped; fewer than ten defined resamples give no
    interval. This function applies no minimum n: `analyze` calls it only from MIN_CI_RUNS runs on.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n = len(x)
    if n_boot <= 0 or n < 2:
        return (math.nan, math.nan)
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    values = statistic(x[idx], y[idx])
    values = values[np.isfinite(values)]
    if len(values) < 10:
        return (math.nan, math.nan)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(values, [alpha, 1.0 - alpha])
    return (float(lo), float(hi))


def _permutations(n: int, n_perm: int, seed: int) -> tuple[np.ndarray, bool]:
    """All n! orders of range(n) when n! ≤ n_perm (exact = True), else n_perm seeded random ones."""
    if n <= 20 and math.factorial(n) <= n_perm:
        return np.array(list(itertools.permutations(range(n))), dtype=np.intp).reshape(-1, n), True
    rng = np.random.default_rng(seed)
    return rng.permuted(np.tile(np.arange(n, dtype=np.intp), (n_perm, 1)), axis=1), False


def kendall_permutation_pvalues(x: np.ndarray, y: np.ndarray, n_perm: int = N_PERM,
                                seed: int = 0) -> np.ndarray:
    """Two-sided permutation p-value of Kendall τ-b for each row of `x` (k, n) against one `y` (n,).

    H0: no association (every order of y is equally likely given x). Statistic: |S| with S = C − D =
    Σ_{i<j} sign(x_i − x_j)·sign(y_i − y_j); τ-b = S / sqrt(untied pairs in x · untied pairs in y) and
    that denominator is the same for every permutation of y, so |S| and |τ-b| give the same test (and S is
    an integer, so "reaches the observed value" needs no floating-point tolerance).

    * n! ≤ n_perm: exact, p = #{π ∈ S_n : |S(x, y∘π)| ≥ |S_obs|} / n! (the identity is one of them).
    * otherwise: Monte Carlo, p = (b + 1) / (n_perm + 1), b = the number of the permutations
      `np.random.default_rng(seed).permuted(np.tile(np.arange(n), (n_perm, 1)), axis=1)` whose |S| reaches
      |S_obs|. The same permutations are used for every row, so measures over the same runs are tested
      on the same draws, and a p-value depends only on the data and the seed.

    Rows sharing the runs are tested together (one pass over the permuted gaps, a matrix product per
    chunk: about half a second for n = 200 and 9999 permutations). Above `_PAIRWISE_LIMIT` runs each
    row and permutation goes through scipy's O(n log n) τ instead (seconds per measure). NaN for a
    non-finite or constant row, a constant or non-finite y, n < 2 or n_perm ≤ 0.
    """
    x = np.atleast_2d(np.asarray(x, dtype=float))
    y = np.asarray(y, dtype=float).ravel()
    k, n = x.shape
    out = np.full(k, np.nan)
    if n < 2 or n_perm <= 0 or len(y) != n or not np.isfinite(y).all() or np.ptp(y) == 0:
        return out
    defined = np.isfinite(x).all(axis=1) & ~_constant(np.nan_to_num(x))
    if not defined.any():
        return out
    perms, exact = _permutations(n, int(n_perm), seed)
    xs = x[defined]
    count = np.zeros(len(xs), dtype=np.int64)
    if n <= _PAIRWISE_LIMIT:
        iu, ju = np.triu_indices(n, 1)
        # Dense integer ranks give the same signs as the values, and int16 differences are cheap.
        yr = rankdata(y, method="dense").astype(np.int16)
        xr = rankdata(xs, method="dense", axis=1).astype(np.int16)
        sx = np.sign(xr[:, iu] - xr[:, ju]).astype(np.float32)            # (k, P) in {-1, 0, 1}
        s_obs = np.abs(sx @ np.sign(yr[iu] - yr[ju]).astype(np.float32))  # exact: |S| ≤ P < 2^24
        chunk = max(1, _CHUNK_ELEMENTS // len(iu))
        for start in range(0, len(perms), chunk):
            yp = yr[perms[start:start + chunk]]
            sy = np.sign(yp[:, iu] - yp[:, ju]).astype(np.float32)
            count += (np.abs(sy @ sx.T) >= s_obs[None, :] - 0.5).sum(axis=0)
    else:
        for row, xi in enumerate(xs):
            t_obs = abs(_kendall_sorted(xi, y))
            count[row] = sum(abs(_kendall_sorted(xi, y[perm])) >= t_obs - 1e-12 for perm in perms)
    out[defined] = count / len(perms) if exact else (count + 1) / (len(perms) + 1)
    return out


def kendall_permutation_p(x: np.ndarray, y: np.ndarray, n_perm: int = N_PERM, seed: int = 0) -> float:
    """The permutation p-value of one measure's Kendall τ (see `kendall_permutation_pvalues`)."""
    return float(kendall_permutation_pvalues(np.asarray(x, dtype=float)[None, :], y, n_perm, seed)[0])


def bootstrap_pvalue(diffs: np.ndarray) -> float:
    """Two-sided bootstrap p-value of H0 "the difference is 0": min(1, 2·min(P*(d ≤ 0), P*(d ≥ 0))), each
    tail counted as (#{d* in the tail} + 1) / (B + 1) so that it is never 0 (B = defined resamples).

    With a 95% percentile interval from the same resamples, p < 0.05 holds (up to the interpolation of the
    quantiles and the +1) exactly when the interval excludes 0. Identical resamples (d* = 0) give 1.
    """
    d = np.asarray(diffs, dtype=float)
    d = d[np.isfinite(d)]
    if len(d) == 0:
        return math.nan
    below = (np.count_nonzero(d <= 0) + 1) / (len(d) + 1)
    above = (np.count_nonzero(d >= 0) + 1) / (len(d) + 1)
    return float(min(1.0, 2.0 * min(below, above)))


COMPARISON_COLUMNS = ["measure_a", "measure_b", "n", "tau_a", "tau_b", "diff", "diff_lo", "diff_hi",
                      "p_value"]


def paired_comparisons(frame: pd.DataFrame, measures: list[str], gap_column: str,
                       larger_is_sharper: Mapping[str, bool] | None = None, n_boot: int = 1000,
                       seed: int = 0, level: float = CI_LEVEL,
                       min_ci_runs: int = MIN_CI_RUNS) -> pd.DataFrame:
    """Is measure A better than measure B on this study? Kendall τ_A − τ_B over the same runs.

    Long format, one row per ordered pair (A, B), A ≠ B, in the order of `measures`: n (runs where A, B
    and the gap are all finite), tau_a, tau_b (τ-b against the gap over those runs, each measure negated
    when `larger_is_sharper[m]` is False), diff = tau_a − tau_b, its `level` percentile interval diff_lo,
    diff_hi, and a two-sided p-value. The (B, A) row is the mirror image: −diff, the same p.

    Test: a paired bootstrap. The runs are resampled with `np.random.default_rng(seed).integers(0, n,
    size=(n_boot, n))` (the convention of `bootstrap_ci`; the same indices for A and B, so the correlation
    between the two τ's, which share the gap and usually most of the ranking, is kept); on each resample
    d* = τ*_A − τ*_B, resamples where either τ* is undefined are dropped, and p = `bootstrap_pvalue(d*)`.
    Chosen over a permutation test that swaps A's and B's ranks within runs because that test's null
    (A and B exchangeable run by run) is far stronger than τ_A = τ_B, while the bootstrap targets the
    reported difference and gives its interval and p-value from the same resamples (p < 0.05 iff the
    interval excludes 0, up to interpolation).

    Fewer than MIN_RUNS shared runs or a constant measure: diff NaN. Fewer than `min_ci_runs` shared
    runs, n_boot ≤ 0, or fewer than ten defined resamples: diff is given, interval and p are NaN.
    """
    flip = dict(larger_is_sharper or {})
    nrows = len(frame)
    gap = frame[gap_column].to_numpy(dtype=float) if nrows else np.zeros(0)
    data: dict[str, np.ndarray] = {}
    for m in measures:
        raw = frame[m].to_numpy(dtype=float) if m in frame.columns and nrows else np.full(nrows, np.nan)
        data[m] = raw if flip.get(m, True) else -raw
    alpha = (1.0 - level) / 2.0
    points: dict[tuple[str, bytes], float] = {}
    boots: dict[tuple[str, bytes], np.ndarray] = {}
    indices: dict[int, np.ndarray] = {}

    def tau(m: str, mask: np.ndarray) -> float:
        key = (m, mask.tobytes())
        if key not in points:
            v, g = data[m][mask], gap[mask]
            ok = len(v) >= MIN_RUNS and np.ptp(v) > 0 and np.ptp(g) > 0
            points[key] = float(kendall_batch(v[None, :], g[None, :])[0]) if ok else math.nan
        return points[key]

    def boot(m: str, mask: np.ndarray) -> np.ndarray:
        key = (m, mask.tobytes())
        if key not in boots:
            n = int(mask.sum())
            if n not in indices:
                indices[n] = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
            idx = indices[n]
            boots[key] = kendall_batch(data[m][mask][idx], gap[mask][idx])
        return boots[key]

    rows = []
    for a, b in itertools.permutations(measures, 2):
        mask = np.isfinite(data[a]) & np.isfinite(data[b]) & np.isfinite(gap)
        n = int(mask.sum())
        ta, tb = tau(a, mask), tau(b, mask)
        diff = ta - tb
        lo = hi = p = math.nan
        if math.isfinite(diff) and n >= max(min_ci_runs, 2) and n_boot > 0:
            d = boot(a, mask) - boot(b, mask)
            d = d[np.isfinite(d)]
            if len(d) >= 10:
                lo, hi = (float(q) for q in np.quantile(d, [alpha, 1.0 - alpha]))
                p = bootstrap_pvalue(d)
        rows.append({"measure_a": a, "measure_b": b, "n": n, "tau_a": ta, "tau_b": tb, "diff": diff,
                     "diff_lo": lo, "diff_hi": hi, "p_value": p})
    out = pd.DataFrame(rows, columns=COMPARISON_COLUMNS)
    out["n"] = out["n"].astype(int)
    return out


# ------------------------------------------------------------------------------- granulated Kendall, CMI

def _axis_codes(frame: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """Axis values as strings, so floats, strings and missing values group the same way everywhere."""
    return pd.DataFrame({a: frame[a].map(_axis_text).to_numpy() for a in axes}, index=frame.index)


def _axis_text(value: Any) -> str:
    if value is None or (isinstance(value, (float, np.floating)) and math.isnan(value)):
        return "None"
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return repr(float(value))  # 0 (from YAML) and 0.0 are the same axis value
    return str(value)


def granulated_kendall(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame,
                       axes: list[str]) -> tuple[float, dict[str, float]]:
    """Ψ and ψ_i per axis (Jiang et al. 2020, Eq. 4); runs are the rows of `codes`, aligned with the arrays.

    ψ_i averages τ over the groups of runs that share every other axis value; a group whose runs all have
    the same value of axis i says nothing about axis i and is skipped. An axis without any usable group
    gets NaN, and Ψ is the mean over the axes that have a value.
    """
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    per_axis: dict[str, float] = {}
    for axis in axes:
        others = [a for a in axes if a != axis]
        if others:
            keys = codes[others].agg("\x1f".join, axis=1).to_numpy()
        else:
            keys = np.zeros(len(codes), dtype=int)
        axis_values = codes[axis].to_numpy()
        taus = []
        for key in pd.unique(keys):
            members = np.flatnonzero(keys == key)
            if len(members) < 2 or len(set(axis_values[members])) < 2:
                continue
            taus.append(kendall_tau_a(measure[members], gap[members]))
        per_axis[axis] = float(np.mean(taus)) if taus else math.nan
    defined = [v for v in per_axis.values() if math.isfinite(v)]
    return (float(np.mean(defined)) if defined else math.nan), per_axis


def _entropy(counts: np.ndarray) -> np.ndarray:
    """Entropy in bits of each row of a count array (rows summing to 0 give 0)."""
    total = counts.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total > 0, counts / np.where(total > 0, total, 1), 0.0)
        terms = np.where(p > 0, -p * np.log2(np.where(p > 0, p, 1.0)), 0.0)
    return terms.sum(axis=-1)


def conditional_mi(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame,
                   axes: list[str]) -> tuple[float, str]:
    """Jiang et al.'s CMI score and the conditioning set that attains its minimum (see module doc).

    Pairs with equal gaps carry no ordering to predict and are dropped; a tie in the measure is its own
    outcome of V_μ (a measure that cannot tell two runs apart has failed to predict their order).
    """
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    n = len(measure)
    if len(axes) < 2 or n < 2:
        return math.nan, ""
    size = 2 if len(axes) >= 3 else 1
    int_codes = {a: pd.factorize(codes[a])[0].astype(np.int64) for a in axes}
    cardinality = {a: int(int_codes[a].max()) + 1 for a in axes}
    best, best_set = math.inf, ""
    for subset in itertools.combinations(axes, size):
        n_cells = int(np.prod([cardinality[a] ** 2 for a in subset]))
        counts = np.zeros(n_cells * 6, dtype=np.int64)
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(n, 1))
        for start in range(0, n, rows_per_chunk):
            i = np.arange(start, min(n, start + rows_per_chunk))[:, None]
            j = np.arange(n)[None, :]
            i, j = np.broadcast_arrays(i, j)
            keep = i != j
            i, j = i[keep], j[keep]
            vg = np.sign(gap[i] - gap[j])
            untied = vg != 0
            i, j, vg = i[untied], j[untied], vg[untied]
            vm = np.sign(measure[i] - measure[j]).astype(np.int64) + 1
            cell = np.zeros(len(i), dtype=np.int64)
            for a in subset:
                k = cardinality[a]
                cell = cell * k * k + int_codes[a][i] * k + int_codes[a][j]
            code = (cell * 2 + (vg > 0)) * 3 + vm
            counts += np.bincount(code, minlength=n_cells * 6)
        table = counts.reshape(n_cells, 2, 3).astype(float)
        per_cell = table.sum(axis=(1, 2))
        total = per_cell.sum()
        if total == 0:
            continue
        weight = per_cell / total
        h_g = _entropy(table.sum(axis=2))
        h_m = _entropy(table.sum(axis=1))
        h_joint = _entropy(table.reshape(n_cells, 6))
        mi = np.maximum(h_g + h_m - h_joint, 0.0)
        cond_h = float((weight * h_g).sum())
        if cond_h <= 0:
            continue
        score = float((weight * mi).sum()) / cond_h
        if score < best:
            best, best_set = score, "+".join(subset)
    return (best if math.isfinite(best) else math.nan), best_set


# ------------------------------------------------------------------------------------------- exclusions

def gap_column(gap: str) -> str:
    if gap not in ("acc", "loss"):
        raise ValueError(f"gap must be 'acc' or 'loss', got {gap!r}")
    return f"gap_{gap}"


def exclusion_reasons(table: pd.DataFrame, gap: str = "acc", min_train_acc: float = 0.0) -> pd.Series:
    """Why each run is left out of the statistics ("" when it is used), aligned with the table's index."""
    gcol = gap_column(gap)
    reasons = []
    for _, row in table.iterrows():
        status = str(row.get("status", "unknown"))
        if status != "finished":
            reasons.append(f"not trained (status: {status})")
            continue
        why = []
        train_acc = _num(row.get("train_acc"))
        if not math.isfinite(train_acc):
            why.append("no train accuracy recorded")
        elif train_acc < min_train_acc:
            why.append(f"did not train: train accuracy {train_acc:.3f} < {min_train_acc:.3f}")
        bad = [c for c in ("train_loss", "test_loss") if not math.isfinite(_num(row.get(c)))]
        if bad:
            why.append("non-finite loss (" + ", ".join(f"{c}={_num(row.get(c))}" for c in bad) + ")")
        if not bad and not math.isfinite(_num(row.get(gcol))):
            why.append(f"non-finite {gcol}")
        reasons.append("; ".join(why))
    return pd.Series(reasons, index=table.index, dtype=object)


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


# ------------------------------------------------------------------------------------------- the analysis

@dataclass
class Analysis:
    """Everything the report needs from the statistics, computed once."""

    correlations: pd.DataFrame
    """One row per headline measure, best Kendall τ first (columns: see `correlations`)."""
    included: pd.DataFrame
    """The table rows used in the statistics."""
    excluded: pd.DataFrame
    """run_id, experiment, status, reason of every run left out."""
    axes: list[str]
    """Hyperparameter axes that vary among the included runs (granulated Kendall / CMI)."""
    gap: str
    gap_column: str
    larger_is_sharper: dict[str, bool]
    notes: list[str] = field(default_factory=list)
    comparisons: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=COMPARISON_COLUMNS))
    """Every ordered pair of measures: τ_a − τ_b with its paired-bootstrap interval and p-value (see
    `paired_comparisons`), measures in ranking order."""


def analyze(table: pd.DataFrame, gap: str = "acc", min_train_acc: float = 0.0, n_boot: int = 1000,
            seed: int = 0, axes: list[str] | None = None, n_perm: int = N_PERM) -> Analysis:
    """Exclusions, then every statistic for every headline measure (see the module docstring).

    Columns of `Analysis.correlations`, one row per headline measure, best Kendall τ first: measure,
    larger_is_sharper, n, n_missing; for τ, ρ and r the value with `_lo`/`_hi` (NaN below MIN_CI_RUNS);
    kendall_p (permutation p-value); vs_best ("best" for the top measure; "worse" when the paired 95%
    interval of τ_best − τ_m lies above 0; "better on shared runs" when it lies below 0, which can only
    happen when the two have values on different runs; otherwise "indistinguishable", including when there
    is no interval because the two share fewer than MIN_CI_RUNS runs, n_boot is 0, or τ is undefined on
    the shared runs: not shown to differ; "" when τ_m itself is undefined) and
    vs_best_p (that comparison's p-value); se_median and se_ratio (Monte-Carlo standard error, NaN for
    exact measures); psi, psi_<axis>, cmi, cmi_condition; note.
    """
    gcol = gap_column(gap)
    notes: list[str] = []
    measures = headline_columns(table)
    se_cols = stderr_columns(table)
    all_axes = list(axes) if axes is not None else sweep_axes(table)
    reasons = exclusion_reasons(table, gap, min_train_acc) if len(table) else pd.Series([], dtype=object)
    keep = (reasons == "").to_numpy() if len(table) else np.zeros(0, dtype=bool)
    included = table[keep]
    excluded = pd.DataFrame({
        "run_id": table["run_id"][~keep].to_numpy() if len(table) else [],
        "experiment": table["experiment"][~keep].to_numpy() if len(table) else [],
        "status": table["status"][~keep].to_numpy() if len(table) else [],
        "reason": reasons[~keep].to_numpy() if len(table) else [],
    })
    used_axes = [a for a in all_axes if a in included.columns
                 and included[a].map(_axis_text).nunique() > 1]
    flip = directions(measures, notes, table.attrs.get("directions"))

    if len(included) < MIN_RUNS:
        notes.append(f"correlations need at least {MIN_RUNS} trained runs; {len(included)} "
                     f"{'is' if len(included) == 1 else 'are'} available")
    elif len(included) < MIN_CI_RUNS:
        notes.append(f"{len(included)} runs: with fewer than {MIN_CI_RUNS} runs no bootstrap interval is "
                     "given (it would be unreliable and often collapses to a point); judge each τ by its "
                     "permutation p-value")
    if len(used_axes) < 2:
        notes.append("the conditional mutual information score needs at least two varying hyperparameter "
                     f"axes; {'only ' + used_axes[0] + ' varies' if used_axes else 'none varies'}")
    elif len(used_axes) == 2:
        notes.append("only two axes vary, so the CMI score conditions on one axis at a time "
                     "(conditioning on both would leave nothing to explain)")

    gap_values = included[gcol].to_numpy(dtype=float) if len(included) else np.zeros(0)
    codes = _axis_codes(included, used_axes)
    p_values = _permutation_pvalues(included, measures, gap_values, flip, n_perm, seed)
    rows = []
    for key in measures:
        rows.append(_measure_row(key, included, gap_values, codes, used_axes, flip[key], n_boot, seed,
                                 p_values.get(key, math.nan), se_cols.get(key)))
    columns = ["measure", "larger_is_sharper", "n", "n_missing"]
    for stat in STATISTICS:
        columns += [stat, f"{stat}_lo", f"{stat}_hi"]
    columns += ["kendall_p", "vs_best", "vs_best_p", "se_median", "se_ratio",
                "psi", *[f"psi_{a}" for a in used_axes], "cmi", "cmi_condition", "note"]
    corr = pd.DataFrame(rows, columns=columns)
    if len(corr):
        corr = corr.sort_values(["kendall_tau", "measure"], ascending=[False, True], na_position="last",
                                kind="mergesort").reset_index(drop=True)
    comparisons = paired_comparisons(included, corr["measure"].tolist(), gcol, flip, n_boot=n_boot,
                                     seed=seed)
    _mark_vs_best(corr, comparisons)
    corr.attrs.update({"gap": gap, "gap_column": gcol, "axes": list(used_axes), "notes": list(notes),
                       "excluded": excluded.to_dict(orient="records"), "n_included": len(included),
                       "min_ci_runs": MIN_CI_RUNS, "n_perm": n_perm, "n_boot": n_boot, "seed": seed})
    return Analysis(correlations=corr, included=included, excluded=excluded, axes=used_axes, gap=gap,
                    gap_column=gcol, larger_is_sharper=flip, notes=notes, comparisons=comparisons)


def usable(values: np.ndarray, gap: np.ndarray) -> bool:
    """Whether τ is defined: enough runs, and neither the measure nor the gap constant over them."""
    return len(values) >= MIN_RUNS and np.ptp(values) > 0 and np.ptp(gap) > 0


def _permutation_pvalues(included: pd.DataFrame, measures: list[str], gap_values: np.ndarray,
                         flip: Mapping[str, bool], n_perm: int, seed: int) -> dict[str, float]:
    """kendall_p of every measure; measures with values on the same runs are tested in one pass."""
    groups: dict[bytes, list[tuple[str, np.ndarray]]] = {}
    masks: dict[bytes, np.ndarray] = {}
    for key in measures:
        raw = included[key].to_numpy(dtype=float) if len(included) else np.zeros(0)
        ok = np.isfinite(raw) & np.isfinite(gap_values)
        values = (raw if flip[key] else -raw)[ok]
        if not usable(values, gap_values[ok]):
            continue
        groups.setdefault(ok.tobytes(), []).append((key, values))
        masks[ok.tobytes()] = ok
    out: dict[str, float] = {}
    for mask_key, members in groups.items():
        x = np.stack([v for _, v in members])
        p = kendall_permutation_pvalues(x, gap_values[masks[mask_key]], n_perm=n_perm, seed=seed)
        out.update({key: float(pi) for (key, _), pi in zip(members, p)})
    return out


def _mark_vs_best(corr: pd.DataFrame, comparisons: pd.DataFrame) -> None:
    """Fill `vs_best`/`vs_best_p` from the paired comparisons of the top measure with each other one."""
    corr["vs_best"] = ""
    corr["vs_best_p"] = math.nan
    finite = np.isfinite(corr["kendall_tau"].to_numpy(dtype=float)) if len(corr) else np.zeros(0, bool)
    if not finite.any():
        return
    best = str(corr["measure"][int(np.flatnonzero(finite)[0])])
    pairs = comparisons[comparisons["measure_a"] == best].set_index("measure_b")
    for i in np.flatnonzero(finite):
        m = str(corr.at[i, "measure"])
        if m == best:
            corr.at[i, "vs_best"] = "best"
            continue
        if m not in pairs.index:
            continue
        cmp = pairs.loc[m]
        lo, hi = float(cmp["diff_lo"]), float(cmp["diff_hi"])
        if math.isfinite(lo) and lo > 0:
            corr.at[i, "vs_best"] = "worse"
        elif math.isfinite(hi) and hi < 0:
            corr.at[i, "vs_best"] = "better on shared runs"
        else:
            corr.at[i, "vs_best"] = "indistinguishable"
        corr.at[i, "vs_best_p"] = float(cmp["p_value"])


def _measure_row(key: str, included: pd.DataFrame, gap_values: np.ndarray, codes: pd.DataFrame,
                 axes: list[str], larger_is_sharper: bool, n_boot: int, seed: int,
                 kendall_p: float = math.nan, se_column: str | None = None) -> dict[str, Any]:
    raw = included[key].to_numpy(dtype=float) if len(included) else np.zeros(0)
    ok = np.isfinite(raw) & np.isfinite(gap_values)
    values = (raw if larger_is_sharper else -raw)[ok]
    gap = gap_values[ok]
    row: dict[str, Any] = {"measure": key, "larger_is_sharper": larger_is_sharper, "n": int(ok.sum()),
                           "n_missing": int(len(raw) - ok.sum())}
    for stat in STATISTICS:
        row[stat] = row[f"{stat}_lo"] = row[f"{stat}_hi"] = math.nan
    row["kendall_p"] = math.nan
    row["psi"] = row["cmi"] = math.nan
    row["cmi_condition"] = ""
    for axis in axes:
        row[f"psi_{axis}"] = math.nan
    row["se_median"], row["se_ratio"] = _stderr_summary(included, se_column, ok, values)
    note = []
    if row["n"] == 0:
        note.append("no value on any run" if len(raw) else "no runs")
    elif row["n"] < MIN_RUNS:
        note.append(f"only {row['n']} run(s) with a value" if len(raw) >= MIN_RUNS else "too few runs")
    elif np.ptp(values) == 0:
        note.append("constant across runs")
    elif np.ptp(gap) == 0:
        note.append("the gap is constant across these runs")
    else:
        with_ci = row["n"] >= MIN_CI_RUNS
        for stat, fn in STATISTICS.items():
            row[stat] = float(fn(values[None, :], gap[None, :])[0])
            if with_ci:
                row[f"{stat}_lo"], row[f"{stat}_hi"] = bootstrap_ci(values, gap, fn, n_boot=n_boot,
                                                                    seed=seed)
        row["kendall_p"] = kendall_p
        if not with_ci:
            note.append(f"n < {MIN_CI_RUNS}: no interval; see the p-value")
        elif row["kendall_tau_lo"] == row["kendall_tau_hi"]:
            note.append("every bootstrap resample gives the same τ (interval collapsed to a point); see the "
                        "p-value")
        if axes:
            sub = codes[ok]
            row["psi"], per_axis = granulated_kendall(values, gap, sub, axes)
            for axis, value in per_axis.items():
                row[f"psi_{axis}"] = value
            row["cmi"], row["cmi_condition"] = conditional_mi(values, gap, sub, axes)
    if row["se_ratio"] >= SE_NOTE_RATIO:  # False for NaN
        note.append(f"standard error comparable to the spread between runs (se/sd = {row['se_ratio']:.2f}): "
                    "the ranking is partly noise")
    if row["n_missing"] and row["n"]:
        note.append(f"no value on {row['n_missing']} run(s)")
    if not larger_is_sharper:
        note.append("sign flipped (smaller = sharper)")
    row["note"] = "; ".join(note)
    return row


def _stderr_summary(included: pd.DataFrame, se_column: str | None, ok: np.ndarray,
                    values: np.ndarray) -> tuple[float, float]:
    """(median Monte-Carlo standard error over the measure's runs, that median / the sample standard
    deviation (ddof = 1) of the measure over the same runs). NaN without an SE column or any finite SE;
    the ratio is inf when the measure is constant but its SE is not 0."""
    if se_column is None or se_column not in included.columns or not ok.any():
        return math.nan, math.nan
    se = np.abs(pd.to_numeric(included[se_column], errors="coerce").to_numpy(dtype=float)[ok])
    se = se[np.isfinite(se)]
    if len(se) == 0:
        return math.nan, math.nan
    median = float(np.median(se))
    if len(values) < 2:
        return median, math.nan
    sd = float(np.std(values, ddof=1))
    if sd > 0:
        return median, median / sd
    return median, (math.inf if median > 0 else math.nan)


def correlations(table: pd.DataFrame, gap: str = "acc", min_train_acc: float = 0.0, n_boot: int = 1000,
                 seed: int = 0, n_perm: int = N_PERM) -> pd.DataFrame:
    """Per headline measure: τ/ρ/r with 95% bootstrap CIs (from MIN_CI_RUNS runs), the permutation
    p-value of τ, the comparison with the best measure, Monte-Carlo SE summaries, n, Ψ with per-axis ψ,
    CMI; best τ first (columns: see `analyze`).

    The frame's `attrs` carry the excluded runs with their reasons (`attrs["excluded"]`), the axes used
    and the notes (e.g. why CMI is missing); `analyze` returns the same as a structured `Analysis`.
    """
    return analyze(table, gap=gap, min_train_acc=min_train_acc, n_boot=n_boot, seed=seed,
                   n_perm=n_perm).correlations


def agreement_matrix(frame: pd.DataFrame, columns: list[str], min_pairs: int = MIN_RUNS) -> pd.DataFrame:
    """Kendall τ-b between every two columns over the runs where both are finite (which measures agree)."""
    data = {c: frame[c].to_numpy(dtype=float) for c in columns}
    out = pd.DataFrame(np.nan, index=columns, columns=columns)
    for a, b in itertools.combinations_with_replacement(columns, 2):
        ok = np.isfinite(data[a]) & np.isfinite(data[b])
        if ok.sum() < min_pairs:
            continue
        tau = float(kendall_batch(data[a][ok][None, :], data[b][ok][None, :])[0])
        out.loc[a, b] = out.loc[b, a] = tau
    return out


def oriented(frame: pd.DataFrame, larger_is_sharper: Mapping[str, bool]) -> pd.DataFrame:
    """Measure columns negated where smaller means sharper, so that larger always means 'predicts a
    larger gap' (used by the agreement heatmap)."""
    out = frame.copy()
    for key, larger in larger_is_sharper.items():
        if key in out.columns and not larger:
            out[key] = -out[key].astype(float)
    return out
