"""Δτ of the rescaling audit within each model, for a study that pools models.

A pooled τ can come from the gap between two models rather than from the order inside either, and so
can a pooled Δτ: a rescaling that moves one model's values as a block moves the pooled τ while the order
within each model holds. `audit_population.csv` (written next to `audit_correlations.csv` by
`flatbench audit --population`) has every run's value before and after each draw, so the report
computes, per measure, factor range and model, τ with the gap before and after each draw within the
model's runs, oriented like the verdict (negated where smaller values are the sharper ones); Δτ is their
difference, shown as the mean over the draws with the largest |Δτ|.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from flatbench.analysis.stats import kendall_tests

POPULATION_CSV = "audit_population.csv"


def per_model_deltas(folder: Path, models: Mapping[str, str], larger_is_sharper: Mapping[str, bool]) -> pd.DataFrame:
    """One row per (measure, family, max_factor, model): n runs, Δτ mean over the draws, largest |Δτ|;
    empty when the folder has no readable audit_population.csv."""
    path = folder / POPULATION_CSV
    cols = ["measure", "family", "max_factor", "model", "n", "delta_mean", "delta_absmax"]
    if not path.is_file():
        return pd.DataFrame(columns=cols)
    try:
        pop = pd.read_csv(path, usecols=["run_id", "measure", "family", "max_factor", "draw", "original",
                                         "transformed", "gap"])
    except (OSError, ValueError, pd.errors.ParserError):
        return pd.DataFrame(columns=cols)
    pop["model"] = pop["run_id"].astype(str).map(models)
    pop = pop[pop["model"].notna()]
    rows = []
    for (measure, family, factor, model), part in pop.groupby(["measure", "family", "max_factor", "model"], sort=True):
        sign = 1.0 if larger_is_sharper.get(str(measure), True) else -1.0
        deltas = []
        for _, draw in part.groupby("draw"):
            gap = pd.to_numeric(draw["gap"], errors="coerce").to_numpy(dtype=float)
            before = sign * pd.to_numeric(draw["original"], errors="coerce").to_numpy(dtype=float)
            after = sign * pd.to_numeric(draw["transformed"], errors="coerce").to_numpy(dtype=float)
            (tau1, _, _), (tau0, _, _) = kendall_tests([(after, gap), (before, gap)], pvalues=False)
            deltas.append(tau1 - tau0)
        finite = [d for d in deltas if math.isfinite(d)]
        rows.append({"measure": str(measure), "family": str(family), "max_factor": float(factor), "model": str(model),
                     "n": int(part["run_id"].nunique()),
                     "delta_mean": float(np.mean(finite)) if finite else math.nan,
                     "delta_absmax": float(np.max(np.abs(finite))) if finite else math.nan})
    return pd.DataFrame(rows, columns=cols)
