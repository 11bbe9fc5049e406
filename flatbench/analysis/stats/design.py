"""The study's design as the statistics see it: hyperparameter axes, replicates, cells, bootstrap strata.

* **Hyperparameter axes**: the study's sweep axes (`table.sweep_axes`: what run.json records as swept,
  plus `experiment` when pooled folders differ in a fixed field) that take more than one value among the
  runs used. `seed` is never one: seeds are replicates of a configuration, not a hyperparameter (Jiang et
  al. 2020 average over hyperparameter axes only). A pooled report's `experiment` axis *is* treated as a
  hyperparameter: runs of two folders are compared only where every other hyperparameter is equal, as
  for any other axis (say, a dataset or an architecture that the folders fix).
* **Replicate axis**: `seed`, when it varies.
* **Cell**: the runs that share every hyperparameter value (they differ in their seed only). Any number
  of levels per axis, any number of runs per cell (an unbalanced design is fine).
* **Strata** of the bootstrap: the cells. Resampling within a cell keeps the design fixed (the same
  configurations in every resample) and resamples only what is random in it, the seeds.
  - A design whose every cell holds one run (one seed; Tsuzuku et al.'s `{uniform: N}` ratios) has
    nothing to resample within cells: the bootstrap falls back to resampling all runs as one stratum
    (it then treats the configurations as drawn at random), and says so.
  - Cells of one run next to larger cells: those single runs are pooled into one stratum of their own,
    and the report says how many.

`design_bootstrap` draws the resamples as weights: in every stratum of m runs, m runs are drawn with
replacement (the stratified bootstrap; `resample_weights`), and two corrections make it fit τ and small
cells (two seeds):

* **pair weights**: τ is a sum over pairs of distinct runs, and a plain resample keeps a pair of runs of
  the same stratum only with probability (m − 1)/m (half of the time for two seeds: the within-cell pairs,
  the hard ones, would be under-represented and τ* biased upwards). Each such pair's weight is multiplied
  by m/(m − 1), so that every pair of distinct runs has expected weight 1 (`pair_weights`);
* **spread**: the stratified bootstrap's variance of a linear statistic is (m − 1)/m of the unbiased one
  (half for two seeds). The resampled statistics are spread about the estimate by λ = sqrt(mean over the
  runs of m/(m − 1)) (Rao & Wu 1988's rescaling, applied to the output): θ*' = θ̂ + λ(θ* − θ̂), clipped to
  [−1, 1]. First-order correct for smooth statistics; exact for linear ones.

Integer weights are kept integer (the pair weights are scaled by the lcm of the (m − 1), a factor that
changes no ratio), so the batched τ is exact and does not depend on the order of floating-point sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

REPLICATE_AXES = ("seed",)
"""Config fields that index replicates of one configuration, never a hyperparameter axis."""


def axis_text(value: Any) -> str:
    """Axis values as strings, so floats, strings and missing values group the same way everywhere."""
    if value is None or (isinstance(value, (float, np.floating)) and math.isnan(value)):
        return "None"
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return repr(float(value))  # 0 (from YAML) and 0.0 are the same axis value
    return str(value)


def axis_codes(frame: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    return pd.DataFrame({a: frame[a].map(axis_text).to_numpy() for a in axes}, index=frame.index)


def group_ids(codes: pd.DataFrame, columns: list[str]) -> np.ndarray:
    """One integer per distinct combination of `columns` (all zeros without columns)."""
    if not columns or not len(codes):
        return np.zeros(len(codes), dtype=np.int64)
    return pd.MultiIndex.from_frame(codes[columns]).factorize()[0].astype(np.int64)


@dataclass
class Design:
    axes: list[str]
    """Hyperparameter axes that vary among the runs (never `seed`)."""
    replicate: str | None
    """`seed` when it varies among the runs, else None."""
    codes: pd.DataFrame
    """String codes of the axes and the replicate column, one row per run (index of the runs' frame)."""
    cells: np.ndarray
    """Cell id per run: runs with equal ids share every hyperparameter value."""

    @property
    def n_cells(self) -> int:
        return int(self.cells.max()) + 1 if len(self.cells) else 0

    def subset(self, mask: np.ndarray) -> "Design":
        cells = pd.factorize(self.cells[mask])[0].astype(np.int64)
        return Design(self.axes, self.replicate, self.codes[mask], cells)


def design_of(frame: pd.DataFrame, sweep: list[str]) -> Design:
    """The design of the runs in `frame` given the study's sweep axes (see the module doc)."""
    varying = [a for a in sweep if a in frame.columns and frame[a].map(axis_text).nunique() > 1]
    axes = [a for a in varying if a not in REPLICATE_AXES]
    replicate = next((a for a in varying if a in REPLICATE_AXES), None)
    if replicate is None and "seed" in frame.columns and frame["seed"].map(axis_text).nunique() > 1:
        replicate = "seed"
    codes = axis_codes(frame, axes + ([replicate] if replicate else []))
    return Design(axes, replicate, codes, group_ids(codes, axes))


# ------------------------------------------------------------------------------------------ the strata

@dataclass
class Strata:
    ids: np.ndarray
    """Stratum per run."""
    scheme: str
    """"cells" (stratified by cell), "cells, singletons pooled" or "runs" (one stratum: plain bootstrap)."""
    description: str
    """One sentence for the report."""


def strata_of(cells: np.ndarray) -> Strata:
    """Bootstrap strata for runs with the given cell ids (see the module doc for the fallbacks)."""
    n = len(cells)
    if n == 0:
        return Strata(np.zeros(0, dtype=np.int64), "runs", "no runs")
    sizes = np.bincount(cells)
    single = sizes[cells] == 1
    n_cells = len(sizes)
    if n_cells == 1:
        return Strata(np.zeros(n, dtype=np.int64), "runs",
                      "every run has the same hyperparameters: the runs are resampled as one group")
    if single.all():
        return Strata(np.zeros(n, dtype=np.int64), "runs",
                      f"every one of the {n_cells} cells (hyperparameter combinations) holds a single run, so "
                      "there is no replicate to resample within a cell: the runs are resampled as one group "
                      "(plain bootstrap; it treats the configurations as drawn at random)")
    if single.any():
        ids = np.where(single, n_cells, cells)
        ids = pd.factorize(ids)[0].astype(np.int64)
        return Strata(ids, "cells, singletons pooled",
                      f"resampled within the {int((sizes > 1).sum())} cells that hold two or more runs; the "
                      f"{int(single.sum())} runs alone in their cell are pooled into one stratum")
    return Strata(cells.astype(np.int64), "cells",
                  f"resampled within each of the {n_cells} cells (hyperparameter combinations; "
                  f"{int(sizes.min())} to {int(sizes.max())} runs each): the design is kept, the seeds are "
                  "resampled")


def resample_weights(strata: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot, n) counts of the stratified bootstrap, as floats.

    Exactly: rng = `np.random.default_rng(seed)`; for each stratum in order of its id, with members
    m_1 < … < m_k, draws = rng.integers(0, k, size=(n_boot, k)); run m_j's weight is its number of draws.
    A stratum of one run always has weight 1 (no draw is made for it).
    """
    strata = np.asarray(strata, dtype=np.int64)
    n = len(strata)
    rng = np.random.default_rng(seed)
    out = np.zeros((max(n_boot, 0), n), dtype=np.float64)
    for h in range(int(strata.max()) + 1 if n else 0):
        g = np.flatnonzero(strata == h)
        k = len(g)
        if k == 0:
            continue
        if k == 1:
            out[:, g[0]] = 1.0
            continue
        draws = rng.integers(0, k, size=(n_boot, k))
        flat = (np.arange(n_boot)[:, None] * k + draws).ravel()
        out[:, g] = np.bincount(flat, minlength=n_boot * k).reshape(n_boot, k)
    return out


def pair_weights(strata: np.ndarray) -> np.ndarray:
    """(n, n) integer-valued pair weights: L for runs of different strata, L·m/(m − 1) for two runs of one
    stratum of m runs, L = lcm of the (m − 1) (module doc)."""
    strata = np.asarray(strata, dtype=np.int64)
    sizes = np.bincount(strata) if len(strata) else np.zeros(0, dtype=np.int64)
    lcm = 1
    for m in sizes:
        if m > 1:
            lcm = math.lcm(lcm, int(m) - 1)
    if lcm > 10**6:
        lcm = 1
    out = np.full((len(strata), len(strata)), float(lcm))
    same = strata[:, None] == strata[None, :]
    m = sizes[strata].astype(float)
    factor = np.where(m > 1, lcm * m / np.maximum(m - 1, 1), lcm)
    out[same] = np.broadcast_to(factor[:, None], out.shape)[same]
    return out


def spread_factor(strata: np.ndarray) -> float:
    """λ = sqrt(mean over the runs of strata with m ≥ 2 of m/(m − 1)) (module doc); 1 without any."""
    strata = np.asarray(strata, dtype=np.int64)
    if not len(strata):
        return 1.0
    m = np.bincount(strata)[strata].astype(float)
    m = m[m > 1]
    return float(math.sqrt(np.mean(m / (m - 1)))) if len(m) else 1.0


@dataclass
class Bootstrap:
    """The design bootstrap of one set of runs: weights, pair weights and spread (module doc)."""

    strata: Strata
    weights: np.ndarray
    pairs: np.ndarray
    spread: float
    cache: dict = field(default_factory=dict)
    """Per-design intermediate results shared by the measures (e.g. the gap's resample ranks)."""

    def rescale(self, estimate: float, resampled: np.ndarray, clip: float | None = 1.0) -> np.ndarray:
        out = estimate + self.spread * (np.asarray(resampled, dtype=float) - estimate)
        return np.clip(out, -clip, clip) if clip is not None else out


def design_bootstrap(cells: np.ndarray, n_boot: int, seed: int) -> Bootstrap:
    """The design bootstrap for runs with the given cell ids: strata, n_boot resamples drawn from `seed`."""
    cells = pd.factorize(np.asarray(cells))[0].astype(np.int64) if len(cells) else np.zeros(0, np.int64)
    strata = strata_of(cells)
    return Bootstrap(strata, resample_weights(strata.ids, n_boot, seed), pair_weights(strata.ids),
                     spread_factor(strata.ids))
