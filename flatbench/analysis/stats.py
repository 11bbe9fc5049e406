"""Does a measure track the generalization gap? Rank statistics with honest uncertainty.

For every headline measure (a `name` or `name@loss` column of the table) against the gap:

* Kendall τ-b, Spearman ρ and Pearson r, each with a 95% percentile-bootstrap interval. The bootstrap
  resamples runs with replacement from a generator seeded with `seed`, so a report is reproducible.
* Jiang et al. (2020, "Fantastic generalization measures and where to find them", §4) granulated Kendall
  coefficient: for each hyperparameter axis i, the mean over all combinations of the other axes' values
  of Kendall's τ among the runs that differ only in axis i; Ψ is the mean over axes. Within a group τ is
  Jiang et al.'s definition, the mean of sign(Δmeasure)·sign(Δgap) over pairs (τ-a: a tie scores 0).
* Jiang et al.'s conditional-mutual-information score (§5; the PGDL competition's metric): over ordered
  pairs of runs, V_g = sign(Δgap) and V_μ = sign(Δmeasure); conditioning on the pair's values U_S of a set
  S of axes, Î = I(V_μ; V_g | U_S) / H(V_g | U_S), and the score is the minimum over sets S of two axes.
  Conditioning on *every* varying axis leaves nothing to explain (each cell is one pair), so when exactly
  two axes vary the sets are the single axes. It needs at least two varying axes; it ignores the sign.

Direction: a measure whose registry entry says `larger_is_sharper=False` is negated before any
statistic, so that a positive number always means "tracks the gap".

Exclusions: runs that are not finished, have a train accuracy below `min_train_acc`, or a non-finite
loss or gap are left out of every statistic and returned with a reason, never silently dropped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import rankdata

from flatbench.analysis.table import headline_columns, sweep_axes

MIN_RUNS = 3
"""Correlations over fewer runs than this are not reported (two points always have |τ| = 1)."""
CI_LEVEL = 0.95
_PAIRWISE_LIMIT = 400
"""Above this many runs the bootstrap uses an O(n log n) τ per resample instead of the n×n sign arrays."""
_CHUNK_ELEMENTS = 4_000_000


# --------------------------------------------------------------------------------------------- direction

def measure_specs() -> dict[str, Any]:
    """The measure registry (name → MeasureSpec); a separate function so tests can substitute it."""
    from flatbench.measures import all_measures

    return all_measures()


def directions(keys: list[str], notes: list[str] | None = None) -> dict[str, bool]:
    """`larger_is_sharper` for every result key, looked up by the part before "@" (default True)."""
    try:
        specs = measure_specs()
    except Exception as exc:  # noqa: BLE001 - a broken measure module must not take the report down
        specs = {}
        if notes is not None:
            notes.append(f"the measure registry could not be loaded ({type(exc).__name__}: {exc}); every "
                         "measure is read as larger = sharper")
    out = {}
    for key in keys:
        base = key.split("/", 1)[0].split("@", 1)[0]
        spec = specs.get(base)
        out[key] = bool(getattr(spec, "larger_is_sharper", True)) if spec is not None else True
    return out


# ----------------------------------------------------------------------------------- correlation kernels

def _constant(x: np.ndarray) -> np.ndarray:
    """Rows of a (B, n) array whose values are all equal (exactly: no floating-point tolerance)."""
    return np.ptp(x, axis=-1) == 0


def pearson_batch(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of each row pair of two (B, n) arrays; NaN (no warning) for a constant row."""
    x = np.atleast_2d(np.asarray(x, dtype=float))
    y = np.atleast_2d(np.asarray(y, dtype=float))
    bad = _constant(x) | _constant(y)
    xc = x - x.mean(axis=1, keepdims=True)
    yc = y - y.mean(axis=1, keepdims=True)
    # Scaling by the max keeps huge (1e30) or tiny measure values from overflowing the sums of squares.
    xc = xc / np.where(bad, 1.0, np.abs(xc).max(axis=1))[:, None]
    yc = yc / np.where(bad, 1.0, np.abs(yc).max(axis=1))[:, None]
    num = (xc * yc).sum(axis=1)
    den = np.sqrt((xc * xc).sum(axis=1) * (yc * yc).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(bad | (den == 0), np.nan, num / np.where(den == 0, 1.0, den))
    return np.clip(r, -1.0, 1.0)


def spearman_batch(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman ρ: Pearson r of the average ranks (ties share their mean rank, as scipy does)."""
    x = np.atleast_2d(np.asarray(x, dtype=float))
    y = np.atleast_2d(np.asarray(y, dtype=float))
    return pearson_batch(rankdata(x, axis=1), rankdata(y, axis=1))


def kendall_batch(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Kendall τ-b of each row pair: (C − D) / sqrt((pairs untied in x)(pairs untied in y)).

    Written over the n×n sign matrices so that a thousand bootstrap resamples are one array operation;
    NaN when either row is constant.
    """
    x = np.atleast_2d(np.asarray(x, dtype=float))
    y = np.atleast_2d(np.asarray(y, dtype=float))
    b, n = x.shape
    out = np.full(b, np.nan)
    if n < 2:
        return out
    if n > _PAIRWISE_LIMIT:
        for i in range(b):
            out[i] = _kendall_sorted(x[i], y[i])
        return out
    chunk = max(1, _CHUNK_ELEMENTS // (n * n))
    for start in range(0, b, chunk):
        xs, ys = x[start:start + chunk], y[start:start + chunk]
        sx = np.sign(xs[:, :, None] - xs[:, None, :]).astype(np.int8)
        sy = np.sign(ys[:, :, None] - ys[:, None, :]).astype(np.int8)
        num = (sx * sy).sum(axis=(1, 2), dtype=np.int64)
        dx = np.abs(sx).sum(axis=(1, 2), dtype=np.int64)
        dy = np.abs(sy).sum(axis=(1, 2), dtype=np.int64)
        ok = (dx > 0) & (dy > 0)
        den = np.sqrt(dx.astype(float) * dy.astype(float))
        out[start:start + chunk] = np.where(ok, num / np.where(ok, den, 1.0), np.nan)
    return out


def _kendall_sorted(x: np.ndarray, y: np.ndarray) -> float:
    """τ-b for large n via scipy's O(n log n) algorithm, with our constant-input rule (NaN, no warning)."""
    from scipy.stats import kendalltau

    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(kendalltau(x, y).statistic)


def kendall_tau_a(x: np.ndarray, y: np.ndarray) -> float:
    """Jiang et al.'s τ: mean over unordered pairs of sign(Δx)·sign(Δy); ties score 0. NaN for n < 2."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n = len(x)
    if n < 2:
        return math.nan
    sx = np.sign(x[:, None] - x[None, :])
    sy = np.sign(y[:, None] - y[None, :])
    return float((sx * sy).sum() / (n * (n - 1)))


STATISTICS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "kendall_tau": kendall_batch,
    "spearman_rho": spearman_batch,
    "pearson_r": pearson_batch,
}


def bootstrap_ci(x: np.ndarray, y: np.ndarray, statistic: Callable[[np.ndarray, np.ndarray], np.ndarray],
                 n_boot: int = 1000, seed: int = 0, level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic`, resampling the (x, y) pairs with replacement.

    The generator is seeded afresh per call, so an interval depends only on the data and the seed (not on
    which other measures were analysed first), and measures with the same n share their resamples.
    Resamples on which the statistic is undefined (a constant resample) are dropped; fewer than ten
    defined resamples give no interval.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n = len(x)
    if n_boot <= 0 or n < 2:
        return (math.nan, math.nan)
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    values = statistic(x[idx], y[idx])
    values = values[np.isfinite(values)]
    if len(values) < 10:
        return (math.nan, math.nan)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(values, [alpha, 1.0 - alpha])
    return (float(lo), float(hi))


# ------------------------------------------------------------------------------- granulated Kendall, CMI

def _axis_codes(frame: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """Axis values as strings, so floats, strings and missing values group the same way everywhere."""
    return pd.DataFrame({a: frame[a].map(_axis_text).to_numpy() for a in axes}, index=frame.index)


def _axis_text(value: Any) -> str:
    if value is None or (isinstance(value, (float, np.floating)) and math.isnan(value)):
        return "None"
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return repr(float(value))  # 0 (from YAML) and 0.0 are the same axis value
    return str(value)


def granulated_kendall(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame,
                       axes: list[str]) -> tuple[float, dict[str, float]]:
    """Ψ and ψ_i per axis (Jiang et al. 2020, Eq. 4); runs are the rows of `codes`, aligned with the arrays.

    ψ_i averages τ over the groups of runs that share every other axis value; a group whose runs all have
    the same value of axis i says nothing about axis i and is skipped. An axis without any usable group
    gets NaN, and Ψ is the mean over the axes that have a value.
    """
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    per_axis: dict[str, float] = {}
    for axis in axes:
        others = [a for a in axes if a != axis]
        if others:
            keys = codes[others].agg("\x1f".join, axis=1).to_numpy()
        else:
            keys = np.zeros(len(codes), dtype=int)
        axis_values = codes[axis].to_numpy()
        taus = []
        for key in pd.unique(keys):
            members = np.flatnonzero(keys == key)
            if len(members) < 2 or len(set(axis_values[members])) < 2:
                continue
            taus.append(kendall_tau_a(measure[members], gap[members]))
        per_axis[axis] = float(np.mean(taus)) if taus else math.nan
    defined = [v for v in per_axis.values() if math.isfinite(v)]
    return (float(np.mean(defined)) if defined else math.nan), per_axis


def _entropy(counts: np.ndarray) -> np.ndarray:
    """Entropy in bits of each row of a count array (rows summing to 0 give 0)."""
    total = counts.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total > 0, counts / np.where(total > 0, total, 1), 0.0)
        terms = np.where(p > 0, -p * np.log2(np.where(p > 0, p, 1.0)), 0.0)
    return terms.sum(axis=-1)


def conditional_mi(measure: np.ndarray, gap: np.ndarray, codes: pd.DataFrame,
                   axes: list[str]) -> tuple[float, str]:
    """Jiang et al.'s CMI score and the conditioning set that attains its minimum (see module doc).

    Pairs with equal gaps carry no ordering to predict and are dropped; a tie in the measure is its own
    outcome of V_μ (a measure that cannot tell two runs apart has failed to predict their order).
    """
    measure = np.asarray(measure, dtype=float)
    gap = np.asarray(gap, dtype=float)
    n = len(measure)
    if len(axes) < 2 or n < 2:
        return math.nan, ""
    size = 2 if len(axes) >= 3 else 1
    int_codes = {a: pd.factorize(codes[a])[0].astype(np.int64) for a in axes}
    cardinality = {a: int(int_codes[a].max()) + 1 for a in axes}
    best, best_set = math.inf, ""
    for subset in itertools.combinations(axes, size):
        n_cells = int(np.prod([cardinality[a] ** 2 for a in subset]))
        counts = np.zeros(n_cells * 6, dtype=np.int64)
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(n, 1))
        for start in range(0, n, rows_per_chunk):
            i = np.arange(start, min(n, start + rows_per_chunk))[:, None]
            j = np.arange(n)[None, :]
            i, j = np.broadcast_arrays(i, j)
            keep = i != j
            i, j = i[keep], j[keep]
            vg = np.sign(gap[i] - gap[j])
            untied = vg != 0
            i, j, vg = i[untied], j[untied], vg[untied]
            vm = np.sign(measure[i] - measure[j]).astype(np.int64) + 1
            cell = np.zeros(len(i), dtype=np.int64)
            for a in subset:
                k = cardinality[a]
                cell = cell * k * k + int_codes[a][i] * k + int_codes[a][j]
            code = (cell * 2 + (vg > 0)) * 3 + vm
            counts += np.bincount(code, minlength=n_cells * 6)
        table = counts.reshape(n_cells, 2, 3).astype(float)
        per_cell = table.sum(axis=(1, 2))
        total = per_cell.sum()
        if total == 0:
            continue
        weight = per_cell / total
        h_g = _entropy(table.sum(axis=2))
        h_m = _entropy(table.sum(axis=1))
        h_joint = _entropy(table.reshape(n_cells, 6))
        mi = np.maximum(h_g + h_m - h_joint, 0.0)
        cond_h = float((weight * h_g).sum())
        if cond_h <= 0:
            continue
        score = float((weight * mi).sum()) / cond_h
        if score < best:
            best, best_set = score, "+".join(subset)
    return (best if math.isfinite(best) else math.nan), best_set


# ------------------------------------------------------------------------------------------- exclusions

def gap_column(gap: str) -> str:
    if gap not in ("acc", "loss"):
        raise ValueError(f"gap must be 'acc' or 'loss', got {gap!r}")
    return f"gap_{gap}"


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
        train_acc = _num(row.get("train_acc"))
        if not math.isfinite(train_acc):
            why.append("no train accuracy recorded")
        elif train_acc < min_train_acc:
            why.append(f"did not train: train accuracy {train_acc:.3f} < {min_train_acc:.3f}")
        bad = [c for c in ("train_loss", "test_loss") if not math.isfinite(_num(row.get(c)))]
        if bad:
            why.append("non-finite loss (" + ", ".join(f"{c}={_num(row.get(c))}" for c in bad) + ")")
        if not bad and not math.isfinite(_num(row.get(gcol))):
            why.append(f"non-finite {gcol}")
        reasons.append("; ".join(why))
    return pd.Series(reasons, index=table.index, dtype=object)


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


# ------------------------------------------------------------------------------------------- the analysis

@dataclass
class Analysis:
    """Everything the report needs from the statistics, computed once."""

    correlations: pd.DataFrame
    """One row per headline measure, best Kendall τ first (columns: see `correlations`)."""
    included: pd.DataFrame
    """The table rows used in the statistics."""
    excluded: pd.DataFrame
    """run_id, experiment, status, reason of every run left out."""
    axes: list[str]
    """Hyperparameter axes that vary among the included runs (granulated Kendall / CMI)."""
    gap: str
    gap_column: str
    larger_is_sharper: dict[str, bool]
    notes: list[str] = field(default_factory=list)


def analyze(table: pd.DataFrame, gap: str = "acc", min_train_acc: float = 0.0, n_boot: int = 1000,
            seed: int = 0, axes: list[str] | None = None) -> Analysis:
    """Exclusions, then every statistic for every headline measure (see the module docstring)."""
    gcol = gap_column(gap)
    notes: list[str] = []
    measures = headline_columns(table)
    all_axes = list(axes) if axes is not None else sweep_axes(table)
    reasons = exclusion_reasons(table, gap, min_train_acc) if len(table) else pd.Series([], dtype=object)
    keep = (reasons == "").to_numpy() if len(table) else np.zeros(0, dtype=bool)
    included = table[keep]
    excluded = pd.DataFrame({
        "run_id": table["run_id"][~keep].to_numpy() if len(table) else [],
        "experiment": table["experiment"][~keep].to_numpy() if len(table) else [],
        "status": table["status"][~keep].to_numpy() if len(table) else [],
        "reason": reasons[~keep].to_numpy() if len(table) else [],
    })
    used_axes = [a for a in all_axes if a in included.columns
                 and included[a].map(_axis_text).nunique() > 1]
    flip = directions(measures, notes)

    if len(included) < MIN_RUNS:
        notes.append(f"correlations need at least {MIN_RUNS} trained runs; {len(included)} "
                     f"{'is' if len(included) == 1 else 'are'} available")
    if len(used_axes) < 2:
        notes.append("the conditional mutual information score needs at least two varying hyperparameter "
                     f"axes; {'only ' + used_axes[0] + ' varies' if used_axes else 'none varies'}")
    elif len(used_axes) == 2:
        notes.append("only two axes vary, so the CMI score conditions on one axis at a time "
                     "(conditioning on both would leave nothing to explain)")

    gap_values = included[gcol].to_numpy(dtype=float) if len(included) else np.zeros(0)
    codes = _axis_codes(included, used_axes)
    rows = []
    for key in measures:
        rows.append(_measure_row(key, included, gap_values, codes, used_axes, flip[key], n_boot, seed))
    columns = ["measure", "larger_is_sharper", "n", "n_missing"]
    for stat in STATISTICS:
        columns += [stat, f"{stat}_lo", f"{stat}_hi"]
    columns += ["psi", *[f"psi_{a}" for a in used_axes], "cmi", "cmi_condition", "note"]
    corr = pd.DataFrame(rows, columns=columns)
    if len(corr):
        corr = corr.sort_values(["kendall_tau", "measure"], ascending=[False, True], na_position="last",
                                kind="mergesort").reset_index(drop=True)
    corr.attrs.update({"gap": gap, "gap_column": gcol, "axes": list(used_axes), "notes": list(notes),
                       "excluded": excluded.to_dict(orient="records"), "n_included": len(included)})
    return Analysis(correlations=corr, included=included, excluded=excluded, axes=used_axes, gap=gap,
                    gap_column=gcol, larger_is_sharper=flip, notes=notes)


def _measure_row(key: str, included: pd.DataFrame, gap_values: np.ndarray, codes: pd.DataFrame,
                 axes: list[str], larger_is_sharper: bool, n_boot: int, seed: int) -> dict[str, Any]:
    raw = included[key].to_numpy(dtype=float) if len(included) else np.zeros(0)
    ok = np.isfinite(raw) & np.isfinite(gap_values)
    values = (raw if larger_is_sharper else -raw)[ok]
    gap = gap_values[ok]
    row: dict[str, Any] = {"measure": key, "larger_is_sharper": larger_is_sharper, "n": int(ok.sum()),
                           "n_missing": int(len(raw) - ok.sum())}
    for stat in STATISTICS:
        row[stat] = row[f"{stat}_lo"] = row[f"{stat}_hi"] = math.nan
    row["psi"] = row["cmi"] = math.nan
    row["cmi_condition"] = ""
    for axis in axes:
        row[f"psi_{axis}"] = math.nan
    note = []
    if row["n"] == 0:
        note.append("no value on any run" if len(raw) else "no runs")
    elif row["n"] < MIN_RUNS:
        note.append(f"only {row['n']} run(s) with a value" if len(raw) >= MIN_RUNS else "too few runs")
    elif np.ptp(values) == 0:
        note.append("constant across runs")
    elif np.ptp(gap) == 0:
        note.append("the gap is constant across these runs")
    else:
        for stat, fn in STATISTICS.items():
            row[stat] = float(fn(values[None, :], gap[None, :])[0])
            row[f"{stat}_lo"], row[f"{stat}_hi"] = bootstrap_ci(values, gap, fn, n_boot=n_boot, seed=seed)
        if axes:
            sub = codes[ok]
            row["psi"], per_axis = granulated_kendall(values, gap, sub, axes)
            for axis, value in per_axis.items():
                row[f"psi_{axis}"] = value
            row["cmi"], row["cmi_condition"] = conditional_mi(values, gap, sub, axes)
    if row["n_missing"] and row["n"]:
        note.append(f"no value on {row['n_missing']} run(s)")
    if not larger_is_sharper:
        note.append("sign flipped (smaller = sharper)")
    row["note"] = "; ".join(note)
    return row


def correlations(table: pd.DataFrame, gap: str = "acc", min_train_acc: float = 0.0, n_boot: int = 1000,
                 seed: int = 0) -> pd.DataFrame:
    """Per headline measure: τ/ρ/r with 95% bootstrap CIs, n, Ψ with per-axis ψ, CMI; best τ first.

    The frame's `attrs` carry the excluded runs with their reasons (`attrs["excluded"]`), the axes used
    and the notes (e.g. why CMI is missing); `analyze` returns the same as a structured `Analysis`.
    """
    return analyze(table, gap=gap, min_train_acc=min_train_acc, n_boot=n_boot, seed=seed).correlations


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
