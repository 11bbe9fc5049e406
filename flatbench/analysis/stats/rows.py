"""One row of correlations.csv: a measure's (or a reference's) point statistics and their inference.

`RowContext` holds what every row shares (the runs, the design, the resampling, the plans per set of
runs), so that a row is `measure_row(ctx, key, values, larger_is_sharper)`. The point statistics come
from `plan.point_statistics` (the same function the random reference evaluates for its R draws); the
inference adds the two-way bootstrap intervals of τ, ρ and r, the ψ p-values and the replicate p-value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from flatbench.analysis.stats.blocked import stratified_kendall
from flatbench.analysis.stats.compare import CI_LEVEL, MIN_CI_RUNS, MIN_RUNS, Resamples
from flatbench.analysis.stats.design import Design
from flatbench.analysis.stats.kernels import STATISTICS, weighted_pearson, weighted_ranks, weighted_spearman
from flatbench.analysis.stats.plan import DesignPlan, Point, design_plan, point_statistics
from flatbench.analysis.stats.psi_inference import psi_pvalues
from flatbench.analysis.stats.robust import ENV_COLUMNS, replicate_pvalue

SE_NOTE_RATIO = 0.5
"""A measure whose median Monte-Carlo standard error is at least this fraction of its between-run standard
deviation gets a note. At 0.5 the noise variance is a quarter of the observed variance (reliability
≈ 0.75), which by Spearman's attenuation formula shrinks a correlation by a factor of about
√0.75 ≈ 0.87: enough to reorder measures whose τ differ by less than that."""
POINT_COLUMNS = ("psi", "psi_data", "cmi", "sign_error_mean", "sign_error_worst", "seed_pairs_concordant")


def correlation_columns(axes: list[str]) -> list[str]:
    """The columns of correlations.csv, in order (`core.analyze`'s docstring says what each holds)."""
    columns = ["measure", "kind", "larger_is_sharper", "n", "n_missing"]
    for stat in STATISTICS:
        columns += [stat, f"{stat}_lo", f"{stat}_hi"]
    columns += ["kendall_tau_pooled", "kendall_tau_within_cell", "vs_hyperparameters", "vs_hyperparameters_lo",
                "vs_hyperparameters_hi", "beats_hyperparameters"]
    return columns + ["kendall_p", "kendall_p_method", "vs_best", "vs_best_p", "vs_best_p_holm", "vs_best_mcse",
                      "vs_best_borderline", "se_median", "se_ratio", "psi", "psi_data", *[f"psi_{a}" for a in axes],
                      *[f"p_psi_{a}" for a in axes], *[f"p_psi_holm_{a}" for a in axes], "cmi", "cmi_condition",
                      "cmi_min_pairs", "sign_error_mean", "sign_error_worst", "n_environments",
                      "n_environments_small", "seed_pairs_concordant", "n_seed_pairs", "seed_pairs_p", "note"]


@dataclass
class RowContext:
    """What every row shares (module doc)."""

    included: pd.DataFrame
    gap: np.ndarray
    design: Design
    resamples: Resamples
    noise_sd: float
    """The replicate standard deviation of the gap (`robust.replicate_sd`): the sign errors' noise scale."""
    full: bool
    se_columns: dict[str, str] = field(default_factory=dict)
    kendall_p: dict[str, tuple[float, str]] = field(default_factory=dict)
    plans: dict[bytes, DesignPlan] = field(default_factory=dict)
    block_taus: dict[str, tuple[bytes, dict[str, np.ndarray]]] = field(default_factory=dict)
    """Per row key: (its plan's key, the block τ's of every axis), for the ψ tests (`psi_tests`)."""

    @property
    def n_boot(self) -> int:
        return self.resamples.n_boot

    @property
    def seed(self) -> int:
        return self.resamples.seed

    def plan(self, ok: np.ndarray) -> DesignPlan:
        key = ok.tobytes()
        if key not in self.plans:
            self.plans[key] = design_plan(self.design.subset(ok), self.gap[ok], self.noise_sd)
        return self.plans[key]


def empty_row(key: str, kind: str, larger_is_sharper: bool, n: int, n_missing: int, axes: list[str]) -> dict[str, Any]:
    """A row with every statistic NaN (empty labels, zero counts)."""
    row: dict[str, Any] = {c: math.nan for c in correlation_columns(axes)}
    row.update({"measure": key, "kind": kind, "larger_is_sharper": larger_is_sharper, "n": n, "n_missing": n_missing,
                "kendall_p_method": "", "vs_best": "", "vs_best_borderline": False, "beats_hyperparameters": False, "cmi_condition": "",
                "n_environments": 0, "n_environments_small": 0, "n_seed_pairs": 0, "note": ""})
    return row


def fill_point(row: dict[str, Any], values: dict[str, float], plan: DesignPlan | None, condition: str,
               note: list[str]) -> None:
    """Put point statistics (`values`: name → number, from one row of a `Point` or averaged over its rows)
    and the plan's counts into `row`."""
    for name, value in values.items():
        row[name] = float(value)
    if plan is None:
        return
    cmi = plan.cmi
    row["cmi_min_pairs"] = cmi.min_pairs
    row["cmi_condition"] = condition if math.isfinite(row["cmi"]) else ""
    if cmi.reason and plan.design.axes:
        note.append(f"CMI n/a: {cmi.reason}")
    averaged = plan.environments.frame["averaged"].to_numpy(dtype=bool)
    row["n_environments"], row["n_environments_small"] = int(averaged.sum()), int((~averaged).sum())
    row["n_seed_pairs"] = int(len(plan.replicates.i))


def _undefined(n: int, n_runs: int, values: np.ndarray, gap: np.ndarray) -> str:
    """Why τ is not defined on these runs ("" when it is)."""
    if n == 0:
        return "no value on any run" if n_runs else "no runs"
    if n < MIN_RUNS:
        return f"only {n} run(s) with a value" if n_runs >= MIN_RUNS else "too few runs"
    if np.ptp(values) == 0:
        return "constant across runs"
    if np.ptp(gap) == 0:
        return "the gap is constant across these runs"
    return ""


def _fill_intervals(ctx: RowContext, row: dict[str, Any], key: str, values: np.ndarray, gap: np.ndarray,
                    ok: np.ndarray) -> None:
    """Percentile intervals of τ, ρ and r on the two-way bootstrap's resamples (τ* shared with the
    comparisons); none below MIN_CI_RUNS runs or `bootstrap.MIN_UNITS` units."""
    if row["n"] < MIN_CI_RUNS or not ctx.resamples.comparable(ok):
        return
    boot_design = ctx.resamples.bootstrap(ok)
    weights = boot_design.weights
    for stat in STATISTICS:
        if stat == "kendall_tau":
            boot = ctx.resamples.boot(key, ok)
        elif stat == "spearman_rho":
            if "gap_ranks" not in boot_design.cache:
                boot_design.cache["gap_ranks"] = weighted_ranks(gap, weights)
            boot = weighted_spearman(values, gap, weights, y_ranks=boot_design.cache["gap_ranks"])
        else:
            boot = weighted_pearson(values, gap, weights)
        boot = boot[np.isfinite(boot)]
        if len(boot) >= 10:
            lo, hi = np.quantile(boot, [(1 - CI_LEVEL) / 2, (1 + CI_LEVEL) / 2])
            row[f"{stat}_lo"], row[f"{stat}_hi"] = float(lo), float(hi)


def baseline_comparison(ctx: RowContext, rows: list[dict[str, Any]], baseline: str) -> None:
    """Fill vs_hyperparameters (τ_row − τ_baseline over the runs both have), its 95% interval from the same
    two-way resamples (`Resamples.diff_boot`) and beats_hyperparameters (the interval above 0): the rule of
    `baselines`. Rows not in the resamples' data (`ref.random`) and the baseline itself are left empty."""
    data = ctx.resamples.data
    if baseline not in data:
        return
    for row in rows:
        key = row["measure"]
        if key == baseline or key not in data or not math.isfinite(row["kendall_tau"]):
            continue
        mask = ctx.resamples.mask(key, baseline)
        diff = ctx.resamples.tau(key, mask) - ctx.resamples.tau(baseline, mask)
        row["vs_hyperparameters"] = diff
        if not math.isfinite(diff) or not ctx.resamples.comparable(mask):
            continue
        d = ctx.resamples.diff_boot(key, baseline, mask)
        d = d[np.isfinite(d)]
        if len(d) >= 10:
            lo, hi = np.quantile(d, [(1 - CI_LEVEL) / 2, (1 + CI_LEVEL) / 2])
            row["vs_hyperparameters_lo"], row["vs_hyperparameters_hi"] = float(lo), float(hi)
            row["beats_hyperparameters"] = bool(lo > 0)


def psi_tests(ctx: RowContext, rows: list[dict[str, Any]]) -> None:
    """Fill p_psi_<axis> of the rows: the two-way bootstrap of every ψ (`psi_inference`), all the rows on
    the same runs at once (they share the resamples)."""
    groups: dict[bytes, list[dict[str, Any]]] = {}
    for row in rows:
        if row["measure"] in ctx.block_taus:
            groups.setdefault(ctx.block_taus[row["measure"]][0], []).append(row)
    for key, members in groups.items():
        plan = ctx.plans[key]
        for axis, blocks in plan.psi.items():
            taus = np.stack([ctx.block_taus[r["measure"]][1][axis] for r in members])
            p, _ = psi_pvalues(blocks, taus, ctx.n_boot, ctx.seed)
            for r, value in zip(members, p):
                r[f"p_psi_{axis}"] = float(value)


def _fill_inference(ctx: RowContext, row: dict[str, Any], plan: DesignPlan, point: Point, values: np.ndarray,
                    ok: np.ndarray) -> None:
    """Keep the block τ's for the ψ tests (`psi_tests`); the replicate pairs' p-value."""
    ctx.block_taus[row["measure"]] = (ok.tobytes(), {axis: taus[0] for axis, taus in point.block_taus.items()})
    if ctx.n_boot <= 0:
        return
    if len(plan.replicates.i) and ctx.resamples.comparable(ok):
        row["seed_pairs_p"], _ = replicate_pvalue(plan.replicates, values, ctx.resamples.bootstrap(ok))


def measure_row(ctx: RowContext, key: str, oriented: np.ndarray, larger_is_sharper: bool,
                kind: str = "measure") -> tuple[dict[str, Any], pd.DataFrame | None]:
    """One row of correlations.csv for the oriented values of a measure (or reference) on the included
    runs, and its sign-error environments (None without axes or with `ctx.full` False)."""
    ok = np.isfinite(oriented) & np.isfinite(ctx.gap)
    values, gap = oriented[ok], ctx.gap[ok]
    row = empty_row(key, kind, larger_is_sharper, int(ok.sum()), int(len(oriented) - ok.sum()), ctx.design.axes)
    row["se_median"], row["se_ratio"] = stderr_summary(ctx.included, ctx.se_columns.get(key), ok, values)
    note: list[str] = []
    envs = None
    why = _undefined(row["n"], len(oriented), values, gap)
    if why:
        note.append(why)
    else:
        if ctx.full:
            plan = ctx.plan(ok)
            point = point_statistics(plan, values[None, :])
            stats = {name: v[0] for name, v in point.values.items()}
            fill_point(row, stats, plan, point.cmi_condition[0], note)
            _fill_inference(ctx, row, plan, point, values, ok)
            if ctx.design.axes:
                envs = plan.environments.frame.assign(sign_error=point.environment_errors[0])[ENV_COLUMNS]
        else:
            for stat, fn in STATISTICS.items():
                row[stat] = float(fn(values[None, :], gap[None, :])[0])
            row["kendall_tau_pooled"] = row["kendall_tau"]
            row["kendall_tau"] = float(stratified_kendall(values, gap, ctx.design.draws[ok])[0])
            if ctx.design.n_cells < len(ctx.gap):
                row["kendall_tau_within_cell"] = float(stratified_kendall(values, gap, ctx.design.cells[ok])[0])
        _fill_intervals(ctx, row, key, values, gap, ok)
        row["kendall_p"], row["kendall_p_method"] = ctx.kendall_p.get(key, (math.nan, ""))
        if row["n"] < MIN_CI_RUNS:
            note.append(f"n < {MIN_CI_RUNS}: no interval; see the p-value")
        elif row["kendall_tau_lo"] == row["kendall_tau_hi"]:
            note.append("every bootstrap resample gives the same τ (interval collapsed to a point); see the p-value")
    row["note"] = "; ".join(note + _row_notes(row))
    return row, envs


def _row_notes(row: dict[str, Any]) -> list[str]:
    note = []
    if row["se_ratio"] >= SE_NOTE_RATIO:  # False for NaN
        note.append(f"standard error comparable to the spread between runs (se/sd = {row['se_ratio']:.2f}): "
                    "the ranking is partly noise")
    if row["n_missing"] and row["n"]:
        note.append(f"no value on {row['n_missing']} run(s)")
    if 0 < row["n_environments_small"] and row["n_environments"]:
        note.append(f"{row['n_environments_small']} environment(s) with fewer than 10 pairs above the noise are not "
                    "averaged into the sign errors (environments.csv lists them)")
    if not row["larger_is_sharper"]:
        note.append("sign flipped (smaller = sharper)")
    return note


def stderr_summary(included: pd.DataFrame, se_column: str | None, ok: np.ndarray,
                   values: np.ndarray) -> tuple[float, float]:
    """(median Monte-Carlo standard error over the measure's runs, that median / the sample standard
    deviation (ddof = 1) of the measure over the same runs). NaN without an SE column or any finite SE;
    the ratio is inf when the measure is constant but its SE is not 0."""
    if se_column is None or se_column not in included.columns or not ok.any():
        return math.nan, math.nan
    se = np.abs(pd.to_numeric(included[se_column], errors="coerce").to_numpy(dtype=float)[ok])
    se = se[np.isfinite(se)]
    if len(se) == 0:
        return math.nan, math.nan
    median = float(np.median(se))
    if len(values) < 2:
        return median, math.nan
    sd = float(np.std(values, ddof=1))
    if sd > 0:
        return median, median / sd
    return median, (math.inf if median > 0 else math.nan)
