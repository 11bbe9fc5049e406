"""`flatbench audit`: do the measures keep their values, and their correlations, under reparametrization?

**Run audit** (`flatbench audit RUN_DIR`). The run's model is loaded into a measure context exactly as
`flatbench measure` does (same measurement set, dtype and settings: the experiment's saved study.yaml).
The measures are computed on it, then for every family (`layer`, `node`, `bn`, `logit_scale`, see
`flatbench.rescale`) and trial, the model is transformed with fresh random factors (log-uniform in
[1/F, F], F = `--max-factor`, seeded by run, family and trial), the logits on the measurement set are
checked to be unchanged (up to a positive factor for `logit_scale`; the audit stops if they are not),
and every measure is recomputed on the transformed copy in a fresh context (no cached curvature is
reused). Written next to the run (or to `--out`):

- `audit.csv`: one row per (measure, family, trial): `measure, family, trial, value, baseline,
  rel_change, declared_invariant, status, function_change, seconds` (`rel_change = |value − baseline| /
  |baseline|`; `measure` is the result key, `name@loss` for a loss other than ce);
- `audit.png`: a measure × family heatmap of the median relative change, on a log colour scale, with
  the families each measure declares itself invariant to marked;

and the same table is printed. A family that does not apply to the model is reported and skipped.

**Population audit** (`flatbench audit EXPERIMENT_DIR --population [--family node]`): the papers' central
claim made executable. Every finished run of the experiment gets one random function-preserving
transformation of the same family with large factors (default F = 100); the measures are recomputed on
the transformed population, and each measure's Kendall τ-b with the generalization gap (the study's
`report.gap`) is reported next to the untransformed one. The gap does not change, so a measure worth
using keeps its correlation. Untransformed values come from the run's measures.json where present (they
were computed with the same settings), otherwise they are computed. As in the report, a measure whose
registry entry says `larger_is_sharper=False` is negated first, so a positive τ means "tracks the gap".
Written to the experiment folder (or `--out`): `audit_population.csv` (per run and measure: original
and transformed value, gap), `audit_correlations.csv` (`measure, n, tau_original, tau_transformed,
delta, p_original, p_transformed, declared_invariant`) and `audit_correlations.png` (paired bars).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import yaml

from flatbench.errors import FlatbenchError
from flatbench.store import (MEASURES_JSON, RUN_JSON, STUDY_FILE, atomic_write_bytes, atomic_write_text,
                             is_finished, list_run_dirs, read_json)

AUDIT_CSV = "audit.csv"
AUDIT_PNG = "audit.png"
POPULATION_CSV = "audit_population.csv"
CORRELATIONS_CSV = "audit_correlations.csv"
CORRELATIONS_PNG = "audit_correlations.png"

FUNCTION_TOL = {torch.float64: 1e-8, torch.float32: 1e-3}
"""Largest relative change of the logits accepted as 'the same function' (per measurement dtype)."""
INVARIANCE_RTOL = 1e-4
"""A declared-invariant measure whose median relative change exceeds this is flagged in the table."""
HEATMAP_FLOOR = 1e-16
"""Relative changes below this (including exact zeros) are drawn at this value on the log scale."""
MIN_RUNS = 3

Echo = Callable[[str], None]


# ---------------------------------------------------------------- shared pieces


def _study_run_dirs(exp_dir: Path) -> list[Path]:
    """The run folders of the experiment's current study (those of an earlier config left out), or every
    run folder when the experiment has no saved study."""
    from flatbench.store import run_dir
    from flatbench.study import read_saved_study

    if not (Path(exp_dir) / STUDY_FILE).is_file():
        return list_run_dirs(exp_dir)
    return [run_dir(exp_dir, rid) for rid in read_saved_study(exp_dir).run_ids()]


def measure_config(exp_dir: Path):
    """The experiment's measure config (from its saved study.yaml; defaults when there is none)."""
    from flatbench.config import MeasureConfig, parse_study

    saved = Path(exp_dir) / STUDY_FILE
    if not saved.is_file():
        return MeasureConfig()
    raw = yaml.safe_load(saved.read_text()) or {}
    return parse_study({"measure": raw.get("measure") or {}}, default_name="audit").measure


def report_gap(exp_dir: Path) -> str:
    saved = Path(exp_dir) / STUDY_FILE
    if not saved.is_file():
        return "acc"
    raw = yaml.safe_load(saved.read_text()) or {}
    return str((raw.get("report") or {}).get("gap", "acc"))


@dataclass(frozen=True)
class Entry:
    key: str
    """The result key: the measure's name, `name@loss` for a loss other than ce."""
    name: str
    loss: str | None
    settings: dict


def plan_entries(names: list[str] | None, cfg: Any) -> list[Entry]:
    """Measures (default: the study's) × configured losses, with their merged settings."""
    from flatbench.measures.registry import get_measure, resolve_names
    from flatbench.measures.runner import check_settings, entry_key

    chosen = resolve_names(names or list(cfg.measures))
    check_settings(chosen, cfg)
    entries = []
    for name in chosen:
        spec = get_measure(name)
        settings = spec.settings(cfg.settings)
        for loss in (cfg.losses if spec.uses_loss else (None,)):
            entries.append(Entry(entry_key(name, loss), name, loss, settings))
    return entries


def _compute(ctx: Any, entry: Entry) -> dict[str, Any]:
    from flatbench.measures.registry import get_measure
    from flatbench.measures.runner import compute_entry

    return compute_entry(ctx, get_measure(entry.name), entry.settings, entry.loss)


def _headline(record: dict[str, Any], key: str) -> float:
    if record.get("status") != "ok":
        return float("nan")
    return float(record.get("values", {}).get(key, float("nan")))


def _rel_change(value: float, base: float) -> float:
    if not (math.isfinite(value) and math.isfinite(base)):
        return float("nan")
    if base == 0:
        return 0.0 if value == 0 else float("inf")
    return abs(value - base) / abs(base)


def _families(text: str | list[str] | tuple[str, ...]) -> list[str]:
    from flatbench.rescale import FAMILIES

    parts = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    unknown = [p for p in parts if p not in FAMILIES]
    if unknown or not parts:
        what = f"famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown) or '(none)'}"
        raise FlatbenchError(f"unknown {what} (choose from: {', '.join(FAMILIES)})")
    return list(dict.fromkeys(parts))


def transform_checked(ctx: Any, family: str, generator: torch.Generator, max_factor: float,
                      where: str) -> tuple[Any, float]:
    """A fresh context on a transformed copy of ctx.model, after checking the function is unchanged."""
    from flatbench.rescale import function_change, transform

    model = transform(ctx.model, family, generator, 1.0 / max_factor, max_factor)
    for p in model.parameters():
        p.requires_grad_(True)
    change = function_change(ctx.model, model, ctx.inputs, family, ctx.chunk_size)
    tol = FUNCTION_TOL.get(ctx.dtype, 1e-3)
    if not change <= tol:
        dtype = str(ctx.dtype).replace("torch.", "")
        raise FlatbenchError(f"{where}: the {family} transformation changed the logits by {change:.2e} "
                             f"(relative, tolerance {tol:g} for {dtype}); refusing to compare measures of "
                             "different functions (measure in float64 or lower --max-factor)")
    return replace(ctx, model=model, cache={}), change


def _declared(name: str, family: str) -> bool:
    from flatbench.measures.registry import get_measure

    return family in get_measure(name).invariant_to


# ---------------------------------------------------------------- run audit


def audit_run(run_path: Path, *, families: list[str] | str = "layer,node,bn,logit_scale", trials: int = 3,
              measures: list[str] | None = None, device: torch.device | str = "cpu", max_factor: float = 10.0,
              out_dir: Path | None = None, echo: Echo = print) -> pd.DataFrame:
    """Audit one finished run; writes audit.csv and audit.png and returns the rows."""
    from flatbench.measures.runner import build_context
    from flatbench.rescale import applicable_families
    from flatbench.seeding import make_generator

    run_path = Path(run_path)
    if not is_finished(run_path):
        raise FlatbenchError(f"{run_path} is not a finished flatbench run "
                             "(no finished run.json and model.pt)")
    if trials < 1:
        raise FlatbenchError(f"--trials must be at least 1, got {trials}")
    if not max_factor > 1:
        raise FlatbenchError(f"--max-factor must be larger than 1, got {max_factor}")
    fams = _families(families)
    cfg = measure_config(run_path.parent.parent)
    entries = plan_entries(measures, cfg)
    ctx = build_context(run_path, cfg, torch.device(device))
    verdict = applicable_families(ctx.model)
    echo(f"auditing {run_path.name}: {len(entries)} measure entries × {len(fams)} families × {trials} trials "
         f"(factors log-uniform in [1/{max_factor:g}, {max_factor:g}])")
    baseline = {}
    for entry in entries:
        record = _compute(ctx, entry)
        baseline[entry.key] = record
        if record["status"] != "ok":
            echo(f"  {entry.key}: {record['status']} ({record.get('reason') or record.get('error')})")
    rows = []
    for family in fams:
        if verdict[family] is not True:
            echo(f"  {family}: not applicable to this model ({verdict[family]})")
            continue
        for trial in range(trials):
            gen = make_generator("audit", ctx.run_id, family, trial)
            where = f"{run_path.name} {family} trial {trial}"
            sub, change = transform_checked(ctx, family, gen, max_factor, where)
            for entry in entries:
                if baseline[entry.key]["status"] != "ok":
                    continue
                record = _compute(sub, entry)
                value, base = _headline(record, entry.key), _headline(baseline[entry.key], entry.key)
                rows.append({"measure": entry.key, "family": family, "trial": trial, "value": value,
                             "baseline": base, "rel_change": _rel_change(value, base),
                             "declared_invariant": _declared(entry.name, family), "status": record["status"],
                             "function_change": change, "seconds": record["seconds"]})
    frame = pd.DataFrame(rows, columns=["measure", "family", "trial", "value", "baseline", "rel_change",
                                        "declared_invariant", "status", "function_change", "seconds"])
    out = Path(out_dir) if out_dir else run_path
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / AUDIT_CSV, frame.to_csv(index=False))
    order = [e.key for e in entries if baseline[e.key]["status"] == "ok"]
    summary = summarize(frame, order, fams)
    atomic_write_bytes(out / AUDIT_PNG, heatmap_png(summary, title=f"{run_path.name}: median relative change "
                                                                   f"over {trials} trial(s)"))
    echo(format_summary(summary))
    echo(f"wrote {out / AUDIT_CSV} and {out / AUDIT_PNG}")
    return frame


@dataclass
class Summary:
    median: pd.DataFrame
    """measure × family median relative change (NaN where not computed)."""
    declared: pd.DataFrame
    """measure × family: declared invariant (bool)."""
    violations: list[tuple[str, str, float]]


def summarize(frame: pd.DataFrame, measures: list[str], families: list[str]) -> Summary:
    median = pd.DataFrame(np.nan, index=measures, columns=families, dtype=float)
    declared = pd.DataFrame(False, index=measures, columns=families)
    for m in measures:
        name = m.split("@")[0]
        for f in families:
            declared.loc[m, f] = _declared(name, f)
    if len(frame):
        ok = frame[frame["status"] == "ok"]
        for (m, f), group in ok.groupby(["measure", "family"]):
            if m in median.index and f in median.columns:
                median.loc[m, f] = float(np.median(group["rel_change"].to_numpy(dtype=float)))
    violations = [(m, f, float(median.loc[m, f])) for m in measures for f in families
                  if declared.loc[m, f] and not math.isnan(median.loc[m, f])
                  and not median.loc[m, f] < INVARIANCE_RTOL]
    return Summary(median, declared, violations)


def format_summary(summary: Summary) -> str:
    med, dec = summary.median, summary.declared
    width = max([len("measure")] + [len(m) for m in med.index])
    head = f"{'measure':{width}}  " + "  ".join(f"{f:>12}" for f in med.columns)
    lines = [head, "-" * len(head)]
    flagged = {(m, f) for m, f, _ in summary.violations}
    for m in med.index:
        cells = []
        for f in med.columns:
            v = med.loc[m, f]
            text = "n/a" if math.isnan(v) else f"{v:.1e}"
            mark = "*" if dec.loc[m, f] else " "
            if (m, f) in flagged:
                mark = "!"
            cells.append(f"{text:>11}{mark}")
        lines.append(f"{m:{width}}  " + "  ".join(cells))
    lines.append("median relative change; * declared invariant; ! declared invariant but changed by "
                 f"≥ {INVARIANCE_RTOL:g}")
    if summary.violations:
        lines.append(f"{len(summary.violations)} declared invariance(s) not met: "
                     + ", ".join(f"{m} under {f} ({v:.1e})" for m, f, v in summary.violations))
    return "\n".join(lines)


def heatmap_png(summary: Summary, title: str = "") -> bytes:
    import io

    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    med = summary.median
    n_rows, n_cols = med.shape
    data = med.to_numpy(dtype=float)
    shown = np.where(np.isnan(data), np.nan, np.clip(data, HEATMAP_FLOOR, None))
    finite = shown[np.isfinite(shown)]
    vmax = max(1.0, float(finite.max())) if finite.size else 1.0
    fig = Figure(figsize=(2.0 + 1.25 * max(n_cols, 1), 1.2 + 0.38 * max(n_rows, 1)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("#d9d9d9")
    image = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=LogNorm(vmin=HEATMAP_FLOOR, vmax=vmax),
                      aspect="auto")
    for i in range(n_rows):
        for j in range(n_cols):
            v = data[i, j]
            text = "n/a" if math.isnan(v) else ("0" if v == 0 else f"{v:.0e}")
            # viridis is dark at the low end: white text there, black on the bright end and on grey n/a
            position = 0.0 if math.isnan(v) else (math.log10(shown[i, j] / HEATMAP_FLOOR)
                                                   / math.log10(vmax / HEATMAP_FLOOR))
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    color="white" if not math.isnan(v) and position < 0.6 else "black")
            if summary.declared.iloc[i, j]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#e41a1c",
                                       linewidth=2))
    ax.set_xticks(range(n_cols), list(med.columns), fontsize=8)
    ax.set_yticks(range(n_rows), list(med.index), fontsize=8)
    ax.set_xlabel("transformation family (red frame: declared invariant)", fontsize=8)
    fig.colorbar(image, ax=ax, label="median |Δ| / |baseline|")
    if title:
        ax.set_title(title, fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130)
    fig.clear()
    return buf.getvalue()


# ---------------------------------------------------------------- population audit


def audit_population(exp_dir: Path, *, family: str = "node", measures: list[str] | None = None,
                     device: torch.device | str = "cpu", max_factor: float = 100.0, gap: str | None = None,
                     out_dir: Path | None = None, echo: Echo = print) -> pd.DataFrame:
    """Transform every run once, recompute the measures and compare their correlations with the gap."""
    from scipy.stats import kendalltau

    from flatbench.measures.registry import get_measure
    from flatbench.measures.runner import build_context
    from flatbench.rescale import applicable_families
    from flatbench.seeding import make_generator

    exp_dir = Path(exp_dir)
    if not (exp_dir / "runs").is_dir():
        raise FlatbenchError(f"{exp_dir} is not a flatbench experiment folder (no runs/ inside)")
    fams = _families(family)
    if len(fams) != 1:
        raise FlatbenchError(f"--family takes one family for the population audit, got {family!r}")
    fam = fams[0]
    if not max_factor > 1:
        raise FlatbenchError(f"--max-factor must be larger than 1, got {max_factor}")
    gap = gap or report_gap(exp_dir)
    gap_col = {"acc": "gap_acc", "loss": "gap_loss"}.get(gap)
    if gap_col is None:
        raise FlatbenchError(f"gap must be acc or loss, got {gap!r}")
    runs = [p for p in _study_run_dirs(exp_dir) if is_finished(p)]
    if len(runs) < MIN_RUNS:
        raise FlatbenchError(f"{exp_dir} has {len(runs)} finished run(s); the population audit needs at "
                             f"least {MIN_RUNS}")
    cfg = measure_config(exp_dir)
    entries = plan_entries(measures, cfg)
    echo(f"population audit of {exp_dir.name}: {len(runs)} runs, one {fam} transformation each "
         f"(factors log-uniform in [1/{max_factor:g}, {max_factor:g}]), {len(entries)} measure entries")
    rows = []
    for i, run_path in enumerate(runs, 1):
        t0 = time.perf_counter()
        info = read_json(run_path / RUN_JSON)
        stored = read_json(run_path / MEASURES_JSON) if (run_path / MEASURES_JSON).is_file() else {}
        ctx = build_context(run_path, cfg, torch.device(device))
        verdict = applicable_families(ctx.model)[fam]
        if verdict is not True:
            raise FlatbenchError(f"{run_path.name}: the {fam} family does not apply ({verdict}); "
                                 "choose another --family")
        sub, _change = transform_checked(ctx, fam, make_generator("audit_population", ctx.run_id, fam),
                                         max_factor, run_path.name)
        gap_value = float(info.get(gap_col, float("nan")))
        for entry in entries:
            original = stored.get(entry.key)
            source = "measures.json"
            if not original or original.get("status") != "ok" or entry.key not in original.get("values", {}):
                original, source = _compute(ctx, entry), "computed"
            transformed = _compute(sub, entry)
            v0, v1 = _headline(original, entry.key), _headline(transformed, entry.key)
            rows.append({"run_id": run_path.name, "measure": entry.key, "original": v0, "transformed": v1,
                         "rel_change": _rel_change(v1, v0), "gap": gap_value, "status": transformed["status"],
                         "original_source": source})
        echo(f"  [{i}/{len(runs)}] {run_path.name} ({time.perf_counter() - t0:.1f}s)")
    per_run = pd.DataFrame(rows)
    out = Path(out_dir) if out_dir else exp_dir
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / POPULATION_CSV, per_run.to_csv(index=False))
    corr_rows = []
    for entry in entries:
        part = per_run[per_run["measure"] == entry.key]
        sign = 1.0 if get_measure(entry.name).larger_is_sharper else -1.0
        row: dict[str, Any] = {"measure": entry.key, "family": fam,
                               "declared_invariant": _declared(entry.name, fam)}
        for which in ("original", "transformed"):
            x = part[which].to_numpy(dtype=float) * sign
            y = part["gap"].to_numpy(dtype=float)
            ok = np.isfinite(x) & np.isfinite(y)
            tau = p = float("nan")
            if ok.sum() >= MIN_RUNS and np.ptp(x[ok]) > 0 and np.ptp(y[ok]) > 0:
                res = kendalltau(x[ok], y[ok])
                tau, p = float(res.statistic), float(res.pvalue)
            row[f"tau_{which}"], row[f"p_{which}"] = tau, p
            row["n"] = int(ok.sum()) if which == "original" else min(row["n"], int(ok.sum()))
        row["delta"] = row["tau_transformed"] - row["tau_original"]
        row["median_rel_change"] = float(np.nanmedian(part["rel_change"].to_numpy(dtype=float))) \
            if part["rel_change"].notna().any() else float("nan")
        corr_rows.append(row)
    corr = pd.DataFrame(corr_rows, columns=["measure", "family", "n", "tau_original", "tau_transformed",
                                            "delta", "p_original", "p_transformed", "median_rel_change",
                                            "declared_invariant"])
    atomic_write_text(out / CORRELATIONS_CSV, corr.to_csv(index=False))
    atomic_write_bytes(out / CORRELATIONS_PNG, correlation_bars_png(corr, gap, fam))
    echo(format_correlations(corr, gap, fam))
    echo(f"wrote {out / CORRELATIONS_CSV}, {out / CORRELATIONS_PNG} and {out / POPULATION_CSV}")
    return corr


def format_correlations(corr: pd.DataFrame, gap: str, family: str) -> str:
    width = max([len("measure")] + [len(m) for m in corr["measure"]])
    head = (f"{'measure':{width}}  {'n':>3}  {'τ original':>11}  {'τ ' + family:>11}  {'Δτ':>7}  "
            "median rel. change")
    lines = [f"Kendall τ with the {gap} gap, before and after one {family} transformation per run", head,
             "-" * len(head)]
    def fmt(v: float) -> str:
        return "n/a" if not math.isfinite(v) else f"{v:+.3f}"

    for _, r in corr.iterrows():
        mark = "*" if r["declared_invariant"] else " "
        rel = r["median_rel_change"]
        lines.append(f"{r['measure']:{width}}  {r['n']:>3}  {fmt(r['tau_original']):>11}  "
                     f"{fmt(r['tau_transformed']):>11}  {fmt(r['delta']):>7}  "
                     f"{'n/a' if not math.isfinite(rel) else f'{rel:.1e}'}{mark}")
    lines.append(f"* declared invariant to {family}")
    return "\n".join(lines)


def correlation_bars_png(corr: pd.DataFrame, gap: str, family: str) -> bytes:
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(corr)
    fig = Figure(figsize=(6.4, 1.0 + 0.42 * max(n, 1)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    y = np.arange(n)
    before = corr["tau_original"].to_numpy(dtype=float)
    after = corr["tau_transformed"].to_numpy(dtype=float)
    ax.barh(y - 0.2, np.nan_to_num(before), height=0.38, color="#4d4d4d", label="original")
    ax.barh(y + 0.2, np.nan_to_num(after), height=0.38, color="#bdbdbd", edgecolor="black", hatch="//",
            label=f"after {family} transformation")
    labels = [f"{m}{' *' if d else ''}" for m, d in zip(corr["measure"], corr["declared_invariant"])]
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlim(-1, 1)
    ax.set_xlabel(f"Kendall τ with the {gap} gap (* declared invariant to {family})", fontsize=8)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside upper center", ncols=2)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130)
    fig.clear()
    return buf.getvalue()
