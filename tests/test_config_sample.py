"""Sampled study configs (`sample:`, flatbench.config.sample): the Latin-hypercube property, determinism,
stable run ids, expansion against the seeds and grid lists, and one-line errors."""

from __future__ import annotations

import math
import os
from collections import Counter

import numpy as np
import pytest

from flatbench.config import apply_overrides, parse_study, run_config_from_dict
from flatbench.config.sample import SampleSpec, draw, parse_axis, strata
from flatbench.errors import ConfigError
from tests.project_scripts import load_script

if os.environ.get("CI"):
    import hypothesis  # noqa: F401  CI installs the test extra: a missing Hypothesis is a failure there
else:
    pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

AXES = {"train.lr": {"log_uniform": [1.0e-4, 3.0e-3]},
        "train.weight_decay": {"log_uniform": [1.0e-6, 1.0e-3]},
        "model.hidden_width": {"log_uniform_int": [32, 512]},
        "model.hidden_depth": {"choice": [1, 2, 3]},
        "model.batch_norm": {"choice": [False, True]},
        "train.batch_size": {"choice": [32, 64, 128]}}


def sampled(n: int = 6, seed: int = 0, axes: dict | None = None, **extra) -> dict:
    return {"seed": [0, 1, 2], "sample": {"method": "latin_hypercube", "n": n, "seed": seed, "axes": axes or AXES},
            **extra}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), seed=st.integers(0, 2**31), axis=st.sampled_from(["train.lr", "model.dropout"]))
def test_each_stratum_holds_exactly_one_point(n, seed, axis):
    perm, points = strata(n, seed, axis)
    assert sorted(perm) == list(range(n))
    assert [math.floor(u * n) for u in points] == perm and all(0 <= u < 1 for u in points)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 60), seed=st.integers(0, 1000))
def test_the_values_keep_the_hypercube_and_choices_split_evenly(n, seed):
    spec = SampleSpec("latin_hypercube", n, seed, (parse_axis("a", {"uniform_int": [0, n - 1]}),
                                                   parse_axis("b", {"choice": ["x", "y", "z"]}),
                                                   parse_axis("c", {"log_uniform": [1e-3, 1.0]})))
    cells = draw(spec)
    assert sorted(c["a"] for c in cells) == list(range(n))  # integer strata: one value per stratum
    counts = Counter(c["b"] for c in cells)
    assert max(counts.values()) - min(counts.values(), default=0) <= 1 and len(counts) == min(3, n)
    assert all(1e-3 <= c["c"] <= 1.0 and float(f"{c['c']:.3g}") == c["c"] for c in cells)
    logs = sorted(math.floor(n * math.log(c["c"] / 1e-3) / math.log(1e3)) for c in cells)
    assert sum(a != b for a, b in zip(logs, range(n))) <= n // 4 + 1  # rounding to 3 digits moves few


def test_the_design_is_deterministic_and_each_axis_has_its_own_stream():
    a, b = parse_study(sampled()), parse_study(sampled())
    assert a.run_ids() == b.run_ids()
    assert parse_study(sampled(seed=1)).run_ids() != a.run_ids()
    fewer = parse_study(sampled(axes={k: v for k, v in AXES.items() if k != "model.batch_norm"}))
    lrs = [r.train.lr for _, r in a.runs]
    assert lrs == [r.train.lr for _, r in fewer.runs]  # dropping an axis leaves the others' draws


def test_the_drawn_values_are_pinned():
    """The draws of one design, written down: a change of the algorithm would move every sampled study's
    run ids (its finished runs would no longer be found)."""
    runs = [r for _, r in parse_study(sampled(n=4)).runs if r.seed == 0]
    got = [(r.train.lr, r.train.weight_decay, r.model.widths, r.model.batch_norm, r.train.batch_size) for r in runs]
    assert got == PINNED, got
    assert parse_study(sampled(n=4)).run_ids()[0] == "mlp-mnist_mini-r0.00-s0-11e1d808"


PINNED = [(0.00012, 5.97e-06, (413,), False, 64), (0.000272, 1.03e-06, (50, 50), True, 32),
          (0.00201, 6.33e-05, (79, 79, 79), True, 128), (0.000754, 0.000473, (239,), False, 32)]


def test_expansion_is_cells_times_seeds_times_grid_and_ids_match_the_plain_config():
    study = parse_study(sampled(n=5, train={"epochs": [3, 4]}))
    assert len(study.runs) == 5 * 3 * 2
    cells = Counter(r.sample_cell for _, r in study.runs)
    assert cells == {i: 6 for i in range(5)}
    run = study.runs[0][1]
    same = {"seed": run.seed, "model": {"widths": list(run.model.widths), "batch_norm": run.model.batch_norm},
            "train": {"lr": run.train.lr, "weight_decay": run.train.weight_decay,
                      "batch_size": run.train.batch_size, "epochs": run.train.epochs}}
    assert parse_study(same).run_ids() == [study.runs[0][0]]  # the cell is not part of the identity
    assert {"train.lr", "model.widths", "train.epochs", "seed"} <= set(study.sweep_axes)
    assert run.to_dict()["sample_cell"] == run.sample_cell
    assert run_config_from_dict(run.to_dict()) == run
    assert "sample_cell" not in parse_study({}).runs[0][1].to_dict()  # grid studies' run.json unchanged


def test_one_hidden_axis_takes_the_other_from_model_widths():
    depth = parse_study(sampled(axes={"model.hidden_depth": {"choice": [1, 3]}}, model={"widths": [64]}, n=2))
    assert sorted({r.model.widths for _, r in depth.runs}) == [(64,), (64, 64, 64)]
    width = parse_study(sampled(axes={"model.hidden_width": {"uniform_int": [10, 20]}}, n=3))
    assert all(len(r.model.widths) == 2 for _, r in width.runs)  # the default's two layers


def test_overrides_reach_a_sampled_axis():
    raw = apply_overrides(sampled(), ["sample.axes.train.lr={log_uniform: [0.01, 0.1]}", "sample.n=3"])
    assert all(0.01 <= r.train.lr <= 0.1 for _, r in parse_study(raw).runs)
    assert len(parse_study(raw).runs) == 9


@pytest.mark.parametrize("sample, extra, fragment", [
    ({"n": 4, "axes": {"train.lr": {"log_uniform": [1e-3, 1e-2]}}, "size": 3}, {}, "unknown key 'sample.size'"),
    ({"n": 4, "method": "sobol", "axes": {"train.lr": {"uniform": [0, 1]}}}, {}, "unknown method 'sobol'"),
    ({"axes": {"train.lr": {"uniform": [0, 1]}}}, {}, "sample.n is missing"),
    ({"n": 0, "axes": {"train.lr": {"uniform": [0, 1]}}}, {}, "sample.n must be in [1, 10,000]"),
    ({"n": 10**6, "axes": {"train.lr": {"uniform": [0, 1]}}}, {}, "sample.n must be in [1, 10,000]"),
    ({"n": 4, "axes": {}}, {}, "sample.axes must map at least one"),
    ({"n": 4, "axes": {"train.lrr": {"uniform": [0, 1]}}}, {}, "unknown config field 'train.lrr' (did you mean"),
    ({"n": 4, "axes": {"train.lr": {"gauss": [0, 1]}}}, {}, "unknown distribution 'gauss'"),
    ({"n": 4, "axes": {"train.lr": {"log_uniform": [0, 1]}}}, {}, "a log range needs lo > 0"),
    ({"n": 4, "axes": {"train.lr": {"uniform": [0.1, 0.01]}}}, {}, "needs lo < hi"),
    ({"n": 4, "axes": {"train.lr": {"uniform": [0.1]}}}, {}, "must be a range [lo, hi]"),
    ({"n": 4, "axes": {"train.lr": {"uniform": [0, "x"]}}}, {}, "expected a finite number"),
    ({"n": 4, "axes": {"train.lr": {"log_uniform": [1e-4, 1e-2]}}}, {"train": {"lr": [0.1, 0.2]}},
     "train.lr is both sampled (sample.axes) and given in 'train'"),
    ({"n": 4, "axes": {"train.batch_size": {"uniform": [8, 64]}}}, {}, "integer field: use uniform_int"),
    ({"n": 4, "axes": {"model.batch_norm": {"uniform": [0, 1]}}}, {}, "is not a number: use {choice"),
    ({"n": 4, "axes": {"data.seed": {"choice": [1, 2]}}}, {}, "a data draw is a replicate"),
    ({"n": 4, "axes": {"train.workers": {"choice": [1, 2]}}}, {}, "cannot be sampled"),
    ({"n": 4, "axes": {"model.batch_norm": {"choice": [True, False, True]}}}, {}, "lists a value twice"),
    ({"n": 3, "axes": {"model.batch_norm": {"choice": [True, False]}}}, {}, "drew the same values"),
    ({"n": 2, "axes": {"train.lr": {"choice": [0.1, -1.0]}}}, {}, "train.lr must be positive"),
    ({"n": 4, "axes": {"model.hidden_width": {"uniform_int": [8, 64]}}}, {"model": {"name": "lenet"}},
     "model.name must be mlp"),
    ({"n": 4, "axes": {"model.hidden_width": {"uniform_int": [8, 64]},
                       "model.hidden_depth": {"choice": [1, 2]}}}, {"model": {"widths": [[8], [16]]}},
     "model.widths is both sampled"),
    ("latin", {}, "sample must be a mapping"),
])
def test_a_bad_sample_section_is_one_line(sample, extra, fragment):
    with pytest.raises(ConfigError) as err:
        parse_study({"sample": sample, **extra})
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_the_pilot_decomposition_finds_what_was_planted():
    decompose = load_script("natural_sampled_pilot").decompose
    rng = np.random.default_rng(0)
    draws, cells = rng.normal(0, 1.0, (10, 1)), rng.normal(0, 1.0, (1, 24))
    strong = decompose(draws + cells + rng.normal(0, 0.1, (10, 24)))
    assert strong["omega2_cell"] > 0.95 and 0.2 < strong["draw_share"] < 0.8
    none = decompose(draws + 0 * cells + rng.normal(0, 0.1, (10, 24)))
    assert abs(none["omega2_cell"]) < 0.05 and none["draw_share"] > 0.95
    total = strong["draw_share"] + strong["cell_share"] + strong["error_share"]
    assert total == pytest.approx(1.0)


def test_leave_one_cell_out_finds_a_share_resting_on_one_cell():
    pilot = load_script("natural_sampled_pilot")
    rng = np.random.default_rng(1)
    gap = rng.normal(0, 0.1, (6, 8))
    gap[:, 5] += 5.0  # one outlying configuration carries all the between-cell variance
    assert pilot.decompose(gap)["omega2_cell"] > 0.9
    low, cell = pilot.leave_one_cell_out(gap)
    assert cell == 5 and low < 0.2


def test_the_sampled_natural_studies_keep_the_referees_design():
    """Issue 42: the full test set for every draw, 1,000 to 2,000 training images, at least 10 draws crossed
    with the sampled configurations, width and weight decay among the sampled axes, the accuracy gap as the
    report's gap, and a second dataset with the same design."""
    from pathlib import Path

    import yaml

    from flatbench.config import load_study

    root = Path(__file__).resolve().parents[1] / "configs" / "cpu"
    fashion, mnist = load_study(root / "natural_sampled.yaml"), load_study(root / "natural_sampled_mnist.yaml")
    for study in (fashion, mnist):
        runs = [r for _, r in study.runs]
        assert all(r.data.n_test is None and 1000 <= r.data.n_train <= 2000 for r in runs)
        assert len({r.seed for r in runs}) >= 10 and all(r.data.seed is None for r in runs)
        cells = Counter(r.sample_cell for r in runs)
        assert len(cells) >= 10 and set(cells.values()) == {len({r.seed for r in runs})}  # crossed
        assert {"train.lr", "train.weight_decay", "model.widths"} <= set(study.sweep_axes)
        assert study.report.gap == "acc" and all(r.train.target_train_loss == 0.01 for r in runs)
    assert {r.data.dataset for _, r in fashion.runs} == {"fashion_mnist"}
    assert {r.data.dataset for _, r in mnist.runs} == {"mnist"}
    a, b = (yaml.safe_load((root / f).read_text()) for f in ("natural_sampled.yaml", "natural_sampled_mnist.yaml"))
    for raw in (a, b):
        raw.pop("name"), raw["data"].pop("dataset")
    assert a == b


_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True)
                       | st.text(max_size=8), lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=12), inner, max_size=3), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(method=st.sampled_from(["latin_hypercube", "grid", 3]), n=st.one_of(st.integers(-2, 12), _VALUES),
       field=st.sampled_from([*AXES, "train.epochs", "model.widths", "data.n_train", "train.lr.x", "x"]),
       spec=st.one_of(_VALUES, st.dictionaries(st.sampled_from(["uniform", "log_uniform", "uniform_int",
                                                                  "log_uniform_int", "choice"]), _VALUES,
                                               min_size=1, max_size=2)))
def test_any_sample_section_parses_or_is_one_config_error(method, n, field, spec):
    try:
        study = parse_study({"sample": {"method": method, "n": n, "axes": {field: spec}}})
    except ConfigError as err:
        assert "\n" not in str(err)
    else:
        assert len(study.runs) == n
