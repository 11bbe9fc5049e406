"""The verdict table: one row per measure, what a researcher reads first.

Per measure: its family and cost (from the registry), the invariances it declares and those the
rescaling audit measured (|Δτ|, `audit_digest`), Kendall τ with its interval, the permutation p-value,
and its label against the best measure; when a study pools models (architectures, datasets or
experiment folders), τ within each model as well, because a pooled τ can come from the gap between two
clusters rather than from the order inside either. Measures with no finite value are not rows: they are
listed once with the reason their runs gave.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from flatbench.analysis.audit_digest import Measured
from flatbench.analysis.families import family_of, spec_of
from flatbench.analysis.stats import MIN_CI_RUNS, MIN_RUNS, kendall_batch, oriented
from flatbench.analysis.table import to_float

MODEL_FIELDS = ("model.name", "data.dataset", "experiment")
"""What makes runs different models for the per-model τ: the architecture, the dataset, the folder (a
width or a learning rate is a hyperparameter of one model, judged by ψ instead)."""
TIE_TOL = 1e-12


@dataclass
class Row:
    measure: str
    family: str
    cost: str
    declared: list[str]
    measured: list[Measured]
    stats: dict[str, Any]
    per_model: dict[str, tuple[float, int]] = field(default_factory=dict)
    tie: int = 0
    """1, 2, ...: the tie group this measure's τ is in; 0: no other measure has the same τ."""


@dataclass
class Verdict:
    rows: list[Row]
    models: list[str]
    missing: list[tuple[str, str]]
    """(measure, reason) of every measure without a finite value."""
    ties: list[list[str]]
    n_runs: int

    @property
    def can_compare(self) -> bool:
        return self.n_runs >= MIN_CI_RUNS


def pooled_models(frame: pd.DataFrame) -> pd.Series | None:
    """Each run's model (the `MODEL_FIELDS` that vary, joined), or None when the study has one model."""
    cols = [c for c in MODEL_FIELDS if c in frame.columns and frame[c].astype(str).nunique() > 1]
    if not cols or not len(frame):
        return None
    return frame[cols].astype(str).agg(" ".join, axis=1)


def per_model_tau(frame: pd.DataFrame, key: str, gap_col: str, models: pd.Series) -> dict[str, tuple[float, int]]:
    """τ-b of the (oriented) measure with the gap within each model: (τ, n); NaN below `MIN_RUNS` runs or
    when the measure or the gap is constant there."""
    out = {}
    values = pd.to_numeric(frame[key], errors="coerce").to_numpy(dtype=float)
    gap = pd.to_numeric(frame[gap_col], errors="coerce").to_numpy(dtype=float)
    for model in sorted(set(models)):
        sel = (models.to_numpy() == model) & np.isfinite(values) & np.isfinite(gap)
        n = int(sel.sum())
        tau = float(kendall_batch(values[sel], gap[sel])[0]) if n >= MIN_RUNS else math.nan
        out[model] = (tau, n)
    return out


def _ties(rows: list[Row]) -> list[list[str]]:
    """Groups of measures with the same τ (to `TIE_TOL`), in ranking order; numbers each row's group."""
    groups: list[list[Row]] = []
    for row in rows:
        tau = to_float(row.stats.get("kendall_tau"))
        if groups and abs(to_float(groups[-1][0].stats.get("kendall_tau")) - tau) <= TIE_TOL:
            groups[-1].append(row)
        else:
            groups.append([row])
    named = [g for g in groups if len(g) > 1]
    for i, group in enumerate(named, 1):
        for row in group:
            row.tie = i
    return [[r.measure for r in g] for g in named]


def build_verdict(corr: pd.DataFrame, included: pd.DataFrame, gap_col: str, larger_is_sharper: Mapping[str, bool],
                  measure_info: Mapping[str, Any] | None, measured: Mapping[str, list[Measured]],
                  reasons: Mapping[str, str]) -> Verdict:
    """The verdict from the analysis (`corr` in ranking order), the runs used, the registry's specs, the
    audits' measured invariances and each measure's first problem (for the ones without a value)."""
    models = pooled_models(included)
    data = oriented(included, dict(larger_is_sharper)) if models is not None else included
    rows, missing = [], []
    for r in corr.to_dict(orient="records"):
        key = str(r["measure"])
        if not math.isfinite(to_float(r.get("kendall_tau"))):
            why = reasons.get(key) or str(r.get("note") or "").split(";")[0] or "no finite value on any run"
            missing.append((key, why))
            continue
        spec = spec_of(key, measure_info)
        rows.append(Row(key, family_of(key, measure_info), str(getattr(spec, "cost", "") or "n/a"),
                        sorted(getattr(spec, "invariant_to", ()) or ()), list(measured.get(key, [])), r,
                        per_model_tau(data, key, gap_col, models) if models is not None else {}))
    ties = _ties(rows)
    return Verdict(rows, sorted(set(models)) if models is not None else [], missing, ties, len(included))
