"""Training: determinism, resume after a kill or SIGTERM, atomic writes, run locks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flatbench.config import parse_study
from flatbench.locks import RunLock
from flatbench.store import atomic_write_json, read_json
from flatbench.models import load_model
from flatbench.training import train_run

from conftest import run_cli


def _tiny_run(**train):
    study = parse_study({"data": {"dataset": "mnist_mini", "n_train": 256, "n_test": 128,
                                  "random_label_ratio": 0.5},
                         "model": {"widths": [16]}, "train": {"epochs": 2, "batch_size": 64, **train}})
    return study.runs[0]


def _weights(run_path: Path) -> dict[str, torch.Tensor]:
    return load_model(run_path).state_dict()


def _train(rid, cfg, folder: Path) -> dict:
    return train_run(rid, cfg, folder / rid, torch.device("cpu"), progress=False, echo=lambda m: None)


def test_same_config_gives_bit_identical_weights(tmp_path):
    rid, cfg = _tiny_run()
    a = _train(rid, cfg, tmp_path / "a")
    b = _train(rid, cfg, tmp_path / "b")
    wa, wb = _weights(tmp_path / "a" / rid), _weights(tmp_path / "b" / rid)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["train_acc"] == b["train_acc"] and a["status"] == "finished"
    info = read_json(tmp_path / "a" / rid / "run.json")
    for key in ("config", "labels", "train_acc", "test_acc", "train_loss", "test_loss", "gap_acc", "gap_loss",
                "epochs", "seconds", "device", "versions", "history"):
        assert key in info
    assert info["labels"]["n_corrupted"] == 128 and info["labels"]["scheme"] == "uniform"
    assert info["gap_acc"] == pytest.approx(info["train_acc"] - info["test_acc"])
    assert not (tmp_path / "a" / rid / "checkpoint.pt").exists()
    assert info["model_sha256"] and info["history"][-1]["test_acc"] == pytest.approx(info["test_acc"])


def test_finished_run_is_skipped_and_other_config_is_refused(tmp_path):
    rid, cfg = _tiny_run()
    _train(rid, cfg, tmp_path)
    mtime = (tmp_path / rid / "model.pt").stat().st_mtime_ns
    _train(rid, cfg, tmp_path)
    assert (tmp_path / rid / "model.pt").stat().st_mtime_ns == mtime
    _, other = _tiny_run(lr=0.01)
    from flatbench.errors import FlatbenchError
    with pytest.raises(FlatbenchError, match=r"another run than its id says \(train.lr: stored 0.001, expected 0.01\)"):
        train_run(rid, other, tmp_path / rid, torch.device("cpu"), progress=False, echo=lambda m: None)


def test_early_stop_at_target_train_accuracy(tmp_path):
    rid, cfg = _tiny_run(epochs=30, target_train_acc=0.3)
    info = _train(rid, cfg, tmp_path)
    assert info["epochs"] < 30 and info["reached_target"] is True
    assert info["history"][-1]["train_acc"] >= 0.3


def test_stop_at_a_target_train_loss_and_snapshots_on_the_way(tmp_path):
    from flatbench.training import list_snapshots

    rid, cfg = _tiny_run(epochs=200, lr=0.003, target_train_loss=0.05, snapshot_losses=[1.0, 0.3, 0.1])
    info = _train(rid, cfg, tmp_path)
    assert info["reached_target"] is True and info["train_loss"] <= 0.05 < info["history"][-2]["eval_train_loss"]
    assert info["epochs"] < 200
    evals = [h["eval_train_loss"] for h in info["history"]]
    levels = [s["level"] for s in info["snapshots"]]
    assert levels == [1.0, 0.3, 0.1] and info["snapshots"] == list_snapshots(tmp_path / rid)
    for snap in info["snapshots"]:
        # the first evaluation at or below the level, with that epoch's numbers
        first = next(i for i, loss in enumerate(evals) if loss <= snap["level"])
        assert snap["epoch"] == first + 1 and snap["train_loss"] == evals[first]
        assert snap["test_acc"] == info["history"][first]["test_acc"]
        model = load_model(tmp_path / rid, model_file=tmp_path / rid / snap["path"] / "model.pt",
                           sha256=snap["model_sha256"])
        assert sum(p.numel() for p in model.parameters()) > 0


def test_lazy_evaluation_skips_epochs_far_from_the_next_level_and_keeps_the_endpoint(tmp_path):
    """train.lazy_eval (default 30): an evaluation epoch whose running loss is above 30x the next loss level
    is not evaluated (but the powers of two are); the run stops at the same epoch with the same weights as
    with every epoch evaluated (lazy_eval: 0)."""
    rid, cfg = _tiny_run(epochs=600, lr=0.01, target_train_loss=0.05)
    rid0, cfg0 = _tiny_run(epochs=600, lr=0.01, target_train_loss=0.05, lazy_eval=0)
    assert cfg.train.lazy_eval == 30 and rid0 != rid
    lazy, full = _train(rid, cfg, tmp_path / "lazy"), _train(rid0, cfg0, tmp_path / "full")
    assert lazy["reached_target"], lazy["train_loss"]
    assert lazy["epochs"] == full["epochs"] < 600, (lazy["epochs"], full["epochs"])
    assert lazy["train_loss"] == full["train_loss"] and lazy["test_acc"] == full["test_acc"]
    wa, wb = _weights(tmp_path / "lazy" / rid), _weights(tmp_path / "full" / rid0)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all("eval_train_loss" in h for h in full["history"])
    skipped = [h for h in lazy["history"] if "eval_train_loss" not in h]
    assert skipped and all(h["train_loss"] > 30 * 0.05 and h["epoch"] & (h["epoch"] - 1) for h in skipped)
    evaluated = {h["epoch"] for h in lazy["history"] if "eval_train_loss" in h}
    assert {1, 2, 4, 8, 16} <= evaluated
    for h in lazy["history"]:  # what was evaluated is what the full run measured at that epoch
        if "eval_train_loss" in h:
            assert h["eval_train_loss"] == full["history"][h["epoch"] - 1]["eval_train_loss"]


def test_test_every_evaluates_the_test_set_only_where_it_is_read_and_trains_the_same_model(tmp_path):
    """train.test_every = K: the test set is evaluated at epochs 1, 2, 4, ..., every K-th, at every snapshot,
    at the endpoint and at the last epoch, not at the other evaluations; the run's id, its weights, its
    endpoint, its snapshots and its results are those of the run that tests at every evaluation."""
    train = dict(epochs=200, lr=0.003, target_train_loss=0.05, snapshot_losses=[1.0, 0.3], lazy_eval=0)
    rid, cfg = _tiny_run(**train, test_every=7)
    rid0, cfg0 = _tiny_run(**train)
    assert rid == rid0 and cfg.train.test_every == 7 and cfg0.train.test_every == 0
    sparse, full = _train(rid, cfg, tmp_path / "sparse"), _train(rid0, cfg0, tmp_path / "full")
    wa, wb = _weights(tmp_path / "sparse" / rid), _weights(tmp_path / "full" / rid0)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for key in ("epochs", "train_loss", "train_acc", "test_loss", "test_acc", "gap_loss", "reached_target"):
        assert sparse[key] == full[key], key
    assert [s["level"] for s in sparse["snapshots"]] == [1.0, 0.3]
    for a, b in zip(sparse["snapshots"], full["snapshots"]):
        assert {k: v for k, v in a.items() if k != "model_sha256"} == {k: v for k, v in b.items()
                                                                         if k != "model_sha256"}
    last = sparse["epochs"]
    assert last > 16, last
    snapshot_epochs = {s["epoch"] for s in sparse["snapshots"]}
    expected = {e for e in range(1, last + 1) if e & (e - 1) == 0 or e % 7 == 0} | snapshot_epochs | {last}
    tested = {h["epoch"] for h in sparse["history"] if "test_acc" in h}
    assert tested == expected, sorted(tested ^ expected)
    assert all("test_acc" in h for h in full["history"])
    for h in sparse["history"]:  # every point kept is the full run's
        same = full["history"][h["epoch"] - 1]
        assert h.get("test_acc", same["test_acc"]) == same["test_acc"] and h["eval_train_loss"] == same["eval_train_loss"]
    from flatbench.errors import ConfigError
    with pytest.raises(ConfigError, match="train.test_every must be 0"):
        _tiny_run(test_every=-1)


def test_next_loss_level_walks_down_the_snapshot_levels_to_the_target():
    from flatbench.training.endpoint import evaluates_at, next_loss_level

    _, cfg = _tiny_run(epochs=100, target_train_loss=0.01, snapshot_losses=[0.5, 0.1], eval_every=2)
    assert next_loss_level(cfg, []) == 0.5
    assert next_loss_level(cfg, [{"eval_train_loss": 0.3}]) == 0.1
    assert next_loss_level(cfg, [{"eval_train_loss": 0.3}, {"epoch": 3}, {"eval_train_loss": 0.05}]) == 0.01
    assert next_loss_level(cfg, [{"eval_train_loss": 0.009}]) is None
    history = [{"eval_train_loss": 0.3}]
    assert not evaluates_at(cfg, 6, 3.01, history) and evaluates_at(cfg, 6, 2.99, history)  # 30 x 0.1
    assert not evaluates_at(cfg, 7, 0.001, history)  # not an evaluation epoch (eval_every 2)
    assert evaluates_at(cfg, 8, 100.0, history) and evaluates_at(cfg, 100, 100.0, history)  # 2^3; the last
    _, off = _tiny_run(epochs=100, target_train_loss=0.01, eval_every=2, lazy_eval=0)
    assert evaluates_at(off, 6, 100.0, history)
    _, none = _tiny_run(epochs=100, eval_every=2)  # no level to check: every evaluation epoch
    assert evaluates_at(none, 6, 100.0, history)


def test_a_run_that_misses_its_loss_target_says_so(tmp_path):
    rid, cfg = _tiny_run(epochs=2, target_train_loss=1e-6, eval_every=3)
    info = _train(rid, cfg, tmp_path)
    assert info["reached_target"] is False and info["epochs"] == 2
    # eval_every=3 > epochs: the last epoch is always evaluated
    assert "eval_train_loss" not in info["history"][0] and "test_acc" in info["history"][1]


@pytest.mark.parametrize("schedule, optimizer", [("cosine", "sgd"), ("step", "adam")])
def test_schedules_and_optimizers_train(tmp_path, schedule, optimizer):
    rid, cfg = _tiny_run(schedule=schedule, optimizer=optimizer, step_size=1, lr=0.01)
    info = _train(rid, cfg, tmp_path)
    lrs = [h["lr"] for h in info["history"]]
    assert lrs[-1] < 0.01


def test_inverse_time_schedule_decays_per_minibatch(tmp_path):
    rid, cfg = _tiny_run(schedule="inverse_time", optimizer="sgd", lr=0.1, lr_decay=0.01)
    info = _train(rid, cfg, tmp_path)
    steps_per_epoch = 256 // 64
    for h in info["history"]:
        assert h["lr"] == pytest.approx(0.1 / (1 + 0.01 * steps_per_epoch * h["epoch"]))


def test_runs_that_differ_in_ratio_share_init_and_batch_order():
    from flatbench.seeding import batch_generator
    from flatbench.training import init_model

    study = parse_study({"data": {"n_train": 256, "random_label_ratio": [0.0, 0.5, 1.0]},
                         "model": {"widths": [16]}})
    models = [init_model(rid, cfg, (1, 28, 28), 10, torch.device("cpu")) for rid, cfg in study.runs]
    for m in models[1:]:
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), m.parameters()))
    perms = [torch.randperm(256, generator=batch_generator(cfg, 3)) for _, cfg in study.runs]
    assert all(torch.equal(perms[0], p) for p in perms[1:])
    other_seed = parse_study({"seed": 1, "data": {"n_train": 256}, "model": {"widths": [16]}}).runs[0]
    m1 = init_model(other_seed[0], other_seed[1], (1, 28, 28), 10, torch.device("cpu"))
    assert not torch.equal(next(m1.parameters()), next(models[0].parameters()))


INTERRUPT_CONFIG = {
    "name": "resume", "seed": 0,
    "data": {"dataset": "mnist_mini", "n_train": 3000, "n_test": 200, "random_label_ratio": 0.5},
    "model": {"name": "mlp", "widths": [64, 64]},
    "train": {"epochs": 8, "batch_size": 32, "schedule": "cosine"},  # resume must restore the schedule too
}
INTERRUPT_ID = parse_study(INTERRUPT_CONFIG).run_ids()[0]


def _interrupt(tmp_path: Path, sig: int) -> tuple[Path, int]:
    import yaml

    cfg = tmp_path / "resume.yaml"
    cfg.write_text(yaml.safe_dump(INTERRUPT_CONFIG))
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "flatbench", "train", str(cfg), "--out", str(out),
                             "--device", "cpu", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    run = out / "resume" / "runs" / INTERRUPT_ID
    deadline = time.time() + 300
    while time.time() < deadline:
        ckpt = run / "checkpoint.pt"
        if ckpt.exists() and proc.poll() is None:
            time.sleep(0.05)
            os.kill(proc.pid, sig)
            break
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.communicate(timeout=120)
    assert read_json(run / "run.json")["status"] != "finished", "the run finished before it was interrupted"
    assert (run / "checkpoint.pt").exists()
    return cfg, proc.returncode


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_interrupted_run_resumes_to_the_same_weights(tmp_path, sig):
    cfg, code = _interrupt(tmp_path, sig)
    if sig == signal.SIGTERM:
        assert code == 143
        run = tmp_path / "interrupted" / "resume" / "runs" / INTERRUPT_ID
        assert read_json(run / "run.json")["status"] == "preempted"
    resumed = run_cli("train", str(cfg), "--out", str(tmp_path / "interrupted"), "--device", "cpu", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    straight = run_cli("train", str(cfg), "--out", str(tmp_path / "straight"), "--device", "cpu", "--quiet")
    assert straight.returncode == 0, straight.stderr
    rid = INTERRUPT_ID
    a = _weights(tmp_path / "interrupted" / "resume" / "runs" / rid)
    b = _weights(tmp_path / "straight" / "resume" / "runs" / rid)
    assert all(torch.equal(a[k], b[k]) for k in a)
    hist = read_json(tmp_path / "interrupted" / "resume" / "runs" / rid / "run.json")["history"]
    assert [h["epoch"] for h in hist] == list(range(1, 9))


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    atomic_write_json(path, {"a": 1})

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_json(path, {"a": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_nonfinite_floats_round_trip_as_strings(tmp_path):
    atomic_write_json(tmp_path / "x.json", {"v": float("nan"), "w": float("inf")})
    assert read_json(tmp_path / "x.json") == {"v": "nan", "w": "inf"}


def test_run_lock_excludes_a_second_holder_and_takes_over_stale_locks(tmp_path):
    with RunLock(tmp_path):
        other = subprocess.run([sys.executable, "-c",
                                "from flatbench.locks import RunLock; RunLock(r'%s').acquire()" % tmp_path],
                               capture_output=True, text=True)
        assert other.returncode != 0 and "RunLocked" in other.stderr
    assert not (tmp_path / ".lock").exists()
    import socket
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(f"{socket.gethostname()} {dead.pid}\n")
    with RunLock(tmp_path) as lock:
        assert lock.held


def test_preempted_run_resumes_with_its_schedule_bit_for_bit(tmp_path, monkeypatch):
    """train_run stopped by Preempted right after the epoch-2 checkpoint, then resumed, ends with exactly
    the weights and learning rates of an uninterrupted run: the checkpoint restores the cosine schedule
    (with a fresh schedule the resumed epochs would run at other learning rates)."""
    import math

    import flatbench.training.loop as loop_mod
    from flatbench.training import Preempted

    rid, cfg = _tiny_run(epochs=4, optimizer="sgd", lr=0.05, schedule="cosine")
    original = loop_mod.write_checkpoint

    def write_then_preempt(path, model, opt, sched, epoch, *args, **kwargs):
        original(path, model, opt, sched, epoch, *args, **kwargs)
        if epoch == 2:
            raise Preempted("test: preempted after epoch 2")

    monkeypatch.setattr(loop_mod, "write_checkpoint", write_then_preempt)
    with pytest.raises(Preempted):
        _train(rid, cfg, tmp_path / "resumed")
    info = read_json(tmp_path / "resumed" / rid / "run.json")
    assert info["status"] == "preempted" and [h["epoch"] for h in info["history"]] == [1, 2]
    monkeypatch.undo()
    resumed = _train(rid, cfg, tmp_path / "resumed")
    straight = _train(rid, cfg, tmp_path / "straight")
    a, b = _weights(tmp_path / "resumed" / rid), _weights(tmp_path / "straight" / rid)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lrs = [h["lr"] for h in resumed["history"]]
    assert lrs == [h["lr"] for h in straight["history"]]
    # the lr recorded after epoch e: 0.05 · (1 + cos(π e / 4)) / 2
    assert lrs == pytest.approx([0.05 * (1 + math.cos(math.pi * e / 4)) / 2 for e in (1, 2, 3, 4)], rel=1e-12)
    assert [h["epoch"] for h in resumed["history"]] == [1, 2, 3, 4]


def test_snapshot_models_reproduce_their_recorded_losses(tmp_path):
    """A snapshot's model.pt is the model of the epoch it names: evaluated again, it gives the training and
    test loss and accuracy its snapshot.json records (and differs from the final model)."""
    from flatbench.data import load_dataset
    from flatbench.training import evaluate

    rid, cfg = _tiny_run(epochs=3, lr=0.003, snapshot_losses=[2.15])
    info = _train(rid, cfg, tmp_path)
    (snap,) = info["snapshots"]
    evals = [h["eval_train_loss"] for h in info["history"]]
    assert snap["epoch"] == 1 + next(i for i, loss in enumerate(evals) if loss <= 2.15)
    assert snap["epoch"] < 3, "the level should be reached before the last epoch"
    ds = load_dataset(cfg.data, cfg.seed)
    model = load_model(tmp_path / rid, model_file=tmp_path / rid / snap["path"] / "model.pt",
                       sha256=snap["model_sha256"])
    bs = cfg.train.eval_batch_size
    assert evaluate(model, ds.x_train, ds.y_train, bs) == pytest.approx((snap["train_loss"], snap["train_acc"]),
                                                                        rel=1e-12)
    assert evaluate(model, ds.x_test, ds.y_test, bs) == pytest.approx((snap["test_loss"], snap["test_acc"]),
                                                                      rel=1e-12)
    final = _weights(tmp_path / rid)
    assert not all(torch.equal(final[k], v) for k, v in model.state_dict().items())


def test_checkpoint_every_k_epochs_resumes_from_the_last_one_to_the_same_weights(tmp_path, monkeypatch):
    """`train.checkpoint_every: 2` writes the epoch checkpoint after epochs 2 and 4 only; a run stopped during
    epoch 4's write resumes from epoch 2, replays epochs 3-4 and ends with the weights of an uninterrupted
    run; the setting is not part of the run's identity."""
    import flatbench.training.loop as loop_mod
    from flatbench.training import Preempted

    rid, cfg = _tiny_run(epochs=5, optimizer="sgd", lr=0.05, checkpoint_every=2)
    assert rid == _tiny_run(epochs=5, optimizer="sgd", lr=0.05)[0]
    original, written = loop_mod.write_checkpoint, []

    def record(path, model, opt, sched, epoch, *args, **kwargs):
        written.append(epoch)
        if epoch == 4 and written.count(4) == 1:
            raise Preempted("test: preempted before the epoch-4 checkpoint")
        original(path, model, opt, sched, epoch, *args, **kwargs)

    monkeypatch.setattr(loop_mod, "write_checkpoint", record)
    with pytest.raises(Preempted):
        _train(rid, cfg, tmp_path / "resumed")
    assert written == [2, 4]
    resumed = _train(rid, cfg, tmp_path / "resumed")
    assert written == [2, 4, 4]  # resumed at epoch 2: epochs 3, 4 replayed, 5 not a multiple of 2
    monkeypatch.undo()
    _train(rid, cfg, tmp_path / "straight")
    a, b = _weights(tmp_path / "resumed" / rid), _weights(tmp_path / "straight" / rid)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["epoch"] for h in resumed["history"]] == [1, 2, 3, 4, 5]


def test_adam_uses_its_fused_kernel_on_float_parameters_and_sgd_is_unchanged():
    """Adam's fused kernel (a training step of a small MLP 20-30% faster on the CPU) wherever the parameters
    allow it: floating point, on the CPU or CUDA; it takes the same step as the reference loop, to rounding."""
    from flatbench.training.setup import make_optimizer

    _, adam = _tiny_run(lr=0.01, weight_decay=1e-3)
    _, sgd = _tiny_run(optimizer="sgd")
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    reference = torch.nn.Sequential(*[torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3)])
    reference.load_state_dict(model.state_dict())
    fused = make_optimizer(model, adam)
    assert fused.defaults["fused"] is True and not make_optimizer(model, sgd).defaults.get("fused")
    plain = torch.optim.Adam(reference.parameters(), lr=0.01, weight_decay=1e-3, foreach=False)
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    for _ in range(5):
        for net, opt in ((model, fused), (reference, plain)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, torch.zeros_like(a))
