"""Jiang et al. (2020, "Fantastic generalization measures and where to find them") §4-5: the granulated
Kendall coefficient Ψ and the conditional-mutual-information score, over hyperparameter axes only.

* ψ_i (Eq. 4): for hyperparameter axis i, the mean over the groups of runs that share every *other*
  hyperparameter value and the seed of Jiang's τ among the group's runs (which then differ in axis i
  only); τ here is Jiang's, the mean over the group's pairs of sign(Δmeasure)·sign(Δgap) (a tie scores
  0). A group of one run, or whose runs share axis i's value, says nothing about axis i and is skipped.
  Ψ = the mean of ψ_i over the hyperparameter axes that have a value. The seed is never an axis: ψ over
  seeds would average "does the measure order two replicates of one configuration by their gap", which
  is the noise of the experiment, not a hyperparameter's effect (`robust.seed_pairs` reports it).
* CMI (§5): over the ordered pairs (i, j) of runs with different gaps, V_g = sign(Δgap), V_μ =
  sign(Δmeasure) (a tie in the measure is a third outcome); for a set S of hyperparameter axes, U_S is
  the pair's values of S, (θ_i,S, θ_j,S). Î(S) = I(V_μ; V_g | U_S) / H(V_g | U_S), both averaged over
  the cells of U_S with the cells' share of the pairs as weights (Jiang et al.'s definition; the PGDL
  scorer averages the cells without weights and uses only |S| = 2). The score is the minimum of Î over
  all S with |S| ≤ 2 (the empty set included), never conditioning on the seed. It is sign-agnostic: a
  measure that orders every pair backwards scores as high as one that orders them right.
  Plug-in mutual information is biased upwards in small cells: for a cell holding m unordered pairs of
  a measure that is pure noise the expected score is about 0.72 / m, and at m = 1 it is exactly 1 for
  every measure (the cell's two ordered pairs are mirror images, and any measure "predicts" one from the
  other). So the score is given only when every cell that has something to explain (H(V_g | cell) > 0)
  holds at least `MIN_CMI_PAIRS` unordered pairs, under every conditioning set; otherwise it is n/a and
  the reason names the set and its smallest cell.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import entropy

from flatbench.analysis.stats.design import group_ids
from flatbench.analysis.stats.kernels import kendall_tau_a

MIN_CMI_PAIRS = 10
"""Fewest unordered pairs of runs a CMI cell with V_g not constant may hold (bias of pure noise ≲ 0.07)."""
MAX_CMI_SET = 2


def psi_groups(codes: pd.DataFrame, axes: list[str], axis: str,
               within: list[str] | tuple[str, ...] = ()) -> list[np.ndarray]:
    """The groups ψ_axis averages over: runs sharing every other axis (and the `within` columns) whose
    values of `axis` differ; a group of one run, or of one value of the axis, says nothing and is left out."""
    keys = group_ids(codes, [a for a in axes if a != axis] + [c for c in within if c in codes.columns])
    values = codes[axis].to_numpy()
    out = []
    for key in np.unique(keys):
        members = np.flatnonzero(keys == key)
        if len(members) >= 2 and len(set(values[members])) >= 2:
            out.append(members)
    return out


def granulated_kendall(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame, axes: list[str],
                       within: list[str] | tuple[str, ...] = ()) -> tuple[float, dict[str, float]]:
    """Ψ and ψ_i per hyperparameter axis; runs are the rows of `codes`, aligned with the arrays. `within`
    are columns every group must share besides the other axes (the replicate column, `seed`)."""
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    per_axis: dict[str, float] = {}
    for axis in axes:
        taus = [kendall_tau_a(measure[g], gap[g]) for g in psi_groups(codes, axes, axis, within)]
        per_axis[axis] = float(np.mean(taus)) if taus else math.nan
    defined = [v for v in per_axis.values() if math.isfinite(v)]
    return (float(np.mean(defined)) if defined else math.nan), per_axis


@dataclass
class CMIResult:
    score: float
    condition: str
    """The conditioning set attaining the minimum ("+"-joined axes; "none" for the empty set)."""
    min_pairs: int
    """Smallest number of unordered pairs in a cell with V_g not constant, over every conditioning set."""
    reason: str = ""
    """Why the score is n/a ("" when it is given)."""
    per_set: dict[str, float] | None = None


def _pairs(gap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ordered pairs (i, j), i ≠ j, with different gaps."""
    n = len(gap)
    i, j = np.nonzero(~np.eye(n, dtype=bool))
    keep = gap[i] != gap[j]
    return i[keep], j[keep]


def conditional_mi(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame, axes: list[str],
                   min_pairs: int = MIN_CMI_PAIRS) -> CMIResult:
    """Jiang et al.'s CMI score over the hyperparameter `axes` (module doc); `codes` holds their values."""
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    if not axes:
        return CMIResult(math.nan, "", 0, "no hyperparameter axis varies (the seed is never conditioned on)")
    if len(measure) < 3:
        return CMIResult(math.nan, "", 0, "fewer than 3 runs")
    i, j = _pairs(gap)
    if not len(i):
        return CMIResult(math.nan, "", 0, "the gap is constant")
    vg = (gap[i] > gap[j]).astype(np.int64)
    vm = (np.sign(measure[i] - measure[j]) + 1).astype(np.int64)
    int_codes = {a: pd.factorize(codes[a])[0].astype(np.int64) for a in axes}
    cardinality = {a: int(int_codes[a].max()) + 1 for a in axes}
    best, best_set, smallest = math.inf, "", None
    smallest_set = ""
    per_set: dict[str, float] = {}
    for size in range(0, min(MAX_CMI_SET, len(axes)) + 1):
        for subset in itertools.combinations(axes, size):
            name = "+".join(subset) if subset else "none"
            cell = np.zeros(len(i), dtype=np.int64)
            diagonal = np.ones(len(i), dtype=bool)
            for a in subset:
                k = cardinality[a]
                ci, cj = int_codes[a][i], int_codes[a][j]
                cell = (cell * k + ci) * k + cj
                diagonal &= ci == cj
            cells, cell = np.unique(cell, return_inverse=True)
            n_cells = len(cells)
            table = np.bincount((cell * 2 + vg) * 3 + vm, minlength=n_cells * 6).reshape(n_cells, 2, 3)
            per_cell = table.sum(axis=(1, 2)).astype(float)
            # unordered pairs: a diagonal cell holds both orders of each of its pairs
            is_diag = np.zeros(n_cells, dtype=bool)
            is_diag[cell[diagonal]] = True
            unordered = np.where(is_diag, per_cell / 2, per_cell)
            g_counts = table.sum(axis=2).astype(float)
            h_g = entropy(g_counts, base=2, axis=1)
            informative = h_g > 1e-12
            if informative.any():
                low = int(unordered[informative].min())
                if smallest is None or low < smallest:
                    smallest, smallest_set = low, name
            weight = per_cell / per_cell.sum()
            cond_h = float((weight * h_g).sum())
            if cond_h <= 1e-12:
                continue  # S determines the ordering of every pair: nothing left to explain
            h_m = entropy(table.sum(axis=1).astype(float), base=2, axis=1)
            h_joint = entropy(table.reshape(n_cells, 6).astype(float), base=2, axis=1)
            mi = np.maximum(h_g + h_m - h_joint, 0.0)
            score = float((weight * mi).sum()) / cond_h
            per_set[name] = score
            if score < best - 1e-15:
                best, best_set = score, name
    smallest = int(smallest) if smallest is not None else 0
    if not per_set:
        return CMIResult(math.nan, "", smallest, "the hyperparameters determine the gap's ordering of every pair",
                         per_set)
    if smallest < min_pairs:
        return CMIResult(math.nan, best_set, smallest,
                         f"conditioning on {smallest_set} leaves cells of {smallest} pair(s) of runs (fewer than "
                         f"{min_pairs}): there the plug-in mutual information is close to 1 for any measure, "
                         "noise included", per_set)
    return CMIResult(best, best_set, smallest, "", per_set)
