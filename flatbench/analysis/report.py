"""The report stage: experiment folders in, a decision out ("this measure tracks the gap, that one not").

    write_report([results/quickstart], results/quickstart)
      → table.csv          one row per run: hyperparameters, metrics, gaps, every measure value
      → correlations.csv   per headline measure: τ/ρ/r with 95% bootstrap CIs, n, Ψ and ψ per axis, CMI
      → plots/*.png        per measure vs gap, overview grid, ranking, vs ratio, agreement heatmap
      → report.md          the same story with relative image links
      → report.html        self-contained: images embedded, no network needed

It reads only `run.json`, `measures.json` and `study.yaml`, so it can run on a laptop over folders
copied back from a cluster, and over several folders at once (e.g. an MNIST and a CIFAR-10 study), in
which case `experiment` becomes a hyperparameter axis. Statistics live in `flatbench.analysis.stats`.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from flatbench import store
from flatbench.analysis import plots
from flatbench.analysis.document import Bullets, CodeBlock, Document, Heading, Image, Paragraph, Table
from flatbench.analysis.stats import (
    MIN_RUNS,
    Analysis,
    agreement_matrix,
    analyze,
    correlations,
    oriented,
)
from flatbench.analysis.table import RunRecord, build_table, load_records, stderr_columns, to_float
from flatbench.errors import FlatbenchError
from flatbench.measures.keys import parse_key

__all__ = ["ReportSummary", "build_table", "correlations", "format_summary", "write_report"]

MAX_RUN_ROWS = 300
"""The report lists at most this many runs; table.csv always has all of them."""


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


def write_report(exp_dirs: list[Path] | list[str], out_dir: Path | str, gap: str = "acc",
                 min_train_acc: float = 0.0, quiet: bool = False, echo: Callable[[str], Any] = print,
                 n_boot: int = 1000, seed: int = 0, records: list[RunRecord] | None = None,
                 stale: list[RunRecord] | None = None, report_cfg: Any = None,
                 max_train_loss: float | None = None, max_loss_span: float | None = None,
                 measure_info: dict[str, Any] | None = None) -> ReportSummary:
    """Read the experiment folders (or use `records`), compute the statistics, write every report file,
    print the ranking. `stale` runs are listed as not in this study. `measure_info` (measure name → an
    object with `description` and `cost`, e.g. the registry's specs) describes the measures in the report;
    the report reads everything else from the files.

    Refuses (FlatbenchError, nothing written) when no run can be used, so that a good report is never
    replaced by an empty one. `quiet` prints one line (where the report is and the best measure).
    """
    start = time.perf_counter()
    exp_dirs = [Path(p) for p in exp_dirs]
    out_dir = Path(out_dir)
    if records is None:
        records = load_records(exp_dirs)
    table = build_table(exp_dirs, records=records)
    analysis = analyze(table, gap=gap, min_train_acc=min_train_acc, n_boot=n_boot, seed=seed)
    if len(analysis.included) < MIN_RUNS:
        reasons = sorted({str(r) for r in analysis.excluded["reason"]}) if len(analysis.excluded) else []
        why = f"; {len(analysis.excluded)} excluded, e.g. {reasons[0]}" if reasons else ""
        raise FlatbenchError(f"only {len(analysis.included)} usable run(s), a report needs at least {MIN_RUNS}"
                             f"{why}; nothing was written (an existing report is kept)")
    if stale:
        extra = pd.DataFrame([{"run_id": rec.run_id, "experiment": rec.experiment, "status": rec.status,
                               "reason": "not in this study (left by an earlier version of its config; "
                                         "report --include-stale counts it)"} for rec in stale])
        analysis.excluded = pd.concat([analysis.excluded, extra], ignore_index=True)
    if report_cfg is not None:
        max_train_loss = report_cfg.max_train_loss if max_train_loss is None else max_train_loss
        max_loss_span = report_cfg.max_loss_span if max_loss_span is None else max_loss_span
    endpoint = check_endpoint(analysis.included, max_train_loss or 0.01, max_loss_span or 10.0)
    levels = level_correlations(records, gap=gap, n_boot=n_boot, seed=seed, final=analysis.correlations)
    notes = list(analysis.notes)
    corr = analysis.correlations

    out_dir.mkdir(parents=True, exist_ok=True)
    table_csv = out_dir / "table.csv"
    corr_csv = out_dir / "correlations.csv"
    store.atomic_write_text(table_csv, table.to_csv(index=False))
    store.atomic_write_text(corr_csv, corr.to_csv(index=False))
    store.atomic_write_text(out_dir / "comparisons.csv", analysis.comparisons.to_csv(index=False))
    if len(levels):
        store.atomic_write_text(out_dir / "correlations_by_level.csv", levels.to_csv(index=False))
    else:
        (out_dir / "correlations_by_level.csv").unlink(missing_ok=True)

    figures = _draw_figures(analysis, out_dir / "plots", records=records, levels=levels)

    best = _best_measure(corr)
    doc = _build_document(exp_dirs, records, table, analysis, figures, notes, best, n_boot, seed,
                          min_train_acc, endpoint, levels, measure_info)
    report_md = out_dir / "report.md"
    report_html = out_dir / "report.html"
    store.atomic_write_text(report_md, doc.to_markdown())
    store.atomic_write_text(report_html, doc.to_html())

    summary = ReportSummary(
        out_dir=out_dir, table_csv=table_csv, correlations_csv=corr_csv, report_md=report_md,
        report_html=report_html, plots=[out_dir / "plots" / name for name, _, _ in figures],
        n_runs=len(table) + len(stale or []),
        n_finished=int((table["status"] == "finished").sum()) if len(table) else 0,
        n_included=len(analysis.included), excluded=analysis.excluded.to_dict(orient="records"),
        best_measure=best, correlations=corr, table=table, notes=notes,
        seconds=time.perf_counter() - start, warnings=list(endpoint.warnings))
    if quiet:
        best_txt = f"; best: {best} (tau = {_f(corr.iloc[0]['kendall_tau'])})" if best else ""
        echo(f"report: {report_html} ({summary.n_included} of {summary.n_runs} runs used{best_txt})")
        for warning in summary.warnings:
            echo(f"WARNING: {warning}")
    else:
        echo(format_summary(summary, analysis))
    return summary


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


def snapshot_records(records: list[RunRecord]) -> dict[float, list[RunRecord]]:
    """Per train-loss level, each run's snapshot at that level as a record of its own: the run's identity
    and config, the snapshot's accuracies, losses and gaps, and the snapshot's measures."""
    levels: dict[float, list[RunRecord]] = {}
    for rec in records:
        for snap in rec.info.get("snapshots") or []:
            folder = rec.path / str(snap.get("path", ""))
            measures: dict[str, dict[str, Any]] = {}
            problems: list[str] = []
            if (folder / store.MEASURES_JSON).is_file():
                try:
                    measures = {str(k): v for k, v in store.read_json(folder / store.MEASURES_JSON).items()
                                if isinstance(v, dict)}
                except FlatbenchError as exc:
                    problems.append(str(exc))
            info = {**{k: v for k, v in rec.info.items() if k not in ("snapshots", "history")},
                    **{k: snap.get(k) for k in ("train_acc", "train_loss", "test_acc", "test_loss", "gap_acc",
                                                "gap_loss", "epoch")}, "epochs": snap.get("epoch")}
            levels.setdefault(float(snap["level"]), []).append(
                RunRecord(experiment=rec.experiment, run_id=rec.run_id, path=folder, info=info,
                          measures=measures, problems=problems))
    return dict(sorted(levels.items(), reverse=True))


def level_correlations(records: list[RunRecord], gap: str = "acc", n_boot: int = 1000, seed: int = 0,
                       final: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each measure's Kendall τ with the gap at every snapshot level (the models as they were when their
    train loss first reached it), plus the final models' (level "final"). Empty when no run kept snapshots.

    At a level every run is at the same train loss by construction, so no run is excluded for its train
    accuracy there (a run that never reached the level has no snapshot and is simply absent: n says so)."""
    per_level = snapshot_records(records)
    if not per_level:
        return pd.DataFrame()
    rows = []
    cols = ["measure", "kendall_tau", "kendall_tau_lo", "kendall_tau_hi", "kendall_p", "n"]
    for level, recs in per_level.items():
        table = build_table([], records=recs)
        corr = analyze(table, gap=gap, min_train_acc=0.0, n_boot=n_boot, seed=seed).correlations
        for r in corr.to_dict(orient="records"):
            rows.append({"level": level, **{c: r.get(c) for c in cols}})
    if final is not None:
        for r in final.to_dict(orient="records"):
            rows.append({"level": "final", **{c: r.get(c) for c in cols}})
    return pd.DataFrame(rows, columns=["level", *cols])


# ----------------------------------------------------------------------------------------------- figures

def plot_filename(key: str) -> str:
    """A measure key as a portable file name: "@" → "_at_", "/" → "__", anything odd → "_"."""
    name = key.replace("@", "_at_").replace("/", "__")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "measure"


def _draw_figures(analysis: Analysis, plot_dir: Path, records: list[RunRecord] | None = None,
                  levels: pd.DataFrame | None = None) -> list[tuple[str, bytes, str]]:
    """Every figure as (file name, PNG bytes, caption); also written to `plot_dir` (stale PNGs removed)."""
    frame = analysis.included
    corr = analysis.correlations
    keys = corr["measure"].tolist()
    rows = {r["measure"]: r for r in corr.to_dict(orient="records")}
    labels = plots.model_labels(frame)
    gcol, gap = analysis.gap_column, analysis.gap
    out: list[tuple[str, bytes, str]] = [
        ("ranking.png", plots.ranking_figure(corr),
         "Kendall τ of each measure with the gap and its 95% bootstrap interval; best at the top."),
        ("overview.png", plots.overview_figure(frame, keys, gap, gcol, labels, rows),
         "Every measure against the gap (colour: random-label ratio; marker: model)."),
        ("vs_ratio.png", plots.vs_ratio_figure(frame, keys, gap, gcol, labels),
         "The gap and each measure against the random-label ratio (mean ± std over seeds)."),
    ]
    agreement_cols = [gcol, *keys]
    matrix = agreement_matrix(oriented(frame, analysis.larger_is_sharper), agreement_cols)
    matrix = matrix.rename(index={gcol: "gap"}, columns={gcol: "gap"})
    out.append(("agreement.png", plots.agreement_figure(matrix),
                ("Kendall τ between measures over the runs (measures oriented so larger = sharper): "
                "which measures rank the models alike.")))
    if len(analysis.comparisons):
        out.append(("comparisons.png", plots.comparison_figure(analysis.comparisons, keys),
                    "Paired comparison of the measures: τ_row − τ_col over the runs both have, from the same "
                    "bootstrap resamples; cells whose 95% interval contains 0 are marked as not significant."))
    if records:
        included = set(zip(frame["experiment"], frame["run_id"])) if len(frame) else set()
        used_records = [r for r in records if (r.experiment, r.run_id) in included]
        histories = {r.run_id: r.info.get("history") or [] for r in used_records}
        ratios = {r.run_id: (r.info.get("config") or {}).get("data", {}).get("random_label_ratio")
                  for r in used_records}
        if any(histories.values()):
            out.append(("training_curves.png", plots.training_curves_figure(histories, ratios),
                        "Train accuracy (on the labels trained on, left) and test accuracy (right) per epoch: "
                        "the gap at the end is a memorization gap."))
    if levels is not None and len(levels):
        out.append(("tau_by_level.png", plots.tau_by_level_figure(levels),
                    "Kendall τ of each measure with the gap at every train-loss level the runs were "
                    "snapshotted at (and at their final models): how much a verdict depends on how far "
                    "training went."))
    se_cols = stderr_columns(frame) if len(frame) else {}
    used = {name for name, _, _ in out}
    for key in keys:
        name = plot_filename(key) + ".png"
        while name in used:
            name = name[:-4] + "_.png"
        used.add(name)
        out.append((name, plots.measure_figure(frame, key, gap, gcol, labels, rows.get(key),
                                               analysis.larger_is_sharper.get(key, True),
                                               se_column=se_cols.get(key)),
                    f"`{key}` against the gap."))
    plot_dir.mkdir(parents=True, exist_ok=True)
    for name, png, _ in out:
        store.atomic_write_bytes(plot_dir / name, png)
    for stale in plot_dir.glob("*.png"):
        if stale.name not in used:
            stale.unlink()
    return out


# ------------------------------------------------------------------------------------------- formatting

def _f(value: Any, digits: int = 2) -> str:
    v = to_float(value)
    return f"{v:.{digits}f}" if math.isfinite(v) else "n/a"


def _ci(row: Any, stat: str) -> str:
    lo, hi = to_float(row[f"{stat}_lo"]), to_float(row[f"{stat}_hi"])
    if not math.isfinite(to_float(row[stat])):
        return "n/a"
    ci = f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    return f"{to_float(row[stat]):.2f}{ci}"


def _seconds(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    if value < 1:
        return f"{value:.2f} s"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.2f} h"


def _best_measure(corr: pd.DataFrame) -> str | None:
    if len(corr) and math.isfinite(to_float(corr.iloc[0]["kendall_tau"])):
        return str(corr.iloc[0]["measure"])
    return None


def format_summary(summary: ReportSummary, analysis: Analysis | None = None) -> str:
    """The terminal table: aligned plain text (ASCII, survives any cluster log), best measure first."""
    corr = summary.correlations
    gap = corr.attrs.get("gap", "acc")
    lines = [(f"flatbench report: {summary.n_runs} runs, {summary.n_finished} finished, "
             f"{summary.n_included} used, {len(summary.excluded)} excluded "
             f"(gap: {'train acc - test acc' if gap == 'acc' else 'test loss - train loss'})")]
    if len(corr):
        header = ["#", "measure", "n", "tau [95% CI]", "p", "vs best", "rho", "r", "Psi", "CMI"]
        body = []
        marks = {"best": "best", "indistinguishable": "~best", "worse": "worse", "better on shared runs": "better*"}
        for i, row in enumerate(corr.to_dict(orient="records"), 1):
            name = row["measure"] + ("" if row["larger_is_sharper"] else " (-)")
            body.append([str(i), name, str(row["n"]), _ci(row, "kendall_tau"), _p(row.get("kendall_p")),
                         marks.get(str(row.get("vs_best") or ""), ""), _f(row["spearman_rho"]),
                         _f(row["pearson_r"]), _f(row["psi"]), _f(row["cmi"])])
        widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header))]
        left = {1, 3, 5}
        for r in [header, *body]:
            cells = [r[c].ljust(widths[c]) if c in left else r[c].rjust(widths[c]) for c in range(len(r))]
            lines.append("  " + "  ".join(cells).rstrip())
        lines.append("  p: permutation p-value of tau; ~best: indistinguishable from the best (paired bootstrap)")
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


# --------------------------------------------------------------------------------------------- document

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
                s["problem"] = text.splitlines()[0][:160] if text else status
    return [stats[k] for k in sorted(stats)]


def _p(value: Any) -> str:
    v = to_float(value)
    if not math.isfinite(v):
        return "n/a"
    return f"{v:.2g}" if v >= 0.001 else "<0.001"


def _build_document(exp_dirs: list[Path], records: list[RunRecord], table: pd.DataFrame,
                    analysis: Analysis, figures: list[tuple[str, bytes, str]], notes: list[str],
                    best: str | None, n_boot: int, seed: int, min_train_acc: float,
                    endpoint: Endpoint | None = None, levels: pd.DataFrame | None = None,
                    measure_info: dict[str, Any] | None = None) -> Document:
    corr = analysis.correlations
    names = ", ".join(f"`{p.name}`" for p in exp_dirs)
    doc = Document(title=f"flatbench report: {', '.join(p.name for p in exp_dirs)}")
    n_runs = len(table)
    n_finished = int((table["status"] == "finished").sum()) if n_runs else 0
    gap_text = "train accuracy − test accuracy" if analysis.gap == "acc" else "test loss − train loss"

    # Summary -----------------------------------------------------------------------------------------
    doc.add(Heading(2, "Summary", "summary"))
    lines = [f"Experiment folder(s): {names}.",
             (f"{n_runs} runs found, {n_finished} trained (status finished); {len(analysis.included)} used "
             f"in the statistics, {len(analysis.excluded)} excluded (listed below)."),
             (f"Generalization gap: {gap_text}. Runs need train accuracy ≥ {min_train_acc:g} and finite "
             "losses to count."),
             ("Every correlation is oriented so that a positive value means the measure tracks the gap "
             "(measures where a smaller value means sharper are negated).")]
    if best is not None:
        row = corr.iloc[0]
        lines.append(f"Best measure: `{best}` (Kendall τ = {_ci(row, 'kendall_tau')}, n = {row['n']}).")
    doc.add(Bullets(lines))
    if n_runs and table["experiment"].nunique() > 1:
        per = table.groupby("experiment")["status"].agg(
            runs="size", finished=lambda s: int((s == "finished").sum()))
        used = analysis.included.groupby("experiment").size()
        doc.add(Table(["experiment", "runs", "finished", "used"],
                      [[f"`{e}`", str(r.runs), str(r.finished), str(int(used.get(e, 0)))]
                       for e, r in per.iterrows()], [False, True, True, True]))
    if analysis.axes:
        doc.add(Paragraph("Hyperparameter axes that vary: " + ", ".join(f"`{a}`" for a in analysis.axes)
                          + "."))
    if notes:
        doc.add(Bullets([f"Note: {n}" for n in notes]))

    # Training endpoint -------------------------------------------------------------------------------
    if endpoint is not None and len(analysis.included):
        doc.add(Heading(2, "Training endpoint", "endpoint"))
        doc.add(Paragraph(
            f"Final train loss of the runs used: {endpoint.low:.3g} to {endpoint.high:.3g} (a factor of "
            f"{endpoint.span:.3g}). The cross-entropy's curvature shrinks with the loss, so curvature measures are "
            "comparable only between runs that stopped at similar losses (`train.target_train_loss`)."))
        if endpoint.warnings:
            doc.add(Bullets([f"**Warning:** {w}" for w in endpoint.warnings]))
        else:
            doc.add(Paragraph("Every run ended within the report's limits (`report.max_train_loss`, "
                              "`report.max_loss_span`)."))

    # Ranking -----------------------------------------------------------------------------------------
    doc.add(Heading(2, "Ranking", "ranking"))
    min_ci = corr.attrs.get("min_ci_runs", 10)
    doc.add(Paragraph(f"Correlation of each measure with the gap over the runs where it has a value (n). "
                      f"p: two-sided permutation p-value of Kendall τ (exact below 8 runs, else "
                      f"{corr.attrs.get('n_perm', 9999)} seeded permutations). Intervals: 95% percentile "
                      f"bootstrap from {n_boot} resamples of the runs (seed {seed}), given only from {min_ci} runs "
                      "on (below that a bootstrap interval is unreliable and often collapses to a point). "
                      "vs best: the paired bootstrap comparison with the best measure over the runs both have "
                      "(indistinguishable when the interval of the τ difference contains 0, or when there is "
                      "no interval). SE/spread: a Monte-Carlo measure's median standard error over the "
                      "standard deviation of its values. Ψ is Jiang et al.'s granulated Kendall coefficient "
                      "(mean over axes of τ among runs that differ in that axis only); CMI is their conditional "
                      "mutual-information score (sign-agnostic, minimum over conditioning sets)."))
    if len(corr):
        rows = []
        for i, r in enumerate(corr.to_dict(orient="records"), 1):
            rows.append([str(i), f"`{r['measure']}`", "larger" if r["larger_is_sharper"] else "smaller",
                         str(r["n"]), _ci(r, "kendall_tau"), _p(r.get("kendall_p")),
                         str(r.get("vs_best") or "") + (f" (p {_p(r.get('vs_best_p'))})"
                                                        if r.get("vs_best") not in (None, "", "best")
                                                        and math.isfinite(to_float(r.get("vs_best_p"))) else ""),
                         _ci(r, "spearman_rho"), _ci(r, "pearson_r"), _f(r.get("se_ratio")),
                         _f(r["psi"]), _f(r["cmi"]), r["note"] or ""])
        doc.add(Table(["#", "measure", "sharper when", "n", "Kendall τ [95% CI]", "p", "vs best",
                       "Spearman ρ [95% CI]", "Pearson r [95% CI]", "SE/spread", "Ψ", "CMI", "note"], rows,
                      [True, False, False, True, True, True, False, True, True, True, True, True, False]))
        tied = [r["measure"] for r in corr.to_dict(orient="records") if r.get("vs_best") in ("best", "indistinguishable")]
        if best is not None:
            doc.add(Paragraph("Indistinguishable from the best on this study (paired bootstrap): "
                              + ", ".join(f"`{m}`" for m in tied) + "."))
        if analysis.axes:
            doc.add(Heading(3, "Granulated Kendall per axis"))
            headers = ["measure", *[f"ψ `{a}`" for a in analysis.axes], "Ψ", "CMI attained at"]
            doc.add(Table(headers, [[f"`{r['measure']}`", *[_f(r[f"psi_{a}"]) for a in analysis.axes],
                                     _f(r["psi"]), f"`{r['cmi_condition']}`" if r["cmi_condition"] else "n/a"]
                                    for r in corr.to_dict(orient="records")],
                          [False, *[True] * len(analysis.axes), True, False]))
    else:
        doc.add(Paragraph("No measure values were found in these folders (run `flatbench measure` first)."))
    if len(analysis.included) < MIN_RUNS:
        doc.add(Paragraph(f"Correlations need at least {MIN_RUNS} trained runs; this study has "
                          f"{len(analysis.included)}."))

    # By training-loss level ----------------------------------------------------------------------------
    if levels is not None and len(levels):
        doc.add(Heading(2, "Verdict by training-loss level", "levels"))
        doc.add(Paragraph("Each measure's Kendall τ with the gap on the models as they were when their train loss "
                          "first reached each level (`train.snapshot_losses`), and on the final models. n is "
                          "the number of runs that reached the level."))
        order = [str(m) for m in corr["measure"]] if len(corr) else sorted(set(levels["measure"]))
        cols = list(dict.fromkeys(levels["level"].tolist()))
        lookup = {(r["measure"], r["level"]): r for r in levels.to_dict(orient="records")}
        rows = []
        for m in order:
            cells = []
            for lv in cols:
                r = lookup.get((m, lv))
                cells.append("n/a" if r is None else f"{_f(r['kendall_tau'])} (n {r['n']})")
            rows.append([f"`{m}`", *cells])
        doc.add(Table(["measure", *[f"loss ≤ {lv:g}" if lv != "final" else "final" for lv in cols]], rows,
                      [False, *[True] * len(cols)]))

    # Figures ------------------------------------------------------------------------------------------
    doc.add(Heading(2, "Figures", "figures"))
    fixed = {"ranking.png", "overview.png", "vs_ratio.png", "agreement.png", "comparisons.png",
             "training_curves.png", "tau_by_level.png"}
    for name, png, caption in figures:
        if name in fixed:
            doc.add(Image(f"plots/{name}", png, caption))

    # Excluded runs ------------------------------------------------------------------------------------
    doc.add(Heading(2, "Excluded runs", "excluded"))
    if len(analysis.excluded):
        doc.add(Table(["run", "experiment", "status", "reason"],
                      [[f"`{r.run_id}`", f"`{r.experiment}`", str(r.status), str(r.reason)]
                       for r in analysis.excluded.itertuples()]))
    else:
        doc.add(Paragraph("None: every run found was trained and enters the statistics."))

    # Measures and time --------------------------------------------------------------------------------
    doc.add(Heading(2, "Measures and time", "time"))
    train_sec = table["train_seconds"].sum(min_count=1) if n_runs else math.nan
    status = _measure_status(records)
    measure_sec = sum(s["seconds"] for s in status)
    doc.add(Table(["stage", "total time", "runs"],
                  [["training", _seconds(to_float(train_sec)),
                    str(int(table["train_seconds"].notna().sum()) if n_runs else 0)],
                   ["measuring", _seconds(measure_sec),
                    str(sum(1 for r in records if r.measures))]], [False, True, True]))
    if status:
        specs = measure_info or {}
        rows = []
        for s in status:
            spec = specs.get(parse_key(s["entry"]).measure)
            mean = s["seconds"] / s["timed"] if s["timed"] else math.nan
            rows.append([f"`{s['entry']}`", getattr(spec, "description", "") or "(not registered)",
                         getattr(spec, "cost", "") or "", str(s["ok"]), str(s["not_applicable"]),
                         str(s["error"] + s["other"]), _seconds(s["seconds"]), _seconds(mean), s["problem"]])
        doc.add(Table(["measure", "description", "cost", "ok", "not applicable", "failed", "total time",
                       "per run", "first problem"], rows,
                      [False, False, False, True, True, True, True, True, False]))

    # Study config -------------------------------------------------------------------------------------
    doc.add(Heading(2, "Study config", "config"))
    doc.add(Paragraph(f"Report settings: gap = {analysis.gap}, min_train_acc = {min_train_acc:g}, "
                      f"bootstrap resamples = {n_boot}, seed = {seed}."))
    for exp in exp_dirs:
        path = exp / store.STUDY_FILE
        if len(exp_dirs) > 1:
            doc.add(Heading(3, f"`{exp.name}`"))
        if path.is_file():
            doc.add(CodeBlock(path.read_text(encoding="utf-8", errors="replace"), "yaml"))
        else:
            doc.add(Paragraph(f"No `{store.STUDY_FILE}` in `{exp}`; the run configs are in table.csv."))

    # Runs ---------------------------------------------------------------------------------------------
    doc.add(Heading(2, "Runs", "runs"))
    axis_cols = [a for a in analysis.axes if a in table.columns]
    shown = table.head(MAX_RUN_ROWS)
    rows = []
    for _, r in shown.iterrows():
        loss = to_float(r.get("train_loss"))
        rows.append([f"`{r['run_id']}`", str(r["status"]), *[str(r[a]) for a in axis_cols],
                     _f(r["train_acc"], 3), f"{loss:.3g}" if math.isfinite(loss) else "n/a",
                     _f(r["test_acc"], 3), _f(r[analysis.gap_column], 3), _f(r.get("epochs"), 0),
                     {True: "yes", False: "no"}.get(r.get("reached_target"), "-") if not isinstance(
                         r.get("reached_target"), float) else "-",
                     _seconds(to_float(r["train_seconds"]))])
    doc.add(Table(["run", "status", *[f"`{a}`" for a in axis_cols], "train acc", "train loss", "test acc",
                   "gap", "epochs", "target reached", "train time"], rows,
                  [False, False, *[False] * len(axis_cols), True, True, True, True, True, False, True]))
    if n_runs > MAX_RUN_ROWS:
        doc.add(Paragraph(f"First {MAX_RUN_ROWS} of {n_runs} runs; table.csv has all of them."))

    # Per-measure plots --------------------------------------------------------------------------------
    doc.add(Heading(2, "Each measure against the gap", "measures"))
    for name, png, caption in figures:
        if name not in fixed:
            doc.add(Image(f"plots/{name}", png, caption))
    return doc

