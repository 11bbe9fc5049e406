"""Jiang et al. (2020, "Fantastic generalization measures and where to find them") §4-5: the granulated
Kendall coefficient Ψ and the conditional-mutual-information score.

* ψ_i (Eq. 4): for axis i, the **blocks** are the runs that share every *other* axis value and their data
  draw (`design`); ψ_i is the mean over the blocks of Jiang's τ inside the block: the mean, over the
  block's pairs of runs at different levels of axis i, of sign(Δmeasure)·sign(Δgap) (a tie scores 0).
  With one run per level in a block (a full product with one run per cell and draw) these are all the
  block's pairs, as in Jiang et al.; pairs of runs at the same level (two initialization seeds of one
  draw) differ in no axis and are left out. A block without such a pair says nothing about axis i.
  Replicate fields (`seed`, `data.seed`) are never axes: ψ over them would ask whether the measure orders
  two replicates of one configuration by their gap, the noise of the experiment (`robust.replicate_pairs`).
* **Ψ** = the mean of ψ_i over the *training* axes whose ψ is defined (Jiang et al. average over
  training hyperparameters); **psi_data** = the mean over the data axes (`design.is_data_axis`). Each is
  NaN when none of its axes has a ψ.
* **CMI** (§5): over the ordered pairs (i, j) of runs with different gaps, V_g = sign(Δgap), V_μ =
  sign(Δmeasure) (a tie in the measure is a third outcome); for a set S of axes, U_S is the pair's values
  of S, (θ_i,S, θ_j,S). Î(S) = I(V_μ; V_g | U_S) / H(V_g | U_S), both averaged over the cells of U_S with
  the cells' share of the pairs as weights (Jiang et al.'s definition; the PGDL scorer averages the cells
  without weights and uses only |S| = 2). The score is the minimum of Î over all S with |S| ≤ 2 (the
  empty set included), S drawn from every axis, training and data (never a replicate field). It is
  sign-agnostic: a measure that orders every pair backwards scores as high as one that orders them right.
  Plug-in mutual information is biased upwards in small cells: for a cell holding m unordered pairs of
  a measure that is pure noise the expected score is about 0.72 / m, and at m = 1 it is exactly 1 for
  every measure (the cell's two ordered pairs are mirror images, and any measure "predicts" one from the
  other). So the score is given only when every cell that has something to explain (H(V_g | cell) > 0)
  holds at least `MIN_CMI_PAIRS` unordered pairs, under every conditioning set; otherwise it is n/a and
  the reason names the set and its smallest cell.

Everything that depends only on the design and the gap (the blocks and their pairs, the CMI cells) is
built once (`PsiBlocks`, `CMIPlan`); a statistic is then evaluated for a batch of measures at once
(rows of a (R, n) array: the measures of a study, or the R draws of the random reference).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import entropy

from flatbench.analysis.stats.design import group_ids

MIN_CMI_PAIRS = 10
"""Fewest unordered pairs of runs a CMI cell with V_g not constant may hold (bias of pure noise ≲ 0.07)."""
MAX_CMI_SET = 2


# ------------------------------------------------------------------------------------------------ ψ

@dataclass
class PsiBlocks:
    """The blocks of ψ for one axis and their pairs of runs at different levels of it, block by block."""

    axis: str
    i: np.ndarray
    j: np.ndarray
    starts: np.ndarray
    """Index into the pairs where each block's pairs begin (blocks in order; every block has a pair)."""
    counts: np.ndarray
    combo: np.ndarray
    """Per block: the id (0 .. K − 1) of its combination of the other axes."""
    draw: np.ndarray
    """Per block: its draw id (0 .. D − 1)."""
    n_combos: int
    n_draws: int

    @property
    def n_blocks(self) -> int:
        return len(self.starts)

    def block_taus(self, measures: np.ndarray, gap: np.ndarray) -> np.ndarray:
        """(R, n_blocks) Jiang τ of every block for every row of `measures` (R, n)."""
        x = np.atleast_2d(np.asarray(measures, dtype=float))
        if not self.n_blocks:
            return np.zeros((len(x), 0))
        s = np.sign(x[:, self.i] - x[:, self.j]) * np.sign(gap[self.i] - gap[self.j])[None, :]
        return np.add.reduceat(s, self.starts, axis=1) / self.counts[None, :]


def psi_blocks(codes: pd.DataFrame, axes: list[str], axis: str, draws: np.ndarray) -> PsiBlocks:
    """The blocks of ψ_axis (module doc): runs sharing every other axis and the draw."""
    draws = np.asarray(draws, dtype=np.int64)
    combo = group_ids(codes, [a for a in axes if a != axis])
    n_draws = int(draws.max()) + 1 if len(draws) else 0
    key = combo * max(n_draws, 1) + draws
    level = pd.factorize(codes[axis].to_numpy())[0] if len(codes) else np.zeros(0, dtype=np.int64)
    order = np.argsort(key, kind="stable")
    bounds = np.flatnonzero(np.diff(key[order])) + 1
    pi, pj, starts, counts, combos, block_draws = [], [], [], [], [], []
    total = 0
    for members in np.split(order, bounds) if len(order) else []:
        a, b = np.triu_indices(len(members), 1)
        cross = level[members[a]] != level[members[b]]
        if not cross.any():
            continue
        pi.append(members[a][cross])
        pj.append(members[b][cross])
        starts.append(total)
        counts.append(int(cross.sum()))
        total += int(cross.sum())
        combos.append(int(combo[members[0]]))
        block_draws.append(int(draws[members[0]]))
    cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    combo_ids = pd.factorize(np.array(combos, dtype=np.int64))[0] if combos else np.zeros(0, dtype=np.int64)
    return PsiBlocks(axis, cat(pi), cat(pj), np.array(starts, dtype=np.int64), np.array(counts, dtype=float),
                     combo_ids.astype(np.int64), np.array(block_draws, dtype=np.int64),
                     int(combo_ids.max()) + 1 if len(combo_ids) else 0, n_draws)


def psi_values(blocks: PsiBlocks, measures: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """(R,) ψ of the axis for every row of `measures`; NaN without blocks."""
    taus = blocks.block_taus(measures, gap)
    return taus.mean(axis=1) if taus.shape[1] else np.full(len(taus), np.nan)


def mean_defined(values: list[np.ndarray], n: int) -> np.ndarray:
    """Row-wise mean of the finite entries of several (n,) arrays; NaN where none is finite."""
    if not values:
        return np.full(n, np.nan)
    stack = np.vstack(values)
    ok = np.isfinite(stack)
    with np.errstate(invalid="ignore"):
        return np.where(ok.any(axis=0), np.where(ok, stack, 0.0).sum(axis=0) / np.maximum(ok.sum(axis=0), 1), np.nan)


def granulated_kendall(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame, axes: list[str],
                       within: list[str] | tuple[str, ...] = ()) -> tuple[float, dict[str, float]]:
    """(mean of the defined ψ_i, ψ_i per axis) for one measure; runs are the rows of `codes`, aligned with
    the arrays. `within` are columns of `codes` every block must share besides the other axes (the draw).
    (`analyze` splits the mean into Ψ over training axes and psi_data over data axes.)"""
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    draws = group_ids(codes, [c for c in within if c in codes.columns])
    per_axis = {a: float(psi_values(psi_blocks(codes, axes, a, draws), measure[None, :], gap)[0]) for a in axes}
    return float(mean_defined([np.array([v]) for v in per_axis.values()], 1)[0]), per_axis


# ---------------------------------------------------------------------------------------------- CMI

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


@dataclass
class _CMISet:
    name: str
    cell: np.ndarray
    """Cell of U_S of every ordered pair."""
    n_cells: int
    h_g: np.ndarray
    weight: np.ndarray
    cond_h: float
    base: np.ndarray
    """(cell·2 + V_g)·3 of each pair (i < j): its place in the (cell, V_g, V_μ) table but for V_μ."""
    mirror: np.ndarray
    """The cell of (j, i) for each cell of (i, j): U_S with the two runs' values swapped."""


@dataclass
class CMIPlan:
    """What CMI needs of the design and the gap: the ordered pairs, V_g, and every conditioning set's
    cells (measure-independent); `scores` evaluates it for a batch of measures."""

    i: np.ndarray
    j: np.ndarray
    vg: np.ndarray
    sets: list[_CMISet]
    min_pairs: int
    smallest_set: str
    reason: str
    half: np.ndarray | None = None
    """The ordered pairs with i < j: one of each mirror-image pair (`scores`)."""

    ROWS_PER_CHUNK = 16
    """Measures whose tables are counted at once (bounds the (rows, pairs) index arrays: 19 MB at 145k pairs)."""

    def scores(self, measures: np.ndarray) -> tuple[np.ndarray, list[str], list[dict[str, float]]]:
        """(R,) scores (NaN with `reason`), the set attaining each, and each row's score per set.

        The ordered pairs come in mirror images: (j, i) has the swapped cell, the other V_g and V_μ = 2 − V_μ
        of (i, j). So each table is counted over the pairs i < j alone and its mirror image added
        (`_CMISet.mirror`, both V axes reversed): the same integer counts as over every ordered pair, in half
        the passes (the random reference's 200 measures over 291k pairs: 14 s before)."""
        x = np.atleast_2d(np.asarray(measures, dtype=float))
        r = len(x)
        if not self.sets:
            return np.full(r, np.nan), [""] * r, [{} for _ in range(r)]
        i, j = self.i[self.half], self.j[self.half]
        table_scores = np.empty((r, len(self.sets)))
        for start in range(0, r, self.ROWS_PER_CHUNK):
            chunk = x[start:start + self.ROWS_PER_CHUNK]
            vm = (np.sign(chunk[:, i] - chunk[:, j]) + 1).astype(np.int64)
            for k, s in enumerate(self.sets):
                table_scores[start:start + len(chunk), k] = _set_scores(s, vm)
        best = np.argmin(table_scores, axis=1)
        names = [self.sets[b].name for b in best]
        per_set = [{s.name: float(table_scores[row, k]) for k, s in enumerate(self.sets)} for row in range(r)]
        score = table_scores[np.arange(r), best]
        return (np.full(r, np.nan) if self.reason else score), names, per_set


def _set_scores(s: _CMISet, vm: np.ndarray) -> np.ndarray:
    """Î(S) of each row of `vm` (V_μ of the pairs i < j) for the conditioning set `s` (`CMIPlan.scores`)."""
    r, size = len(vm), s.n_cells * 6
    index = vm + s.base[None, :]
    index += (np.arange(r) * size)[:, None]
    half = np.bincount(index.ravel(), minlength=r * size).reshape(r, s.n_cells, 2, 3)
    table = (half + half[:, s.mirror, ::-1, ::-1]).astype(float)
    h_m = entropy(table.sum(axis=2), base=2, axis=2)
    h_joint = entropy(table.reshape(r, s.n_cells, 6), base=2, axis=2)
    mi = np.maximum(s.h_g[None, :] + h_m - h_joint, 0.0)
    return (s.weight[None, :] * mi).sum(axis=1) / s.cond_h


def _mirror_pairs(i: np.ndarray, j: np.ndarray, n_runs: int) -> np.ndarray:
    """The index of (j, i) among the ordered pairs, for each pair (i, j)."""
    position = np.full((n_runs, n_runs), -1, dtype=np.int64)
    position[i, j] = np.arange(len(i))
    return position[j, i]


def _mirror_cells(cell: np.ndarray, mirror_pair: np.ndarray, n_cells: int) -> np.ndarray:
    """For each cell of U_S, the cell of the mirror-image pairs: cell(j, i) for the pairs (i, j) in it."""
    mirror = np.empty(n_cells, dtype=np.int64)
    mirror[cell] = cell[mirror_pair]
    return mirror


def _pairs(gap: np.ndarray, draws: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ordered pairs (i, j), i ≠ j, with different gaps (of one draw when `draws` is given)."""
    n = len(gap)
    i, j = np.nonzero(~np.eye(n, dtype=bool))
    keep = gap[i] != gap[j]
    if draws is not None:
        keep &= np.asarray(draws)[i] == np.asarray(draws)[j]
    return i[keep], j[keep]


def _conditioning_cells(int_codes: dict[str, np.ndarray], cardinality: dict[str, int], subset: tuple[str, ...],
                        i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """(cell of every ordered pair, number of cells, whether each cell is diagonal: θ_i,S = θ_j,S)."""
    cell = np.zeros(len(i), dtype=np.int64)
    diagonal = np.ones(len(i), dtype=bool)
    for a in subset:
        k = cardinality[a]
        ci, cj = int_codes[a][i], int_codes[a][j]
        cell = (cell * k + ci) * k + cj
        diagonal &= ci == cj
    cells, cell = np.unique(cell, return_inverse=True)
    is_diag = np.zeros(len(cells), dtype=bool)
    is_diag[cell[diagonal]] = True
    return cell.astype(np.int64), len(cells), is_diag


def cmi_plan(gap: np.ndarray, codes: pd.DataFrame, axes: list[str], min_pairs: int = MIN_CMI_PAIRS,
             draws: np.ndarray | None = None) -> CMIPlan:
    """The measure-independent part of Jiang et al.'s CMI score over `axes` (module doc); with `draws`, over
    the pairs of runs of one draw only (the report's blocking, `plan`)."""
    gap = np.asarray(gap, dtype=float)
    empty = np.zeros(0, dtype=np.int64)
    if not axes:
        return CMIPlan(empty, empty, empty, [], 0, "", "no axis varies (a replicate field is never conditioned on)")
    if len(gap) < 3:
        return CMIPlan(empty, empty, empty, [], 0, "", "fewer than 3 runs")
    i, j = _pairs(gap, draws)
    if not len(i):
        return CMIPlan(empty, empty, empty, [], 0, "", "the gap is constant")
    vg = (gap[i] > gap[j]).astype(np.int64)
    half = i < j
    mirror_pair = _mirror_pairs(i, j, len(gap))
    int_codes = {a: pd.factorize(codes[a])[0].astype(np.int64) for a in axes}
    cardinality = {a: int(int_codes[a].max()) + 1 for a in axes}
    sets: list[_CMISet] = []
    smallest, smallest_set = None, ""
    for size in range(0, min(MAX_CMI_SET, len(axes)) + 1):
        for subset in itertools.combinations(axes, size):
            name = "+".join(subset) if subset else "none"
            cell, n_cells, is_diag = _conditioning_cells(int_codes, cardinality, subset, i, j)
            g_counts = np.bincount(cell * 2 + vg, minlength=n_cells * 2).reshape(n_cells, 2).astype(float)
            per_cell = g_counts.sum(axis=1)
            unordered = np.where(is_diag, per_cell / 2, per_cell)  # a diagonal cell holds both orders of a pair
            h_g = entropy(g_counts, base=2, axis=1)
            informative = h_g > 1e-12
            if informative.any():
                low = int(unordered[informative].min())
                if smallest is None or low < smallest:
                    smallest, smallest_set = low, name
            weight = per_cell / per_cell.sum()
            cond_h = float((weight * h_g).sum())
            if cond_h > 1e-12:  # else S determines the ordering of every pair: nothing left to explain
                sets.append(_CMISet(name, cell, n_cells, h_g, weight, cond_h, base=(cell[half] * 2 + vg[half]) * 3,
                                    mirror=_mirror_cells(cell, mirror_pair, n_cells)))
    smallest = int(smallest) if smallest is not None else 0
    reason = ""
    if not sets:
        reason = "the axes determine the gap's ordering of every pair"
    elif smallest < min_pairs:
        reason = (f"conditioning on {smallest_set} leaves cells of {smallest} pair(s) of runs (fewer than "
                  f"{min_pairs}): there the plug-in mutual information is close to 1 for any measure, noise included")
    return CMIPlan(i, j, vg, sets, smallest, smallest_set, reason, half=half)


def conditional_mi(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame, axes: list[str],
                   min_pairs: int = MIN_CMI_PAIRS) -> CMIResult:
    """Jiang et al.'s CMI score of one measure over `axes` (module doc); `codes` holds their values."""
    plan = cmi_plan(gap, codes, axes, min_pairs)
    if not plan.sets:
        return CMIResult(math.nan, "", plan.min_pairs, plan.reason, {} if plan.reason.startswith("the axes") else None)
    scores, names, per_set = plan.scores(np.asarray(measure, dtype=float)[None, :])
    best = min(per_set[0].values())
    return CMIResult(math.nan if plan.reason else best, names[0], plan.min_pairs, plan.reason, per_set[0])
