"""Is `hessian_density`'s reported uncertainty of m1 (the mean eigenvalue Tr H / d) calibrated?

On small float64 networks whose exact Tr H / d comes from the dense Hessian, the density is computed with
many different seeds (`runs` Rademacher start vectors each; the measure's default is 5). Printed per
network and number of runs: the empirical standard deviation of m1 across the seeds, the mean, root mean
square and median of the reported `stderr`, and the coverage of the reported 95% interval (the fraction of
seeds with the exact Tr H / d inside `m1_ci95`, Student's t with runs − 1 degrees of freedom) beside the
coverage of the naive interval m1 ± 1.96 · stderr (what the standard error alone suggests).

By default the quadratures run on the dense Hessian as a matrix (`curvature.density.slq` and
`spectral_density`, m1 exactly as the measure computes it, 2,000 seeds in seconds), also on a matrix
with one dominant eigenvalue (5 u uᵀ plus a small diagonal: a trained net's outlier, where vᵀHv is
χ²-like); `--operator` runs `HessianOperator.spectral_density` on the networks themselves (the measure's
full path: minutes for 200 seeds).

    python scripts/density_stderr_calibration.py [--seeds 2000] [--runs 2,3,5,10] [--operator]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cases import dense_hessian  # noqa: E402  (the tests' brute-force Hessian)

from flatbench.curvature import HessianOperator, slq, spectral_density  # noqa: E402
from flatbench.losses import get_loss  # noqa: E402


def networks() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    """Two small nets: the density test's untrained Tanh/ReLU net (138 parameters, many negative
    eigenvalues) and a ReLU MLP fitted for 200 Adam steps (a trained net's spectrum: a few large
    eigenvalues, a bulk near zero)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4)).double().eval()
    x, y = torch.randn(24, 6, dtype=torch.float64), torch.randint(0, 4, (24,))
    torch.manual_seed(1)
    fit = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 4)).double()
    xf = torch.randn(48, 6, dtype=torch.float64)
    yf = (xf[:, :4].argmax(1) + (torch.rand(48) < 0.2).long()) % 4
    opt = torch.optim.Adam(fit.parameters(), lr=0.02)
    for _ in range(200):
        opt.zero_grad()
        nn.functional.cross_entropy(fit(xf), yf).backward()
        opt.step()
    return {"tanh-relu, untrained (138 params)": (net, x, y), "relu MLP, fitted (136 params)": (fit.eval(), xf, yf)}


def _report(runs: int, exact: float, outs: list[dict]) -> str:
    m1 = torch.tensor([o["moments"][0] for o in outs], dtype=torch.float64)
    se = torch.tensor([o["m1_stderr"] for o in outs], dtype=torch.float64)
    inside = sum(o["m1_ci95"][0] <= exact <= o["m1_ci95"][1] for o in outs) / len(outs)
    naive = float(((m1 - exact).abs() <= 1.96 * se).double().mean())
    return (f"  runs {runs:3d}: SD of m1 across {len(outs)} seeds {float(m1.std()):.4g}; reported stderr mean "
            f"{float(se.mean()):.4g}, rms {float(se.pow(2).mean().sqrt()):.4g}, median {float(se.median()):.4g}; "
            f"coverage of the reported 95% interval {inside:.3f}, of m1 ± 1.96·stderr {naive:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=None, help="default 2000 (200 with --operator)")
    parser.add_argument("--runs", default="2,3,5,10")
    parser.add_argument("--iters", type=int, default=2, help="Lanczos steps (m1 is exact for any iters ≥ 1)")
    parser.add_argument("--operator", action="store_true", help="the networks' HessianOperator, not the matrix")
    args = parser.parse_args()
    seeds = args.seeds or (200 if args.operator else 2000)
    torch.set_num_threads(1)
    loss = get_loss("ce")
    cases = {name: (dense_hessian(net, x, y, loss), HessianOperator(net, x, y, loss))
             for name, (net, x, y) in networks().items()}
    if not args.operator:
        u = torch.randn(138, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        noise = torch.randn(138, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        cases["one dominant eigenvalue (5 u uT + 0.01 diag, d = 138)"] = (
            5 * torch.outer(u / u.norm(), u / u.norm()) + 0.01 * torch.diag(noise), None)
    for name, (hess, op) in cases.items():
        d = hess.shape[0]
        exact = float(torch.trace(hess)) / d
        offdiag = float(hess.pow(2).sum() - hess.diagonal().pow(2).sum())
        print(f"{name}: d = {d}, exact Tr H / d = {exact:.6g}")
        for runs in (int(r) for r in args.runs.split(",")):
            outs = []
            for seed in range(seeds):
                gen = torch.Generator().manual_seed(seed)
                if args.operator:
                    outs.append(op.spectral_density(generator=gen, runs=runs, iters=args.iters))
                else:
                    outs.append(spectral_density(slq(lambda v: hess @ v, d, runs=runs, iters=args.iters,
                                                     generator=gen)))
            theory = math.sqrt(2 * offdiag) / d / math.sqrt(runs)
            print(_report(runs, exact, outs) + f" (theory's SD {theory:.4g})")


if __name__ == "__main__":
    main()
