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
from flatbench.store import RunLock, atomic_write_json, read_json
from flatbench.train import load_model, train_run

from conftest import run_cli


def _tiny_run(**train):
    study = parse_study({"data": {"dataset": "mnist_mini", "n_train": 256, "n_test": 128,
                                  "random_label_ratio": 0.5},
                         "model": {"widths": [16]}, "train": {"epochs": 2, "batch_size": 64, **train}})
    return study.runs[0]


def _weights(run_path: Path) -> dict[str, torch.Tensor]:
    return load_model(run_path).state_dict()


def test_same_config_gives_bit_identical_weights(tmp_path):
    rid, cfg = _tiny_run()
    a = train_run(rid, cfg, tmp_path / "a", torch.device("cpu"), progress=False, echo=lambda m: None)
    b = train_run(rid, cfg, tmp_path / "b", torch.device("cpu"), progress=False, echo=lambda m: None)
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["train_acc"] == b["train_acc"] and a["status"] == "finished"
    info = read_json(tmp_path / "a" / "run.json")
    for key in ("config", "labels", "train_acc", "test_acc", "train_loss", "test_loss", "gap_acc", "gap_loss",
                "epochs", "seconds", "device", "versions", "history"):
        assert key in info
    assert info["labels"]["n_corrupted"] == 128 and info["labels"]["scheme"] == "uniform"
    assert info["gap_acc"] == pytest.approx(info["train_acc"] - info["test_acc"])
    assert not (tmp_path / "a" / "checkpoint.pt").exists()


def test_finished_run_is_skipped_and_other_config_is_refused(tmp_path):
    rid, cfg = _tiny_run()
    train_run(rid, cfg, tmp_path / "a", torch.device("cpu"), progress=False, echo=lambda m: None)
    mtime = (tmp_path / "a" / "model.pt").stat().st_mtime_ns
    train_run(rid, cfg, tmp_path / "a", torch.device("cpu"), progress=False, echo=lambda m: None)
    assert (tmp_path / "a" / "model.pt").stat().st_mtime_ns == mtime
    _, other = _tiny_run(lr=0.01)
    from flatbench.errors import FlatbenchError
    with pytest.raises(FlatbenchError, match="different config"):
        train_run(rid, other, tmp_path / "a", torch.device("cpu"), progress=False, echo=lambda m: None)


def test_early_stop_at_target_train_accuracy(tmp_path):
    rid, cfg = _tiny_run(epochs=30, target_train_acc=0.3)
    info = train_run(rid, cfg, tmp_path / "a", torch.device("cpu"), progress=False, echo=lambda m: None)
    assert info["epochs"] < 30
    assert info["history"][-1]["train_acc"] >= 0.3


@pytest.mark.parametrize("schedule, optimizer", [("cosine", "sgd"), ("step", "adam")])
def test_schedules_and_optimizers_train(tmp_path, schedule, optimizer):
    rid, cfg = _tiny_run(schedule=schedule, optimizer=optimizer, step_size=1, lr=0.01)
    info = train_run(rid, cfg, tmp_path / "a", torch.device("cpu"), progress=False, echo=lambda m: None)
    lrs = [h["lr"] for h in info["history"]]
    assert lrs[-1] < 0.01


INTERRUPT_CONFIG = {
    "name": "resume", "seed": 0,
    "data": {"dataset": "mnist_mini", "n_train": 3000, "n_test": 200, "random_label_ratio": 0.5},
    "model": {"name": "mlp", "widths": [256, 256]},
    "train": {"epochs": 8, "batch_size": 32},
}


def _interrupt(tmp_path: Path, sig: int) -> tuple[Path, int]:
    import yaml

    cfg = tmp_path / "resume.yaml"
    cfg.write_text(yaml.safe_dump(INTERRUPT_CONFIG))
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "flatbench", "train", str(cfg), "--out", str(out),
                             "--device", "cpu", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    run = out / "resume" / "runs" / "mlp-mnist_mini-r0.50-s0"
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
        run = tmp_path / "interrupted" / "resume" / "runs" / "mlp-mnist_mini-r0.50-s0"
        assert read_json(run / "run.json")["status"] == "preempted"
    resumed = run_cli("train", str(cfg), "--out", str(tmp_path / "interrupted"), "--device", "cpu", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    straight = run_cli("train", str(cfg), "--out", str(tmp_path / "straight"), "--device", "cpu", "--quiet")
    assert straight.returncode == 0, straight.stderr
    rid = "mlp-mnist_mini-r0.50-s0"
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
                                "from flatbench.store import RunLock; RunLock(r'%s').acquire()" % tmp_path],
                               capture_output=True, text=True)
        assert other.returncode != 0 and "RunLocked" in other.stderr
    assert not (tmp_path / ".lock").exists()
    import socket
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(f"{socket.gethostname()} {dead.pid}\n")
    with RunLock(tmp_path) as lock:
        assert lock.held
