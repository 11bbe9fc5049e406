"""The verdict block: the first screen of a report.

One sentence on the design (which axes vary, and what τ therefore measures), one headline that names
the criterion behind each "best" (pooled τ, Ψ within the design, sign error), then ONE table: per measure
τ with its interval, its label against the best, Ψ, ψ per axis as a strip of cells coloured on a
diverging map centred at 0, CMI, Dziugaite et al.'s sign error (mean and worst environment), what the
rescaling audit measured, and τ within each model where models are pooled. The floor and ceiling
(`ref.random`, `ref.replicate_gap`) are rows of their own below the sorted ones. Each note of the
statistics is listed once, with the measures it concerns, under the table.

Before any ranking the headline names three things: its target, its blocking, its baseline (issue 42).

Why. A referee recomputing the natural study found the headline ranked measures on the loss gap while the
text read like the accuracy gap; that 58% of the accuracy gap's variance was a per-draw offset shared by
every configuration of a draw (so a pooled τ partly scored that offset); and that a lookup of the
configurations' gaps beat the best measure. So the headline says which gap is the target (`target_text`),
that τ compares runs within a data draw and how large the draw offset is (`blocking_text`, from
`stats.anova`), and how the measures stand against `ref.hyperparameters` (`baseline_text`, the rule of
`stats.baselines`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import to_hex

from flatbench.analysis.audit_digest import measured_text
from flatbench.analysis.document import Bullets, Document, Heading, Paragraph, Table
from flatbench.analysis.fmt import ci_text, is_true, num, p_text
from flatbench.analysis.plots.common import DIVERGING
from flatbench.analysis.stats import MIN_CI_RUNS
from flatbench.analysis.table import RATIO_COLUMN, to_float
from flatbench.analysis.stats.baselines import HYPERPARAMETERS
from flatbench.analysis.verdict import MODEL_FIELDS, Row, Verdict

ALPHA = 0.05
SHORT = {RATIO_COLUMN: "ratio", "experiment": "folder", "model.name": "model", "data.dataset": "dataset"}


def target_text(gap: str) -> str:
    if gap == "acc":
        return "the accuracy gap (train accuracy − test accuracy)"
    if gap == "calibrated":
        return ("the temperature-calibrated loss gap (test − train cross-entropy of the logits divided by the "
                "temperature that minimizes the test cross-entropy, cross-fitted on the test set's halves)")
    return "the loss gap (test cross-entropy − train cross-entropy)"


def n_draws(analysis: Any) -> int:
    design = getattr(analysis, "design", None)
    return design.n_draws if design is not None else 1


def tau_name(analysis: Any) -> str:
    """What the headline τ is called: "τ within draws" when the study has several draws, else "τ"."""
    return "τ within draws" if n_draws(analysis) > 1 else "τ"


def variance_text(variance: pd.DataFrame) -> str:
    """"the draw's main effect is 0.9% of the variance; the configurations' partial ω² 0.88 (F 39.8, df 107,
    428)" from variance.csv's rows."""
    if variance is None or not len(variance):
        return ""
    rows = variance.set_index("effect")
    parts = []
    if "draw" in rows.index and to_float(rows.at["draw", "df"]) > 0:
        parts.append(f"the draw's main effect is {100 * to_float(rows.at['draw', 'share']):.1f}% of the gap's variance")
    if "cell" in rows.index and math.isfinite(to_float(rows.at["cell", "F"])):
        block = " with draws as a block" if parts else ""
        parts.append(f"the configurations' partial ω²{block} is {num(rows.at['cell', 'partial_omega2'])} (F "
                     f"{to_float(rows.at['cell', 'F']):.2f}, df {int(rows.at['cell', 'df'])}, "
                     f"{int(rows.at['residual', 'df'])})")
    return "; ".join(parts)


def blocking_text(analysis: Any) -> str:
    d = n_draws(analysis)
    decomposition = variance_text(getattr(analysis, "variance", None))
    tail = f" (gap ~ draw + configuration: {decomposition}; variance.csv)" if decomposition else ""
    if d <= 1:
        return f"**Blocking:** one data draw, so τ compares every pair of runs{tail}."
    return (f"**Blocking:** τ compares runs within each of the {d} data draws (pairs of one draw, pooled over "
            f"the draws), because every configuration of a draw shares that draw's offset of the gap{tail}; the "
            "pooled τ over all pairs is the second τ column.")


def baseline_text(analysis: Any, rows: list[dict[str, Any]]) -> str:
    """The baseline's τ and how many measures beat it (`stats.baselines`: the interval of τ − τ_baseline
    above 0)."""
    refs = getattr(analysis, "references", None)
    if refs is None or not len(refs) or HYPERPARAMETERS not in set(refs["measure"]):
        return ""
    base = refs[refs["measure"] == HYPERPARAMETERS].iloc[0].to_dict()
    if not math.isfinite(to_float(base.get("kendall_tau"))):
        return f"**Baseline:** `{HYPERPARAMETERS}` has no τ here ({str(base.get('note') or '').split('; ')[0]})."
    how = "in the other data draws" if n_draws(analysis) > 1 else "over its other runs (one data draw)"
    beats = [r["measure"] for r in rows if bool(r.get("beats_hyperparameters"))]
    above = [r["measure"] for r in rows if to_float(r.get("vs_hyperparameters")) > 0 and r["measure"] not in beats]
    named = f" ({', '.join(f'`{m}`' for m in beats)})" if beats else ""
    more = f"; {len(above)} more above it within noise" if above else ""
    return (f"**Baseline:** `{HYPERPARAMETERS}` (each run's configuration's mean gap {how}) scores "
            f"{tau_name(analysis)} {ci_text(base, 'kendall_tau')}; {len(beats)} of {len(rows)} measures beat it "
            f"(95% interval of τ − τ_baseline above 0){named}{more}.")


def beats_cell(stats: dict[str, Any]) -> str:
    """"beats +0.12" / "no −0.05": the label and Δτ against ref.hyperparameters ("" without a comparison); its
    interval is in correlations.csv (`vs_hyperparameters_lo`, `_hi`), kept out of the cell so that the verdict
    table fits a 1440 px screen."""
    diff = to_float(stats.get("vs_hyperparameters"))
    if not math.isfinite(diff):
        return ""
    return f"{'beats' if bool(stats.get('beats_hyperparameters')) else 'no'} {'+' if diff >= 0 else ''}{num(diff)}"


def short_axis(axis: str) -> str:
    """`data.random_label_ratio` → ratio, `train.lr` → lr, `model.widths` → widths."""
    return SHORT.get(axis, axis.rsplit(".", 1)[-1])


def signed_color(value: Any) -> str:
    """A light background for a value in [−1, 1] on the diverging map ("" for none)."""
    v = to_float(value)
    if not math.isfinite(v):
        return ""
    rgba = colormaps[DIVERGING](0.5 + 0.5 * max(-1.0, min(1.0, v)) * 0.8)
    return to_hex(rgba)


def _values(frame: pd.DataFrame, axis: str) -> int:
    return int(frame[axis].astype(str).nunique()) if axis in frame.columns else 0


def design_sentence(ctx: Any) -> str:
    """Which axes vary, and what τ measures therefore."""
    a, frame, models = ctx.analysis, ctx.analysis.included, ctx.verdict.models
    swept = [x for x in a.axes if x not in MODEL_FIELDS]
    within = (f", within each of {len(models)} models pooled here ({', '.join(f'`{m}`' for m in models)}; τ per "
              "model in the last columns)") if models else ""
    head = f"**Design:** {len(frame)} runs used"
    if swept == [RATIO_COLUMN]:
        return (f"{head}; only the random-label ratio varies here ({_values(frame, RATIO_COLUMN)} values, besides "
                f"the seed{within}): τ measures monotonicity in label noise, not how a measure follows "
                "hyperparameters (ψ ratio is τ within one model and data draw).")
    if not swept:
        return f"{head}; no hyperparameter varies{within}: τ compares replicates that differ only in their seed."
    listed = ", ".join(f"`{x}` ({_values(frame, x)} values)" for x in swept)
    return (f"{head}; {len(swept)} axes vary: {listed}{within}. τ pools all of them; ψ per axis (the coloured "
            "strip) is τ among runs that differ in that axis only, Ψ the mean ψ over the training axes: a measure "
            "can reach a high τ by following one axis while ranking another the wrong way.")


def _psi_flags(stats: Mapping[str, Any], axes: list[str], reference: bool = False) -> list[str]:
    """"`n_train` −0.72" for each ψ below 0 beyond noise (Holm-adjusted p < 0.05)."""
    out = []
    for axis in axes:
        psi = to_float(stats.get(f"psi_{axis}"))
        p = to_float(stats.get(f"p_psi_{axis}" if reference else f"p_psi_holm_{axis}"))
        if math.isfinite(psi) and psi < 0 and math.isfinite(p) and p < ALPHA:
            out.append(f"ψ {short_axis(axis)} {num(psi)}")
    return out


def _best_by(rows: list[Row], stat: str, lowest: bool = False) -> Row | None:
    have = [r for r in rows if math.isfinite(to_float(r.stats.get(stat)))]
    if not have:
        return None
    return (min if lowest else max)(have, key=lambda r: to_float(r.stats.get(stat)))


def headline(ctx: Any) -> list[str]:
    """The best measure by each criterion, each with what contradicts it."""
    verdict, axes = ctx.verdict, ctx.analysis.axes
    if not verdict.rows:
        return ["No measure has a τ with the gap (the measures without a value are listed below)."]
    top = verdict.rows[0]
    flags = _psi_flags(top.stats, axes)
    against = f"; but {', '.join(flags)} beyond noise: it ranks runs against the gap along that axis" if flags else ""
    psi = to_float(top.stats.get("psi"))
    psi_txt = f", Ψ {num(psi)}" if math.isfinite(psi) else ""
    tied = next((g for g in verdict.ties if top.measure in g), [])
    tie = f", tied with {', '.join(f'`{m}`' for m in tied if m != top.measure)}" if tied else ""
    name = tau_name(ctx.analysis)
    pooled = (f", pooled τ {num(top.stats.get('kendall_tau_pooled'))}" if name != "τ" else "")
    lines = [f"**Target:** {target_text(ctx.analysis.gap)}.", blocking_text(ctx.analysis)]
    base = baseline_text(ctx.analysis, [r.stats for r in verdict.rows])
    lines += [base] if base else []
    lines.append(f"**Highest {name}:** `{top.measure}` ({name} {ci_text(top.stats, 'kendall_tau')}{pooled}, p "
                 f"{p_text(top.stats.get('kendall_p'))}, n {top.stats.get('n')}{psi_txt}{tie}{against}).")
    by_psi = _best_by(verdict.rows, "psi")
    if by_psi is not None:
        lines.append(f"**Highest Ψ** (τ within the design, mean over the training axes): `{by_psi.measure}` (Ψ "
                     f"{num(by_psi.stats.get('psi'))}, τ {num(by_psi.stats.get('kendall_tau'))}).")
    by_se = _best_by(verdict.rows, "sign_error_mean", lowest=True)
    if by_se is None and ctx.analysis.axes:
        lines.append("Sign errors: n/a for every measure (no environment has 10 pairs of runs whose gaps differ "
                     "beyond the replicate noise; environments.csv lists them).")
    if by_se is not None:
        lines.append(f"**Lowest mean sign error:** `{by_se.measure}` ({num(by_se.stats.get('sign_error_mean'))}, "
                     f"worst environment {num(by_se.stats.get('sign_error_worst'))}; 0.5 is chance).")
    if not verdict.can_compare:
        lines.append(f"With {verdict.n_runs} runs (fewer than {MIN_CI_RUNS}) no measure can be compared with the "
                     "best one, and τ has no interval: judge each τ by its permutation p-value.")
    return lines


def _label(row: Row, verdict: Verdict, rank: int) -> str:
    """The row's label against the best measure (with the Holm-adjusted p), or why there is none."""
    if not verdict.can_compare:
        return ("highest τ; " if rank == 1 else "") + f"cannot compare (n < {MIN_CI_RUNS})"
    label = str(row.stats.get("vs_best") or "")
    p = to_float(row.stats.get("vs_best_p_holm"))
    text = label + (f" ({p_text(p)})" if label not in ("best", "") and math.isfinite(p) else "")
    return text + (" (borderline)" if is_true(row.stats.get("vs_best_borderline")) else "")


def _tau_cells(stats: Mapping[str, Any]) -> list[str]:
    """Pooled τ, within-cell τ and the comparison with ref.hyperparameters."""
    return [f'{num(stats.get("kendall_tau_pooled"))} / {num(stats.get("kendall_tau_within_cell"))}',
            beats_cell(dict(stats))]


def _psi_cell(stats: Mapping[str, Any], axis: str, reference: bool) -> str:
    psi = to_float(stats.get(f"psi_{axis}"))
    p = to_float(stats.get(f"p_psi_{axis}" if reference else f"p_psi_holm_{axis}"))
    return num(psi) + ("*" if math.isfinite(psi) and math.isfinite(p) and p < ALPHA else "")


def _stat_cells(stats: Mapping[str, Any], axes: list[str], reference: bool) -> list[str]:
    return [num(stats.get("psi")), *[_psi_cell(stats, a, reference) for a in axes], num(stats.get("cmi")),
            num(stats.get("sign_error_mean")), num(stats.get("sign_error_worst"))]


def verdict_table(ctx: Any) -> Table:
    """The one verdict table (see the module doc)."""
    verdict, axes, flip = ctx.verdict, list(ctx.analysis.axes), ctx.analysis.larger_is_sharper
    models = verdict.models
    sizes = {m: {r.per_model.get(m, (math.nan, 0))[1] for r in verdict.rows} for m in models}
    same = {m: len(sizes[m]) == 1 for m in models}
    name = tau_name(ctx.analysis)
    headers = ["#", "measure", "family", "n", f"Kendall {name} [95% CI]", "vs best (Holm p)", "τ pooled / within cell",
               "vs baseline: Δτ", "Ψ",
               *[f"ψ `{short_axis(a)}`" for a in axes], "CMI", "sign error mean", "sign error worst",
               "audit: largest |Δτ|",
               *[f"τ `{m}`" + (f" (n {next(iter(sizes[m]))})" if same[m] else "") for m in models]]
    rows, colors = [], {}
    tau_col, psi_col = 4, 8
    for i, r in enumerate(verdict.rows):
        negated = " (−)" if not flip.get(r.measure, True) else ""
        tau = ci_text(r.stats, "kendall_tau") + (f" (tie {r.tie})" if r.tie else "")
        cells = [str(i + 1), f"`{r.measure}`{negated}", r.family, str(r.stats.get("n")), tau, _label(r, verdict, i + 1),
                 *_tau_cells(r.stats), *_stat_cells(r.stats, axes, False), measured_text(r.measured)]
        cells += [num(t) + ("" if same[m] else f" (n {n})")
                  for m, (t, n) in ((m, r.per_model.get(m, (math.nan, 0))) for m in models)]
        rows.append(cells)
    refs = _references(ctx)
    foot = [[{"ref.random": "floor", "ref.replicate_gap": "ceiling", HYPERPARAMETERS: "baseline"}.get(
                 str(r["measure"]), "ref"), f"`{r['measure']}`", "reference", str(r.get("n")), ci_text(r, "kendall_tau"),
             "reference", *_tau_cells(r), *_stat_cells(r, axes, True), "", *[""] * len(models)] for r in refs]
    stats = [r.stats for r in verdict.rows] + refs
    for i, s in enumerate(stats):
        colors[(i, tau_col)] = signed_color(s.get("kendall_tau"))
        colors[(i, psi_col)] = signed_color(s.get("psi"))
        for j, axis in enumerate(axes):
            colors[(i, psi_col + 1 + j)] = signed_color(s.get(f"psi_{axis}"))
    attrs = [{"family": r.family.replace(" ", "_"), "cost": r.cost, "invariance": " ".join(r.declared) or "none"}
             for r in verdict.rows]
    k = len(axes)
    numeric = [True, False, False, True, True, False, True, False, True, *[True] * k, True, True, True, False,
               *[True] * len(models)]
    ascending = [True, False, False, False, False, False, False, False, False, *[False] * k, False, True, True,
                 False, *[False] * len(models)]
    return Table(headers, rows, numeric, table_id="verdict", sortable=True, filters=["family", "cost", "invariance"],
                 row_attrs=attrs, compact=True, ascending=ascending, foot=foot,
                 colors={key: c for key, c in colors.items() if c},
                 nowrap=frozenset({headers.index("audit: largest |Δτ|")}))


def _references(ctx: Any) -> list[dict[str, Any]]:
    refs = ctx.analysis.references
    return refs.to_dict(orient="records") if refs is not None and len(refs) else []


def grouped_notes(records: list[Mapping[str, Any]], total: int) -> list[str]:
    """Each distinct note fragment once, with the measures it concerns ("all N measures" when all)."""
    groups: dict[str, list[str]] = {}
    for r in records:
        if not math.isfinite(to_float(r.get("kendall_tau"))):
            continue  # a measure without τ is listed once with its reason instead
        for part in str(r.get("note") or "").split("; "):
            part = part.strip()
            if part and part != "nan" and not part.startswith("reference:"):
                groups.setdefault(part, []).append(str(r["measure"]))
    out = []
    for text, measures in groups.items():
        named = [m for m in measures if not m.startswith("ref.")]
        who = (f"all {total} measures with a τ" + (" and the references" if len(named) < len(measures) else "")
               if len(named) >= total else ", ".join(f"`{m}`" for m in measures))
        out.append(f"{text[0].upper()}{text[1:]} ({who}).")
    return out


def explanation(ctx: Any) -> str:
    models = ctx.verdict.models
    return ("One row per measure with a τ, highest τ first; the HTML table sorts by any column (numbers by value; "
            "#, p and sign errors smallest first) and filters by family, cost and invariance. τ: Kendall's τ-b with "
            "the gap over the pairs of runs of one data draw, pooled over the draws (τ-b itself with one draw), "
            f"its 95% interval of the two-way cluster bootstrap from {MIN_CI_RUNS} runs on "
            f"({ctx.analysis.resampling or 'no resampling'}); (−): smaller values are the sharper ones, negated. vs "
            "best: Holm-adjusted paired comparison with the highest τ. τ pooled: over every pair of runs, across "
            "draws; τ within cell: over the pairs of runs of one configuration (they differ only in their seed or "
            "draw). vs baseline: Δτ = τ − τ of `ref.hyperparameters`, the hyperparameter lookup (each "
            "configuration's mean gap in the other draws), on the same resamples; beats: its 95% interval "
            "(correlations.csv) lies above 0. Ψ, ψ: granulated "
            "Kendall (τ within blocks "
            "that differ in one axis only; * below 0.05 after Holm's correction), red below 0, blue above. CMI: "
            "Jiang et al.'s conditional mutual information. Sign error: Dziugaite et al.'s, mean and worst "
            "environment (0.5 = chance; smaller is better). Audit: what the rescaling audit measured (holds, "
            "breaks, moves, unchanged, with the largest |Δτ|; the audit section has Δτ per draw"
            + (" and per model" if models else "") + "). The last rows are the floor (`ref.random`: pure-noise "
            "measures, its 95% band) and the ceiling (`ref.replicate_gap`: the gap of the other replicates), after the "
            "baseline `ref.hyperparameters` and the lookups on one axis (`ref.axis.*`).")


def verdict_block(doc: Document, ctx: Any) -> None:
    """The first screen: design, headline, the table, then its legend, ties, notes and missing measures."""
    verdict = ctx.verdict
    doc.add(Heading(2, "Verdict", "verdict"))
    doc.add(Paragraph(design_sentence(ctx), css="design"))
    doc.add(Paragraph(" ".join(headline(ctx)), css="headline"))
    doc.add(verdict_table(ctx))
    doc.add(Paragraph(explanation(ctx)))
    if verdict.ties:
        doc.add(Paragraph("Ties (the same τ): " + "; ".join(
            f"tie {i}: " + " = ".join(f"`{m}`" for m in group) for i, group in enumerate(verdict.ties, 1))
            + ". Tied measures can still get different labels against the best: the paired comparison resamples "
              "the difference of two τ, which depends on how each measure co-varies with the best one."))
    notes = grouped_notes(ctx.analysis.correlations.to_dict(orient="records") + _references(ctx), len(verdict.rows))
    if notes:
        doc.add(Paragraph("Notes, each once:"))
        doc.add(Bullets(notes))
    if verdict.missing:
        doc.add(Paragraph(f"{len(verdict.missing)} measure(s) have no τ and are not drawn in any figure:"))
        doc.add(Bullets([f"`{m}`: {why}" for m, why in verdict.missing]))
