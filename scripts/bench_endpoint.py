#!/usr/bin/env python3
"""What the step-level endpoint (`train.endpoint_tolerance`) costs and what it changes: one small study trained
with per-epoch checks and with the step-level endpoint, one after the other, on the CPU.

    python scripts/bench_endpoint.py                       # 18 runs, each setting: about a minute on one thread
    python scripts/bench_endpoint.py --seeds 0 --check-steps 1,8

The study is a CPU-sized copy of the natural study's design on mnist_mini: an MLP 784-128-128-10 trained by
Adam on 500 training images (1,000 test images) to train cross-entropy 0.01, at most 600 epochs, learning rate
3e-4 | 1e-3 | 3e-3 x batch size 16 | 64 | 256 x the seeds given, `test_every: 10`, checkpoints every 10
epochs. After an untimed warm-up run, each setting trains every run from scratch in a fresh folder, one run
after another, on one thread.
It prints each run's final train loss relative to the target under each setting, then per setting the
training time (wall clock and CPU time of the whole train stage, and the sum of the runs' own seconds), the range of the
final losses, how many runs are within 5% below the target, the checks and the scaled steps. On a shared
machine the process's CPU time is the steadier of the times.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flatbench.config import parse_study  # noqa: E402
from flatbench.store import read_json  # noqa: E402
from flatbench.study.train import train_study  # noqa: E402

TARGET = 0.01


def study_config(seeds: list[int], **endpoint) -> dict:
    return {"name": "bench_endpoint", "seed": seeds,
            "data": {"dataset": "mnist_mini", "n_train": 500, "n_test": 1000},
            "model": {"name": "mlp", "widths": [128, 128]},
            "train": {"optimizer": "adam", "lr": [3e-4, 1e-3, 3e-3], "batch_size": [16, 64, 256], "epochs": 600,
                      "target_train_loss": TARGET, "test_every": 10, "checkpoint_every": 10, "vectorize": "off",
                      **endpoint}}


def train(label: str, raw: dict, root: Path) -> dict:
    study = parse_study(raw, out=str(root / label))
    t0, c0 = time.perf_counter(), time.process_time()
    train_study(study, torch.device("cpu"), quiet=True, echo=lambda m: None)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    runs = {}
    for rid, cfg in study.runs:
        info = read_json(study.exp_dir / "runs" / rid / "run.json")
        runs[(cfg.seed, cfg.train.lr, cfg.train.batch_size)] = info
    return {"label": label, "wall": wall, "cpu": cpu, "runs": runs}


def summary(result: dict) -> str:
    runs = list(result["runs"].values())
    ratios = [r["train_loss"] / TARGET for r in runs]
    within = sum(0.95 <= x <= 1.0 for x in ratios)
    ends = [r.get("endpoint") or {} for r in runs]
    checks = sum(e.get("checks", 0) for e in ends)
    scaled = sum(e.get("scaled_step") is not None for e in ends)
    own = sum(r["seconds"] for r in runs)
    epochs = sum(r["epochs"] for r in runs)
    return (f"{result['label']:<28} wall {result['wall']:6.1f} s, CPU {result['cpu']:6.1f} s, runs' own {own:6.1f} s, "
            f"{epochs} epochs; final/target "
            f"{min(ratios):.3f} to {max(ratios):.3f}, {within}/{len(runs)} within [0.95, 1]; {checks} step checks, "
            f"{scaled} scaled steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (replicates)")
    parser.add_argument("--check-steps", default="1", help="endpoint_check_steps values to time, comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        warm = study_config([0])
        warm["train"].update(lr=3e-3, batch_size=64)
        train("warm-up (untimed)", warm, root)  # imports, the dataset's first load, torch's first kernels
        results = [train("per-epoch checks", study_config(seeds), root)]
        for every in [int(s) for s in args.check_steps.split(",")]:
            settings = {"endpoint_tolerance": 0.05}
            if every != 1:
                settings["endpoint_check_steps"] = every
            results.append(train(f"endpoint_tolerance 0.05, N={every}", study_config(seeds, **settings), root))
    print(f"torch {torch.__version__}, {args.threads} thread(s); final train loss / target {TARGET:g} per run:")
    print("  seed      lr  batch  " + "  ".join(f"{r['label'][:24]:>24}" for r in results))
    for key in results[0]["runs"]:
        cells = [f"{r['runs'][key]['train_loss'] / TARGET:>8.3f} ({r['runs'][key]['epochs']:>3} ep)" for r in results]
        print(f"  {key[0]:>4} {key[1]:>7g} {key[2]:>6}  " + "  ".join(f"{c:>24}" for c in cells))
    for r in results:
        print(summary(r))


if __name__ == "__main__":
    main()
