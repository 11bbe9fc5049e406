"""Does a measure track the generalization gap? The analysis that the report rests on.

`analyze` computes, for every headline measure (a `name` or `name@loss` column of the table), over the
runs where it has a value (oriented so that a positive number always means "tracks the gap": a measure
whose measures.json entry says `larger_is_sharper=False` is negated first):

* Kendall τ-b, Spearman ρ and Pearson r, with 95% percentile intervals of the two-way cluster bootstrap
  (10,000 resamples of the configurations and, from `bootstrap.MIN_DRAWS` draws on, the data draws;
  `bootstrap`), only from `MIN_CI_RUNS` runs and `bootstrap.MIN_UNITS` resampled units on;
* `kendall_p`: the permutation p-value of τ and its method (`kernels.kendall_permutation_pvalues`);
* the best group: Holm-adjusted paired comparisons with the top measure (`compare`);
* Jiang et al.'s ψ per axis, Ψ over the training axes, psi_data over the data axes, and their CMI score
  (`jiang`); each ψ's p-value from the two-way bootstrap of its block mean, Holm-adjusted over every ψ
  test of the study (`psi_inference`);
* Dziugaite et al.'s sign errors with their noise filter, and the replicate-pair concordance (`robust`);
* Monte-Carlo standard errors of the measures (`se_median`, `se_ratio`);
* two reference rows, `ref.random` (the floor) and `ref.replicate_gap` (the ceiling) (`references`).

Exclusions: runs that are not finished, have a train accuracy below `min_train_acc`, or a non-finite
loss or gap are left out of every statistic and returned with a reason, never silently dropped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from flatbench.analysis.stats.anova import VARIANCE_COLUMNS, variance_decomposition
from flatbench.analysis.stats.baselines import AXIS_PREFIX, HYPERPARAMETERS, baseline_note, baseline_values
from flatbench.analysis.stats.bootstrap import MIN_UNITS, two_way_bootstrap
from flatbench.analysis.stats.compare import (
    ALPHA,
    COMPARISON_COLUMNS,
    MIN_CI_RUNS,
    MIN_RUNS,
    Resamples,
    best_group,
    oriented_data,
    paired_comparisons,
    usable,
)
from flatbench.analysis.stats.design import Design, design_of
from flatbench.analysis.stats.plan import DesignPlan
from flatbench.analysis.stats.kernels import N_PERM, kendall_batch, kendall_permutation_pvalues, permutation_method
from flatbench.analysis.stats.psi_inference import holm_family, psi_untestable
from flatbench.analysis.stats.references import (
    BAND_COLUMNS,
    REPLICATE_GAP,
    random_reference,
    replicate_gap,
    replicate_gap_row,
)
from flatbench.analysis.stats.robust import ENV_COLUMNS, MIN_ENV_PAIRS, NOISE_Z, replicate_sd
from flatbench.analysis.stats.rows import (
    RowContext,
    baseline_comparison,
    correlation_columns,
    measure_row,
    psi_tests,
)
from flatbench.analysis.table import headline_columns, stderr_columns, sweep_axes, to_float
from flatbench.store import gap_column

CI_LEVEL = 0.95
N_BOOT = 10_000
"""Two-way bootstrap resamples for every interval, paired comparison and ψ test (the report's default)."""
_MIN_CI_DOC = """Why no interval below 10 runs. A bootstrap resample of n runs holds on average only
n(1 − (1 − 1/n)^n) ≈ 0.63·n distinct runs (3.4 at n = 5), so for small n the bootstrap distribution of τ
is a handful of atoms, and a perfectly ordered sample gives [1, 1] however weak the evidence. Percentile
intervals of correlation coefficients undercover in small samples (Hall, Martin & Schucany 1989), and
n = 10 is the smallest sample Long & Cliff (1997) studied. Below 10 runs the permutation p-value, which
is exact there, is the honest summary. The same holds for the units of the cluster bootstrap
(`bootstrap.MIN_UNITS`)."""


# --------------------------------------------------------------------------------------------- direction

def directions(keys: list[str], notes: list[str] | None = None,
               known: Mapping[str, bool] | None = None) -> dict[str, bool]:
    """`larger_is_sharper` for every result key, as its measures.json entry records it (`known`, from the
    table's attrs); a key without a recorded direction reads as larger = sharper, with a note."""
    known = known or {}
    out = {key: bool(known.get(key, True)) for key in keys}
    unknown = [key for key in keys if key not in known]
    if unknown and notes is not None and known:
        notes.append(f"no recorded direction for {', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}: "
                     "read as larger = sharper")
    return out



# ------------------------------------------------------------------------------------------- exclusions

def exclusion_reasons(table: pd.DataFrame, gap: str = "acc", min_train_acc: float = 0.0) -> pd.Series:
    """Why each run is left out of the statistics ("" when it is used), aligned with the table's index."""
    gcol = gap_column(gap)
    reasons = []
    for _, row in table.iterrows():
        status = str(row.get("status", "unknown"))
        if status != "finished":
            reasons.append(f"not trained (status: {status})")
            continue
        why = []
        train_acc = to_float(row.get("train_acc"))
        if not math.isfinite(train_acc):
            why.append("no train accuracy recorded")
        elif train_acc < min_train_acc:
            why.append(f"did not train: train accuracy {train_acc:.3f} < {min_train_acc:.3f}")
        bad = [c for c in ("train_loss", "test_loss") if not math.isfinite(to_float(row.get(c)))]
        if bad:
            why.append("non-finite loss (" + ", ".join(f"{c}={to_float(row.get(c))}" for c in bad) + ")")
        if not bad and gcol not in table.columns:
            why.append(f"no {gcol} recorded (a run trained before flatbench recorded it: `flatbench train` on its "
                       "config adds it from model.pt)")
        elif not bad and not math.isfinite(to_float(row.get(gcol))):
            why.append(f"non-finite {gcol}")
        reasons.append("; ".join(why))
    return pd.Series(reasons, index=table.index, dtype=object)



# ------------------------------------------------------------------------------------------- the analysis

@dataclass
class Analysis:
    """Everything the report needs from the statistics, computed once."""

    correlations: pd.DataFrame
    """One row per headline measure, best Kendall τ first (columns: see `analyze`)."""
    included: pd.DataFrame
    """The table rows used in the statistics."""
    excluded: pd.DataFrame
    """run_id, experiment, status, reason of every run left out."""
    axes: list[str]
    """Axes that vary among the included runs (never a replicate field), training and data axes."""
    gap: str
    gap_column: str
    larger_is_sharper: dict[str, bool]
    notes: list[str] = field(default_factory=list)
    comparisons: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=COMPARISON_COLUMNS))
    """Every ordered pair of measures: τ_a − τ_b with its two-way bootstrap interval and p-values (see
    `compare.paired_comparisons`), measures in ranking order."""
    environments: pd.DataFrame = field(default_factory=pd.DataFrame)
    """measure, axis, environment, n_pairs, ess, sign_error, averaged: Dziugaite et al.'s environments
    (`robust`), for the measures and the references."""
    design: Design | None = None
    resampling: str = ""
    """The unit of resampling, one sentence ("resampled: the 64 configurations (cluster bootstrap),
    conditional on these 2 data draws: no replicate-level test is possible")."""
    replicate: str | None = None
    references: pd.DataFrame = field(default_factory=pd.DataFrame)
    """The rows `ref.random` and `ref.replicate_gap` (`references`), with the columns of `correlations`."""
    reference_bands: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=BAND_COLUMNS))
    """statistic, mean, q025, q975: the random reference's 95% band of every statistic."""
    psi_family: int = 0
    """How many ψ tests Holm's procedure adjusted together (measures × axes with a p-value)."""
    variance: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=VARIANCE_COLUMNS))
    """effect (draw, cell, residual, total), df, ss, share, F, p, partial_omega2: gap ~ draw + cell
    (`anova`), variance.csv."""

    def all_rows(self) -> pd.DataFrame:
        """correlations.csv: the measures (best τ first), then the references."""
        if not len(self.references):
            return self.correlations
        return pd.concat([self.correlations, self.references], ignore_index=True)


def analyze(table: pd.DataFrame, gap: str = "acc", min_train_acc: float = 0.0, n_boot: int = N_BOOT,
            seed: int = 0, axes: list[str] | None = None, n_perm: int = N_PERM, full: bool = True) -> Analysis:
    """Exclusions, then every statistic for every headline measure (see the module doc).

    Columns of `Analysis.correlations`, one row per headline measure, best Kendall τ first (ties by name):
    measure, kind ("measure"; "reference" in `Analysis.references`), larger_is_sharper, n, n_missing; for
    τ, ρ and r the value with `_lo`/`_hi` (NaN below MIN_CI_RUNS runs or MIN_UNITS units); kendall_p and
    kendall_p_method ("enumerated", "exact", "monte carlo"); vs_best, vs_best_p (Wald p of τ_best − τ_m),
    vs_best_p_holm (Holm-adjusted), vs_best_mcse (its Monte-Carlo error), vs_best_borderline; se_median,
    se_ratio; psi (over the training axes), psi_data (over the data axes), one psi_<axis> per axis, one
    p_psi_<axis> (its two-way bootstrap p-value) and p_psi_holm_<axis> (Holm over every ψ test of the
    study); cmi, cmi_condition, cmi_min_pairs; sign_error_mean, sign_error_worst (over the environments
    with at least 10 pairs above the noise), n_environments (those), n_environments_small (the others);
    seed_pairs_concordant, n_seed_pairs, seed_pairs_p (two-way bootstrap, from 5 draws on); note.

    `axes`: the study's sweep axes (default: the table's); replicate fields among them are replicates.
    `full=False` computes only τ/ρ/r, their intervals and p (the per-level tables), and no reference.
    """
    gcol = gap_column(gap)
    notes: list[str] = []
    measures = headline_columns(table)
    sweep = list(axes) if axes is not None else sweep_axes(table)
    included, excluded = _split_runs(table, gap, min_train_acc)
    design = design_of(included, sweep)
    flip = directions(measures, notes, table.attrs.get("directions"))
    gap_values = included[gcol].to_numpy(dtype=float) if len(included) else np.zeros(0)
    data = oriented_data(included, measures, flip)
    if full:
        data[REPLICATE_GAP] = replicate_gap(gap_values, design.cells)
        data.update(baseline_values(gap_values, design.codes, design.cells, design.draws, design.axes))
    resamples = Resamples(data, gap_values, design.cells, design.draws, n_boot, seed)
    ctx = RowContext(included, gap_values, design, resamples, replicate_sd(gap_values, design.cells), full,
                     stderr_columns(table), _permutation_pvalues(data, list(data), gap_values, n_perm, seed,
                                                                design.draws))
    boot = two_way_bootstrap(design.cells, design.draws, 0, seed)
    notes += _size_notes(len(included), design, boot.description, boot.n_units, full)
    rows, environments = [], []
    for key in measures:
        row, envs = measure_row(ctx, key, data[key], flip[key])
        rows.append(row)
        if envs is not None and len(envs):
            environments.append(envs.assign(measure=key))
    if full:
        psi_tests(ctx, rows)
        baseline_comparison(ctx, rows, HYPERPARAMETERS)
    corr = pd.DataFrame(rows, columns=correlation_columns(design.axes))
    if len(corr):
        corr = corr.sort_values(["kendall_tau", "measure"], ascending=[False, True], na_position="last",
                                kind="mergesort").reset_index(drop=True)
    out = Analysis(correlations=corr, included=included, excluded=excluded, axes=design.axes, gap=gap,
                   gap_column=gcol, larger_is_sharper=flip, notes=notes, design=design,
                   resampling=boot.description, replicate=design.replicate)
    if full:
        out.comparisons = _compare_with_best(corr, included, gcol, flip, resamples, notes)
        out.psi_family = _holm_psi(corr, design.axes)
        notes += _design_notes(ctx, out.psi_family, len(included) >= MIN_RUNS)
        out.references, out.reference_bands, envs = _references(ctx, len(included) >= MIN_RUNS)
        environments += envs
    corr["vs_best_borderline"] = corr["vs_best_borderline"].fillna(False).astype(bool)
    corr["beats_hyperparameters"] = corr["beats_hyperparameters"].fillna(False).astype(bool)
    out.variance = variance_decomposition(gap_values, design.draws, design.cells) if full else out.variance
    corr.attrs.update({"gap": gap, "gap_column": gcol, "axes": list(design.axes), "notes": list(notes),
                       "excluded": excluded.to_dict(orient="records"), "n_included": len(included),
                       "min_ci_runs": MIN_CI_RUNS, "n_perm": n_perm, "n_boot": n_boot, "seed": seed,
                       "resampling": boot.description, "replicate": design.replicate, "alpha": ALPHA,
                       "n_draws": design.n_draws, "n_cells": design.n_cells, "psi_family": out.psi_family})
    out.environments = (pd.concat(environments, ignore_index=True) if environments
                        else pd.DataFrame(columns=[*ENV_COLUMNS, "measure"]))
    return out


def _references(ctx: RowContext, enough: bool) -> tuple[pd.DataFrame, pd.DataFrame, list[pd.DataFrame]]:
    """The reference rows, the random reference's bands and the references' environments."""
    if not enough:
        return pd.DataFrame(columns=correlation_columns(ctx.design.axes)), pd.DataFrame(columns=BAND_COLUMNS), []
    ceiling, envs = replicate_gap_row(ctx)
    baselines, environments = [], []
    for key in [HYPERPARAMETERS, *[AXIS_PREFIX + a for a in ctx.design.axes]]:
        row, base_envs = measure_row(ctx, key, ctx.resamples.data[key], True, kind="reference")
        row["note"] = "; ".join(filter(None, [baseline_note(key, ctx.design.n_draws), row["note"]]))
        baselines.append(row)
        if base_envs is not None and len(base_envs):
            environments.append(base_envs.assign(measure=key))
    psi_tests(ctx, [*baselines, ceiling])
    floor, bands = random_reference(ctx)
    baseline_comparison(ctx, [*baselines, floor, ceiling], HYPERPARAMETERS)
    refs = pd.DataFrame([*baselines, floor, ceiling], columns=correlation_columns(ctx.design.axes))
    refs["vs_best_borderline"] = False
    refs["beats_hyperparameters"] = refs["beats_hyperparameters"].fillna(False).astype(bool)
    if envs is not None and len(envs):
        environments.append(envs.assign(measure=REPLICATE_GAP))
    return refs, bands, environments


def _holm_psi(corr: pd.DataFrame, axes: list[str]) -> int:
    """Fill p_psi_holm_<axis> of the measure rows (Holm over all their ψ tests together); the family size."""
    if not axes or not len(corr):
        return 0
    cols = [f"p_psi_{a}" for a in axes]
    adjusted, size = holm_family(corr[cols].to_numpy(dtype=float))
    for k, axis in enumerate(axes):
        corr[f"p_psi_holm_{axis}"] = adjusted[:, k]
    return size


def _split_runs(table: pd.DataFrame, gap: str, min_train_acc: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the runs the statistics use, the excluded runs with their reasons)."""
    if not len(table):
        return table, pd.DataFrame({"run_id": [], "experiment": [], "status": [], "reason": []})
    reasons = exclusion_reasons(table, gap, min_train_acc)
    keep = (reasons == "").to_numpy()
    excluded = pd.DataFrame({"run_id": table["run_id"][~keep].to_numpy(),
                             "experiment": table["experiment"][~keep].to_numpy(),
                             "status": table["status"][~keep].to_numpy(), "reason": reasons[~keep].to_numpy()})
    return table[keep], excluded


def _size_notes(n: int, design: Design, resampling: str, units: int, full: bool) -> list[str]:
    """What the number of runs and the design rule out, said once for the whole table."""
    notes = []
    if n < MIN_RUNS:
        notes.append(f"correlations need at least {MIN_RUNS} trained runs; {n} {'is' if n == 1 else 'are'} "
                     "available")
        return notes
    if n < MIN_CI_RUNS:
        notes.append(f"{n} runs: with fewer than {MIN_CI_RUNS} runs no bootstrap interval is given (it would be "
                     "unreliable and often collapses to a point) and no measure can be compared with the best "
                     "(\"cannot compare\"); judge each τ by its permutation p-value")
    notes.append(resampling)
    if design.n_draws > 1:
        notes.append(f"τ is stratified by data draw: pairs of runs of one draw only, pooled over the {design.n_draws} "
                     "draws (its permutation p permutes within draws; CMI and sign errors use the same pairs, ψ's "
                     "blocks hold one draw); kendall_tau_pooled is τ over every pair")
    if n >= MIN_CI_RUNS and units < MIN_UNITS:
        notes.append(f"only {units} independent unit(s) to resample (fewer than {MIN_UNITS}): no interval and no "
                     "comparison with the best (a percentile bootstrap over so few clusters is far too liberal)")
    if design.n_cells < n and n >= MIN_RUNS:
        notes.append("the permutation p-value of τ treats the runs as exchangeable; runs that share a data draw "
                     "or a configuration are not, so it is optimistic: read τ's interval")
    if full and not design.axes:
        notes.append("no axis varies (seeds and data seeds are replicates, not axes): Ψ, CMI and the sign errors "
                     "are not defined")
    return notes


def _design_notes(ctx: RowContext, psi_family: int, enough: bool) -> list[str]:
    """The ψ tests' family and their limits, the noise filter of the sign errors, the references."""
    design = ctx.design
    if not enough or not design.axes:
        return []
    notes = []
    plan = ctx.plan(np.isfinite(ctx.gap))
    untested = [f"{a} ({why})" for a, b in plan.psi.items() if (why := psi_untestable(b))]
    if psi_family:
        notes.append(f"ψ p-values: two-way bootstrap of the block mean, Holm-adjusted over all {psi_family} ψ tests "
                     f"of this study (measures × axes; p_psi_holm_<axis>)" + (f"; no test for {'; '.join(untested)}"
                                                                              if untested else ""))
    elif untested:
        notes.append(f"no ψ test is possible: {'; '.join(untested)}")
    if design.data_axes:
        notes.append(f"Ψ averages the training axes ({', '.join(design.training_axes) or 'none'}); psi_data the "
                     f"data axes ({', '.join(design.data_axes)})")
    notes += _sign_error_notes(ctx, plan)
    return notes


def _sign_error_notes(ctx: RowContext, plan: DesignPlan) -> list[str]:
    """The noise filter's threshold, and what it leaves of the environments."""
    frame = plan.environments.frame
    sd = ctx.noise_sd
    if not math.isfinite(sd):
        out = ["sign errors: no configuration holds two runs, so the replicate noise is unknown: every pair with "
               "different gaps counts (no noise filter)"]
    else:
        out = [f"sign errors count only pairs whose gap difference exceeds {2 * NOISE_Z:.2f} × the replicate "
               f"standard deviation of the gap ({sd:.3g}; Dziugaite et al.'s filter with the replicate noise)"]
    if len(frame) and not frame["averaged"].any():
        most = int(frame["n_pairs"].max())
        out.append(f"every environment holds fewer than {MIN_ENV_PAIRS} pairs above the noise (at most {most}, with "
                   f"{ctx.design.n_draws} draw(s)): sign_error_mean and sign_error_worst are not given; "
                   "environments.csv lists the environments")
    return out


def _compare_with_best(corr: pd.DataFrame, included: pd.DataFrame, gcol: str, flip: dict[str, bool],
                       resamples: Resamples, notes: list[str]) -> pd.DataFrame:
    """Fill the best-group columns of `corr` (in place), add their notes; returns the paired comparisons."""
    comparisons = paired_comparisons(included, corr["measure"].tolist(), gcol, flip, resamples=resamples)
    group = best_group(corr["measure"].tolist(), corr["kendall_tau"].to_numpy(dtype=float), resamples)
    for col in group.columns:
        corr[col] = group[col].to_numpy()
    if len(corr) and (corr["vs_best"] == "cannot compare").any() and len(included) >= MIN_CI_RUNS:
        notes.append("\"cannot compare\": fewer than 10 runs shared with the best measure, too few resampled units, "
                     "or resamples that never change the difference")
    cmi_reasons = sorted({str(n).split("CMI n/a: ", 1)[1].split("; ", 1)[0] for n in corr["note"]
                          if "CMI n/a: " in str(n)})
    if cmi_reasons:
        notes.append("CMI is n/a: " + cmi_reasons[0] + (" (similar for some measures)" if len(cmi_reasons) > 1
                                                          else ""))
    return comparisons


def kendall_tests(pairs: Sequence[tuple[np.ndarray, np.ndarray]], n_perm: int = N_PERM, seed: int = 0,
                  strata: np.ndarray | None = None, pvalues: bool = True) -> list[tuple[float, float, int]]:
    """(τ-b, permutation p, n) of each (measure values, gap) pair over the runs where both are finite: the
    package's one τ with the gap, which the report and the audits' Δτ (τ after a rescaling − τ before)
    both read. τ and p are NaN where τ is undefined (`usable`), p also without `pvalues`. Pairs over the
    same runs (one finite mask, the gap of the first such pair) are tested in one pass with the same
    permutations, so each p is the one the pair gets alone. `strata`: the data draws, aligned with the gap,
    for the test of the stratified τ (`kernels.kendall_permutation_pvalues`)."""
    out: list[tuple[float, float, int]] = []
    groups: dict[bytes, list[int]] = {}
    for i, (x, y) in enumerate(pairs):
        ok = np.isfinite(x) & np.isfinite(y)
        out.append((math.nan, math.nan, int(ok.sum())))
        if usable(x[ok], y[ok]):
            groups.setdefault(ok.tobytes(), []).append(i)
    for members in groups.values():
        ok = np.isfinite(pairs[members[0]][0]) & np.isfinite(pairs[members[0]][1])
        xs = np.stack([pairs[i][0][ok] for i in members])
        y = pairs[members[0]][1][ok]
        taus = kendall_batch(xs, np.broadcast_to(y, xs.shape))
        ps = kendall_permutation_pvalues(xs, y, n_perm=n_perm, seed=seed,
                                         strata=None if strata is None else strata[ok]) if pvalues \
            else np.full(len(members), math.nan)
        for i, tau, p in zip(members, taus, ps):
            out[i] = (float(tau), float(p), int(ok.sum()))
    return out


def _permutation_pvalues(data: Mapping[str, np.ndarray], measures: list[str], gap_values: np.ndarray,
                         n_perm: int, seed: int, draws: np.ndarray | None = None) -> dict[str, tuple[float, str]]:
    """(kendall_p, its method) for every measure where τ is defined (`kendall_tests`). With `draws`, the
    test of the stratified τ (permutations within draws)."""
    out: dict[str, tuple[float, str]] = {}
    tests = kendall_tests([(data[key], gap_values) for key in measures], n_perm, seed, draws)
    for key, (tau, p, _) in zip(measures, tests):
        if not math.isfinite(tau):
            continue
        ok = np.isfinite(data[key]) & np.isfinite(gap_values)
        strata = draws[ok] if draws is not None else None
        method = permutation_method(data[key][ok], gap_values[ok], n_perm, strata)
        within = " within draws" if strata is not None and len(np.unique(strata)) > 1 else ""
        out[key] = (p, f"monte carlo ({n_perm} permutations{within})" if method == "monte carlo"
                    else "exact (scipy, no ties)" if method == "exact" else "enumerated (all n! orders)")
    return out


def agreement_matrix(frame: pd.DataFrame, columns: list[str], min_pairs: int = MIN_RUNS) -> pd.DataFrame:
    """Kendall τ-b between every two columns over the runs where both are finite (which measures agree)."""
    data = {c: frame[c].to_numpy(dtype=float) for c in columns}
    out = pd.DataFrame(np.nan, index=columns, columns=columns)
    for a, b in itertools.combinations_with_replacement(columns, 2):
        ok = np.isfinite(data[a]) & np.isfinite(data[b])
        if ok.sum() < min_pairs:
            continue
        tau = float(kendall_batch(data[a][ok][None, :], data[b][ok][None, :])[0])
        out.loc[a, b] = out.loc[b, a] = tau
    return out


def oriented(frame: pd.DataFrame, larger_is_sharper: Mapping[str, bool]) -> pd.DataFrame:
    """Measure columns negated where smaller means sharper, so that larger always means 'predicts a
    larger gap' (used by the agreement heatmap)."""
    out = frame.copy()
    for key, larger in larger_is_sharper.items():
        if key in out.columns and not larger:
            out[key] = -out[key].astype(float)
    return out
