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

from flatbench.analysis import plots
from flatbench.analysis.audit_tables import format_correlations, format_summary, summarize
from flatbench.analysis.stats import MIN_RUNS, gap_column, kendall_batch, kendall_permutation_p, usable
from flatbench.errors import FlatbenchError
from flatbench.measures.keys import entry_keys, parse_key
from flatbench.store import (MEASURES_JSON, RUN_JSON, STUDY_FILE, atomic_write_bytes, atomic_write_text,
                             is_finished, list_run_dirs, read_json)

AUDIT_CSV = "audit.csv"
AUDIT_PNG = "audit.png"
POPULATION_CSV = "audit_population.csv"
CORRELATIONS_CSV = "audit_correlations.csv"
CORRELATIONS_PNG = "audit_correlations.png"

FUNCTION_TOL = {torch.float64: 1e-8, torch.float32: 1e-3}
"""Largest relative change of the logits accepted as 'the same function' (per measurement dtype)."""

Echo = Callable[[str], None]


# ---------------------------------------------------------------- shared pieces


def _saved_study(exp_dir: Path) -> Any:
    """The experiment's saved study, or None when it has none (an older or hand-made folder)."""
    from flatbench.study.spec import read_saved_study

    return read_saved_study(exp_dir) if (Path(exp_dir) / STUDY_FILE).is_file() else None


def _study_run_dirs(exp_dir: Path) -> list[Path]:
    """The run folders of the experiment's current study (those of an earlier config left out), or every
    run folder when the experiment has no saved study."""
    from flatbench.store import run_dir

    study = _saved_study(exp_dir)
    return list_run_dirs(exp_dir) if study is None else [run_dir(exp_dir, rid) for rid in study.run_ids()]


def measure_config(exp_dir: Path) -> Any:
    """The experiment's measure config (defaults when it has no saved study)."""
    from flatbench.config import MeasureConfig

    study = _saved_study(exp_dir)
    return MeasureConfig() if study is None else study.measure


def report_gap(exp_dir: Path) -> str:
    study = _saved_study(exp_dir)
    return "acc" if study is None else study.report.gap


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
    from flatbench.measures.runner import check_settings

    chosen = resolve_names(names or list(cfg.measures))
    check_settings(chosen, cfg)
    entries = []
    for name in chosen:
        spec = get_measure(name)
        settings = spec.settings(cfg.settings)
        entries += [Entry(key, name, loss, settings) for loss, key in entry_keys(name, spec, cfg.losses)]
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


def _declared(key: str, family: str) -> bool:
    """Whether the measure behind a result key (or a measure name) declares invariance to `family`; a
    variant (e.g. a solver stopped early) declares none."""
    from flatbench.measures.registry import get_measure

    spec = get_measure(parse_key(key).measure)
    return not spec.base and family in spec.invariant_to


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
    summary = summarize(frame, order, fams, _declared)
    atomic_write_bytes(out / AUDIT_PNG, plots.audit_heatmap_figure(summary, title=f"{run_path.name}: median relative change "
                                                                   f"over {trials} trial(s)"))
    echo(format_summary(summary))
    echo(f"wrote {out / AUDIT_CSV} and {out / AUDIT_PNG}")
    return frame


# ---------------------------------------------------------------- population audit


def audit_population(exp_dir: Path, *, family: str = "node", measures: list[str] | None = None,
                     device: torch.device | str = "cpu", max_factor: float = 100.0, gap: str | None = None,
                     out_dir: Path | None = None, echo: Echo = print) -> pd.DataFrame:
    """Transform every run once, recompute the measures and compare their correlations with the gap."""
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
    if gap not in ("acc", "loss"):
        raise FlatbenchError(f"gap must be acc or loss, got {gap!r}")
    gap_col = gap_column(gap)
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
            if usable(x[ok], y[ok]):
                tau = float(kendall_batch(x[ok][None, :], y[ok][None, :])[0])
                p = kendall_permutation_p(x[ok], y[ok])
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
    atomic_write_bytes(out / CORRELATIONS_PNG, plots.audit_correlations_figure(corr, gap, fam))
    echo(format_correlations(corr, gap, fam))
    echo(f"wrote {out / CORRELATIONS_CSV}, {out / CORRELATIONS_PNG} and {out / POPULATION_CSV}")
    return corr
