"""The hyperparameter baseline: what a lookup table of the configurations' gaps scores, as a measure.

Why. A measure is computed from one trained network; a table of the gap per hyperparameter setting,
filled from *other* data draws, is the cheapest rival that uses no network at all. A measure that does not
beat it says nothing about a network that its hyperparameters do not already say (on the natural study,
the lookup beat every measure on the loss gap). Both rows are references (`kind` = "reference"), scored
by the same code as the measures (blocked τ with its interval, ψ, CMI, sign errors):

* **`ref.hyperparameters`**: for each run, the mean gap of the runs of its configuration (cell) in the
  *other* draws (leave-one-draw-out), so that the run's own draw, its data and its noise, never enter its
  own prediction. With one draw in the study it is the mean of the other runs of its cell
  (leave-one-run-out), and the note says so. NaN where no such run exists.
* **`ref.axis.<axis>`**: the same lookup on one axis alone: the mean gap of the runs that share the run's
  value of that axis, in the other draws (one draw: the other runs with that value). How much of the gap
  one hyperparameter explains.

`beats`: a measure beats the baseline when the 95% percentile interval of τ_measure − τ_baseline, over
the runs both have and on the same two-way bootstrap resamples (`compare.Resamples.diff_boot`), lies
above 0 (`vs_hyperparameters_lo` > 0). A measure above the baseline whose interval holds 0 does not.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

HYPERPARAMETERS = "ref.hyperparameters"
AXIS_PREFIX = "ref.axis."


def leave_one_draw_out(gap: np.ndarray, groups: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Per run, the mean gap of the runs of its group in the other draws; with one draw in all, the mean
    of the other runs of its group. NaN where there is none."""
    g = np.asarray(gap, dtype=float)
    grp = pd.factorize(np.asarray(groups))[0]
    drw = pd.factorize(np.asarray(draws))[0]
    if not len(g):
        return np.zeros(0)
    k = grp.max() + 1
    sums, counts = np.bincount(grp, weights=g, minlength=k)[grp], np.bincount(grp, minlength=k)[grp]
    if drw.max() == 0:
        own_sum, own_count = g, np.ones(len(g))
    else:
        joint = grp * (drw.max() + 1) + drw
        own_sum = np.bincount(joint, weights=g)[joint]
        own_count = np.bincount(joint)[joint]
    left = counts - own_count
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(left > 0, (sums - own_sum) / np.maximum(left, 1), np.nan)


def baseline_values(gap: np.ndarray, codes: pd.DataFrame, cells: np.ndarray, draws: np.ndarray,
                    axes: list[str]) -> dict[str, np.ndarray]:
    """{ref.hyperparameters: ..., ref.axis.<axis>: ... per axis} (module doc), aligned with the runs."""
    out = {HYPERPARAMETERS: leave_one_draw_out(gap, cells, draws)}
    for axis in axes:
        out[AXIS_PREFIX + axis] = leave_one_draw_out(gap, codes[axis].to_numpy(), draws)
    return out


def baseline_note(key: str, n_draws: int) -> str:
    what = ("the mean gap of the same configuration" if key == HYPERPARAMETERS
            else f"the mean gap of the runs with the same {key[len(AXIS_PREFIX):]}")
    how = ("in the other data draws (leave-one-draw-out)" if n_draws > 1
           else "over its other runs (one data draw: leave-one-run-out)")
    return f"reference: {what} {how}, a hyperparameter lookup scored like a measure (the baseline)"
