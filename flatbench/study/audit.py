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

The population audit over a whole experiment is `flatbench.study.population`'s; both share the
pieces here (the measure config of a study, the entries to compute). Both measure their transformed copies
as targets (`measures.targets.Rescaling`), loaded and checked where the measure stage loads its models
(`measures.runner.load_context`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from flatbench.analysis import plots
from flatbench.analysis.audit_tables import format_summary, summarize
from flatbench.config import MeasureConfig
from flatbench.errors import Echo, FlatbenchError
from flatbench.measures.keys import parse_key
from flatbench.measures.registry import get_measure, load_plugins, resolve_names
from flatbench.measures.runner import (FUNCTION_CHANGE, check_settings, compute_entry, context_in, entry_dtype,
                                       load_context, plan_context, plan_measures)
from flatbench.measures.targets import Rescaling
from flatbench.measures.contract import declares, rel_change
from flatbench.rescale import FAMILIES, applicable_families
from flatbench.store import (STUDY_FILE, atomic_write_bytes, atomic_write_text, is_finished, list_run_dirs,
                             run_dir)
from flatbench.study.spec import read_saved_study

AUDIT_CSV = "audit.csv"
AUDIT_PNG = "audit.png"

# ---------------------------------------------------------------- shared pieces


def saved_study(exp_dir: Path) -> Any:
    """The experiment's saved study, or None when it has none (an older or hand-made folder)."""
    return read_saved_study(exp_dir) if (Path(exp_dir) / STUDY_FILE).is_file() else None


def study_run_dirs(exp_dir: Path) -> list[Path]:
    """The run folders of the experiment's current study (those of an earlier config left out), or every
    run folder when the experiment has no saved study."""
    study = saved_study(exp_dir)
    return list_run_dirs(exp_dir) if study is None else [run_dir(exp_dir, rid) for rid in study.run_ids()]


def measure_config(exp_dir: Path, plugins: tuple[str, ...] = ()) -> Any:
    """The experiment's measure config (defaults when it has no saved study), with `plugins` added to its
    `measure.plugins` (and all of them loaded)."""
    study = saved_study(exp_dir)
    cfg = MeasureConfig() if study is None else study.measure
    if plugins:
        cfg = replace(cfg, plugins=tuple(dict.fromkeys((*cfg.plugins, *plugins))))
    load_plugins(cfg.plugins)
    return cfg


def report_gap(exp_dir: Path) -> str:
    study = saved_study(exp_dir)
    return "acc" if study is None else study.report.gap


@dataclass(frozen=True)
class Entry:
    key: str
    """The result key: the measure's name, `name@loss` for a loss other than ce."""
    name: str
    loss: str | None
    settings: dict
    dtype: str = "float64"
    """The dtype it is computed in (`measures.runner.entry_dtype` of the study's `measure.dtype`)."""
    context: dict | None = field(default=None, compare=False)
    """Its measurement context as the measure stage records it (`measures.runner.measurement_context`),
    planned once: what decides whether a stored value is the one the audit computes."""


def plan_entries(names: list[str] | None, cfg: Any) -> list[Entry]:
    """Measures (default: the study's) × configured losses, planned as the measure stage plans them
    (`measures.runner.plan_measures`), as plain data that travels to a worker process."""
    chosen = resolve_names(names or list(cfg.measures))
    check_settings(chosen, cfg)
    planned, dtype = plan_measures(chosen, cfg), cfg.dtype  # (the config is not handed to the comprehension)
    return [Entry(key, m.spec.name, loss, m.settings, entry_dtype(dtype, m.spec), m.context)
            for m in planned for loss, key in m.keys]


def measure_entry(ctx: Any, entry: Entry) -> dict[str, Any]:
    """One entry's record on `ctx` (`measures.runner.compute_entry` with the entry's measure and settings, in
    the entry's dtype: a float32 entry gets ctx's float32 twin, `measures.runner.context_in`)."""
    return compute_entry(context_in(ctx, entry.dtype), get_measure(entry.name), entry.settings, entry.loss)


def headline(record: dict[str, Any], key: str) -> float:
    if record.get("status") != "ok":
        return float("nan")
    return float(record.get("values", {}).get(key, float("nan")))


def parse_families(text: str | list[str] | tuple[str, ...]) -> list[str]:
    parts = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    unknown = [p for p in parts if p not in FAMILIES]
    if unknown or not parts:
        what = f"famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown) or '(none)'}"
        raise FlatbenchError(f"unknown {what} (choose from: {', '.join(FAMILIES)})")
    return list(dict.fromkeys(parts))


def declared_invariant(key: str, family: str) -> bool:
    """Whether the measure behind a result key (or a measure name) declares invariance to `family`
    (`contract.declares`)."""
    return declares(get_measure(parse_key(key).measure), family)


# ---------------------------------------------------------------- run audit


def audit_run(run_path: Path, *, families: list[str] | str = "layer,node,bn,logit_scale", trials: int = 3,
              measures: list[str] | None = None, device: torch.device | str = "cpu", max_factor: float = 10.0,
              out_dir: Path | None = None, echo: Echo = print, plugins: tuple[str, ...] = ()) -> pd.DataFrame:
    """Audit one finished run; writes audit.csv and audit.png and returns the rows. `plugins`: measure
    plugins to load besides the study's `measure.plugins`."""
    run_path = Path(run_path)
    if not is_finished(run_path):
        raise FlatbenchError(f"{run_path} is not a finished flatbench run (no finished run.json and model.pt)")
    if trials < 1:
        raise FlatbenchError(f"--trials must be at least 1, got {trials}")
    if not max_factor > 1:
        raise FlatbenchError(f"--max-factor must be larger than 1, got {max_factor}")
    fams = parse_families(families)
    cfg = measure_config(run_path.parent.parent, plugins)
    entries, plan = plan_entries(measures, cfg), plan_context(run_path, cfg)
    ctx = load_context(plan, torch.device(device))
    verdict = applicable_families(ctx.model)
    echo(f"auditing {run_path.name}: {len(entries)} measure entries × {len(fams)} families × {trials} trials "
         f"(factors log-uniform in [1/{max_factor:g}, {max_factor:g}])")
    baseline = {entry.key: measure_entry(ctx, entry) for entry in entries}
    for key, record in baseline.items():
        if record["status"] != "ok":
            echo(f"  {key}: {record['status']} ({record.get('reason') or record.get('error')})")
    rows = []
    for family in fams:
        if verdict[family] is not True:
            echo(f"  {family}: not applicable to this model ({verdict[family]})")
            continue
        for trial in range(trials):
            rescaling = Rescaling(family, max_factor, trial, ("audit", ctx.run_id, family, trial))
            sub = load_context(plan.rescaled(rescaling), ctx.device, base=ctx)
            for entry in entries:
                if baseline[entry.key]["status"] != "ok":
                    continue
                record = measure_entry(sub, entry)
                value, base = headline(record, entry.key), headline(baseline[entry.key], entry.key)
                rows.append({"measure": entry.key, "family": family, "trial": trial, "value": value,
                             "baseline": base, "rel_change": rel_change(base, value),
                             "declared_invariant": declared_invariant(entry.name, family),
                             "status": record["status"], "function_change": sub.cache[FUNCTION_CHANGE],
                             "seconds": record["seconds"]})
    frame = pd.DataFrame(rows, columns=["measure", "family", "trial", "value", "baseline", "rel_change",
                                        "declared_invariant", "status", "function_change", "seconds"])
    out = Path(out_dir) if out_dir else run_path
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / AUDIT_CSV, frame.to_csv(index=False))
    order = [e.key for e in entries if baseline[e.key]["status"] == "ok"]
    summary = summarize(frame, order, fams, declared_invariant)
    atomic_write_bytes(out / AUDIT_PNG, plots.audit_heatmap_figure(summary, title=f"{run_path.name}: median relative change "
                                                                   f"over {trials} trial(s)"))
    echo(format_summary(summary))
    echo(f"wrote {out / AUDIT_CSV} and {out / AUDIT_PNG}")
    return frame
