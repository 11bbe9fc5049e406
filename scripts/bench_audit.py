"""Time the population audit per run: the old way (one transformed copy per call, its context rebuilt from
disk and its untransformed values read or computed again for every copy) against the new pass (one
context and one set of untransformed values per run, every (range, draw) copy measured on it).

    python scripts/bench_audit.py EXPERIMENT_DIR [--runs 2] [--draws 3] [--max-factors 2,100] [--measures a,b]

Prints, per run, the seconds of both ways and the seconds per transformed copy, after one untimed warm-up
pass of every measure on the first run. The values of the two ways are checked to be identical (each copy is
measured alone in both).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    from flatbench.measures.runner import build_context, load_context, plan_context
    from flatbench.rescale import applicable_families
    from flatbench.store import MEASURES_JSON, is_finished, read_json
    from flatbench.study import audit as A
    from flatbench.study import population as P

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--draws", type=int, default=P.DEFAULT_DRAWS)
    p.add_argument("--max-factors", default="2,100")
    p.add_argument("--family", default="node")
    p.add_argument("--measures", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    exp = Path(args.experiment)
    factors = P.parse_max_factors(args.max_factors)
    cfg = A.measure_config(exp)
    entries = A.plan_entries(args.measures.split(",") if args.measures else None, cfg)
    gap_col = "gap_" + A.report_gap(exp)
    runs = [r for r in A.study_run_dirs(exp) if is_finished(r)][:args.runs]
    copies = len(factors) * args.draws
    print(f"{exp.name}: {len(runs)} run(s), {len(entries)} measure entries, {copies} copies per run "
          f"({args.draws} draws x F in {', '.join(f'{f:g}' for f in factors)}), torch threads "
          f"{torch.get_num_threads()}")
    # warm-up (imports, first dataset load, compiled kernels), so that neither way pays it
    ctx = build_context(runs[0], cfg, torch.device("cpu"))
    for entry in entries:
        A.measure_entry(ctx, entry)
    totals = {"old": 0.0, "new": 0.0}
    for run in runs:
        # old: what the single-draw audit did for its one copy, once per copy
        t0 = time.perf_counter()
        old_values = {}
        for factor in factors:
            for draw in range(args.draws):
                stored = read_json(run / MEASURES_JSON) if (run / MEASURES_JSON).is_file() else {}
                ctx = build_context(run, cfg, torch.device("cpu"))
                assert applicable_families(ctx.model)[args.family] is True
                for entry in entries:
                    original = stored.get(entry.key)
                    if not original or original.get("status") != "ok" or entry.key not in original.get("values", {}):
                        A.measure_entry(ctx, entry)
                copy = P.population_rescaling(ctx.run_id, args.family, factor, draw)
                sub = load_context(plan_context(run, cfg).rescaled(copy), ctx.device, ctx)
                for entry in entries:
                    old_values[(entry.key, factor, draw)] = A.headline(A.measure_entry(sub, entry), entry.key)
        t_old = time.perf_counter() - t0
        # new: the audit's one pass over the run
        t0 = time.perf_counter()
        rows = P._audit_one_run(plan_context(run, cfg), entries, args.family, factors, args.draws, gap_col,
                                "bench", "cpu")
        t_new = time.perf_counter() - t0
        new_values = {(r["measure"], r["max_factor"], r["draw"]): r["transformed"] for r in rows}
        same = all((old_values[k] == v) or (old_values[k] != old_values[k] and v != v) for k, v in new_values.items())
        totals["old"] += t_old
        totals["new"] += t_new
        print(f"  {run.name}: old {t_old:.1f}s ({t_old / copies:.2f}s per copy), new {t_new:.1f}s "
              f"({t_new / copies:.2f}s per copy), values identical: {same}")
    n = max(len(runs), 1)
    print(f"mean per run: old {totals['old'] / n:.1f}s ({totals['old'] / n / copies:.2f}s per copy), "
          f"new {totals['new'] / n:.1f}s ({totals['new'] / n / copies:.2f}s per copy); "
          f"speed-up x{totals['old'] / max(totals['new'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
