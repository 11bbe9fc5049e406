"""The report's detail sections, after the verdict, figures and audit (`sections`): the statistics the
verdict table leaves out (never its τ, interval or label again), τ per training-loss level, the training
endpoint, the runs left out, the measures' status and time, the runs and the study config; last, what the
page's hover says about each run (`hover_runs`)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

from flatbench import store
from flatbench.analysis.document import Bullets, CodeBlock, Details, Document, Heading, Paragraph, Table
from flatbench.analysis.fmt import is_true, num, p_text, seconds_text
from flatbench.analysis.sections import ReportContext
from flatbench.analysis.stats import MIN_CMI_PAIRS, MIN_RUNS
from flatbench.analysis.table import NON_MODEL_FIELDS, to_float
from flatbench.analysis.verdict_block import short_axis
from flatbench.measures.keys import parse_key

MAX_RUN_ROWS = 300
"""The report lists at most this many runs; table.csv always has all of them."""


def _with_p(value: Any, p: Any) -> str:
    """A statistic with its p-value in brackets (the value alone when it has no p)."""
    text = num(value)
    return text if text == "n/a" or not math.isfinite(to_float(p)) else f"{text} (p {p_text(p)})"


def _ranking_text(ctx: ReportContext) -> str:
    corr = ctx.analysis.correlations
    methods = sorted({str(m) for m in corr.get("kendall_p_method", pd.Series(dtype=object)) if str(m)})
    alpha = corr.attrs.get("alpha", 0.05)
    min_ci = corr.attrs.get("min_ci_runs", 10)
    return (f"Correlation of each measure with the gap over the runs where it has a value (n). p: two-sided "
            f"permutation p-value of Kendall τ (here: {'; '.join(methods) if methods else 'none'}; it treats the runs "
            "as exchangeable). Intervals: 95% percentile intervals of the two-way cluster bootstrap, "
            f"{corr.attrs.get('n_boot', ctx.n_boot)} resamples (report seed {ctx.seed}); "
            f"{ctx.analysis.resampling or 'no resampling'} (docs/statistics.md). Given only from {min_ci} runs and "
            f"{min_ci} resampled units on. vs best: the paired comparison of τ with the best measure (same resamples, "
            "Wald test with the bootstrap standard error), Holm-adjusted over all the comparisons with the best "
            f"(family-wise error {alpha:g}): worse, indistinguishable (the data cannot tell them apart), or cannot "
            f"compare; (borderline): the adjusted p is within three Monte-Carlo errors of {alpha:g}, so another "
            "report seed may give the other label. The last rows are the references: `ref.random`, the mean over "
            "pure-noise measures with its 95% band (the floor), and `ref.replicate_gap`, the mean gap of the other "
            "replicates of the same configuration (the ceiling).")


def _reference_records(ctx: ReportContext) -> list[dict[str, Any]]:
    refs = ctx.analysis.references
    return refs.to_dict(orient="records") if refs is not None and len(refs) else []


def _cmi_where(r: dict[str, Any]) -> str:
    cond = str(r.get("cmi_condition") or "")
    if cond in ("", "nan"):
        return "n/a"
    return "no conditioning (unconditional)" if cond == "none" else f"`{cond}`"


def statistics_section(doc: Document, ctx: ReportContext) -> None:
    """What the verdict table leaves out, once per measure (never τ, its interval or the label again):
    the permutation p, ρ and r, psi_data, the ψ p-values, where CMI is attained, the environments, the
    replicate pairs and the Monte-Carlo SE/spread; collapsed, and opened by printing."""
    doc.add(Heading(2, "More statistics", "statistics"))
    corr = ctx.analysis.correlations
    if not len(corr):
        doc.add(Paragraph("No measure values were found in these folders (run `flatbench measure` first)."))
        return
    axes = ctx.analysis.axes
    doc.add(Paragraph(_ranking_text(ctx) + " " + (_design_text(ctx) if axes else "") + " ρ and r with their "
                      "intervals: correlations.csv."))
    doc.add(Paragraph("Replicate pairs: the share of pairs of runs of one configuration (they differ only in their seed "
                      "or data draw) whose measure difference has the gap's sign (0.5 = chance); its p-value only from "
                      "5 data draws on (two-way bootstrap). SE/spread: a Monte-Carlo measure's median standard error "
                      "over the standard deviation of its values."))
    records = corr.to_dict(orient="records") + _reference_records(ctx)
    rows = []
    for r in records:
        psi_p = [p_text(r.get(f"p_psi_holm_{a}") if r.get("kind") != "reference" else r.get(f"p_psi_{a}"))
                 for a in axes]
        rows.append([f"`{r['measure']}`", "larger" if is_true(r.get("larger_is_sharper")) else "smaller",
                     p_text(r.get("kendall_p")), num(r.get("spearman_rho")), num(r.get("pearson_r")),
                     num(r.get("psi_data")), *psi_p, _cmi_where(r), num(r.get("cmi_min_pairs"), 0),
                     f"{r.get('n_environments', 0)} ({r.get('n_environments_small', 0)})",
                     _with_p(r.get("seed_pairs_concordant"), r.get("seed_pairs_p")), str(r.get("n_seed_pairs", 0)),
                     num(r.get("se_ratio"))])
    k = len(axes)
    headers = ["measure", "sharper when", "p (τ)", "Spearman ρ", "Pearson r", "psi_data",
               *[f"p ψ {short_axis(a)}" for a in axes], "CMI attained at", "CMI min pairs", "environments (small)",
               "replicate pairs ordered", "replicate pairs", "SE/ spread"]
    doc.add(Details(f"p, ρ, r, psi_data, the p-value of each ψ, CMI's conditioning, environments and replicate pairs "
                    f"of the {len(corr)} measures and the references", [Table(
                        headers, rows, [False, False, True, True, True, True, *[True] * k, False, True, True, True,
                                        True, True],
                        sortable=True, compact=True,
                        ascending=[False, False, True, False, False, False, *[True] * k, False, False, False, False,
                                   False, False])]))
    if len(ctx.analysis.included) < MIN_RUNS:
        doc.add(Paragraph(f"Correlations need at least {MIN_RUNS} trained runs; this study has "
                          f"{len(ctx.analysis.included)}."))


def _design_text(ctx: ReportContext) -> str:
    analysis, design = ctx.analysis, ctx.analysis.design
    training, data = (design.training_axes, design.data_axes) if design is not None else ([], [])
    return ("ψ per axis: the mean τ over the blocks of runs that share every other axis and the data draw (they "
            "differ in that axis only). Ψ is their mean over the training axes "
            f"({', '.join(f'`{a}`' for a in training) or 'none'}), psi_data over the data axes "
            f"({', '.join(f'`{a}`' for a in data) or 'none'}). The p-value of each ψ comes from "
            f"the two-way bootstrap of its block mean, Holm-adjusted over all {analysis.psi_family} ψ tests of the "
            "study. CMI: the minimum over conditioning sets of at most two axes (never a replicate field) of Jiang "
            f"et al.'s normalized conditional mutual information, given only when every cell holds at least "
            f"{MIN_CMI_PAIRS} pairs of runs. Sign error: Dziugaite et al.'s, mean and worst over the environments with "
            "at least 10 pairs whose gap difference exceeds the replicate noise (0.5 = chance; environments.csv "
            "lists every environment).")


def levels_section(doc: Document, ctx: ReportContext) -> None:
    """τ at each snapshot level: whether a verdict depends on how far training went."""
    levels = ctx.levels
    if levels is None or not len(levels):
        return
    doc.add(Heading(2, "Verdict by training-loss level", "levels"))
    doc.add(Paragraph("Each measure's Kendall τ with the gap on the models as they were when their train loss first "
                      "reached each level (`train.snapshot_losses`), and on the final models. n is the number of "
                      "runs that reached the level. Only the measures computed on snapshots are listed."))
    cols = list(dict.fromkeys(levels["level"].tolist()))
    lookup = {(r["measure"], r["level"]): r for r in levels.to_dict(orient="records")}
    snap = {str(m) for m, lv in zip(levels["measure"], levels["level"]) if lv != "final"}
    order = [str(m) for m in ctx.analysis.correlations["measure"] if str(m) in snap] or sorted(snap)
    rows = []
    for m in order:
        cells = [("n/a" if (r := lookup.get((m, lv))) is None else f"{num(r['kendall_tau'])} (n {r['n']})")
                 for lv in cols]
        rows.append([f"`{m}`", *cells])
    doc.add(Table(["measure", *[f"loss ≤ {lv:g}" if lv != "final" else "final" for lv in cols]], rows,
                  [False, *[True] * len(cols)], sortable=True, compact=True))


def endpoint_section(doc: Document, ctx: ReportContext) -> None:
    """Where the runs stopped: curvature measures compare only between runs at similar train losses."""
    endpoint = ctx.endpoint
    if endpoint is None or not len(ctx.analysis.included):
        return
    doc.add(Heading(2, "Training endpoint", "endpoint"))
    doc.add(Paragraph(
        f"Final train loss of the runs used: {endpoint.low:.3g} to {endpoint.high:.3g} (a factor of {endpoint.span:.3g}). "
        "The cross-entropy's curvature shrinks with the loss, so curvature measures are comparable only between runs "
        "that stopped at similar losses (`train.target_train_loss`)."))
    if endpoint.warnings:
        doc.add(Bullets([f"**Warning:** {w}" for w in endpoint.warnings]))
    else:
        doc.add(Paragraph("Every run ended within the report's limits (`report.max_train_loss`, "
                          "`report.max_loss_span`)."))


def excluded_section(doc: Document, ctx: ReportContext) -> None:
    """Every run left out, with its reason: nothing is dropped silently."""
    doc.add(Heading(2, "Excluded runs", "excluded"))
    excluded = ctx.analysis.excluded
    if len(excluded):
        doc.add(Table(["run", "experiment", "status", "reason"],
                      [[f"`{r.run_id}`", f"`{r.experiment}`", str(r.status), str(r.reason)]
                       for r in excluded.itertuples()]))
    else:
        doc.add(Paragraph("None: every run found was trained and enters the statistics."))


def time_section(doc: Document, ctx: ReportContext) -> None:
    """Each measure's status, cost and time, and its first problem in full (a truncated error is useless)."""
    doc.add(Heading(2, "Measures and time", "time"))
    table, records, status = ctx.table, ctx.records, ctx.status
    n_runs = len(table)
    train_sec = table["train_seconds"].sum(min_count=1) if n_runs else math.nan
    doc.add(Table(["stage", "total time", "runs"],
                  [["training", seconds_text(train_sec), str(int(table["train_seconds"].notna().sum()) if n_runs else 0)],
                   ["measuring", seconds_text(sum(s["seconds"] for s in status)),
                    str(sum(1 for r in records if r.measures))]], [False, True, True]))
    if not status:
        return
    specs = ctx.measure_info or {}
    rows = []
    for s in status:
        spec = specs.get(parse_key(s["entry"]).measure)
        rows.append([f"`{s['entry']}`", ctx.families.get(s["entry"], "other"),
                     getattr(spec, "description", "") or "(not registered)", getattr(spec, "cost", "") or "",
                     str(s["ok"]), str(s["not_applicable"]), str(s["error"] + s["other"]), seconds_text(s["seconds"]),
                     seconds_text(s["seconds"] / s["timed"] if s["timed"] else math.nan)])
    blocks: list[Any] = [Table(["measure", "family", "description", "cost", "ok", "not applicable", "failed",
                                "total time", "per run"], rows,
                               [False, False, False, False, True, True, True, True, True], sortable=True, compact=True)]
    problems = [f"`{s['entry']}`: {s['problem']}" for s in status if s["problem"]]
    if problems:
        blocks += [Paragraph("First problem of each measure that did not give a value on every run:"), Bullets(problems)]
    doc.add(Details(f"Each of the {len(status)} measure entries: description, cost, status, time, first problem",
                    blocks))


def runs_section(doc: Document, ctx: ReportContext) -> None:
    """The runs, each linked to its folder (run.json, measures.json), so a point in a plot can be traced."""
    doc.add(Heading(2, "Runs", "runs"))
    table, axes = ctx.table, [a for a in ctx.analysis.axes if a in ctx.table.columns]
    hrefs = {(rec.experiment, rec.run_id): Path(os.path.relpath(rec.path, ctx.out_dir)).as_posix() + "/"
             for rec in ctx.records}  # the run folder relative to the report (a link, never fetched)
    rows = []
    for _, r in table.head(MAX_RUN_ROWS).iterrows():
        loss = to_float(r.get("train_loss"))
        reached = r.get("reached_target")
        href = hrefs.get((r["experiment"], r["run_id"]))
        rows.append([f"[{r['run_id']}]({href})" if href else f"`{r['run_id']}`", str(r["status"]),
                     *[str(r[a]) for a in axes], num(r["train_acc"], 3), f"{loss:.3g}" if math.isfinite(loss) else "n/a",
                     num(r["test_acc"], 3), num(r[ctx.analysis.gap_column], 3), num(r.get("epochs"), 0),
                     {True: "yes", False: "no"}.get(reached, "-") if not isinstance(reached, float) else "-",
                     seconds_text(r["train_seconds"])])
    doc.add(Details(f"The {len(rows)} runs, each linked to its folder", [
        Table(["run (folder)", "status", *[f"`{a}`" for a in axes], "train acc", "train loss", "test acc", "gap",
               "epochs", "target reached", "train time"], rows,
              [False, False, *[False] * len(axes), True, True, True, True, True, False, True], sortable=True,
              compact=True)]))
    if len(table) > MAX_RUN_ROWS:
        doc.add(Paragraph(f"First {MAX_RUN_ROWS} of {len(table)} runs; table.csv has all of them."))


def config_section(doc: Document, ctx: ReportContext) -> None:
    """The saved study config, so that the report says exactly what was run."""
    doc.add(Heading(2, "Study config", "config"))
    doc.add(Paragraph(f"Report settings: gap = {ctx.analysis.gap}, min_train_acc = {ctx.min_train_acc:g}, bootstrap "
                      f"resamples = {ctx.n_boot}, seed = {ctx.seed}."))
    for exp in ctx.exp_dirs:
        path = exp / store.STUDY_FILE
        if len(ctx.exp_dirs) > 1:
            doc.add(Heading(3, f"`{exp.name}`"))
        if path.is_file():
            doc.add(Details(f"`{exp.name}/{store.STUDY_FILE}`",
                            [CodeBlock(path.read_text(encoding="utf-8", errors="replace"), "yaml")]))
        else:
            doc.add(Paragraph(f"No `{store.STUDY_FILE}` in `{exp}`; the run configs are in table.csv."))


HOVER_ALWAYS = ("model.name", "data.dataset", "data.random_label_ratio", "seed")


def hover_runs(ctx: ReportContext) -> list[dict[str, Any]]:
    """What the page's hover says about each run used (in the order of the scatter grids' run indices):
    id, gap, and its configuration: the model, dataset, ratio and seed, then every config field that
    differs between the runs (the swept axes, data draws, ...), each once."""
    frame = ctx.analysis.included
    config = [c for c in frame.columns if c == "seed" or c.split(".", 1)[0] in ("data", "model", "train")]
    varying = [c for c in config if c not in NON_MODEL_FIELDS and frame[c].astype(str).nunique() > 1]
    cols = list(dict.fromkeys([c for c in (*HOVER_ALWAYS, *ctx.analysis.axes, *varying) if c in frame.columns]))
    out = []
    for _, r in frame.iterrows():
        gap = to_float(r.get(ctx.analysis.gap_column))
        fields = [[c, str(r[c])] for c in cols]
        out.append({"id": str(r["run_id"]), "gap": gap if math.isfinite(gap) else None, "fields": fields})
    return out
