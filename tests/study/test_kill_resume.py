"""kill -9 at a random moment of train, measure, report and audit, then the same command again, gives the
same files as an uninterrupted run (issue 30), one test per stage, through real processes.

A tiny quickstart-like study (three label-noise ratios, a small MLP, a norm, a solver and a seeded
Monte-Carlo measure) is run once without interruption, stage by stage (`uninterrupted`). Each test copies
the state before its stage, starts the stage as a subprocess, waits until the stage has begun writing (its
first file), SIGKILLs it after a seeded random delay, runs the same command again to the end, and compares
every file of the experiment with the uninterrupted run's.

Compared byte for byte: model.pt, study.yaml, every report CSV but table.csv, every plot PNG, and the audit's
CSVs and figure. Compared with the wall times taken out: run.json and measures.json (every `seconds` key:
the time an epoch or an entry took), table.csv and audit_population.csv (their `seconds` columns). Left
out: report.md and report.html, whose run-time table is wall time. Every subprocess runs on one thread, so
the numbers do not depend on how the machine's cores were shared.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
STUDY = {
    "name": "k", "seed": 0,
    "data": {"dataset": "mnist_mini", "n_train": 240, "n_test": 100, "random_label_ratio": [0.0, 0.5, 1.0]},
    "model": {"name": "mlp", "widths": [24]},
    "train": {"epochs": 4, "batch_size": 32, "lr": 0.003},
    "measure": {"measures": ["frobenius_norm", "spectral_norm", "adaptive_sharpness_avg"], "n_examples": 80,
                "settings": {"adaptive_sharpness_avg": {"samples": 4}}},
    "report": {"min_train_acc": 0.0},
}
EXCLUDED = {"report.md", "report.html"}
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def commands(root: Path) -> dict[str, list[str]]:
    exp = str(root / "out" / "k")
    return {"train": ["train", str(root / "k.yaml"), "--out", str(root / "out"), "--device", "cpu", "--quiet"],
            "measure": ["measure", exp, "--device", "cpu", "--quiet"],
            "report": ["report", exp, "--quiet"],
            "audit": ["audit", exp, "--population", "--draws", "1", "--max-factor", "2", "--device", "cpu"]}


def flatbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flatbench", *args], env=ENV, capture_output=True, text=True,
                          timeout=600)


def _without_seconds(value):
    if isinstance(value, dict):
        return {k: _without_seconds(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


def contents(exp: Path) -> dict[str, bytes]:
    """Every file of the experiment (path → bytes, wall times taken out: see the module doc)."""
    out = {}
    for path in sorted(p for p in exp.rglob("*") if p.is_file()):
        rel = str(path.relative_to(exp))
        if path.name in EXCLUDED:
            continue
        data = path.read_bytes()
        if path.suffix == ".json":
            data = json.dumps(_without_seconds(json.loads(data)), sort_keys=True).encode()
        elif path.name in ("table.csv", "audit_population.csv"):
            frame = pd.read_csv(io.BytesIO(data))
            data = frame.drop(columns=[c for c in frame.columns if "seconds" in c]).to_csv(index=False).encode()
        out[rel] = data
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The state of the study before each stage, and after the last, from one uninterrupted run."""
    root = tmp_path_factory.mktemp("straight")
    (root / "k.yaml").write_text(yaml.safe_dump(STUDY))
    states = {"train": None}
    cmds = commands(root)
    for stage, after in (("train", "measure"), ("measure", "report"), ("report", "audit"), ("audit", "done")):
        result = flatbench(*cmds[stage])
        assert result.returncode == 0, (stage, result.stdout, result.stderr)
        states[after] = tmp_path_factory.mktemp(f"before_{after}")
        shutil.copytree(root / "out", states[after] / "out")
    return states


def _started(stage: str, exp: Path, before: dict[str, float]) -> bool:
    """Whether the stage has begun writing: a file it writes is new or newer than before it started."""
    pattern = {"train": "runs/*/*", "measure": "runs/*/measures.json", "report": "*.csv",
               "audit": "audit_population.csv"}[stage]
    return any(before.get(str(p), -1.0) < p.stat().st_mtime for p in exp.glob(pattern) if p.is_file())


def kill_and_resume(stage: str, start_from: Path | None, tmp_path: Path, seed: int) -> Path:
    """Copy the state before `stage`, start the stage, SIGKILL it a random moment after it began writing,
    run it again to the end; returns the experiment folder."""
    root = tmp_path / "killed"
    root.mkdir()
    (root / "k.yaml").write_text(yaml.safe_dump(STUDY))
    if start_from is not None:
        shutil.copytree(start_from / "out", root / "out")
    exp = root / "out" / "k"
    rng = random.Random(seed)
    before = {str(p): p.stat().st_mtime for p in exp.rglob("*") if p.is_file()} if exp.is_dir() else {}
    cmd = commands(root)[stage]
    killed = False
    for window in (1.5, 0.5, 0.1):  # a shorter window when the stage finished before the kill
        proc = subprocess.Popen([sys.executable, "-m", "flatbench", *cmd], env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and not (exp.is_dir() and _started(stage, exp, before)):
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, window))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            killed = proc.wait() == -signal.SIGKILL
        else:
            proc.wait()
        if killed:
            break
        shutil.rmtree(root / "out", ignore_errors=True)  # it finished first: start again from the same state
        if start_from is not None:
            shutil.copytree(start_from / "out", root / "out")
    assert killed, f"{stage} always finished before the kill"
    resumed = flatbench(*cmd)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return exp


def _same(got: Path, want: Path) -> None:
    a, b = contents(got), contents(want / "out" / "k")
    assert sorted(a) == sorted(b)  # no file left over (a temporary, a lock, a checkpoint) and none missing
    differ = [k for k in a if a[k] != b[k]]
    assert not differ, differ


@pytest.mark.slow
def test_kill_9_during_train_then_resume(uninterrupted, tmp_path):
    _same(kill_and_resume("train", None, tmp_path, seed=301), uninterrupted["measure"])


@pytest.mark.slow
def test_kill_9_during_measure_then_resume(uninterrupted, tmp_path):
    _same(kill_and_resume("measure", uninterrupted["measure"], tmp_path, seed=302), uninterrupted["report"])


@pytest.mark.slow
def test_kill_9_during_report_then_resume(uninterrupted, tmp_path):
    _same(kill_and_resume("report", uninterrupted["report"], tmp_path, seed=303), uninterrupted["audit"])


@pytest.mark.slow
def test_kill_9_during_audit_then_resume(uninterrupted, tmp_path):
    _same(kill_and_resume("audit", uninterrupted["audit"], tmp_path, seed=304), uninterrupted["done"])
