"""The train stage: every unfinished run of a study (or of a shard of it), one by one or in vectorized
groups, after checking everything that can be checked first."""

from __future__ import annotations

from pathlib import Path

import torch

from flatbench.config import Study
from flatbench.errors import FlatbenchError
from flatbench.store import RUN_JSON, RunLocked, is_finished, run_dir
from flatbench.study.spec import (Echo, check_data, check_output_dir, check_study, save_study, shard_runs,
                                  show_progress)


def train_study(study: Study, device: torch.device, *, shard: tuple[int, int] | None = None,
                quiet: bool = False, echo: Echo = print, run_ids: list[str] | None = None) -> dict[str, list[str]]:
    """Train every unfinished run of the (shard of the) study; returns run ids by outcome.

    Runs that `train.vectorize` groups (see `flatbench.vectorized`) train at once, the others one after
    another, or, with `train.workers` > 1, several at once in worker processes on the same device
    (`flatbench.study.workers`); every way writes the same files. `run_ids` restricts the study to those runs (cluster tasks).
    Before anything is written: the names, the datasets, the output folder and every existing run folder
    (its stored config must be the run's, its model.pt the one it wrote) are checked.
    """
    from flatbench.train import check_run_dir
    from flatbench.vectorized import plan_groups

    check_study(study)
    outcome: dict[str, list[str]] = {"trained": [], "skipped": [], "locked": [], "failed": []}
    runs = shard_runs(study, shard)
    if run_ids is not None:
        wanted = set(run_ids)
        runs = [(rid, cfg) for rid, cfg in runs if rid in wanted]
    pending = []
    for rid, cfg in runs:
        if check_run_dir(run_dir(study.exp_dir, rid), rid, cfg) == "finished":
            outcome["skipped"].append(rid)
        else:
            pending.append((rid, cfg))
    check_data(study, pending)
    check_output_dir(study.exp_dir, "experiment folder")
    save_study(study)
    done = len(outcome["skipped"])
    groups = plan_groups(pending, device)
    workers = max((cfg.train.workers for _, cfg in pending), default=1)
    if workers > 1 and len(groups) > 1:
        _train_in_workers(groups, study, device, workers, outcome, echo)
        return outcome
    progress = show_progress(quiet)
    for group in groups:
        ids = [rid for rid, _ in group]
        if not quiet:
            echo(_starting(ids, done, len(runs)))
        done += len(ids)
        for key, values in train_group_job(group, study.exp_dir, device, study.sweep_axes, progress, echo).items():
            outcome[key].extend(values)
    return outcome


def _starting(ids: list[str], done: int, total: int) -> str:
    if len(ids) == 1:
        return f"[{done + 1}/{total}] training {ids[0]}"
    return f"[{done + 1}-{done + len(ids)}/{total}] training {len(ids)} runs at once: {', '.join(ids)}"


def train_group_job(group: list, exp_dir: Path, device: torch.device | str, sweep_axes: tuple,
                    progress: bool = False, echo: Echo = print) -> dict[str, list[str]]:
    """Train one planned group (one run, or a vectorized group); returns run ids by outcome. A run that
    fails is marked failed and the others go on; a stop signal or Ctrl-C propagates (checkpoints kept)."""
    from flatbench.train import Preempted, train_run
    from flatbench.vectorized import train_group

    device = torch.device(device)
    outcome: dict[str, list[str]] = {"trained": [], "skipped": [], "locked": [], "failed": []}
    ids = [rid for rid, _ in group]
    try:
        if len(group) == 1:
            rid, cfg = group[0]
            train_run(rid, cfg, run_dir(exp_dir, rid), device, sweep_axes=sweep_axes, progress=progress, echo=echo)
            outcome["trained"].append(rid)
        else:
            result = train_group(group, exp_dir, device, sweep_axes=sweep_axes, progress=progress, echo=echo)
            for key, values in result.items():
                outcome[key].extend(values)
    except RunLocked as exc:
        echo(f"skipping {ids[0]}: {exc}")
        outcome["locked"].append(ids[0])
    except (FlatbenchError, Preempted, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - one broken run must not stop the sweep
        for rid in ids:
            path = run_dir(exp_dir, rid)
            if not is_finished(path):
                _mark_failed(path, exc)
                echo(f"run {rid} failed: {type(exc).__name__}: {exc}")
                outcome["failed"].append(rid)
    return outcome


def _worker_train(group: list, exp_dir: str, device: str, sweep_axes: tuple) -> dict[str, list[str]]:
    """A worker process's job: one group; its output lines are returned (`lines`) for the parent to echo,
    and a stop signal is reported, not raised."""
    from flatbench.train import Preempted

    lines: list[str] = []
    try:
        result = train_group_job(group, Path(exp_dir), device, sweep_axes, progress=False, echo=lines.append)
    except Preempted as exc:
        result = {"preempted": [rid for rid, _ in group], "signal": [str(exc.signum)]}
    except KeyboardInterrupt:
        result = {"interrupted": [rid for rid, _ in group]}
    except FlatbenchError as exc:
        result = {"error": [str(exc)]}
    return {**result, "lines": lines}


def _train_in_workers(groups: list, study: Study, device: torch.device, workers: int,
                      outcome: dict[str, list[str]], echo: Echo) -> None:
    """`train.workers` > 1: the planned groups as jobs of a pool of worker processes on one device."""
    from flatbench.study.workers import run_jobs
    from flatbench.train import Preempted

    echo(f"training {sum(len(g) for g in groups)} runs in {min(workers, len(groups))} worker processes on {device}")
    stopped: dict[str, list[str]] = {}

    def collect(job: tuple, result: dict[str, list[str]]) -> None:
        for line in result.pop("lines", []):
            echo(line)
        for key, values in result.items():
            if key in outcome:
                outcome[key].extend(values)
            else:
                stopped.setdefault(key, []).extend(values)

    run_jobs(_worker_train, [(group, str(study.exp_dir), str(device), study.sweep_axes) for group in groups],
             workers, device, collect)
    if stopped.get("error"):
        raise FlatbenchError(stopped["error"][0])
    if stopped.get("preempted"):
        signum = int(stopped.get("signal", ["15"])[0])
        raise Preempted(f"signal {signum} ({len(stopped['preempted'])} run(s) checkpointed)", signum)
    if stopped.get("interrupted"):
        raise KeyboardInterrupt


def _mark_failed(path: Path, exc: BaseException) -> None:
    from flatbench.store import atomic_write_json, read_json

    info = read_json(path / RUN_JSON) if (path / RUN_JSON).is_file() else {"run_id": path.name}
    info.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    atomic_write_json(path / RUN_JSON, info)
