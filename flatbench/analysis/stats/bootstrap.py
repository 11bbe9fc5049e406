"""The two-way cluster bootstrap: resample the configurations and the data draws, never single runs.

A study crosses C configurations (cells) with D data draws (`design`). Runs of one configuration share
its hyperparameters, runs of one draw share their data subset, labels and initialization streams: a run
belongs to two clusters, and neither the runs nor the pairs of runs are independent. Owen's (2007)
"pigeonhole" bootstrap for such crossed designs (Owen & Eckles 2012) draws, in every resample,

    cell weights  w_c ~ Multinomial(C; 1/C, …, 1/C)   (how often configuration c is drawn),
    draw weights  v_d ~ Multinomial(D; 1/D, …, 1/D)   (how often draw d is drawn),

independently, and gives run (c, d) the weight w_c·v_d: the resampled data set holds w_c·v_d copies of
it. A statistic of the runs computed with these weights (ρ, r) is exactly the statistic of that data set
(`kernels.weighted_spearman`, `kernels.weighted_pearson`).

**Pairs of copies.** A statistic over *pairs* of runs (τ, its paired differences, the replicate pairs'
share) needs one refinement. A configuration drawn twice puts two copies of each of its runs in the data
set, and a pair formed across the two copies, (c, d) of copy 1 with (c, d′) of copy 2, is a pair that no
real data set holds: two *different* configurations drawn from the population are never the same one. The
plain weights W_i·W_j give a pair of runs of one configuration the weight w_c², whose mean is 2 − 1/C,
against (C − 1)/C for a pair of two configurations: the within-configuration pairs (where runs differ by
noise only) count about twice, τ* is pulled toward their τ, and its percentile interval can miss the
estimate (yi_mnist's ref.replicate_gap, 11 configurations: τ = 0.905, interval [0.706, 0.868]). So the pair
statistics count only pairs of distinct copies, the bootstrap of a U-statistic over the units (its kernel
has no diagonal term), with the weights that give every pair of distinct runs the same expected weight:

    P_ij = F_ij · G_ij,
    F_ij = w_c(i)·w_c(j) if c(i) ≠ c(j), else α·w_c(i) with α = (C − 1)/C   (E F_ij = (C − 1)/C for all),
    G_ij = v_d(i)·v_d(j) if d(i) ≠ d(j), else β·v_d(i) with β = (D − 1)/D   (β = 1 when v ≡ 1),

(α = 1 with one configuration, β = 1 with one draw: there is no other kind of pair to balance).
`TwoWay.pair_sums` and `TwoWay.pair_weights` compute them. This is the principle the earlier stratified
bootstrap's within-cell pair weights followed, derived here for the two-way design; no spread rescaling
is needed (the cluster bootstrap's variance is (C − 1)/C of the unbiased one, ≤ 10% from 10 units on).

* **Few draws.** With D < `MIN_DRAWS` draws the draw distribution cannot be estimated from D values: the
  draws are then not resampled (v ≡ 1), and the inference is conditional on these D draws (it says how
  the result would vary over other configurations like these, trained on these data draws). No
  replicate-level test is possible then, and the report says so.
* **One run per cell.** The cell weights are then run weights: with D < `MIN_DRAWS` it is the plain
  bootstrap of the runs.
* **One configuration** (every run has the same hyperparameters) and D < `MIN_DRAWS`: the runs are
  resampled one by one (plain bootstrap), and the description says so.

The random numbers, exactly (so that a test can rebuild them with an explicit loop): rng =
`np.random.default_rng(seed)`; cell draws = rng.integers(0, C, size=(n_boot, C)), w[b, c] = the number
of times c occurs in row b; then, only when the draws are resampled, draw draws = rng.integers(0, D,
size=(n_boot, D)) and v likewise. `two_way_weights` is the same for any two crossed unit sets (the ψ
test crosses combinations of the other axes with the draws).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

MIN_DRAWS = 5
"""Fewest data draws the bootstrap resamples; with fewer, the inference is conditional on the draws."""
MIN_UNITS = 10
"""Fewest independent units a bootstrap interval or test needs on one side (configurations, combinations of
the other axes, or resampled draws). A percentile bootstrap over few clusters is anti-conservative: for
the block mean of ψ under its null, a nominal 5% test rejects 32% of the time with 3 units, 12% with 5,
9% with 8 and 6% with 10 (`scripts/cluster_bootstrap_size.py`); it is the same number as
`compare.MIN_CI_RUNS`, the rule for runs."""


def multinomial_counts(rng: np.random.Generator, k: int, n_boot: int) -> np.ndarray:
    """(n_boot, k) float counts: row b counts how often each of k units occurs among k uniform draws."""
    if k <= 0:
        return np.zeros((max(n_boot, 0), 0))
    draws = rng.integers(0, k, size=(max(n_boot, 0), k))
    flat = (np.arange(max(n_boot, 0))[:, None] * k + draws).ravel()
    return np.bincount(flat, minlength=max(n_boot, 0) * k).reshape(max(n_boot, 0), k).astype(float)


def two_way_weights(n_rows: int, n_cols: int, n_boot: int, seed: int | tuple[int, ...],
                    resample_cols: bool) -> tuple[np.ndarray, np.ndarray]:
    """(row weights (n_boot, n_rows), column weights (n_boot, n_cols)) of the pigeonhole bootstrap (module
    doc); the column weights are all 1 when `resample_cols` is False."""
    rng = np.random.default_rng(seed)
    rows = multinomial_counts(rng, n_rows, n_boot)
    cols = multinomial_counts(rng, n_cols, n_boot) if resample_cols else np.ones((max(n_boot, 0), n_cols))
    return rows, cols


def resamples_draws(n_draws: int) -> bool:
    return n_draws >= MIN_DRAWS


def draws_phrase(n_draws: int) -> str:
    """How the draws enter the inference, in words a report can print."""
    if n_draws >= MIN_DRAWS:
        return f"the {n_draws} data draws"
    if n_draws <= 1:
        return "conditional on this one data draw: no replicate-level test is possible"
    return f"conditional on these {n_draws} data draws: no replicate-level test is possible"


@dataclass
class TwoWay:
    """The two-way cluster bootstrap of one set of runs (module doc)."""

    cells: np.ndarray
    """The resampled configuration unit of every run (0 .. C − 1; the run itself in the fallback)."""
    draws: np.ndarray
    """The draw of every run (0 .. D − 1)."""
    cell_weights: np.ndarray
    draw_weights: np.ndarray
    draws_resampled: bool
    description: str
    """The unit of resampling in words, e.g. "resampled: the 64 configurations and the 5 data draws
    (two-way cluster bootstrap)"."""
    cache: dict = field(default_factory=dict)
    """Intermediate results shared by the measures on these runs (e.g. the gap's resample ranks)."""

    @property
    def n_units(self) -> int:
        """Independent units on the better-populated side: the configurations (runs in the fallback), or the
        draws when they are resampled and more numerous."""
        n_cols = self.draw_weights.shape[1] if self.draws_resampled else 0
        return max(self.cell_weights.shape[1], n_cols)

    def __post_init__(self) -> None:
        self.weights = self.cell_weights[:, self.cells] * self.draw_weights[:, self.draws]
        """(n_boot, n) run weights w_c·v_d."""

    @property
    def alpha(self) -> float:
        """The factor of a pair of runs of one configuration (module doc: pairs of copies)."""
        c = self.cell_weights.shape[1]
        return (c - 1) / c if c > 1 else 1.0

    @property
    def beta(self) -> float:
        """The factor of a pair of runs of one draw (1 when the draws are not resampled)."""
        d = self.draw_weights.shape[1]
        return (d - 1) / d if self.draws_resampled and d > 1 else 1.0

    def pair_weights(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """(n_boot, P) weights P_ij of the pairs (i, j) of distinct runs (module doc: pairs of copies)."""
        wi, wj = self.cell_weights[:, self.cells[i]], self.cell_weights[:, self.cells[j]]
        vi, vj = self.draw_weights[:, self.draws[i]], self.draw_weights[:, self.draws[j]]
        f = np.where(self.cells[i] == self.cells[j], self.alpha * wi, wi * wj)
        g = np.where(self.draws[i] == self.draws[j], self.beta * vi, vi * vj)
        return f * g

    def pair_sums(self, matrix: np.ndarray) -> np.ndarray:
        """(n_boot,) Σ_{i<j} P_ij·M_ij for a symmetric (n, n) matrix M (module doc: pairs of copies): the plain
        quadratic form ½ Wᵀ M W corrected on the pairs of one configuration and of one draw."""
        m = np.asarray(matrix, dtype=float)
        m = m - np.diag(np.diag(m))
        w_run = self.cell_weights[:, self.cells]
        v_run = self.draw_weights[:, self.draws]
        out = np.einsum("bi,bi->b", self.weights @ m, self.weights)
        extra_w = w_run * w_run - self.alpha * w_run  # w² − α·w: F's correction on a pair of one configuration
        extra_v = v_run * v_run - self.beta * v_run
        cell_groups, draw_groups, same_both = self._blocks()
        if any(len(g) > 1 for g in cell_groups):
            out -= _within(extra_w * v_run, v_run, m, cell_groups)
        if self.draws_resampled:
            out -= _within(extra_v * w_run, w_run, m, draw_groups)
            out += (extra_w * extra_v) @ (m * same_both).sum(axis=1)
        return 0.5 * out

    def _blocks(self) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """The runs of each configuration and of each draw (index arrays), and the (n, n) mask of the pairs of
        one configuration and one draw: made once per bootstrap, for every measure's `pair_sums`."""
        if "blocks" not in self.cache:
            cell_groups, draw_groups = ([np.flatnonzero(ids == k) for k in np.unique(ids)]
                                        for ids in (self.cells, self.draws))
            same_both = ((self.cells[:, None] == self.cells[None, :])
                         & (self.draws[:, None] == self.draws[None, :]))
            self.cache["blocks"] = (cell_groups, draw_groups, same_both)
        return self.cache["blocks"]


def _within(left: np.ndarray, right: np.ndarray, m: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """(B,) Σ_i left[b, i] · Σ_j right[b, j] · M[j, i] over the pairs (i, j) within one group: the quadratic
    form of M masked to its diagonal blocks, a block at a time (on the natural study's 540 runs in 5 draws a
    fifth of the dense masked product's work; its 108 configurations' blocks of 5 runs next to nothing)."""
    out = np.zeros(len(left))
    for idx in groups:
        out += np.einsum("bi,bi->b", left[:, idx], right[:, idx] @ m[np.ix_(idx, idx)])
    return out


def describe(n_runs: int, n_cells: int, n_draws: int, by_run: bool) -> str:
    """The unit of resampling in words (see `TwoWay.description`)."""
    if by_run:
        why = "every run has the same hyperparameters" if n_cells == 1 else "every configuration holds one run"
        units = f"the {n_runs} runs ({why})"
    else:
        units = f"the {n_cells} configurations"
    if n_draws >= MIN_DRAWS:
        return f"resampled: {units} and the {n_draws} data draws (two-way cluster bootstrap)"
    kind = "plain bootstrap" if by_run else "cluster bootstrap"
    return f"resampled: {units} ({kind}), {draws_phrase(n_draws)}"


def two_way_bootstrap(cells: np.ndarray, draws: np.ndarray, n_boot: int, seed: int) -> TwoWay:
    """The two-way cluster bootstrap for runs with these cell and draw ids (module doc)."""
    cells = pd.factorize(np.asarray(cells))[0].astype(np.int64) if len(cells) else np.zeros(0, np.int64)
    draws = pd.factorize(np.asarray(draws))[0].astype(np.int64) if len(draws) else np.zeros(0, np.int64)
    n = len(cells)
    n_cells = int(cells.max()) + 1 if n else 0
    n_draws = int(draws.max()) + 1 if n else 0
    single = n_cells == n
    resample = resamples_draws(n_draws)
    one_config = n_cells == 1 and not resample and n > 1
    by_run = single or one_config
    units = np.arange(n, dtype=np.int64) if one_config else cells
    rows, cols = two_way_weights(int(units.max()) + 1 if n else 0, n_draws, n_boot, seed, resample)
    return TwoWay(units, draws, rows, cols, resample, describe(n, n_cells, n_draws, by_run))
