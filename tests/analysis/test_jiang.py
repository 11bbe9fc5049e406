"""Jiang et al.'s Ψ and CMI on unbalanced and tied designs (the classes of planted bugs that survived: an
axis whose ψ is undefined, CMI's pair count in unbalanced cells, CMI with ties in the measure) against
independent brute-force code."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pandas as pd
import pytest
from stat_designs import as_table, crossed

from flatbench.analysis.stats import analyze, conditional_mi


def _entropy(counts) -> float:
    total = sum(counts)
    return -sum(c / total * math.log2(c / total) for c in counts if c)


def _brute_cmi(measure, gap, codes: pd.DataFrame, axes: list[str]) -> tuple[dict[str, float], int]:
    """(Î(S) for every S with |S| ≤ 2 that leaves something to explain, the smallest number of distinct
    unordered pairs in a cell with H(V_g) > 0), by loops over ordered pairs and dictionaries."""
    n = len(gap)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j and gap[i] != gap[j]]
    scores, smallest = {}, None
    for size in range(3):
        for subset in itertools.combinations(axes, size):
            cells: dict[tuple, list[tuple[int, int, int, int]]] = {}
            for i, j in pairs:
                key = tuple((codes[a][i], codes[a][j]) for a in subset)
                vg = int(gap[i] > gap[j])
                vm = int(np.sign(measure[i] - measure[j])) + 1
                cells.setdefault(key, []).append((i, j, vg, vm))
            total = len(pairs)
            cond_h = mi = 0.0
            for items in cells.values():
                h_g = _entropy(Counter(vg for *_, vg, _ in items).values())
                if h_g > 1e-12:
                    unordered = len({frozenset((i, j)) for i, j, _, _ in items})
                    smallest = unordered if smallest is None else min(smallest, unordered)
                h_m = _entropy(Counter(vm for *_, vm in items).values())
                h_joint = _entropy(Counter((vg, vm) for *_, vg, vm in items).values())
                weight = len(items) / total
                cond_h += weight * h_g
                mi += weight * max(h_g + h_m - h_joint, 0.0)
            if cond_h > 1e-12:
                scores["+".join(subset) or "none"] = mi / cond_h
    return scores, int(smallest or 0)


def _unbalanced(seed: int):
    rng = np.random.default_rng(seed)
    design = crossed({"a": 3, "b": 2, "c": 2}, n_draws=3, drop=(0, 1, 7, 20, 21, 22))
    codes = pd.DataFrame({k: design[k].astype(str) for k in ("a", "b", "c")})
    gap = np.round(design["a"].to_numpy() * 0.2 + rng.normal(0, 0.15, len(design)), 2)  # ties in the gap too
    measure = np.round(gap + rng.normal(0, 0.2, len(design)), 1)  # many ties in the measure
    return codes, gap, measure


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cmi_with_ties_and_unbalanced_cells_by_brute_force(seed):
    codes, gap, measure = _unbalanced(seed)
    assert len(np.unique(measure)) < len(measure) - 5
    scores, smallest = _brute_cmi(measure, gap, codes, ["a", "b", "c"])
    result = conditional_mi(measure, gap, codes, ["a", "b", "c"], min_pairs=1)
    assert result.min_pairs == smallest
    assert result.per_set == pytest.approx(scores)
    assert result.score == pytest.approx(min(scores.values()))
    assert result.condition == min(scores, key=scores.get)
    # above the smallest cell the score is withheld, and the reason names the smallest cell
    withheld = conditional_mi(measure, gap, codes, ["a", "b", "c"], min_pairs=smallest + 1)
    assert math.isnan(withheld.score) and f"cells of {smallest} pair(s)" in withheld.reason


def test_cmi_of_a_batch_across_chunks_is_each_measures_brute_force_score():
    """`CMIPlan.scores` counts each table over the pairs i < j and adds its mirror image, a chunk of rows at
    a time: a batch longer than a chunk (tied, constant and reversed measures among its rows) gives every
    row its brute-force score over all ordered pairs."""
    from flatbench.analysis.stats import cmi_plan

    codes, gap, measure = _unbalanced(0)
    rng = np.random.default_rng(5)
    rows = [measure, -measure, np.ones_like(measure), gap]
    rows += [np.round(gap + rng.normal(0, s, len(gap)), 1) for s in np.linspace(0.05, 2.0, 17)]
    plan = cmi_plan(gap, codes, ["a", "b", "c"], min_pairs=1)
    assert len(rows) > plan.ROWS_PER_CHUNK
    _, names, per_set = plan.scores(np.stack(rows))
    for row, name, scores in zip(rows, names, per_set):
        brute, _ = _brute_cmi(row, gap, codes, ["a", "b", "c"])
        assert scores == pytest.approx(brute, abs=1e-12) and scores[name] == min(scores.values())


def test_cmi_pair_count_counts_a_diagonal_cell_once_per_unordered_pair():
    """An unbalanced cell of 3 runs at a = 0 next to 1 run at a = 1: conditioning on a, the cell (0, 0) holds
    3 unordered pairs (6 ordered), the off-diagonal cells (0, 1) and (1, 0) 3 each."""
    codes = pd.DataFrame({"a": ["0", "0", "0", "1"]})
    gap = np.array([0.1, 0.2, 0.3, 0.4])
    measure = np.array([1.0, 3.0, 2.0, 4.0])
    scores, smallest = _brute_cmi(measure, gap, codes, ["a"])
    result = conditional_mi(measure, gap, codes, ["a"], min_pairs=1)
    assert smallest == result.min_pairs == 3 and result.per_set == pytest.approx(scores)


def test_psi_with_an_axis_whose_psi_is_undefined():
    """b and c always change together, so neither varies alone: ψ_b and ψ_c are undefined, and Ψ is the
    mean over the defined ψ (here ψ_a alone), never a mean with a 0 or a NaN in it."""
    rng = np.random.default_rng(5)
    design = crossed({"train.lr": 3, "train.batch_size": 2}, n_draws=2)
    design["model.width"] = design["train.batch_size"]  # confounded with the batch size
    gap = rng.normal(size=len(design))
    measure = gap + rng.normal(size=len(design))
    result = analyze(as_table(design, gap, {"m": measure}), n_boot=0)
    row = result.correlations.iloc[0]
    assert math.isnan(row["psi_train.batch_size"]) and math.isnan(row["psi_model.width"])
    lr, seed = design["train.lr"].to_numpy(), design["draw"].to_numpy()
    taus = []
    for key in set(zip(design["train.batch_size"], seed)):
        idx = [r for r in range(len(gap)) if (design["train.batch_size"][r], seed[r]) == key]
        terms = [np.sign(measure[p] - measure[q]) * np.sign(gap[p] - gap[q])
                 for p, q in itertools.combinations(idx, 2) if lr[p] != lr[q]]
        taus.append(np.mean(terms))
    assert row["psi_train.lr"] == pytest.approx(np.mean(taus))
    assert row["psi"] == pytest.approx(np.mean(taus))
    assert math.isnan(row["psi_data"])  # no data axis
