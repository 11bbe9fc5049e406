"""Tests aimed at plausible one-line bugs that the rest of the suite did not catch (issue 21).

Each test names the bug it is there to catch:

- the evaluation pass leaving the model in train mode (BatchNorm with batch statistics that also updates
  its running statistics, dropout on);
- the run identity ignoring a field (every field of the config, enumerated from the dataclasses, not a list);
- the measure cache ignoring the measurement context (`n_examples`, `dtype`, `normalized_ce_tau`);
- the granulated τ (Ψ) computed with τ-b instead of Jiang's τ-a within groups (ties in the measure and gap).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import types
import typing

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbench.config import (
    EXECUTION_ONLY_KEYS,
    DataConfig,
    MeasureConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    parse_study,
)
from flatbench.training import evaluate, train_run

# ---------------------------------------------------------------- the evaluation pass is in eval mode


def _bn_dropout_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))
    with torch.no_grad():  # running statistics far from what one batch gives
        model.train()
        for _ in range(5):
            model(torch.randn(64, 6) * 3 + 2)
    return model


def test_evaluate_uses_running_statistics_and_no_dropout_and_restores_the_mode():
    model = _bn_dropout_model()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 6, generator=gen), torch.randint(0, 4, (50,), generator=gen)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for mode in (True, False):
        model.train(mode)
        loss, acc = evaluate(model, x, y, batch_size=7)
        assert model.training is mode, "evaluate must restore the mode it found"
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), f"evaluate changed {key} (BatchNorm ran in train mode)"
        model.eval()
        with torch.no_grad():
            logits = model(x)
        assert loss == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)
        assert acc == pytest.approx((logits.argmax(1) == y).float().mean().item())
        assert evaluate(model, x, y, batch_size=50) == pytest.approx((loss, acc))  # no dropout: repeatable


def test_a_batchnorm_run_records_eval_mode_losses_of_the_model_it_saved(tmp_path):
    """run.json's final losses are those of the saved model.pt in eval mode; an evaluation in train mode
    uses batch statistics and also moves the running statistics saved in model.pt."""
    from flatbench.data import load_dataset
    from flatbench.models import load_model
    from flatbench.store import read_json

    study = parse_study({"data": {"dataset": "mnist_mini", "n_train": 200, "n_test": 100, "random_label_ratio": 0.5},
                         "model": {"widths": [16], "batch_norm": True},
                         "train": {"epochs": 2, "batch_size": 64, "eval_batch_size": 37}})
    rid, cfg = study.runs[0]
    train_run(rid, cfg, tmp_path / rid, torch.device("cpu"), progress=False, echo=lambda m: None)
    info = read_json(tmp_path / rid / "run.json")
    model = load_model(tmp_path / rid).eval()
    ds = load_dataset(cfg.data, cfg.seed)
    with torch.no_grad():
        train_loss = F.cross_entropy(model(ds.x_train), ds.y_train).item()
        test_loss = F.cross_entropy(model(ds.x_test), ds.y_test).item()
    assert info["train_loss"] == pytest.approx(train_loss, rel=1e-5)
    assert info["test_loss"] == pytest.approx(test_loss, rel=1e-5)
    assert info["history"][-1]["eval_train_loss"] == pytest.approx(train_loss, rel=1e-5)


# ---------------------------------------------------------------- every identity field changes the run id


EXPECTED_EXECUTION_ONLY = {"data.root", "data.download", "train.eval_batch_size", "train.checkpoint_every",
                           "train.test_every", "train.vectorize", "train.compile", "train.channels_last",
                           "train.workers"}


def _other_value(value: typing.Any, tp: typing.Any) -> typing.Any:
    """A value of type `tp` different from `value`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return _other_value(None, next(a for a in args if a is not type(None)))
        if type(None) in args:
            return None
        return _other_value(value, next(a for a in args if isinstance(value, a)))
    if origin is tuple:
        return (*(value or ()), _other_value(None, args[0]))
    if tp is bool:
        return not value
    if tp is int:
        return 7 if value is None else value + 1
    if tp is float:
        return 0.375 if value is None else value + 0.125
    if tp is str:
        return "other" if value is None else value + "_other"
    if tp is dict or origin is dict:
        return {**(value or {}), f"other{len(value or {})}": 1}
    raise AssertionError(f"no other value for {tp}")


def _every_field():
    yield "seed", None, int
    for section, cls in (("data", DataConfig), ("model", ModelConfig), ("train", TrainConfig)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", (section, f.name), hints[f.name]


def _changed(run: RunConfig, where: tuple[str, str] | None, tp: typing.Any) -> RunConfig:
    if where is None:
        return dataclasses.replace(run, seed=_other_value(run.seed, tp))
    section, name = where
    part = getattr(run, section)
    return dataclasses.replace(run, **{section: dataclasses.replace(part, **{name: _other_value(getattr(part, name), tp)})})


def test_the_execution_only_fields_are_exactly_the_documented_ones():
    assert set(EXECUTION_ONLY_KEYS) == EXPECTED_EXECUTION_ONLY


@pytest.mark.parametrize("start", ["defaults", "changed"])
def test_every_identity_field_changes_the_hash_and_execution_fields_do_not(start):
    """Over every field of RunConfig (from the dataclasses, so a new field is covered too): from the defaults
    and from a config where every field already has another value (so that a field is not only seen
    leaving its default)."""
    base = RunConfig()
    fields = list(_every_field())
    assert len(fields) > 30
    if start == "changed":
        for _key, where, tp in fields:
            base = _changed(base, where, tp)
    assert base.config_hash() == RunConfig.config_hash(base)
    for key, where, tp in fields:
        other = _changed(base, where, tp)
        if key in EXPECTED_EXECUTION_ONLY:
            assert other.config_hash() == base.config_hash(), f"{key} only says how a run executes"
        else:
            assert other.config_hash() != base.config_hash(), f"the run identity ignores {key}"
            assert other.run_id() != base.run_id(), f"the run id ignores {key}"


def test_identity_of_a_default_config_is_empty_and_keeps_existing_ids():
    """Fields at their default stay out of the identity (what keeps old run ids when a key is added)."""
    assert RunConfig().identity() == {}
    rid = parse_study({"data": {"dataset": "mnist_mini", "n_train": 300, "n_test": 200, "random_label_ratio": 0.0},
                       "model": {"name": "mlp", "widths": [32]},
                       "train": {"epochs": 3, "batch_size": 64, "lr": 0.003}}).run_ids()[0]
    assert rid == "mlp-mnist_mini-r0.00-s0-7dc62239"  # the tiny study's id in README and bad_inputs


# ---------------------------------------------------------------- the measure cache checks the context


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    study = parse_study({"data": {"dataset": "mnist_mini", "n_train": 240, "n_test": 100, "random_label_ratio": 0.5},
                         "model": {"widths": [12]}, "train": {"epochs": 1, "batch_size": 64}})
    rid, cfg = study.runs[0]
    path = tmp_path_factory.mktemp("cache") / rid
    train_run(rid, cfg, path, torch.device("cpu"), progress=False, echo=lambda m: None)
    return path


@pytest.mark.parametrize("change", [{"n_examples": 200}, {"dtype": "float32"}, {"normalized_ce_tau": 2.0}])
def test_a_changed_measurement_context_recomputes_the_cached_entry(trained_run, tmp_path, change):
    """A cached entry computed on another measurement set, in another precision or with another τ is
    recomputed, never reused: its recorded context is the new one."""
    import shutil

    from flatbench.measures.runner import measure_run, pending_entries

    run = tmp_path / trained_run.name
    shutil.copytree(trained_run, run)
    names = ["fisher_rao_norm", "eps_sharpness"]
    losses = ("ce", "normalized_ce")
    # every measure in float64 first, so that a change to float32 changes every entry's context (under the
    # default dtype auto, eps_sharpness is computed in float32 already)
    first = MeasureConfig(n_examples=100, losses=losses, settings={"eps_sharpness": {"iters": 2}}, dtype="float64")
    measure_run(run, names, first, torch.device("cpu"))
    before = json.loads((run / "measures.json").read_text())
    assert all(e["status"] == "ok" for e in before.values()), before
    assert not pending_entries(run, names, first)[1], "the same context must reuse the cache"
    second = dataclasses.replace(first, **change)
    key, value = next(iter(change.items()))
    assert pending_entries(run, names, second)[1], f"a changed {key} must not reuse the cache"
    measure_run(run, names, second, torch.device("cpu"))
    after = json.loads((run / "measures.json").read_text())
    dependent = [k for k in after if key != "normalized_ce_tau" or "normalized_ce" in k]
    assert dependent
    for entry_key in dependent:
        assert after[entry_key]["context"][key] == value, entry_key
        assert after[entry_key]["context"] != before[entry_key]["context"], entry_key
    if key == "n_examples":
        assert after["fisher_rao_norm"]["values"] != before["fisher_rao_norm"]["values"]


def test_a_run_trained_again_recomputes_its_measures_and_snapshots(tmp_path):
    """A finished run whose weights are gone (a committed study: run.json and measures.json, no model.pt) is
    trained again from the start: its earlier snapshots are dropped, and every measures.json entry, which
    records the sha256 of the model it was computed on, is recomputed on the new model, never reused."""
    import shutil

    from flatbench.measures.runner import measure_run, pending_entries
    from flatbench.store import MODEL_FILE

    study = parse_study({"data": {"dataset": "mnist_mini", "n_train": 240, "n_test": 100, "random_label_ratio": 0.5},
                         "model": {"widths": [12]}, "train": {"epochs": 3, "batch_size": 64,
                                                              "snapshot_losses": [100.0]}})
    rid, cfg = study.runs[0]
    path = tmp_path / rid
    info = train_run(rid, cfg, path, torch.device("cpu"), progress=False, echo=lambda m: None)
    names = ["frobenius_norm"]
    measure_run(path, names, MeasureConfig(), torch.device("cpu"))
    entry = json.loads((path / "measures.json").read_text())["frobenius_norm"]
    assert entry["model_sha256"] == info["model_sha256"]
    assert not pending_entries(path, names, MeasureConfig())[1]
    snapshot = path / "snapshots"
    assert snapshot.is_dir()
    (path / MODEL_FILE).unlink()
    for model in snapshot.rglob(MODEL_FILE):
        model.unlink()
    (snapshot / "stale.txt").write_text("from an earlier training")
    # another machine's training: the same run, other rounding; here: a model file with another hash
    info2 = train_run(rid, cfg, path, torch.device("cpu"), progress=False, echo=lambda m: None)
    assert not (snapshot / "stale.txt").exists() and list(snapshot.rglob(MODEL_FILE))
    stored = json.loads((path / "run.json").read_text())
    stored["model_sha256"] = "0" * 64
    shutil.copyfile(path / MODEL_FILE, tmp_path / "m.pt")
    (path / "run.json").write_text(json.dumps(stored))
    assert [key for _, _, key in pending_entries(path, names, MeasureConfig())[1]] == ["frobenius_norm"]
    assert info2["model_sha256"] == info["model_sha256"]  # deterministic on one machine


def test_a_stored_context_that_differs_in_any_field_is_not_up_to_date(tmp_path):
    from flatbench.measures.registry import get_measure
    from flatbench.measures.runner import measurement_context, pending_entries

    cfg = MeasureConfig(n_examples=100)
    spec = get_measure("frobenius_norm")
    context = measurement_context(cfg, spec)
    assert set(context) >= {"n_examples", "dtype", "normalized_ce_tau"} and context["dtype"] == "float64"
    for key, other in (("n_examples", 50), ("dtype", "float32"), ("normalized_ce_tau", 3.0)):
        stored = {**context, key: other}
        (tmp_path / "measures.json").write_text(json.dumps({"frobenius_norm": {
            "status": "ok", "values": {"frobenius_norm": 1.0}, "settings": spec.settings({}), "context": stored}}))
        assert pending_entries(tmp_path, ["frobenius_norm"], cfg)[1], key
    (tmp_path / "measures.json").write_text(json.dumps({"frobenius_norm": {
        "status": "ok", "values": {"frobenius_norm": 1.0}, "settings": spec.settings({}), "context": context}}))
    assert not pending_entries(tmp_path, ["frobenius_norm"], cfg)[1]


# ---------------------------------------------------------------- granulated τ: Jiang's τ-a, with ties


def _tau_a(m: np.ndarray, g: np.ndarray) -> float:
    pairs = list(itertools.combinations(range(len(m)), 2))
    return sum(np.sign(m[i] - m[j]) * np.sign(g[i] - g[j]) for i, j in pairs) / len(pairs)


def test_granulated_kendall_is_tau_a_within_groups_with_ties():
    """Ties in the measure and in the gap inside a group: τ-a counts a tied pair as 0 over all pairs (τ-b
    would shrink the denominator and give another value)."""
    from flatbench.analysis.stats import jiang

    codes = pd.DataFrame({"lr": ["a", "a", "a", "a", "b", "b", "b", "b", "a", "b"],
                          "wd": ["x", "y", "z", "w", "x", "y", "z", "w", "x", "x"],
                          "seed": ["0", "0", "0", "0", "0", "0", "0", "0", "1", "1"]})
    measure = np.array([1.0, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 1.0, 2.0, 2.0])
    gap = np.array([0.1, 0.2, 0.2, 0.4, 0.3, 0.1, 0.3, 0.5, 0.2, 0.7])
    psi, per_axis = jiang.granulated_kendall(measure, gap, codes, ["lr", "wd"], within=["seed"])
    expected = {}
    for axis, other in (("lr", "wd"), ("wd", "lr")):
        taus = []
        for _, group in codes.groupby([other, "seed"]):
            idx = group.index.to_numpy()
            if len(idx) >= 2 and group[axis].nunique() >= 2:
                taus.append(_tau_a(measure[idx], gap[idx]))
        expected[axis] = float(np.mean(taus))
    assert per_axis == pytest.approx(expected)
    assert psi == pytest.approx(np.mean(list(expected.values())))
    from scipy.stats import kendalltau

    idx = codes.index[(codes.lr == "a") & (codes.seed == "0")].to_numpy()  # a group with ties, for wd
    assert kendalltau(measure[idx], gap[idx]).statistic != pytest.approx(_tau_a(measure[idx], gap[idx]))
