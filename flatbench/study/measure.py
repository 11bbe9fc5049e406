"""The measure stage: every registered measure the study asks for, on every finished run's final model
and snapshots, each result cached in its measures.json (`flatbench.measures.runner`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from flatbench.config import Study
from flatbench.errors import FlatbenchError
from flatbench.store import is_finished, run_dir
from flatbench.study.spec import Echo, check_study, names_for, shard_runs, show_progress


GROUP_SIZE = 16
"""Runs whose Hessian diagonals are computed together (`measure.group_runs`)."""


def grouped_contexts(targets: list, names: list[str], cfg: Any, device: torch.device, force: bool) -> dict:
    """Contexts of the targets that still need a curvature measure, with the exact Hessian diagonals of
    same-architecture MLPs computed as groups (`flatbench.measures.shared.prime_hessian_diagonals`); the
    others are measured as usual."""
    from flatbench.measures.runner import build_context, pending_entries
    from flatbench.measures.shared import prime_hessian_diagonals

    contexts = {}
    for target in targets:
        _, todo = pending_entries(target, names, cfg, force)
        if any(spec.cost == "hessian" for spec, _, _ in todo):
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
    errors: int = 0
    """Measure entries that failed."""
    failed_runs: dict[str, str] = field(default_factory=dict)
    """Runs that could not be measured at all (corrupt or replaced model.pt, another config): the reason."""
    damaged_files: list[str] = field(default_factory=list)
    """measures.json files that were damaged (their readable entries were kept)."""


def measure_study(study: Study, device: torch.device, *, names: list[str] | None = None, force: bool = False,
                  shard: tuple[int, int] | None = None, quiet: bool = False, echo: Echo = print,
                  run_ids: list[str] | None = None) -> MeasureCounts:
    """Compute the configured (or given) measures on every finished run of the study (of the shard, or of
    `run_ids`), and on the snapshots they kept when `measure.snapshots` is on.

    A run whose model cannot be used (corrupt, replaced, another config) gets its error recorded in every
    pending entry, and the pass goes on with the other runs; the caller exits non-zero at the end.
    """
    from flatbench.measures.runner import measure_run, measure_targets

    chosen = check_study(study, names)
    counts = MeasureCounts()
    targets = []
    for rid, cfg in shard_runs(study, shard):
        if run_ids is not None and rid not in run_ids:
            continue
        path = run_dir(study.exp_dir, rid)
        if not is_finished(path):
            counts.not_trained += 1
            continue
        targets.extend(measure_targets(path, snapshots=study.measure.snapshots))
    plan = {target: names_for(target, chosen, study, names) for target in targets}

    def count(target: Any, report: Any, seconds: float) -> None:
        counts.measured += 1
        counts.errors += report.errors
        if report.damaged:
            counts.damaged_files.append(report.damaged)
        if report.failure:
            counts.failed_runs[target.label] = report.failure
        if quiet:
            echo(f"{target.label}: {report.entries} measure entries ({seconds:.1f}s)"
                 + (f"; FAILED: {report.failure}" if report.failure else ""))

    if study.measure.workers > 1 and len(targets) > 1:
        from flatbench.study.workers import run_jobs

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
        return counts
    bar = _MeasureBar(plan, study.measure, force) if show_progress(quiet) else None
    use_groups = study.measure.group_runs == "on" or (study.measure.group_runs == "auto" and device.type == "cuda")
    step = GROUP_SIZE if use_groups else 1
    try:
        for start in range(0, len(targets), step):
            batch = targets[start:start + step]
            contexts = grouped_contexts(batch, chosen, study.measure, device, force) if use_groups else {}
            for target in batch:
                t0 = time.perf_counter()
                report = measure_run(target, plan[target], study.measure, device, force=force,
                                     echo=None if quiet else (bar.write if bar else echo),
                                     ctx=contexts.pop(target, None), on_entry=bar.advance if bar else None)
                count(target, report, time.perf_counter() - t0)
    finally:
        if bar is not None:
            bar.close()
    return counts


def _worker_measure(target: Any, names: list[str], cfg: Any, device: str, force: bool, quiet: bool
                    ) -> tuple[Any, float, list[str]]:
    """A worker process's job: measure one model; returns its report, seconds and output lines (for the
    parent to echo)."""
    from flatbench.measures.runner import measure_run

    lines: list[str] = []
    t0 = time.perf_counter()
    report = measure_run(target, names, cfg, torch.device(device), force=force, echo=None if quiet else lines.append)
    return report, time.perf_counter() - t0, lines


class _MeasureBar:
    """One progress bar over every (model, measure entry) still to compute; lines go above it."""

    def __init__(self, plan: dict, cfg: Any, force: bool):
        from tqdm.auto import tqdm

        from flatbench.measures.runner import pending_entries

        total = 0
        for target, names in plan.items():
            try:
                total += len(pending_entries(target, names, cfg, force)[1])
            except FlatbenchError:
                continue
        self.bar = tqdm(total=total, unit="measure", dynamic_ncols=True, leave=False, desc="measuring")

    def write(self, line: str) -> None:
        self.bar.write(line)

    def advance(self, label: str, key: str) -> None:
        self.bar.set_description_str(f"{label} {key}"[-60:])
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
