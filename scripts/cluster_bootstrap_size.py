"""How liberal is a percentile cluster bootstrap with few units? The size of the ψ test at nominal 5% and 1%.

The ψ test (`flatbench.analysis.stats.psi_inference`) resamples K combinations of the other axes (with 2
data draws, not resampled). Under its null here, each combination's two block τ's are ±1 with a random
common sign (they agree with probability 0.7: the same configurations in both draws). The script draws
`--trials` such studies for each K and prints how often the test rejects; `bootstrap.MIN_UNITS` (10) is
where it comes close to the nominal level.

    python scripts/cluster_bootstrap_size.py            # a few seconds
"""

from __future__ import annotations

import argparse

import numpy as np

from flatbench.analysis.stats import bootstrap_pvalue, two_way_weights


def size(k: int, trials: int, n_boot: int, rng: np.random.Generator) -> tuple[float, float]:
    u, v = two_way_weights(k, 2, n_boot, 1, False)
    rejected = np.zeros(2)
    for _ in range(trials):
        base = rng.choice([-1.0, 1.0], size=k)
        taus = np.stack([base, np.where(rng.random(k) < 0.7, base, -base)], axis=1)
        psi_star = (u @ taus.sum(axis=1)) / (u @ np.full(k, 2.0))
        p = bootstrap_pvalue(psi_star)
        rejected += [p <= 0.05, p <= 0.01]
    return tuple(rejected / trials)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--n-boot", type=int, default=2000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("units K   size at 5%   size at 1%")
    for k in (3, 5, 8, 10, 16, 32):
        five, one = size(k, args.trials, args.n_boot, rng)
        print(f"{k:7d}   {five:10.3f}   {one:10.3f}")


if __name__ == "__main__":
    main()
