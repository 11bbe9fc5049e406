"""The two-way cluster bootstrap (flatbench.analysis.stats.bootstrap) against explicit loops: its weights, the
τ of its resampled data sets, the rule for few draws, the fallbacks and the units rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps
from stat_designs import as_table, crossed

from flatbench.analysis.stats import MIN_CI_RUNS, Resamples, analyze, design_of, two_way_bootstrap


def _explicit_weights(n_cells: int, n_draws: int, n_boot: int, seed: int, resample_draws: bool):
    """The documented random numbers, drawn one resample and one unit at a time."""
    rng = np.random.default_rng(seed)
    cell_draws = rng.integers(0, n_cells, size=(n_boot, n_cells))
    draw_draws = rng.integers(0, n_draws, size=(n_boot, n_draws)) if resample_draws else None
    w = np.zeros((n_boot, n_cells))
    v = np.ones((n_boot, n_draws))
    for b in range(n_boot):
        for c in cell_draws[b]:
            w[b, c] += 1
        if resample_draws:
            v[b] = 0
            for d in draw_draws[b]:
                v[b, d] += 1
    return w, v


@pytest.mark.parametrize("n_draws", [2, 6])
def test_run_weights_are_cell_times_draw_weights(n_draws):
    rng = np.random.default_rng(0)
    cells = np.repeat(np.arange(7), n_draws)
    draws = np.tile(np.arange(n_draws), 7)
    order = rng.permutation(len(cells))  # any order of the runs
    cells, draws = cells[order], draws[order]
    boot = two_way_bootstrap(cells, draws, 30, seed=4)
    # the ids are factorized in order of appearance
    cell_id = {c: k for k, c in enumerate(dict.fromkeys(cells))}
    draw_id = {d: k for k, d in enumerate(dict.fromkeys(draws))}
    w, v = _explicit_weights(7, n_draws, 30, 4, n_draws >= 5)
    for b in range(30):
        for r in range(len(cells)):
            assert boot.weights[b, r] == w[b, cell_id[cells[r]]] * v[b, draw_id[draws[r]]]
    assert boot.draws_resampled == (n_draws >= 5)
    if n_draws < 5:
        assert "conditional on these 2 data draws: no replicate-level test is possible" in boot.description
        assert (boot.draw_weights == 1).all()
    else:
        assert boot.description == "resampled: the 7 configurations and the 6 data draws (two-way cluster bootstrap)"


def copy_pairs(cells, draws, w, v, resample_draws):
    """The resampled data set of one resample, observation by observation (run, configuration copy, draw
    copy), and its pairs of distinct copies (not two copies of one configuration, nor of one draw) with
    their weight: (C − 1)/C for two runs of one configuration, (D − 1)/D for two of one resampled draw."""
    n_cells, n_draws = len(w), len(v)
    alpha = (n_cells - 1) / n_cells if n_cells > 1 else 1.0
    beta = (n_draws - 1) / n_draws if resample_draws and n_draws > 1 else 1.0
    obs = [(r, (cells[r], s), (draws[r], t)) for r in range(len(cells))
           for s in range(int(w[cells[r]])) for t in range(int(v[draws[r]]))]
    for a in range(len(obs)):
        for b in range(a + 1, len(obs)):
            (ra, ca, da), (rb, cb, db) = obs[a], obs[b]
            if (ca[0] == cb[0] and ca != cb) or (da[0] == db[0] and da != db) or ra == rb:
                continue
            yield ra, rb, (alpha if ca[0] == cb[0] else 1.0) * (beta if da[0] == db[0] else 1.0)


@pytest.mark.parametrize("n_draws", [2, 5])
def test_resampled_tau_is_tau_over_the_pairs_of_distinct_copies(n_draws):
    """Every τ* of `Resamples` is τ-b over the pairs of the resampled data set (w_c·v_d copies of run (c, d))
    that are not two copies of one configuration or of one draw, with their weights, written out pair by
    pair; only pairs of runs of one draw count (τ stratified by draw, issue 42)."""
    rng = np.random.default_rng(1)
    design = crossed({"train.lr": 3, "data.n_train": 2}, n_draws=n_draws)
    n = len(design)
    gap = design["train.lr"].to_numpy() * 0.1 + rng.normal(0, 0.05, n)
    measure = np.round(gap + rng.normal(0, 0.05, n), 2)  # ties
    d = design_of(as_table(design, gap, {"m": measure}), ["train.lr", "data.n_train", "seed"])
    res = Resamples({"m": measure}, gap, d.cells, d.draws, 30, seed=7)
    tau_star = res.boot("m", np.ones(n, dtype=bool))
    w, v = _explicit_weights(d.n_cells, d.n_draws, 30, 7, n_draws >= 5)
    for b in range(30):
        num = dx = dy = 0.0
        for i, j, k in copy_pairs(d.cells, d.draws, w[b], v[b], n_draws >= 5):
            if d.draws[i] != d.draws[j]:
                continue
            sx, sy = np.sign(measure[i] - measure[j]), np.sign(gap[i] - gap[j])
            num, dx, dy = num + k * sx * sy, dx + k * abs(sx), dy + k * abs(sy)
        ref = num / math.sqrt(dx * dy) if dx and dy else math.nan
        assert (math.isnan(ref) and math.isnan(tau_star[b])) or tau_star[b] == pytest.approx(ref, abs=1e-12)


def test_pairs_of_copies_would_bias_tau_toward_the_within_configuration_tau():
    """11 configurations × 2 draws where the measure orders the configurations perfectly and every pair of
    replicates backwards (it is the other replicate's gap). Counting pairs across copies of a configuration
    (the plain quadratic form W_i·W_j) doubles the within-configuration pairs on average and drags τ* far
    below τ; over pairs of distinct copies, weighted so that every pair has the same expected weight, the
    resamples centre on τ and the interval holds it. The two replicates are two seeds of one data draw (τ
    over all pairs; with two draws the headline τ would leave the replicate pairs out, issue 42)."""
    from flatbench.analysis.stats import weighted_kendall

    cells, draws = np.repeat(np.arange(11), 2), np.zeros(22, dtype=np.int64)
    gap = cells * 1.0 + np.tile([0.0, 0.1], 11)
    measure = cells * 1.0 + np.tile([0.1, 0.0], 11)
    tau = sps.kendalltau(measure, gap).statistic
    res = Resamples({"m": measure}, gap, cells, draws, 4000, seed=0)
    distinct = res.boot("m", np.ones(22, dtype=bool))
    plain = weighted_kendall(measure, gap, res.bootstrap(np.ones(22, dtype=bool)).weights)
    assert abs(np.nanmean(distinct) - tau) < 0.02
    assert tau - np.nanmean(plain) > 0.05
    lo, hi = np.quantile(plain[np.isfinite(plain)], [0.025, 0.975])
    assert hi < tau  # the plain interval misses its own estimate
    lo, hi = np.quantile(distinct[np.isfinite(distinct)], [0.025, 0.975])
    assert lo < tau < hi


def test_one_configuration_and_few_draws_fall_back_to_the_runs():
    boot = two_way_bootstrap(np.zeros(6, dtype=int), np.array([0, 0, 1, 1, 2, 2]), 25, seed=3)
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 6, size=(25, 6))
    assert np.array_equal(boot.weights, np.stack([np.bincount(row, minlength=6) for row in idx]))
    assert "every run has the same hyperparameters" in boot.description and boot.n_units == 6


def test_one_run_per_cell_is_the_plain_bootstrap_of_the_runs():
    """The same resamples as `kernels.bootstrap_ci`'s idx (rng.integers(0, n, (B, n)))."""
    boot = two_way_bootstrap(np.arange(12), np.zeros(12, dtype=int), 20, seed=5)
    idx = np.random.default_rng(5).integers(0, 12, size=(20, 12))
    assert np.array_equal(boot.weights, np.stack([np.bincount(row, minlength=12) for row in idx]))
    assert "the 12 runs (every configuration holds one run)" in boot.description


def test_fewer_than_ten_configurations_give_no_interval_and_say_so():
    rng = np.random.default_rng(2)
    design = crossed({"data.random_label_ratio": 6}, n_draws=4)  # tsuzuku_cifar10's design: 6 × 4
    gap = design["data.random_label_ratio"] * 0.1 + rng.normal(0, 0.02, len(design))
    table = as_table(design, gap, {"a": gap + rng.normal(0, 0.01, len(design)), "b": rng.normal(size=len(design))})
    result = analyze(table, n_boot=200)
    corr = result.correlations.set_index("measure")
    assert len(table) >= MIN_CI_RUNS and corr["kendall_tau_lo"].isna().all()
    assert set(corr["vs_best"]) == {"best", "cannot compare"}
    assert any("only 6 independent unit(s) to resample" in n for n in result.notes)
    assert result.resampling == ("resampled: the 6 configurations (cluster bootstrap), conditional on these 4 data "
                                 "draws: no replicate-level test is possible")


def test_two_way_intervals_widen_with_a_shared_draw_effect():
    """12 configurations × 6 draws; the measure knows only its own draw effect, independent of the gap's. The
    cluster bootstrap conditional on the draws (v ≡ 1) calls its τ significant in most data sets; the two-way
    bootstrap, which resamples the 6 draws too, much more rarely."""
    rng = np.random.default_rng(11)
    design = crossed({"train.lr": 12}, n_draws=6)
    n = len(design)
    d = design_of(as_table(design, np.zeros(n), {}), ["train.lr", "seed"])
    two_way = two_way_bootstrap(d.cells, d.draws, 400, seed=0)
    cells_only_w = two_way.cell_weights[:, d.cells]
    excluded = {"two-way": 0, "cells only": 0}
    from flatbench.analysis.stats import weighted_kendall

    for _ in range(40):
        delta, eta = rng.normal(0, 1, 6), rng.normal(0, 1, 6)
        gap = design["train.lr"].to_numpy() * 0.02 + delta[d.draws] + rng.normal(0, 0.1, n)
        measure = eta[d.draws] + rng.normal(0, 0.1, n)
        for name, w in (("two-way", two_way.weights), ("cells only", cells_only_w)):
            lo, hi = np.quantile(weighted_kendall(measure, gap, w), [0.025, 0.975])
            excluded[name] += lo > 0 or hi < 0
    assert excluded["cells only"] >= 25 and excluded["two-way"] <= 12, excluded
