"""Dziugaite et al. (2020, "In search of robust measures of generalization"): sign errors per environment,
and the ordering of seed replicates.

* **Environment**: a hyperparameter axis i together with one combination of the values of every other
  hyperparameter axis. Its pairs are the pairs of runs that differ in axis i only (any two levels of it;
  every combination of the two runs' seeds counts, as independent draws of the two trainings). A pair
  whose gaps are equal has no sign to predict and is left out.
* **Sign error** of a pair: 1 when sign(Δmeasure) is the opposite of sign(Δgap), ½ when the measure ties,
  0 when it has the gap's sign. An environment's sign error is the mean over its pairs; a measure's
  `sign_error_mean` is the mean over environments and `sign_error_worst` the largest (Dziugaite et al.'s
  robust, worst-case view: a measure is only as good as in the environment where it fails most). 0.5 is
  what a coin flip scores. An environment of a few pairs gives a coarse error (0, ½, 1 for one pair),
  so the worst case over many small environments is pessimistic; `n_environments` says how many.
* **Seed pairs**: pairs of runs that share every hyperparameter value (their cell) and differ only in
  the seed. `seed_pairs_concordant` is the share of them (gap ties left out, measure ties counted ½)
  whose measure difference has the gap's sign: does the measure order two replicates of one
  configuration the way their gaps are ordered? 0.5 is chance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import binomtest

from flatbench.analysis.stats.design import group_ids


def _pair_errors(measure: np.ndarray, gap: np.ndarray, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pair: (sign error, whether the pair counts, i.e. has different gaps)."""
    sg = np.sign(gap[i] - gap[j])
    sm = np.sign(measure[i] - measure[j])
    err = np.where(sm == 0, 0.5, (sm != sg).astype(float))
    return err, sg != 0


@dataclass
class SignErrors:
    environments: pd.DataFrame
    """axis, environment (the other axes' values), n_pairs, sign_error: one row per environment."""

    @property
    def mean(self) -> float:
        e = self.environments["sign_error"]
        return float(e.mean()) if len(e) else math.nan

    @property
    def worst(self) -> float:
        e = self.environments["sign_error"]
        return float(e.max()) if len(e) else math.nan


def sign_errors(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame, axes: list[str]) -> SignErrors:
    """Every environment's sign error (module doc); runs are the rows of `codes`."""
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    rows = []
    for axis in axes:
        others = [a for a in axes if a != axis]
        keys = group_ids(codes, others)
        values = codes[axis].to_numpy()
        for key in np.unique(keys):
            members = np.flatnonzero(keys == key)
            if len(members) < 2:
                continue
            a, b = np.triu_indices(len(members), 1)
            i, j = members[a], members[b]
            differ = values[i] != values[j]
            i, j = i[differ], j[differ]
            err, ok = _pair_errors(measure, gap, i, j)
            if not ok.any():
                continue
            env = ", ".join(f"{o}={codes[o].iloc[members[0]]}" for o in others) or "(no other axis)"
            rows.append({"axis": axis, "environment": env, "n_pairs": int(ok.sum()),
                         "sign_error": float(err[ok].mean())})
    return SignErrors(pd.DataFrame(rows, columns=["axis", "environment", "n_pairs", "sign_error"]))


def seed_pairs(measure: np.ndarray, gap: np.ndarray, cells: np.ndarray,
               replicates: np.ndarray | None) -> tuple[float, int]:
    """(share of seed pairs ordered like their gaps, number of seed pairs); (NaN, 0) without any."""
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    if replicates is None or len(measure) < 2:
        return math.nan, 0
    a, b = np.triu_indices(len(measure), 1)
    same = (cells[a] == cells[b]) & (np.asarray(replicates)[a] != np.asarray(replicates)[b])
    i, j = a[same], b[same]
    err, ok = _pair_errors(measure, gap, i, j)
    if not ok.any():
        return math.nan, 0
    return float(1.0 - err[ok].mean()), int(ok.sum())


def seed_pairs_pvalue(measure: np.ndarray, gap: np.ndarray, cells: np.ndarray,
                      replicates: np.ndarray | None) -> float:
    """Two-sided exact sign test of the seed pairs: among the pairs that differ only in the seed and whose
    measure and gap both differ, is the share ordered like the gap different from ½? NaN without any.

    With two seeds per cell the pairs are independent (one per cell), so the binomial null is exact; with
    more seeds a cell's pairs share runs and the test is approximate (the p-value is then too small).
    """
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    if replicates is None or len(measure) < 2:
        return math.nan
    a, b = np.triu_indices(len(measure), 1)
    same = (cells[a] == cells[b]) & (np.asarray(replicates)[a] != np.asarray(replicates)[b])
    err, ok = _pair_errors(measure, gap, a[same], b[same])
    decided = err[ok & (err != 0.5)]
    if not len(decided):
        return math.nan
    return float(binomtest(int((decided == 0).sum()), len(decided), 0.5).pvalue)
