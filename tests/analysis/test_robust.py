"""Dziugaite et al.'s sign errors with the noise filter and the replicate pairs (flatbench.analysis.stats.robust)
against brute force: the replicate noise, the pair weights, every environment, the numbers the report prints
(sign_error_mean and sign_error_worst), the rule for small environments, and the replicate share's test."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from stat_designs import as_table, crossed
from test_bootstrap import copy_pairs

from flatbench.analysis.stats import analyze, bootstrap_pvalue, pair_weight, replicate_sd, two_way_bootstrap


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _brute_weight(delta: float, sd: float) -> float:
    """(q − ½)₊, q = P(both gaps within |Δ|/2 of their means) for N(0, sd²) noise (Dziugaite et al.'s rule)."""
    if delta == 0:
        return 0.0
    within = 1.0 - 2.0 * (1.0 - _phi(abs(delta) / (2.0 * sd)))
    return max(within ** 2 - 0.5, 0.0)


def test_pair_weight_and_its_threshold():
    deltas = np.array([0.0, 0.1, 0.2, 0.209, 0.2106, 0.3, 1.0, -0.5])
    ours = pair_weight(deltas, 0.1)
    assert ours == pytest.approx([_brute_weight(d, 0.1) for d in deltas], abs=1e-12)
    assert ours[3] == 0 and ours[4] > 0  # the threshold is 2 · 1.0518 · σ = 0.2104 for σ = 0.1
    assert (pair_weight(deltas, math.nan) == (deltas != 0)).all()  # no replicate: no filter


def _unbalanced_study(seed: int, n_draws: int):
    rng = np.random.default_rng(seed)
    design = crossed({"train.lr": 3, "model.width": 2}, n_draws=n_draws, drop=(4, 13))
    n = len(design)
    gap = design["train.lr"].to_numpy() * 0.3 + design["model.width"].to_numpy() * 0.1 + rng.normal(0, 0.08, n)
    measure = gap + rng.normal(0, 0.1, n)
    measure[[2, 7]] = measure[9]  # ties in the measure
    return design, gap, measure


def test_sign_errors_and_the_reports_mean_and_worst_by_brute_force():
    design, gap, measure = _unbalanced_study(0, n_draws=5)
    axes = ["train.lr", "model.width"]
    result = analyze(as_table(design, gap, {"m": measure}), n_boot=0)
    row = result.correlations.iloc[0]
    # the replicate noise: pooled within-configuration SD
    cells = {}
    for r in range(len(gap)):
        cells.setdefault(tuple(design.loc[r, axes]), []).append(gap[r])
    ss = sum(sum((g - np.mean(v)) ** 2 for g in v) for v in cells.values() if len(v) > 1)
    dof = sum(len(v) - 1 for v in cells.values() if len(v) > 1)
    sd = math.sqrt(ss / dof)
    keys = [tuple(design.loc[r, axes]) for r in range(len(gap))]
    assert replicate_sd(gap, np.unique(keys, axis=0, return_inverse=True)[1].ravel()) == pytest.approx(sd)
    envs: dict[tuple, list[tuple[float, float]]] = {}
    for p, q in itertools.combinations(range(len(gap)), 2):
        differ = [a for a in axes if design.loc[p, a] != design.loc[q, a]]
        if len(differ) != 1 or design.loc[p, "draw"] != design.loc[q, "draw"]:  # pairs of one draw (issue 42)
            continue
        other = tuple(design.loc[p, a] for a in axes if a != differ[0])
        w = _brute_weight(gap[p] - gap[q], sd)
        envs.setdefault((differ[0], other), [])
        if w > 0:
            sm, sg = np.sign(measure[p] - measure[q]), np.sign(gap[p] - gap[q])
            envs[(differ[0], other)].append((w, 0.5 if sm == 0 else float(sm != sg)))
    frame = result.environments[result.environments["measure"] == "m"]
    assert len(frame) == len(envs)
    errors = {}
    for (axis, other), pairs in envs.items():
        name = ", ".join(f"{a}={float(v)!r}" for a, v in zip([a for a in axes if a != axis], other))
        got = frame[(frame["axis"] == axis) & (frame["environment"] == name)].iloc[0]
        assert got["n_pairs"] == len(pairs) and bool(got["averaged"]) == (len(pairs) >= 10)
        if pairs:
            e = sum(w * x for w, x in pairs) / sum(w for w, _ in pairs)
            assert got["sign_error"] == pytest.approx(e)
            assert got["ess"] == pytest.approx(sum(w for w, _ in pairs) ** 2 / sum(w * w for w, _ in pairs))
            if len(pairs) >= 10:
                errors[(axis, other)] = e
    assert 0 < len(errors) < len(envs)  # some environments averaged, some listed
    assert row["sign_error_mean"] == pytest.approx(np.mean(list(errors.values())))
    assert row["sign_error_worst"] == pytest.approx(max(errors.values()))  # the report's number
    assert row["n_environments"] == len(errors) and row["n_environments_small"] == len(envs) - len(errors)


def test_two_draws_leave_every_environment_small_and_say_so():
    """Axes of two levels and two draws: an environment holds at most 2 × 2 = 4 pairs."""
    rng = np.random.default_rng(1)
    design = crossed({"train.lr": 2, "model.width": 2, "train.batch_size": 2}, n_draws=2)
    gap = design["train.lr"].to_numpy() * 0.5 + rng.normal(0, 0.05, len(design))
    measure = gap + rng.normal(0, 0.1, len(design))
    result = analyze(as_table(design, gap, {"m": measure}), n_boot=0)
    row = result.correlations.iloc[0]
    assert math.isnan(row["sign_error_mean"]) and math.isnan(row["sign_error_worst"])
    envs = result.environments[result.environments["measure"] == "m"]
    assert row["n_environments"] == 0 and row["n_environments_small"] == len(envs) == 3 * 4
    assert (envs["n_pairs"] <= 4).all() and not envs["averaged"].any()
    assert any("every environment holds fewer than 10 pairs above the noise (at most" in n for n in result.notes)


def test_replicate_share_and_its_bootstrap_p_from_five_draws():
    rng = np.random.default_rng(2)
    design = crossed({"train.lr": 10}, n_draws=5)
    n = len(design)
    draw_effect = rng.normal(0, 0.05, 5)
    gap = design["train.lr"].to_numpy() * 0.1 + draw_effect[design["draw"]] + rng.normal(0, 0.02, n)
    measure = gap + rng.normal(0, 0.02, n)
    result = analyze(as_table(design, gap, {"m": measure}), n_boot=300, seed=4)
    row = result.correlations.iloc[0]
    cells, draws = design["train.lr"].to_numpy(), design["draw"].to_numpy()
    pairs = [(p, q) for p, q in itertools.combinations(range(n), 2) if cells[p] == cells[q]]
    conc = [float(np.sign(measure[p] - measure[q]) == np.sign(gap[p] - gap[q])) for p, q in pairs]
    assert row["n_seed_pairs"] == len(pairs) == 10 * 10 and row["seed_pairs_concordant"] == pytest.approx(np.mean(conc))
    boot = two_way_bootstrap(cells, draws, 300, seed=4)
    concordant = dict(zip(pairs, conc))
    shares = []
    for b in range(300):  # over the pairs of distinct copies of the resampled data set (test_bootstrap)
        counted = [(k, concordant[(i, j)]) for i, j, k in copy_pairs(boot.cells, boot.draws, boot.cell_weights[b],
                                                                      boot.draw_weights[b], True)
                   if (i, j) in concordant]
        total = sum(k for k, _ in counted)
        shares.append(sum(k * c for k, c in counted) / total if total else math.nan)
    assert row["seed_pairs_p"] == pytest.approx(bootstrap_pvalue(np.array(shares) - 0.5), abs=1e-12)
    assert 0.001 < row["seed_pairs_p"] < 0.05, row["seed_pairs_p"]  # the draw effect orders replicates


def test_no_replicate_test_below_five_draws():
    rng = np.random.default_rng(3)
    design = crossed({"train.lr": 12}, n_draws=4)
    gap = design["train.lr"].to_numpy() * 0.1 + rng.normal(0, 0.02, len(design))
    result = analyze(as_table(design, gap, {"m": gap}), n_boot=100)
    row = result.correlations.iloc[0]
    assert row["seed_pairs_concordant"] == 1.0 and math.isnan(row["seed_pairs_p"])
    assert any("conditional on these 4 data draws: no replicate-level test is possible" in n for n in result.notes)
