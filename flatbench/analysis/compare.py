"""Several studies side by side: does a measure's verdict hold across studies?

    write_comparison([results/cpu/yi_mnist, results/cpu/tsuzuku_mnist, ...], results/cpu/comparison)
      → comparison.csv        one row per measure: per study τ, its interval, p, n and best-group mark
      → plots/comparison.png  heatmap measure × study: τ (diverging colour and number) with its
                              interval and Ψ where the study has it, the best group framed
      → comparison.html       the heatmap first; then one row per study (n, dataset, model, swept axes,
                              a link to its report); then one compact table, τ and a best-group mark
                              per study, sortable and filterable by family

It reads only each study's `correlations.csv` (what `flatbench report` wrote), so it takes a second and
never recomputes a statistic: the numbers are the studies' own. A measure a study did not compute is
"not measured" there, never 0. Rows: measures in the best group of the most studies first, then by
mean τ over the studies that have it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.patches import Rectangle

from flatbench import store
from flatbench.analysis.document import Document, Heading, Image, Paragraph, Table
from flatbench.analysis.families import family_of
from flatbench.analysis.fmt import is_true
from flatbench.analysis.plots.common import DIVERGING, ink_on, new_figure, png_bytes
from flatbench.analysis.stats import MIN_CI_RUNS
from flatbench.analysis.table import to_float
from flatbench.analysis.verdict_block import signed_color
from flatbench.errors import FlatbenchError

MARKS = {"best": "best", "indistinguishable": "in best group", "worse": "worse", "cannot compare": "cannot compare",
         "better on shared runs": "better on shared runs"}


@dataclass
class ComparisonSummary:
    out_dir: Path
    csv: Path
    html: Path
    png: Path
    studies: list[str]
    n_measures: int


def _study_names(exp_dirs: list[Path]) -> list[str]:
    names = [p.resolve().name for p in exp_dirs]
    return [n if names.count(n) == 1 else f"{p.resolve().parent.name}/{n}" for n, p in zip(names, exp_dirs)]


def read_studies(exp_dirs: list[Path]) -> dict[str, pd.DataFrame]:
    """Each study's correlations.csv by study name; a clear error naming the folder when one is missing."""
    out = {}
    for name, exp in zip(_study_names(exp_dirs), exp_dirs):
        path = exp / "correlations.csv"
        if not exp.is_dir():
            raise FlatbenchError(f"experiment folder {exp} does not exist")
        if not path.is_file():
            raise FlatbenchError(f"{exp} has no correlations.csv: run `flatbench report {exp}` first")
        frame = pd.read_csv(path)
        if "kind" in frame.columns:  # the reference rows (ref.random, ref.replicate_gap) are not measures
            frame = frame[frame["kind"].astype(str) != "reference"].reset_index(drop=True)
        out[name] = frame
    return out


def _mark(row: Mapping[str, Any]) -> str:
    n = to_float(row.get("n"))
    label = str(row.get("vs_best") or "")
    if not math.isfinite(to_float(row.get("kendall_tau"))):
        return "no τ"
    if label == "nan" or not label:
        return ""
    if label == "best" and math.isfinite(n) and n < MIN_CI_RUNS:
        return "highest τ (cannot compare)"
    return MARKS.get(label, label) + (" (borderline)" if is_true(row.get("vs_best_borderline")) else "")


def comparison_frame(studies: Mapping[str, pd.DataFrame], measure_info: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """One row per measure (see the module doc for the order); per study `<study>:tau`, `:tau_lo`, `:tau_hi`,
    `:p`, `:n`, `:best_group`."""
    measures = list(dict.fromkeys(m for corr in studies.values() for m in corr["measure"].astype(str)))
    rows = []
    for m in measures:
        row: dict[str, Any] = {"measure": m, "family": family_of(m, measure_info)}
        for name, corr in studies.items():
            hit = corr[corr["measure"].astype(str) == m]
            r = hit.iloc[0].to_dict() if len(hit) else {}
            row[f"{name}:tau"] = to_float(r.get("kendall_tau"))
            row[f"{name}:tau_lo"] = to_float(r.get("kendall_tau_lo"))
            row[f"{name}:tau_hi"] = to_float(r.get("kendall_tau_hi"))
            row[f"{name}:p"] = to_float(r.get("kendall_p"))
            row[f"{name}:n"] = int(to_float(r.get("n"))) if len(hit) and math.isfinite(to_float(r.get("n"))) else 0
            row[f"{name}:best_group"] = _mark(r) if len(hit) else "not measured"
            row[f"{name}:psi"] = to_float(r.get("psi"))
        rows.append(row)
    frame = pd.DataFrame(rows)
    names = list(studies)
    group = frame[[f"{s}:best_group" for s in names]].isin(["best", "in best group"]).sum(axis=1)
    mean = frame[[f"{s}:tau" for s in names]].mean(axis=1, skipna=True)
    frame = frame.assign(_g=group, _m=mean.fillna(-np.inf)).sort_values(["_g", "_m", "measure"],
                                                                      ascending=[False, False, True], kind="mergesort")
    return frame.drop(columns=["_g", "_m"]).reset_index(drop=True)


def comparison_figure(frame: pd.DataFrame, studies: list[str]) -> bytes:
    """Measure × study heatmap of τ: the value and its interval in each cell, the best group framed in
    black, "not measured" and "no τ" cells blank with the word."""
    n, k = len(frame), len(studies)
    fig = new_figure(2.9 + 1.75 * k + 0.9, 0.3 * max(n, 1) + 1.6)
    ax = fig.add_subplot()
    values = frame[[f"{s}:tau" for s in studies]].to_numpy(dtype=float) if n else np.zeros((0, k))
    norm = Normalize(-1.0, 1.0)
    image = ax.imshow(np.ma.masked_invalid(values), cmap=colormaps[DIVERGING].with_extremes(bad="white"), norm=norm,
                      aspect="auto")
    mapper = ScalarMappable(norm=norm, cmap=DIVERGING)
    for i, r in enumerate(frame.to_dict(orient="records")):
        for j, s in enumerate(studies):
            v = values[i, j]
            mark = str(r[f"{s}:best_group"])
            if not math.isfinite(v):
                ax.text(j, i, "not measured" if mark == "not measured" else "no τ", ha="center", va="center",
                        fontsize=6, color="0.45")
                continue
            lo, hi = r[f"{s}:tau_lo"], r[f"{s}:tau_hi"]
            ci = f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
            best = mark in ("best", "in best group")
            psi = to_float(r.get(f"{s}:psi"))
            psi_txt = f"  Ψ {psi:.2f}" if math.isfinite(psi) else ""
            ax.text(j, i, f"{v:.2f}{ci}{psi_txt}", ha="center", va="center", fontsize=6.2,
                    color=ink_on(mapper.to_rgba(v)), fontweight="bold" if best else "normal")
            if best:
                ax.add_patch(Rectangle((j - 0.48, i - 0.45), 0.96, 0.9, fill=False, edgecolor="black", linewidth=1.4))
    ax.set_xticks(range(k), studies, fontsize=7.5)
    ax.xaxis.tick_top()
    ax.set_yticks(range(n), frame["measure"].astype(str).tolist(), fontsize=7)
    ax.tick_params(length=0)
    cbar = fig.colorbar(image, ax=ax, location="bottom", shrink=0.5, aspect=40, pad=0.01)
    cbar.set_label("Kendall τ with the gap [95% interval where n ≥ 10] (colour, diverging at 0); Ψ: granulated "
                   "Kendall where the study has training axes; framed, bold: in the study's best group", fontsize=7)
    cbar.ax.tick_params(labelsize=6.5)
    return png_bytes(fig)


SYMBOL = {"best": "★", "in best group": "●"}
"""The compact table's best-group marks: ★ the study's best, ● not shown worse than it."""


def study_facts(exp: Path, corr: pd.DataFrame) -> dict[str, str]:
    """n, dataset, model(s) and swept axes of a study, from its table.csv and correlations.csv."""
    facts = {"n": str(int(pd.to_numeric(corr.get("n", pd.Series(dtype=float)), errors="coerce").max() or 0)),
             "dataset": "n/a", "model": "n/a"}
    path = exp / "table.csv"
    if path.is_file():
        table = pd.read_csv(path, usecols=lambda c: c in ("data.dataset", "model.name", "status"))
        for col, key in (("data.dataset", "dataset"), ("model.name", "model")):
            if col in table.columns:
                facts[key] = ", ".join(sorted(table[col].dropna().astype(str).unique()))
    axes = [c[4:] for c in corr.columns if c.startswith("psi_") and c != "psi_data" and not c.startswith("psi_data.")]
    axes = [c[4:] for c in corr.columns if c.startswith("psi_data.")] + axes
    facts["axes"] = ", ".join(f"`{a}`" for a in axes) or "none (replicates only)"
    return facts


def _studies_table(frame: pd.DataFrame, studies: list[str], exp_dirs: list[Path], out_dir: Path,
                   corrs: Mapping[str, pd.DataFrame]) -> Table:
    rows = []
    for s, exp in zip(studies, exp_dirs):
        facts = study_facts(exp, corrs[s])
        link = Path(os.path.relpath(exp / "report.html", out_dir)).as_posix()
        best = frame[frame[f"{s}:best_group"].astype(str).str.startswith(("best", "highest"))]
        top = f"`{best.iloc[0]['measure']}`" if len(best) else "n/a"
        psi = corrs[s]["psi"] if "psi" in corrs[s].columns else pd.Series(dtype=float)
        has_psi = "yes" if np.isfinite(pd.to_numeric(psi, errors="coerce")).any() else "no (no training axis)"
        rows.append([f"[{s}]({link})", facts["n"], facts["dataset"], facts["model"], facts["axes"], top, has_psi])
    return Table(["study", "n runs", "dataset", "model", "swept axes", "best by τ", "Ψ"], rows,
                 [False, True, False, False, False, False, False], table_id="studies", sortable=True, compact=True)


def _compact_cell(r: Mapping[str, Any], s: str) -> str:
    mark = str(r[f"{s}:best_group"])
    if mark == "not measured":
        return "–"
    tau = to_float(r[f"{s}:tau"])
    if not math.isfinite(tau):
        return "no τ"
    return f"{tau:.2f}" + (f" {SYMBOL[mark]}" if mark in SYMBOL else "")


def _document(frame: pd.DataFrame, studies: list[str], exp_dirs: list[Path], out_dir: Path, png: bytes,
              corrs: Mapping[str, pd.DataFrame]) -> Document:
    doc = Document(title="flatbench: the studies side by side")
    doc.add(Heading(2, "Heatmap", "heatmap"))
    doc.add(Paragraph("Each study's own numbers, read from its correlations.csv (nothing is recomputed): Kendall τ of "
                      "each measure with the gap (colour: red below 0, white at 0, blue above), its 95% bootstrap "
                      "interval, Ψ where the study varies a training axis, and, framed, the measures in the study's "
                      "best group (not shown worse than its highest τ by a Holm-adjusted paired comparison). Data: "
                      "[comparison.csv](comparison.csv)."))
    doc.add(Image("plots/comparison.png", png, "Kendall τ of every measure (rows) in every study (columns), with its "
                                               "interval and Ψ; framed: in the study's best group.", css="full"))
    doc.add(Heading(2, "Studies", "studies"))
    doc.add(_studies_table(frame, studies, exp_dirs, out_dir, corrs))
    doc.add(Heading(2, "Every measure in every study", "table"))
    doc.add(Paragraph("τ per study; ★ the study's best (highest τ), ● in its best group, – not measured. The HTML "
                      "table sorts by any column (numbers by value, largest first) and filters by family; intervals, "
                      "p-values and labels are in the heatmap and comparison.csv."))
    rows, attrs, colors = [], [], {}
    for i, r in enumerate(frame.to_dict(orient="records")):
        rows.append([f"`{r['measure']}`", str(r["family"]), *[_compact_cell(r, s) for s in studies]])
        attrs.append({"family": str(r["family"]).replace(" ", "_")})
        for j, s in enumerate(studies):
            if r[f"{s}:best_group"] != "not measured" and signed_color(r[f"{s}:tau"]):
                colors[(i, 2 + j)] = signed_color(r[f"{s}:tau"])
    doc.add(Table(["measure", "family", *[f"`{s}`" for s in studies]], rows, [False, False, *[True] * len(studies)],
                  table_id="comparison", sortable=True, filters=["family"], row_attrs=attrs, compact=True,
                  colors=colors))
    return doc


def write_comparison(exp_dirs: list[Path] | list[str], out_dir: Path | str,
                     measure_info: Mapping[str, Any] | None = None) -> ComparisonSummary:
    """Read the studies' correlations, write comparison.csv, plots/comparison.png and comparison.html."""
    exp_dirs, out_dir = [Path(p) for p in exp_dirs], Path(out_dir)
    studies = read_studies(exp_dirs)
    names = list(studies)
    frame = comparison_frame(studies, measure_info)
    png = comparison_figure(frame, names)
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    store.atomic_write_text(out_dir / "comparison.csv", frame.to_csv(index=False))
    store.atomic_write_bytes(out_dir / "plots" / "comparison.png", png)
    doc = _document(frame, names, exp_dirs, out_dir, png, studies)
    store.atomic_write_text(out_dir / "comparison.html", doc.to_html())
    return ComparisonSummary(out_dir, out_dir / "comparison.csv", out_dir / "comparison.html",
                             out_dir / "plots" / "comparison.png", names, len(frame))
