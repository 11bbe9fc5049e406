"""The `flatbench` command line: run | train | measure | report | audit | status | list-measures.

The commands only parse options and call the stages (`flatbench.study`: train, measure, report, audit,
status, cluster); they import those (and torch) only when they run, so `flatbench --help` is instant.

Errors the user can fix (`FlatbenchError`, and file-system errors such as an unwritable `--out`) are
printed as one line on stderr with exit code 2; nothing that already finished is touched. A preempted
training (SIGTERM/SIGUSR1/SIGUSR2) exits with 143 after its last checkpoint, ready to be resumed by the
same command; Ctrl-C exits with 130 the same way.

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
from typing import Any, Callable

import click

from flatbench.errors import FlatbenchError

DEVICE = click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
                      help="Where to train and measure.")
OUT = click.option("--out", default=None, help="Results root (default: the config's `out`, else ./results).")
QUIET = click.option("--quiet", is_flag=True, help="No progress bars: one line per run (for cluster logs).")
SHARD = click.option("--shard", default=None, metavar="I/N", help="Only the I-th of N disjoint slices of the sweep.")
MEASURES = click.option("--measures", "measures", default=None,
                        help="Comma-separated measures (default: the config's).")
OVERRIDES = click.argument("overrides", nargs=-1)
WORKERS = click.option("--workers", type=click.IntRange(min=1), default=None,
                       help="Train and measure up to N runs at once in worker processes on the device "
                            "(train.workers, measure.workers).")
CLUSTER_OPTIONS = [
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
CLUSTER_KEYS = ("partition", "gpus_per_task", "cpus_per_task", "mem_gb", "time_min", "array_parallelism",
                "runs_per_task")


def study_options(*extra: Callable, shard: bool = True, cluster: bool = True) -> Callable:
    """The one option stack of the study commands (`run`, `train`, `measure`): the target and its
    overrides, --out, --device, --quiet, [--shard], [the cluster options], plus `extra`."""
    def decorate(f: Callable) -> Callable:
        options = [OVERRIDES, OUT, DEVICE, QUIET, WORKERS, *([SHARD] if shard else []), *extra,
                   *(CLUSTER_OPTIONS if cluster else [])]
        for option in reversed(options):
            f = option(f)
        return f
    return decorate


def _echo(msg: str) -> None:
    click.echo(msg)


def _with_workers(overrides: tuple[str, ...], workers: int | None) -> tuple[str, ...]:
    """--workers N as the overrides it stands for."""
    return overrides if workers is None else (*overrides, f"train.workers={workers}", f"measure.workers={workers}")


def _names(measures: str | None) -> list[str] | None:
    return [m.strip() for m in measures.split(",") if m.strip()] if measures else None


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.version_option(package_name="flatbench")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Random-label studies of flatness measures: train, measure, report.

    Start with `flatbench run configs/quickstart.yaml`.
    """
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


def _submit(study: Any, stage: str, kw: dict, device: str, shard: str | None = None, **extra: Any) -> None:
    """The --executor branch shared by run, train and measure."""
    from flatbench.study.cluster import ClusterOptions, submit_and_report
    from flatbench.study.spec import parse_shard

    opts = ClusterOptions(**{k: kw[k] for k in CLUSTER_KEYS})
    submit_and_report(study, kw["executor"], opts, stage=stage, device=device, shard=parse_shard(shard),
                      wait=kw["wait"], echo=_echo, **extra)


@cli.command()
@click.argument("config")
@study_options(MEASURES, shard=False)
def run(config: str, overrides: tuple[str, ...], out: str | None, device: str, quiet: bool,
        workers: int | None, measures: str | None, **kw: Any) -> None:
    """Train, measure and report a study: CONFIG [KEY=VALUE ...].

    With --executor each array task trains its runs and then measures them; the command returns at once
    and prints the `flatbench report` command for when `flatbench status` shows every run finished and
    measured (with --wait it waits and writes the report itself).
    """
    from flatbench.study.measure import measure_study
    from flatbench.study.report import report_study
    from flatbench.study.spec import check_study, study_from_target
    from flatbench.study.train import train_study
    from flatbench.train import resolve_device

    study = study_from_target(config, _with_workers(overrides, workers), out=out)
    check_study(study, _names(measures))
    if kw["executor"]:
        _submit(study, "run", kw, device, measures=_names(measures))
        if kw["wait"]:
            report_study([study.exp_dir], echo=_echo)
        return
    dev = resolve_device(device)
    outcome = train_study(study, dev, quiet=quiet, echo=_echo)
    counts = measure_study(study, dev, names=_names(measures), quiet=quiet, echo=_echo)
    report_study([study.exp_dir], echo=_echo, quiet=quiet)
    _exit_on_failures(outcome, counts)


@cli.command()
@click.argument("config")
@study_options()
def train(config: str, overrides: tuple[str, ...], out: str | None, device: str, quiet: bool,
          workers: int | None, shard: str | None, **kw: Any) -> None:
    """Train every unfinished run of a study: CONFIG [KEY=VALUE ...].

    Runs that differ only in seed and random labels train several at once on a GPU (train.vectorize).
    With --executor the runs are submitted as a job array instead (see `flatbench status`).
    """
    from flatbench.study.spec import check_study, parse_shard, study_from_target
    from flatbench.study.train import train_study
    from flatbench.train import resolve_device

    study = study_from_target(config, _with_workers(overrides, workers), out=out)
    check_study(study)
    if kw["executor"]:
        _submit(study, "train", kw, device, shard)
        return
    outcome = train_study(study, resolve_device(device), shard=parse_shard(shard), quiet=quiet, echo=_echo)
    _echo(f"{len(outcome['trained'])} trained, {len(outcome['skipped'])} already finished, "
          f"{len(outcome['failed'])} failed, {len(outcome['locked'])} locked elsewhere -> {study.exp_dir}")
    _exit_on_failures(outcome)


@cli.command()
@click.argument("target")
@study_options(MEASURES, click.option("--force", is_flag=True, help="Recompute measures already in measures.json."))
def measure(target: str, overrides: tuple[str, ...], out: str | None, device: str, quiet: bool,
            workers: int | None, shard: str | None, measures: str | None, force: bool, **kw: Any) -> None:
    """Compute measures on the trained runs of TARGET (an experiment folder or a config)."""
    from flatbench.study.measure import measure_study
    from flatbench.study.spec import check_study, parse_shard, study_from_target
    from flatbench.train import resolve_device

    study = study_from_target(target, _with_workers(overrides, workers), out=out)
    check_study(study, _names(measures))
    if not study.exp_dir.is_dir():
        raise FlatbenchError(f"experiment folder {study.exp_dir} does not exist: train the study first "
                             f"(`flatbench train {target}`)")
    if kw["executor"]:
        _submit(study, "measure", kw, device, shard, measures=_names(measures), force=force)
        return
    counts = measure_study(study, resolve_device(device), names=_names(measures), force=force,
                           shard=parse_shard(shard), quiet=quiet, echo=_echo)
    _echo(f"measured {counts.measured} models ({counts.not_trained} runs not trained yet, "
          f"{counts.errors} failed measure entries) -> {study.exp_dir}")
    _exit_on_failures(None, counts)


@cli.command()
@click.argument("experiments", nargs=-1, required=True)
@click.option("--out", "out_dir", default=None, help="Where to write the report (default: the first folder).")
@click.option("--gap", type=click.Choice(["acc", "loss"]), default=None, help="Gap to correlate with.")
@click.option("--min-train-acc", type=float, default=None,
              help="Exclude runs below this final train accuracy (0 to 1; default: the study's report.min_train_acc).")
@click.option("--include-stale", is_flag=True,
              help="Also count runs left in runs/ by an earlier version of the study (listed as not in this study).")
@click.option("--quiet", is_flag=True, help="One line: where the report is and the best measure.")
def report(experiments: tuple[str, ...], out_dir: str | None, gap: str | None, min_train_acc: float | None,
           include_stale: bool, quiet: bool) -> None:
    """Tables, correlations, plots and report.md for one or more EXPERIMENT folders."""
    from flatbench.study.report import report_study

    report_study([Path(e) for e in experiments], out_dir=Path(out_dir) if out_dir else None, gap=gap,
                 min_train_acc=min_train_acc, include_stale=include_stale, echo=_echo, quiet=quiet)


@cli.command()
@click.argument("target")
@click.option("--families", default="layer,node,bn,logit_scale", show_default=True,
              help="Run audit: comma-separated transformation families.")
@click.option("--trials", type=int, default=3, show_default=True,
              help="Run audit: random transformations per family.")
@MEASURES
@click.option("--population", is_flag=True,
              help="TARGET is an experiment: transform every run once and compare the correlations with the gap.")
@click.option("--family", default="node", show_default=True,
              help="Population audit: the family applied to every run.")
@click.option("--max-factor", type=float, default=None,
              help="Factors are log-uniform in [1/F, F] (default 10; 100 with --population).")
@click.option("--out", "out_dir", default=None, help="Where to write the files (default: TARGET).")
@DEVICE
def audit(target: str, families: str, trials: int, measures: str | None, population: bool, family: str,
          max_factor: float | None, out_dir: str | None, device: str) -> None:
    """Check the measures under function-preserving transformations: TARGET is a run folder, or an
    experiment folder with --population."""
    from flatbench.study.audit import audit_population, audit_run
    from flatbench.store import RUN_JSON
    from flatbench.study.spec import check_output_dir
    from flatbench.train import resolve_device

    path = Path(target)
    if not path.is_dir():
        raise FlatbenchError(f"{path} does not exist" if not path.exists() else f"{path} is a file, not a folder")
    out = check_output_dir(out_dir, "audit output folder") if out_dir else None
    dev = resolve_device(device)
    if population:
        audit_population(path, family=family, measures=_names(measures), device=dev,
                         max_factor=max_factor or 100.0, out_dir=out, echo=click.echo)
        return
    if not (path / RUN_JSON).is_file():
        hint = " (add --population to audit a whole experiment)" if (path / "runs").is_dir() else ""
        raise FlatbenchError(f"{path} is not a run folder (no {RUN_JSON}){hint}")
    audit_run(path, families=families, trials=trials, measures=_names(measures), device=dev,
              max_factor=max_factor or 10.0, out_dir=out, echo=click.echo)


@cli.command()
@click.argument("experiment")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (counts and every run's state).")
def status(experiment: str, as_json: bool) -> None:
    """How many runs of EXPERIMENT are finished, running, preempted, failed or not started."""
    import json

    from flatbench.study.status import format_status, study_status

    st = study_status(experiment)
    click.echo(json.dumps(st, indent=2) if as_json else format_status(st))


@cli.command("list-measures")
def list_measures() -> None:
    """Every registered measure: name, invariances, cost, description."""
    from flatbench.measures import all_measures

    specs = all_measures()
    rows = [(name, ",".join(sorted(spec.invariant_to)) or "-", spec.cost,
             spec.description + (f" [variants: {', '.join(spec.variants)}]" if spec.variants else ""))
            for name, spec in specs.items()]
    header = ("name", "invariant to", "cost", "description")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(3)]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])


def _exit_on_failures(outcome: dict[str, list[str]] | None, counts: Any = None) -> None:
    """Exit non-zero (one line) when runs failed to train or could not be measured; everything else done
    is kept."""
    problems = []
    if outcome and outcome["failed"]:
        problems.append(f"{len(outcome['failed'])} run(s) failed to train: {', '.join(outcome['failed'])} "
                        "(see their run.json)")
    if counts is not None and counts.failed_runs:
        first = next(iter(counts.failed_runs.items()))
        problems.append(f"{len(counts.failed_runs)} model(s) could not be measured ({first[0]}: {first[1]})")
    if problems:
        raise FlatbenchError("; ".join(problems))


def main(argv: list[str] | None = None) -> None:
    """Entry point: click, with user errors turned into one line and exit code 2."""
    import warnings

    # torch's own vmap decompositions call the deprecated torch.jit.script: noise for our users
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*is deprecated", category=FutureWarning)
    try:
        cli.main(args=argv, prog_name="flatbench", standalone_mode=False)
    except FlatbenchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted: finished runs and the last checkpoints are kept; the same command resumes",
                   err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except OSError as exc:
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        click.echo(f"error: {exc.strerror or exc}{where}", err=True)
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - the last guard: not a user error, but still no traceback wall
        if type(exc).__name__ == "Preempted":
            click.echo(f"preempted ({exc}): the last epoch checkpoint is saved; re-run the same command to "
                       "resume", err=True)
            sys.exit(143)
        raise
    sys.exit(0)
