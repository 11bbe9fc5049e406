"""Does computing the estimates in float32 (`measure.dtype: auto`) change a study's verdict? For each study
given (a folder written by `flatbench run`, its weights present), every entry that `auto` computes in
float32 (the measures registered with precision="float32") and every published-solver entry (whose
normalized-sharpness steps run in float32, `published_dtype`) is computed again in float64 on a copy of the
study, and the two verdicts are compared: each entry's largest relative change over the runs, its Kendall τ
with the gap and its best-group label (Holm, the report's seed 0), as `flatbench report` computes them.

    python scripts/check_precision.py results/cpu/yi_mnist [...] --out /tmp/precision [--workers 2]

Prints one table per study and a summary line; exit status 1 if a τ or a label differs. Nothing under the
studies is changed (the float64 values go to the copies under --out).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flatbench.measures.keys import entry_keys  # noqa: E402
from flatbench.measures.registry import get_measure, resolve_names  # noqa: E402
from flatbench.measures.runner import build_context, compute_entry, measurement_context  # noqa: E402
from flatbench.store import atomic_write_json, is_finished, list_run_dirs, read_json  # noqa: E402
from flatbench.study.audit import measure_config  # noqa: E402
from flatbench.study.workers import run_jobs  # noqa: E402

PUBLISHED_FLOAT64 = {"published_dtype": "float64"}


def changed_entries(cfg) -> list[tuple[str, str | None, str, dict]]:
    """(measure, loss, result key, float64 settings) of every entry whose numeric path `auto` changed."""
    out = []
    for name in resolve_names(list(cfg.measures)):
        spec = get_measure(name)
        published = spec.base in ("normalized_sharpness", "normalized_sharpness_nce") and \
            spec.preset.get("solver") == "published"
        if spec.precision != "float32" and not published:
            continue
        settings = spec.settings(cfg.settings)
        if published:
            settings = {**settings, **PUBLISHED_FLOAT64}
        out += [(name, loss, key, settings) for loss, key in entry_keys(name, spec, cfg.losses)]
    return out


def recompute_in_float64(run_dir: str) -> str:
    """Write the float64 values of the changed entries into the copy's measures.json; returns the run."""
    run = Path(run_dir)
    cfg = replace(measure_config(run.parent.parent), dtype="float64")
    ctx = build_context(run, cfg, torch.device("cpu"))
    results = read_json(run / "measures.json")
    for name, loss, key, settings in changed_entries(cfg):
        spec = get_measure(name)
        record = compute_entry(ctx, spec, settings, loss)
        record["context"] = measurement_context(cfg, spec)
        results[key] = record
    atomic_write_json(run / "measures.json", results)
    return run.name


def verdict(exp: Path):
    from flatbench.analysis.stats import analyze
    from flatbench.analysis.table import build_table, load_records
    from flatbench.study.spec import read_saved_study

    study = read_saved_study(exp)
    records = [r for r in load_records([exp]) if r.run_id in set(study.run_ids())]
    table = build_table([exp], records=records)
    corr = analyze(table, gap=study.report.gap, min_train_acc=study.report.min_train_acc, seed=0).correlations
    return table, corr.set_index("measure")


def compare(original: Path, copy: Path) -> tuple[list[str], int]:
    table_a, corr_a = verdict(original)
    table_b, corr_b = verdict(copy)
    cfg = measure_config(original)
    keys = [key for _, _, key, _ in changed_entries(cfg)]
    lines = ["| entry | largest relative change | τ (auto) | τ (float64) | label (auto) | label (float64) |",
             "| --- | ---: | ---: | ---: | --- | --- |"]
    differ = 0
    for key in keys:
        if key not in corr_a.index or key not in table_a:
            continue
        a, b = table_a[key].astype(float), table_b[key].astype(float)
        rel = ((a - b).abs() / b.abs().where(b.abs() > 0, 1.0)).max()
        ta, tb = float(corr_a.loc[key, "kendall_tau"]), float(corr_b.loc[key, "kendall_tau"])
        la, lb = str(corr_a.loc[key, "vs_best"]), str(corr_b.loc[key, "vs_best"])
        same = (ta == tb or (ta != ta and tb != tb)) and la == lb
        differ += not same
        lines.append(f"| `{key}` | {rel:.1e} | {ta:.4f} | {tb:.4f} | {la} | {lb} |" + ("" if same else " **differs**"))
    # the best-group labels of every other measure can move when a float32 measure is the best
    others = [k for k in corr_a.index if k not in keys and k in corr_b.index
              and str(corr_a.loc[k, "vs_best"]) != str(corr_b.loc[k, "vs_best"])]
    for key in others:
        differ += 1
        lines.append(f"| `{key}` (unchanged values) | 0 | {float(corr_a.loc[key, 'kendall_tau']):.4f} | "
                     f"{float(corr_b.loc[key, 'kendall_tau']):.4f} | {corr_a.loc[key, 'vs_best']} | "
                     f"{corr_b.loc[key, 'vs_best']} | **differs**")
    return lines, differ


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="+")
    p.add_argument("--out", required=True, help="where the float64 copies go")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    total_differ = 0
    for folder in args.studies:
        original = Path(folder)
        copy = Path(args.out) / original.name
        if copy.exists():
            shutil.rmtree(copy)
        shutil.copytree(original, copy)
        runs = [str(r) for r in list_run_dirs(copy) if is_finished(r)]
        run_jobs(recompute_in_float64, [(r,) for r in runs], args.workers, torch.device("cpu"),
                 lambda job, name: None)
        lines, differ = compare(original, copy)
        total_differ += differ
        print(f"\n{original.name}: {len(runs)} runs, {differ} entries whose τ or label differ")
        print("\n".join(lines))
    print(f"\n{total_differ} differences over {len(args.studies)} studies")
    return 1 if total_differ else 0


if __name__ == "__main__":
    sys.exit(main())
