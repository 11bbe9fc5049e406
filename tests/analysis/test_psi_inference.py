"""ψ per axis and its test (flatbench.analysis.stats.jiang, .psi_inference) against brute force: the blocks
and their τ, the two-way bootstrap of the block mean by an explicit loop, Holm over every ψ test of the
study, and the designs where no test is possible."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from stat_designs import as_table, codes_of, crossed

from flatbench.analysis.stats import (
    analyze,
    bootstrap_pvalue,
    granulated_kendall,
    holm,
    psi_blocks,
    psi_pvalues,
)
from flatbench.analysis.stats.psi_inference import BOOT_FACTOR, CHUNK


def _brute_psi(measure, gap, codes: pd.DataFrame, axes, axis, draws) -> tuple[float, dict]:
    """ψ_axis by loops: blocks = (other axes' values, draw); τ over the block's pairs at different levels."""
    blocks: dict[tuple, list[int]] = {}
    for r in range(len(gap)):
        key = (tuple(codes[a][r] for a in axes if a != axis), draws[r])
        blocks.setdefault(key, []).append(r)
    taus = {}
    for key, members in blocks.items():
        terms = [np.sign(measure[p] - measure[q]) * np.sign(gap[p] - gap[q])
                 for p, q in itertools.combinations(members, 2) if codes[axis][p] != codes[axis][q]]
        if terms:
            taus[key] = float(np.mean(terms))
    return (float(np.mean(list(taus.values()))) if taus else math.nan), taus


def test_psi_blocks_by_brute_force_with_two_seeds_per_draw_and_a_missing_run():
    rng = np.random.default_rng(0)
    design = crossed({"a": 3, "b": 2}, n_draws=2, seeds_per_draw=2, drop=(5,))
    codes = codes_of(design, ["a", "b"])
    gap = rng.normal(size=len(design))
    measure = np.round(gap + rng.normal(size=len(design)), 1)  # ties in the measure
    draws = design["draw"].to_numpy()
    for axis in ("a", "b"):
        blocks = psi_blocks(codes, ["a", "b"], axis, draws)
        ref, taus = _brute_psi(measure, gap, codes, ["a", "b"], axis, draws)
        ours = blocks.block_taus(measure[None, :], gap)[0]
        assert blocks.n_blocks == len(taus) and sorted(ours) == pytest.approx(sorted(taus.values()))
        assert float(ours.mean()) == pytest.approx(ref)
    # within = the draw column gives the same ψ through the public function
    codes_w = codes.assign(draw=[str(d) for d in draws])
    _, per_axis = granulated_kendall(measure, gap, codes_w, ["a", "b"], within=["draw"])
    assert per_axis["a"] == pytest.approx(_brute_psi(measure, gap, codes, ["a", "b"], "a", draws)[0])


def _explicit_psi_star(block_keys, taus, n_boot, seed, resample_draws):
    """ψ* by loops over resamples and blocks, with the documented chunked random numbers."""
    combos = list(dict.fromkeys(k for k, _ in block_keys))
    n_draws = max(d for _, d in block_keys) + 1
    out = []
    for c, start in enumerate(range(0, n_boot, CHUNK)):
        size = min(CHUNK, n_boot - start)
        rng = np.random.default_rng((seed, c))
        u_draws = rng.integers(0, len(combos), size=(size, len(combos)))
        v_draws = rng.integers(0, n_draws, size=(size, n_draws)) if resample_draws else None
        for b in range(size):
            u = np.bincount(u_draws[b], minlength=len(combos))
            v = np.bincount(v_draws[b], minlength=n_draws) if resample_draws else np.ones(n_draws)
            num = den = 0.0
            for (k, d), t in zip(block_keys, taus):
                weight = u[combos.index(k)] * v[d]
                num += weight * t
                den += weight
            out.append(num / den if den > 0 else math.nan)
    return np.array(out)


@pytest.mark.parametrize("n_draws", [2, 5])
def test_psi_pvalue_is_the_documented_two_way_bootstrap(n_draws):
    rng = np.random.default_rng(1)
    design = crossed({"a": 2, "b": 5, "c": 2}, n_draws=n_draws)  # K = 10 combinations for axis a
    codes = codes_of(design, ["a", "b", "c"])
    gap = design["a"].to_numpy() * 0.3 + rng.normal(size=len(design))
    measure = gap + rng.normal(size=len(design))
    blocks = psi_blocks(codes, ["a", "b", "c"], "a", design["draw"].to_numpy())
    taus = blocks.block_taus(measure[None, :], gap)[0]
    keys = list(zip(blocks.combo, blocks.draw))
    n_boot = 60
    p, why = psi_pvalues(blocks, taus[None, :], n_boot, seed=3)
    star = _explicit_psi_star(keys, taus, BOOT_FACTOR * n_boot, 3, n_draws >= 5)
    assert why == "" and p[0] == pytest.approx(bootstrap_pvalue(star), abs=1e-12)
    below, zero = np.sum(star < 0), np.sum(star == 0)
    assert p[0] == pytest.approx(min(1, 2 * min(below + zero / 2 + 1, len(star) - below - zero + zero / 2 + 1)
                                     / (len(star) + 1)))


def test_no_test_with_fewer_than_ten_units():
    """A single-axis study has one combination of the other axes: with 2 draws its ψ cannot be tested (a
    percentile bootstrap over so few units is far too liberal), and the notes say so."""
    rng = np.random.default_rng(2)
    design = crossed({"data.random_label_ratio": 11}, n_draws=2)
    gap = design["data.random_label_ratio"] * 0.1 + rng.normal(0, 0.01, len(design))
    result = analyze(as_table(design, gap, {"m": gap + rng.normal(0, 0.01, len(design))}), n_boot=100)
    row = result.correlations.iloc[0]
    assert row["psi_data.random_label_ratio"] > 0.8 and math.isnan(row["p_psi_data.random_label_ratio"])
    assert result.psi_family == 0
    assert any("no ψ test is possible: data.random_label_ratio (1 combination(s) of the other axes and 2 draw(s)" in n
               for n in result.notes)


def test_holm_over_every_psi_test_of_the_study_by_brute_force():
    """p_psi_holm_<axis> is Holm's step-down over all (measure, axis) p-values together; the references are
    outside the family (their adjusted p is NaN) and the notes give the family size."""
    rng = np.random.default_rng(3)
    design = crossed({"train.lr": 2, "train.batch_size": 2, "model.width": 3, "data.n_train": 2}, n_draws=2)
    n = len(design)
    gap = design["train.lr"] * 0.2 + design["data.n_train"] * 0.1 + rng.normal(0, 0.05, n)
    measures = {"good": gap + rng.normal(0, 0.05, n), "lr_only": design["train.lr"] + rng.normal(0, 0.1, n),
                "noise": rng.normal(size=n)}
    result = analyze(as_table(design, gap, measures), n_boot=300)
    corr = result.correlations.set_index("measure")
    axes = result.axes
    raw = [(m, a, corr.loc[m, f"p_psi_{a}"]) for m in measures for a in axes]
    finite = [(m, a, p) for m, a, p in raw if math.isfinite(p)]
    k = len(finite)
    order = sorted(finite, key=lambda t: t[2])
    running = 0.0
    expected = {}
    for i, (m, a, p) in enumerate(order):
        running = max(running, min(1.0, (k - i) * p))
        expected[(m, a)] = running
    for (m, a), value in expected.items():
        assert corr.loc[m, f"p_psi_holm_{a}"] == pytest.approx(value, abs=1e-12)
    # model.width has 2 × 2 × 2 = 8 combinations of the other axes (fewer than 10 units): untested
    assert corr[["p_psi_model.width"]].isna().all().all()
    assert result.psi_family == k == len(measures) * (len(axes) - 1)
    assert any(f"over all {k} ψ tests" in note for note in result.notes)
    assert result.references[[f"p_psi_holm_{a}" for a in axes]].isna().all().all()
    assert np.allclose(holm(np.array([p for *_, p in finite])), [expected[(m, a)] for m, a, _ in finite])
    # the measure that follows the learning rate is significant on it, noise on nothing
    assert corr.loc["lr_only", "p_psi_holm_train.lr"] <= 0.05
    assert (corr.loc["noise", [f"p_psi_holm_{a}" for a in axes]].dropna() > 0.05).all()


def test_psi_over_training_axes_and_psi_data_over_data_axes():
    rng = np.random.default_rng(4)
    design = crossed({"train.lr": 2, "data.augment": 2, "data.n_train": 2, "data.random_label_ratio": 2}, 2)
    n = len(design)
    gap = rng.normal(size=n)
    m = gap + rng.normal(size=n)
    result = analyze(as_table(design, gap, {"m": m}), n_boot=0)
    row = result.correlations.iloc[0]
    assert result.design.training_axes == ["train.lr", "data.augment"]  # data.augment is a training hyperparameter
    assert result.design.data_axes == ["data.n_train", "data.random_label_ratio"]
    assert row["psi"] == pytest.approx((row["psi_train.lr"] + row["psi_data.augment"]) / 2)
    assert row["psi_data"] == pytest.approx((row["psi_data.n_train"] + row["psi_data.random_label_ratio"]) / 2)
