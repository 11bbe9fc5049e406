"""This version against an earlier one, on the same machine and the same trained models: the seconds of
training one run and of measuring it (every entry its study's config asks for), per study.

    git worktree add /tmp/flatbench-old c024995          # the last version before issues 18-23
    python scripts/bench_versions.py --old /tmp/flatbench-old \\
        configs/cpu/yi_mnist.yaml:data.random_label_ratio=0.5 \\
        configs/cpu/tsuzuku_cifar10.yaml:data.random_label_ratio=0.6

For each CONFIG[:KEY=VALUE,...] (one run: the overrides and `seed=0` must leave a single run), both code
trees train the run from scratch into a temporary folder, each in its own process and with
`--threads` threads (default 1, as a worker of a 2-process study has), and then measure the model *the old
version trained* with each version's `flatbench measure --force --workers 1` (so that the two measure
stages see the same weights; the new version's lazy evaluation and channels_last can change the trained
weights at float rounding). Both stages are timed as whole commands: process start and data loading count.
It prints, per run, the wall seconds of each stage in each version and their ratio (old / new).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]



def run(cmd: list[str], tree: Path, threads: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    # cwd = the tree: `python -m flatbench` puts the working folder ahead of PYTHONPATH on sys.path
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tree)


def train(tree: Path, config: str, overrides: list[str], out: Path, threads: int) -> tuple[float, Path]:
    t0 = time.perf_counter()
    run([sys.executable, "-m", "flatbench", "train", config, "seed=0", "train.workers=1", *overrides,
         "--out", str(out), "--quiet", "--device", "cpu"], tree, threads)
    seconds = time.perf_counter() - t0
    runs = [p for p in out.glob("*/runs/*") if (p / "model.pt").is_file()]
    if len(runs) != 1:
        raise SystemExit(f"{config} {overrides}: expected one run, got {len(runs)} (add overrides)")
    return seconds, runs[0]


def measure(tree: Path, exp_dir: Path, threads: int) -> float:
    """Seconds of `flatbench measure EXP --force` (every entry of the study's config, one worker process),
    process start and data loading included, as in a study."""
    t0 = time.perf_counter()
    run([sys.executable, "-m", "flatbench", "measure", str(exp_dir), "--force", "--workers", "1", "--quiet",
         "--device", "cpu"], tree, threads)
    return time.perf_counter() - t0


def _commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="CONFIG[:KEY=VALUE,...] leaving one run with seed=0")
    p.add_argument("--old", required=True, help="a checkout (git worktree) of the earlier version")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    old, new = Path(args.old).resolve(), ROOT
    print(f"old: {old} ({_commit(old)}), new: {new} ({_commit(new)}, with its uncommitted changes), "
          f"{args.threads} thread(s)")
    print("| run | train old (s) | train new (s) | ratio | measure old (s) | measure new (s) | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for spec in args.runs:
        config, _, rest = spec.partition(":")
        config = str(Path(config).resolve())
        overrides = [o for o in rest.split(",") if o]
        with tempfile.TemporaryDirectory() as tmp:
            t_old, run_old = train(old, config, overrides, Path(tmp) / "old", args.threads)
            t_new, _ = train(new, config, overrides, Path(tmp) / "new", args.threads)
            m_old = measure(old, run_old.parent.parent, args.threads)
            # the new version measures the same weights: a copy of the old run's folder
            copy = Path(tmp) / "same" / run_old.parent.parent.name
            shutil.copytree(run_old.parent.parent, copy)
            m_new = measure(new, copy, args.threads)
        print(f"| `{Path(config).stem}` {' '.join(overrides)} | {t_old:.1f} | {t_new:.1f} | {t_old / t_new:.2f}× | "
              f"{m_old:.1f} | {m_new:.1f} | {m_old / m_new:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
