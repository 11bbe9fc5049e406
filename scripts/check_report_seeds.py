"""Do two report seeds give the same best-group labels? For every study given (default: every committed
study under results/cpu/ with a correlations.csv),
the statistics are computed as `flatbench report` computes them (the study's report settings, its current
runs) with `--seed 1` and `--seed 2`, nothing is written, and the labels that differ are printed, each
with whether both seeds mark it borderline (which the report then says).

    python scripts/check_report_seeds.py [EXPERIMENT_DIR ...] [--seeds 1 2]

Exit status 1 when a label differs without being marked borderline under both seeds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def labels(exp: Path, seed: int):
    from flatbench import store
    from flatbench.analysis.stats import analyze
    from flatbench.analysis.table import build_table, load_records
    from flatbench.config import ReportConfig
    from flatbench.study.spec import read_saved_study

    cfg, current = ReportConfig(), None
    if (exp / store.STUDY_FILE).is_file():
        study = read_saved_study(exp)
        cfg, current = study.report, set(study.run_ids())
    records = [r for r in load_records([exp]) if current is None or r.run_id in current]
    table = build_table([exp], records=records)
    corr = analyze(table, gap=cfg.gap, min_train_acc=cfg.min_train_acc, seed=seed).correlations
    return corr.set_index("measure")[["kendall_tau", "vs_best", "vs_best_p_holm", "vs_best_borderline"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="*")
    parser.add_argument("--seeds", nargs=2, type=int, default=[1, 2])
    args = parser.parse_args()
    exps = [Path(e) for e in args.experiments] or sorted(
        p.parent for p in (ROOT / "results" / "cpu").glob("*/correlations.csv"))
    bad = 0
    for exp in exps:
        t0 = time.perf_counter()
        a, b = (labels(exp, s) for s in args.seeds)
        differ = [m for m in a.index if str(a.loc[m, "vs_best"]) != str(b.loc[m, "vs_best"])]
        border = sorted(m for m in a.index if bool(a.loc[m, "vs_best_borderline"]) or bool(b.loc[m, "vs_best_borderline"]))
        group = [m for m in a.index if a.loc[m, "vs_best"] in ("best", "indistinguishable")]
        print(f"{exp.name}: seeds {args.seeds[0]} and {args.seeds[1]}: {len(differ)} label(s) differ "
              f"of {int((a['vs_best'] != '').sum())}; best group (seed {args.seeds[0]}) {len(group)}: "
              f"{', '.join(group)}; borderline: {', '.join(border) or 'none'} "
              f"({time.perf_counter() - t0:.1f} s)")
        for m in differ:
            marked = bool(a.loc[m, "vs_best_borderline"]) and bool(b.loc[m, "vs_best_borderline"])
            bad += not marked
            print(f"  {m}: {a.loc[m, 'vs_best']} (Holm p {a.loc[m, 'vs_best_p_holm']:.4f}) vs "
                  f"{b.loc[m, 'vs_best']} (Holm p {b.loc[m, 'vs_best_p_holm']:.4f})"
                  f"{' - marked borderline in both' if marked else ' - NOT marked borderline'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
