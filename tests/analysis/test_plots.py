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
    text = plots.tau_text(row)
    assert "[" not in text and "p = 0.017" in text and "n = 5" in text
    row.update(kendall_tau_lo=0.5, kendall_tau_hi=1.0, kendall_p=math.nan)
    assert "[0.50, 1.00]" in plots.tau_text(row) and "p =" not in plots.tau_text(row)


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
    epochs, train, test, used_eval = plots.history_curves(
        [{"epoch": 2, "train_acc": 0.9, "eval_train_acc": 0.8, "test_acc": 0.5},
         {"epoch": 1, "train_acc": 0.6}])
    assert used_eval and list(epochs) == [1.0, 2.0]
    assert math.isnan(train[0]) and train[1] == 0.8 and math.isnan(test[0]) and test[1] == 0.5
    _, train, _, used_eval = plots.history_curves([{"epoch": 1, "train_acc": 0.6}])
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


def test_sign_error_figure():
    env = pd.DataFrame({"measure": ["a"] * 3 + ["b"] * 2, "axis": ["x"] * 5, "environment": list("pqrpq"),
                        "n_pairs": [4] * 5, "sign_error": [0.0, 0.25, 0.5, 0.75, 1.0]})
    png = plots.sign_error_figure(env, ["b", "a"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.sign_error_figure(env.iloc[:0])[:8] == b"\x89PNG\r\n\x1a\n"


def _sparse_history(epochs: int, every: int, ratio: float) -> list[dict]:
    """A history as training writes it with `train.eval_every: every`: the running accuracy every epoch, the
    whole-set evaluation (eval_train_acc, test_acc) only every `every` epochs."""
    out = []
    for e in range(1, epochs + 1):
        h = {"epoch": e, "train_acc": min(1.0, 0.3 + 0.7 * e / epochs), "train_loss": 1.0 / e}
        if e % every == 0:
            h.update(eval_train_acc=h["train_acc"], test_acc=0.3 + (0.6 - 0.5 * ratio) * e / epochs)
        out.append(h)
    return out


@pytest.mark.parametrize("n_runs", [4, 24])
def test_training_curves_start_at_epoch_1_and_mark_every_evaluated_epoch(n_runs):
    """With eval_every: 5 each run's train lines (accuracy and loss) hold every epoch from epoch 1 (the
    running values), its test line exactly its evaluated epochs (5, 10, ...) with a marker on each: a line
    through the unevaluated epochs would break into invisible single points."""
    histories = {f"run{i}": _sparse_history(23 + i % 3, 5, i / n_runs) for i in range(n_runs)}
    ratios = {name: i / n_runs for i, name in enumerate(histories)}
    fig = plots.draw_training_curves(histories, ratios, target_loss=0.01)
    train_ax, test_ax, loss_ax = fig.axes[:3]
    for ax in (train_ax, test_ax, loss_ax):
        lines = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
        assert set(lines) == set(histories)
        for name, history in histories.items():
            want = [h["epoch"] for h in history if "test_acc" in h] if ax is test_ax else [h["epoch"] for h in history]
            assert list(lines[name].get_xdata()) == want and want[0] == (5 if ax is test_ax else 1), name
            assert np.isfinite(lines[name].get_ydata()).all()
            if ax is test_ax:
                assert lines[name].get_marker() not in (None, "None", "", " ")
    assert any(list(line.get_ydata()) == [0.01, 0.01] for line in loss_ax.get_lines())  # the loss target
    assert plots.training_curves_figure(histories, ratios).startswith(PNG)


def test_training_curves_of_a_committed_study_with_eval_every_5():
    """Ibayashi et al.'s committed study evaluates every 5 epochs: every run's train line starts at epoch 1
    and its test line holds each of its evaluated epochs (the figure's data, not its pixels)."""
    import json
    from pathlib import Path

    import yaml

    exp = Path(__file__).resolve().parents[2] / "results" / "cpu" / "ibayashi_mnist"
    assert yaml.safe_load((exp / "study.yaml").read_text())["train"]["eval_every"] == 5
    infos = [json.loads(p.read_text()) for p in sorted((exp / "runs").glob("*/run.json"))]
    histories = {info["run_id"]: info["history"] for info in infos}
    ratios = {info["run_id"]: info["config"]["data"]["random_label_ratio"] for info in infos}
    fig = plots.draw_training_curves(histories, ratios)
    for ax, key in zip(fig.axes[:2], ("train_acc", "test_acc")):
        lines = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
        assert set(lines) == set(histories)
        for run, history in histories.items():
            evaluated = [float(h["epoch"]) for h in history if h.get(key) is not None]
            assert list(lines[run].get_xdata()) == evaluated, run
            if key == "test_acc":
                assert len(evaluated) >= 2 and all(e % 5 == 0 for e in evaluated[:-1])
                assert lines[run].get_marker() not in (None, "None", "", " ")
            else:
                assert evaluated[0] == 1.0


def test_scatter_grid_maps_points_to_their_pixels():
    """The hover's pixel positions follow the data: within a panel a larger gap is further right and a larger
    value higher up (smaller y from the top), and every point is inside the image."""
    frame = _table(12)
    frame["k2"] = -frame["k"]
    labels = plots.model_labels(frame)
    rows = {"m": {"kendall_tau": 1.0, "kendall_p": 0.0001, "n": 12}}
    drawn = plots.scatter_grid(frame, ["m", "k", "k2"], "acc", "gap_acc", labels, rows, {"k2": True})
    assert drawn.png.startswith(PNG) and drawn.panels == ["m", "k", "k2"]
    pts = np.array(drawn.points)
    assert len(pts) == 3 * 12
    assert (pts[:, 0] >= 0).all() and (pts[:, 0] <= drawn.width).all()
    assert (pts[:, 1] >= 0).all() and (pts[:, 1] <= drawn.height).all()
    gap = frame["gap_acc"].to_numpy()
    for panel, sign in ((1, 1), (2, -1)):
        part = pts[pts[:, 3] == panel]
        order = np.argsort(gap[part[:, 2].astype(int)])
        assert (np.diff(part[order, 0]) > 0).all()  # x follows the gap
        assert (sign * np.diff(part[order, 1]) < 0).all()  # y (from the top) falls as the value grows


def test_one_p_format():
    from flatbench.analysis.fmt import p_phrase, p_text

    assert [p_text(p) for p in (0.0001, 0.0034, 0.017, 0.5, 1.0, math.nan, None, True)] == \
        ["<0.001", "0.0034", "0.017", "0.500", "1", "n/a", "n/a", "n/a"]
    assert p_phrase(0.0001) == "p < 0.001" and p_phrase(0.017) == "p = 0.017"
    row = {"kendall_tau": 0.5, "kendall_tau_lo": 0.1, "kendall_tau_hi": 0.8, "kendall_p": 1e-5, "n": 24}
    assert plots.tau_text(row) == "Kendall τ = 0.50 [0.10, 0.80], p < 0.001, n = 24"


def test_matrices_at_40_measures_fit_the_page():
    import io

    from PIL import Image as PILImage

    names = [f"measure_number_{i}@normalized_ce" for i in range(40)]
    rng = np.random.default_rng(3)
    matrix = pd.DataFrame(rng.uniform(-1, 1, (40, 40)), index=names, columns=names)
    families = {m: ("norm", "curvature", "sharpness")[i % 3] for i, m in enumerate(names)}
    png = plots.agreement_figure(matrix, families)
    width, height = PILImage.open(io.BytesIO(png)).size
    assert width <= plots.PAGE_WIDTH * plots.DPI + 1 and height < 1.3 * width


def test_ratio_colour_bar_shows_only_the_studys_ratios():
    """A study with ratios 0 and 0.5 gets a key of two swatches labelled 0 and 0.5, each in the colour its
    points have (RATIO_NORM on [0, 1], the same in every figure), not a bar over [0, 1]; without ratios, the
    continuous bar."""
    from matplotlib import colormaps

    from flatbench.analysis.plots.common import CMAP, RATIO_NORM, new_figure, ratio_colorbar

    fig = new_figure(4, 3)
    ax = fig.add_subplot()
    cbar = ratio_colorbar(fig, ax, 8, ratios=[0.5, 0.0, math.nan, 0.5, 0.0])
    assert [t.get_text() for t in cbar.ax.get_yticklabels()] == ["0", "0.5"]
    assert len(cbar.cmap.colors) == 2
    for colour, ratio in zip(cbar.cmap.colors, (0.0, 0.5)):
        assert np.allclose(colour, colormaps[CMAP](RATIO_NORM(ratio)))
    plain = ratio_colorbar(new_figure(4, 3), new_figure(4, 3).add_subplot(), 8)
    assert plain.norm.vmin == 0.0 and plain.norm.vmax == 1.0


def test_figures_give_the_ratio_key_their_runs_ratios(monkeypatch):
    """The scatter grid, the single-measure figure, the design (hyperparameter) figure and the training curves
    pass their runs' ratios to the colour key, so it lists the study's ratios only."""
    from flatbench.analysis.plots import common, design, scatter, training

    seen = []
    real = common.ratio_colorbar

    def spy(fig, axes, fontsize, shrink=1.0, ratios=None):
        seen.append(common.study_ratios(ratios))
        return real(fig, axes, fontsize, shrink, ratios)

    for module in (scatter, design, training):
        monkeypatch.setattr(module, "ratio_colorbar", spy)
    frame = _table(8)
    frame["data.random_label_ratio"] = [0.0, 0.5] * 4
    frame["train.lr"] = [1e-3] * 4 + [3e-3] * 4
    labels = plots.model_labels(frame)
    row = {"kendall_tau": 0.5, "kendall_p": 0.1, "n": 8}
    plots.measure_figure(frame, "m", "acc", "gap_acc", labels, row, True)
    plots.scatter_grid(frame, ["m", "k"], "acc", "gap_acc", labels, {"m": row})
    design.axis_figure(frame, "train.lr", ["m"], "acc", "gap_acc", labels, {"m": row})
    plots.training_curves_figure({"a": _history(3, 0.0), "b": _history(3, 0.5)}, {"a": 0.0, "b": 0.5})
    assert seen == [[0.0, 0.5]] * 4
