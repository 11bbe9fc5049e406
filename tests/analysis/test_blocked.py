"""Issue 42: τ within data draws, its two-way cluster bootstrap, the variance decomposition gap ~ draw + cell,
and the hyperparameter baselines, each against a brute-force computation on small random designs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatbench.analysis.stats import analyze
from flatbench.analysis.stats.anova import variance_decomposition
from flatbench.analysis.stats.baselines import HYPERPARAMETERS, leave_one_draw_out
from flatbench.analysis.stats.blocked import blocked_boot_tau, blocked_pair_sums, stratified_kendall
from flatbench.analysis.stats.bootstrap import two_way_bootstrap
from flatbench.analysis.stats.kernels import kendall_batch, kendall_permutation_pvalues
from tests.stat_designs import as_table, crossed


def brute_tau(x, y, strata):
    """Concordant minus discordant pairs within each stratum over the pooled untied pairs: a plain pair loop."""
    num = tx = ty = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        if strata[i] != strata[j]:
            continue
        sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
        num += sx * sy
        tx += sx != 0
        ty += sy != 0
    return num / math.sqrt(tx * ty) if tx and ty else math.nan


def random_design(rng, n_cells, n_draws, drop=0.0, ties=False):
    cells = np.repeat(np.arange(n_cells), n_draws)
    draws = np.tile(np.arange(n_draws), n_cells)
    keep = rng.random(len(cells)) >= drop
    cells, draws = cells[keep], draws[keep]
    x = rng.normal(size=len(cells))
    y = rng.normal(size=len(cells)) + 0.5 * x
    if ties:
        x = np.round(x)
    return cells, draws, x, y


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 7), st.integers(1, 4), st.floats(0, 0.4), st.booleans(), st.integers(0, 2**31))
def test_stratified_tau_is_the_within_draw_pair_loop(n_cells, n_draws, drop, ties, seed):
    rng = np.random.default_rng(seed)
    cells, draws, x, y = random_design(rng, n_cells, n_draws, drop, ties)
    if len(x) < 2:
        return
    got = stratified_kendall(x, y, draws)[0]
    want = brute_tau(x, y, draws)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-12)


def test_one_draw_is_the_pooled_tau_exactly():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=30), rng.normal(size=30)
    assert stratified_kendall(x, y, np.zeros(30))[0] == kendall_batch(x[None], y[None])[0]
    assert stratified_kendall(x, y, None)[0] == kendall_batch(x[None], y[None])[0]


def test_a_draw_offset_moves_the_pooled_tau_but_not_the_blocked_one():
    """Every configuration of draw 1 sits far above draw 0 in the gap; the measure orders the
    configurations within each draw perfectly but knows nothing of the draw."""
    cells = np.tile(np.arange(10), 2)
    draws = np.repeat([0, 1], 10)
    x = np.concatenate([np.arange(10), np.arange(10) - 5.0])
    y = np.arange(10.0)[cells] * 0.01 + 10.0 * draws
    assert stratified_kendall(x, y, draws)[0] == pytest.approx(1.0)
    assert kendall_batch(x[None], y[None])[0] < 0.6


@pytest.mark.parametrize("n_draws,repeat", [(2, False), (5, False), (5, True), (6, True)])
def test_blocked_pair_sums_are_the_two_way_pair_sums_masked_to_one_draw(n_draws, repeat):
    rng = np.random.default_rng(n_draws)
    cells, draws, x, y = random_design(rng, 11, n_draws, 0.15)
    if repeat:  # two runs of one configuration in one draw (seeds within a data seed)
        cells, draws = np.concatenate([cells, [0, 3, 3]]), np.concatenate([draws, [1, 0, 2]])
        x, y = np.concatenate([x, rng.normal(size=3)]), np.concatenate([y, rng.normal(size=3)])
    boot = two_way_bootstrap(cells, draws, 64, 1)
    m = np.sign(x[:, None] - x[None, :]) * np.sign(y[:, None] - y[None, :])
    same = draws[:, None] == draws[None, :]
    np.testing.assert_allclose(blocked_pair_sums(boot, m), boot.pair_sums(m * same), atol=1e-9)


def test_blocked_bootstrap_tau_is_the_pair_loop_on_each_resample():
    """τ* on one resample: every pair of distinct copies of runs of one draw, weighted as P_ij, by a loop."""
    rng = np.random.default_rng(5)
    cells, draws, x, y = random_design(rng, 12, 5, 0.1)
    boot = two_way_bootstrap(cells, draws, 6, 2)
    got = blocked_boot_tau(boot, x, y)
    for b in range(6):
        w, v = boot.cell_weights[b], boot.draw_weights[b]
        num = tx = ty = 0.0
        for i, j in itertools.combinations(range(len(x)), 2):
            if draws[i] != draws[j]:
                continue
            f = boot.alpha * w[cells[i]] if cells[i] == cells[j] else w[cells[i]] * w[cells[j]]
            weight = f * boot.beta * v[draws[i]]
            sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
            num, tx, ty = num + weight * sx * sy, tx + weight * (sx != 0), ty + weight * (sy != 0)
        want = num / math.sqrt(tx * ty) if tx > 0 and ty > 0 else math.nan
        assert (math.isnan(got[b]) and math.isnan(want)) or got[b] == pytest.approx(want, abs=1e-12)


def test_the_bootstrap_resamples_whole_draws_and_configurations():
    """The weights are per configuration and per draw (clusters), never per run: two runs of one
    configuration always carry the same cell weight."""
    rng = np.random.default_rng(1)
    cells, draws, _, _ = random_design(rng, 12, 5)
    boot = two_way_bootstrap(cells, draws, 50, 0)
    assert boot.draws_resampled and boot.cell_weights.shape == (50, 12) and boot.draw_weights.shape == (50, 5)
    np.testing.assert_array_equal(boot.weights, boot.cell_weights[:, cells] * boot.draw_weights[:, draws])
    assert (boot.draw_weights == 0).any() and (boot.cell_weights == 0).any()  # whole units drop out


def test_the_permutation_test_within_draws_never_moves_a_run_out_of_its_draw():
    """With a draw offset and a measure that follows only the draw, τ within draws is 0 and its p is large;
    pooled, the same data look highly significant."""
    rng = np.random.default_rng(0)
    draws = np.repeat(np.arange(4), 15)
    y = rng.normal(size=60) * 0.1 + draws
    x = draws + rng.normal(size=60) * 1e-3  # follows the draw; inside a draw a random order
    p_within = kendall_permutation_pvalues(x[None], y, n_perm=999, seed=1, strata=draws)[0]
    p_pooled = kendall_permutation_pvalues(x[None], y, n_perm=999, seed=1)[0]
    assert p_pooled < 0.01 and p_within > 0.05


# ---------------------------------------------------------------------------------------------- ANOVA

def lstsq_anova(g, draws, cells):
    """Type-II sums of squares from dummy matrices and numpy lstsq, the ranks from matrix_rank."""
    one = np.ones((len(g), 1))
    dmat = (draws[:, None] == np.unique(draws)[None, :]).astype(float)
    cmat = (cells[:, None] == np.unique(cells)[None, :]).astype(float)

    def fit(*parts):
        x = np.hstack(parts)
        beta = np.linalg.lstsq(x, g, rcond=None)[0]
        return float(((g - x @ beta) ** 2).sum()), np.linalg.matrix_rank(x)

    full, rf = fit(one, dmat, cmat)
    d_only, rd = fit(one, dmat)
    c_only, rc = fit(one, cmat)
    return {"draw": (c_only - full, rf - rc), "cell": (d_only - full, rf - rd),
            "residual": (full, len(g) - rf)}


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 8), st.integers(1, 4), st.floats(0, 0.5), st.integers(0, 2**31))
def test_the_variance_decomposition_is_lstsq_on_dummies(n_cells, n_draws, drop, seed):
    rng = np.random.default_rng(seed)
    cells, draws, _, _ = random_design(rng, n_cells, n_draws, drop)
    if len(cells) < 3:
        return
    g = rng.normal(size=n_cells)[cells] + rng.normal(size=n_draws)[draws] + rng.normal(size=len(cells)) * 0.3
    table = variance_decomposition(g, draws, cells).set_index("effect")
    want = lstsq_anova(g, draws, cells)
    total = float(((g - g.mean()) ** 2).sum())
    for effect, (ss, df) in want.items():
        assert int(table.at[effect, "df"]) == df, effect
        if df > 0:
            assert table.at[effect, "ss"] == pytest.approx(max(ss, 0.0), abs=1e-7 * total), effect
    df_res = want["residual"][1]
    if want["cell"][1] > 0 and df_res > 0 and want["residual"][0] > 1e-12 * total:
        F = (want["cell"][0] / want["cell"][1]) / (want["residual"][0] / df_res)
        assert table.at["cell", "F"] == pytest.approx(F, rel=1e-6)
        k = want["cell"][1]
        assert table.at["cell", "partial_omega2"] == pytest.approx(k * (F - 1) / (k * (F - 1) + len(g)), rel=1e-6)


def test_the_draw_share_of_a_balanced_design_is_the_draw_means_sum_of_squares():
    rng = np.random.default_rng(2)
    cells, draws, _, _ = random_design(rng, 9, 4)
    g = rng.normal(size=9)[cells] + 2 * rng.normal(size=4)[draws] + rng.normal(size=36) * 0.2
    means = pd.Series(g).groupby(draws).mean().to_numpy()
    ss = 9 * ((means - g.mean()) ** 2).sum()
    row = variance_decomposition(g, draws, cells).set_index("effect").loc["draw"]
    assert row["share"] == pytest.approx(ss / ((g - g.mean()) ** 2).sum())


# ------------------------------------------------------------------------------------------ baselines

def test_leave_one_draw_out_is_the_mean_over_the_other_draws_of_the_cell():
    rng = np.random.default_rng(4)
    cells, draws, _, _ = random_design(rng, 6, 4, 0.25)
    cells, draws = np.concatenate([cells, [2, 2]]), np.concatenate([draws, [1, 1]])  # two runs of one draw
    g = rng.normal(size=len(cells))
    got = leave_one_draw_out(g, cells, draws)
    for r in range(len(g)):
        others = [g[s] for s in range(len(g)) if cells[s] == cells[r] and draws[s] != draws[r]]
        assert (math.isnan(got[r]) and not others) or got[r] == pytest.approx(np.mean(others))


def test_with_one_draw_the_baseline_leaves_out_the_run_only():
    g = np.array([1.0, 2.0, 4.0, 10.0, 20.0])
    got = leave_one_draw_out(g, np.array([0, 0, 0, 1, 2]), np.zeros(5))
    np.testing.assert_allclose(got, [3.0, 2.5, 1.5, np.nan, np.nan])


def test_the_analysis_reports_blocked_pooled_within_cell_tau_and_the_baseline_rows():
    design = crossed({"lr": 4, "width": 3}, n_draws=3)
    rng = np.random.default_rng(0)
    gap = 0.1 * design["lr"] + 0.05 * design["width"] + 0.5 * design["draw"] + rng.normal(0, 0.02, len(design))
    sharp = 0.1 * design["lr"] + 0.05 * design["width"] + rng.normal(0, 0.02, len(design))
    table = as_table(design, gap.to_numpy(), {"sharp": sharp.to_numpy()})
    a = analyze(table, n_boot=200, n_perm=199)
    rows = a.all_rows().set_index("measure")
    draws, cells = a.design.draws, a.design.cells
    x, g = table["sharp"].to_numpy(), table["gap_acc"].to_numpy()
    assert rows.at["sharp", "kendall_tau"] == pytest.approx(brute_tau(x, g, draws))
    assert rows.at["sharp", "kendall_tau_pooled"] == pytest.approx(kendall_batch(x[None], g[None])[0])
    assert rows.at["sharp", "kendall_tau_within_cell"] == pytest.approx(brute_tau(x, g, cells))
    assert rows.at["sharp", "kendall_tau"] > rows.at["sharp", "kendall_tau_pooled"] + 0.2
    refs = [m for m in rows.index if rows.at[m, "kind"] == "reference"]
    assert refs == [HYPERPARAMETERS, "ref.axis.lr", "ref.axis.width", "ref.random", "ref.replicate_gap"]
    base = leave_one_draw_out(g, cells, draws)
    assert rows.at[HYPERPARAMETERS, "kendall_tau"] == pytest.approx(brute_tau(base, g, draws))
    diff = rows.at["sharp", "kendall_tau"] - rows.at[HYPERPARAMETERS, "kendall_tau"]
    assert rows.at["sharp", "vs_hyperparameters"] == pytest.approx(diff)
    assert rows.at["sharp", "vs_hyperparameters_lo"] <= diff <= rows.at["sharp", "vs_hyperparameters_hi"]
    assert bool(rows.at["sharp", "beats_hyperparameters"]) == (rows.at["sharp", "vs_hyperparameters_lo"] > 0)
    assert list(a.variance["effect"]) == ["draw", "cell", "residual", "total"]
    assert a.variance.set_index("effect").at["draw", "share"] > 0.5


def test_a_study_of_one_draw_has_the_pooled_numbers():
    design = crossed({"lr": 4, "width": 3}, n_draws=1, seeds_per_draw=2)
    rng = np.random.default_rng(1)
    gap = 0.1 * design["lr"] + rng.normal(0, 0.05, len(design))
    sharp = 0.1 * design["lr"] + rng.normal(0, 0.05, len(design))
    table = as_table(design, gap.to_numpy(), {"sharp": sharp.to_numpy()}, seeds_per_draw=2)
    a = analyze(table, n_boot=200, n_perm=199)
    row = a.correlations.iloc[0]
    assert row["kendall_tau"] == row["kendall_tau_pooled"]
    assert a.variance.set_index("effect").at["draw", "df"] == 0
    note = a.references.set_index("measure").at[HYPERPARAMETERS, "note"]
    assert "leave-one-run-out" in note
