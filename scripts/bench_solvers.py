"""Seconds per normalized-sharpness solve on LeNet-5-sized layers (the timing that used to be a test).

    python scripts/bench_solvers.py               # 5 repeats per shape
    python scripts/bench_solvers.py --repeats 20 --budget 1.0

The problems are the test suite's (`solver_problem` in tests/cases.py): heavy-tailed positive
curvature H and squared weights W² spread over orders of magnitude, float64, for the weight shapes of
LeNet-5's layers (120×400, 84×120, 16×6 after reducing the conv kernels, 10×84). Each shape is solved
`--repeats` times with `solve_normalized_sharpness`; the table gives the best and median seconds, the
iterations and whether it converged. The exit status is 1 when the total of the medians exceeds
`--budget` seconds (default 1 s, the limit the suite used to assert), so the script can serve as a
performance check on a quiet machine; correctness is the suite's job.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test catalogue

from cases import solver_problem  # noqa: E402

from flatbench.measures.builtin.normalized import solve_normalized_sharpness  # noqa: E402

SHAPES = [(120, 400), (84, 120), (16, 6), (10, 84)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget", type=float, default=1.0, help="seconds allowed for the sum of the medians")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{'shape':>10} {'best s':>9} {'median s':>9} {'iters':>6} converged")
    total = 0.0
    for shape in SHAPES:
        h, q = solver_problem(*shape, 0)
        times, res = [], None
        for _ in range(max(1, args.repeats)):
            t0 = time.perf_counter()
            res = solve_normalized_sharpness(h, q)
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        total += median
        print(f"{shape[0]:>4}×{shape[1]:<5} {min(times):9.4f} {median:9.4f} {res.iterations:6d} {res.converged}")
    verdict = "within" if total <= args.budget else "OVER"
    print(f"total of medians {total:.4f} s ({verdict} the {args.budget:g} s budget)")
    return 0 if total <= args.budget else 1


if __name__ == "__main__":
    sys.exit(main())
