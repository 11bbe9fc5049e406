"""The measure stage: every registered measure the study asks for, on every finished run's final model
and snapshots, each result cached in its measures.json (`flatbench.measures.runner`).

Two `measure` processes may work on one study at once (other `--measures`, another shard, a second job):
each model's folder is locked (`store.folder_lock`) while its measures.json is read, computed into and
written, so one process never rewrites the file from what it read before the other wrote. A model that
another process holds is measured after the others, from what that process wrote. A run whose run.json
is damaged is recorded as not measurable and the others are measured."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from flatbench.config import Study
from flatbench.errors import Echo, FlatbenchError
from flatbench.measures.runner import build_context, measure_run, measure_targets, pending_entries
from flatbench.measures.shared import prime_hessian_diagonals
from flatbench.store import folder_lock, is_finished, missing_model, run_dir, run_json_problem
from flatbench.study.spec import check_study, names_for, shard_runs, show_progress
from flatbench.study.workers import run_jobs


GROUP_SIZE = 16
"""Runs whose Hessian diagonals are computed together (`measure.group_runs`)."""


def grouped_contexts(targets: list, pending: dict, cfg: Any, device: torch.device) -> dict:
    """Contexts of the targets that still need a curvature measure (`pending`: each target's entries to
    compute), with the exact Hessian diagonals of same-architecture MLPs computed as groups
    (`flatbench.measures.shared.prime_hessian_diagonals`); the others are measured as usual."""
    contexts = {}
    for target in targets:
        if any(spec.cost == "hessian" for spec, _, _ in pending.get(target, [])):
            try:
                contexts[target] = build_context(target, cfg, device)
            except FlatbenchError:
                continue  # measured alone, where the error is recorded
    prime_hessian_diagonals(list(contexts.values()), cfg.losses)
    return contexts


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


def measure_study(study: Study, device: torch.device, *, names: list[str] | None = None, force: bool = False,
                  shard: tuple[int, int] | None = None, quiet: bool = False, echo: Echo = print,
                  run_ids: list[str] | None = None, chosen: list[str] | None = None) -> MeasureCounts:
    """Compute the configured (or given) measures on every finished run of the study (of the shard, or of
    `run_ids`), and on the snapshots they kept when `measure.snapshots` is on.

    A run whose model cannot be used (corrupt, replaced, another config) gets its error recorded in every
    pending entry, and the pass goes on with the other runs; the caller exits non-zero at the end.
    `chosen`: the resolved measure names when the caller has already checked the study (`check_study`
    returns them), so it is not checked again.
    """
    chosen = chosen if chosen is not None else check_study(study, names)
    counts = MeasureCounts()
    targets = _targets(study, shard, run_ids, counts, quiet, echo)
    plan = {target: names_for(target, chosen, study, names) for target in targets}

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

    if study.measure.workers > 1 and len(targets) > 1:
        _measure_in_workers(targets, plan, study, device, force, quiet, echo, count)
    else:
        _measure_here(targets, plan, study, device, force, quiet, echo, count)
    return counts


def _targets(study: Study, shard: tuple[int, int] | None, run_ids: list[str] | None, counts: MeasureCounts,
             quiet: bool, echo: Echo) -> list:
    """The models to measure (final and snapshots) of the finished runs; damaged and untrained runs are
    counted in `counts` instead."""
    targets = []
    for rid, _ in shard_runs(study, shard):
        if run_ids is not None and rid not in run_ids:
            continue
        path = run_dir(study.exp_dir, rid)
        problem = run_json_problem(path)
        if problem:
            counts.failed_runs[rid] = problem  # damaged: recorded, and the other runs are measured
            if not quiet:
                echo(f"  {rid}: cannot be measured: {problem}")
            continue
        if not is_finished(path):
            missing = missing_model(path)
            if missing:
                counts.failed_runs[rid] = missing  # damage, never "not trained yet"
                if not quiet:
                    echo(f"  {rid}: cannot be measured: {missing}")
            else:
                counts.not_trained += 1
                counts.not_trained_ids.append(rid)
            continue
        targets.extend(measure_targets(path, snapshots=study.measure.snapshots))
    return targets


def _measure_in_workers(targets: list, plan: dict, study: Study, device: torch.device, force: bool, quiet: bool,
                        echo: Echo, count: Callable[[Any, Any, float], None]) -> None:
    """`measure.workers` > 1: one job per model in a pool of worker processes on the device."""
    if not quiet:
        echo(f"measuring {len(targets)} models in {min(study.measure.workers, len(targets))} worker "
             f"processes on {device}")

    def collect(job: tuple, result: tuple) -> None:
        report, seconds, lines = result
        for line in lines:
            echo(line)
        count(job[0], report, seconds)

    run_jobs(_worker_measure, [(t, plan[t], study.measure, str(device), force, quiet) for t in targets],
             study.measure.workers, device, collect)


def _pending(plan: dict, cfg: Any, force: bool) -> dict:
    """Each target's entries still to compute, read once for the progress bar and the grouped diagonals
    (a model that cannot be read has none here: measuring it records its error)."""
    out = {}
    for target, names in plan.items():
        try:
            out[target] = pending_entries(target, names, cfg, force)[1]
        except FlatbenchError:
            out[target] = []
    return out


def _measure_here(targets: list, plan: dict, study: Study, device: torch.device, force: bool, quiet: bool,
                  echo: Echo, count: Callable[[Any, Any, float], None]) -> None:
    """The models one after another in this process (grouped Hessian diagonals where asked), a model
    held by another process last, on what that process wrote."""
    use_groups = study.measure.group_runs == "on" or (study.measure.group_runs == "auto" and device.type == "cuda")
    pending = _pending(plan, study.measure, force) if use_groups or show_progress(quiet) else {}
    bar = _MeasureBar(pending) if show_progress(quiet) else None
    step = GROUP_SIZE if use_groups else 1
    busy: list = []

    def measure_one(target: Any, ctx: Any, blocking: bool) -> bool:
        with folder_lock(target.where, blocking=blocking) as held:
            if not held:
                return False
            t0 = time.perf_counter()
            report = measure_run(target, plan[target], study.measure, device, force=force,
                                 echo=None if quiet else (bar.write if bar else echo),
                                 ctx=ctx, on_entry=bar.advance if bar else None)
            count(target, report, time.perf_counter() - t0)
        return True

    try:
        for start in range(0, len(targets), step):
            batch = targets[start:start + step]
            contexts = grouped_contexts(batch, pending, study.measure, device) if use_groups else {}
            for target in batch:
                if not measure_one(target, contexts.pop(target, None), blocking=False):
                    busy.append(target)  # another process measures it now: after the others, on what it wrote
        for target in busy:
            measure_one(target, None, blocking=True)
    finally:
        if bar is not None:
            bar.close()


def _worker_measure(target: Any, names: list[str], cfg: Any, device: str, force: bool, quiet: bool
                    ) -> tuple[Any, float, list[str]]:
    """A worker process's job: measure one model; returns its report, seconds and output lines (for the
    parent to echo)."""
    lines: list[str] = []
    with folder_lock(target.where):
        t0 = time.perf_counter()
        report = measure_run(target, names, cfg, torch.device(device), force=force,
                             echo=None if quiet else lines.append)
    return report, time.perf_counter() - t0, lines


class _MeasureBar:
    """One progress bar over every (model, measure entry) still to compute; lines go above it."""

    def __init__(self, pending: dict):
        total = sum(len(todo) for todo in pending.values())
        self.bar = tqdm(total=total, unit="measure", dynamic_ncols=True, leave=False, desc="measuring")

    def write(self, line: str) -> None:
        self.bar.write(line)

    def advance(self, label: str, key: str) -> None:
        self.bar.set_description_str(f"{label} {key}"[-60:])
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
