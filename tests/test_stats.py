"""Correlation statistics: agreement with scipy, granulated Kendall by hand, bootstrap, direction, CMI,
and the exclusion rules."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from flatbench.analysis import stats
from flatbench.analysis.stats import (
    analyze,
    bootstrap_ci,
    conditional_mi,
    correlations,
    exclusion_reasons,
    granulated_kendall,
    kendall_batch,
    kendall_tau_a,
    pearson_batch,
    spearman_batch,
)


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
def no_registry(monkeypatch):
    """Every measure reads as larger = sharper unless a test says otherwise (no real registry needed)."""
    monkeypatch.setattr(stats, "measure_specs", dict)


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
    table = make_table([0.1, 0.4, 0.7, 0.2, 0.3, 0.8], {"m": [1.0, 3.0, 2.0, 2.0, 1.0, 3.0]},
                       ratios=[0, 0.5, 1, 0, 0.5, 1], seeds=[0, 0, 0, 1, 1, 1])
    row = correlations(table, n_boot=0).iloc[0]
    assert row["psi_data.random_label_ratio"] == pytest.approx(1 / 3)
    assert row["psi_seed"] == pytest.approx(1.0)
    assert row["psi"] == pytest.approx(2 / 3)


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


def test_direction_flip(monkeypatch):
    registry = {"flat": SimpleNamespace(larger_is_sharper=False),
                "sharp": SimpleNamespace(larger_is_sharper=True)}
    monkeypatch.setattr(stats, "measure_specs", lambda: registry)
    gap = np.linspace(0.0, 0.8, 6)
    table = make_table(gap, {"flat": -gap + 3, "flat@normalized_ce": 1 / (1 + gap), "sharp": gap * 2,
                             "unregistered": gap ** 2})
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
    # A measure equal to the gap carries all the information left after any conditioning.
    score, cond = conditional_mi(gap * 3 + 1, gap, codes, ["r", "s"])
    assert score == pytest.approx(1.0)
    # A measure that only knows the ratio says nothing once the ratio is known.
    score, cond = conditional_mi(ratios, gap, codes, ["r", "s"])
    assert score == pytest.approx(0.0, abs=1e-12) and cond == "r"
    # Fewer than two axes: not defined.
    assert math.isnan(conditional_mi(gap, gap, codes, ["r"])[0])


def test_cmi_needs_two_axes_note(no_registry):
    gap = np.linspace(0, 1, 6)
    table = make_table(gap, {"m": gap})
    result = analyze(table, n_boot=0)
    assert result.axes == ["data.random_label_ratio"]
    assert math.isnan(result.correlations.loc[0, "cmi"])
    assert any("two varying" in n for n in result.notes)


def test_best_measure_first(no_registry):
    gap = np.linspace(0, 1, 10)
    rng = np.random.default_rng(1)
    table = make_table(gap, {"noise": rng.normal(size=10), "good": gap + rng.normal(0, 0.01, 10),
                             "anti": -gap})
    order = list(correlations(table, n_boot=0)["measure"])
    assert order[0] == "good" and order[-1] == "anti"


def test_bad_gap_name():
    with pytest.raises(ValueError):
        correlations(make_table([0.1, 0.2, 0.3], {"m": [1.0, 2.0, 3.0]}), gap="accuracy")
