"""The within-group permutation test of ψ (flatbench.analysis.stats.psi_test) against brute force: every
combination of within-group permutations enumerated on designs small enough to list."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from flatbench.analysis.stats import granulated_kendall
from flatbench.analysis.stats.jiang import psi_groups
from flatbench.analysis.stats.psi_test import psi_pvalue


def _design(levels_a: int, levels_b: int, seeds: int) -> pd.DataFrame:
    rows = [(str(a), str(b), str(s)) for a in range(levels_a) for b in range(levels_b) for s in range(seeds)]
    return pd.DataFrame(rows, columns=["a", "b", "seed"])


def _brute_force_p(measure, gap, codes, axes, axis, within) -> float:
    groups = psi_groups(codes, axes, axis, within)
    observed = granulated_kendall(measure, gap, codes, axes, within)[1][axis]
    count = total = 0
    for choice in itertools.product(*(list(itertools.permutations(g)) for g in groups)):
        permuted = gap.copy()
        for g, p in zip(groups, choice):
            permuted[g] = gap[list(p)]
        psi = granulated_kendall(measure, permuted, codes, axes, within)[1][axis]
        count += abs(psi) >= abs(observed) - 1e-12
        total += 1
    return count / total


@pytest.mark.parametrize("trial", range(3))
def test_pairs_give_the_exact_sign_test_equal_to_enumeration(trial):
    codes = _design(2, 4, 2)  # axis a has 2 levels: 8 groups of two runs for ψ_a
    rng = np.random.default_rng(trial)
    gap = rng.normal(size=len(codes))
    measure = gap + rng.normal(scale=1.5, size=len(codes))
    p, method = psi_pvalue(measure, gap, codes, ["a", "b"], "a", within=["seed"])
    assert method == "exact (sign test)"
    assert p == pytest.approx(_brute_force_p(measure, gap, codes, ["a", "b"], "a", ["seed"]), abs=1e-12)


def test_ties_inside_a_pair_carry_no_information():
    codes = _design(2, 4, 1)
    gap = np.arange(8, dtype=float)
    measure = gap.copy()
    measure[4] = measure[0]  # group (a=0,b=0),(a=1,b=0) ties in the measure
    p_tied, _ = psi_pvalue(measure, gap, codes, ["a", "b"], "a")
    p_three, _ = psi_pvalue(gap[[1, 2, 3, 5, 6, 7]], gap[[1, 2, 3, 5, 6, 7]],
                            codes.iloc[[1, 2, 3, 5, 6, 7]].reset_index(drop=True), ["a", "b"], "a")
    assert p_tied == pytest.approx(p_three)  # 3 informative concordant pairs: p = 2/8
    assert p_three == pytest.approx(0.25)


@pytest.mark.parametrize("trial", range(3))
def test_larger_groups_monte_carlo_matches_enumeration(trial):
    codes = _design(3, 2, 1)  # ψ_a: 2 groups of three runs, 3!·3! = 36 combinations
    rng = np.random.default_rng(10 + trial)
    gap = rng.normal(size=len(codes))
    measure = gap + rng.normal(scale=0.7, size=len(codes))
    p, method = psi_pvalue(measure, gap, codes, ["a", "b"], "a", n_perm=20_000, seed=trial)
    assert method.startswith("monte carlo")
    exact = _brute_force_p(measure, gap, codes, ["a", "b"], "a", [])
    assert p == pytest.approx(exact, abs=0.015)


def test_a_measure_that_orders_every_group_is_significant_and_noise_is_not():
    codes = _design(2, 16, 2)  # 32 pairs for ψ_a
    rng = np.random.default_rng(0)
    gap = rng.normal(size=len(codes))
    p_perfect, _ = psi_pvalue(gap * 3 + 1, gap, codes, ["a", "b"], "a", within=["seed"])
    assert p_perfect < 1e-8
    ps = [psi_pvalue(rng.normal(size=len(codes)), gap, codes, ["a", "b"], "a", within=["seed"])[0]
          for _ in range(200)]
    assert np.mean(np.array(ps) < 0.05) <= 0.06  # the sign test keeps its level under the null (it is conservative)


def test_an_axis_without_groups_is_nan_with_a_reason():
    codes = pd.DataFrame({"a": ["0", "1"], "b": ["0", "1"]})  # no two runs differ in a alone
    p, reason = psi_pvalue(np.array([1.0, 2.0]), np.array([1.0, 2.0]), codes, ["a", "b"], "a")
    assert np.isnan(p) and "no group" in reason


def test_seed_pairs_sign_test_equals_enumerating_the_pairs_orders():
    from flatbench.analysis.stats import seed_pairs_pvalue

    rng = np.random.default_rng(3)
    cells = np.repeat(np.arange(7), 2)
    seeds = np.tile([0, 1], 7)
    gap = rng.normal(size=14)
    measure = gap + rng.normal(scale=2.0, size=14)
    measure[1] = measure[0]  # one tied pair: left out
    p = seed_pairs_pvalue(measure, gap, cells, seeds)
    signs = [np.sign(measure[2 * c + 1] - measure[2 * c]) * np.sign(gap[2 * c + 1] - gap[2 * c]) for c in range(1, 7)]
    observed = abs(sum(signs))
    flips = list(itertools.product([-1, 1], repeat=6))
    assert p == pytest.approx(sum(abs(sum(f)) >= observed for f in flips) / len(flips), abs=1e-12)


def test_analyze_reports_the_psi_p_values_of_the_design():
    from flatbench.analysis.stats import analyze, design_of

    codes = _design(2, 3, 2)
    rng = np.random.default_rng(5)
    table = codes.rename(columns={"a": "train.lr", "b": "data.n_train"}).astype({"seed": int})
    table["run_id"] = [f"r{i}" for i in range(len(table))]
    table["experiment"], table["status"] = "e", "finished"
    table["train_acc"], table["train_loss"], table["test_loss"] = 1.0, 1e-3, 1.0
    table["gap_acc"] = rng.normal(size=len(table))
    table["gap_loss"] = table["gap_acc"]
    table["m"] = table["gap_acc"] + rng.normal(scale=0.5, size=len(table))
    table.attrs["sweep_axes"] = ["train.lr", "data.n_train", "seed"]
    table.attrs["headline_columns"] = ["m"]
    corr = analyze(table, n_boot=200).correlations
    row = corr.set_index("measure").loc["m"]
    design = design_of(table, ["train.lr", "data.n_train", "seed"])
    for axis in ("train.lr", "data.n_train"):
        p, _ = psi_pvalue(table["m"].to_numpy(), table["gap_acc"].to_numpy(), design.codes, design.axes, axis,
                          within=["seed"])
        assert row[f"p_psi_{axis}"] == pytest.approx(p)
    assert "p_psi_seed" not in corr.columns and "seed_pairs_p" in corr.columns
    # every psi_* column is a ψ of an axis (its p-value is p_psi_<axis>, not a psi_ column of its own)
    assert all(c == "psi" or c[len("psi_"):] in set(design.axes) for c in corr.columns if c.startswith("psi"))
