"""Vectorized group training: same weights and files as one run after another, early stopping, resume."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch

from flatbench.config import apply_overrides, parse_study
from flatbench.errors import ConfigError
from flatbench.store import read_json
from flatbench.models import load_model
from flatbench.study.train import train_study
from flatbench.training import AUTO_GROUP_SIZE, Preempted, group_size, plan_groups

CPU = torch.device("cpu")


def _study(tmp_path, name, vectorize, model="mlp", **train):
    raw = {"name": "v", "seed": [0, 1],
           "data": {"dataset": "mnist_mini", "n_train": 256, "n_test": 128, "random_label_ratio": [0.0, 0.5]},
           "model": {"name": model, "widths": [32]},
           "train": {"epochs": 2, "batch_size": 64, "vectorize": vectorize, **train}}
    return parse_study(raw, out=str(tmp_path / name))


def _train(study):
    return train_study(study, CPU, quiet=True, echo=lambda m: None)


def _assert_same_weights(a, b, atol):
    for rid in a.run_ids():
        wa = load_model(a.exp_dir / "runs" / rid).state_dict()
        wb = load_model(b.exp_dir / "runs" / rid).state_dict()
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=f"{rid} {k}")


@pytest.mark.parametrize("model, atol", [("mlp", 1e-5), ("lenet", 1e-4)])
def test_group_gives_the_weights_and_files_of_sequential_training(tmp_path, model, atol):
    seq, vec = _study(tmp_path, "seq", "off", model), _study(tmp_path, "vec", 4, model)
    assert [len(g) for g in plan_groups(list(vec.runs), CPU)] == [4]
    assert _train(seq).trained == seq.run_ids()
    assert sorted(_train(vec).trained) == sorted(vec.run_ids())
    _assert_same_weights(seq, vec, atol)
    for rid in seq.run_ids():
        a = read_json(seq.exp_dir / "runs" / rid / "run.json")
        b = read_json(vec.exp_dir / "runs" / rid / "run.json")
        assert b["status"] == "finished" and b["epochs"] == a["epochs"] == 2
        assert b["vectorized_group"] == 4 and "vectorized_group" not in a
        assert a["labels"] == b["labels"] and a["config_hash"] == b["config_hash"]
        for ha, hb in zip(a["history"], b["history"]):
            assert ha["epoch"] == hb["epoch"] and ha["lr"] == hb["lr"]
            assert hb["train_loss"] == pytest.approx(ha["train_loss"], abs=1e-4)
        assert b["test_acc"] == pytest.approx(a["test_acc"], abs=1 / 128 + 1e-9)
        assert not (vec.exp_dir / "runs" / rid / "checkpoint.pt").exists()
        assert not (vec.exp_dir / "runs" / rid / ".lock").exists()


def test_a_run_that_reaches_its_target_freezes_while_the_group_goes_on(tmp_path):
    kw = {"epochs": 6, "target_train_acc": 0.6, "lr": 0.003}
    seq, vec = _study(tmp_path, "seq", "off", **kw), _study(tmp_path, "vec", 4, **kw)
    _train(seq)
    _train(vec)
    epochs = {rid: read_json(vec.exp_dir / "runs" / rid / "run.json")["epochs"] for rid in vec.run_ids()}
    assert epochs == {rid: read_json(seq.exp_dir / "runs" / rid / "run.json")["epochs"] for rid in seq.run_ids()}
    assert min(epochs.values()) < 6 and max(epochs.values()) == 6, epochs  # some stopped early, some did not
    _assert_same_weights(seq, vec, 1e-5)


def test_sgd_with_a_schedule_matches_too(tmp_path):
    kw = {"optimizer": "sgd", "lr": 0.05, "nesterov": True, "weight_decay": 1e-4, "schedule": "cosine"}
    seq, vec = _study(tmp_path, "seq", "off", **kw), _study(tmp_path, "vec", 2, **kw)
    _train(seq)
    _train(vec)
    _assert_same_weights(seq, vec, 1e-5)


def test_a_preempted_group_resumes_one_run_at_a_time_to_the_same_weights(tmp_path, monkeypatch):
    import flatbench.training.vectorized as vectorized_mod

    original = vectorized_mod.write_checkpoint
    calls = []

    def write_then_signal(*args, **kwargs):
        original(*args, **kwargs)
        calls.append(args[0])
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # as Slurm would, after the first epoch checkpoint

    monkeypatch.setattr(vectorized_mod, "write_checkpoint", write_then_signal)
    vec = _study(tmp_path, "out", 4, epochs=3)
    with pytest.raises(Preempted):
        _train(vec)
    for rid in vec.run_ids():
        run = vec.exp_dir / "runs" / rid
        info = read_json(run / "run.json")
        assert info["status"] == "preempted" and [h["epoch"] for h in info["history"]] == [1]
        assert torch.load(run / "checkpoint.pt", weights_only=False)["epoch"] == 1
        assert not (run / ".lock").exists()
    monkeypatch.undo()
    resumed = _study(tmp_path, "out", "off", epochs=3)  # the same runs (vectorize is not in the hash)
    assert sorted(_train(resumed).trained) == sorted(resumed.run_ids())
    straight = _study(tmp_path, "straight", "off", epochs=3)
    _train(straight)
    _assert_same_weights(straight, resumed, 1e-5)
    for rid in resumed.run_ids():
        assert [h["epoch"] for h in read_json(resumed.exp_dir / "runs" / rid / "run.json")["history"]] == [1, 2, 3]


def test_bf16_autocast_trains_alone_and_in_a_group(tmp_path):
    """bf16 autocast is really on: the weights differ from fp32 training of the same runs (bf16 rounds the
    forward pass to 8 significant bits), yet stay close (the same data order, init and optimizer)."""
    fp32 = _study(tmp_path, "fp32", "off", epochs=1)
    _train(fp32)
    for name, vectorize in (("seq", "off"), ("vec", 4)):
        study = _study(tmp_path, name, vectorize, precision="bf16", epochs=1)
        assert len(_train(study).trained) == 4
        info = read_json(study.exp_dir / "runs" / study.run_ids()[0] / "run.json")
        assert info["status"] == "finished" and info["history"][0]["train_loss"] < 3.0
        twin = {(c.seed, c.data.random_label_ratio): rid for rid, c in fp32.runs}
        for rid_bf16, cfg in study.runs:
            rid_fp32 = twin[(cfg.seed, cfg.data.random_label_ratio)]
            a = load_model(study.exp_dir / "runs" / rid_bf16).state_dict()
            b = load_model(fp32.exp_dir / "runs" / rid_fp32).state_dict()
            assert all(a[k].dtype == torch.float32 for k in a), "weights stay fp32 under autocast"
            diff = torch.cat([(a[k] - b[k]).flatten() for k in a]).norm()
            rel = float(diff / torch.cat([b[k].flatten() for k in b]).norm())
            assert 1e-6 < rel < 1e-1, f"{name} {rid_bf16}: bf16 vs fp32 weights differ by {rel:.2e} relative"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
def test_compiled_training_alone_and_in_a_group_matches_eager(tmp_path):
    eager = _study(tmp_path, "eager", "off", epochs=1)
    _train(eager)
    for name, vectorize in (("seq", "off"), ("vec", 4)):
        compiled = _study(tmp_path, name, vectorize, epochs=1, compile=True)
        assert len(_train(compiled).trained) == 4
        _assert_same_weights(eager, compiled, 1e-4)


def test_planning_groups_only_runs_that_differ_in_seed_and_labels():
    raw = {"seed": [0, 1], "data": {"random_label_ratio": [0.0, 0.5, 1.0]}, "train": {"vectorize": 4,
                                                                                      "lr": [0.001, 0.01]}}
    runs = list(parse_study(raw).runs)
    groups = plan_groups(runs, CPU)
    assert sorted(len(g) for g in groups) == [2, 2, 4, 4]
    for g in groups:
        assert len({cfg.train.lr for _, cfg in g}) == 1
    assert sum(len(g) for g in groups) == 12
    _, cfg = runs[0]
    auto = parse_study({"train": {"vectorize": "auto"}}).runs[0][1]
    assert group_size(auto, CPU) == 1 and group_size(auto, torch.device("cuda")) == AUTO_GROUP_SIZE
    for model in ({"name": "wrn"}, {"name": "mlp", "batch_norm": True}):
        other = parse_study({"model": model, "train": {"vectorize": 8}}).runs[0][1]
        assert group_size(other, torch.device("cuda")) == 1


@pytest.mark.parametrize("text, value", [("off", "off"), ("auto", "auto"), ("8", 8), ("'8'", 8), ("true", "auto")])
def test_vectorize_setting_has_one_typed_form(text, value):
    study = parse_study(apply_overrides({}, [f"train.vectorize={text}"]))
    assert study.runs[0][1].train.vectorize == value


@pytest.mark.parametrize("bad", ["0", "-2", "fast", "1.5"])
def test_bad_vectorize_setting_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="train.vectorize"):
        parse_study(apply_overrides({}, [f"train.vectorize={bad}"]))


def test_execution_settings_keep_the_config_hash_but_precision_changes_it():
    base = parse_study({}).runs[0][1].config_hash()
    same = parse_study({"train": {"vectorize": 8, "compile": True, "channels_last": False}}).runs[0][1]
    assert same.config_hash() == base
    assert parse_study({"train": {"precision": "bf16"}}).runs[0][1].config_hash() != base
