"""Clusters: disjoint shards in parallel, run locks, submitit's local executor (with a requeue after a
preemption signal), `flatbench status`, and a real Slurm when one runs on this machine."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from flatbench.study.cluster import ClusterOptions, submit_study
from flatbench.study.status import study_status
from flatbench.config import parse_study
from flatbench.store import atomic_write_json, read_json
from flatbench.models import load_model
from flatbench.study.spec import save_study

from conftest import in_process, run_cli

ROOT = Path(__file__).resolve().parents[2]

SWEEP4 = {
    "name": "sweep4", "seed": [0, 1],
    "data": {"dataset": "mnist_mini", "n_train": 256, "n_test": 128, "random_label_ratio": [0.0, 1.0]},
    "model": {"name": "mlp", "widths": [16]},
    "train": {"epochs": 2, "batch_size": 64},
    "report": {"min_train_acc": 0.0},  # 2 epochs fit nothing: the cluster plumbing is what is tested
}
RUN_LINE = re.compile(r"^(\S+): train acc ", re.M)


def wait_for_runs(exp_dir: Path, timeout_s: float, poll_s: float = 2.0, until=None) -> dict:
    """Poll `study_status` until every run is finished or failed (or `until(status)`), or the timeout."""
    deadline = time.time() + timeout_s
    while True:
        st = study_status(exp_dir)
        c = st["counts"]
        if (until(st) if until else c["finished"] + c["failed"] == st["total"]) or time.time() > deadline:
            return st
        time.sleep(poll_s)


def _write(tmp_path: Path, raw: dict, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def _popen_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flatbench", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "MPLBACKEND": "Agg"})


def test_parallel_shards_train_every_run_exactly_once(tmp_path):
    """--shard 0/2 and 1/2 in parallel, plus an unsharded vectorized job racing them for the same runs:
    each run is trained by exactly one process (locks), and every run finishes."""
    cfg = _write(tmp_path, SWEEP4)
    out = str(tmp_path / "out")
    common = ("--out", out, "--device", "cpu", "--quiet")
    procs = {"0/2": _popen_cli("train", str(cfg), *common, "--shard", "0/2"),
             "1/2": _popen_cli("train", str(cfg), *common, "--shard", "1/2"),
             "all": _popen_cli("train", str(cfg), "train.vectorize=4", *common)}
    results = {k: p.communicate(timeout=600) for k, p in procs.items()}
    for k, p in procs.items():
        assert p.returncode == 0, (k, results[k][1])
    trained = {k: RUN_LINE.findall(stdout) for k, (stdout, _) in results.items()}
    ids = parse_study(SWEEP4).run_ids()
    assert sorted(r for runs in trained.values() for r in runs) == sorted(ids), trained  # exactly once each
    assert set(trained["0/2"]) <= set(ids[0::2]) and set(trained["1/2"]) <= set(ids[1::2])
    exp = tmp_path / "out" / "sweep4"
    for rid in ids:
        run = exp / "runs" / rid
        assert read_json(run / "run.json")["status"] == "finished"
        assert (run / "model.pt").is_file()
        assert not (run / ".lock").exists() and not (run / "checkpoint.pt").exists()
    st = in_process("status", str(exp), "--json")
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["counts"]["finished"] == 4


def test_local_executor_submits_returns_at_once_and_finishes(tmp_path):
    raw = dict(SWEEP4, name="local2", seed=0)
    cfg = _write(tmp_path, raw)
    t0 = time.time()
    result = run_cli("train", str(cfg), "--out", str(tmp_path / "out"), "--device", "cpu",
                     "--executor", "local", "--time", "10")
    assert result.returncode == 0, result.stderr
    assert "submitted 2 run(s)" in result.stdout and "job " in result.stdout
    exp = tmp_path / "out" / "local2"
    assert f"logs: {(exp / 'local').resolve()}/" in result.stdout
    st = wait_for_runs(exp, timeout_s=300)
    assert st["counts"]["finished"] == 2, st
    assert time.time() - t0 < 300
    logs = list((exp / "local").glob("*_log.out"))
    assert len(logs) == 2 and all("1 trained" in p.read_text() for p in logs)
    again = run_cli("train", str(cfg), "--out", str(tmp_path / "out"), "--executor", "local")
    assert again.returncode == 0 and "nothing to submit" in again.stdout
    measured = run_cli("measure", str(exp), "--measures", "frobenius_norm", "--device", "cpu",
                       "--executor", "local", "--runs-per-task", "2", "--wait")
    assert measured.returncode == 0, measured.stderr
    assert "as 1 task(s)" in measured.stdout and "all 1 task(s) finished" in measured.stdout
    for rid in parse_study(raw).run_ids():
        assert "frobenius_norm" in read_json(exp / "runs" / rid / "measures.json")


def test_a_task_packs_its_runs_onto_its_device_with_workers(tmp_path):
    """`--runs-per-task 2 --workers 2`: one array task trains its two runs at once in two worker
    processes on its device (on a GPU node: two runs sharing the task's GPU), with the files of runs
    trained alone."""
    raw = dict(SWEEP4, name="packed", seed=0)
    cfg = _write(tmp_path, raw)
    result = run_cli("train", str(cfg), "--out", str(tmp_path / "out"), "--device", "cpu", "--executor", "local",
                     "--runs-per-task", "2", "--workers", "2", "--time", "10", "--wait")
    assert result.returncode == 0, result.stderr
    assert "as 1 task(s)" in result.stdout and "all 1 task(s) finished" in result.stdout
    exp = tmp_path / "out" / "packed"
    (log,) = list((exp / "local").glob("*_log.out"))
    text = log.read_text()
    assert "training 2 runs in 2 worker processes" in text and "2 trained" in text
    for rid in parse_study(raw).run_ids():
        assert read_json(exp / "runs" / rid / "run.json")["status"] == "finished"


def test_run_with_local_executor_trains_measures_and_reports(tmp_path):
    """`flatbench run --executor local --wait`: each task trains its run and then measures it; the report
    is written once every task has ended."""
    raw = dict(SWEEP4, name="run2", seed=0, data=dict(SWEEP4["data"], random_label_ratio=[0.0, 0.5, 1.0]),
               measure={"measures": ["frobenius_norm", "hessian_trace"]})
    cfg = _write(tmp_path, raw)
    result = run_cli("run", str(cfg), "--out", str(tmp_path / "out"), "--device", "cpu", "--executor", "local",
                     "--time", "10", "--wait")
    assert result.returncode == 0, result.stderr
    exp = tmp_path / "out" / "run2"
    assert "submitted 3 run(s) to train and measure as 3 task(s)" in result.stdout, result.stdout
    assert f"logs: {(exp / 'local').resolve()}/" in result.stdout
    assert "all 3 task(s) finished" in result.stdout
    for rid in parse_study(raw).run_ids():
        run = exp / "runs" / rid
        assert read_json(run / "run.json")["status"] == "finished"
        measures = read_json(run / "measures.json")
        assert measures["frobenius_norm"]["status"] == "ok" and measures["hessian_trace"]["status"] == "ok"
    assert (exp / "report.md").is_file()
    logs = list((exp / "local").glob("*_log.out"))
    assert len(logs) == 3 and all("1 trained" in p.read_text() and "measured 1 runs" in p.read_text()
                                  for p in logs)
    st = study_status(exp)
    assert st["counts"]["finished"] == 3 and st["measured"] == 3


def test_run_with_executor_returns_at_once_and_prints_the_report_command(tmp_path):
    raw = dict(SWEEP4, name="run1", seed=[0, 1, 2], data=dict(SWEEP4["data"], random_label_ratio=0.0),
               measure={"measures": ["frobenius_norm"]})
    cfg = _write(tmp_path, raw)
    result = run_cli("run", str(cfg), "--out", str(tmp_path / "out"), "--device", "cpu", "--executor", "local",
                     "--time", "10")
    assert result.returncode == 0, result.stderr
    exp = tmp_path / "out" / "run1"
    assert f"flatbench report {exp}" in result.stdout and f"flatbench status {exp}" in result.stdout
    st = wait_for_runs(exp, timeout_s=300, until=lambda s: s["measured"] == s["total"])
    assert st["measured"] == 3, st
    assert not (exp / "report.md").exists()  # without --wait, the report is the user's next command
    report = in_process("report", str(exp))
    assert report.returncode == 0, report.stderr
    assert (exp / "report.md").is_file()


@pytest.mark.slow
def test_local_executor_requeues_a_task_after_its_preemption_signal(tmp_path):
    """SIGUSR2 (submitit's preemption/timeout signal) mid-training: the task checkpoints, submitit calls
    StudyTask.checkpoint() and requeues it, and the requeued task resumes to the uninterrupted weights."""
    raw = {"name": "requeue", "data": {"dataset": "mnist_mini", "n_train": 2000, "n_test": 200,
                                       "random_label_ratio": 0.5},
           "model": {"widths": [128, 128]}, "train": {"epochs": 5, "batch_size": 32}}
    study = parse_study(raw, out=str(tmp_path / "out"))
    sub = submit_study(study, "local", ClusterOptions(time_min=10), device="cpu")
    assert len(sub.jobs) == 1
    run = study.exp_dir / "runs" / study.run_ids()[0]
    deadline = time.time() + 300
    while not (run / "checkpoint.pt").exists() and time.time() < deadline:
        time.sleep(0.02)
    pid = int((run / ".lock").read_text().split()[1])  # the task's own process
    os.kill(pid, signal.SIGUSR2)
    outcome = sub.wait()[0]
    assert outcome.trained.trained == study.run_ids()
    info = read_json(run / "run.json")
    assert info["status"] == "finished", "the run finished before it was signalled"
    assert [h["epoch"] for h in info["history"]] == [1, 2, 3, 4, 5]
    log = next((study.exp_dir / "local").glob("*_log.out")).read_text()
    assert "asking submitit to requeue" in log and "Requeued job" in log, log
    assert log.count("train 1 run(s)") == 2, log  # started twice: the requeue resumed it
    # the uninterrupted run in a process of its own too (the test process runs torch on one thread)
    straight = run_cli("train", str(_write(tmp_path, raw)), "--out", str(tmp_path / "straight"), "--device", "cpu",
                       "--quiet")
    assert straight.returncode == 0, straight.stderr
    a = load_model(run).state_dict()
    b = load_model(tmp_path / "straight" / "requeue" / "runs" / study.run_ids()[0]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_status_counts_runs_in_every_state(tmp_path):
    raw = dict(SWEEP4, name="st", seed=[0, 1, 2])
    study = parse_study(raw, out=str(tmp_path))
    save_study(study)
    ids = study.run_ids()
    runs = study.exp_dir / "runs"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        def put(rid, status, **extra):
            (runs / rid).mkdir(parents=True, exist_ok=True)
            atomic_write_json(runs / rid / "run.json", {"run_id": rid, "status": status, **extra})

        put(ids[0], "finished", config=study.runs[0][1].to_dict(), train_acc=1.0, test_acc=0.9, train_loss=0.01,
            test_loss=0.5)  # a finished run.json holds its config and metrics (without them it is damaged)
        (runs / ids[0] / "model.pt").write_bytes(b"x")
        put(ids[1], "failed", error="ValueError: boom")
        put(ids[2], "preempted")
        put(ids[3], "running")  # killed without a trace: nobody holds its lock
        put(ids[4], "running")
        (runs / ids[4] / ".lock").write_text(f"{socket.gethostname()} {sleeper.pid}\n")
        st = study_status(study.exp_dir)
        assert st["counts"] == {"finished": 1, "running": 1, "preempted": 2, "failed": 1, "damaged": 0,
                                "not_started": 1}
        assert st["runs"][ids[1]]["detail"] == "ValueError: boom"
        text = run_cli("status", str(study.exp_dir))
        assert text.returncode == 0, text.stderr
        assert "6 runs" in text.stdout and f"{ids[1]}: ValueError: boom" in text.stdout
    finally:
        sleeper.kill()
        sleeper.wait()


def test_cluster_option_errors_are_one_line(tmp_path):
    cfg = _write(tmp_path, SWEEP4)
    bad = in_process("train", str(cfg), "--out", str(tmp_path / "o"), "--executor", "local", "--runs-per-task", "0")
    assert bad.returncode == 2 and "--runs-per-task must be at least 1" in bad.stderr
    no_slurm = run_cli("train", str(cfg), "--out", str(tmp_path / "o"), "--executor", "slurm",
                       env={"PATH": str(tmp_path / "empty")})
    assert no_slurm.returncode == 2 and "needs Slurm's sbatch" in no_slurm.stderr
    assert len(no_slurm.stderr.strip().splitlines()) == 1
    missing = in_process("status", str(tmp_path))
    assert missing.returncode == 2 and "not a flatbench experiment folder" in missing.stderr


def test_slurm_array_template_is_valid_bash():
    script = ROOT / "scripts" / "slurm_array.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "--shard \"$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT\"" in text and "--quiet" in text
    alone = subprocess.run(["bash", str(script), "x.yaml"], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert alone.returncode == 2 and "sbatch --array" in alone.stderr


# ---------------------------------------------------------------- a real Slurm


def _wait_for_usable_node(timeout_s: float) -> str | None:
    """Poll sinfo until a node can take jobs; None when one can, else what sinfo last said.

    A node stays "completing" for a while after the previous test's jobs end (epilog, cgroup
    clean-up); that is transient, so waiting for it to turn idle is part of asking whether Slurm works.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        info = subprocess.run(["sinfo", "-h", "-o", "%P %T"], capture_output=True, text=True, timeout=30)
        if info.returncode == 0 and re.search(r"idle|mixed|alloc", info.stdout):
            return None
        if time.monotonic() > deadline:
            return f"sinfo shows no usable node after {timeout_s:.0f} s: {info.stdout.strip() or info.stderr.strip()}"
        time.sleep(2)


def _require_slurm() -> None:
    """Skip without a local Slurm unless on CI; on CI (or with FLATBENCH_SLURM set) Slurm must answer."""
    wanted = os.environ.get("FLATBENCH_SLURM") or os.environ.get("CI")
    if not wanted:
        pytest.skip("no local Slurm: set FLATBENCH_SLURM=1 after ../shared/slurm/start-local-slurm.sh "
                    "(.ci/run starts it)")
    problem = None
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        problem = "sbatch/sinfo not on PATH"
    else:
        problem = _wait_for_usable_node(timeout_s=180)
    if problem:
        pytest.fail(f"Slurm test on CI or with FLATBENCH_SLURM set, but Slurm is unavailable: {problem}")


@pytest.mark.slurm
def test_executor_slurm_trains_a_sweep_on_a_real_slurm(tmp_path):
    _require_slurm()
    raw = dict(SWEEP4, name="slurm2", seed=0)
    cfg = _write(tmp_path, raw)
    result = run_cli("train", str(cfg), "--out", str(tmp_path / "out"), "--device", "cpu", "--executor", "slurm",
                     "--partition", "debug", "--time", "10", "--cpus-per-task", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    job = re.search(r"job (\d+)", result.stdout)
    assert job, result.stdout
    exp = tmp_path / "out" / "slurm2"
    st = wait_for_runs(exp, timeout_s=300)
    logs = "\n".join(p.read_text() for p in (exp / "slurm").glob("*_log.*"))
    assert st["counts"]["finished"] == 2, (st, logs)
    assert f"{job.group(1)}_0" in " ".join(p.name for p in (exp / "slurm").iterdir())  # one job array


@pytest.mark.slurm
def test_slurm_array_template_runs_shards_on_a_real_slurm(tmp_path):
    _require_slurm()
    cfg = _write(tmp_path, dict(SWEEP4, name="array4"))
    env = {**os.environ, "FLATBENCH": f"{sys.executable} -m flatbench"}
    submit = subprocess.run(["sbatch", "--wait", "--array=0-1", "--partition=debug", "--time=10",
                             "--cpus-per-task=1", str(ROOT / "scripts" / "slurm_array.sh"), str(cfg),
                             "--out", str(tmp_path / "out"), "--device", "cpu"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert submit.returncode == 0, (submit.stdout, submit.stderr, logs)
    st = study_status(tmp_path / "out" / "array4")
    assert st["counts"]["finished"] == 4, (st, logs)
    assert sorted(RUN_LINE.findall(logs)) == sorted(parse_study(SWEEP4).run_ids())
