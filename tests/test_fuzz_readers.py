"""Every reader fuzzed (Hypothesis): a config and its overrides, study.yaml, run.json, measures.json.

Each input, however malformed, must end in a valid object or one `FlatbenchError` (the CLI's one line and
exit code 2), never in another exception. The inputs: random bytes, random YAML / JSON documents, and
documents of the right shape (the real keys) with random values of every type.

The example count is small for CI (`FLATBENCH_FUZZ_EXAMPLES`, default 40, derandomized so that CI is
reproducible); `python scripts/fuzz_readers.py --long` runs thousands, with fresh random examples.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from pathlib import Path

import pytest
import yaml

if os.environ.get("CI"):
    import hypothesis  # CI installs the test extra: a missing Hypothesis is a failure there, never a skip
else:
    hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatbench import store
from flatbench.config import (
    SECTIONS,
    TOP_LEVEL,
    Study,
    apply_overrides,
    load_study,
    parse_study,
    run_config_from_dict,
)
from flatbench.errors import FlatbenchError, one_line

EXAMPLES = int(os.environ.get("FLATBENCH_FUZZ_EXAMPLES", "40"))
LONG = os.environ.get("FLATBENCH_FUZZ_LONG") == "1"
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])

# ---------------------------------------------------------------- strategies

FIELD_NAMES = {section: [f.name for f in dataclasses.fields(cls)] for section, cls in SECTIONS.items()}
KEY_WORDS = [*TOP_LEVEL, *(n for names in FIELD_NAMES.values() for n in names), "uniform", "eps_sharpness",
             "eps", "frobenius_norm", "all", "status", "values", "config", "snapshots", "level", "path"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-10, max_value=10), st.integers(),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 1e-3, -1.0, 1e300]),
    st.text(max_size=12), st.sampled_from(KEY_WORDS), st.sampled_from(["", ".", "..", "a/b", "a\x00b", "nan",
                                                                        "inf", "auto", "off", "mnist_mini", "mlp"]),
)


def values(depth: int = 3) -> st.SearchStrategy:
    """Any YAML/JSON-like value: scalars, short lists and mappings, nested."""
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.sampled_from(KEY_WORDS), st.text(max_size=6)), inner, max_size=3)),
        max_leaves=8)


def field_value(section: str, name: str) -> st.SearchStrategy:
    """A plausible-or-not value for one config field (a short list sometimes: a sweep)."""
    one = st.one_of(scalars, st.lists(st.integers(-3, 600), max_size=3), values())
    return st.one_of(one, st.lists(one, max_size=2))


@st.composite
def shaped_configs(draw: typing.Callable) -> dict:
    """Configs with the real sections and keys (so that validation goes deep) and random values."""
    raw: dict = {}
    if draw(st.booleans()):
        raw["name"] = draw(scalars)
    if draw(st.booleans()):
        raw["seed"] = draw(st.one_of(scalars, st.lists(st.integers(-2, 2), max_size=2)))
    for section, names in FIELD_NAMES.items():
        if draw(st.integers(0, 3)) == 0:
            continue
        keys = draw(st.lists(st.sampled_from(names), max_size=3, unique=True))
        raw[section] = {k: draw(field_value(section, k)) for k in keys}
    if draw(st.integers(0, 5)) == 0:
        raw[draw(st.text(max_size=5))] = draw(scalars)
    return raw


def dotted_keys() -> st.SearchStrategy:
    names = [f"{s}.{n}" for s, ns in FIELD_NAMES.items() for n in ns]
    return st.one_of(st.sampled_from(names + ["name", "seed", "out", "measure.settings.eps_sharpness.eps"]),
                     st.text(max_size=10))


def overrides() -> st.SearchStrategy:
    def dump(v: typing.Any) -> str:
        try:
            return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
        except yaml.YAMLError:
            return str(v)

    item = st.one_of(st.builds(lambda k, v: f"{k}={dump(v)}", dotted_keys(), values()),
                     st.builds(lambda k, t: f"{k}={t}", dotted_keys(), st.text(max_size=10)),
                     st.text(max_size=12))
    return st.lists(item, max_size=3)


def yaml_text(v: typing.Any) -> str:
    try:
        return yaml.safe_dump(v, allow_unicode=True)
    except yaml.YAMLError:
        return repr(v)


documents = st.one_of(st.binary(max_size=200).map(lambda b: ("bytes", b)),
                      st.text(max_size=200).map(lambda t: ("text", t.encode("utf-8", "replace"))),
                      values().map(lambda v: ("yaml", yaml_text(v).encode())),
                      shaped_configs().map(lambda v: ("shaped", yaml_text(v).encode())))


def _ends_well(fn: typing.Callable, *args: typing.Any) -> typing.Any:
    """Call `fn`; return its result or None after a FlatbenchError (anything else fails the test)."""
    try:
        return fn(*args)
    except FlatbenchError as exc:
        message = one_line(str(exc))  # what the CLI prints after "error: "
        assert message.strip() and "\n" not in message, repr(message)
        return None


# ---------------------------------------------------------------- configs and overrides


@FUZZ
@given(doc=documents, extra=overrides())
def test_config_files_and_overrides(tmp_path_factory, doc, extra):
    path = tmp_path_factory.mktemp("cfg") / "fuzz.yaml"
    path.write_bytes(doc[1])
    study = _ends_well(load_study, path, extra)
    if study is not None:
        assert isinstance(study, Study) and study.runs
        for rid, run in study.runs[:5]:
            assert run.run_id() == rid and math.isfinite(run.train.lr)
            assert run_config_from_dict(run.to_dict()) == run  # what run.json stores reads back


@FUZZ
@given(raw=shaped_configs(), extra=overrides())
def test_config_dicts_through_every_check(raw, extra):
    """parse_study and the registry checks (`check_study`) on configs of the right shape."""
    from flatbench.study.spec import check_study

    study = _ends_well(lambda: parse_study(apply_overrides(raw, extra), default_name="fuzz"))
    if study is not None:
        assert study.runs
        _ends_well(check_study, study)


# ---------------------------------------------------------------- study.yaml


@FUZZ
@given(doc=documents, extra=overrides())
def test_study_yaml(tmp_path_factory, doc, extra):
    from flatbench.study.spec import read_saved_study

    exp = tmp_path_factory.mktemp("exp") / "fuzz"
    exp.mkdir()
    (exp / store.STUDY_FILE).write_bytes(doc[1])
    study = _ends_well(read_saved_study, exp, tuple(extra))
    if study is not None:
        assert study.name == "fuzz" and study.runs
    from flatbench.study.status import study_status

    _ends_well(study_status, exp)


# ---------------------------------------------------------------- run.json

GOOD_CONFIG = {"seed": 0, "data": {"dataset": "mnist_mini", "n_train": 300}, "model": {"name": "mlp", "widths": [8]},
               "train": {"epochs": 1}}


@st.composite
def run_infos(draw: typing.Callable) -> typing.Any:
    """run.json documents: the real keys with right or wrong values."""
    if draw(st.integers(0, 4)) == 0:
        return draw(values())
    info: dict = {}
    for key in ("run_id", "status", "config", "config_hash", "history", "snapshots", "model_sha256", "train_acc",
                "test_acc", "train_loss", "test_loss", "labels", "dataset", "error"):
        if draw(st.integers(0, 2)):
            info[key] = draw(st.one_of(values(), st.just(GOOD_CONFIG) if key == "config" else values(),
                                       st.sampled_from(["finished", "running", "failed"]) if key == "status"
                                       else values(),
                                       st.lists(st.fixed_dictionaries({"level": scalars, "path": scalars}), max_size=2)
                                       if key == "snapshots" else values()))
    return info


def _run_json_bytes(draw_value: typing.Any) -> bytes:
    return json.dumps(draw_value, default=str).encode()


@FUZZ
@given(content=st.one_of(st.binary(max_size=200), run_infos().map(_run_json_bytes)), with_model=st.booleans())
def test_run_json(tmp_path_factory, content, with_model):
    from flatbench.measures.targets import measure_targets
    from flatbench.study.status import run_state
    from flatbench.training import check_run_dir

    run = tmp_path_factory.mktemp("runs") / "mlp-mnist_mini-r0.00-s0-00000000"
    run.mkdir()
    (run / store.RUN_JSON).write_bytes(content)
    if with_model:
        (run / store.MODEL_FILE).write_bytes(b"not a model")
    info = _ends_well(store.load_run_info, run)
    if info is not None:
        assert store.run_info_problem(info) is None
        if isinstance(info.get("config"), dict):
            _ends_well(run_config_from_dict, info["config"])
    state, _detail = run_state(run)
    assert state in ("finished", "running", "preempted", "failed", "damaged", "not_started")
    if store.run_json_problem(run):
        assert state == "damaged" and not store.is_finished(run)
    targets = _ends_well(measure_targets, run)
    if targets is not None:
        assert all(isinstance(t.where, Path) for t in targets)
    _rid, cfg = parse_study({**GOOD_CONFIG}).runs[0]
    _ends_well(check_run_dir, run, run.name, cfg)


# ---------------------------------------------------------------- measures.json


@st.composite
def measure_entries(draw: typing.Callable) -> typing.Any:
    if draw(st.integers(0, 4)) == 0:
        return draw(values())
    out = {}
    for key in draw(st.lists(st.sampled_from(["frobenius_norm", "spectral_norm", "x"]), max_size=3, unique=True)):
        entry = {"status": draw(st.one_of(st.sampled_from(["ok", "error", "not_applicable"]), scalars))}
        for field in ("values", "settings", "context", "info", "seconds", "larger_is_sharper"):
            if draw(st.booleans()):
                entry[field] = draw(st.one_of(values(), st.dictionaries(st.sampled_from([key, key + "/a"]),
                                                                         scalars, max_size=2)))
        out[key] = entry if draw(st.integers(0, 5)) else draw(values())
    return out


@FUZZ
@given(content=st.one_of(st.binary(max_size=300), measure_entries().map(_run_json_bytes),
                         measure_entries().map(lambda e: _run_json_bytes(e)[:-7])))
def test_measures_json(tmp_path_factory, content):
    from flatbench.analysis.table import build_table, load_records
    from flatbench.config import MeasureConfig
    from flatbench.measures.runner import pending_entries
    from flatbench.measures.targets import read_entries
    from flatbench.study.status import _measure_state

    exp = tmp_path_factory.mktemp("exp")
    rid, cfg = parse_study({**GOOD_CONFIG}).runs[0]
    run = exp / "runs" / rid
    run.mkdir(parents=True)
    store.atomic_write_json(run / store.RUN_JSON, {"run_id": rid, "status": "finished", "config": cfg.to_dict(),
                                                   "train_acc": 1.0, "test_acc": 0.5, "train_loss": 0.1,
                                                   "test_loss": 1.0})
    (run / store.MEASURES_JSON).write_bytes(content)
    entries, problem = read_entries(run)
    assert all(store.measure_entry_problem(e) is None for e in entries.values())
    _ends_well(pending_entries, run, ["frobenius_norm", "spectral_norm"], MeasureConfig())
    _done, damage, _stale = _measure_state(run, ["frobenius_norm"])
    assert (damage is None) == (problem is None)
    records = _ends_well(load_records, [exp])
    if records is not None:
        _ends_well(build_table, [exp], records)
