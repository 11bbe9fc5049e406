"""The train stage: every unfinished run of a study (or of a shard of it), one by one or in vectorized
groups, after checking everything that can be checked first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flatbench.config import Study
from flatbench.errors import Echo, FlatbenchError
from flatbench.locks import RunLocked
from flatbench.store import (RUN_JSON, STUDY_FILE, atomic_write_json, atomic_write_text, is_finished, read_json,
                             run_dir)
from flatbench.study.spec import check_output_dir, check_runs_data, check_study, shard_runs, show_progress, study_text
from flatbench.study.workers import run_jobs
from flatbench.training import (Preempted, add_calibration, needs_calibration, StopFlag, TrainOutcome, WorkerReport, check_run_dir, plan_groups,
                                train_group, train_run)


@dataclass(frozen=True)
class TrainPlan:
    """What the train stage does, decided from the study before any work: the experiment folder, the runs
    of this shard (finished ones skipped; `calibrate`: finished ones trained before flatbench recorded the
    calibrated cross-entropy, completed from their model.pt), the sweep's axes (for run names) and the
    study.yaml to store."""

    exp_dir: Path
    total: int
    pending: list[tuple[str, Any]]
    skipped: list[str]
    calibrate: list[tuple[str, Any]]
    sweep_axes: tuple[str, ...]
    study_yaml: str


def train_study(study: Study, device: torch.device, *, shard: tuple[int, int] | None = None,
                quiet: bool = False, echo: Echo = print, run_ids: list[str] | None = None,
                checked: bool = False) -> TrainOutcome:
    """Train every unfinished run of the (shard of the) study; returns run ids by outcome.

    Runs that `train.vectorize` groups (see `flatbench.training.vectorized`) train at once, the others one after
    another, or, with `train.workers` > 1, several at once in worker processes on the same device
    (`flatbench.study.workers`); every way writes the same files. `run_ids` restricts the study to those runs (cluster tasks).
    Before anything is written: the names, the datasets, the output folder and every existing run folder
    (its stored config must be the run's, its model.pt the one it wrote) are checked; `checked=True` says
    that the caller has already run `check_study` on this study (`flatbench run`), so it is not run again.
    The stage reads as plan (`_plan`, the only step that reads the study) → compute → store (`_train`).
    """
    with StopFlag() as stop:  # a stop signal is kept for the whole stage (between runs too)
        return _train(_plan(study, shard, run_ids, checked), device, stop, quiet=quiet, echo=echo)


def _plan(study: Study, shard: tuple[int, int] | None, run_ids: list[str] | None, checked: bool) -> TrainPlan:
    """The train stage's plan: the study read once, in order (its folder and runs, its saved text, its
    names checked), then each run folder and the data checked."""
    exp_dir = study.exp_dir
    runs = [(rid, cfg) for rid, cfg in shard_runs(study, shard) if run_ids is None or rid in run_ids]
    text = study_text(study)
    if not checked:
        check_study(study)
    plan = TrainPlan(exp_dir=exp_dir, total=len(runs), pending=[], skipped=[], calibrate=[],
                     sweep_axes=study.sweep_axes, study_yaml=text)
    for rid, cfg in runs:
        if check_run_dir(run_dir(exp_dir, rid), rid, cfg) == "finished":
            plan.skipped.append(rid)
            if needs_calibration(read_json(run_dir(exp_dir, rid) / RUN_JSON)):
                plan.calibrate.append((rid, cfg))
        else:
            plan.pending.append((rid, cfg))
    check_runs_data(plan.pending, study.measure.n_examples)
    check_output_dir(exp_dir, "experiment folder")
    return plan


def _train(plan: TrainPlan, device: torch.device, stop: StopFlag, *, quiet: bool, echo: Echo) -> TrainOutcome:
    """The study stored (study.yaml), then the compute loop over the planned groups."""
    atomic_write_text(plan.exp_dir / STUDY_FILE, plan.study_yaml)
    _calibrate(plan, device, stop, quiet=quiet, echo=echo)
    outcome = TrainOutcome(skipped=list(plan.skipped))
    done = len(outcome.skipped)
    groups = plan_groups(plan.pending, device)
    workers = max((cfg.train.workers for _, cfg in plan.pending), default=1)
    if workers > 1 and len(groups) > 1:
        _train_in_workers(groups, plan, device, workers, outcome, echo)
        return outcome
    progress = show_progress(quiet)
    for group in groups:
        stop.check()  # a signal during the last run's evaluation or save: no other run starts
        ids = [rid for rid, _ in group]
        if not quiet:
            echo(_starting(ids, done, plan.total))
        done += len(ids)
        outcome.add(train_group_job(group, plan.exp_dir, device, plan.sweep_axes, progress, echo))
    return outcome


def _calibrate(plan: TrainPlan, device: torch.device, stop: StopFlag, *, quiet: bool, echo: Echo) -> None:
    """Complete the finished runs that lack the calibrated cross-entropy from their model.pt (no retraining);
    a run held by another job is left for the next call."""
    done, datasets = 0, {}
    for rid, cfg in plan.calibrate:
        stop.check()
        try:
            done += add_calibration(run_dir(plan.exp_dir, rid), cfg, device, datasets)
        except RunLocked:
            continue
    if done and not quiet:
        echo(f"added the temperature-calibrated cross-entropy to {done} finished run(s) (from their model.pt)")


def _starting(ids: list[str], done: int, total: int) -> str:
    if len(ids) == 1:
        return f"[{done + 1}/{total}] training {ids[0]}"
    return f"[{done + 1}-{done + len(ids)}/{total}] training {len(ids)} runs at once: {', '.join(ids)}"


def train_group_job(group: list, exp_dir: Path, device: torch.device | str, sweep_axes: tuple,
                    progress: bool = False, echo: Echo = print) -> TrainOutcome:
    """Train one planned group (one run, or a vectorized group); returns run ids by outcome. A run that
    fails is marked failed and the others go on; a stop signal or Ctrl-C propagates (checkpoints kept)."""
    device = torch.device(device)
    outcome = TrainOutcome()
    ids = [rid for rid, _ in group]
    try:
        if len(group) == 1:
            rid, cfg = group[0]
            train_run(rid, cfg, run_dir(exp_dir, rid), device, sweep_axes=sweep_axes, progress=progress, echo=echo)
            outcome.trained.append(rid)
        else:
            outcome.add(train_group(group, exp_dir, device, sweep_axes=sweep_axes, progress=progress, echo=echo))
    except RunLocked as exc:
        echo(f"skipping {ids[0]}: {exc}")
        outcome.locked.append(ids[0])
    except (FlatbenchError, Preempted, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - one broken run must not stop the sweep
        for rid in ids:
            path = run_dir(exp_dir, rid)
            if not is_finished(path):
                _mark_failed(path, exc)
                echo(f"run {rid} failed: {type(exc).__name__}: {exc}")
                outcome.failed.append(rid)
    return outcome


def _worker_train(group: list, exp_dir: str, device: str, sweep_axes: tuple) -> WorkerReport:
    """A worker process's job: one group; its output lines are returned for the parent to echo, and a stop
    signal, Ctrl-C or a one-line error is reported, not raised."""
    report = WorkerReport(TrainOutcome())
    ids = [rid for rid, _ in group]
    try:
        report.outcome = train_group_job(group, Path(exp_dir), device, sweep_axes, progress=False,
                                         echo=report.lines.append)
    except Preempted as exc:
        report.preempted, report.signum = ids, exc.signum
    except KeyboardInterrupt:
        report.interrupted = ids
    except FlatbenchError as exc:
        report.error = str(exc)
    return report


def _train_in_workers(groups: list, plan: TrainPlan, device: torch.device, workers: int,
                      outcome: TrainOutcome, echo: Echo) -> None:
    """`train.workers` > 1: the planned groups as jobs of a pool of worker processes on one device."""
    echo(f"training {sum(len(g) for g in groups)} runs in {min(workers, len(groups))} worker processes on {device}")
    reports: list[WorkerReport] = []

    def collect(job: tuple, report: WorkerReport) -> None:
        for line in report.lines:
            echo(line)
        outcome.add(report.outcome)
        reports.append(report)

    run_jobs(_worker_train, [(group, str(plan.exp_dir), str(device), plan.sweep_axes) for group in groups],
             workers, device, collect, hold_signals=True)
    errors = [r.error for r in reports if r.error]
    if errors:
        raise FlatbenchError(errors[0])
    preempted = [r for r in reports if r.preempted]
    if preempted:
        signum = next((r.signum for r in preempted if r.signum is not None), 15)
        raise Preempted(f"signal {signum} ({sum(len(r.preempted) for r in preempted)} run(s) checkpointed)", signum)
    if any(r.interrupted for r in reports):
        raise KeyboardInterrupt


def _mark_failed(path: Path, exc: BaseException) -> None:
    try:
        info = read_json(path / RUN_JSON) if (path / RUN_JSON).is_file() else {}
    except FlatbenchError:
        info = {}
    if not isinstance(info, dict):
        info = {}
    info.setdefault("run_id", path.name)
    info.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    atomic_write_json(path / RUN_JSON, info)
