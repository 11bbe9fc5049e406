"""Exact Hessian diagonal of G MLPs: G sequential `hessian_diagonal` calls vs one grouped call.

    python scripts/bench_group_measures.py [--n 2000] [--groups 4 8] [--repeats 2] [--dtype float64] [--device cpu]

Models: MLP 784-512-512-10 (the quickstart's) and 784-128-128-10, randomly initialized (the cost does not
depend on the weights). Inputs: the first n mnist_mini training images, shared by all G models (runs with
one seed share their measurement subset); each model gets its own random labels. Prints the best of
`--repeats` wall-clock seconds for each, the speed-up, and the largest relative difference between the
two results.
"""

from __future__ import annotations

import argparse
import time

import torch

from flatbench.config import DataConfig
from flatbench.curvature import hessian_diagonal
from flatbench.data import load_dataset
from flatbench.losses import get_loss
from flatbench.curvature.group import group_hessian_diagonals
from flatbench.models import MLP


def best_of(repeats: int, fn, device: torch.device) -> tuple[float, object]:
    """Best wall-clock time of `repeats` calls (CUDA work is waited for before the clock stops)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    ds = load_dataset(DataConfig(dataset="mnist_mini"), seed=0, device=device)
    x = ds.x_train[:args.n].to(dtype)
    loss = get_loss("ce")
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, n = {x.shape[0]}, {args.dtype}")
    print(f"{'model':16} {'G':>3} {'sequential s':>13} {'grouped s':>10} {'speed-up':>9} {'max rel diff':>13}")
    for widths in ((512, 512), (128, 128)):
        for g in args.groups:
            gen = torch.Generator().manual_seed(g)
            torch.manual_seed(g)
            models = [MLP(784, widths, 10).to(device=device, dtype=dtype) for _ in range(g)]
            targets = torch.randint(0, 10, (g, x.shape[0]), generator=gen).to(device)
            seq_s, seq = best_of(args.repeats, lambda: [hessian_diagonal(m, x, t, loss, method="exact")
                                                       for m, t in zip(models, targets)], device)
            grp_s, grp = best_of(args.repeats, lambda: group_hessian_diagonals(models, x, targets, loss), device)
            diff = max(float((a.diag[k] - b.diag[k]).abs().max() / b.diag[k].abs().max().clamp_min(1e-300))
                       for a, b in zip(grp, seq) for k in b.diag)
            name = "784-" + "-".join(map(str, widths)) + "-10"
            print(f"{name:16} {g:>3} {seq_s:>13.3f} {grp_s:>10.3f} {seq_s / grp_s:>8.2f}x {diff:>13.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
