"""The `flatbench` command line: run | train | measure | report | audit | status | list-measures.

The commands only parse options and call the stages (`flatbench.study`: train, measure, report, audit,
status, cluster); each command imports those (and torch) only when it runs, so `flatbench --help` is instant.

Errors the user can fix (`FlatbenchError`, and file-system errors such as an unwritable `--out`) are
printed as one line on stderr with exit code 2; nothing that already finished is touched. `measure`,
`measure-model` and `run` exit 0 only when every entry asked for is ok or not applicable, and 1 when an
entry failed (each listed on stderr in one line: model, entry, reason) or runs asked to be measured are not
trained yet (named in one line; `run` leaves out runs another live process is training); `--executor`
tasks fail the same way, and `--wait` exits with the same codes (docs/guide/bad-input.md). A preempted
training (SIGTERM/SIGUSR1/SIGUSR2) exits with 143 after its last checkpoint, Ctrl-C with 130; the same
command resumes either.

On a cluster: `--shard I/N` runs one of N disjoint slices of the sweep (scripts/slurm_array.sh);
`--executor slurm` submits the sweep as one Slurm job array through submitit and returns at once
(`--executor local`: local processes); `flatbench status EXPERIMENT` shows how far it is. `flatbench run
CONFIG --executor ...` submits tasks that train and then measure their runs (`--wait`: it waits and writes
the report itself).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click

from flatbench.errors import FlatbenchError, one_line, printable, silence_library_noise

if TYPE_CHECKING:  # the CLI imports torch (through flatbench.training) only when a command runs
    from flatbench.training import TrainOutcome

DEVICE = click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
                      help="Where to train and measure.")
OUT = click.option("--out", default=None, help="Results root (default: the config's `out`, else ./results).")
QUIET = click.option("--quiet", is_flag=True, help="No progress bars: one line per run (for cluster logs).")
SHARD = click.option("--shard", default=None, metavar="I/N", help="Only the I-th of N disjoint slices of the sweep.")
MEASURES = click.option("--measures", "measures", default=None,
                        help="Comma-separated measures (default: the config's).")
OVERRIDES = click.argument("overrides", nargs=-1)
PLUGIN = click.option("--plugin", "plugins", multiple=True, metavar="FILE_OR_MODULE",
                      help="A measure plugin to load: a Python file or an importable module (repeatable; adds to "
                           "measure.plugins).")
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
_echo: Callable[[str], None] = click.echo
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


def _with_workers(overrides: tuple[str, ...], workers: int | None) -> tuple[str, ...]:
    """--workers N as the overrides it stands for."""
    return overrides if workers is None else (*overrides, f"train.workers={workers}", f"measure.workers={workers}")


def _names(measures: str | None) -> list[str] | None:
    """--measures as names; None when not given (the config's). Given but naming nothing is refused."""
    if measures is None:
        return None
    names = [m.strip() for m in measures.split(",") if m.strip()]
    if not names:
        raise FlatbenchError(f"--measures {measures!r} names no measure: give measure names, comma-separated "
                             "(`flatbench list-measures`), or leave the option out for the configured ones")
    return names


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.version_option(package_name="flatbench")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Random-label studies of flatness measures: train, measure, report.

    Start with `flatbench run configs/quickstart.yaml`.
    """
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


def _submit(study: Any, stage: str, kw: dict, device: str, shard: str | None = None, **extra: Any) -> list[str]:
    """The --executor branch shared by run, train and measure. Returns what the tasks left undone without
    bad input (failed entries, runs not trained), one line each, for an exit 1 after the report; damage or a
    task that failed otherwise raises (exit 2)."""
    from flatbench.study.cluster import ClusterOptions, submit_and_report
    from flatbench.study.spec import parse_shard

    opts = ClusterOptions(**{k: kw[k] for k in CLUSTER_KEYS})
    sub = submit_and_report(study, kw["executor"], opts, stage=stage, device=device, shard=parse_shard(shard),
                            wait=kw["wait"], echo=_echo, **extra)
    return sub.incomplete


@cli.command()
@click.argument("config")
@study_options(MEASURES, PLUGIN, shard=False)
def run(config: str, overrides: tuple[str, ...], out: str | None, device: str, quiet: bool,
        workers: int | None, measures: str | None, plugins: tuple[str, ...], **kw: Any) -> None:
    """Train, measure and report a study: CONFIG [KEY=VALUE ...].

    With --executor each array task trains its runs and then measures them; the command returns at once
    and prints the `flatbench report` command for when `flatbench status` shows every run finished and
    measured (with --wait it waits and writes the report itself).
    """
    from flatbench.study.measure import measure_study
    from flatbench.study.report import report_study
    from flatbench.study.spec import check_study, study_from_target, with_plugins
    from flatbench.study.train import train_study
    from flatbench.training import resolve_device

    study = with_plugins(study_from_target(config, _with_workers(overrides, workers), out=out), plugins)
    chosen = check_study(study, _names(measures))
    if kw["executor"]:
        incomplete = _submit(study, "run", kw, device, measures=_names(measures))
        if kw["wait"]:
            report_study([study.exp_dir], echo=_echo)
        _exit_incomplete(incomplete)
        return
    dev = resolve_device(device)
    outcome = train_study(study, dev, quiet=quiet, echo=_echo, checked=True)
    counts = measure_study(study, dev, names=_names(measures), quiet=quiet, echo=_echo, chosen=chosen)
    report_study([study.exp_dir], echo=_echo, quiet=quiet)
    # a run another live process trains (locked) is that process's to measure: not a failure of this one
    _exit_on_failures(outcome, counts, [rid for rid in counts.not_trained_ids if rid not in outcome.locked])


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
    from flatbench.training import resolve_device

    study = study_from_target(config, _with_workers(overrides, workers), out=out)
    check_study(study)
    if kw["executor"]:
        _submit(study, "train", kw, device, shard)
        return
    outcome = train_study(study, resolve_device(device), shard=parse_shard(shard), quiet=quiet, echo=_echo)
    _echo(f"{len(outcome.trained)} trained, {len(outcome.skipped)} already finished, "
          f"{len(outcome.failed)} failed, {len(outcome.locked)} locked elsewhere -> {study.exp_dir}")
    _exit_on_failures(outcome)


@cli.command()
@click.argument("target")
@study_options(MEASURES, PLUGIN,
               click.option("--force", is_flag=True, help="Recompute measures already in measures.json."))
def measure(target: str, overrides: tuple[str, ...], out: str | None, device: str, quiet: bool,
            workers: int | None, shard: str | None, measures: str | None, plugins: tuple[str, ...], force: bool,
            **kw: Any) -> None:
    """Compute measures on the trained runs of TARGET (an experiment folder or a config)."""
    from flatbench.study.measure import measure_study
    from flatbench.study.spec import check_study, parse_shard, study_from_target, with_plugins
    from flatbench.training import resolve_device

    study = with_plugins(study_from_target(target, _with_workers(overrides, workers), out=out), plugins)
    check_study(study, _names(measures))
    if not study.exp_dir.is_dir():
        raise FlatbenchError(f"experiment folder {study.exp_dir} does not exist: train the study first "
                             f"(`flatbench train {target}`)")
    if kw["executor"]:
        _exit_incomplete(_submit(study, "measure", kw, device, shard, measures=_names(measures), force=force))
        return
    counts = measure_study(study, resolve_device(device), names=_names(measures), force=force,
                           shard=parse_shard(shard), quiet=quiet, echo=_echo)
    _echo(f"measured {counts.measured} models ({counts.not_trained} runs not trained yet, "
          f"{counts.errors} failed measure entries) -> {study.exp_dir}")
    _exit_on_failures(None, counts, counts.not_trained_ids)


@cli.command()
@click.argument("experiments", nargs=-1, required=True)
@click.option("--out", "out_dir", default=None, help="Where to write the report (default: the first folder).")
@click.option("--gap", type=click.Choice(["acc", "loss", "calibrated"]), default=None, help="Gap to correlate with.")
@click.option("--min-train-acc", type=float, default=None,
              help="Exclude runs below this final train accuracy (0 to 1; default: the study's report.min_train_acc).")
@click.option("--include-stale", is_flag=True,
              help="Also count runs left in runs/ by an earlier version of the study (listed as not in this study).")
@click.option("--quiet", is_flag=True, help="One line: where the report is and the best measure.")
@click.option("--seed", type=click.IntRange(min=0, max=2**63 - 1), default=0, show_default=True,
              help="Seed of the report's resampling (bootstrap intervals, comparisons, Monte-Carlo permutations).")
@PLUGIN
def report(experiments: tuple[str, ...], out_dir: str | None, gap: str | None, min_train_acc: float | None,
           include_stale: bool, quiet: bool, seed: int, plugins: tuple[str, ...]) -> None:
    """Tables, correlations, plots and report.md for one or more EXPERIMENT folders."""
    from flatbench.study.report import report_study  # lazy: `flatbench --help` must not import torch

    _load_plugins(plugins, experiments)
    report_study([Path(e) for e in experiments], out_dir=Path(out_dir) if out_dir else None, gap=gap,
                 min_train_acc=min_train_acc, include_stale=include_stale, echo=_echo, quiet=quiet, seed=seed)


@cli.command()
@click.argument("experiments", nargs=-1, required=True)
@click.option("--out", "out_dir", required=True, help="Where to write comparison.html, comparison.csv, plots/.")
def compare(experiments: tuple[str, ...], out_dir: str) -> None:
    """Several studies side by side, from their reports' correlations.csv: EXPERIMENT [EXPERIMENT ...]."""
    from flatbench.study.compare import compare_studies  # lazy: `flatbench --help` stays fast

    summary = compare_studies([Path(e) for e in experiments], Path(out_dir))
    _echo(f"compared {len(summary.studies)} studies, {summary.n_measures} measures -> {summary.html}")


@cli.command()
@click.argument("target")
@click.option("--families", default="layer,node,bn,logit_scale", show_default=True,
              help="Run audit: comma-separated transformation families.")
@click.option("--trials", type=int, default=3, show_default=True,
              help="Run audit: random transformations per family.")
@MEASURES
@click.option("--population", is_flag=True,
              help="TARGET is an experiment: transform every run --draws times for each factor range and compare "
                   "the correlations with the gap.")
@click.option("--family", default="node", show_default=True,
              help="Population audit: the family applied to every run.")
@click.option("--draws", type=int, default=3, show_default=True,
              help="Population audit: random transformations per run and factor range.")
@click.option("--max-factor", "--max-factors", "max_factor", multiple=True,
              help="Factors are log-uniform in [1/F, F]. Run audit: one F (default 10). Population audit: one "
                   "or more ranges, repeated or comma-separated (default 2,100: mild and harsh).")
@click.option("--declared", "declared_only", is_flag=True,
              help="Population audit: only the measures that declare invariance to --family (e.g. a layer-wise "
                   "audit of the layer-invariant measures beside a node-wise audit of all).")
@click.option("--fresh", is_flag=True,
              help="Population audit: recompute every run (default: reuse the finished runs of an earlier or "
                   "interrupted audit with the same settings).")
@click.option("--out", "out_dir", default=None, help="Where to write the files (default: TARGET).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Population audit: audit up to N runs at once in worker processes (default: the study's "
                   "measure.workers).")
@DEVICE
@PLUGIN
def audit(target: str, families: str, trials: int, measures: str | None, population: bool, family: str,
          draws: int, max_factor: tuple[str, ...], declared_only: bool, fresh: bool, out_dir: str | None,
          workers: int | None, device: str, plugins: tuple[str, ...]) -> None:
    """Check the measures under function-preserving transformations: TARGET is a run folder, or an
    experiment folder with --population."""
    from flatbench.study.audit import audit_run
    from flatbench.study.population import audit_population, parse_max_factors
    from flatbench.store import RUN_JSON
    from flatbench.study.spec import check_output_dir
    from flatbench.training import resolve_device

    path = Path(target)
    if not path.is_dir():
        raise FlatbenchError(f"{path} does not exist" if not path.exists() else f"{path} is a file, not a folder")
    factors = parse_max_factors(max_factor) if max_factor else None
    out = check_output_dir(out_dir, "audit output folder") if out_dir else None
    dev = resolve_device(device)
    if population:
        audit_population(path, family=family, measures=_names(measures), device=dev, max_factor=factors,
                         draws=draws, out_dir=out, fresh=fresh, echo=click.echo, plugins=plugins, workers=workers,
                         declared_only=declared_only)
        return
    if not (path / RUN_JSON).is_file():
        hint = " (add --population to audit a whole experiment)" if (path / "runs").is_dir() else ""
        raise FlatbenchError(f"{path} is not a run folder (no {RUN_JSON}){hint}")
    if factors is not None and len(factors) > 1:
        raise FlatbenchError(f"the run audit takes one --max-factor, got {', '.join(f'{f:g}' for f in factors)}")
    if workers is not None:
        raise FlatbenchError("--workers is for the population audit (--population); the run audit measures one run")
    if declared_only:
        raise FlatbenchError("--declared is for the population audit (--population); the run audit marks the "
                             "declared invariances in its table")
    audit_run(path, families=families, trials=trials, measures=_names(measures), device=dev,
              max_factor=factors[0] if factors else 10.0, out_dir=out, echo=click.echo, plugins=plugins)


@cli.command()
@click.argument("experiment")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (counts and every run's state).")
def status(experiment: str, as_json: bool) -> None:
    """How many runs of EXPERIMENT are finished, running, preempted, failed or not started."""
    import json  # lazy: only `status --json` needs it

    from flatbench.study.status import format_status, study_status  # lazy: `--help` must not import torch

    try:
        _load_plugins((), (experiment,))  # the study's plugin measures, to know which entries it expects
    except FlatbenchError:
        pass  # a damaged study.yaml or a missing plugin: the status says what it can
    st = study_status(experiment)
    click.echo(json.dumps(st, indent=2) if as_json else format_status(st))


def _load_plugins(plugins: tuple[str, ...], experiments: tuple[str, ...] = ()) -> None:
    """Load --plugin and the `measure.plugins` of the experiments' saved studies."""
    from flatbench.measures.registry import load_plugins
    from flatbench.store import STUDY_FILE
    from flatbench.study.spec import read_saved_study

    saved = [p for e in experiments if (Path(e) / STUDY_FILE).is_file() for p in read_saved_study(e).measure.plugins]
    load_plugins([*dict.fromkeys((*saved, *plugins))])


@cli.command("list-measures")
@PLUGIN
def list_measures(plugins: tuple[str, ...]) -> None:
    """Every registered measure: name, invariances, cost, the dtype it is computed in under measure.dtype auto,
    description (and the plugin it comes from)."""
    from flatbench.measures import all_measures  # lazy: `flatbench --help` must not import torch

    _load_plugins(plugins)
    specs = all_measures()
    rows = [(name, ",".join(sorted(spec.invariant_to)) or "-", spec.cost, spec.precision,
             spec.description + (f" [variants: {', '.join(spec.variants)}]" if spec.variants else "")
             + ("" if spec.origin == "builtin" else f" [plugin: {spec.origin}]"))
            for name, spec in specs.items()]
    header = ("name", "invariant to", "cost", "dtype", "description")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(4)]
    for row in [header, *rows]:
        click.echo(one_line("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4]))


@cli.command("describe")
@click.argument("name")
@PLUGIN
@click.option("--markdown", is_flag=True, help="Print the documentation site's page of NAME (Markdown).")
def describe(name: str, plugins: tuple[str, ...], markdown: bool) -> None:
    """NAME's definition, invariances, cost, every setting with its default (and meaning where registered)
    and an example (from the registry: a --plugin measure too)."""
    from flatbench.measures.describe import describe_measure  # lazy: `flatbench --help` must not import torch
    from flatbench.measures.reference_page import measure_page

    _load_plugins(plugins)
    click.echo(printable((measure_page if markdown else describe_measure)(name)), nl=False)


@cli.command("check-measure")
@click.argument("name")
@PLUGIN
@click.option("--cases", default=None, help="Comma-separated catalogue cases (default: all of them: "
              "mlp, mlp_nobias, mlp_bn, mlp_psi, lenet, wrn).")
@click.option("--families", default=None, help="Comma-separated rescaling families (default: all four).")
@click.option("--factory", default=None, help="Check on a model of one's own too: file.py:function or "
              "pkg.module:function (with --data; then the catalogue only where --cases names it).")
@click.option("--data", "dataset", default=None, help="The dataset of --factory: a built-in name or an .npz file.")
@click.option("--checkpoint", default=None, help="A state dict (torch.save) to load into --factory's model.")
@click.option("--n-examples", type=click.IntRange(min=1), default=None,
              help="Training examples --factory's model is measured on [default: 64, or all of fewer].")
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True, max=7 * 24 * 3600), default=3600.0,
              show_default=True, help="Seconds one call of the measure may take (as measure.timeout_s).")
def check_measure(name: str, plugins: tuple[str, ...], cases: str | None, families: str | None,
                  factory: str | None, dataset: str | None, checkpoint: str | None, n_examples: int | None,
                  timeout_s: float) -> None:
    """Check NAME's declared invariances on the catalogue of small trained models (or on --factory's model),
    rescaled with large random factors by every family; show which undeclared ones break it; check that it
    is finite and deterministic (or reports its standard error). Exit code 1 when a check fails."""
    from flatbench.measures import contract
    from flatbench.measures.registry import get_measure
    from flatbench.rescale import FAMILIES

    _load_plugins(plugins)
    spec = get_measure(name)
    if (factory is None) != (dataset is None):
        raise FlatbenchError("check-measure: --factory and --data go together")
    chosen_cases: list = list(_choices(cases, contract.CASES, "case")) if cases or factory is None else []
    if factory is not None:
        from flatbench.api import factory_case

        chosen_cases.append(factory_case(factory, dataset, checkpoint=checkpoint, n_examples=n_examples, default_n=64))
    chosen_families = _choices(families, FAMILIES, "family")
    click.echo(f"checking {spec.name} ({spec.origin if spec.origin != 'builtin' else 'built-in'}; declared "
               f"invariant to: {', '.join(sorted(spec.invariant_to)) or 'none'}) on {len(chosen_cases)} trained "
               "models, factors log-uniform in [1/10, 10]")
    report = contract.check_measure(spec.name, cases=chosen_cases, families=chosen_families, timeout_s=timeout_s)
    for line in contract.format_report(report):
        click.echo(line)
    if report.problems:
        sys.exit(1)


def _choices(text: str | None, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    if not text:
        return allowed
    chosen = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [c for c in chosen if c not in allowed]
    if unknown or not chosen:
        raise FlatbenchError(f"unknown {what} '{unknown[0] if unknown else text}' (choose from: {', '.join(allowed)})")
    return chosen


@cli.command("verify")
@click.argument("factory")
@click.option("--data", "dataset", required=True,
              help="The dataset: a built-in name (mnist_mini, mnist, fashion_mnist, cifar10) or an .npz file.")
@click.option("--checkpoint", default=None, help="A state dict (torch.save) to load into the model.")
@click.option("--n-examples", type=click.IntRange(min=1), help="Examples used [default: 32, or all of fewer].")
@click.option("--params", "max_params", type=click.IntRange(min=1), default=200, show_default=True,
              help="Parameters compared (a seeded slice of every tensor; one backward pass each).")
@click.option("--loss", default="ce", show_default=True, help="ce, normalized_ce, mse, or file.py:function.")
@click.option("--hvp-mode", default="auto", show_default=True,
              type=click.Choice(["auto", "rev_fwd", "fwd_rev", "double_backward"]), help="The HVP mode to verify.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the model's init, the slice and probes.")
def verify(factory: str, dataset: str, checkpoint: str | None, n_examples: int | None, max_params: int, loss: str,
           hvp_mode: str, seed: int) -> None:
    """Check flatbench's curvature on FACTORY's model (with --checkpoint weights) against its dense Hessian,
    in float64, on the model or a slice of --params of its parameters: each HVP mode, the shared diagonal,
    hessian_trace, hessian_max_eig, hessian_density. Exit code 1 when a check of flatbench's results fails."""
    from flatbench.api import factory_model  # lazy: `flatbench --help` must not import torch
    from flatbench.verification import format_table, verify as run_verify

    model, x, y = factory_model(factory, dataset, checkpoint=checkpoint, n_examples=n_examples, seed=seed, default_n=32)
    df = run_verify(model, (x, y), loss=loss, n_examples=None, max_params=max_params, seed=seed, hvp_mode=hvp_mode)
    for line in format_table(df):
        click.echo(line)
    if df.attrs["failed"]:
        sys.exit(1)


@cli.command("measure-model")
@click.argument("factory")
@click.option("--data", "dataset", required=True,
              help="The dataset: a built-in name (mnist_mini, mnist, fashion_mnist, cifar10) or an .npz file.")
@click.option("--checkpoint", default=None, help="A state dict (torch.save) to load into the model.")
@click.option("--n-examples", type=click.IntRange(min=1), default=None,
              help="Measure on a seeded random subset of this many training examples (default: all).")
@click.option("--measures", "measures", default=None, help="Comma-separated measures (default: all).")
@click.option("--out", "out_dir", default=None, help="Write measures.json and table.csv into this folder.")
@click.option("--dtype", default="float64", show_default=True, type=click.Choice(["float64", "float32"]))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the model's init and the probes.")
@click.option("--set", "sets", multiple=True, metavar="MEASURE.KEY=VALUE",
              help="A measure setting, as measure.settings in a study config (repeatable; `flatbench describe "
                   "MEASURE` lists them), e.g. --set hessian_max_eig.iters=200.")
@click.option("--loss", default="ce", show_default=True,
              help="The loss of the loss-based measures: ce, normalized_ce, mse (also on floating-point regression "
                   "targets), or file.py:function.")
@click.option("--plot", "plot", default=None, metavar="PATH",
              help="Draw the hessian_density spectrum into this PNG (adds hessian_density to the measures).")
@click.option("--hvp-mode", "hvp_mode", default="auto", show_default=True,
              type=click.Choice(["auto", "rev_fwd", "fwd_rev", "double_backward"]),
              help="How Hessian-vector products are computed (measure.hvp_mode in a study config).")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
              help="Where to measure.")
@PLUGIN
def measure_model(factory: str, dataset: str, checkpoint: str | None, n_examples: int | None, measures: str | None,
                  out_dir: str | None, dtype: str, seed: int, sets: tuple[str, ...], loss: str, plot: str | None,
                  hvp_mode: str, device: str, plugins: tuple[str, ...]) -> None:
    """Measure a model of one's own: FACTORY is file.py:function or pkg.module:function (called with
    input_shape and num_classes where it takes them), with --checkpoint weights, on --data."""
    from flatbench.api import measure_model as run_measure_model, settings_from_overrides
    from flatbench.measures.runner import FAILED, format_value
    from flatbench.study.spec import check_output_dir
    from flatbench.training import resolve_device

    out = check_output_dir(out_dir, "output folder") if out_dir else None
    names = _names(measures)
    if plot and "hessian_density" not in (names or []):
        names = (names or ["all"]) + ["hessian_density"]
    df, where = run_measure_model(factory, dataset, checkpoint=checkpoint, n_examples=n_examples, measures=names,
                                  out=str(out) if out else None, device=str(resolve_device(device)), dtype=dtype,
                                  plugins=plugins, seed=seed, settings=settings_from_overrides(sets), loss=loss,
                                  plot=plot, hvp_mode=hvp_mode)
    heads = df[~df["key"].str.contains("/")]
    width = max([len(k) for k in heads["key"]] + [10])
    for _, row in heads.iterrows():
        text = format_value(row["value"]) if row["status"] == "ok" else f"{row['status'].replace('_', ' ')}: " \
            f"{str(row['reason']).splitlines()[0][:120] if row['reason'] else ''}"
        click.echo(f"{row['key']:{width}s}  {text}  ({row['seconds']:.2f}s)")
    if where is not None:
        click.echo(f"-> {where / 'measures.json'}, {where / 'table.csv'}")
    if plot and df.attrs.get("plot"):
        click.echo(f"-> {df.attrs['plot']}")
    if checkpoint is None:
        click.echo(f"warning: no --checkpoint: these are the measures of {one_line(factory)}'s random "
                   "initialization, not of a trained model", err=True)
    failed = df[df["status"].isin(list(FAILED))]
    _list_failed([(factory, row["key"], str(row["reason"])) for _, row in failed.iterrows()])
    if len(failed):
        _exit_failed(len(failed))


def _exit_on_failures(outcome: TrainOutcome | None, counts: Any = None, untrained: list[str] | tuple = ()) -> None:
    """The exit code a scheduler can trust. Runs that failed to train or models that could not be measured
    (damage) exit 2 in one line; measure entries that failed (error, non_finite) are listed one per line on
    stderr (model, entry, reason) and exit 1, and so do runs asked to be measured that are not trained yet
    (`untrained`, named in one line); everything else done is kept."""
    problems = []
    if outcome and outcome.failed:
        problems.append(f"{len(outcome.failed)} run(s) failed to train: {', '.join(outcome.failed)} "
                        "(see their run.json)")
    if counts is not None and counts.failed_runs:
        (first, why), names = next(iter(counts.failed_runs.items())), ", ".join(list(counts.failed_runs)[:8])
        problems.append(f"{len(counts.failed_runs)} model(s) could not be measured: {names} ({first}: {why})")
    failed = list(counts.failed_entries) if counts is not None else []
    _list_failed(failed)
    if problems:
        raise FlatbenchError("; ".join(problems))
    if failed or untrained:
        _exit_failed(len(failed), untrained)


def _exit_incomplete(lines: list[str]) -> None:
    """Exit 1 after an --executor submission whose tasks left entries or runs undone (one line each)."""
    for line in lines:
        click.echo(f"failed: {one_line(line)[:300]}", err=True)
    if lines:
        click.echo(f"error: {len(lines)} task(s) or run(s) left measure entries undone (listed above; everything "
                   "done is kept)", err=True)
        sys.exit(1)


def _list_failed(failed: list[tuple[str, str, str]]) -> None:
    """One line on stderr per failed entry: the model, the entry, the reason."""
    for label, key, reason in failed:
        click.echo(f"failed: {one_line(label)} {one_line(key)}: {one_line(reason)[:200]}", err=True)


def untrained_text(untrained: list[str] | tuple) -> str:
    """Runs asked to be measured that are not trained yet, in one line (the first ten named)."""
    shown = ", ".join(untrained[:10]) + (f", ... ({len(untrained) - 10} more)" if len(untrained) > 10 else "")
    return (f"{len(untrained)} run(s) not trained yet, nothing measured on them: {shown} (train them first: "
            "`flatbench train`; `flatbench status` shows progress)")


def _exit_failed(n: int, untrained: list[str] | tuple = ()) -> None:
    """Exit 1: the stage ran, and `n` entries asked for failed (listed above) or runs asked for are not
    trained yet (named here)."""
    parts = [f"{n} measure entr{'y' if n == 1 else 'ies'} failed (listed above; the other entries are kept)"] if n else []
    if untrained:
        parts.append(untrained_text(list(untrained)))
    click.echo(f"error: {one_line('; '.join(parts))}", err=True)
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """Entry point (`_main`) in a process flatbench owns (`measures.watchdog`: a hostile measure can end it)."""
    from flatbench.measures.watchdog import end_if_threads_left, owned_process  # lazy, and without torch

    try:
        with owned_process():
            _main(argv)
    except SystemExit as exc:
        end_if_threads_left(exc.code)
        raise


def _main(argv: list[str] | None) -> None:
    """Click, with user errors turned into one line and exit code 2."""
    silence_library_noise()
    try:
        cli.main(args=argv, prog_name="flatbench", standalone_mode=False)
    except FlatbenchError as exc:
        click.echo(f"error: {one_line(str(exc))}", err=True)
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
        click.echo(f"error: {one_line(str(exc.strerror or exc))}{one_line(where)}", err=True)
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - the last guard: not a user error, but still no traceback wall
        if type(exc).__name__ == "Preempted":
            click.echo(f"preempted ({exc}): the last epoch checkpoint is saved; re-run the same command to "
                       "resume", err=True)
            sys.exit(143)
        raise
    sys.exit(0)
