"""Running a study on a cluster: a Slurm job array through submitit, and where a study stands.

`flatbench train CONFIG --executor slurm` submits the unfinished runs of the sweep as one Slurm job array
and returns at once; each array task trains `--runs-per-task` runs through the same
`study.train_study` (so vectorized groups, locks, checkpoints and files are exactly those of a local
run). `flatbench run CONFIG --executor ...` submits tasks that train their runs and then measure them
(`measure_study` on the same run ids); the report is written afterwards, once every run is done
(`flatbench report EXPERIMENT`, or by `run --wait` itself). `--executor local` runs the same tasks through submitit's LocalExecutor, as processes on this
machine (what the tests use). The logs of the tasks go to `<experiment>/<executor>/` (submitit's
`<job id>_<task>_log.out` / `.err`), and `flatbench status EXPERIMENT` counts runs by state.

Preemption and time limits: submitit asks Slurm to send SIGUSR2 shortly before the time limit
(`--signal USR2@<delay>`) and on preemption. The training loop treats it like SIGTERM: it stops at the
next batch with the last epoch checkpoint on disk and marks the run `preempted`; the task then hands
over to submitit, which calls `StudyTask.checkpoint()` (a `submitit.helpers.Checkpointable`) and
requeues the task. The requeued task trains the same runs, each resuming from its checkpoint. Two
tasks never train one run at once (a lock file per run, stale locks taken over), so a task that is
started twice, or a hand-written `--shard` job next to an array, does no harm.

No job scheduler is built here: submitit talks to Slurm (sbatch, squeue, scontrol). Jobs run
`sys.executable` (this environment's Python) in the directory `flatbench` was called from, with the
caller's environment (FLATBENCH_DATA and the like).
"""

from __future__ import annotations

import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flatbench.config import parse_study
from flatbench.errors import ConfigError, Echo, FlatbenchError
from flatbench.store import is_finished, missing_model, run_dir
from flatbench.study.measure import measure_study
from flatbench.study.spec import save_study, shard_runs
from flatbench.study.train import train_study
from flatbench.training import Preempted, group_key, resolve_device, vectorizable

EXECUTORS = ("local", "slurm")
STAGES = ("train", "measure", "run")



# ---------------------------------------------------------------- the submitted callable


def _submitit():
    try:
        import submitit  # optional dependency: submitit, only for --executor (its absence is one line)
    except ImportError:  # a dependency; checked for a clear message anyway
        raise FlatbenchError("--executor needs the submitit package: pip install submitit") from None
    return submitit


def _checkpointable_base() -> type:
    try:
        from submitit.helpers import Checkpointable  # optional dependency: submitit (else a plain base)
    except ImportError:
        return object
    return Checkpointable


class EntriesFailed(Exception):
    """An array task whose stage ran but left something asked for undone without bad input: measure entries
    that failed (error, non_finite) or runs not trained yet. The task fails (the scheduler shows it), and
    `--wait` exits 1, not 2 (damage and bad input are `FlatbenchError`: exit 2). Its message is one line."""


def check_measured(counts: Any, locked: list[str] | tuple = ()) -> None:
    """Raise what a task's measure pass must tell its scheduler: damage (a model that could not be measured)
    as a FlatbenchError, failed entries and runs not trained (other than those another task holds,
    `locked`) as `EntriesFailed`; nothing when everything asked for was computed."""
    if counts.failed_runs:
        rid, why = next(iter(counts.failed_runs.items()))
        raise FlatbenchError(f"{len(counts.failed_runs)} model(s) could not be measured ({rid}: {why})")
    untrained = [rid for rid in counts.not_trained_ids if rid not in locked]
    parts = [f"{label} {key}: {reason}" for label, key, reason in counts.failed_entries[:5]]
    if counts.failed_entries:
        parts[0] = f"{len(counts.failed_entries)} measure entries failed: {parts[0]}"
    if untrained:
        parts.append(f"{len(untrained)} run(s) not trained yet: {', '.join(untrained[:10])}")
    if parts:
        raise EntriesFailed(" | ".join(" ".join(str(p).split()) for p in parts))


@dataclass
class TaskResult:
    """What one array task did: the train stage's outcome (stages train and run) and the measure stage's
    counts (stages measure and run); what `job.result()` returns."""

    trained: Any = None
    measured: Any = None


class StudyTask(_checkpointable_base()):  # type: ignore[misc]
    """One array task: train, measure, or train then measure (`run`) the given runs of a study.

    Picklable (a module-level class holding plain data): the study's resolved raw config, its name and
    absolute results root, the run ids, the device and, for measuring, the measures to compute.
    Calling it runs `train_study` / `measure_study` (both, in that order, for `run`) on those runs and
    returns the outcome; it raises if a run failed, so the scheduler shows the task as failed. A `run`
    task measures the runs it trained even when another of its runs failed, then raises.
    """

    def __init__(self, stage: str, raw: dict, name: str, out: str, run_ids: list[str], device: str = "auto",
                 measures: list[str] | None = None, force: bool = False):
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}")
        self.stage = stage
        self.raw = raw
        self.name = name
        self.out = out
        self.run_ids = list(run_ids)
        self.device = device
        self.measures = measures
        self.force = force

    def __repr__(self) -> str:
        return f"StudyTask({self.stage} {self.name}: {', '.join(self.run_ids)})"

    def __call__(self) -> TaskResult:
        def echo(msg: str) -> None:
            print(msg, flush=True)

        study = parse_study(self.raw, default_name=self.name, out=self.out)
        device = resolve_device(self.device)
        echo(f"{self.stage} {len(self.run_ids)} run(s) of {study.exp_dir} on {device}: {', '.join(self.run_ids)}")
        requeue_signal, requeue_handler = _submitit_requeue_handler()
        try:
            if self.stage == "measure":
                counts = measure_study(study, device, names=self.measures, force=self.force, quiet=True,
                                       echo=echo, run_ids=self.run_ids)
                echo(f"measured {counts.measured} runs ({counts.not_trained} not trained yet)")
                check_measured(counts)
                return TaskResult(measured=counts)
            outcome = train_study(study, device, quiet=True, echo=echo, run_ids=self.run_ids)
        except Preempted as exc:
            if requeue_handler is not None and exc.signum == requeue_signal:
                echo(f"preempted ({exc}): checkpoints saved; asking submitit to requeue this task")
                requeue_handler(exc.signum, None)  # calls self.checkpoint(), requeues, exits
            raise
        echo(f"{len(outcome.trained)} trained, {len(outcome.skipped)} already finished, "
             f"{len(outcome.failed)} failed, {len(outcome.locked)} locked elsewhere")
        result = TaskResult(trained=outcome)
        if self.stage == "run":
            result.measured = measure_study(study, device, names=self.measures, force=self.force, quiet=True,
                                            echo=echo, run_ids=self.run_ids)
            echo(f"measured {result.measured.measured} runs ({result.measured.not_trained} not trained yet)")
        if outcome.failed:
            raise FlatbenchError(f"{len(outcome.failed)} run(s) failed: {', '.join(outcome.failed)} "
                                 "(see their run.json)")
        if result.measured is not None:
            check_measured(result.measured, outcome.locked)
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit on preemption or timeout: requeue this same task. Nothing else needs saving:
        every run keeps its own epoch checkpoint on disk, and the requeued task resumes from them."""
        submitit = _submitit()
        return submitit.helpers.DelayedSubmission(
            StudyTask(self.stage, self.raw, self.name, self.out, self.run_ids, self.device, self.measures,
                      self.force))


def _submitit_requeue_handler() -> tuple[int | None, Any]:
    """(signal, handler) of submitit's checkpoint-and-requeue, when running inside a submitit job."""
    if not os.environ.get("SUBMITIT_FOLDER"):
        return None, None
    try:
        from submitit import JobEnvironment  # optional dependency: submitit, only inside a submitit job

        sig = JobEnvironment._usr_sig()
    except Exception:  # noqa: BLE001 - not inside a job after all
        return None, None
    handler = signal.getsignal(sig)
    return (int(sig), handler) if callable(handler) else (None, None)


# ---------------------------------------------------------------- submitting


@dataclass
class ClusterOptions:
    """Resources of each array task (the CLI's --partition, --gpus-per-task, ...)."""

    partition: str | None = None
    """Slurm partition (default: the cluster's default partition)."""
    gpus_per_task: int = 0
    """GPUs per array task (0: CPU only)."""
    cpus_per_task: int | None = None
    """CPU cores per array task (default: the scheduler's)."""
    mem_gb: float | None = None
    """Memory per array task in GB (default: the scheduler's)."""
    time_min: int = 120
    """Time limit of each array task, in minutes."""
    array_parallelism: int | None = None
    """At most this many array tasks run at once (default: submitit's, 256)."""
    runs_per_task: int = 1
    """Runs per array task; with vectorized training use the group size (e.g. 16) so a group is one task."""
    signal_delay_s: int = 120
    """Seconds before the time limit at which the task is told to checkpoint (SIGUSR2) and requeued."""
    extra: dict = field(default_factory=dict)
    """Further submitit parameters (e.g. {"slurm_account": "abc"})."""

    def check(self) -> None:
        if self.runs_per_task < 1:
            raise ConfigError(f"--runs-per-task must be at least 1, got {self.runs_per_task}")
        if self.gpus_per_task < 0:
            raise ConfigError(f"--gpus-per-task must be 0 or more, got {self.gpus_per_task}")
        if self.time_min < 1:
            raise ConfigError(f"--time must be at least 1 minute, got {self.time_min}")
        if self.array_parallelism is not None and self.array_parallelism < 1:
            raise ConfigError(f"--array-parallelism must be at least 1, got {self.array_parallelism}")


@dataclass
class Submission:
    """What `submit_study` submitted: submitit jobs (one per array task) and where their logs go."""

    executor: str
    jobs: list
    tasks: list[list[str]]
    log_dir: Path
    untrained: list[str] = field(default_factory=list)
    """Stage measure: runs of the study (or shard) not trained yet, so not submitted."""
    damaged: dict[str, str] = field(default_factory=dict)
    """Stage measure: finished runs that cannot be measured (model.pt missing), not submitted: exit 2."""
    incomplete: list[str] = field(default_factory=list)
    """After `--wait`: what the tasks left undone without bad input (failed entries, runs not trained), one
    line each (the CLI exits 1)."""

    @property
    def job_id(self) -> str:
        """The array's job id on Slurm (`123` of `123_0`), the first task's process id locally."""
        if not self.jobs:
            return "-"
        return str(self.jobs[0].job_id).split("_")[0]

    def wait(self) -> list[Any]:
        """Block until every task ends; their results (a task that raised raises here)."""
        return [job.result() for job in self.jobs]


def chunk_runs(runs: list[tuple[str, Any]], runs_per_task: int) -> list[list[str]]:
    """Run ids split into tasks of at most `runs_per_task`, runs of one vectorization group kept together."""

    order: dict[Any, list[str]] = {}
    for rid, cfg in runs:
        key = group_key(cfg) if vectorizable(cfg) else rid
        order.setdefault(key, []).append(rid)
    flat = [rid for ids in order.values() for rid in ids]
    return [flat[i:i + runs_per_task] for i in range(0, len(flat), runs_per_task)]


def make_executor(kind: str, folder: Path, name: str, opts: ClusterOptions) -> Any:
    """A submitit executor: `slurm` (AutoExecutor for Slurm) or `local` (submitit's LocalExecutor)."""
    submitit = _submitit()
    if kind not in EXECUTORS:
        raise ConfigError(f"unknown executor '{kind}' (choose one of: {', '.join(EXECUTORS)})")
    if kind == "local":
        executor = submitit.LocalExecutor(folder=str(folder))
        params: dict[str, Any] = {"timeout_min": int(opts.time_min), "nodes": 1, "tasks_per_node": 1,
                                  "gpus_per_node": int(opts.gpus_per_task),
                                  "signal_delay_s": int(opts.signal_delay_s)}
    else:
        if shutil.which("sbatch") is None:
            raise FlatbenchError("--executor slurm needs Slurm's sbatch on PATH (none found); on a machine "
                                 "without Slurm use --executor local or --shard I/N")
        executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
        params = {"timeout_min": int(opts.time_min), "name": name, "nodes": 1, "tasks_per_node": 1,
                  "slurm_signal_delay_s": int(opts.signal_delay_s)}
        if opts.cpus_per_task:
            params["cpus_per_task"] = int(opts.cpus_per_task)
        if opts.gpus_per_task:
            params["gpus_per_node"] = int(opts.gpus_per_task)
        if opts.mem_gb:
            params["mem_gb"] = float(opts.mem_gb)
        if opts.partition:
            params["slurm_partition"] = opts.partition
        if opts.array_parallelism:
            params["slurm_array_parallelism"] = int(opts.array_parallelism)
    params.update(opts.extra)
    try:
        executor.update_parameters(**params)
    except (NameError, ValueError, TypeError) as exc:
        raise ConfigError(f"invalid {kind} executor parameters: {str(exc).splitlines()[0]}") from None
    return executor


def submit_study(study: Any, executor: str, opts: ClusterOptions | None = None, *, stage: str = "train",
                 device: str = "auto", shard: tuple[int, int] | None = None, measures: list[str] | None = None,
                 force: bool = False) -> Submission:
    """Submit the study's unfinished runs (train), finished runs (measure) or all runs (run: train the
    unfinished ones, then measure) as one job array; returns at once.

    The tasks run `StudyTask`; their logs go to `<experiment>/<executor>/`.
    """
    opts = opts or ClusterOptions()
    opts.check()
    save_study(study)
    runs = shard_runs(study, shard)
    if stage == "train":
        todo = [(rid, cfg) for rid, cfg in runs if not is_finished(run_dir(study.exp_dir, rid))]
    elif stage == "measure":
        todo = [(rid, cfg) for rid, cfg in runs if is_finished(run_dir(study.exp_dir, rid))]
    elif stage == "run":  # finished runs too: their missing measures are computed, cached ones skipped
        todo = list(runs)
    else:
        raise ValueError(f"unknown stage {stage!r}")
    tasks = chunk_runs(todo, opts.runs_per_task)
    log_dir = (study.exp_dir / executor).resolve()
    unfinished = [rid for rid, _ in runs if stage == "measure" and not is_finished(run_dir(study.exp_dir, rid))]
    damaged = {rid: missing_model(run_dir(study.exp_dir, rid)) for rid in unfinished}
    damaged = {rid: why for rid, why in damaged.items() if why}  # finished without model.pt: damage, not untrained
    untrained = [rid for rid in unfinished if rid not in damaged]
    if not tasks:
        return Submission(executor, [], [], log_dir, untrained=untrained, damaged=damaged)
    log_dir.mkdir(parents=True, exist_ok=True)
    ex = make_executor(executor, log_dir, f"flatbench-{stage}-{study.name}", opts)
    out = str(Path(study.out).resolve())
    raw = dict(study.raw)
    raw.pop("out", None)
    jobs = []
    with ex.batch():  # one job array on Slurm
        for ids in tasks:
            jobs.append(ex.submit(StudyTask(stage, raw, study.name, out, ids, device, measures, force)))
    return Submission(executor, jobs, tasks, log_dir, untrained=untrained, damaged=damaged)


def submit_and_report(study: Any, executor: str, opts: ClusterOptions, *, stage: str, device: str,
                      shard: tuple[int, int] | None, wait: bool, echo: Echo, measures: list[str] | None = None,
                      force: bool = False) -> Submission:
    """The CLI's --executor path: submit, print the job id and log folder, optionally wait.

    For the `run` stage it also prints the `flatbench report` command to run once every task is done
    (with `wait`, the caller writes the report itself).
    """
    sub = submit_study(study, executor, opts, stage=stage, device=device, shard=shard, measures=measures,
                       force=force)
    if sub.untrained:
        echo(f"not submitted: {len(sub.untrained)} run(s) not trained yet: {', '.join(sub.untrained[:10])}"
             + (", ..." if len(sub.untrained) > 10 else ""))
    if not sub.jobs:
        _raise_damaged(sub)
        echo(f"nothing to submit: no run to {stage} in {study.exp_dir}")
        if sub.untrained:  # measuring was asked for and nothing can be: never a silent exit 0
            sub.incomplete.append(f"{len(sub.untrained)} run(s) not trained yet: {', '.join(sub.untrained[:10])}")
        return sub
    n_runs = sum(len(t) for t in sub.tasks)
    if executor == "slurm":
        kind = "one Slurm job array" if len(sub.tasks) > 1 else "one Slurm job"
    else:
        kind = "local submitit jobs"
    what = "train and measure" if stage == "run" else stage
    echo(f"submitted {n_runs} run(s) to {what} as {len(sub.tasks)} task(s) ({kind}): job {sub.job_id}")
    echo(f"logs: {sub.log_dir}/")
    echo(f"follow with: flatbench status {study.exp_dir}")
    if stage == "run" and not wait:
        echo(f"when it shows all {n_runs} run(s) finished and measured, write the report with: "
             f"flatbench report {study.exp_dir}")
    if wait:
        _wait_for(sub, echo)
    _raise_damaged(sub)
    return sub


def _raise_damaged(sub: Submission) -> None:
    """Damage found while submitting (a finished run without its model.pt): exit 2, named in one line, after
    the other runs were submitted."""
    if sub.damaged:
        rid, why = next(iter(sub.damaged.items()))
        raise FlatbenchError(f"{len(sub.damaged)} model(s) could not be measured ({rid}: {why})")


def task_error(exc: BaseException) -> tuple[int, str]:
    """(exit code, one line) of a task that raised, from submitit's error (which carries the task's
    traceback as text): 1 for `EntriesFailed` (entries or runs left undone), 2 for anything else."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        if "EntriesFailed: " in line:
            return 1, line.split("EntriesFailed: ", 1)[1]
    errors = [line for line in lines if ": " in line and line.split(":", 1)[0].split(".")[-1].endswith(
        ("Error", "Exception", "Exit", "Interrupt", "Preempted"))]
    return 2, (errors[-1] if errors else (lines[-1] if lines else type(exc).__name__))


def _wait_for(sub: Submission, echo: Echo) -> None:
    """Block until every task has ended: damage or a crash in any task raises (exit 2); tasks that left
    entries or runs undone go to `sub.incomplete` (exit 1), with the runs not submitted because untrained."""
    failures = []
    for job, ids in zip(sub.jobs, sub.tasks):
        try:
            job.result()
        except Exception as exc:  # noqa: BLE001 - report every task
            code, line = task_error(exc)
            text = f"task {job.job_id} ({', '.join(ids)}): {line}"
            (sub.incomplete if code == 1 else failures).append(text)
    if failures:
        raise FlatbenchError(f"{len(failures)} task(s) failed: " + "; ".join(failures))
    if sub.untrained:
        sub.incomplete.append(f"{len(sub.untrained)} run(s) not trained yet: {', '.join(sub.untrained[:10])}")
    done = len(sub.tasks) - sum(1 for line in sub.incomplete if line.startswith("task "))
    echo(f"all {len(sub.tasks)} task(s) ended ({done} with everything asked for done)"
         if sub.incomplete else f"all {len(sub.tasks)} task(s) finished")
