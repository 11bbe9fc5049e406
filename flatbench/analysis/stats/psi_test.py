"""Is a per-axis ψ more than chance? A within-group permutation test of Jiang et al.'s granulated τ.

ψ_i (see `jiang.granulated_kendall`) is the mean, over the groups of runs that share every hyperparameter
but axis i (and the seed), of Jiang's τ inside the group. Its null hypothesis here: inside each group the
gap's order is unrelated to the measure's, i.e. the gaps are exchangeable within a group. The test permutes
the gaps within every group independently and recomputes ψ_i; the two-sided p-value is the share of
permutations whose |ψ_i| is at least the observed one.

* When every informative group holds two runs (a full product with one run per cell and seed, as in
  `configs/cpu/hyperparameters.yaml`), each group's τ is +1 or −1 with probability ½ under the null (a
  group whose two runs tie in the measure or the gap scores 0 under every permutation and carries no
  information), so ψ_i is a rescaled binomial and the test is the exact two-sided sign test
  (`scipy.stats.binomtest`). The method is then "exact (sign test)".
* Otherwise `n_perm` seeded Monte-Carlo permutations, p = (b + 1) / (m + 1) (Phipson & Smyth 2010).

It tests one axis at a time and does not correct for the several axes of a study; a reader comparing ψ
over k axes should compare p with α / k (the report says so).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
from scipy.stats import binomtest

from flatbench.analysis.stats.jiang import psi_groups
from flatbench.analysis.stats.kernels import kendall_tau_a

N_PSI_PERM = 10_000
_TABLE_MAX_RUNS = 6
"""Groups of at most this many runs get every permutation's τ tabulated (6! = 720 values)."""


def _permutation_taus(measure: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """τ_a of the measure against every permutation of the gap (a group of few runs)."""
    return np.array([kendall_tau_a(measure, gap[list(p)]) for p in itertools.permutations(range(len(gap)))])


def psi_pvalue(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame, axes: list[str], axis: str,
               within: list[str] | tuple[str, ...] = (), n_perm: int = N_PSI_PERM,
               seed: int = 0) -> tuple[float, str]:
    """(p, method) of ψ_axis against its within-group permutation null; (nan, reason) without groups."""
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    groups = psi_groups(codes, axes, axis, within)
    if not groups:
        return math.nan, "no group varies this axis alone"
    observed = np.array([kendall_tau_a(measure[g], gap[g]) for g in groups])
    if all(len(g) == 2 for g in groups):
        informative = observed != 0
        k = int(informative.sum())
        if k == 0:
            return 1.0, "exact (sign test)"
        concordant = int((observed[informative] > 0).sum())
        return float(binomtest(concordant, k, 0.5).pvalue), "exact (sign test)"
    stat = abs(float(observed.mean()))
    rng = np.random.default_rng(seed)
    total = np.zeros(n_perm)
    for g in groups:
        m, y = measure[g], gap[g]
        if len(g) <= _TABLE_MAX_RUNS:
            table = _permutation_taus(m, y)
            total += table[rng.integers(0, len(table), size=n_perm)]
        else:
            perms = rng.permuted(np.tile(np.arange(len(g)), (n_perm, 1)), axis=1)
            total += np.array([kendall_tau_a(m, y[p]) for p in perms])
    null = np.abs(total / len(groups))
    b = int((null >= stat - 1e-12).sum())
    return (b + 1) / (n_perm + 1), f"monte carlo ({n_perm} within-group permutations)"


def psi_pvalues(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame, axes: list[str],
                within: list[str] | tuple[str, ...] = (), n_perm: int = N_PSI_PERM,
                seed: int = 0) -> dict[str, tuple[float, str]]:
    """`psi_pvalue` for every hyperparameter axis."""
    return {a: psi_pvalue(measure, gap, codes, axes, a, within, n_perm, seed) for a in axes}
