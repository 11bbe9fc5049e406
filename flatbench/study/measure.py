"""The measure stage: every registered measure the study asks for, on every finished run's final model
and snapshots, each result cached in its measures.json (`flatbench.measures.runner`).

Two `measure` processes may work on one study at once (other `--measures`, another shard, a second job):
each model's folder is locked (`locks.folder_lock`) while its measures.json is read, computed into and
written, so one process never rewrites the file from what it read before the other wrote. A model that
another process holds is measured after the others, from what that process wrote. A run whose run.json
is damaged is recorded as not measurable and the others are measured."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from flatbench.config import Study
from flatbench.errors import Echo
from flatbench.measures.registry import resolve_names
from flatbench.measures.runner import (TargetPlan, io_failure, measure_plans, measure_run, plan_measures,
                                       plan_target)
from flatbench.measures.targets import Target, measure_targets
from flatbench.locks import folder_lock
from flatbench.store import missing_model, run_dir, run_info_or_problem
from flatbench.study.spec import check_study, shard_runs, show_progress
from flatbench.study.workers import run_jobs


@dataclass
class MeasureCounts:
    """What a measure pass did (for the CLI's last line and its exit code)."""

    measured: int = 0
    """Models (final or snapshot) measured or found complete."""
    not_trained: int = 0
    not_trained_ids: list[str] = field(default_factory=list)
    """The runs counted in `not_trained` (nothing was measured on them: `measure` exits 1 naming them)."""
    errors: int = 0
    """Measure entries that failed."""
    failed_runs: dict[str, str] = field(default_factory=dict)
    """Runs that could not be measured at all (corrupt or replaced model.pt, another config): the reason."""
    damaged_files: list[str] = field(default_factory=list)
    """measures.json files that were damaged (their readable entries were kept)."""
    failed_entries: list[tuple[str, str, str]] = field(default_factory=list)
    """(model, entry key, reason) of every entry that failed (error or non_finite): the stage exits with 1."""


@dataclass
class MeasurePlan:
    """The measure stage's plan, built once from the study (`plan_measure_stage`) and passed down: the
    measures resolved once (for final models and for snapshots), every model to measure with its
    measures.json as read once, and the runs that cannot be measured (in `counts`)."""

    study: Study
    names: list[str] | None
    """The measures named on the command line (None: the study's)."""
    force: bool
    targets: list[TargetPlan]
    counts: MeasureCounts


def plan_measure_stage(study: Study, *, names: list[str] | None = None, force: bool = False,
                       shard: tuple[int, int] | None = None, run_ids: list[str] | None = None,
                       chosen: list[str] | None = None, quiet: bool = False, echo: Echo = print) -> MeasurePlan:
    """Check the study (`check_study`: its plugins loaded and checked) unless the caller did (`chosen`: the
    resolved names it returned), resolve the measures once, read each run.json and each measures.json once,
    and list what is to compute. Damaged and untrained runs are counted, not planned."""
    exp_dir, cfg = study.exp_dir, study.measure  # the study is read in order: config, spec, then the registry
    runs = [rid for rid, _ in shard_runs(study, shard) if run_ids is None or rid in run_ids]
    chosen = chosen if chosen is not None else check_study(study, names)
    final = plan_measures(chosen, cfg)
    snapshot = final if names or cfg.snapshot_measures is None else \
        plan_measures(resolve_names(list(cfg.snapshot_measures)), cfg)
    counts = MeasureCounts()
    plans = [plan_target(target, final if target.level is None else snapshot, force)
             for target in _targets(exp_dir, runs, cfg.snapshots, counts, quiet, echo)]
    return MeasurePlan(study, names, force, plans, counts)


def measure_study(study: Study, device: torch.device, *, names: list[str] | None = None, force: bool = False,
                  shard: tuple[int, int] | None = None, quiet: bool = False, echo: Echo = print,
                  run_ids: list[str] | None = None, chosen: list[str] | None = None) -> MeasureCounts:
    """Compute the configured (or given) measures on every finished run of the study (of the shard, or of
    `run_ids`), and on the snapshots they kept when `measure.snapshots` is on: plan once
    (`plan_measure_stage`), then compute and store model by model.

    A run whose model cannot be used (corrupt, replaced, another config) gets its error recorded in every
    pending entry, and the pass goes on with the other runs; the caller exits non-zero at the end.
    `chosen`: the resolved measure names when the caller has already checked the study (`check_study`
    returns them), so it is not checked again.
    """
    plan = plan_measure_stage(study, names=names, force=force, shard=shard, run_ids=run_ids, chosen=chosen,
                              quiet=quiet, echo=echo)
    counts = plan.counts

    def count(target: Any, report: Any, seconds: float) -> None:
        counts.measured += 1
        counts.errors += report.errors
        counts.failed_entries.extend(report.failed)
        if report.damaged:
            counts.damaged_files.append(report.damaged)
        if report.failure:
            counts.failed_runs[target.label] = report.failure
        if quiet:
            echo(f"{target.label}: {report.entries} measure entries ({seconds:.1f}s)"
                 + (f"; FAILED: {report.failure}" if report.failure else ""))

    if study.measure.workers > 1 and len(plan.targets) > 1:
        _measure_in_workers(plan, device, quiet, echo, count)
        return counts
    bar = _MeasureBar(plan.targets) if show_progress(quiet) else None
    try:
        measure_plans(plan.targets, study.measure, device, done=count,
                      echo=None if quiet else (bar.write if bar else echo), on_entry=bar.advance if bar else None)
    finally:
        if bar is not None:
            bar.close()
    return counts


def _targets(exp_dir: Path, runs: list[str], snapshots: bool, counts: MeasureCounts, quiet: bool,
             echo: Echo) -> list[Target]:
    """The models to measure (final and, with `snapshots`, the snapshots) of the finished runs among `runs`,
    each run.json read once; damaged and untrained runs are counted in `counts` instead."""
    targets = []
    for rid in runs:
        path = run_dir(exp_dir, rid)
        info, problem = run_info_or_problem(path)
        problem = problem or (missing_model(path, info) if info is not None else None)
        if problem:
            counts.failed_runs[rid] = problem  # damage, never "not trained yet": the other runs are measured
            if not quiet:
                echo(f"  {rid}: cannot be measured: {problem}")
            continue
        if info is None or info.get("status") != "finished":
            counts.not_trained += 1
            counts.not_trained_ids.append(rid)
            continue
        targets.extend(measure_targets(path, snapshots=snapshots, info=info))
    return targets


def _measure_in_workers(plan: MeasurePlan, device: torch.device, quiet: bool, echo: Echo,
                        count: Callable[[Any, Any, float], None]) -> None:
    """`measure.workers` > 1: one job per model in a pool of worker processes on the device (each worker
    plans its one model again from the names: a plan holds the registry's functions, which do not travel)."""
    cfg = plan.study.measure
    if not quiet:
        echo(f"measuring {len(plan.targets)} models in {min(cfg.workers, len(plan.targets))} worker "
             f"processes on {device}")

    def collect(job: tuple, result: tuple) -> None:
        report, seconds, lines = result
        for line in lines:
            echo(line)
        count(job[0], report, seconds)

    jobs = [(p.target, [m.spec.name for m in p.measures], cfg, str(device), plan.force, quiet) for p in plan.targets]
    run_jobs(_worker_measure, jobs, cfg.workers, device, collect)


def _worker_measure(target: Any, names: list[str], cfg: Any, device: str, force: bool, quiet: bool
                    ) -> tuple[Any, float, list[str]]:
    """A worker process's job: measure one model; returns its report, seconds and output lines (for the
    parent to echo)."""
    lines: list[str] = []
    t0 = time.perf_counter()
    try:
        with folder_lock(target.where):
            report = measure_run(target, names, cfg, torch.device(device), force=force,
                                 echo=None if quiet else lines.append)
    except OSError as exc:  # as in this process (`runner.measure_plans`): this model failed, the others go on
        report = io_failure(target, exc, len(names), None if quiet else lines.append)
    return report, time.perf_counter() - t0, lines


class _MeasureBar:
    """One progress bar over every (model, measure entry) still to compute; lines go above it."""

    def __init__(self, plans: list[TargetPlan]):
        total = sum(len(plan.todo) for plan in plans)
        self.bar = tqdm(total=total, unit="measure", dynamic_ncols=True, leave=False, desc="measuring")

    def write(self, line: str) -> None:
        self.bar.write(line)

    def advance(self, label: str, key: str) -> None:
        self.bar.set_description_str(f"{label} {key}"[-60:])
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
