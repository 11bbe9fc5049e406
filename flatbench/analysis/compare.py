"""Several studies side by side: does a measure's verdict hold across studies?

    write_comparison([results/cpu/yi_mnist, results/cpu/tsuzuku_mnist, ...], results/cpu/comparison)
      → comparison.csv        one row per measure: per study τ, its interval, p, n and best-group mark
      → plots/comparison.png  heatmap measure × study: τ (colour and number) with its interval, the
                              best group framed
      → comparison.html       self-contained, sortable and filterable by family; links to each report

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
from flatbench.analysis.fmt import ci_text, is_true, p_text
from flatbench.analysis.plots.common import CMAP, ink_on, new_figure, png_bytes
from flatbench.analysis.stats import MIN_CI_RUNS
from flatbench.analysis.table import to_float
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
    fig = new_figure(2.9 + 1.45 * k + 0.9, 0.3 * max(n, 1) + 1.6)
    ax = fig.add_subplot()
    values = frame[[f"{s}:tau" for s in studies]].to_numpy(dtype=float) if n else np.zeros((0, k))
    norm = Normalize(-1.0, 1.0)
    image = ax.imshow(np.ma.masked_invalid(values), cmap=colormaps[CMAP].with_extremes(bad="white"), norm=norm,
                      aspect="auto")
    mapper = ScalarMappable(norm=norm, cmap=CMAP)
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
            ax.text(j, i, f"{v:.2f}{ci}", ha="center", va="center", fontsize=6.5, color=ink_on(mapper.to_rgba(v)),
                    fontweight="bold" if best else "normal")
            if best:
                ax.add_patch(Rectangle((j - 0.48, i - 0.45), 0.96, 0.9, fill=False, edgecolor="black", linewidth=1.4))
    ax.set_xticks(range(k), studies, fontsize=7.5)
    ax.xaxis.tick_top()
    ax.set_yticks(range(n), frame["measure"].astype(str).tolist(), fontsize=7)
    ax.tick_params(length=0)
    cbar = fig.colorbar(image, ax=ax, location="bottom", shrink=0.5, aspect=40, pad=0.01)
    cbar.set_label("Kendall τ with the gap [95% interval where n ≥ 10]; framed, bold: in the study's best group",
                   fontsize=7)
    cbar.ax.tick_params(labelsize=6.5)
    return png_bytes(fig)


def _document(frame: pd.DataFrame, studies: list[str], exp_dirs: list[Path], out_dir: Path, png: bytes) -> Document:
    doc = Document(title="flatbench: the studies side by side")
    doc.add(Heading(2, "Studies", "studies"))
    links = [f"[{s}]({Path(os.path.relpath(exp / 'report.html', out_dir)).as_posix()})" for s, exp in zip(studies, exp_dirs)]
    doc.add(Paragraph("Each study's own numbers, read from its correlations.csv (nothing is recomputed): Kendall τ "
                      "of each measure with the gap, its 95% bootstrap interval (from 10 runs on), its "
                      "permutation p-value and its label against the study's best measure (Holm-adjusted paired "
                      "comparison). Reports: " + ", ".join(links) + ". Data: [comparison.csv](comparison.csv). "
                      "In the HTML page the table sorts by any column and filters by family."))
    doc.add(Heading(2, "Every measure in every study", "table"))
    rows, attrs = [], []
    for r in frame.to_dict(orient="records"):
        cells = [f"`{r['measure']}`", str(r["family"])]
        for s in studies:
            if r[f"{s}:best_group"] == "not measured":
                cells.append("not measured")
                continue
            stats = {"kendall_tau": r[f"{s}:tau"], "kendall_tau_lo": r[f"{s}:tau_lo"], "kendall_tau_hi": r[f"{s}:tau_hi"]}
            cells.append(f"{ci_text(stats, 'kendall_tau')} (p {p_text(r[f'{s}:p'])}); {r[f'{s}:best_group'] or '-'}")
        rows.append(cells)
        attrs.append({"family": str(r["family"]).replace(" ", "_")})
    doc.add(Table(["measure", "family", *studies], rows, [False, False, *[True] * len(studies)], table_id="comparison",
                  sortable=True, filters=["family"], row_attrs=attrs, compact=True))
    doc.add(Heading(2, "Heatmap", "heatmap"))
    doc.add(Image("plots/comparison.png", png, "Kendall τ of every measure (rows) in every study (columns), with its "
                                               "interval; framed: in the study's best group."))
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
    store.atomic_write_text(out_dir / "comparison.html", _document(frame, names, exp_dirs, out_dir, png).to_html())
    return ComparisonSummary(out_dir, out_dir / "comparison.csv", out_dir / "comparison.html",
                             out_dir / "plots" / "comparison.png", names, len(frame))
