"""The report's figures: which are drawn, from what, with which caption, in which file.

Only measures with values are drawn (a measure without a finite value is listed once in the verdict
section with its reason, never shown as an empty panel); the scatter grids, the matrices and the
per-level panels group the measures by family. The paired-comparison matrix needs intervals, so it is
drawn only from `MIN_CI_RUNS` runs on. Every figure is also written to `plots/` (stale PNGs removed).
There is no file per measure: the grids show every measure (with Monte-Carlo error bars where recorded),
and a third of the report's time went into drawing each measure again on its own
(`plots.measure_figure` draws one for a paper).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from flatbench import store
from flatbench.analysis import plots
from flatbench.analysis.audit_digest import Audit
from flatbench.analysis.audit_plots import audit_correlations_figure
from flatbench.analysis.families import by_family
from flatbench.analysis.stats import MIN_CI_RUNS, Analysis, agreement_matrix, oriented
from flatbench.analysis.table import RunRecord, stderr_columns, to_float

GRID_MAX = 16
"""Panels per scatter grid image: a family with more is split over several images."""


@dataclass
class FigureEntry:
    name: str
    png: bytes
    caption: str
    group: str
    """"main" (the figures section), "design" (one per swept axis), "scatter" (the grids), "audit"."""
    width: int = 0
    height: int = 0
    hover: dict[str, Any] | None = None
    title: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def plot_filename(key: str) -> str:
    """A measure key as a portable file name: "@" → "_at_", "/" → "__", anything odd → "_"."""
    name = key.replace("@", "_at_").replace("/", "__")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "measure"


def with_values(frame: pd.DataFrame, keys: list[str]) -> list[str]:
    """The keys with at least one finite value over the runs."""
    return [k for k in keys if k in frame.columns
            and np.isfinite(pd.to_numeric(frame[k], errors="coerce").to_numpy(dtype=float)).any()]


def _main_figures(analysis: Analysis, ranked: list[str], families: Mapping[str, str], labels: pd.Series,
                  drawn: list[str]) -> list[FigureEntry]:
    """Ranking, against the ratio, agreement, paired comparisons, sign errors."""
    frame, corr, gcol = analysis.included, analysis.correlations, analysis.gap_column
    ranked_rows = corr[corr["measure"].isin(ranked)]
    ci = "its 95% interval" if len(frame) >= MIN_CI_RUNS else f"no interval (fewer than {MIN_CI_RUNS} runs)"
    out = [FigureEntry("ranking.png", plots.ranking_figure(ranked_rows, analysis.references),
                       f"Kendall τ of each measure with the gap, {ci}, and the permutation p-value; best at the "
                       "top; shaded: the floor (pure-noise measures' 95% band), dash-dotted: the ceiling (the "
                       "replicate gap).", "main"),
           FigureEntry("vs_ratio.png", plots.vs_ratio_figure(frame, by_family(drawn, families), analysis.gap, gcol,
                                                             labels),
                       "The gap and each measure against the random-label ratio: mean ± std over the runs of each "
                       "model at each ratio (its seeds and, where other axes vary, all their values: the design "
                       "figures above show every run), marker and line style: model; measures grouped by family.",
                       "main")]
    order = by_family(ranked, families)
    matrix = agreement_matrix(oriented(frame, analysis.larger_is_sharper), [gcol, *order])
    matrix = matrix.rename(index={gcol: "gap"}, columns={gcol: "gap"})
    out.append(FigureEntry("agreement.png", plots.agreement_figure(matrix, {**families, "gap": "gap"}),
                           "Kendall τ between measures over the runs (measures oriented so that larger = sharper): "
                           "which measures rank the models alike; grouped by family.", "main"))
    if len(frame) >= MIN_CI_RUNS and len(analysis.comparisons):
        out.append(FigureEntry("comparisons.png", plots.comparison_figure(analysis.comparisons, order,
                                                                         families=families),
                               "Paired comparison of the measures: τ_row − τ_col over the runs both have, from "
                               "the same bootstrap resamples.", "main"))
    envs = analysis.environments
    envs = envs[envs["averaged"].astype(bool)] if "averaged" in envs.columns else envs
    if len(envs):
        refs = analysis.references
        floor = None
        if refs is not None and len(refs) and "ref.random" in set(refs["measure"]):
            floor = to_float(refs.loc[refs["measure"] == "ref.random", "sign_error_mean"].iloc[0])
        out.append(FigureEntry("sign_errors.png", plots.sign_error_figure(envs, ranked, floor=floor),
                               "Dziugaite et al.'s robust view, one panel per measure (highest τ first): the share of "
                               "environments (an axis and the values of the other axes, with at least 10 pairs of runs "
                               "whose gaps differ beyond the replicate noise) whose sign error is at most x; the "
                               "further left the curve, the better; grey dotted: the ceiling (the replicate gap), red "
                               "dashed: the floor (pure-noise measures' mean sign error).", "main"))
    return out


DESIGN_MEASURES = 7
"""Measures drawn against each swept axis (the highest τ first), besides the gap."""


def _design_figures(analysis: Analysis, ranked: list[str], flipped: Mapping[str, bool]) -> list[FigureEntry]:
    """One figure per swept axis: the gap and the leading measures against it, a point per run."""
    frame = analysis.included
    if not len(frame):
        return []
    rows = {r["measure"]: r for r in analysis.correlations.to_dict(orient="records")}
    keys = ranked[:DESIGN_MEASURES]
    labels = (frame["model.name"] if "model.name" in frame.columns else frame["experiment"]).astype(str)
    out = []
    for axis in analysis.axes:
        if axis not in frame.columns or frame[axis].astype(str).nunique() < 2:
            continue
        drawn = plots.axis_figure(frame, axis, keys, analysis.gap, analysis.gap_column, labels, rows, flipped)
        values = {k: pd.to_numeric(frame[k], errors="coerce").to_numpy(dtype=float)
                  for k in [analysis.gap_column, *keys]}
        points = [[*p, _json_number(values[drawn.panels[p[3]]][p[2]])] for p in drawn.points]
        out.append(FigureEntry(f"design_{plot_filename(axis)}.png", drawn.png,
                               f"The gap and the {len(keys)} measures of highest τ against `{axis}`: a point is a run "
                               "(the pointer shows its configuration), the black bar the mean of the n runs at each "
                               "value; ψ here: the measure's τ among runs that differ in this axis only (* beyond "
                               "noise after Holm).", "design", drawn.width, drawn.height,
                               {"points": points, "panels": drawn.panels}, axis))
    return out


def _grid_chunks(keys: list[str], families: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """(family, keys) per grid image, at most `GRID_MAX` keys each."""
    out = []
    for family in dict.fromkeys(families.get(k, "other") for k in keys):
        members = [k for k in keys if families.get(k, "other") == family]
        for start in range(0, len(members), GRID_MAX):
            out.append((family, members[start:start + GRID_MAX]))
    return out


def _scatter_grids(analysis: Analysis, keys: list[str], families: Mapping[str, str],
                   labels: pd.Series) -> list[FigureEntry]:
    """Every measure against the gap, one grid image per family (hover data with each point's value)."""
    frame = analysis.included
    rows = {r["measure"]: r for r in analysis.correlations.to_dict(orient="records")}
    flipped = {k: not analysis.larger_is_sharper.get(k, True) for k in keys}
    out, used = [], set()
    for family, members in _grid_chunks(keys, families):
        drawn = plots.scatter_grid(frame, members, analysis.gap, analysis.gap_column, labels, rows, flipped,
                                   stderr_columns(frame) if len(frame) else {})
        values = {k: pd.to_numeric(frame[k], errors="coerce").to_numpy(dtype=float) for k in members}
        points = [[*p, _json_number(values[members[p[3]]][p[2]])] for p in drawn.points]
        name = "scatter_" + plot_filename(family.lower().replace(" ", "_").replace("-", "_"))
        while name + ".png" in used:
            name += "_2"
        used.add(name + ".png")
        out.append(FigureEntry(name + ".png", drawn.png, f"{family}: each measure against the gap.", "scatter",
                               drawn.width, drawn.height, {"points": points, "panels": drawn.panels}, family))
    return out


def _json_number(value: Any) -> float | None:
    v = to_float(value)
    return float(f"{v:.6g}") if np.isfinite(v) else None


def _history_figures(analysis: Analysis, records: list[RunRecord] | None, levels: pd.DataFrame | None,
                     families: Mapping[str, str]) -> list[FigureEntry]:
    """Training curves (from the runs' histories) and τ per train-loss level (measures with snapshots)."""
    out = []
    frame = analysis.included
    if records:
        included = set(zip(frame["experiment"], frame["run_id"])) if len(frame) else set()
        used = [r for r in records if (r.experiment, r.run_id) in included]
        histories = {r.run_id: r.info.get("history") or [] for r in used}
        ratios = {r.run_id: (r.info.get("config") or {}).get("data", {}).get("random_label_ratio") for r in used}
        if any(histories.values()):
            targets = {to_float(((r.info.get("config") or {}).get("train") or {}).get("target_train_loss"))
                       for r in used}
            target = next(iter(targets)) if len(targets) == 1 and np.isfinite(next(iter(targets))) else None
            firsts = [float(plots.epoch_curves(h)[0][0]) for h in histories.values() if len(plots.epoch_curves(h)[0])]
            out.append(FigureEntry("training_curves.png", plots.training_curves_figure(histories, ratios, target),
                                   "Accuracy (top) and cross-entropy (bottom, log scale) of every run: on the labels "
                                   "trained on, the running value of every epoch from epoch 1 (left); on the test set "
                                   "at the evaluated epochs (right)"
                                   + (f"; dashed: the target train loss {target:g} that stops training" if target
                                      else "") + ". Colour: the random-label ratio.", "main",
                                   extra={"first_epoch": min(firsts) if firsts else None, "runs": len(firsts),
                                          "target_train_loss": target}))
    if levels is not None and len(levels):
        snap = levels[levels["level"].astype(str) != plots.FINAL_LEVEL]
        has = [m for m in dict.fromkeys(snap["measure"].astype(str))
               if np.isfinite(pd.to_numeric(snap[snap["measure"] == m]["kendall_tau"], errors="coerce")).any()]
        has = by_family(has, families)
        if has:
            part = levels[levels["measure"].astype(str).isin(has)].copy()
            part["order"] = part["measure"].map({m: i for i, m in enumerate(has)})
            out.append(FigureEntry("tau_by_level.png", plots.tau_by_level_figure(
                part.sort_values("order", kind="stable").drop(columns="order")),
                f"Kendall τ of the {len(has)} measures computed on snapshots with the gap at every train-loss level "
                "the runs were snapshotted at (and at their final models): how much a verdict depends on how far "
                "training went.", "main"))
    return out


def _audit_figures(audits: list[Audit], gap: str) -> list[FigureEntry]:
    """Each audit's τ before and after, over the measures with an untransformed τ."""
    out = []
    for audit in audits:
        frame = audit.frame[np.isfinite(pd.to_numeric(audit.frame["tau_original"], errors="coerce"))]
        if not len(frame):
            continue
        folder = Path(audit.where).parent.as_posix()
        where = "" if folder in (".", "") else "_" + plot_filename(folder)
        png = audit_correlations_figure(frame, gap, ", ".join(audit.families))
        out.append(FigureEntry(f"audit{where}.png", png, f"τ before and after the rescalings of `{audit.where}` "
                               f"({audit.describe()}).", "audit", title=audit.where))
    return out


def draw_figures(analysis: Analysis, plot_dir: Path, families: Mapping[str, str], records: list[RunRecord] | None = None,
                 levels: pd.DataFrame | None = None, audits: list[Audit] | None = None) -> list[FigureEntry]:
    """Every figure of the report (see the module doc), written to `plot_dir`."""
    frame = analysis.included
    keys = analysis.correlations["measure"].astype(str).tolist()
    drawn = with_values(frame, keys)
    ranked = [k for k, t in zip(keys, analysis.correlations["kendall_tau"]) if np.isfinite(to_float(t))]
    labels = plots.model_labels(frame)
    out = _main_figures(analysis, ranked, families, labels, drawn)
    out += _design_figures(analysis, ranked, {k: not analysis.larger_is_sharper.get(k, True) for k in ranked})
    out += _history_figures(analysis, records, levels, families)
    out += _scatter_grids(analysis, by_family(drawn, families), families, labels)
    out += _audit_figures(audits or [], analysis.gap)
    plot_dir.mkdir(parents=True, exist_ok=True)
    for fig in out:
        store.atomic_write_bytes(plot_dir / fig.name, fig.png)
    names = {f.name for f in out}
    for stale in plot_dir.glob("*.png"):
        if stale.name not in names:
            stale.unlink()
    return out
