"""Is measure A better than measure B here, and which measures cannot be told apart from the best one?

Paired comparisons (`paired_comparisons`): for measures A and B over the runs where both have a value,
d = τ_A − τ_B (Kendall τ-b with the gap). The configurations and data draws are resampled by the two-way
cluster bootstrap (`bootstrap.two_way_bootstrap`), with the same weights for A and B, so the strong
correlation between two τ's that share the gap and most of the ranking is kept. From the resampled d*:

* `diff_lo`, `diff_hi`: the percentile interval;
* `diff_se`: the bootstrap standard error sd(d*);
* `p_value`: the two-sided Wald p-value 2·Φ(−|d| / sd(d*)). Chosen over a tail count of the resamples
  because Holm's procedure needs p-values near 0.05 / k (k ≈ 35 comparisons: 0.0014), where a count of
  10,000 resamples rests on ~14 of them (Monte-Carlo error ≈ 27%, enough to flip labels between report
  seeds), while sd(d*) from 10,000 resamples has a relative error of about 1/sqrt(2·10,000) = 0.7%.
  Its limit: it reads d as roughly normal, which a τ near 1 on few runs bends (the percentile interval
  is given next to it);
* `p_boot`: the tail-count bootstrap p-value (`kernels.bootstrap_pvalue`), for reference.

The best group (`best_group`): the reference is the measure with the highest τ. Every other measure with
a τ is compared with it; the k comparisons that have a p-value form one family, and Holm's step-down
procedure (Holm 1979) controls the probability of calling any measure worse when it is not at
α = `ALPHA`. Labels: "best"; "worse" (Holm-adjusted p ≤ α and τ below the best's); "better on shared runs"
(rejected the other way, only possible when the two have values on different runs); "indistinguishable"
(not rejected: the data cannot tell them apart, which is not evidence that they are equal); "cannot
compare" (fewer than `MIN_CI_RUNS` shared runs, fewer than `bootstrap.MIN_UNITS` resampled units, or
resamples that never move d).
The Monte-Carlo error of each adjusted p is estimated from `N_BATCHES` disjoint batches of the resamples
(the whole procedure rerun on each); a label whose adjusted p lies within `BORDERLINE_SE` of those errors
of α is marked borderline (another report seed may give the other label). Known limit: the reference
is chosen after looking at the data; Holm controls the errors of the comparisons given that choice, not
the choice itself (a model confidence set would also cover it).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import numpy as np
import pandas as pd
from scipy.stats import norm

from flatbench.analysis.stats.blocked import blocked_boot_tau, stratified_kendall
from flatbench.analysis.stats.bootstrap import MIN_UNITS, TwoWay, two_way_bootstrap
from flatbench.analysis.stats.kernels import bootstrap_pvalue, tau_from_parts

MIN_RUNS = 3
MIN_CI_RUNS = 10
CI_LEVEL = 0.95
ALPHA = 0.05
N_BATCHES = 10
BORDERLINE_SE = 3.0
COMPARISON_COLUMNS = ["measure_a", "measure_b", "n", "tau_a", "tau_b", "diff", "diff_lo", "diff_hi", "diff_se",
                      "p_value", "p_boot"]


def usable(values: np.ndarray, gap: np.ndarray) -> bool:
    """Whether τ is defined: enough runs, and neither the measure nor the gap constant over them (the one
    rule; `Resamples.tau` and the analysis both ask it)."""
    return len(values) >= MIN_RUNS and np.ptp(values) > 0 and np.ptp(gap) > 0


def holm(pvalues: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values: sort ascending, p̃_(j) = max_{i ≤ j} min(1, (k − i + 1)·p_(i))
    (1-based i); NaN entries are not part of the family and stay NaN."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    k = len(ok)
    if not k:
        return out
    order = ok[np.argsort(p[ok], kind="mergesort")]
    adjusted = np.minimum(1.0, (k - np.arange(k)) * p[order])
    out[order] = np.maximum.accumulate(adjusted)
    return out


def wald_p(diff: float, resampled: np.ndarray) -> tuple[float, float]:
    """(sd of the finite resampled differences, two-sided Wald p of diff against it); p NaN when the
    resamples never move (sd 0) unless diff is 0 too (p = 1)."""
    d = resampled[np.isfinite(resampled)]
    if len(d) < 10 or not math.isfinite(diff):
        return math.nan, math.nan
    se = float(np.std(d, ddof=1))
    if se <= 1e-12:
        return se, (1.0 if abs(diff) <= 1e-12 else math.nan)
    return se, float(2.0 * norm.sf(abs(diff) / se))


class Resamples:
    """τ of every measure over a subset of runs and on the two-way bootstrap's resamples of that subset,
    computed once per (measure, subset) and shared by every comparison (the same weights for every measure
    on the same subset: they depend only on the subset's cells and draws, the number of resamples and the
    seed). τ is stratified by data draw (`blocked`: pairs of runs of one draw only); with one draw it is
    τ-b over all pairs."""

    def __init__(self, data: Mapping[str, np.ndarray], gap: np.ndarray, cells: np.ndarray, draws: np.ndarray,
                 n_boot: int, seed: int):
        self.data, self.gap, self.cells, self.draws = data, gap, cells, draws
        self.n_boot, self.seed = n_boot, seed
        self._designs: dict[bytes, TwoWay] = {}
        self._points: dict[tuple[str, bytes], float] = {}
        self._boots: dict[tuple[str, bytes], np.ndarray] = {}

    def mask(self, *measures: str) -> np.ndarray:
        ok = np.isfinite(self.gap)
        for m in measures:
            ok &= np.isfinite(self.data[m])
        return ok

    def bootstrap(self, mask: np.ndarray) -> TwoWay:
        key = mask.tobytes()
        if key not in self._designs:
            self._designs[key] = two_way_bootstrap(self.cells[mask], self.draws[mask], self.n_boot, self.seed)
        return self._designs[key]

    def comparable(self, mask: np.ndarray, min_ci_runs: int = MIN_CI_RUNS) -> bool:
        """Enough shared runs and resampled units for an interval or a comparison on these runs."""
        return (int(mask.sum()) >= max(min_ci_runs, 2) and self.n_boot > 0
                and self.bootstrap(mask).n_units >= MIN_UNITS)

    def tau(self, m: str, mask: np.ndarray) -> float:
        key = (m, mask.tobytes())
        if key not in self._points:
            v, g = self.data[m][mask], self.gap[mask]
            ok = usable(v, g)
            self._points[key] = float(stratified_kendall(v[None, :], g, self.draws[mask])[0]) if ok else math.nan
        return self._points[key]

    def boot(self, m: str, mask: np.ndarray) -> np.ndarray:
        """τ* of measure m on the resamples of the runs in `mask`, over pairs of distinct copies
        (`bootstrap`: pairs of copies), stratified by draw (`blocked.blocked_boot_tau`) when the runs span
        several draws."""
        key = (m, mask.tobytes())
        if key not in self._boots and len(np.unique(self.draws[mask])) > 1:
            self._boots[key] = blocked_boot_tau(self.bootstrap(mask), self.data[m][mask], self.gap[mask])
        if key not in self._boots:
            design = self.bootstrap(mask)
            g = self.gap[mask]
            sy = np.sign(g[:, None] - g[None, :])
            if "gap_untied" not in design.cache:
                design.cache["gap_untied"] = design.pair_sums(np.abs(sy))
            x = self.data[m][mask]
            sx = np.sign(x[:, None] - x[None, :])
            if "all_pairs" not in design.cache:
                design.cache["all_pairs"] = design.pair_sums(np.ones_like(sx))
            dx = design.pair_sums(np.abs(sx)) if (sx == 0).sum() > len(x) else design.cache["all_pairs"]
            self._boots[key] = tau_from_parts(design.pair_sums(sx * sy), dx, design.cache["gap_untied"])
        return self._boots[key]

    def diff_boot(self, a: str, b: str, mask: np.ndarray) -> np.ndarray:
        """d* = τ*_a − τ*_b on the same resamples."""
        return self.boot(a, mask) - self.boot(b, mask)


def oriented_data(frame: pd.DataFrame, measures: list[str],
                  larger_is_sharper: Mapping[str, bool] | None) -> dict[str, np.ndarray]:
    flip = dict(larger_is_sharper or {})
    nrows = len(frame)
    out = {}
    for m in measures:
        raw = frame[m].to_numpy(dtype=float) if m in frame.columns and nrows else np.full(nrows, np.nan)
        out[m] = raw if flip.get(m, True) else -raw
    return out


def paired_comparisons(frame: pd.DataFrame, measures: list[str], gap_column: str,
                       larger_is_sharper: Mapping[str, bool] | None = None, n_boot: int = 10_000,
                       seed: int = 0, level: float = CI_LEVEL, min_ci_runs: int = MIN_CI_RUNS,
                       cells: np.ndarray | None = None, draws: np.ndarray | None = None,
                       resamples: Resamples | None = None) -> pd.DataFrame:
    """Every ordered pair (A, B), A ≠ B, in the order of `measures` (module doc). `cells` and `draws` are
    the runs' configurations and data draws (default: every run its own configuration, one draw: the
    plain bootstrap of the runs). The (B, A) row mirrors (A, B).

    Fewer than MIN_RUNS shared runs or a constant measure: diff NaN. Fewer than `min_ci_runs` shared runs
    or `bootstrap.MIN_UNITS` resampled units, n_boot ≤ 0, or fewer than ten defined resamples: diff is
    given, interval and p-values are NaN.
    """
    nrows = len(frame)
    gap = frame[gap_column].to_numpy(dtype=float) if nrows else np.zeros(0)
    if resamples is None:
        cells = np.arange(nrows, dtype=np.int64) if cells is None else np.asarray(cells)
        draws = np.zeros(nrows, dtype=np.int64) if draws is None else np.asarray(draws)
        resamples = Resamples(oriented_data(frame, measures, larger_is_sharper), gap, cells, draws, n_boot, seed)
    alpha = (1.0 - level) / 2.0
    rows = []
    done: dict[tuple[str, str], dict] = {}
    for a, b in itertools.permutations(measures, 2):
        if (b, a) in done:
            r = done[(b, a)]
            rows.append({**r, "measure_a": a, "measure_b": b, "tau_a": r["tau_b"], "tau_b": r["tau_a"],
                         "diff": -r["diff"], "diff_lo": -r["diff_hi"], "diff_hi": -r["diff_lo"]})
            continue
        mask = resamples.mask(a, b)
        n = int(mask.sum())
        ta, tb = resamples.tau(a, mask), resamples.tau(b, mask)
        diff = ta - tb
        lo = hi = se = p = pb = math.nan
        if math.isfinite(diff) and resamples.comparable(mask, min_ci_runs):
            d = resamples.diff_boot(a, b, mask)
            d = d[np.isfinite(d)]
            if len(d) >= 10:
                lo, hi = (float(q) for q in np.quantile(d, [alpha, 1.0 - alpha]))
                se, p = wald_p(diff, d)
                pb = bootstrap_pvalue(d)
        row = {"measure_a": a, "measure_b": b, "n": n, "tau_a": ta, "tau_b": tb, "diff": diff,
               "diff_lo": lo, "diff_hi": hi, "diff_se": se, "p_value": p, "p_boot": pb}
        done[(a, b)] = row
        rows.append(row)
    out = pd.DataFrame(rows, columns=COMPARISON_COLUMNS)
    out["n"] = out["n"].astype(int)
    return out


def best_group(measures: list[str], taus: np.ndarray, resamples: Resamples, alpha: float = ALPHA,
               min_ci_runs: int = MIN_CI_RUNS) -> pd.DataFrame:
    """vs_best, vs_best_p (Wald), vs_best_p_holm, vs_best_mcse, vs_best_borderline per measure (the
    order of `measures`; `taus` their τ over all their runs; see the module doc)."""
    k = len(measures)
    out = pd.DataFrame({"vs_best": [""] * k, "vs_best_p": np.nan, "vs_best_p_holm": np.nan,
                        "vs_best_mcse": np.nan, "vs_best_borderline": False}, index=range(k))
    finite = np.flatnonzero(np.isfinite(np.asarray(taus, dtype=float)))
    if not len(finite):
        return out
    top = int(finite[0])
    best = measures[top]
    out.at[top, "vs_best"] = "best"
    family: list[int] = []
    diffs: dict[int, float] = {}
    draws: dict[int, np.ndarray] = {}
    for i in finite:
        if i == top:
            continue
        m = measures[i]
        mask = resamples.mask(best, m)
        diff = resamples.tau(best, mask) - resamples.tau(m, mask)
        if not resamples.comparable(mask, min_ci_runs) or not math.isfinite(diff):
            out.at[i, "vs_best"] = "cannot compare"
            continue
        d = resamples.diff_boot(best, m, mask)
        _, p = wald_p(diff, d)
        if not math.isfinite(p):
            out.at[i, "vs_best"] = "cannot compare"
            continue
        out.at[i, "vs_best_p"] = p
        family.append(int(i))
        diffs[int(i)] = diff
        draws[int(i)] = d
    if not family:
        return out
    adjusted = holm(np.array([out.at[i, "vs_best_p"] for i in family]))
    # Monte-Carlo error: the whole procedure on disjoint batches of the resamples.
    n_boot = len(next(iter(draws.values())))
    batches = np.array_split(np.arange(n_boot), N_BATCHES) if n_boot >= 20 * N_BATCHES else []
    per_batch = []
    for idx in batches:
        pb = np.array([wald_p(diffs[i], draws[i][idx])[1] for i in family])
        per_batch.append(holm(np.where(np.isfinite(pb), pb, 1.0)))
    mcse = (np.std(np.array(per_batch), axis=0, ddof=1) / math.sqrt(len(batches)) if len(per_batch) > 1
            else np.full(len(family), np.nan))
    for i, p_adj, se in zip(family, adjusted, mcse):
        out.at[i, "vs_best_p_holm"] = p_adj
        out.at[i, "vs_best_mcse"] = se
        if p_adj <= alpha:
            out.at[i, "vs_best"] = "worse" if diffs[i] > 0 else "better on shared runs"
        else:
            out.at[i, "vs_best"] = "indistinguishable"
        out.at[i, "vs_best_borderline"] = bool(math.isfinite(se) and abs(p_adj - alpha) <= BORDERLINE_SE * se)
    return out
