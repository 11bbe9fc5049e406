"""Dziugaite et al. (2020, "In search of robust measures of generalization"): sign errors per environment
with their noise filter, and the ordering of replicates of one configuration.

* **Environment**: an axis i together with one combination of the values of every other axis. Its pairs
  are the pairs of runs of one data draw that differ in axis i only (any two levels of it; the report
  passes the draws, `plan`, so that the draw's shared offset of the gap is not scored: 5 draws × one run
  per cell give 5 pairs per level pair; without draws, every pair of draws counts). Dziugaite et al. make one
  environment of every ordered pair of levels; here the level pairs of an axis are pooled in one
  environment (an axis of 11 ratios would otherwise make 55 environments of a few pairs each).
* **Noise filter** (Dziugaite et al., §4 and their code's `hoeffding_weight`): a pair counts only when
  its gap difference Δ is unlikely to be noise, with weight ω(Δ) = (q(Δ) − ½)₊, q(Δ) the probability that
  both gaps lie within |Δ|/2 of their expectations. They bound q by Hoeffding's inequality for a test set
  of n examples, q = (1 − 2·exp(−nΔ²/2))², because their noise is the test sample's. Here the runs of a
  configuration differ by much more than that (data draw, initialization, batch order, as well as the
  test sample), so the same rule uses the replicate noise: each gap is its configuration's expected gap
  plus N(0, σ²) noise, σ the pooled within-configuration standard deviation of the gap
  (`replicate_sd`: Σ_c Σ_(r∈c) (g_r − ḡ_c)² / Σ_c (m_c − 1) over the configurations of m_c ≥ 2 runs),
  so q(Δ) = (1 − 2Φ(−|Δ|/(2σ)))². A pair counts (ω > 0) exactly when |Δ| > 2·z·σ with z = Φ⁻¹((1 + √½)/2)
  ≈ 1.052, i.e. |Δ| > 2.10σ, about 1.5 standard deviations of the difference of two independent gaps.
  Without a configuration of two runs σ cannot be estimated: every pair with different gaps then counts
  with weight 1 and a note says the filter is off.
* **Sign error** of a pair: 1 when sign(Δmeasure) is the opposite of sign(Δgap), ½ when the measure ties,
  0 when it has the gap's sign. An environment's sign error is the ω-weighted mean over its counted
  pairs (as Dziugaite et al.). Only environments with at least `MIN_ENV_PAIRS` counted pairs are
  averaged: `sign_error_mean` is their mean and `sign_error_worst` their largest (the robust, worst-case
  view; 0.5 is what a coin flip scores). The others are listed by name (`averaged` False), never silently
  averaged (Dziugaite et al. drop environments whose effective sample size (Σω)²/Σω² is below 12; the
  `ess` column gives it). With 2 draws an environment of a 2-level axis holds at most 2 pairs within
  draws (one run per cell and draw): none is averaged.
* **Replicate pairs** (`seed_pairs_concordant`): pairs of runs of one configuration (they differ in their
  replicate fields only). The share of them (gap ties left out, measure ties counted ½) whose measure
  difference has the gap's sign: does the measure order two replicates of one configuration the way their
  gaps are ordered? 0.5 is chance. It is descriptive: the pairs of one draw-pair share a draw effect, so
  a binomial test over them is not valid; its p-value (`replicate_pvalue`) comes from the two-way
  bootstrap, only when the draws are resampled (D ≥ `bootstrap.MIN_DRAWS`), otherwise NaN with the
  note "with D draws no replicate-level test is possible".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import norm

from flatbench.analysis.stats.bootstrap import MIN_UNITS, TwoWay
from flatbench.analysis.stats.design import group_ids
from flatbench.analysis.stats.kernels import bootstrap_pvalue

MIN_ENV_PAIRS = 10
"""Fewest counted pairs an environment needs to enter `sign_error_mean` and `sign_error_worst`."""
NOISE_Z = float(norm.ppf((1.0 + math.sqrt(0.5)) / 2.0))
"""q(Δ) > ½ ⇔ |Δ| > 2·NOISE_Z·σ (module doc)."""
ENV_COLUMNS = ["axis", "environment", "n_pairs", "ess", "sign_error", "averaged"]


def replicate_sd(gap: np.ndarray, cells: np.ndarray) -> float:
    """Pooled within-configuration standard deviation of the gap; NaN without a cell of two runs."""
    gap = np.asarray(gap, dtype=float)
    cells = np.asarray(cells, dtype=np.int64)
    if not len(gap):
        return math.nan
    sizes = np.bincount(cells)
    means = np.bincount(cells, weights=gap) / np.maximum(sizes, 1)
    dof = int((sizes[sizes > 1] - 1).sum())
    if dof == 0:
        return math.nan
    return float(math.sqrt(((gap - means[cells]) ** 2).sum() / dof))


def pair_weight(delta: np.ndarray, noise_sd: float) -> np.ndarray:
    """ω(Δ) = (q(Δ) − ½)₊ with q(Δ) = (1 − 2Φ(−|Δ|/(2σ)))² (module doc); 1 where Δ ≠ 0 when σ is NaN."""
    delta = np.abs(np.asarray(delta, dtype=float))
    if not math.isfinite(noise_sd):
        return (delta > 0).astype(float)
    if noise_sd <= 0:
        return np.where(delta > 0, 0.5, 0.0)
    q = (1.0 - 2.0 * norm.sf(delta / (2.0 * noise_sd))) ** 2
    return np.maximum(q - 0.5, 0.0)


def _pair_errors(measure: np.ndarray, sg: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """(R, P) sign errors of the pairs for every row of `measure` (R, n), given the gap's signs `sg`."""
    sm = np.sign(measure[:, i] - measure[:, j])
    return np.where(sm == 0, 0.5, (sm != sg[None, :]).astype(float))


@dataclass
class EnvironmentPlan:
    """Every environment of the design and its counted pairs (contiguous, environment by environment)."""

    frame: pd.DataFrame
    """axis, environment, n_pairs (counted), ess, averaged: one row per environment."""
    i: np.ndarray
    j: np.ndarray
    weight: np.ndarray
    sg: np.ndarray
    starts: np.ndarray
    """Index of each environment's first counted pair, for the environments with one (`has_pairs`)."""
    has_pairs: np.ndarray
    noise_sd: float

    def errors(self, measures: np.ndarray) -> np.ndarray:
        """(R, n_environments) weighted sign error of every environment (NaN without a counted pair)."""
        x = np.atleast_2d(np.asarray(measures, dtype=float))
        out = np.full((len(x), len(self.frame)), np.nan)
        if len(self.i):
            err = _pair_errors(x, self.sg, self.i, self.j) * self.weight[None, :]
            num = np.add.reduceat(err, self.starts, axis=1)
            den = np.add.reduceat(self.weight, self.starts)
            out[:, self.has_pairs] = num / den[None, :]
        return out

    def summary(self, errors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(R,) mean and worst sign error over the averaged environments; NaN without one."""
        averaged = self.frame["averaged"].to_numpy(dtype=bool)
        if not averaged.any():
            return np.full(len(errors), np.nan), np.full(len(errors), np.nan)
        chosen = errors[:, averaged]
        return chosen.mean(axis=1), chosen.max(axis=1)


def _environment_pairs(codes: pd.DataFrame, axes: list[str], axis: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, i, j) of every environment of `axis`: the pairs of runs that differ in this axis only."""
    others = [a for a in axes if a != axis]
    keys = group_ids(codes, others)
    values = codes[axis].to_numpy()
    out = []
    for key in np.unique(keys):
        members = np.flatnonzero(keys == key)
        a, b = np.triu_indices(len(members), 1)
        differ = values[members[a]] != values[members[b]]
        if not differ.any():
            continue
        name = ", ".join(f"{o}={codes[o].iloc[members[0]]}" for o in others) or "(no other axis)"
        out.append((name, members[a][differ], members[b][differ]))
    return out


def environment_plan(gap: np.ndarray, codes: pd.DataFrame, axes: list[str], noise_sd: float,
                     min_pairs: int = MIN_ENV_PAIRS, draws: np.ndarray | None = None) -> EnvironmentPlan:
    """The environments of the design, their counted pairs and weights (module doc); with `draws`, only the
    pairs of runs of one draw count (the report's blocking, `plan`)."""
    gap = np.asarray(gap, dtype=float)
    same = (lambda i, j: draws[i] == draws[j]) if draws is not None else (lambda i, j: np.ones(len(i), bool))
    rows, pi, pj, pw, starts, has = [], [], [], [], [], []
    total = 0
    for axis in axes:
        for name, i, j in _environment_pairs(codes, axes, axis):
            within = same(i, j)
            i, j = i[within], j[within]
            if not len(i):
                continue
            w = pair_weight(gap[i] - gap[j], noise_sd)
            keep = w > 0
            n = int(keep.sum())
            ess = float(w[keep].sum() ** 2 / (w[keep] ** 2).sum()) if n else 0.0
            rows.append({"axis": axis, "environment": name, "n_pairs": n, "ess": ess, "averaged": n >= min_pairs})
            has.append(n > 0)
            if n:
                pi.append(i[keep])
                pj.append(j[keep])
                pw.append(w[keep])
                starts.append(total)
                total += n
    cat = (lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))
    i, j = cat(pi, np.int64), cat(pj, np.int64)
    frame = pd.DataFrame(rows, columns=["axis", "environment", "n_pairs", "ess", "averaged"])
    return EnvironmentPlan(frame, i, j, cat(pw, float), np.sign(gap[i] - gap[j]), np.array(starts, dtype=np.int64),
                           np.array(has, dtype=bool), noise_sd)


@dataclass
class SignErrors:
    environments: pd.DataFrame
    """axis, environment, n_pairs, ess, sign_error, averaged: one row per environment."""
    mean: float
    worst: float


def sign_errors(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame, axes: list[str],
                noise_sd: float = math.nan, min_pairs: int = MIN_ENV_PAIRS) -> SignErrors:
    """Every environment's sign error for one measure (module doc); runs are the rows of `codes`."""
    plan = environment_plan(gap, codes, axes, noise_sd, min_pairs)
    errors = plan.errors(np.asarray(measure, dtype=float)[None, :])
    mean, worst = plan.summary(errors)
    frame = plan.frame.assign(sign_error=errors[0])[ENV_COLUMNS]
    return SignErrors(frame, float(mean[0]), float(worst[0]))


# --------------------------------------------------------------------------------------- replicate pairs

@dataclass
class ReplicatePairs:
    """Pairs of runs of one configuration whose gaps differ."""

    i: np.ndarray
    j: np.ndarray
    sg: np.ndarray

    def shares(self, measures: np.ndarray) -> np.ndarray:
        """(R,) share of the pairs ordered like their gaps (measure ties ½); NaN without pairs."""
        x = np.atleast_2d(np.asarray(measures, dtype=float))
        if not len(self.i):
            return np.full(len(x), np.nan)
        return 1.0 - _pair_errors(x, self.sg, self.i, self.j).mean(axis=1)


def replicate_pairs(gap: np.ndarray, cells: np.ndarray) -> ReplicatePairs:
    gap = np.asarray(gap, dtype=float)
    a, b = np.triu_indices(len(gap), 1)
    keep = (np.asarray(cells)[a] == np.asarray(cells)[b]) & (gap[a] != gap[b])
    i, j = a[keep], b[keep]
    return ReplicatePairs(i, j, np.sign(gap[i] - gap[j]))


def _replicate_weights(pairs: ReplicatePairs, boot: TwoWay) -> tuple[np.ndarray, np.ndarray]:
    """The (n_boot, P) weights of the pairs and their sums, made once per bootstrap and pairs: they depend on
    neither the measure nor its values (the natural study: 18 measures × 1 s before). Kept in `boot.cache`
    with the pair arrays themselves, so that other pairs on the same bootstrap never get them."""
    kept = boot.cache.get("replicate_pair_weights")
    if kept is None or kept[0] is not pairs.i or kept[1] is not pairs.j:
        w = boot.pair_weights(pairs.i, pairs.j)
        w.flags.writeable = False
        kept = boot.cache["replicate_pair_weights"] = (pairs.i, pairs.j, w, w.sum(axis=1))
    return kept[2], kept[3]


def replicate_pvalue(pairs: ReplicatePairs, measure: np.ndarray, boot: TwoWay) -> tuple[float, str]:
    """(p, "") of H0 "the share is ½" by the two-way bootstrap of the pairs (pairs of distinct copies,
    `TwoWay.pair_weights`), or (NaN, why not): only when the draws are resampled."""
    n_draws = boot.draw_weights.shape[1]
    if not boot.draws_resampled:
        return math.nan, f"with {n_draws} draw(s) no replicate-level test is possible"
    if not len(pairs.i) or boot.n_units < MIN_UNITS:
        return math.nan, "too few replicate pairs or units"
    err = _pair_errors(np.asarray(measure, dtype=float)[None, :], pairs.sg, pairs.i, pairs.j)[0]
    w, total = _replicate_weights(pairs, boot)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(total > 0, 1.0 - (w @ err) / np.where(total > 0, total, 1.0), np.nan)
    return bootstrap_pvalue(share - 0.5), ""
