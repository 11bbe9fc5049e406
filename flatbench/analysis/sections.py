"""The report document, one function per section, in reading order: what was studied (summary), what it
says (verdict), what it looks like (figures), whether it survives reparametrization (audit); the
details follow in `sections_detail`. Every section reads a `ReportContext` and adds blocks to the
document; none computes statistics (they are in `analysis.stats`, computed once by `write_report`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from flatbench.analysis.audit_digest import Audit, delta_text, verdict_of
from flatbench.analysis.audit_models import per_model_deltas
from flatbench.analysis.document import Bullets, Details, Document, Heading, Image, Paragraph, Table
from flatbench.analysis.families import family_rank
from flatbench.analysis.figures import FigureEntry
from flatbench.analysis.fmt import is_true, num
from flatbench.analysis.stats import MIN_CI_RUNS, Analysis
from flatbench.analysis.table import RunRecord, to_float
from flatbench.analysis.verdict import Verdict, pooled_models


@dataclass
class ReportContext:
    """Everything the sections read: the inputs, the analysis and the figures, computed once."""

    exp_dirs: list[Path]
    out_dir: Path
    records: list[RunRecord]
    table: pd.DataFrame
    analysis: Analysis
    figures: list[FigureEntry]
    verdict: Verdict
    audits: list[Audit]
    families: dict[str, str]
    status: list[dict[str, Any]]
    n_boot: int
    seed: int
    min_train_acc: float
    endpoint: Any = None
    levels: pd.DataFrame | None = None
    measure_info: dict[str, Any] | None = None

    def figure(self, name: str) -> FigureEntry | None:
        return next((f for f in self.figures if f.name == name), None)


PRINT_FULL: tuple[str, ...] = ()
"""Figures too tall to read at the print sheet's figure height: printed up to a page tall."""


def image(fig: FigureEntry) -> Image:
    """A figure as a document image (its hover data travels with it)."""
    return Image(f"plots/{fig.name}", fig.png, fig.caption, fig.width, fig.height, fig.hover,
                 css="full" if fig.name in PRINT_FULL else "")


def best_group_text(corr: pd.DataFrame) -> str:
    """The best group in one sentence: the best, the measures not shown worse, the borderline ones."""
    rows = corr.to_dict(orient="records")
    group = [r["measure"] for r in rows if r.get("vs_best") in ("best", "indistinguishable")]
    cannot = [r["measure"] for r in rows if r.get("vs_best") == "cannot compare"]
    border = [r["measure"] for r in rows if is_true(r.get("vs_best_borderline"))]
    text = ("Best group (not shown worse than the best after Holm's correction over "
            f"{sum(1 for r in rows if math.isfinite(to_float(r.get('vs_best_p_holm'))))} comparisons): "
            + ", ".join(f"`{m}`" for m in group) + ".")
    if cannot:
        text += " Cannot compare with the best (too few shared runs): " + ", ".join(f"`{m}`" for m in cannot) + "."
    if border:
        text += " Borderline (another report seed may label them differently): " + ", ".join(
            f"`{m}`" for m in border) + "."
    return text


def _best_lines(ctx: ReportContext) -> list[str]:
    corr, verdict = ctx.analysis.correlations, ctx.verdict
    if not verdict.rows:
        return ["No measure has a τ with the gap (see the verdict section for why)."]
    lines = []
    if verdict.can_compare:
        lines.append(best_group_text(corr))
    else:
        lines.append(f"With {verdict.n_runs} runs (fewer than {MIN_CI_RUNS}) no measure can be compared with the best "
                     "one, and τ has no interval: judge each τ by its permutation p-value.")
    return lines


def summary_section(doc: Document, ctx: ReportContext) -> None:
    """What was studied and the answer in two lines, so that a reader who stops here has the verdict."""
    a, table = ctx.analysis, ctx.table
    n_runs = len(table)
    n_finished = int((table["status"] == "finished").sum()) if n_runs else 0
    gap_text = "train accuracy − test accuracy" if a.gap == "acc" else "test loss − train loss"
    doc.add(Heading(2, "Summary", "summary"))
    lines = [f"Experiment folder(s): {', '.join(f'`{p.name}`' for p in ctx.exp_dirs)}.",
             (f"{n_runs} runs found, {n_finished} trained (status finished); {len(a.included)} used in the "
              f"statistics, {len(a.excluded)} excluded (listed below)."),
             (f"Generalization gap: {gap_text}. Runs need train accuracy ≥ {ctx.min_train_acc:g} and finite losses "
              "to count. Every correlation is oriented so that a positive value means the measure tracks the gap "
              "(measures where a smaller value means sharper are negated, marked (−))."),
             *_best_lines(ctx)]
    if ctx.endpoint is not None:
        lines += [f"**Warning:** {w}" for w in ctx.endpoint.warnings]
    lines += [f"Note: {n}" for n in ctx.analysis.notes]
    doc.add(Bullets(lines))
    links = ["[table.csv](table.csv) (one row per run)", "[correlations.csv](correlations.csv) (every statistic)",
             "[comparisons.csv](comparisons.csv) (paired comparisons)"]
    folders = sorted({Path(os.path.relpath(rec.path.parent, ctx.out_dir)).as_posix() for rec in ctx.records})
    links += [f"[{f}/]({f}/) (the run folders)" for f in folders[:4]]
    doc.add(Paragraph("Files: " + ", ".join(links) + "."))
    if n_runs and table["experiment"].nunique() > 1:
        per = table.groupby("experiment")["status"].agg(runs="size", finished=lambda s: int((s == "finished").sum()))
        used = a.included.groupby("experiment").size()
        doc.add(Table(["experiment", "runs", "finished", "used"],
                      [[f"`{e}`", str(r.runs), str(r.finished), str(int(used.get(e, 0)))] for e, r in per.iterrows()],
                      [False, True, True, True]))
    if a.axes:
        doc.add(Paragraph("Hyperparameter axes that vary: " + ", ".join(f"`{x}`" for x in a.axes) + "."))


def figures_section(doc: Document, ctx: ReportContext) -> None:
    """The figures in reading order, then the scatter grids by family (the comparison matrix only where
    there are intervals: below 10 runs every cell would say "not significant")."""
    doc.add(Heading(2, "Figures", "figures"))
    design = [f for f in ctx.figures if f.group == "design"]
    if design:
        doc.add(Paragraph(f"The design: the gap and the leading measures against each of the {len(design)} swept axes "
                          "(in the HTML page a select chooses the axis; printed, every axis is shown)."))
        for fig in design:
            doc.add(Image(f"plots/{fig.name}", fig.png, fig.caption, fig.width, fig.height, fig.hover, css="facet",
                          key=fig.title))
    for name in ("ranking.png", "vs_ratio.png", "agreement.png", "comparisons.png", "sign_errors.png",
                 "training_curves.png", "tau_by_level.png"):
        fig = ctx.figure(name)
        if fig is not None:
            doc.add(image(fig))
        elif name == "comparisons.png" and len(ctx.analysis.included) < MIN_CI_RUNS:
            doc.add(Paragraph(f"No paired comparisons: with fewer than {MIN_CI_RUNS} runs no pair of measures has an "
                              "interval for its difference."))
    doc.add(Heading(2, "Each measure against the gap", "measures"))
    grids = [f for f in ctx.figures if f.group == "scatter"]
    doc.add(Paragraph("Colour: random-label ratio; marker: model; (−): smaller values are the sharper ones; grey "
                      "bars: ±1 Monte-Carlo standard error where the measure records one. In the HTML page, the "
                      "pointer over a point shows its run."
                      if grids else "No measure has a finite value."))
    for fig in grids:
        doc.add(image(fig))


def _audit_table(audit: Audit) -> Table:
    frame = audit.frame
    rows = []
    for r in frame.to_dict(orient="records"):
        rng = "not recorded" if not math.isfinite(to_float(r.get("max_factor"))) else f"[1/{r['max_factor']:g}, " \
              f"{r['max_factor']:g}]"
        after = num(r.get("tau_mean")) if math.isfinite(to_float(r.get("tau_mean"))) else "n/a"
        rows.append([f"`{r['measure']}`", str(r["family"]), "yes" if is_true(r.get("declared_invariant")) else "no",
                     rng, str(int(to_float(r.get("n")) or 0)), num(r.get("tau_original")), after, delta_text(r),
                     verdict_of(r)])
    return Table(["measure", "rescaling", "declared invariant", "factor range", "n", "τ before", "τ after (mean)",
                  "Δτ (mean [min, max])", "invariance"], rows, [False, False, False, False, True, True, True, True, False],
                 sortable=True, compact=True)


def _audit_by_family(ctx: ReportContext, audit: Audit) -> Table:
    """Per measure family: how many measures the audit covered, which held or broke what they declare."""
    counts: dict[str, dict[str, Any]] = {}
    for r in audit.frame.to_dict(orient="records"):
        fam = ctx.families.get(str(r["measure"]), "other")
        c = counts.setdefault(fam, {"measures": set(), "holds": 0, "breaks": 0, "moves": 0, "unchanged": 0, "n/a": 0,
                                    "worst": math.nan})
        c["measures"].add(r["measure"])
        c[verdict_of(r)] += 1
        d = to_float(r.get("delta_absmax"))
        if math.isfinite(d) and not d <= to_float(c["worst"]):
            c["worst"] = d
    rows = [[fam, str(len(c["measures"])), str(c["holds"]), str(c["breaks"]), str(c["moves"]), str(c["unchanged"]),
             str(c["n/a"]), num(c["worst"], 3)] for fam, c in sorted(counts.items(), key=lambda kv: family_rank(kv[0]))]
    return Table(["measure family", "measures", "holds", "breaks", "moves", "unchanged", "n/a", "largest |Δτ|"], rows,
                 [False, *[True] * 7])


def _per_model_table(ctx: ReportContext, audit: Audit) -> Table | None:
    """Δτ per model next to the pooled Δτ, where the study pools models (`audit_models`)."""
    models = pooled_models(ctx.analysis.included)
    if models is None or len(ctx.exp_dirs) != 1:
        return None
    mapping = dict(zip(ctx.analysis.included["run_id"].astype(str), models))
    folder = ctx.exp_dirs[0] / Path(audit.where).parent
    frame = per_model_deltas(folder, mapping, ctx.analysis.larger_is_sharper)
    if not len(frame):
        return None
    names = sorted(set(frame["model"]))
    lookup = {(r["measure"], r["max_factor"], r["model"]): r for r in frame.to_dict(orient="records")}
    rows = []
    for r in audit.frame.to_dict(orient="records"):
        factor = to_float(r.get("max_factor"))
        cells = [f"`{r['measure']}`", f"[1/{factor:g}, {factor:g}]" if math.isfinite(factor) else "n/a",
                 delta_text(r)]
        for m in names:
            hit = lookup.get((str(r["measure"]), factor, m))
            cells.append("n/a" if hit is None or not math.isfinite(to_float(hit["delta_mean"])) else
                         f"{hit['delta_mean']:+.3f} (max {hit['delta_absmax']:.3f}, n {hit['n']})")
        rows.append(cells)
    return Table(["measure", "factor range", "pooled Δτ", *[f"Δτ `{m}`" for m in names]], rows,
                 [False, False, True, *[True] * len(names)], sortable=True, compact=True)


def audit_section(doc: Document, ctx: ReportContext) -> None:
    """Every rescaling audit found: a verdict on invariance belongs next to the verdict on the gap."""
    doc.add(Heading(2, "Rescaling audit", "audit"))
    if not ctx.audits:
        doc.add(Paragraph("No rescaling audit in this folder: `flatbench audit EXPERIMENT --population` writes one "
                          "(audit_correlations.csv), and the next report shows it here."))
        return
    doc.add(Paragraph("τ with the gap before and after function-preserving transformations of every run "
                      "(`flatbench audit EXPERIMENT --population`). Δτ = τ after − τ before, mean and range over the "
                      "draws; n: runs per draw; invariance: holds or breaks for a declared invariance (|Δτ| ≤ 1e-12), "
                      "moves or unchanged for an undeclared one; n/a where no transformed value exists (never 0). "
                      "Counts per measure family are per (measure, factor range)."))
    figures = {f.title: f for f in ctx.figures if f.group == "audit"}
    for audit in ctx.audits:
        doc.add(Heading(3, f"`{audit.where}`: {audit.describe()}"))
        doc.add(_audit_by_family(ctx, audit))
        doc.add(Details(f"Every measure of this audit ({len(audit.frame)} rows: τ before and after, Δτ, n, invariance)",
                        [_audit_table(audit)]))
        per_model = _per_model_table(ctx, audit)
        if per_model is not None:
            doc.add(Details(f"Δτ within each model ({', '.join(f'`{m}`' for m in ctx.verdict.models)}): the pooled "
                            "Δτ can come from a rescaling moving one model's values as a block", [per_model]))
        if audit.where in figures:
            doc.add(image(figures[audit.where]))
