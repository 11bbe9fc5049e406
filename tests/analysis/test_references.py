"""The reference rows (flatbench.analysis.stats.references): the floor `ref.random` and the ceiling
`ref.replicate_gap`, against brute force, and where they must stand on designed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps
from stat_designs import as_table, crossed

from flatbench.analysis.stats import N_RANDOM, analyze, replicate_gap
from flatbench.analysis.stats.references import RANDOM_STREAM


def test_replicate_gap_is_the_mean_of_the_other_replicates():
    gap = np.array([0.1, 0.3, 0.5, 0.9, 0.2, 0.7])
    cells = np.array([0, 0, 0, 1, 2, 2])
    ours = replicate_gap(gap, cells)
    expected = [np.mean([g for k, g in enumerate(gap) if cells[k] == cells[r] and k != r]) if (cells == cells[r]).sum() > 1
                else math.nan for r in range(len(gap))]
    assert np.allclose(ours, expected, equal_nan=True)


def _study(seed: int, n_draws: int = 2, levels=None):
    rng = np.random.default_rng(seed)
    design = crossed(levels or {"train.lr": 4, "model.width": 4, "data.n_train": 2}, n_draws=n_draws)
    n = len(design)
    effect = rng.normal(0, 1, len(design.drop_duplicates(subset=[c for c in design.columns if c not in ("draw", "init")])))
    return rng, design, n, effect


def test_random_reference_is_the_mean_over_its_draws_with_its_band():
    rng, design, n, _ = _study(0)
    gap = design["train.lr"].to_numpy() * 0.1 + rng.normal(0, 0.05, n)
    result = analyze(as_table(design, gap, {"m": gap + rng.normal(0, 0.05, n)}), n_boot=50, seed=3)
    row = result.references.set_index("measure").loc["ref.random"]
    x = np.random.default_rng([3, RANDOM_STREAM]).standard_normal((N_RANDOM, n))
    pooled = np.array([sps.kendalltau(xi, gap).statistic for xi in x])
    same = design["draw"].to_numpy()[:, None] == design["draw"].to_numpy()[None, :]
    sy = np.sign(gap[:, None] - gap[None, :]) * same
    taus = np.array([(np.sign(xi[:, None] - xi[None, :]) * sy).sum() / (same.sum() - n) for xi in x])  # within draws
    rhos = np.array([sps.spearmanr(xi, gap).statistic for xi in x])
    assert row["kendall_tau"] == pytest.approx(taus.mean(), abs=1e-12)
    assert row["kendall_tau_pooled"] == pytest.approx(pooled.mean(), abs=1e-12)
    assert (row["kendall_tau_lo"], row["kendall_tau_hi"]) == pytest.approx(tuple(np.quantile(taus, [0.025, 0.975])))
    assert row["spearman_rho"] == pytest.approx(rhos.mean(), abs=1e-12)
    bands = result.reference_bands.set_index("statistic")
    assert bands.loc["kendall_tau", "q975"] == pytest.approx(np.quantile(taus, 0.975))
    assert set(bands.index) >= {"kendall_tau", "spearman_rho", "pearson_r", "psi", "psi_data", "cmi",
                                "sign_error_mean", "sign_error_worst", "seed_pairs_concordant",
                                "psi_train.lr", "psi_model.width", "psi_data.n_train"}
    assert row["kind"] == "reference" and row["vs_best"] == "" and math.isnan(row["kendall_p"])


def test_floor_is_near_zero():
    """On 64 configurations × 2 draws a pure-noise measure's τ, ψ and Ψ centre on 0 and its CMI is small."""
    rng, design, n, _ = _study(1, levels={"train.lr": 4, "model.width": 4, "train.batch_size": 2, "data.n_train": 2})
    gap = design["train.lr"].to_numpy() * 0.1 + rng.normal(0, 0.05, n)
    result = analyze(as_table(design, gap, {"m": gap}), n_boot=0)
    row = result.references.set_index("measure").loc["ref.random"]
    assert abs(row["kendall_tau"]) < 0.02 and abs(row["spearman_rho"]) < 0.03 and abs(row["pearson_r"]) < 0.03
    for col in ("psi", "psi_data", "psi_train.lr", "psi_model.width", "psi_train.batch_size", "psi_data.n_train"):
        assert abs(row[col]) < 0.05, col
    assert 0 <= row["cmi"] < 0.01
    assert abs(row["seed_pairs_concordant"] - 0.5) < 0.03
    bands = result.reference_bands.set_index("statistic")
    assert bands.loc["kendall_tau", "q025"] < 0 < bands.loc["kendall_tau", "q975"] < 0.2


def test_ceiling_beats_every_measure_when_the_gap_is_a_noisy_function_of_the_configuration():
    """gap = f(configuration) + noise; the measures are f plus more noise, a monotone transform of it, a part of
    f, or noise. The other replicates' gap tracks the gap better than every one of them (τ, Ψ, CMI, sign
    errors), and the references stay out of the best group and of the ψ family."""
    levels = {"train.lr": 4, "model.width": 3, "train.batch_size": 2, "data.n_train": 2}
    rng, design, n, _ = _study(2, n_draws=3, levels=levels)
    f = (design["train.lr"] * 0.3 + design["model.width"] * 0.2 + design["train.batch_size"] * 0.25
         + design["data.n_train"] * 0.15).to_numpy()
    gap = f + rng.normal(0, 0.1, n)
    measures = {"noisy_f": f + rng.normal(0, 0.2, n), "exp_noisy_f": np.exp(f + rng.normal(0, 0.15, n)),
                "lr_part": design["train.lr"].to_numpy() + rng.normal(0, 0.1, n), "noise": rng.normal(size=n)}
    result = analyze(as_table(design, gap, measures), n_boot=100)
    corr = result.correlations.set_index("measure")
    ceiling = result.references.set_index("measure").loc["ref.replicate_gap"]
    for m in measures:
        assert ceiling["kendall_tau"] > corr.loc[m, "kendall_tau"], m
        assert ceiling["psi"] > corr.loc[m, "psi"], m
        assert ceiling["cmi"] > corr.loc[m, "cmi"], m
        assert ceiling["sign_error_mean"] <= corr.loc[m, "sign_error_mean"], m  # within one draw lr_part can be
        assert ceiling["sign_error_worst"] <= corr.loc[m, "sign_error_worst"], m  # as perfect as the ceiling
    assert "ref.replicate_gap" not in set(result.correlations["measure"])
    assert set(result.all_rows()["kind"]) == {"measure", "reference"}
    assert list(result.all_rows()["measure"][-2:]) == ["ref.random", "ref.replicate_gap"]
    assert result.psi_family == int(corr[[c for c in corr.columns if c.startswith("p_psi_")
                                          and not c.startswith("p_psi_holm_")]].notna().to_numpy().sum())
