"""The `flatbench` command line: run | train | measure | report | audit | status | list-measures.

Errors the user can fix (`FlatbenchError`) are printed as one line on stderr with exit code 2; nothing
that already finished is touched. A preempted training (SIGTERM/SIGUSR1/SIGUSR2) exits with 143 after its
last checkpoint, ready to be resumed by the same command.

On a cluster: `--shard I/N` runs one of N disjoint slices of the sweep (for a hand-written
`sbatch --array`, see scripts/slurm_array.sh); `--executor slurm` submits the sweep as one Slurm job array
through submitit and returns at once (`--executor local`: the same through local processes);
`flatbench status EXPERIMENT` shows how far it is. `flatbench run CONFIG --executor ...` submits tasks that
train and then measure their runs; it prints the `flatbench report` command to run once they are done
(`--wait`: it waits and writes the report itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from flatbench.errors import FlatbenchError

DEVICE = click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
                      help="Where to train and measure.")
OUT = click.option("--out", default=None, help="Results root (default: the config's `out`, else ./results).")
QUIET = click.option("--quiet", is_flag=True, help="No progress bars: one line per run (for cluster logs).")
SHARD = click.option("--shard", default=None, metavar="I/N", help="Only the I-th of N disjoint slices of the sweep.")
OVERRIDES = click.argument("overrides", nargs=-1)


def CLUSTER(f):  # noqa: N802 - a decorator like the ones above
    """The --executor options shared by `run`, `train` and `measure`."""
    options = [
        click.option("--executor", type=click.Choice(["local", "slurm"]), default=None,
                     help="Submit the runs as a job array through submitit and return at once: slurm, or local "
                          "(processes on this machine). Logs go to EXPERIMENT/<executor>/."),
        click.option("--partition", default=None, help="Slurm partition (default: the cluster's default)."),
        click.option("--gpus-per-task", type=int, default=0, show_default=True, help="GPUs per array task."),
        click.option("--cpus-per-task", type=int, default=None, help="CPU cores per array task."),
        click.option("--mem-gb", type=float, default=None, help="Memory per array task, in GB."),
        click.option("--time", "time_min", type=int, default=120, show_default=True,
                     help="Time limit per array task, in minutes (a task near its limit checkpoints and is requeued)."),
        click.option("--array-parallelism", type=int, default=None,
                     help="At most this many array tasks at once (default: submitit's 256)."),
        click.option("--runs-per-task", type=int, default=1, show_default=True,
                     help="Runs per array task (with train.vectorize, the group size keeps each group in one task)."),
        click.option("--wait", is_flag=True, help="With --executor: wait until every task has ended."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _cluster_options(partition, gpus_per_task, cpus_per_task, mem_gb, time_min, array_parallelism, runs_per_task):
    from flatbench.cluster import ClusterOptions

    return ClusterOptions(partition=partition, gpus_per_task=gpus_per_task, cpus_per_task=cpus_per_task,
                          mem_gb=mem_gb, time_min=time_min, array_parallelism=array_parallelism,
                          runs_per_task=runs_per_task)


def _echo(msg: str) -> None:
    click.echo(msg)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flatbench")
def cli() -> None:
    """Random-label studies of flatness measures: train, measure, report."""


@cli.command()
@click.argument("config")
@OVERRIDES
@OUT
@DEVICE
@QUIET
@click.option("--measures", "measures", default=None, help="Comma-separated measures (default: the config's).")
@CLUSTER
def run(config: str, overrides: tuple[str, ...], out: str | None, device: str, quiet: bool,
        measures: str | None, executor: str | None, partition: str | None, gpus_per_task: int,
        cpus_per_task: int | None, mem_gb: float | None, time_min: int, array_parallelism: int | None,
        runs_per_task: int, wait: bool) -> None:
    """Train, measure and report a study: CONFIG [KEY=VALUE ...].

    With --executor each array task trains its runs and then measures them; the command returns at once
    and prints the `flatbench report` command for when `flatbench status` shows every run finished and
    measured (with --wait it waits and writes the report itself).
    """
    from flatbench.report_cli import report_experiment
    from flatbench.study import measure_study, study_from_target, train_study
    from flatbench.train import resolve_device

    study = study_from_target(config, overrides, out=out)
    _check_measures(measures)
    _check_study_measures(study)
    if executor:
        from flatbench.cluster import submit_and_report

        opts = _cluster_options(partition, gpus_per_task, cpus_per_task, mem_gb, time_min, array_parallelism,
                                runs_per_task)
        submit_and_report(study, executor, opts, stage="run", device=device, shard=None, wait=wait, echo=_echo,
                          measures=measures.split(",") if measures else None)
        if wait:
            report_experiment([study.exp_dir], study.exp_dir, study.report, echo=_echo)
        return
    dev = resolve_device(device)
    outcome = train_study(study, dev, quiet=quiet, echo=_echo)
    measure_study(study, dev, names=measures.split(",") if measures else None, quiet=quiet, echo=_echo)
    report_experiment([study.exp_dir], study.exp_dir, study.report, echo=_echo)
    _exit_on_failures(outcome)


@cli.command()
@click.argument("config")
@OVERRIDES
@OUT
@DEVICE
@QUIET
@SHARD
@CLUSTER
def train(config: str, overrides: tuple[str, ...], out: str | None, device: str, quiet: bool,
          shard: str | None, executor: str | None, partition: str | None, gpus_per_task: int,
          cpus_per_task: int | None, mem_gb: float | None, time_min: int, array_parallelism: int | None,
          runs_per_task: int, wait: bool) -> None:
    """Train every unfinished run of a study: CONFIG [KEY=VALUE ...].

    Runs that differ only in seed and random labels train several at once on a GPU (train.vectorize).
    With --executor the runs are submitted as a job array instead (see `flatbench status`).
    """
    from flatbench.study import parse_shard, study_from_target, train_study
    from flatbench.train import resolve_device

    study = study_from_target(config, overrides, out=out)
    if executor:
        from flatbench.cluster import submit_and_report

        opts = _cluster_options(partition, gpus_per_task, cpus_per_task, mem_gb, time_min, array_parallelism,
                                runs_per_task)
        submit_and_report(study, executor, opts, stage="train", device=device, shard=parse_shard(shard),
                          wait=wait, echo=_echo)
        return
    outcome = train_study(study, resolve_device(device), shard=parse_shard(shard), quiet=quiet, echo=_echo)
    _echo(f"{len(outcome['trained'])} trained, {len(outcome['skipped'])} already finished, "
          f"{len(outcome['failed'])} failed, {len(outcome['locked'])} locked elsewhere -> {study.exp_dir}")
    _exit_on_failures(outcome)


@cli.command()
@click.argument("target")
@OVERRIDES
@OUT
@DEVICE
@QUIET
@SHARD
@click.option("--measures", "measures", default=None, help="Comma-separated measures (default: the config's).")
@click.option("--force", is_flag=True, help="Recompute measures already in measures.json.")
@CLUSTER
def measure(target: str, overrides: tuple[str, ...], out: str | None, device: str, quiet: bool,
            shard: str | None, measures: str | None, force: bool, executor: str | None, partition: str | None,
            gpus_per_task: int, cpus_per_task: int | None, mem_gb: float | None, time_min: int,
            array_parallelism: int | None, runs_per_task: int, wait: bool) -> None:
    """Compute measures on the trained runs of TARGET (an experiment folder or a config)."""
    from flatbench.study import measure_study, parse_shard, study_from_target
    from flatbench.train import resolve_device

    study = study_from_target(target, overrides, out=out)
    _check_measures(measures)
    if executor:
        from flatbench.cluster import submit_and_report

        opts = _cluster_options(partition, gpus_per_task, cpus_per_task, mem_gb, time_min, array_parallelism,
                                runs_per_task)
        submit_and_report(study, executor, opts, stage="measure", device=device, shard=parse_shard(shard),
                          wait=wait, echo=_echo, measures=measures.split(",") if measures else None, force=force)
        return
    counts = measure_study(study, resolve_device(device), names=measures.split(",") if measures else None,
                           force=force, shard=parse_shard(shard), quiet=quiet, echo=_echo)
    _echo(f"measured {counts['measured']} runs ({counts['not_trained']} not trained yet, "
          f"{counts['errors']} failed measure entries) -> {study.exp_dir}")


@cli.command()
@click.argument("experiments", nargs=-1, required=True)
@click.option("--out", "out_dir", default=None, help="Where to write the report (default: the first folder).")
@click.option("--gap", type=click.Choice(["acc", "loss"]), default=None, help="Gap to correlate with.")
@click.option("--min-train-acc", type=float, default=None, help="Exclude runs below this train accuracy.")
def report(experiments: tuple[str, ...], out_dir: str | None, gap: str | None,
           min_train_acc: float | None) -> None:
    """Tables, correlations, plots and report.md for one or more EXPERIMENT folders."""
    from dataclasses import replace

    from flatbench.config import ReportConfig
    from flatbench.report_cli import report_experiment, report_config_of

    dirs = [Path(e) for e in experiments]
    for d in dirs:
        if not (d / "runs").is_dir():
            raise FlatbenchError(f"{d} is not a flatbench experiment folder (no runs/ inside)")
    cfg: ReportConfig = report_config_of(dirs[0])
    if gap:
        cfg = replace(cfg, gap=gap)
    if min_train_acc is not None:
        cfg = replace(cfg, min_train_acc=min_train_acc)
    report_experiment(dirs, Path(out_dir) if out_dir else dirs[0], cfg, echo=_echo)


@cli.command()
@click.argument("experiment")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (counts and every run's state).")
def status(experiment: str, as_json: bool) -> None:
    """How many runs of EXPERIMENT are finished, running, preempted, failed or not started."""
    import json

    from flatbench.cluster import format_status, study_status

    st = study_status(experiment)
    click.echo(json.dumps(st, indent=2) if as_json else format_status(st))


@cli.command("list-measures")
def list_measures() -> None:
    """Every registered measure: name, invariances, cost, description."""
    from flatbench.measures import all_measures

    specs = all_measures()
    width = max(len(n) for n in specs)
    click.echo(f"{'name':{width}}  {'invariant to':22}  {'cost':8}  description")
    for name, spec in specs.items():
        inv = ",".join(sorted(spec.invariant_to)) or "-"
        click.echo(f"{name:{width}}  {inv:22}  {spec.cost:8}  {spec.description}")


def _register_extra_commands() -> None:
    """Commands that live next to their logic: `audit` (the invariance contract on trained runs)."""
    from flatbench.audit import audit

    cli.add_command(audit)


_register_extra_commands()


def _check_measures(measures: str | None) -> None:
    if measures:
        from flatbench.measures import resolve_names

        resolve_names(measures.split(","))


def _check_study_measures(study) -> None:
    """Unknown measures or settings in the config stop the study before any training."""
    from flatbench.measures import resolve_names
    from flatbench.measures.runner import check_settings

    check_settings(resolve_names(list(study.measure.measures)), study.measure)


def _exit_on_failures(outcome: dict[str, list[str]]) -> None:
    if outcome["failed"]:
        raise FlatbenchError(f"{len(outcome['failed'])} run(s) failed: {', '.join(outcome['failed'])} "
                             "(see their run.json)")


def main(argv: list[str] | None = None) -> None:
    """Entry point: click, with user errors turned into one line and exit code 2."""
    from flatbench.train import Preempted

    try:
        cli.main(args=argv, prog_name="flatbench", standalone_mode=False)
    except FlatbenchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except Preempted as exc:
        click.echo(f"preempted ({exc}): the last epoch checkpoint is saved; re-run the same command to resume",
                   err=True)
        sys.exit(143)
    except KeyboardInterrupt:
        click.echo("interrupted: finished runs and the last checkpoints are kept", err=True)
        sys.exit(130)
    sys.exit(0)
