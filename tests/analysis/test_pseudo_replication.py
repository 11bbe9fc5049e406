"""Pseudo-replicated designs: 64 configurations × 2 data draws, where runs of one draw (or of one
configuration) share an effect. The old tests treated the 64 seed pairs or the 64 ψ blocks as independent
and rejected; the new inference does not (it says no replicate-level test is possible, or resamples the
configurations). Both are shown: the old test is written out here."""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import binomtest
from stat_designs import as_table, codes_of, crossed

from flatbench.analysis.stats import analyze, psi_blocks, psi_pvalues

LEVELS = {"train.lr": 2, "train.batch_size": 2, "train.weight_decay": 2, "model.width": 2,
          "data.n_train": 2, "data.random_label_ratio": 2}


def test_a_shared_draw_effect_fools_the_seed_pair_sign_test_not_the_new_inference():
    """Every configuration of draw 1 has a higher gap and a higher measure than in draw 0 (one shared draw
    effect): all 64 seed pairs are ordered like their gaps. The old exact sign test over the 64 pairs calls
    that p ≈ 1e-19; they are one observation of one draw effect, and with 2 draws no replicate-level test
    is possible: the new seed_pairs_p is NaN and the notes say why."""
    rng = np.random.default_rng(0)
    design = crossed(LEVELS, n_draws=2)
    n = len(design)
    draw = design["draw"].to_numpy()
    config_gap = rng.normal(0, 0.05, n // 2).repeat(2)
    config_measure = rng.normal(0, 1.0, n // 2).repeat(2)
    gap = config_gap + 0.1 * draw + rng.normal(0, 0.005, n)
    measure = config_measure + 2.0 * draw + rng.normal(0, 0.05, n)
    result = analyze(as_table(design, gap, {"m": measure}), n_boot=200)
    row = result.correlations.iloc[0]
    # the old test: an exact binomial test over the 64 seed pairs as if they were independent
    pairs = [(2 * c, 2 * c + 1) for c in range(n // 2)]
    concordant = sum(np.sign(measure[q] - measure[p]) == np.sign(gap[q] - gap[p]) for p, q in pairs)
    old_p = binomtest(int(concordant), len(pairs), 0.5).pvalue
    assert concordant == 64 and old_p < 1e-15
    assert row["seed_pairs_concordant"] == 1.0 and row["n_seed_pairs"] == 64
    assert math.isnan(row["seed_pairs_p"])
    assert any("conditional on these 2 data draws: no replicate-level test is possible" in note
               for note in result.notes)


def test_configurations_repeated_over_two_draws_fool_the_psi_sign_test_not_the_bootstrap():
    """Null: the gap and the measure are independent functions of the configuration (plus small run noise).
    ψ_lr has 64 blocks, but blocks (k, draw 0) and (k, draw 1) hold the same two configurations, so their τ
    mostly agree: 32 independent units, not 64. Over 200 such studies the old sign test over the 64 blocks
    rejects at 5% far more often than 5%; the two-way bootstrap (here: over the 32 combinations, conditional
    on the 2 draws) about 5% of the time."""
    rng = np.random.default_rng(1)
    design = crossed(LEVELS, n_draws=2)
    n = len(design)
    axes = list(LEVELS)
    codes = codes_of(design, axes)
    blocks = psi_blocks(codes, axes, "train.lr", design["draw"].to_numpy())
    assert blocks.n_blocks == 64 and blocks.n_combos == 32
    old = new = 0
    trials = 200
    for t in range(trials):
        gap = rng.normal(0, 1, n // 2).repeat(2) + rng.normal(0, 0.1, n)
        measure = rng.normal(0, 1, n // 2).repeat(2) + rng.normal(0, 0.1, n)
        taus = blocks.block_taus(measure[None, :], gap)[0]
        informative = taus[taus != 0]
        old += binomtest(int((informative > 0).sum()), len(informative), 0.5).pvalue <= 0.05
        p, _ = psi_pvalues(blocks, taus[None, :], 200, seed=t)
        new += p[0] <= 0.05
    assert old / trials > 0.12, old
    assert new / trials < 0.09, new
