"""Correlation statistics: agreement with scipy, granulated Kendall by hand, bootstrap, direction, CMI,
the exclusion rules, permutation p-values, the small-n interval rule, paired comparisons between
measures and Monte-Carlo standard errors."""

from __future__ import annotations

import itertools
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from flatbench.analysis.stats import (
    MIN_CI_RUNS,
    SE_NOTE_RATIO,
    analyze,
    bootstrap_ci,
    bootstrap_pvalue,
    conditional_mi,
    exclusion_reasons,
    granulated_kendall,
    holm,
    kendall_batch,
    kendall_permutation_p,
    kendall_permutation_pvalues,
    kendall_tau_a,
    paired_comparisons,
    pearson_batch,
    spearman_batch,
)
from flatbench.analysis.stats import N_BOOT, N_PERM
from flatbench.analysis.table import build_table, headline_columns, measure_columns, stderr_columns


def correlations(table: pd.DataFrame, gap: str = "acc", min_train_acc: float = 0.0, n_boot: int = N_BOOT,
                 seed: int = 0, n_perm: int = N_PERM) -> pd.DataFrame:
    """`analyze(...).correlations`, the per-measure frame these tests read (its attrs: exclusions, notes)."""
    return analyze(table, gap=gap, min_train_acc=min_train_acc, n_boot=n_boot, seed=seed,
                   n_perm=n_perm).correlations


def make_table(gap, measures: dict, ratios=None, seeds=None, **overrides) -> pd.DataFrame:
    """A minimal report table: finished, well-trained runs with the given gaps and measure values."""
    n = len(gap)
    ratios = list(ratios) if ratios is not None else list(np.linspace(0, 1, n))
    seeds = list(seeds) if seeds is not None else [0] * n
    data = {"run_id": [f"run{i}" for i in range(n)], "experiment": ["exp"] * n, "status": ["finished"] * n,
            "seed": seeds, "data.random_label_ratio": ratios, "model.name": ["mlp"] * n,
            "train_acc": [1.0] * n, "train_loss": [0.01] * n, "test_acc": [1.0 - g for g in gap],
            "test_loss": [1.0] * n, "gap_acc": list(gap), "gap_loss": [0.99] * n}
    data.update(overrides)
    data.update(measures)
    table = pd.DataFrame(data)
    table.attrs["measure_columns"] = list(measures)
    table.attrs["sweep_axes"] = [a for a in ("data.random_label_ratio", "seed")
                                 if len(set(map(str, table[a]))) > 1]
    return table


@pytest.fixture
def no_registry():
    """Every measure reads as larger = sharper unless the table records otherwise (analysis never reads the
    registry: a measure's direction comes from its measures.json entries, via the table's attrs)."""


# Fixed data with ties in both variables (ties are where τ-a, τ-b and rank averaging differ).
X = np.array([3.1, 1.2, 4.4, 1.2, 5.0, 9.3, 2.6, 5.0, 3.5, 8.9, 7.9, 3.2])
Y = np.array([2.0, 1.0, 3.0, 1.5, 2.0, 6.0, 2.5, 4.0, 3.3, 5.0, 7.0, 1.9])


def test_point_estimates_match_scipy():
    assert kendall_batch(X, Y)[0] == pytest.approx(sps.kendalltau(X, Y).statistic, abs=1e-12)
    assert spearman_batch(X, Y)[0] == pytest.approx(sps.spearmanr(X, Y).statistic, abs=1e-12)
    assert pearson_batch(X, Y)[0] == pytest.approx(sps.pearsonr(X, Y).statistic, abs=1e-12)
    # The large-n path (scipy's O(n log n) τ per resample) agrees with the pairwise one.
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(size=450), 1)
    y = x + rng.normal(size=450)
    assert kendall_batch(x, y)[0] == pytest.approx(sps.kendalltau(x, y).statistic, abs=1e-12)


def test_correlations_table_matches_scipy(no_registry):
    table = make_table(Y, {"m": X})
    row = correlations(table, n_boot=50).set_index("measure").loc["m"]
    assert row["n"] == len(X)
    assert row["kendall_tau"] == pytest.approx(sps.kendalltau(X, Y).statistic)
    assert row["spearman_rho"] == pytest.approx(sps.spearmanr(X, Y).statistic)
    assert row["pearson_r"] == pytest.approx(sps.pearsonr(X, Y).statistic)


def test_granulated_kendall_hand_worked():
    # Axes: ratio ∈ {0, 0.5, 1} × seed ∈ {0, 1}.
    #   seed 0: gap 0.1 0.4 0.7, measure 1 3 2;   seed 1: gap 0.2 0.3 0.8, measure 2 1 3.
    # ψ_ratio: groups = seeds. seed 0 pairs (0,.5) +·+ = +1, (0,1) +·+ = +1, (.5,1) +·− = −1 → 1/3;
    #          seed 1: (0,.5) +·− = −1, (0,1) +1, (.5,1) +1 → 1/3.  ψ_ratio = 1/3.
    # ψ_seed: groups = ratios, one pair each: r=0 (+,+) = +1; r=.5 (−,−) = +1; r=1 (+,+) = +1 → 1.
    # Ψ = (1/3 + 1) / 2 = 2/3.
    ratio = [0, 0.5, 1, 0, 0.5, 1]
    seed = [0, 0, 0, 1, 1, 1]
    gap = np.array([0.1, 0.4, 0.7, 0.2, 0.3, 0.8])
    measure = np.array([1.0, 3.0, 2.0, 2.0, 1.0, 3.0])
    codes = pd.DataFrame({"ratio": [str(r) for r in ratio], "seed": [str(s) for s in seed]})
    psi, per_axis = granulated_kendall(measure, gap, codes, ["ratio", "seed"])
    assert per_axis["ratio"] == pytest.approx(1 / 3)
    assert per_axis["seed"] == pytest.approx(1.0)
    assert psi == pytest.approx(2 / 3)

    # Drop run (ratio 1, seed 1): seed-1 group is now {0, .5}: −1, so ψ_ratio = (1/3 − 1)/2 = −1/3;
    # the ratio-1 group has a single run and is skipped, so ψ_seed stays 1; Ψ = (−1/3 + 1)/2 = 1/3.
    keep = np.arange(5)
    psi, per_axis = granulated_kendall(measure[keep], gap[keep], codes.iloc[keep].reset_index(drop=True),
                                       ["ratio", "seed"])
    assert per_axis["ratio"] == pytest.approx(-1 / 3)
    assert per_axis["seed"] == pytest.approx(1.0)
    assert psi == pytest.approx(1 / 3)


def test_granulated_kendall_through_correlations(no_registry):
    # The seed is a replicate, never an axis: ψ_ratio is computed within each seed, and there is no psi_seed.
    # The ratio is a data axis: psi_data is its ψ, and Ψ (over the training axes, none here) is NaN.
    table = make_table([0.1, 0.4, 0.7, 0.2, 0.3, 0.8], {"m": [1.0, 3.0, 2.0, 2.0, 1.0, 3.0]},
                       ratios=[0, 0.5, 1, 0, 0.5, 1], seeds=[0, 0, 0, 1, 1, 1])
    corr = correlations(table, n_boot=0)
    row = corr.iloc[0]
    assert row["psi_data.random_label_ratio"] == pytest.approx(1 / 3)
    assert row["psi_data"] == pytest.approx(1 / 3) and math.isnan(row["psi"])
    assert "psi_seed" not in corr.columns


def test_kendall_tau_a_counts_ties_as_zero():
    # pairs: (1,2) tied in x → 0; (1,3) +·+ = 1; (2,3) +·+ = 1 → 2/3 (τ-b would give 2/√6).
    assert kendall_tau_a(np.array([1.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(2 / 3)


def test_bootstrap_is_deterministic_and_covers_estimate():
    for fn in (kendall_batch, spearman_batch, pearson_batch):
        a = bootstrap_ci(X, Y, fn, n_boot=500, seed=7)
        b = bootstrap_ci(X, Y, fn, n_boot=500, seed=7)
        c = bootstrap_ci(X, Y, fn, n_boot=500, seed=8)
        assert a == b
        assert a != c
        estimate = fn(X, Y)[0]
        assert a[0] <= estimate <= a[1]
        assert -1.0 <= a[0] < a[1] <= 1.0


def test_correlations_ci_reproducible(no_registry):
    table = make_table(Y, {"m": X, "k": X[::-1].copy()})
    first = correlations(table, n_boot=300, seed=3)
    second = correlations(table, n_boot=300, seed=3)
    pd.testing.assert_frame_equal(first, second)
    for _, row in first.iterrows():
        for stat in ("kendall_tau", "spearman_rho", "pearson_r"):
            assert row[f"{stat}_lo"] <= row[stat] <= row[f"{stat}_hi"]


def test_direction_flip():
    gap = np.linspace(0.0, 0.8, 6)
    table = make_table(gap, {"flat": -gap + 3, "flat@normalized_ce": 1 / (1 + gap), "sharp": gap * 2,
                             "unregistered": gap ** 2})
    table.attrs["directions"] = {"flat": False, "flat@normalized_ce": False, "sharp": True}
    corr = correlations(table, n_boot=0).set_index("measure")
    assert not corr.loc["flat", "larger_is_sharper"]
    assert not corr.loc["flat@normalized_ce", "larger_is_sharper"]
    assert corr.loc["unregistered", "larger_is_sharper"]
    for key in ("flat", "flat@normalized_ce", "sharp", "unregistered"):
        assert corr.loc[key, "kendall_tau"] == pytest.approx(1.0)
        assert corr.loc[key, "pearson_r"] > 0.9
    assert "sign flipped" in corr.loc["flat", "note"]


def test_exclusion_rules(no_registry):
    gap = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    table = make_table(gap, {"m": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]})
    table.loc[1, "status"] = "running"
    table.loc[2, "status"] = "failed"
    table.loc[3, "train_acc"] = 0.2
    table.loc[4, "train_loss"] = math.nan
    table.loc[5, "test_loss"] = math.inf
    reasons = exclusion_reasons(table, "acc", min_train_acc=0.9)
    assert reasons[0] == ""
    assert "running" in reasons[1]
    assert "failed" in reasons[2]
    assert "train accuracy 0.200 < 0.900" in reasons[3]
    assert "non-finite loss" in reasons[4] and "train_loss" in reasons[4]
    assert "non-finite loss" in reasons[5] and "test_loss" in reasons[5]
    assert reasons[6] == ""
    # Without a threshold the low-accuracy run counts again.
    assert exclusion_reasons(table, "acc", min_train_acc=0.0)[3] == ""

    result = analyze(table, min_train_acc=0.9, n_boot=0)
    assert set(result.excluded["run_id"]) == {"run1", "run2", "run3", "run4", "run5"}
    assert list(result.included["run_id"]) == ["run0", "run6"]
    corr = result.correlations
    assert corr.loc[0, "n"] == 2 and math.isnan(corr.loc[0, "kendall_tau"])
    assert any("at least 3" in n for n in result.notes)
    assert {e["run_id"] for e in corr.attrs["excluded"]} == set(result.excluded["run_id"])


def test_missing_values_give_their_n(no_registry):
    gap = np.linspace(0, 1, 8)
    partial = gap.copy()
    partial[[1, 4]] = np.nan
    table = make_table(gap, {"partial": partial, "failed": [np.nan] * 8})
    corr = correlations(table, n_boot=0).set_index("measure")
    assert corr.loc["partial", "n"] == 6 and corr.loc["partial", "n_missing"] == 2
    assert corr.loc["partial", "kendall_tau"] == pytest.approx(1.0)
    assert corr.loc["failed", "n"] == 0 and math.isnan(corr.loc["failed", "kendall_tau"])
    assert list(corr.index)[-1] == "failed"  # undefined correlations sort last


def test_constant_measure_is_nan_without_warnings(no_registry):
    gap = np.linspace(0, 1, 8)
    table = make_table(gap, {"const": [2.0] * 8, "good": gap})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        corr = correlations(table, n_boot=100).set_index("measure")
    for col in ("kendall_tau", "spearman_rho", "pearson_r", "kendall_tau_lo", "psi"):
        assert math.isnan(corr.loc["const", col])
    assert "constant" in corr.loc["const", "note"]
    assert corr.loc["good", "kendall_tau"] == pytest.approx(1.0)


def test_cmi_definition():
    ratios = np.repeat([0.0, 0.25, 0.5, 0.75, 1.0], 3)
    seeds = np.tile([0, 1, 2], 5)
    rng = np.random.default_rng(0)
    gap = ratios * 0.8 + rng.normal(0, 0.05, len(ratios))
    codes = pd.DataFrame({"r": ratios.astype(str), "s": seeds.astype(str)})
    # Three seeds per ratio: conditioning on r leaves cells of 3 pairs: too few, so n/a with the reason.
    result = conditional_mi(gap * 3 + 1, gap, codes, ["r"])
    assert math.isnan(result.score) and result.min_pairs == 3 and "fewer than 10" in result.reason
    # With the rule relaxed the definitions show: the gap itself carries everything, a measure that knows
    # only the ratio says nothing once the ratio is known.
    assert conditional_mi(gap * 3 + 1, gap, codes, ["r"], min_pairs=1).score == pytest.approx(1.0)
    only_ratio = conditional_mi(ratios, gap, codes, ["r"], min_pairs=1)
    assert only_ratio.score == pytest.approx(0.0, abs=1e-12) and only_ratio.condition == "r"
    # No hyperparameter axis: not defined.
    assert math.isnan(conditional_mi(gap, gap, codes, []).score)


def _cmi_brute_force(measure, gap, values):
    """Jiang et al.'s score from its definition, pair by pair with dictionaries, for one axis {r} and the
    empty set (the minimum of the two)."""
    scores = []
    for cond in (False, True):
        cells: dict = {}
        for i in range(len(gap)):
            for j in range(len(gap)):
                if i == j or gap[i] == gap[j]:
                    continue
                key = (values[i], values[j]) if cond else ()
                vg, vm = gap[i] > gap[j], int(np.sign(measure[i] - measure[j]))
                cells.setdefault(key, []).append((vg, vm))
        total = sum(len(v) for v in cells.values())
        mi = h = 0.0
        for pairs in cells.values():
            w = len(pairs) / total
            joint = pd.Series(pairs).value_counts(normalize=True)
            pg = pd.Series([p[0] for p in pairs]).value_counts(normalize=True)
            pm = pd.Series([p[1] for p in pairs]).value_counts(normalize=True)
            h += w * sps.entropy(pg.to_numpy(), base=2)
            mi += w * sum(pj * math.log2(pj / (pg[k[0]] * pm[k[1]])) for k, pj in joint.items())
        if h > 1e-12:
            scores.append(mi / h)
    return min(scores)


def test_cmi_noise_gap_and_ratio_only():
    """The issue's three cases, on a design with cells big enough (8 ratios x 12 seeds: 66 pairs per cell)."""
    rng = np.random.default_rng(1)
    ratios = np.repeat(np.linspace(0, 1, 8), 12)
    gap = ratios * 0.8 + rng.normal(0, 0.05, len(ratios))
    codes = pd.DataFrame({"r": ratios.astype(str)})
    noise = conditional_mi(rng.normal(size=len(gap)), gap, codes, ["r"])
    assert noise.score < 0.05 and noise.min_pairs >= 10
    assert conditional_mi(gap, gap, codes, ["r"]).score == pytest.approx(1.0)
    only_ratio = conditional_mi(ratios + 1e-9 * rng.normal(size=len(gap)), gap, codes, ["r"])
    assert only_ratio.score < 0.05 and only_ratio.condition == "r"
    # Tracking the ratio without conditioning scores high: the low score comes from the conditioning.
    assert only_ratio.per_set["none"] > 0.3
    # Brute force from the definition agrees.
    m = gap + rng.normal(0, 0.05, len(gap))
    assert conditional_mi(m, gap, codes, ["r"]).score == pytest.approx(_cmi_brute_force(m, gap, ratios), abs=1e-12)


def test_cmi_two_seeds_is_na(no_registry):
    """Two seeds per ratio: one pair per cell, where the plug-in score would be 1 for anything. The seeds are
    initializations within one data draw: CMI's pairs are pairs of one draw (issue 42), and two data draws
    would leave the replicate pairs out."""
    ratios = np.repeat(np.linspace(0, 1, 6), 2)
    seeds = np.tile([0, 1], 6)
    rng = np.random.default_rng(2)
    gap = ratios * 0.8 + rng.normal(0, 0.05, 12)
    codes = pd.DataFrame({"r": ratios.astype(str)})
    relaxed = conditional_mi(rng.normal(size=12), gap, codes, ["r"], min_pairs=1)
    assert relaxed.per_set["r"] > 0.5  # the degenerate plug-in value the rule protects against
    table = make_table(gap, {"noise": rng.normal(size=12)}, ratios=ratios, seeds=seeds, **{"data.seed": [7] * 12})
    result = analyze(table, n_boot=0)
    assert result.axes == ["data.random_label_ratio"]
    row = result.correlations.iloc[0]
    assert math.isnan(row["cmi"]) and row["cmi_min_pairs"] == 1 and "CMI n/a" in row["note"]
    assert any("CMI is n/a" in n for n in result.notes)


def test_no_hyperparameter_axis_note(no_registry):
    gap = np.linspace(0, 1, 6)
    table = make_table(gap, {"m": gap}, ratios=[0.5] * 6, seeds=range(6))
    result = analyze(table, n_boot=0)
    assert result.axes == [] and result.replicate == "seed"
    assert math.isnan(result.correlations.loc[0, "psi"]) and math.isnan(result.correlations.loc[0, "cmi"])
    assert any("no axis varies" in n for n in result.notes)


def test_best_measure_first(no_registry):
    gap = np.linspace(0, 1, 10)
    rng = np.random.default_rng(1)
    table = make_table(gap, {"noise": rng.normal(size=10), "good": gap + rng.normal(0, 0.01, 10),
                             "anti": -gap})
    order = list(correlations(table, n_boot=0)["measure"])
    assert order[0] == "good" and order[-1] == "anti"


def test_bad_gap_name():
    from flatbench.errors import ConfigError

    with pytest.raises(ConfigError, match="gap must be one of acc, loss, calibrated"):
        correlations(make_table([0.1, 0.2, 0.3], {"m": [1.0, 2.0, 3.0]}), gap="accuracy")


# ------------------------------------------------------------------------------- bootstrap, pinned exactly

@pytest.mark.parametrize("fn", [kendall_batch, spearman_batch])
def test_bootstrap_ci_is_the_documented_percentile_interval(fn):
    # Resamples drawn explicitly with the documented seed convention: a 90% interval labelled 95%, or
    # indices that never reach the last run, give different numbers.
    n, n_boot, seed = len(X), 400, 5
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    values = fn(X[idx], Y[idx])
    values = values[np.isfinite(values)]
    expected = np.quantile(values, [0.025, 0.975])
    lo, hi = bootstrap_ci(X, Y, fn, n_boot=n_boot, seed=seed)
    assert (lo, hi) == (pytest.approx(expected[0], abs=1e-12), pytest.approx(expected[1], abs=1e-12))
    # The mutants the check above must catch really are different.
    assert not np.allclose(expected, np.quantile(values, [0.05, 0.95]))
    short = np.random.default_rng(seed).integers(0, n - 1, size=(n_boot, n))
    wrong = fn(X[short], Y[short])
    assert not np.allclose(expected, np.quantile(wrong[np.isfinite(wrong)], [0.025, 0.975]))


def test_kendall_batch_matches_scipy_on_resamples():
    idx = np.random.default_rng(0).integers(0, len(X), size=(50, len(X)))
    ours = kendall_batch(X[idx], Y[idx])
    for row, tau in zip(idx, ours):
        ref = sps.kendalltau(X[row], Y[row]).statistic
        assert (math.isnan(tau) and math.isnan(ref)) or tau == pytest.approx(ref, abs=1e-12)
    assert math.isnan(kendall_batch(np.array([1.0, np.nan, 2.0]), np.array([1.0, 2.0, 3.0]))[0])


# ----------------------------------------------------------------------------------- permutation p-values

def _brute_force_p(x, y):
    """Two-sided exact permutation p of τ-b: the share of all n! orders of y whose |C − D| reaches the
    observed one (the τ-b denominator is the same for every order, so this is |τ| ≥ |τ observed|)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = np.triu_indices(len(x), 1)
    sx = np.sign(x[i] - x[j])
    s_obs = abs(np.sum(sx * np.sign(y[i] - y[j])))
    perms = np.array(list(itertools.permutations(range(len(y)))))
    yp = y[perms]
    s = np.abs((sx * np.sign(yp[:, i] - yp[:, j])).sum(axis=1))
    return np.count_nonzero(s >= s_obs) / len(perms)


def test_exact_permutation_p_matches_brute_force():
    rng = np.random.default_rng(3)
    for n in (4, 6, 7):
        x = np.round(rng.normal(size=n), 0)  # ties in the measure
        y = x + rng.normal(size=n)
        y[0] = y[1]  # and a tie in the gap
        assert kendall_permutation_p(x, y) == pytest.approx(_brute_force_p(x, y), abs=1e-12)
    # The brute force's statistic is τ-b's: its extreme orders reach scipy's |τ| = 1 exactly twice.
    assert _brute_force_p(np.arange(5.0), np.arange(5.0)) == 2 / 120


def test_perfectly_monotone_five_runs_exact_p():
    x = np.arange(5.0)
    # Of the 120 orders of the gap, exactly two (identity and reversal) reach |τ| = 1.
    assert kendall_permutation_p(x, x * 2 + 1) == pytest.approx(2 / 120)
    assert kendall_permutation_p(x, -x) == pytest.approx(2 / 120)
    swapped = np.array([0.0, 2, 1, 4, 3])
    assert kendall_permutation_p(x, swapped) == pytest.approx(_brute_force_p(x, swapped))


def test_monte_carlo_p_is_the_documented_count():
    rng = np.random.default_rng(4)
    n, m, seed = 12, 999, 9
    x = np.round(rng.normal(size=n), 0)  # ties: neither enumerable (12! > 999) nor scipy-exact
    y = 0.4 * x + rng.normal(size=n)
    perms = np.random.default_rng(seed).permuted(np.tile(np.arange(n), (m, 1)), axis=1)
    t_obs = abs(kendall_batch(x, y)[0])
    taus = kendall_batch(np.tile(x, (m, 1)), y[perms])
    b = int((np.abs(taus) >= t_obs - 1e-12).sum())
    p = kendall_permutation_p(x, y, n_perm=m, seed=seed)
    assert p == pytest.approx((b + 1) / (m + 1), abs=1e-15)
    assert p == kendall_permutation_p(x, y, n_perm=m, seed=seed)
    assert p != kendall_permutation_p(x, y, n_perm=m, seed=seed + 1)


@pytest.mark.parametrize("n, strength", [(25, 0.45), (60, 0.25)])
def test_permutation_p_agrees_with_scipy(n, strength):
    rng = np.random.default_rng(n)
    x = rng.normal(size=n)
    y = strength * x + rng.normal(size=n)
    ours = kendall_permutation_p(x, y, n_perm=9999, seed=0)
    ref = sps.kendalltau(x, y).pvalue  # exact for n = 25 without ties, normal approximation for 60
    assert 0.001 < ref < 0.5
    assert ours == pytest.approx(ref, rel=0.15, abs=0.005)


def test_permutation_p_rows_and_undefined_cases():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 15))
    y = rng.normal(size=15)
    x[1] = 2.0  # constant row
    together = kendall_permutation_pvalues(x, y, n_perm=500, seed=1)
    assert math.isnan(together[1])
    for i in (0, 2):  # testing rows together changes nothing
        assert together[i] == kendall_permutation_p(x[i], y, n_perm=500, seed=1)
    assert np.isnan(kendall_permutation_pvalues(x, np.ones(15))).all()
    assert math.isnan(kendall_permutation_p(x[0], y, n_perm=0))


# --------------------------------------------------------------------------------------- interval rule

def test_five_monotone_runs_give_no_interval_but_a_p_value(no_registry):
    gap = np.linspace(0.1, 0.9, 5)
    result = analyze(make_table(gap, {"m": gap * 3, "noisy": [0.3, 0.1, 0.5, 0.2, 0.4]}), n_boot=200)
    row = result.correlations.set_index("measure").loc["m"]
    assert row["kendall_tau"] == pytest.approx(1.0)
    for stat in ("kendall_tau", "spearman_rho", "pearson_r"):
        assert math.isnan(row[f"{stat}_lo"]) and math.isnan(row[f"{stat}_hi"])
    assert row["kendall_p"] == pytest.approx(2 / 120)
    assert f"n < {MIN_CI_RUNS}: no interval; see the p-value" in row["note"]
    assert row["vs_best"] == "best"
    # With 5 runs no measure can be compared with the best one: "cannot compare", not "indistinguishable".
    assert result.correlations.set_index("measure").loc["noisy", "vs_best"] == "cannot compare"
    assert any("no bootstrap interval" in n for n in result.notes)


def test_interval_from_min_ci_runs_on(no_registry):
    rng = np.random.default_rng(6)
    for n, has_ci in ((MIN_CI_RUNS - 1, False), (MIN_CI_RUNS, True)):
        gap = rng.uniform(0, 1, n)
        row = correlations(make_table(gap, {"m": gap + rng.normal(0, 0.3, n)}), n_boot=200).iloc[0]
        assert math.isfinite(row["kendall_tau"]) and math.isfinite(row["kendall_p"])
        assert math.isfinite(row["kendall_tau_lo"]) == has_ci
        assert math.isfinite(row["pearson_r_hi"]) == has_ci
        assert ("no interval" in row["note"]) != has_ci
    # A perfectly ordered larger sample: the bootstrap collapses to a point, and the note says so.
    gap = np.linspace(0, 1, 12)
    row = correlations(make_table(gap, {"m": gap}), n_boot=200).iloc[0]
    assert row["kendall_tau_lo"] == row["kendall_tau_hi"] == 1.0
    assert "collapsed to a point" in row["note"]


def test_kendall_p_is_seeded_and_in_the_frame(no_registry):
    rng = np.random.default_rng(7)
    gap = rng.uniform(0, 1, 14)
    table = make_table(gap, {"m": gap + rng.normal(0, 0.5, 14)})
    a = correlations(table, n_boot=50, seed=1, n_perm=999).iloc[0]
    b = correlations(table, n_boot=50, seed=1, n_perm=999).iloc[0]
    assert a["kendall_p"] == b["kendall_p"]
    values = table["m"].to_numpy()
    assert a["kendall_p"] == kendall_permutation_p(values, gap, n_perm=999, seed=1)


# --------------------------------------------------------------------------------- paired comparisons

def _frame(gap, **measures):
    return pd.DataFrame({"gap_acc": gap, **measures})


def test_identical_measures_compare_equal():
    rng = np.random.default_rng(8)
    gap = rng.uniform(0, 1, 20)
    m = gap + rng.normal(0, 0.3, 20)
    out = paired_comparisons(_frame(gap, a=m, b=m.copy()), ["a", "b"], "gap_acc", n_boot=300, seed=0)
    assert len(out) == 2
    for row in out.itertuples():
        assert row.diff == 0.0 and row.diff_lo == 0.0 and row.diff_hi == 0.0 and row.p_value == 1.0
        assert row.n == 20


def test_gap_beats_noise():
    rng = np.random.default_rng(9)
    gap = rng.uniform(0, 1, 30)
    frame = _frame(gap, good=gap * 2 + 1, noise=rng.normal(size=30))
    out = paired_comparisons(frame, ["good", "noise"], "gap_acc", n_boot=500, seed=0).set_index(
        ["measure_a", "measure_b"])
    ab, ba = out.loc[("good", "noise")], out.loc[("noise", "good")]
    assert ab["tau_a"] == pytest.approx(1.0)
    assert ab["diff"] > 0.5 and ab["diff_lo"] > 0 and ab["p_value"] < 0.01
    assert ba["diff"] == -ab["diff"] and ba["diff_hi"] < 0 and ba["p_value"] == ab["p_value"]


def test_paired_bootstrap_is_the_documented_one():
    # Without cells and draws (every run its own configuration, one draw: the plain bootstrap) the resamples
    # are the bootstrap_ci convention over the runs where both measures and the gap are finite, the same for
    # both measures; p is the Wald p with sd(d*), p_boot the tail count. Smaller-is-sharper: negated.
    rng = np.random.default_rng(10)
    n_all, n_boot, seed = 26, 300, 11
    gap = rng.uniform(0, 1, n_all)
    a = gap + rng.normal(0, 0.2, n_all)
    b = -gap + rng.normal(0, 0.4, n_all)  # smaller = sharper
    a[[2, 5]] = np.nan
    b[[5, 9, 17]] = np.nan
    out = paired_comparisons(_frame(gap, a=a, b=b), ["a", "b"], "gap_acc", {"a": True, "b": False},
                             n_boot=n_boot, seed=seed).set_index(["measure_a", "measure_b"])
    row = out.loc[("a", "b")]
    mask = np.isfinite(a) & np.isfinite(b)
    n = int(mask.sum())
    assert row["n"] == n == n_all - 4
    ga, va, vb = gap[mask], a[mask], -b[mask]
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    diff = sps.kendalltau(va, ga).statistic - sps.kendalltau(vb, ga).statistic
    raw = kendall_batch(va[idx], ga[idx]) - kendall_batch(vb[idx], ga[idx])
    d = raw[np.isfinite(raw)]
    lo, hi = np.quantile(d, [0.025, 0.975])
    assert row["tau_a"] == pytest.approx(sps.kendalltau(va, ga).statistic)
    assert row["tau_b"] == pytest.approx(sps.kendalltau(vb, ga).statistic)
    assert row["diff"] == pytest.approx(diff)
    assert (row["diff_lo"], row["diff_hi"]) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    assert row["diff_se"] == pytest.approx(np.std(d, ddof=1), rel=1e-12)
    assert row["p_value"] == pytest.approx(2 * sps.norm.sf(abs(diff) / np.std(d, ddof=1)), rel=1e-9)
    assert row["p_boot"] == pytest.approx(bootstrap_pvalue(d), abs=1e-12)
    mirror = out.loc[("b", "a")]
    assert mirror["diff"] == -row["diff"] and mirror["p_value"] == row["p_value"]
    assert mirror["diff_lo"] == -row["diff_hi"]


def test_bootstrap_pvalue_splits_an_atom_at_zero():
    # The case: resamples below 0 or exactly 0, interval [-0.18, 0.00]. Counting d* = 0 in both
    # tails gave p = 1; the atom is split between the tails.
    d = np.concatenate([np.linspace(-0.18, -0.01, 450), np.zeros(550)])
    assert np.quantile(d, 0.975) == 0.0 and np.quantile(d, 0.025) < -0.17
    p = bootstrap_pvalue(d)
    assert p == pytest.approx(2 * (0 + 0.5 * 550 + 1) / 1001)
    assert p < 0.6
    old = min(1.0, 2 * min((np.sum(d <= 0) + 1) / 1001, (np.sum(d >= 0) + 1) / 1001))
    assert old == 1.0  # the old rule
    assert bootstrap_pvalue(np.zeros(100)) == 1.0
    assert bootstrap_pvalue(np.full(999, 0.3)) == pytest.approx(2 / 1000)


def test_bootstrap_pvalue_counts_rounding_around_zero_as_the_atom():
    """Differences equal in exact arithmetic come out 0 or ±1e-17 depending on the order of the sums; the p
    is the same either way, and a real difference of 1e-6 still counts on its side."""
    rng = np.random.default_rng(4)
    d = np.concatenate([rng.uniform(-0.2, -0.01, 300), np.zeros(500), rng.uniform(0.01, 0.1, 200)])
    noisy = d.copy()
    noisy[300:800] = rng.choice([-1e-17, 0.0, 3e-16], 500)
    assert bootstrap_pvalue(noisy) == bootstrap_pvalue(d) == pytest.approx(2 * (200 + 250 + 1) / 1001)
    real = d.copy()
    real[300:800] = -1e-6
    assert bootstrap_pvalue(real) == pytest.approx(2 * (200 + 1) / 1001)


def test_pair_sums_are_the_masked_quadratic_form_by_brute_force():
    """`TwoWay.pair_sums` (the within-configuration and within-draw corrections a block at a time) against
    Σ_{i<j} P_ij·M_ij with `pair_weights`' P_ij, on an unbalanced design with draws resampled."""
    from flatbench.analysis.stats import two_way_bootstrap

    cells = np.array([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 5, 5, 6, 7, 7, 8, 9, 9, 10, 11, 11, 11, 12])
    draws = np.arange(len(cells)) % 5
    boot = two_way_bootstrap(cells, draws, 300, seed=2)
    assert boot.draws_resampled
    rng = np.random.default_rng(3)
    m = rng.normal(size=(len(cells), len(cells)))
    m = m + m.T
    i, j = np.triu_indices(len(cells), 1)
    brute = boot.pair_weights(i, j) @ m[i, j]
    np.testing.assert_allclose(boot.pair_sums(m), brute, rtol=1e-12, atol=1e-9)


def test_holm_matches_its_definition():
    rng = np.random.default_rng(20)
    p = rng.uniform(0, 0.1, 9)
    p[3] = np.nan
    adj = holm(p)
    assert math.isnan(adj[3])
    ok = np.flatnonzero(np.isfinite(p))
    k = len(ok)
    order = ok[np.argsort(p[ok])]
    expected = {}
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (k - rank) * p[i]))
        expected[i] = running
    for i in ok:
        assert adj[i] == pytest.approx(expected[i])
    # Step-down: rejected at 0.05 exactly where the sequential rule rejects.
    reject = set()
    for rank, i in enumerate(order):
        if p[i] <= 0.05 / (k - rank):
            reject.add(i)
        else:
            break
    assert {i for i in ok if adj[i] <= 0.05} == reject


def test_paired_comparison_edge_cases():
    gap = np.linspace(0, 1, 12)
    few = gap.copy()
    few[:5] = np.nan  # 7 shared runs with "a": < MIN_CI_RUNS
    frame = _frame(gap, a=gap, const=np.ones(12), few=few, empty=np.full(12, np.nan))
    out = paired_comparisons(frame, ["a", "const", "few", "empty", "absent"], "gap_acc", n_boot=100,
                             seed=0).set_index(["measure_a", "measure_b"])
    assert len(out) == 5 * 4
    assert math.isnan(out.loc[("a", "const"), "diff"]) and math.isnan(out.loc[("a", "const"), "p_value"])
    row = out.loc[("a", "few")]
    assert row["n"] == 7 and row["diff"] == 0.0
    assert math.isnan(row["diff_lo"]) and math.isnan(row["p_value"])
    assert out.loc[("a", "empty"), "n"] == 0 and math.isnan(out.loc[("a", "empty"), "diff"])
    assert math.isnan(out.loc[("a", "absent"), "diff"])
    none = paired_comparisons(frame, ["a", "few"], "gap_acc", n_boot=0).set_index(["measure_a", "measure_b"])
    assert math.isnan(none.loc[("a", "few"), "diff_lo"])
    assert paired_comparisons(frame.iloc[:0], [], "gap_acc").empty


def test_vs_best_in_analyze(no_registry):
    rng = np.random.default_rng(12)
    gap = rng.uniform(0, 1, 30)
    good = gap + rng.normal(0, 0.05, 30)
    table = make_table(gap, {"good": good, "twin": good + 1e-9 * rng.normal(size=30),
                             "noise": rng.normal(size=30), "const": np.ones(30)})
    result = analyze(table, n_boot=2000)
    corr = result.correlations.set_index("measure")
    best = result.correlations.iloc[0]["measure"]
    assert best in ("good", "twin")
    assert corr.loc[best, "vs_best"] == "best" and math.isnan(corr.loc[best, "vs_best_p"])
    other = "twin" if best == "good" else "good"
    assert corr.loc[other, "vs_best"] == "indistinguishable" and corr.loc[other, "vs_best_p_holm"] > 0.05
    assert corr.loc["noise", "vs_best"] == "worse" and corr.loc["noise", "vs_best_p_holm"] < 0.01
    assert corr.loc["const", "vs_best"] == ""
    # Holm over the two comparisons with the best.
    assert corr.loc["noise", "vs_best_p_holm"] == pytest.approx(min(1, 2 * corr.loc["noise", "vs_best_p"]))
    cmp = result.comparisons
    assert list(cmp.columns) == ["measure_a", "measure_b", "n", "tau_a", "tau_b", "diff", "diff_lo",
                                 "diff_hi", "diff_se", "p_value", "p_boot"]
    assert len(cmp) == 4 * 3
    assert cmp["measure_a"].iloc[0] == best  # ranking order
    row = cmp[(cmp["measure_a"] == best) & (cmp["measure_b"] == "noise")].iloc[0]
    assert row["p_value"] == corr.loc["noise", "vs_best_p"]


def test_best_group_labels_are_stable_across_seeds(no_registry):
    """Labels of the best group under three report seeds agree except where marked borderline."""
    rng = np.random.default_rng(21)
    ratios = np.repeat(np.linspace(0, 1, 12), 2)  # 12 configurations: enough units for the cluster bootstrap
    seeds = np.tile([0, 1], 12)
    gap = ratios * 0.8 + rng.normal(0, 0.04, 24)
    measures = {f"m{k}": gap + rng.normal(0, 0.02 + 0.03 * k, 24) for k in range(8)}
    table = make_table(gap, measures, ratios=ratios, seeds=seeds)
    runs = [analyze(table, n_boot=4000, seed=s).correlations.set_index("measure") for s in (0, 1, 2)]
    for m in measures:
        labels = {r.loc[m, "vs_best"] for r in runs}
        assert len(labels) == 1 or all(r.loc[m, "vs_best_borderline"] for r in runs), (m, labels)
    assert (runs[0]["vs_best"] == "worse").any()


# ---------------------------------------------------------------------------- Monte-Carlo standard errors

def _write_run(exp: Path, i: int, gap: float, measures: dict) -> None:
    run = exp / "runs" / f"run{i:02d}"
    run.mkdir(parents=True)
    info = {"run_id": run.name, "status": "finished",
            "config": {"seed": i % 2, "data": {"random_label_ratio": round(i / 10, 2)},
                       "model": {"name": "mlp"}},
            "train_acc": 1.0, "train_loss": 0.01, "test_acc": 1.0 - gap, "test_loss": 1.0}
    (run / "run.json").write_text(json.dumps(info))
    (run / "measures.json").write_text(json.dumps(measures))


def test_stderr_columns_round_trip_through_csv(tmp_path, no_registry):
    rng = np.random.default_rng(13)
    exp = tmp_path / "exp"
    for i in range(12):
        gap = 0.05 * i + rng.normal(0, 0.01)
        se = 0.5 if i != 3 else "nan"  # stored non-finite values are strings
        measures = {
            "noisy@normalized_ce": {"status": "ok",
                                    "values": {"noisy@normalized_ce": gap + rng.normal(0, 0.2)},
                                    "info": {"stderr": se}},
            "precise": {"status": "ok", "values": {"precise": 10 * gap, "precise/layers.0": gap},
                        "info": {"stderr": 1e-4}},
            "exact": {"status": "ok", "values": {"exact": gap}, "info": {"method": "closed form"}},
        }
        if i == 0:
            measures["precise"]["info"] = {}
        _write_run(exp, i, gap, measures)
    table = build_table([exp])
    mapping = {"noisy@normalized_ce": "noisy@normalized_ce#se", "precise": "precise#se"}
    assert table.attrs["stderr_columns"] == mapping
    assert set(mapping.values()) <= set(table.columns)
    assert math.isnan(table.loc[0, "precise#se"]) and table.loc[1, "precise#se"] == 1e-4
    assert math.isnan(table.loc[3, "noisy@normalized_ce#se"])
    for cols in (measure_columns(table), headline_columns(table)):
        assert not any(c.endswith("#se") for c in cols)
    csv = tmp_path / "table.csv"
    table.to_csv(csv, index=False)
    back = pd.read_csv(csv)
    assert stderr_columns(back) == mapping
    assert sorted(headline_columns(back)) == ["exact", "noisy@normalized_ce", "precise"]
    first = analyze(table, n_boot=0).correlations.set_index("measure")
    second = analyze(back, n_boot=0).correlations.set_index("measure")
    for key in ("noisy@normalized_ce", "precise"):
        assert second.loc[key, "se_median"] == pytest.approx(first.loc[key, "se_median"])
        assert second.loc[key, "se_ratio"] == pytest.approx(first.loc[key, "se_ratio"])
    assert math.isnan(second.loc["exact", "se_median"]) and math.isnan(second.loc["exact", "se_ratio"])
    assert set(second.index) == {"exact", "noisy@normalized_ce", "precise"}  # "#se" is never ranked
    # The definitions: median SE over the measure's runs, over the runs' standard deviation (ddof=1).
    values = table["noisy@normalized_ce"].to_numpy()
    assert first.loc["noisy@normalized_ce", "se_median"] == pytest.approx(0.5)
    assert first.loc["noisy@normalized_ce", "se_ratio"] == pytest.approx(0.5 / np.std(values, ddof=1))
    assert first.loc["noisy@normalized_ce", "se_ratio"] >= SE_NOTE_RATIO
    assert "the ranking is partly noise" in first.loc["noisy@normalized_ce", "note"]
    assert first.loc["precise", "se_ratio"] < 0.01
    assert "noise" not in first.loc["precise", "note"]


def test_stderr_note_from_a_plain_table(no_registry):
    gap = np.linspace(0, 1, 10)
    values = gap.copy()
    table = make_table(gap, {"m": values, "k": values * 2})
    table["m#se"] = 0.6 * np.std(values, ddof=1)
    table["k#se"] = 0.4 * np.std(values * 2, ddof=1)
    corr = correlations(table, n_boot=0).set_index("measure")
    assert corr.loc["m", "se_ratio"] == pytest.approx(0.6)
    assert "standard error comparable to the spread between runs" in corr.loc["m", "note"]
    assert corr.loc["k", "se_ratio"] == pytest.approx(0.4)
    assert "standard error" not in corr.loc["k", "note"]


# ------------------------------------------------------------------------------------- weighted kernels

from flatbench.analysis.stats import (  # noqa: E402
    multinomial_counts,
    weighted_kendall,
    weighted_pearson,
    weighted_spearman,
)


@pytest.mark.parametrize("ties", [False, True])
def test_weighted_kernels_are_the_resampled_statistics(ties):
    """Integer weights = the statistic of np.repeat(x, w): checked against scipy resample by resample."""
    rng = np.random.default_rng(30)
    n = 15
    x = rng.normal(size=n)
    y = 0.5 * x + rng.normal(size=n)
    if ties:
        x, y = np.round(x), np.round(y * 2) / 2
    w = multinomial_counts(np.random.default_rng(3), n, 40)
    tau, rho, r = weighted_kendall(x, y, w), weighted_spearman(x, y, w), weighted_pearson(x, y, w)
    for b in range(len(w)):
        counts = w[b].astype(int)
        xs, ys = np.repeat(x, counts), np.repeat(y, counts)
        for ours, ref in ((tau[b], sps.kendalltau(xs, ys).statistic), (rho[b], sps.spearmanr(xs, ys).statistic),
                          (r[b], sps.pearsonr(xs, ys).statistic)):
            assert (math.isnan(ours) and math.isnan(ref)) or ours == pytest.approx(ref, abs=1e-10)


def test_one_run_per_cell_falls_back_and_says_so(no_registry):
    """Tsuzuku's {uniform: N} ratios with one seed: the plain bootstrap of the runs, an interval of non-zero
    width, and a note that says what was resampled."""
    rng = np.random.default_rng(7)
    ratios = np.round(rng.uniform(0, 1, 14), 4)
    gap = ratios * 0.8 + rng.normal(0, 0.05, 14)
    result = analyze(make_table(gap, {"m": gap + rng.normal(0, 0.1, 14)}, ratios=ratios), n_boot=2000)
    row = result.correlations.iloc[0]
    assert row["kendall_tau_lo"] < row["kendall_tau"] < row["kendall_tau_hi"]
    assert "every configuration holds one run" in result.resampling and "plain bootstrap" in result.resampling
    assert result.resampling in result.notes


def test_exact_kendall_p_is_scipys():
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=25), rng.normal(size=25)
    y = y + 0.4 * x
    assert kendall_permutation_p(x, y) == pytest.approx(sps.kendalltau(x, y, method="exact").pvalue, abs=1e-12)
    assert correlations(make_table(y, {"m": x}), n_boot=0).iloc[0]["kendall_p_method"].startswith("exact")


def test_yi_like_seed_axis_no_longer_drags_psi(no_registry):
    """A measure that orders the ratios perfectly but not two seeds of one ratio: its seed is a replicate,
    never an axis, so ψ over the ratio is 1; the ratio is a data axis, so it is psi_data (Ψ, over the
    training axes, has none: NaN); the replicate pairs are all ordered backwards."""
    ratios = np.repeat(np.linspace(0, 1, 11), 2)
    seeds = np.tile([0, 1], 11)
    gap = ratios + np.tile([0.0, 0.01], 11)
    m = ratios * 10 + np.tile([0.05, 0.0], 11)  # within a ratio, backwards
    corr = correlations(make_table(gap, {"m": m}, ratios=ratios, seeds=seeds), n_boot=0)
    row = corr.iloc[0]
    assert row["psi_data"] == row["psi_data.random_label_ratio"] == pytest.approx(1.0)
    assert math.isnan(row["psi"])
    assert row["seed_pairs_concordant"] == 0.0 and row["n_seed_pairs"] == 11
    # one environment (the ratio, no other axis) of 220 pairs, most above the noise: averaged
    assert row["n_environments"] == 1 and row["sign_error_mean"] == pytest.approx(0.0)


def test_the_permutation_p_of_many_tied_runs_is_the_count_of_scipys_tau_over_the_same_permutations():
    """Above 400 runs with ties (an accuracy gap), S of every permutation comes from the pair-sign matrices
    as below; it must count exactly the permutations whose scipy τ-b reaches the observed one."""
    from flatbench.analysis.stats.kernels import _permutations, kendall_permutation_pvalues, kendall_scipy

    rng = np.random.default_rng(0)
    n = 450
    y = rng.integers(0, 20, n).astype(float)
    x = rng.integers(0, 30, (4, n)).astype(float)
    x[2] = y + rng.normal(0, 5, n).round()  # associated: a small p
    got = kendall_permutation_pvalues(x, y, n_perm=200, seed=3)
    perms, _ = _permutations(n, 200, 3)
    for row, p in zip(x, got):
        t_obs = abs(kendall_scipy(row, y))
        count = sum(abs(kendall_scipy(row, y[perm])) >= t_obs - 1e-12 for perm in perms)
        assert p == (count + 1) / (len(perms) + 1)
    assert got[2] < 0.01 < got[0]


def test_the_replicate_p_value_keeps_its_pair_weights_per_bootstrap_and_pairs():
    """The pairs' bootstrap weights are made once per (bootstrap, pairs) and shared by every measure: each
    measure's p-value is that of a fresh bootstrap, and other pairs on the same bootstrap get their own."""
    from flatbench.analysis.stats import replicate_pairs, replicate_pvalue, two_way_bootstrap

    rng = np.random.default_rng(8)
    cells, draws = np.repeat(np.arange(12), 10), np.tile(np.repeat(np.arange(5), 2), 12)
    gap = rng.normal(size=len(cells))
    pairs, other = replicate_pairs(gap, cells), replicate_pairs(gap, draws)
    assert len(pairs.i) != len(other.i)
    boot = two_way_bootstrap(cells, draws, 400, seed=1)
    for measure in (gap + rng.normal(0, 0.5, len(gap)), -gap, rng.normal(size=len(gap))):
        for p in (pairs, other):
            shared = replicate_pvalue(p, measure, boot)
            assert shared == replicate_pvalue(p, measure, two_way_bootstrap(cells, draws, 400, seed=1))
            assert not math.isnan(shared[0])
