"""`flatbench status`: how far a study is (finished, running, preempted, failed, damaged, not started;
measured; run folders not in the study; damaged files), read from its folder alone."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from flatbench.errors import FlatbenchError
from flatbench.measures.keys import entry_keys
from flatbench.measures.registry import get_measure, resolve_names
from flatbench.measures.runner import DONE, FAILED
from flatbench.measures.targets import read_entries
from flatbench.measures.stale import stale_keys
from flatbench.locks import RunLock
from flatbench.store import RUN_JSON, load_run_info, run_dir, run_json_problem
from flatbench.study.cluster import EXECUTORS
from flatbench.study.spec import read_saved_study, stale_run_ids
from flatbench.study.validity import finished_run_problem


STATES = ("finished", "running", "preempted", "failed", "damaged", "not_started")


def _lock_held(run_path: Path) -> bool:
    lock = RunLock(run_path)
    return lock.path.exists() and not lock.is_stale()


def run_state(run_path: Path) -> tuple[str, str | None]:
    """(state, detail) of one run folder; state is one of STATES.

    running: its lock is held by a live process (or, from another host, a recent one); preempted: stopped
    with a checkpoint (status `preempted` or `interrupted`, or `running` with nobody holding the lock: a
    killed job); failed: status `failed` (detail: the error); damaged: finished, but its run.json is
    unreadable or its model.pt missing, corrupt or not the file it wrote (detail: which).
    """
    run_path = Path(run_path)
    held = _lock_held(run_path)
    damage = run_json_problem(run_path)
    if damage:
        return "damaged", damage
    if not (run_path / RUN_JSON).is_file():
        return ("running", None) if held else ("not_started", None)
    try:
        info = load_run_info(run_path)
    except FlatbenchError as exc:
        return "damaged", str(exc)
    status = info.get("status")
    if status == "finished":
        problem = finished_run_problem(run_path, info)
        if problem:
            return "damaged", problem
        return "finished", None
    if held:
        return "running", None
    if status == "failed":
        return "failed", info.get("error")
    return "preempted", None


def _expected_entries(study: Any) -> list[str]:
    """measures.json keys of the study's configured measures (one per loss for loss-based ones)."""
    try:
        names = resolve_names(list(study.measure.measures))
    except FlatbenchError:
        return []
    return [key for name in names for _, key in entry_keys(name, get_measure(name), study.measure.losses)]


def _measure_state(run_path: Path, keys: list[str]) -> tuple[bool, str | None, list[str]]:
    """(every configured entry present and current, the damage of measures.json if any, the stale entries:
    those of a plugin whose source changed since, `measures.stale`)."""
    entries, damaged = read_entries(run_path)
    problem = f"{run_path / 'measures.json'} is damaged ({damaged})" if damaged else None
    stale = stale_keys(entries)
    done = bool(keys) and all(entries.get(k, {}).get("status") in (*DONE, *FAILED) and k not in stale for k in keys)
    return done and not damaged, problem, stale


def study_status(exp_dir: str | Path) -> dict[str, Any]:
    """Counts of runs by state, from the experiment's study.yaml run list and the run folders.

    `measured`: finished runs whose measures.json has an entry for every configured measure (what
    `flatbench run --executor` waits for before `flatbench report`). `stale`: run folders that are not
    runs of the current config; `damaged_files`: measures.json files that need `flatbench measure`;
    `stale_entries`: entries of a plugin measure whose plugin changed since (each run's under its
    `stale_entries`): the report leaves them out and `flatbench measure` recomputes them.
    """
    exp_dir = Path(exp_dir)
    study = read_saved_study(exp_dir)
    keys = _expected_entries(study)
    runs: dict[str, dict] = {}
    measured = 0
    stale_entries = 0
    damaged_files = []
    for rid in study.run_ids():
        state, detail = run_state(run_dir(exp_dir, rid))
        runs[rid] = {"state": state, **({"detail": detail} if detail else {})}
        if state == "finished":
            done, problem, stale = _measure_state(run_dir(exp_dir, rid), keys)
            if problem:
                damaged_files.append(problem)
            if stale:
                runs[rid]["stale_entries"] = stale
                stale_entries += len(stale)
            if done:
                runs[rid]["measured"] = True
                measured += 1
    counts = {s: sum(1 for r in runs.values() if r["state"] == s) for s in STATES}
    logs = [str(exp_dir / k) for k in EXECUTORS if (exp_dir / k).is_dir()]
    return {"experiment": str(exp_dir), "total": len(runs), "counts": counts, "measured": measured,
            "runs": runs, "logs": logs, "stale": stale_run_ids(study), "damaged_files": damaged_files,
            "stale_entries": stale_entries}


def format_status(status: dict[str, Any]) -> str:
    c = status["counts"]
    lines = [f"{status['experiment']}: {status['total']} runs"]
    labels = {"finished": "finished", "running": "running", "preempted": "preempted or interrupted (resume by "
              "re-running)", "failed": "failed", "damaged": "damaged (model.pt or run.json; retrain them)",
              "not_started": "not started"}
    width = max(len(str(v)) for v in c.values()) if c else 1
    for state in STATES:
        lines.append(f"  {c[state]:>{width}}  {labels[state]}")
    if status.get("measured"):
        lines.append(f"  {status['measured']:>{width}}  of the finished runs have every configured measure")
    for state in ("failed", "damaged"):
        bad = {rid: r for rid, r in status["runs"].items() if r["state"] == state}
        if bad:
            lines.append(f"{state} runs:")
            for rid, r in bad.items():
                lines.append(f"  {rid}: {r.get('detail') or 'see its run.json'}")
    if status.get("stale_entries"):
        first = next((rid, r["stale_entries"]) for rid, r in status["runs"].items() if r.get("stale_entries"))
        lines.append(f"stale: {status['stale_entries']} measure entries of an edited plugin or loss file (e.g. "
                     f"{first[0]} {first[1][0]}): left out of the report; `flatbench measure` recomputes them")
    for problem in status.get("damaged_files", []):
        lines.append(f"damaged: {problem} (`flatbench measure` keeps its readable entries and recomputes the rest)")
    if status.get("stale"):
        shown = ", ".join(status["stale"][:5]) + (", ..." if len(status["stale"]) > 5 else "")
        lines.append(f"{len(status['stale'])} run folder(s) not in this study (an earlier config): {shown}")
    for log in status["logs"]:
        lines.append(f"job logs: {log}/")
    done = c["finished"] / status["total"] if status["total"] else 1.0
    lines.append(f"{math.floor(100 * done)}% done")
    return "\n".join(lines)
