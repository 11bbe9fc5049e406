"""The report stage: experiment folders in, a decision out ("this measure tracks the gap, that one not").

    write_report([results/quickstart], results/quickstart)
      → table.csv          one row per run: hyperparameters, metrics, gaps, every measure value
      → correlations.csv   per headline measure: τ within draws/ρ/r with 95% bootstrap CIs, pooled and
                           within-cell τ, against ref.hyperparameters, n, Ψ and ψ per axis, CMI; then the
                           reference rows ref.hyperparameters, ref.axis.*, ref.random, ref.replicate_gap
      → comparisons.csv    every pair of measures: τ_a − τ_b with its paired interval
      → reference_bands.csv  the random reference's 95% band of every statistic
      → environments.csv   Dziugaite et al.'s environments of every measure, with their counted pairs
      → variance.csv       gap ~ draw + cell: the draw's share of the variance, the cells' partial ω²
      → plots/*.png        ranking, scatter grids by family, against the ratio, agreement, comparisons, ...
      → report.md          the same story with relative image links, readable as plain text
      → report.html        self-contained: images, script and data inline, nothing fetched

It reads only `run.json`, `measures.json`, `study.yaml` and the rescaling audits' `audit_correlations.csv`,
so it can run on a laptop over folders copied back from a cluster, and over several folders at once (e.g.
an MNIST and a CIFAR-10 study), in which case `experiment` becomes a hyperparameter axis. Statistics live
in `flatbench.analysis.stats`, the figures in `figures`, the document's sections in `sections` and
`sections_detail`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from flatbench import store
from flatbench.analysis import sections as sec
from flatbench.analysis import sections_detail as detail
from flatbench.analysis.audit_digest import find_audits, measured_invariance
from flatbench.analysis.document import Document
from flatbench.analysis.families import family_of
from flatbench.analysis.figures import draw_figures, plot_filename
from flatbench.analysis.fmt import ci_text, num, p_text
from flatbench.analysis.stats import MIN_RUNS, N_BOOT, Analysis, analyze
from flatbench.analysis.table import ReportInputs, RunRecord, report_inputs, to_float
from flatbench.analysis.verdict import build_verdict
from flatbench.analysis.verdict_block import verdict_block
from flatbench.config import ReportConfig
from flatbench.errors import FlatbenchError

__all__ = ["ReportInputs", "ReportSummary", "format_summary", "plot_filename", "write_report", "write_statistics"]


@dataclass
class ReportSummary:
    """What `write_report` produced, for the CLI and for tests."""

    out_dir: Path
    table_csv: Path
    correlations_csv: Path
    report_md: Path
    report_html: Path
    plots: list[Path]
    n_runs: int
    n_finished: int
    n_included: int
    excluded: list[dict[str, Any]]
    """run_id, experiment, status, reason for every run left out of the statistics."""
    best_measure: str | None
    """Highest Kendall τ with the gap, or None when no correlation could be computed."""
    correlations: pd.DataFrame
    table: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    """Why the verdict may not hold (e.g. runs that stopped at very different train losses)."""


def _analysis(inputs: ReportInputs, gap: str, min_train_acc: float, n_boot: int, seed: int) -> Analysis:
    """The table's statistics; refuses when too few runs can be used (nothing is written then). Runs that
    missed their step-level endpoint (`endpoint_misses`) stay in the table and are left out of the
    statistics, listed with their reason."""
    table, missed = inputs.table, endpoint_misses(inputs.records)
    judged = table
    if missed:
        judged = table[[(e, r) not in missed for e, r in zip(table["experiment"], table["run_id"])]]
        judged.attrs = dict(table.attrs)
    analysis = analyze(judged, gap=gap, min_train_acc=min_train_acc, n_boot=n_boot, seed=seed)
    if missed:
        rows = [{"run_id": r, "experiment": e, "status": "finished", "reason": why} for (e, r), why in missed.items()]
        analysis.excluded = pd.concat([analysis.excluded, pd.DataFrame(rows)], ignore_index=True)
    if len(analysis.included) < MIN_RUNS:
        reasons = sorted({str(r) for r in analysis.excluded["reason"]}) if len(analysis.excluded) else []
        why = f"; {len(analysis.excluded)} excluded, e.g. {reasons[0]}" if reasons else ""
        raise FlatbenchError(f"only {len(analysis.included)} usable run(s), a report needs at least {MIN_RUNS}"
                             f"{why}; nothing was written (an existing report is kept)")
    if inputs.stale:
        extra = pd.DataFrame([{"run_id": rec.run_id, "experiment": rec.experiment, "status": rec.status,
                               "reason": "not in this study (left by an earlier version of its config; "
                                         "report --include-stale counts it)"} for rec in inputs.stale])
        analysis.excluded = pd.concat([analysis.excluded, extra], ignore_index=True)
    return analysis


def endpoint_misses(records: list[RunRecord]) -> dict[tuple[str, str], str]:
    """(experiment, run id) → why, for every finished run whose run.json `endpoint` record (written with
    `train.endpoint_tolerance`) says it did not stop within the tolerance below its loss target
    (`store.endpoint_miss`): such a run is out of the verdict. A run without the record is not judged here
    (runs trained without the setting are reported as before)."""
    out = {}
    for rec in records:
        if rec.status == "finished":
            why = store.endpoint_miss(rec.info.get("endpoint"))
            if why is not None:
                out[(rec.experiment, rec.run_id)] = f"missed the training endpoint: {why}"
    return out


def _endpoint_warning(excluded: pd.DataFrame) -> str | None:
    """The report's line naming the runs left out for missing their endpoint (the first five)."""
    names = [str(r.run_id) for r in excluded.itertuples() if str(r.reason).startswith("missed the training endpoint")]
    if not names:
        return None
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return (f"{len(names)} run(s) missed the common training endpoint (train.endpoint_tolerance) and are out of the "
            f"statistics: {', '.join(names[:5])}{more} (reasons under Excluded runs)")


def _write_tables(out_dir: Path, table: pd.DataFrame, analysis: Analysis, levels: pd.DataFrame) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    store.atomic_write_text(out_dir / "table.csv", table.to_csv(index=False))
    store.atomic_write_text(out_dir / "correlations.csv", analysis.all_rows().to_csv(index=False))
    store.atomic_write_text(out_dir / "comparisons.csv", analysis.comparisons.to_csv(index=False))
    store.atomic_write_text(out_dir / "reference_bands.csv", analysis.reference_bands.to_csv(index=False))
    store.atomic_write_text(out_dir / "environments.csv", analysis.environments.to_csv(index=False))
    store.atomic_write_text(out_dir / "variance.csv", analysis.variance.to_csv(index=False))
    if len(levels):
        store.atomic_write_text(out_dir / "correlations_by_level.csv", levels.to_csv(index=False))
    else:
        (out_dir / "correlations_by_level.csv").unlink(missing_ok=True)


def _statistics(inputs: ReportInputs, settings: ReportConfig, n_boot: int, seed: int
                ) -> tuple[Analysis, pd.DataFrame, Endpoint]:
    """The report's numbers, computed once from the inputs' tables: the analysis, τ per snapshot level and
    the endpoint warnings."""
    analysis = _analysis(inputs, settings.gap, settings.min_train_acc, n_boot, seed)
    endpoint = check_endpoint(analysis.included, settings.max_train_loss, settings.max_loss_span)
    missed = _endpoint_warning(analysis.excluded)
    if missed:
        endpoint.warnings.insert(0, missed)
    levels = level_correlations(inputs.level_tables, gap=settings.gap, n_boot=n_boot, seed=seed,
                                final=analysis.correlations)
    return analysis, levels, endpoint


def write_statistics(exp_dirs: list[Path], out_dir: Path, settings: ReportConfig, inputs: ReportInputs | None = None,
                     n_boot: int = N_BOOT, seed: int = 0) -> tuple[Analysis, pd.DataFrame, Endpoint]:
    """The report's numbers without its figures and pages: table.csv, correlations.csv, comparisons.csv,
    reference_bands.csv, environments.csv, variance.csv (and correlations_by_level.csv), from `inputs`
    (read from the folders when None). tests/test_results.py rebuilds every committed study's numbers this
    way (`report_study(statistics_only=True)`: the figures take five times as long as the statistics and
    hold no number the files do not)."""
    inputs = inputs or report_inputs([Path(p) for p in exp_dirs])
    analysis, levels, endpoint = _statistics(inputs, settings, n_boot, seed)
    _write_tables(Path(out_dir), inputs.table, analysis, levels)
    return analysis, levels, endpoint


SECTIONS = (verdict_block, sec.summary_section, sec.figures_section, sec.audit_section, detail.statistics_section,
            detail.levels_section, detail.endpoint_section, detail.excluded_section, detail.time_section,
            detail.runs_section, detail.config_section)
"""The report's sections in reading order (`verdict_block`, `sections`, `sections_detail`)."""


def write_report(exp_dirs: list[Path] | list[str], out_dir: Path | str, settings: ReportConfig | None = None, *,
                 inputs: ReportInputs | None = None, n_boot: int = N_BOOT, seed: int = 0, quiet: bool = False,
                 echo: Callable[[str], Any] = print) -> ReportSummary:
    """The report in one pass over `inputs` (the runs and their tables, `table.report_inputs`; read from
    the folders when None): the statistics, then the files (tables, figures), then the document section by
    section, then the ranking printed. `settings`: the study's `report` section (gap, min_train_acc,
    max_train_loss, max_loss_span; `ReportConfig`'s defaults when None, the one home of their default
    values). `n_boot` and `seed`: the resampling.

    Refuses (FlatbenchError, nothing written) when no run can be used, so that a good report is never
    replaced by an empty one. `quiet` prints one line (where the report is and the best measure).
    """
    start = time.perf_counter()
    exp_dirs, out_dir = [Path(p) for p in exp_dirs], Path(out_dir)
    settings = settings or ReportConfig()
    inputs = inputs or report_inputs(exp_dirs)
    analysis, levels, endpoint = _statistics(inputs, settings, n_boot, seed)
    ctx = _write_files(exp_dirs, out_dir, inputs, analysis, levels, endpoint, n_boot, seed, settings.min_train_acc)
    doc = Document(title=f"flatbench report: {', '.join(p.name for p in exp_dirs)}")
    for section in SECTIONS:
        section(doc, ctx)
    doc.data = {"runs": detail.hover_runs(ctx), "figures": {f.name: f.extra for f in ctx.figures if f.extra}}
    store.atomic_write_text(out_dir / "report.md", doc.to_markdown())
    store.atomic_write_text(out_dir / "report.html", doc.to_html())
    corr, table = analysis.correlations, inputs.table
    best = _best_measure(corr)
    summary = ReportSummary(
        out_dir=out_dir, table_csv=out_dir / "table.csv", correlations_csv=out_dir / "correlations.csv",
        report_md=out_dir / "report.md", report_html=out_dir / "report.html",
        plots=[out_dir / "plots" / f.name for f in ctx.figures], n_runs=len(table) + len(inputs.stale),
        n_finished=int((table["status"] == "finished").sum()) if len(table) else 0,
        n_included=len(analysis.included), excluded=analysis.excluded.to_dict(orient="records"),
        best_measure=best, correlations=corr, table=table, notes=list(analysis.notes),
        seconds=time.perf_counter() - start, warnings=list(endpoint.warnings))
    if quiet:
        best_txt = f"; best: {best} (tau = {num(corr.iloc[0]['kendall_tau'])})" if best else ""
        echo(f"report: {summary.report_html} ({summary.n_included} of {summary.n_runs} runs used{best_txt})")
        for warning in summary.warnings:
            echo(f"WARNING: {warning}")
    else:
        echo(format_summary(summary, analysis))
    return summary


def _reasons(status: list[dict[str, Any]], corr: pd.DataFrame) -> dict[str, str]:
    """Why a measure has no τ, in one line: what its runs said, or the statistics' note."""
    notes = {str(r["measure"]): str(r.get("note") or "") for r in corr.to_dict(orient="records")}
    out = {}
    for s in status:
        runs = s["ok"] + s["not_applicable"] + s["error"] + s["other"]
        if s["ok"] == 0:
            what = "not applicable" if s["not_applicable"] == runs else "no value"
            out[s["entry"]] = f"{what} on all {runs} runs: {s['problem']}"
        else:
            out[s["entry"]] = notes.get(s["entry"], "").split(";")[0] or f"a value on only {s['ok']} of {runs} runs"
    return out


def _write_files(exp_dirs: list[Path], out_dir: Path, inputs: ReportInputs, analysis: Analysis, levels: pd.DataFrame,
                 endpoint: Endpoint, n_boot: int, seed: int, min_train_acc: float) -> sec.ReportContext:
    """The files the document links to (the tables, then the figures) and everything the sections read:
    audits, families, the measures' status and the verdict."""
    corr, measure_info = analysis.correlations, inputs.measure_info
    families = {str(k): family_of(str(k), measure_info) for k in corr["measure"]}
    audits = find_audits(exp_dirs)
    status = _measure_status(inputs.records)
    verdict = build_verdict(corr, analysis.included, analysis.gap_column, analysis.larger_is_sharper, measure_info,
                            measured_invariance(audits), _reasons(status, corr))
    _write_tables(out_dir, inputs.table, analysis, levels)
    figures = draw_figures(analysis, out_dir / "plots", families, records=inputs.records, levels=levels, audits=audits)
    return sec.ReportContext(exp_dirs, out_dir, inputs.records, inputs.table, analysis, figures, verdict, audits,
                             families, status, n_boot, seed, min_train_acc, endpoint, levels, measure_info)


def _best_measure(corr: pd.DataFrame) -> str | None:
    if len(corr) and math.isfinite(to_float(corr.iloc[0]["kendall_tau"])):
        return str(corr.iloc[0]["measure"])
    return None


# ------------------------------------------------------------------------------------- training endpoint

@dataclass
class Endpoint:
    """Where the runs stopped training: their final train losses and whether that makes curvature
    measures comparable (a curvature measure of the cross-entropy shrinks with the loss, so across runs
    that ended at losses decades apart it mostly measures the loss)."""

    low: float
    high: float
    span: float
    above: list[str]
    """Runs that ended above `report.max_train_loss`."""
    missed: list[str]
    """Runs whose `train.target_train_loss` / `target_train_acc` was not reached by `train.epochs`."""
    warnings: list[str]


def check_endpoint(included: pd.DataFrame, max_train_loss: float, max_loss_span: float) -> Endpoint:
    """The endpoint warnings of a report (see `Endpoint`)."""
    losses = pd.to_numeric(included.get("train_loss", pd.Series(dtype=float)), errors="coerce").to_numpy(float)
    finite = losses[np.isfinite(losses)]
    low = float(finite.min()) if len(finite) else math.nan
    high = float(finite.max()) if len(finite) else math.nan
    span = high / low if len(finite) and low > 0 else math.inf if len(finite) else math.nan
    ids = included["run_id"].tolist() if "run_id" in included else []
    above = [rid for rid, loss in zip(ids, losses) if math.isfinite(loss) and loss > max_train_loss]
    reached = included.get("reached_target", pd.Series([None] * len(included), index=included.index))
    missed = [rid for rid, r in zip(ids, reached) if r is False or str(r) == "False"]
    warnings = []
    if len(finite) and span > max_loss_span:
        warnings.append(f"the runs' final train losses span {low:.3g} to {high:.3g} ({span:.3g}x > "
                        f"report.max_loss_span = {max_loss_span:g}): curvature measures of runs stopped at such "
                        "different losses are not comparable (stop every run at train.target_train_loss)")
    if above:
        warnings.append(f"{len(above)} run(s) ended above train loss {max_train_loss:g} (report.max_train_loss), "
                        f"e.g. {above[0]}: not at a minimum")
    if missed:
        warnings.append(f"{len(missed)} run(s) stopped at train.epochs before reaching their training target, "
                        f"e.g. {missed[0]}")
    return Endpoint(low, high, span, above, missed, warnings)


def level_correlations(level_tables: Mapping[float, pd.DataFrame], gap: str = "acc", n_boot: int = N_BOOT,
                       seed: int = 0, final: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each measure's Kendall τ with the gap at every snapshot level (the models as they were when their
    train loss first reached it; `table.level_tables`), plus the final models' (level "final"). Empty when
    no run kept snapshots.

    At a level every run is at the same train loss by construction, so no run is excluded for its train
    accuracy there (a run that never reached the level has no snapshot and is simply absent: n says so)."""
    if not level_tables:
        return pd.DataFrame()
    rows = []
    cols = ["measure", "kendall_tau", "kendall_tau_lo", "kendall_tau_hi", "kendall_p", "n"]
    for level, table in level_tables.items():
        corr = analyze(table, gap=gap, min_train_acc=0.0, n_boot=n_boot, seed=seed, full=False).correlations
        for r in corr.to_dict(orient="records"):
            rows.append({"level": level, **{c: r.get(c) for c in cols}})
    if final is not None:
        for r in final.to_dict(orient="records"):
            rows.append({"level": "final", **{c: r.get(c) for c in cols}})
    return pd.DataFrame(rows, columns=["level", *cols])


# ---------------------------------------------------------------------------------------------- terminal

def format_summary(summary: ReportSummary, analysis: Analysis | None = None) -> str:
    """The terminal table: aligned plain text (ASCII, survives any cluster log), best measure first."""
    corr = summary.correlations
    gap = corr.attrs.get("gap", "acc")
    lines = [(f"flatbench report: {summary.n_runs} runs, {summary.n_finished} finished, "
             f"{summary.n_included} used, {len(summary.excluded)} excluded "
             f"(gap: {'train acc - test acc' if gap == 'acc' else 'test loss - train loss'})")]
    if len(corr):
        header = ["#", "measure", "n", "tau [95% CI]", "p", "vs best", "Psi", "CMI", "SE mean", "SE worst"]
        body = []
        marks = {"best": "best", "indistinguishable": "~best", "worse": "worse", "better on shared runs": "better*",
                 "cannot compare": "n/c"}
        for i, row in enumerate(corr.to_dict(orient="records"), 1):
            name = row["measure"] + ("" if row["larger_is_sharper"] else " (-)")
            mark = marks.get(str(row.get("vs_best") or ""), "") + ("?" if row.get("vs_best_borderline") else "")
            body.append([str(i), name, str(row["n"]), ci_text(row, "kendall_tau"), p_text(row.get("kendall_p")), mark,
                         num(row["psi"]), num(row["cmi"]), num(row.get("sign_error_mean")),
                         num(row.get("sign_error_worst"))])
        widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header))]
        left = {1, 3, 5}
        for r in [header, *body]:
            cells = [r[c].ljust(widths[c]) if c in left else r[c].rjust(widths[c]) for c in range(len(r))]
            lines.append("  " + "  ".join(cells).rstrip())
        for row in (analysis.references.to_dict(orient="records") if analysis is not None else []):
            lines.append(f"  reference {row['measure']}: tau {ci_text(row, 'kendall_tau')}, Psi {num(row['psi'])}, "
                         f"CMI {num(row['cmi'])}")
        lines.append("  p: permutation p-value of tau; ~best: not shown worse than the best (Holm, paired two-way "
                     "bootstrap); n/c: cannot compare (fewer than 10 shared runs or units); ?: borderline (another "
                     "--seed may give the other label); SE: Dziugaite sign error (mean, worst environment)")
        if any(not v for v in corr["larger_is_sharper"]):
            lines.append("  (-) smaller value = sharper: negated, so tau > 0 always means 'tracks the gap'")
    else:
        lines.append("  no measure values found")
    for ex in summary.excluded[:10]:
        lines.append(f"  excluded {ex['run_id']}: {ex['reason']}")
    if len(summary.excluded) > 10:
        lines.append(f"  ... and {len(summary.excluded) - 10} more excluded runs (see the report)")
    for warning in summary.warnings:
        lines.append(f"  WARNING: {warning}")
    for note in summary.notes:
        lines.append(f"  note: {note}")
    lines.append(f"report: {summary.report_html}")
    return "\n".join(lines)


def _measure_status(records: list[RunRecord]) -> list[dict[str, Any]]:
    """Per measure entry: how many runs ok / not applicable / failed, its time, and the first problem."""
    stats: dict[str, dict[str, Any]] = {}
    for rec in records:
        for name, entry in rec.measures.items():
            s = stats.setdefault(name, {"entry": name, "ok": 0, "not_applicable": 0, "error": 0, "other": 0,
                                        "seconds": 0.0, "timed": 0, "problem": ""})
            status = str(entry.get("status", "ok"))
            s[status if status in ("ok", "not_applicable", "error") else "other"] += 1
            sec = to_float(entry.get("seconds"))
            if math.isfinite(sec):
                s["seconds"] += sec
                s["timed"] += 1
            if status != "ok" and not s["problem"]:
                text = str(entry.get("error") or entry.get("reason") or status)
                s["problem"] = text.splitlines()[0] if text else status
    return [stats[k] for k in sorted(stats)]


