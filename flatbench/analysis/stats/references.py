"""Every statistic beside its floor and its ceiling: two reference rows of correlations.csv.

Both go through the same code as the measures (`plan.point_statistics`, `rows.measure_row`) and are left
out of the best group and of the Holm family of the ψ tests (`kind` = "reference").

* **`ref.random`, the floor**: a measure of pure noise. `N_RANDOM` measures, each an i.i.d. N(0, 1) value
  per run (drawn from `np.random.default_rng([report seed, RANDOM_STREAM])`, rows of one (R, n) array),
  are scored like a measure; the row holds the mean over the R draws of every statistic (τ, ρ, r, ψ per
  axis, Ψ, psi_data, CMI, sign-error mean and worst, replicate share), and its `_lo`/`_hi` columns the
  2.5% and 97.5% quantiles of τ, ρ and r over the draws: the 95% band of a measure that knows nothing.
  `reference_bands` holds that band for every statistic (reference_bands.csv). τ, ρ, r and ψ of noise
  centre on 0, the sign errors on 0.5; CMI is ≥ 0 with a small positive bias; the worst sign error of
  noise over many small environments is far above 0.5, which is why that statistic needs this band.
* **`ref.replicate_gap`, the ceiling**: for every run, the mean gap of the *other* replicates (runs of
  other draws or seeds) of the same configuration, NaN where a configuration has one run. It is what any
  measure can at best do when the runs of a configuration differ by noise: a function of the
  configuration, estimated from independent replicates. It is not a strict upper bound: a measure can
  exceed it by tracking the run's own noise (its own train or test sample), or by being an exact
  function of the configuration (the replicate gap carries the replicates' noise; the cell-mean oracle,
  with the run's own gap averaged in, is not a measure).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from flatbench.analysis.stats.kernels import STATISTICS
from flatbench.analysis.stats.plan import point_statistics
from flatbench.analysis.stats.rows import RowContext, empty_row, fill_point, measure_row

RANDOM = "ref.random"
REPLICATE_GAP = "ref.replicate_gap"
N_RANDOM = 200
"""Draws of the random reference: its band's quantiles to about ±0.01 in τ on 100 runs, in about a second."""
RANDOM_STREAM = 27
"""Second key of the random reference's generator, so that its draws are not the bootstrap's."""
BAND_COLUMNS = ["statistic", "mean", "q025", "q975"]


def replicate_gap(gap: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """Per run, the mean gap of the other runs of its configuration; NaN for a run alone in its cell."""
    gap = np.asarray(gap, dtype=float)
    cells = np.asarray(cells, dtype=np.int64)
    if not len(gap):
        return np.zeros(0)
    sizes = np.bincount(cells)[cells]
    sums = np.bincount(cells, weights=gap)[cells]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(sizes > 1, (sums - gap) / np.maximum(sizes - 1, 1), np.nan)


def replicate_gap_row(ctx: RowContext) -> tuple[dict[str, Any], pd.DataFrame | None]:
    """The ceiling's row (module doc); its values must be in `ctx.resamples.data` under REPLICATE_GAP."""
    row, envs = measure_row(ctx, REPLICATE_GAP, ctx.resamples.data[REPLICATE_GAP], True, kind="reference")
    text = "reference: the mean gap of the other replicates of the same configuration (the ceiling)"
    row["note"] = "; ".join([text, row["note"]]) if row["note"] else text
    return row, envs


def _summaries(values: dict[str, np.ndarray]) -> tuple[dict[str, float], pd.DataFrame]:
    """Mean over the finite draws of every statistic, and its band (statistic, mean, q025, q975)."""
    means, rows = {}, []
    for name, v in values.items():
        finite = v[np.isfinite(v)]
        mean = float(finite.mean()) if len(finite) else math.nan
        lo, hi = (float(q) for q in np.quantile(finite, [0.025, 0.975])) if len(finite) else (math.nan, math.nan)
        means[name] = mean
        rows.append({"statistic": name, "mean": mean, "q025": lo, "q975": hi})
    return means, pd.DataFrame(rows, columns=BAND_COLUMNS)


def random_reference(ctx: RowContext, n_draws: int = N_RANDOM) -> tuple[dict[str, Any], pd.DataFrame]:
    """The floor's row and its bands (module doc), over every included run."""
    ok = np.isfinite(ctx.gap)
    n = int(ok.sum())
    row = empty_row(RANDOM, "reference", True, n, 0, ctx.design.axes)
    note = [f"reference: the mean over {n_draws} measures of pure noise (i.i.d. N(0, 1) per run), its intervals "
            "their 95% band (reference_bands.csv): the floor"]
    rng = np.random.default_rng([int(ctx.seed), RANDOM_STREAM])
    x = rng.standard_normal((n_draws, n))
    plan = ctx.plan(ok) if ctx.full else None
    if plan is not None:
        values = point_statistics(plan, x).values
    else:
        values = {stat: np.asarray(fn(x, np.broadcast_to(ctx.gap[ok], x.shape)), dtype=float)
                  for stat, fn in STATISTICS.items()}
    means, bands = _summaries(values)
    fill_point(row, means, plan, "", note)
    for stat in STATISTICS:
        band = bands.set_index("statistic").loc[stat]
        row[f"{stat}_lo"], row[f"{stat}_hi"] = float(band["q025"]), float(band["q975"])
    row["note"] = "; ".join(note)
    return row, bands
