"""The report's figures: each returns a PNG on small synthetic inputs, edge cases included (one run, NaNs,
one level, nothing to draw)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from flatbench.analysis import plots, stats

PNG = b"\x89PNG\r\n\x1a\n"


def _table(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    gap = rng.uniform(0, 1, n)
    return pd.DataFrame({"run_id": [f"r{i}" for i in range(n)], "model.name": ["mlp"] * n,
                         "data.random_label_ratio": np.linspace(0, 1, n), "gap_acc": gap,
                         "m": 10 ** (1 + 3 * gap), "m#se": 0.1 * 10 ** (1 + 3 * gap), "k": gap + 0.1})


@pytest.mark.parametrize("n", [1, 6])
def test_measure_figure_with_stderr_bars(n):
    frame = _table(n)
    labels = plots.model_labels(frame)
    row = {"measure": "m", "kendall_tau": 1.0, "kendall_tau_lo": math.nan, "kendall_tau_hi": math.nan,
           "kendall_p": 2 / 120, "n": n, "note": ""}
    for key, se in (("m", "m#se"), ("k", None), ("k", "absent#se")):
        png = plots.measure_figure(frame, key, "acc", "gap_acc", labels, row, True, se_column=se)
        assert png.startswith(PNG)
    frame.loc[0, "m#se"] = math.nan
    frame.loc[n - 1, "m"] = math.nan
    assert plots.measure_figure(frame, "m", "acc", "gap_acc", labels, None, False, "m#se").startswith(PNG)
    # The old call (no SE argument) keeps working.
    assert plots.measure_figure(frame, "k", "acc", "gap_acc", labels, row, True).startswith(PNG)


def test_tau_text_shows_p_and_interval_only_when_there_is_one():
    row = {"kendall_tau": 1.0, "kendall_tau_lo": math.nan, "kendall_tau_hi": math.nan, "kendall_p": 2 / 120,
           "n": 5}
    text = plots._tau_text(row)
    assert "[" not in text and "p = 0.017" in text and "n = 5" in text
    row.update(kendall_tau_lo=0.5, kendall_tau_hi=1.0, kendall_p=math.nan)
    assert "[0.50, 1.00]" in plots._tau_text(row) and "p =" not in plots._tau_text(row)


def _history(epochs: int, ratio: float, eval_acc: bool = True, test: bool = True) -> list[dict]:
    out = []
    for e in range(1, epochs + 1):
        h = {"epoch": e, "train_acc": min(1.0, 0.2 + 0.8 * e / epochs), "train_loss": 1.0 / e}
        if eval_acc:
            h["eval_train_acc"] = h["train_acc"] - 0.01
        if test:
            h["test_acc"] = 0.2 + (0.7 - 0.6 * ratio) * e / epochs
        out.append(h)
    return out


def test_training_curves_figure():
    ratios = np.repeat([0.0, 0.5, 1.0], 10)
    many = [_history(8, r, eval_acc=bool(i % 2)) for i, r in enumerate(ratios)]
    assert plots.training_curves_figure(many, ratios).startswith(PNG)  # ≥ 20 runs: mean per ratio
    assert plots.training_curves_figure([_history(1, 0.2)], [0.2]).startswith(PNG)  # one run, one epoch
    no_test = [_history(5, 0.0, test=False), _history(5, 1.0, test=False)]
    assert plots.training_curves_figure(no_test, [0.0, None]).startswith(PNG)
    odd = [[{"epoch": 1, "train_acc": "nan"}, {"train_acc": 0.5, "test_acc": None}], [], None]
    assert plots.training_curves_figure(odd, [math.nan]).startswith(PNG)  # short ratio list, gaps
    assert plots.training_curves_figure({"a": _history(3, 0.5)}, {"a": 0.5}).startswith(PNG)
    assert plots.training_curves_figure([], None).startswith(PNG)


def test_history_curves_prefer_eval_train_acc():
    epochs, train, test, used_eval = plots._history_curves(
        [{"epoch": 2, "train_acc": 0.9, "eval_train_acc": 0.8, "test_acc": 0.5},
         {"epoch": 1, "train_acc": 0.6}])
    assert used_eval and list(epochs) == [1.0, 2.0]
    assert math.isnan(train[0]) and train[1] == 0.8 and math.isnan(test[0]) and test[1] == 0.5
    _, train, _, used_eval = plots._history_curves([{"epoch": 1, "train_acc": 0.6}])
    assert not used_eval and train[0] == 0.6


def _levels(measures: list[str], levels: list) -> pd.DataFrame:
    rng = np.random.default_rng(1)
    rows = []
    for m in measures:
        for lv in levels:
            t = float(rng.uniform(-0.5, 0.9))
            rows.append({"measure": m, "level": lv, "kendall_tau": t, "kendall_tau_lo": t - 0.2,
                         "kendall_tau_hi": min(1.0, t + 0.2), "n": 12})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("measures, levels", [
    (["a"], [1.0, 0.1, 0.01, "final"]),
    (["a", "b@normalized_ce", "c"], [0.5, 0.05, "final"]),
    ([f"m{i}" for i in range(9)], [1.0, 0.3, 0.1, "final"]),  # small multiples
    (["a"], ["final"]),
    (["a", "b"], [0.1]),
    (["a"], [0.0, 0.5, "final"]),  # a zero level: linear axis
])
def test_tau_by_level_figure(measures, levels):
    frame = _levels(measures, levels)
    assert plots.tau_by_level_figure(frame).startswith(PNG)
    frame.loc[0, ["kendall_tau", "kendall_tau_lo", "kendall_tau_hi"]] = math.nan
    frame["level"] = frame["level"].astype(str)  # as read back from a CSV
    assert plots.tau_by_level_figure(frame).startswith(PNG)


def test_tau_by_level_figure_empty():
    empty = pd.DataFrame(columns=["measure", "level", "kendall_tau"])
    assert plots.tau_by_level_figure(empty).startswith(PNG)


def test_comparison_and_ranking_figures_from_an_analysis():
    rng = np.random.default_rng(2)
    n = 15
    gap = rng.uniform(0, 1, n)
    part = gap.copy()
    part[:8] = np.nan
    table = pd.DataFrame({"run_id": [f"r{i}" for i in range(n)], "experiment": "e", "status": "finished",
                          "data.random_label_ratio": np.linspace(0, 1, n), "train_acc": 1.0,
                          "train_loss": 0.01, "test_acc": 1 - gap, "test_loss": 1.0, "gap_acc": gap,
                          "gap_loss": 1.0, "good": gap, "noise": rng.normal(size=n), "const": 1.0,
                          "partial": part})
    table.attrs["measure_columns"] = ["good", "noise", "const", "partial"]
    result = stats.analyze(table, n_boot=100, n_perm=199)
    order = result.correlations["measure"].tolist()
    assert plots.comparison_figure(result.comparisons, order).startswith(PNG)
    assert plots.comparison_figure(result.comparisons).startswith(PNG)
    assert plots.comparison_figure(result.comparisons.iloc[:0], []).startswith(PNG)
    assert plots.ranking_figure(result.correlations).startswith(PNG)
    many = [f"m{i}" for i in range(25)]
    rows = [{"measure_a": a, "measure_b": b, "n": 20, "tau_a": 0.5, "tau_b": 0.4, "diff": 0.1,
             "diff_lo": -0.1 if i % 2 else 0.05, "diff_hi": 0.3, "p_value": 0.3}
            for i, (a, b) in enumerate((a, b) for a in many for b in many if a != b)]
    assert plots.comparison_figure(pd.DataFrame(rows), many).startswith(PNG)
