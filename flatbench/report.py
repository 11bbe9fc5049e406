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
    measure_specs,
    oriented,
)
from flatbench.analysis.table import RunRecord, build_table, load_records, to_float
from flatbench.errors import FlatbenchError

__all__ = ["ReportSummary", "build_table", "correlations", "format_summary", "report_study", "write_report"]

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


def report_study(exp_dirs: list[Path], out_dir: Path | None = None, gap: str | None = None,
                 min_train_acc: float | None = None, include_stale: bool | None = None,
                 echo: Callable[[str], Any] = print, quiet: bool = False) -> ReportSummary:
    """The report stage over experiment folders, as `flatbench report` runs it.

    Each folder's saved study (study.yaml) says which runs are the study's now: run folders left by an
    earlier version of its config are listed as not in this study and left out (`include_stale` counts
    them). Settings default to the first folder's `report` section. Everything is checked before anything
    is written: the folders, the settings, the output folder, damaged files (refused, so that a report is
    never silently built from half a study) and that some run can be used (a good report is never
    replaced by an empty one).
    """
    from dataclasses import replace

    from flatbench.config import ReportConfig
    from flatbench.errors import ConfigError
    from flatbench.study import check_output_dir, read_saved_study

    exp_dirs = [Path(p) for p in exp_dirs]
    cfg: ReportConfig | None = None
    current: dict[Path, set[str] | None] = {}
    for path in exp_dirs:
        if not path.exists():
            raise FlatbenchError(f"experiment folder {path} does not exist")
        if not path.is_dir():
            raise FlatbenchError(f"{path} is a file, not an experiment folder")
        if (path / store.STUDY_FILE).is_file():
            study = read_saved_study(path)
            current[path] = set(study.run_ids())
            cfg = cfg or study.report
        elif (path / store.RUNS_DIR).is_dir():
            current[path] = None  # no saved study: every run folder counts
        else:
            raise FlatbenchError(f"{path} is not a flatbench experiment folder (no {store.STUDY_FILE} and no "
                                 f"{store.RUNS_DIR}/ inside)")
    cfg = cfg or ReportConfig()
    if gap is not None:
        cfg = replace(cfg, gap=gap)
    if min_train_acc is not None:
        if not 0.0 <= min_train_acc <= 1.0:
            raise ConfigError(f"--min-train-acc must be a train accuracy in [0, 1], got {min_train_acc:g}")
        cfg = replace(cfg, min_train_acc=min_train_acc)
    if include_stale is not None:
        cfg = replace(cfg, include_stale=include_stale or cfg.include_stale)
    out = check_output_dir(out_dir or exp_dirs[0], "report folder")
    records = load_records(exp_dirs)
    damaged = [problem for rec in records for problem in rec.problems]
    if damaged:
        raise FlatbenchError(f"{len(damaged)} damaged file(s), e.g. {damaged[0]}: run `flatbench measure` on the "
                             "experiment to repair measures.json files (their readable entries are kept), or "
                             "move the damaged run away; the report was not written")
    stale = []
    if not cfg.include_stale:
        stale = [rec for rec in records if current.get(rec.path.parent.parent) is not None
                 and rec.run_id not in current[rec.path.parent.parent]]
        records = [rec for rec in records if rec not in stale]
    echo(f"building the report from {len(records)} runs"
         + (f" ({len(stale)} left out as not in this study)" if stale else "") + " ...")
    return write_report(exp_dirs, out, gap=cfg.gap, min_train_acc=cfg.min_train_acc, quiet=quiet, echo=echo,
                        records=records, stale=stale, report_cfg=cfg)


def write_report(exp_dirs: list[Path] | list[str], out_dir: Path | str, gap: str = "acc",
                 min_train_acc: float = 0.0, quiet: bool = False, echo: Callable[[str], Any] = print,
                 n_boot: int = 1000, seed: int = 0, records: list[RunRecord] | None = None,
                 stale: list[RunRecord] | None = None, report_cfg: Any = None) -> ReportSummary:
    """Read the experiment folders (or use `records`), compute the statistics, write every report file,
    print the ranking. `stale` runs are listed as not in this study.

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
    notes = list(analysis.notes)
    corr = analysis.correlations

    out_dir.mkdir(parents=True, exist_ok=True)
    table_csv = out_dir / "table.csv"
    corr_csv = out_dir / "correlations.csv"
    store.atomic_write_text(table_csv, table.to_csv(index=False))
    store.atomic_write_text(corr_csv, corr.to_csv(index=False))

    figures = _draw_figures(analysis, out_dir / "plots")

    best = _best_measure(corr)
    doc = _build_document(exp_dirs, records, table, analysis, figures, notes, best, n_boot, seed,
                          min_train_acc)
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
        seconds=time.perf_counter() - start)
    if quiet:
        best_txt = f"; best: {best} (tau = {_f(corr.iloc[0]['kendall_tau'])})" if best else ""
        echo(f"report: {report_html} ({summary.n_included} of {summary.n_runs} runs used{best_txt})")
    else:
        echo(format_summary(summary, analysis))
    return summary


# ----------------------------------------------------------------------------------------------- figures

def plot_filename(key: str) -> str:
    """A measure key as a portable file name: "@" → "_at_", "/" → "__", anything odd → "_"."""
    name = key.replace("@", "_at_").replace("/", "__")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "measure"


def _draw_figures(analysis: Analysis, plot_dir: Path) -> list[tuple[str, bytes, str]]:
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
    used = {name for name, _, _ in out}
    for key in keys:
        name = plot_filename(key) + ".png"
        while name in used:
            name = name[:-4] + "_.png"
        used.add(name)
        out.append((name, plots.measure_figure(frame, key, gap, gcol, labels, rows.get(key),
                                               analysis.larger_is_sharper.get(key, True)),
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
        header = ["#", "measure", "n", "tau [95% CI]", "rho", "r", "Psi", "CMI"]
        body = []
        for i, row in enumerate(corr.to_dict(orient="records"), 1):
            name = row["measure"] + ("" if row["larger_is_sharper"] else " (-)")
            body.append([str(i), name, str(row["n"]), _ci(row, "kendall_tau"), _f(row["spearman_rho"]),
                         _f(row["pearson_r"]), _f(row["psi"]), _f(row["cmi"])])
        widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header))]
        left = {1, 3}
        for r in [header, *body]:
            cells = [r[c].ljust(widths[c]) if c in left else r[c].rjust(widths[c]) for c in range(len(r))]
            lines.append("  " + "  ".join(cells).rstrip())
        if any(not v for v in corr["larger_is_sharper"]):
            lines.append("  (-) smaller value = sharper: negated, so tau > 0 always means 'tracks the gap'")
    else:
        lines.append("  no measure values found")
    for ex in summary.excluded[:10]:
        lines.append(f"  excluded {ex['run_id']}: {ex['reason']}")
    if len(summary.excluded) > 10:
        lines.append(f"  ... and {len(summary.excluded) - 10} more excluded runs (see the report)")
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


def _registry_info() -> dict[str, Any]:
    try:
        return measure_specs()
    except Exception:  # noqa: BLE001 - the stats already noted a broken registry
        return {}


def _build_document(exp_dirs: list[Path], records: list[RunRecord], table: pd.DataFrame,
                    analysis: Analysis, figures: list[tuple[str, bytes, str]], notes: list[str],
                    best: str | None, n_boot: int, seed: int, min_train_acc: float) -> Document:
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

    # Ranking -----------------------------------------------------------------------------------------
    doc.add(Heading(2, "Ranking", "ranking"))
    doc.add(Paragraph(f"Correlation of each measure with the gap over the runs where it has a value (n); "
                      f"95% percentile-bootstrap intervals from {n_boot} resamples of the runs (seed "
                      f"{seed}). Ψ is Jiang et al.'s granulated Kendall coefficient (mean over axes of τ "
                      "among runs that differ in that axis only); CMI is their conditional "
                      "mutual-information score (sign-agnostic, minimum over conditioning sets)."))
    if len(corr):
        rows = []
        for i, r in enumerate(corr.to_dict(orient="records"), 1):
            rows.append([str(i), f"`{r['measure']}`", "larger" if r["larger_is_sharper"] else "smaller",
                         str(r["n"]), _ci(r, "kendall_tau"), _ci(r, "spearman_rho"), _ci(r, "pearson_r"),
                         _f(r["psi"]), _f(r["cmi"]), r["note"] or ""])
        doc.add(Table(["#", "measure", "sharper when", "n", "Kendall τ [95% CI]", "Spearman ρ [95% CI]",
                       "Pearson r [95% CI]", "Ψ", "CMI", "note"], rows,
                      [True, False, False, True, True, True, True, True, True, False]))
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

    # Figures ------------------------------------------------------------------------------------------
    doc.add(Heading(2, "Figures", "figures"))
    fixed = {"ranking.png", "overview.png", "vs_ratio.png", "agreement.png"}
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
        specs = _registry_info()
        rows = []
        for s in status:
            spec = specs.get(s["entry"].split("@", 1)[0])
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
        rows.append([f"`{r['run_id']}`", str(r["status"]), *[str(r[a]) for a in axis_cols],
                     _f(r["train_acc"], 3), _f(r["test_acc"], 3), _f(r[analysis.gap_column], 3),
                     _seconds(to_float(r["train_seconds"]))])
    doc.add(Table(["run", "status", *[f"`{a}`" for a in axis_cols], "train acc", "test acc", "gap",
                   "train time"], rows,
                  [False, False, *[False] * len(axis_cols), True, True, True, True]))
    if n_runs > MAX_RUN_ROWS:
        doc.add(Paragraph(f"First {MAX_RUN_ROWS} of {n_runs} runs; table.csv has all of them."))

    # Per-measure plots --------------------------------------------------------------------------------
    doc.add(Heading(2, "Each measure against the gap", "measures"))
    for name, png, caption in figures:
        if name not in fixed:
            doc.add(Image(f"plots/{name}", png, caption))
    return doc

