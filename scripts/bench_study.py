"""Where a study's time goes: seconds per stage (data, train, measure, report) and per measure, per run.

    python scripts/bench_study.py configs/quickstart.yaml                     # CPU, a fresh temporary folder
    python scripts/bench_study.py configs/quickstart.yaml --device cuda
    python scripts/bench_study.py configs/cpu/yi_mnist.yaml --workers 2 train.epochs=50
    python scripts/bench_study.py configs/quickstart.yaml --compare-workers 2

It runs the stages exactly as `flatbench run` does (`flatbench.study`), in a temporary results folder (or
`--out`), and prints one table: wall-clock seconds of each stage and per run (per model for the measure
stage, which also measures snapshots), then each measure's total and per-model seconds as its
measures.json entries recorded them. `--compare-workers N` runs the same study a second time with
`--workers N` (train.workers and measure.workers) and prints the two side by side, with the ratios.
Timings are wall clock on whatever else the machine is doing: run it on a quiet machine, and compare
ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbench.config import load_study  # noqa: E402
from flatbench.errors import FlatbenchError  # noqa: E402
from flatbench.store import MEASURES_JSON, list_run_dirs  # noqa: E402
from flatbench.study.measure import measure_study  # noqa: E402
from flatbench.study.report import report_study  # noqa: E402
from flatbench.study.spec import check_data, check_study  # noqa: E402
from flatbench.study.train import train_study  # noqa: E402
from flatbench.training import resolve_device  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, as on the flatbench command line")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--out", default=None, help="results root (default: a temporary folder, removed after)")
    p.add_argument("--workers", type=int, default=None, help="train.workers and measure.workers")
    p.add_argument("--compare-workers", type=int, default=None,
                   help="also run with this many workers and print both")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for this process")
    return p.parse_args()


def bench(config: str, overrides: list[str], device: torch.device, out: Path) -> dict:
    """Run the study's stages in `out`; returns seconds per stage, per measure entry and counts."""
    study = load_study(config, overrides, out=str(out))
    check_study(study)
    quiet = lambda _line: None  # noqa: E731
    t0 = time.perf_counter()
    check_data(study)
    t_data = time.perf_counter() - t0
    t0 = time.perf_counter()
    train_study(study, device, quiet=True, echo=quiet)
    t_train = time.perf_counter() - t0
    t0 = time.perf_counter()
    counts = measure_study(study, device, quiet=True, echo=quiet)
    t_measure = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        report_study([study.exp_dir], echo=quiet, quiet=True)
        t_report = time.perf_counter() - t0
    except FlatbenchError as exc:  # e.g. fewer than 3 runs: the other stages are still timed
        print(f"report not written: {exc}")
        t_report = float("nan")
    per_measure: dict[str, float] = defaultdict(float)
    for run in list_run_dirs(study.exp_dir):
        for path in [run / MEASURES_JSON, *run.glob(f"snapshots/*/{MEASURES_JSON}")]:
            if path.is_file():
                for key, entry in json.loads(path.read_text()).items():
                    per_measure[key] += float(entry.get("seconds") or 0.0)
    return {"runs": len(study.runs), "models": counts.measured, "data": t_data, "train": t_train,
            "measure": t_measure, "report": t_report, "per_measure": dict(per_measure)}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="flatbench-bench-"))
    settings = [("workers 1" if args.compare_workers else "", args.workers)]
    if args.compare_workers:
        settings.append((f"workers {args.compare_workers}", args.compare_workers))
    results = []
    try:
        for i, (_label, workers) in enumerate(settings):
            extra = [f"train.workers={workers}", f"measure.workers={workers}"] if workers else []
            results.append(bench(args.config, [*args.overrides, *extra], device, base / f"bench{i}"))
    finally:
        if not args.out:
            shutil.rmtree(base, ignore_errors=True)
    print(f"# {args.config} {' '.join(args.overrides)} on {device} ({torch.get_num_threads()} threads, "
          f"torch {torch.__version__})")
    first = results[0]
    print(f"{first['runs']} runs, {first['models']} models measured (final models and snapshots)\n")
    head = "| stage | " + " | ".join(f"{label or 'seconds'} | per run" for label, _ in settings)
    head += " | ratio |" if len(results) > 1 else " |"
    print(head)
    print("| --- |" + " ---: | ---: |" * len(results) + (" ---: |" if len(results) > 1 else ""))
    for stage in ("data", "train", "measure", "report"):
        cells = []
        for r in results:
            per = r[stage] / (r["models"] if stage == "measure" else r["runs"]) if r["runs"] else float("nan")
            cells.append(f"{r[stage]:.1f} | {per:.2f}")
        ratio = (f" {results[0][stage] / results[1][stage]:.2f}x |" if min(results[0][stage], results[1][stage]) > 0.05
                 else " – |") if len(results) > 1 else ""
        print(f"| {stage} | " + " | ".join(cells) + " |" + ratio)
    total = [sum(r[s] for s in ("data", "train", "measure", "report") if r[s] == r[s]) for r in results]
    print("| total | " + " | ".join(f"{t:.1f} | " for t in total) + "|"
          + (f" {total[0] / total[1]:.2f}x |" if len(results) > 1 else ""))
    print("\n| measure entry | seconds (all models) | per model |\n| --- | ---: | ---: |")
    for key, seconds in sorted(first["per_measure"].items(), key=lambda kv: -kv[1]):
        print(f"| `{key}` | {seconds:.2f} | {seconds / max(first['models'], 1):.3f} |")
    print(f"\nmeasure stage / train stage: {first['measure'] / max(first['train'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
