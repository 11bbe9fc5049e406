"""Does a measure track the generalization gap? The analysis that the report rests on.

`analyze` computes, for every headline measure (a `name` or `name@loss` column of the table), over the
runs where it has a value (oriented so that a positive number always means "tracks the gap": a measure
whose measures.json entry says `larger_is_sharper=False` is negated first):

* Kendall τ-b, Spearman ρ and Pearson r, with 95% percentile intervals of the design bootstrap (10,000
  resamples within the cells of the hyperparameter axes, `design`), only from `MIN_CI_RUNS` runs on;
* `kendall_p`: the permutation p-value of τ and its method (`kernels.kendall_permutation_pvalues`);
* the best group: Holm-adjusted paired comparisons with the top measure (`compare`);
* Jiang et al.'s Ψ with one ψ per hyperparameter axis and their CMI score (`jiang`);
* Dziugaite et al.'s sign errors over environments and the seed-pair concordance (`robust`);
* Monte-Carlo standard errors of the measures (`se_median`, `se_ratio`).

Exclusions: runs that are not finished, have a train accuracy below `min_train_acc`, or a non-finite
loss or gap are left out of every statistic and returned with a reason, never silently dropped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

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
from flatbench.analysis.stats.design import Design, design_of, strata_of
from flatbench.analysis.stats.jiang import conditional_mi, granulated_kendall
from flatbench.analysis.stats.kernels import (
    N_PERM,
    STATISTICS,
    WEIGHTED,
    kendall_batch,
    weighted_ranks,
    kendall_permutation_pvalues,
    permutation_method,
    weighted_spearman,
)
from flatbench.analysis.stats.psi_test import psi_pvalues
from flatbench.analysis.stats.robust import seed_pairs, seed_pairs_pvalue, sign_errors
from flatbench.analysis.table import headline_columns, stderr_columns, sweep_axes, to_float
from flatbench.store import gap_column

CI_LEVEL = 0.95
N_BOOT = 10_000
"""Design-bootstrap resamples for every interval and paired comparison (the report's default)."""
SE_NOTE_RATIO = 0.5
"""A measure whose median Monte-Carlo standard error is at least this fraction of its between-run standard
deviation gets a note. At 0.5 the noise variance is a quarter of the observed variance (reliability
≈ 0.75), which by Spearman's attenuation formula shrinks a correlation by a factor of about
√0.75 ≈ 0.87: enough to reorder measures whose τ differ by less than that."""
_MIN_CI_DOC = """Why no interval below 10 runs. A bootstrap resample of n runs holds on average only
n(1 − (1 − 1/n)^n) ≈ 0.63·n distinct runs (3.4 at n = 5), so for small n the bootstrap distribution of τ
is a handful of atoms, and a perfectly ordered sample gives [1, 1] however weak the evidence. Percentile
intervals of correlation coefficients undercover in small samples (Hall, Martin & Schucany 1989), and
n = 10 is the smallest sample Long & Cliff (1997) studied. Below 10 runs the permutation p-value, which
is exact there, is the honest summary."""


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
        if not bad and not math.isfinite(to_float(row.get(gcol))):
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
    """Hyperparameter axes that vary among the included runs (never `seed`)."""
    gap: str
    gap_column: str
    larger_is_sharper: dict[str, bool]
    notes: list[str] = field(default_factory=list)
    comparisons: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=COMPARISON_COLUMNS))
    """Every ordered pair of measures: τ_a − τ_b with its design-bootstrap interval and p-values (see
    `compare.paired_comparisons`), measures in ranking order."""
    environments: pd.DataFrame = field(default_factory=pd.DataFrame)
    """measure, axis, environment, n_pairs, sign_error: Dziugaite et al.'s environments (`robust`)."""
    design: Design | None = None
    resampling: str = ""
    """How the bootstrap resampled (the strata of the design, or the fallback), one sentence."""
    replicate: str | None = None


def analyze(table: pd.DataFrame, gap: str = "acc", min_train_acc: float = 0.0, n_boot: int = N_BOOT,
            seed: int = 0, axes: list[str] | None = None, n_perm: int = N_PERM, full: bool = True) -> Analysis:
    """Exclusions, then every statistic for every headline measure (see the module doc).

    Columns of `Analysis.correlations`, one row per headline measure, best Kendall τ first (ties by name):
    measure, larger_is_sharper, n, n_missing; for τ, ρ and r the value with `_lo`/`_hi` (NaN below
    MIN_CI_RUNS runs); kendall_p and kendall_p_method ("enumerated", "exact", "monte carlo"); vs_best,
    vs_best_p (Wald p of τ_best − τ_m), vs_best_p_holm (Holm-adjusted), vs_best_mcse (its Monte-Carlo
    error), vs_best_borderline; se_median, se_ratio; psi and one psi_<axis> per hyperparameter axis, then one
    p_psi_<axis> (the within-group permutation p-value of that ψ, `psi_test`); cmi, cmi_condition,
    cmi_min_pairs; sign_error_mean, sign_error_worst, n_environments; seed_pairs_concordant, n_seed_pairs,
    seed_pairs_p (exact sign test); note.

    `axes`: the study's sweep axes (default: the table's); `seed` among them is read as the replicate.
    `full=False` computes only τ/ρ/r, their intervals and p (the per-level tables).
    """
    gcol = gap_column(gap)
    notes: list[str] = []
    measures = headline_columns(table)
    se_cols = stderr_columns(table)
    sweep = list(axes) if axes is not None else sweep_axes(table)
    if "seed" in table.columns and "seed" not in sweep:
        sweep = [*sweep, "seed"]
    included, excluded = _split_runs(table, gap, min_train_acc)
    design = design_of(included, sweep)
    used_axes = design.axes
    flip = directions(measures, notes, table.attrs.get("directions"))
    strata = strata_of(design.cells)
    resampling = strata.description
    notes += _size_notes(len(included), used_axes, strata, full)

    gap_values = included[gcol].to_numpy(dtype=float) if len(included) else np.zeros(0)
    data = oriented_data(included, measures, flip)
    p_values, p_methods = _permutation_pvalues(data, measures, gap_values, n_perm, seed)
    resamples = Resamples(data, gap_values, design.cells, n_boot, seed)
    rows, environments = [], []
    for key in measures:
        row, envs = _measure_row(key, data[key], included, gap_values, design, flip[key], n_boot, seed,
                                 p_values.get(key, math.nan), p_methods.get(key, ""), se_cols.get(key),
                                 resamples, full)
        rows.append(row)
        if envs is not None and len(envs):
            environments.append(envs.assign(measure=key))
    corr = pd.DataFrame(rows, columns=_correlation_columns(used_axes))
    if len(corr):
        corr = corr.sort_values(["kendall_tau", "measure"], ascending=[False, True], na_position="last",
                                kind="mergesort").reset_index(drop=True)
    comparisons = pd.DataFrame(columns=COMPARISON_COLUMNS)
    if full:
        comparisons = _compare_with_best(corr, included, gcol, flip, resamples, notes)
    corr["vs_best_borderline"] = corr["vs_best_borderline"].fillna(False).astype(bool)
    corr.attrs.update({"gap": gap, "gap_column": gcol, "axes": list(used_axes), "notes": list(notes),
                       "excluded": excluded.to_dict(orient="records"), "n_included": len(included),
                       "min_ci_runs": MIN_CI_RUNS, "n_perm": n_perm, "n_boot": n_boot, "seed": seed,
                       "resampling": resampling, "replicate": design.replicate, "alpha": ALPHA})
    env_frame = (pd.concat(environments, ignore_index=True) if environments
                 else pd.DataFrame(columns=["axis", "environment", "n_pairs", "sign_error", "measure"]))
    return Analysis(correlations=corr, included=included, excluded=excluded, axes=used_axes, gap=gap,
                    gap_column=gcol, larger_is_sharper=flip, notes=notes, comparisons=comparisons,
                    environments=env_frame, design=design, resampling=resampling, replicate=design.replicate)


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


def _size_notes(n: int, used_axes: list[str], strata: Any, full: bool) -> list[str]:
    """What the number of runs and the design rule out, said once for the whole table."""
    notes = []
    if n < MIN_RUNS:
        notes.append(f"correlations need at least {MIN_RUNS} trained runs; {n} {'is' if n == 1 else 'are'} "
                     "available")
    elif n < MIN_CI_RUNS:
        notes.append(f"{n} runs: with fewer than {MIN_CI_RUNS} runs no bootstrap interval is given (it would be "
                     "unreliable and often collapses to a point) and no measure can be compared with the best "
                     "(\"cannot compare\"); judge each τ by its permutation p-value")
    if full and n >= MIN_RUNS:
        if not used_axes:
            notes.append("no hyperparameter axis varies (the seed is a replicate, not an axis): Ψ, CMI and the "
                         "sign errors are not defined")
        if strata.scheme != "cells" and n >= MIN_CI_RUNS:
            notes.append(f"bootstrap: {strata.description}")
    return notes


def _correlation_columns(used_axes: list[str]) -> list[str]:
    """The columns of correlations.csv, in order (`analyze`'s docstring says what each holds)."""
    columns = ["measure", "larger_is_sharper", "n", "n_missing"]
    for stat in STATISTICS:
        columns += [stat, f"{stat}_lo", f"{stat}_hi"]
    return columns + ["kendall_p", "kendall_p_method", "vs_best", "vs_best_p", "vs_best_p_holm", "vs_best_mcse",
                      "vs_best_borderline", "se_median", "se_ratio", "psi", *[f"psi_{a}" for a in used_axes],
                      *[f"p_psi_{a}" for a in used_axes], "cmi", "cmi_condition", "cmi_min_pairs",
                      "sign_error_mean", "sign_error_worst", "n_environments", "seed_pairs_concordant",
                      "n_seed_pairs", "seed_pairs_p", "note"]


def _compare_with_best(corr: pd.DataFrame, included: pd.DataFrame, gcol: str, flip: dict[str, bool],
                       resamples: Resamples, notes: list[str]) -> pd.DataFrame:
    """Fill the best-group columns of `corr` (in place), add their notes; returns the paired comparisons."""
    comparisons = paired_comparisons(included, corr["measure"].tolist(), gcol, flip, resamples=resamples)
    group = best_group(corr["measure"].tolist(), corr["kendall_tau"].to_numpy(dtype=float), resamples)
    for col in group.columns:
        corr[col] = group[col].to_numpy()
    if len(corr) and (corr["vs_best"] == "cannot compare").any() and len(included) >= MIN_CI_RUNS:
        notes.append("\"cannot compare\": fewer than 10 runs shared with the best measure, or resamples "
                     "that never change the difference")
    cmi_reasons = sorted({str(n).split("CMI n/a: ", 1)[1].split("; ", 1)[0] for n in corr["note"]
                          if "CMI n/a: " in str(n)})
    if cmi_reasons:
        notes.append("CMI is n/a: " + cmi_reasons[0] + (" (similar for some measures)" if len(cmi_reasons) > 1
                                                          else ""))
    return comparisons


def _permutation_pvalues(data: Mapping[str, np.ndarray], measures: list[str], gap_values: np.ndarray,
                         n_perm: int, seed: int) -> tuple[dict[str, float], dict[str, str]]:
    """kendall_p and its method for every measure; measures with values on the same runs are tested in
    one pass."""
    groups: dict[bytes, list[tuple[str, np.ndarray]]] = {}
    masks: dict[bytes, np.ndarray] = {}
    for key in measures:
        raw = data[key]
        ok = np.isfinite(raw) & np.isfinite(gap_values)
        values = raw[ok]
        if not usable(values, gap_values[ok]):
            continue
        groups.setdefault(ok.tobytes(), []).append((key, values))
        masks[ok.tobytes()] = ok
    out: dict[str, float] = {}
    methods: dict[str, str] = {}
    for mask_key, members in groups.items():
        x = np.stack([v for _, v in members])
        g = gap_values[masks[mask_key]]
        p = kendall_permutation_pvalues(x, g, n_perm=n_perm, seed=seed)
        for (key, values), pi in zip(members, p):
            out[key] = float(pi)
            method = permutation_method(values, g, n_perm)
            methods[key] = (f"monte carlo ({n_perm} permutations)" if method == "monte carlo"
                            else "exact (scipy, no ties)" if method == "exact" else "enumerated (all n! orders)")
    return out, methods


def _design_statistics(row: dict[str, Any], note: list[str], values: np.ndarray, gap: np.ndarray,
                       design: Design, ok: np.ndarray, seed: int) -> pd.DataFrame | None:
    """Fill the within-design statistics of one measure into `row` (ψ per axis with its p, Ψ, CMI, sign
    errors, seed pairs); return the sign-error environments (None without hyperparameter axes)."""
    axes = design.axes
    envs = None
    if axes:
        sub = design.codes[ok]
        within = [design.replicate] if design.replicate else []
        row["psi"], per_axis = granulated_kendall(values, gap, sub, axes, within)
        for axis, value in per_axis.items():
            row[f"psi_{axis}"] = value
        for axis, (p, _method) in psi_pvalues(values, gap, sub, axes, within, seed=seed).items():
            row[f"p_psi_{axis}"] = p
        cmi = conditional_mi(values, gap, sub, axes)
        row["cmi"], row["cmi_condition"], row["cmi_min_pairs"] = cmi.score, cmi.condition, cmi.min_pairs
        if cmi.reason:
            note.append(f"CMI n/a: {cmi.reason}")
            row["cmi_condition"] = ""
        errors = sign_errors(values, gap, sub, axes)
        envs = errors.environments
        row["sign_error_mean"], row["sign_error_worst"] = errors.mean, errors.worst
        row["n_environments"] = int(len(envs))
    if design.replicate:
        reps = design.codes[design.replicate].to_numpy()[ok]
        row["seed_pairs_concordant"], row["n_seed_pairs"] = seed_pairs(values, gap, design.cells[ok], reps)
        row["seed_pairs_p"] = seed_pairs_pvalue(values, gap, design.cells[ok], reps)
    return envs


def _measure_row(key: str, oriented: np.ndarray, included: pd.DataFrame, gap_values: np.ndarray,
                 design: Design, larger_is_sharper: bool, n_boot: int, seed: int, kendall_p: float,
                 kendall_p_method: str, se_column: str | None, resamples: Resamples,
                 full: bool) -> tuple[dict[str, Any], pd.DataFrame | None]:
    """One measure's row of correlations.csv: τ, ρ, r with their design-bootstrap intervals (`full`: also
    the within-design statistics, ψ per axis, CMI, sign errors, seed pairs), and its bootstrap draws of τ
    for the comparisons with the best; NaN statistics with a note where τ is not defined."""
    ok = np.isfinite(oriented) & np.isfinite(gap_values)
    values = oriented[ok]
    gap = gap_values[ok]
    axes = design.axes
    row: dict[str, Any] = {"measure": key, "larger_is_sharper": larger_is_sharper, "n": int(ok.sum()),
                           "n_missing": int(len(oriented) - ok.sum())}
    for stat in STATISTICS:
        row[stat] = row[f"{stat}_lo"] = row[f"{stat}_hi"] = math.nan
    row.update({"kendall_p": math.nan, "kendall_p_method": "", "vs_best": "", "vs_best_p": math.nan,
                "vs_best_p_holm": math.nan, "vs_best_mcse": math.nan, "vs_best_borderline": False,
                "psi": math.nan, "cmi": math.nan, "cmi_condition": "", "cmi_min_pairs": math.nan,
                "sign_error_mean": math.nan, "sign_error_worst": math.nan, "n_environments": 0,
                "seed_pairs_concordant": math.nan, "n_seed_pairs": 0})
    for axis in axes:
        row[f"psi_{axis}"] = row[f"p_psi_{axis}"] = math.nan
    row["seed_pairs_p"] = math.nan
    row["se_median"], row["se_ratio"] = _stderr_summary(included, se_column, ok, values)
    note = []
    envs = None
    if row["n"] == 0:
        note.append("no value on any run" if len(oriented) else "no runs")
    elif row["n"] < MIN_RUNS:
        note.append(f"only {row['n']} run(s) with a value" if len(oriented) >= MIN_RUNS else "too few runs")
    elif np.ptp(values) == 0:
        note.append("constant across runs")
    elif np.ptp(gap) == 0:
        note.append("the gap is constant across these runs")
    else:
        with_ci = row["n"] >= MIN_CI_RUNS and n_boot > 0
        if with_ci:
            boot_design = resamples.bootstrap(ok)
            if "gap_ranks" not in boot_design.cache:
                boot_design.cache["gap_ranks"] = weighted_ranks(gap, boot_design.weights)
        for stat, fn in STATISTICS.items():
            row[stat] = float(fn(values[None, :], gap[None, :])[0])
            if with_ci:
                if stat == "kendall_tau":
                    boot = resamples.boot(key, ok)  # shared with the paired comparisons
                elif stat == "spearman_rho":
                    boot = weighted_spearman(values, gap, boot_design.weights,
                                             y_ranks=boot_design.cache["gap_ranks"])
                else:
                    boot = WEIGHTED[stat](values, gap, boot_design.weights, boot_design.pairs)
                boot = boot_design.rescale(row[stat], boot[np.isfinite(boot)])
                if len(boot) >= 10:
                    lo, hi = np.quantile(boot, [(1 - CI_LEVEL) / 2, (1 + CI_LEVEL) / 2])
                    row[f"{stat}_lo"], row[f"{stat}_hi"] = float(lo), float(hi)
        row["kendall_p"] = kendall_p
        row["kendall_p_method"] = kendall_p_method
        if row["n"] < MIN_CI_RUNS:
            note.append(f"n < {MIN_CI_RUNS}: no interval; see the p-value")
        elif row["kendall_tau_lo"] == row["kendall_tau_hi"]:
            note.append("every bootstrap resample gives the same τ (interval collapsed to a point); see the "
                        "p-value")
        if full:
            envs = _design_statistics(row, note, values, gap, design, ok, seed)
    if row["se_ratio"] >= SE_NOTE_RATIO:  # False for NaN
        note.append(f"standard error comparable to the spread between runs (se/sd = {row['se_ratio']:.2f}): "
                    "the ranking is partly noise")
    if row["n_missing"] and row["n"]:
        note.append(f"no value on {row['n_missing']} run(s)")
    if not larger_is_sharper:
        note.append("sign flipped (smaller = sharper)")
    row["note"] = "; ".join(note)
    return row, envs


def _stderr_summary(included: pd.DataFrame, se_column: str | None, ok: np.ndarray,
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
