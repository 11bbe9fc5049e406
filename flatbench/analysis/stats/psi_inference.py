"""Is a per-axis ψ more than chance? The two-way cluster bootstrap of its block mean, and Holm's procedure
over every ψ test of a study.

ψ_i (`jiang`) is the mean over blocks g = (k, d) of the block's τ, where k is the block's combination of
the other axes and d its data draw. Blocks that share k share their configurations (the other axes'
values), blocks that share d share their data draw: they are crossed clusters, not independent groups,
so neither a sign test over the blocks nor within-block permutations of the gap (which treat every
block as independent evidence) is valid. The test here resamples both, as Owen's pigeonhole bootstrap
(`bootstrap`): in every resample, u_k ~ Multinomial(K) over the K combinations and v_d ~ Multinomial(D)
over the draws (v ≡ 1 when D < `bootstrap.MIN_DRAWS`: conditional on these draws), and

    ψ* = Σ_g u_k(g)·v_d(g)·τ_g / Σ_g u_k(g)·v_d(g),

a weighted mean of the precomputed (K, D) block matrix (two small matrix products per chunk of resamples,
`BOOT_FACTOR` times the report's number of them).
The two-sided p-value is the percentile one with the +1 correction, `kernels.bootstrap_pvalue(ψ*)`:
p = min(1, 2·min(#{ψ* < 0} + ½#{ψ* = 0} + 1, #{ψ* > 0} + ½#{ψ* = 0} + 1) / (B + 1)), B the finite ψ*.

It needs `bootstrap.MIN_UNITS` independent units on one side (K combinations, or resampled draws): with
fewer the percentile test is far too liberal (the numbers are in `bootstrap.MIN_UNITS`), and p is NaN
with the reason. A study with a single axis has K = 1: its ψ can be tested only over ≥ 10 draws.

**Multiplicity.** A study tests every (measure, axis): 17 measures × 6 axes are 102 tests. `holm_family`
adjusts all of them together by Holm's step-down procedure (`compare.holm`), the family-wise error of
the whole study at α; the reference rows (`references`) are not part of the family.
"""

from __future__ import annotations


import numpy as np

from flatbench.analysis.stats.bootstrap import MIN_UNITS, resamples_draws, two_way_weights
from flatbench.analysis.stats.compare import holm
from flatbench.analysis.stats.jiang import PsiBlocks
from flatbench.analysis.stats.kernels import bootstrap_pvalue

BOOT_FACTOR = 10
"""ψ tests draw this many times the report's resamples (100,000 for 10,000): Holm over a study's ~100 ψ
tests needs p-values near 0.05/100 = 5e-4, where 10,000 resamples would rest on five of them (Monte-Carlo
error ±45%); 100,000 bring it to about ±14%, and they cost little (a weighted mean of a small matrix)."""
CHUNK = 10_000


def block_matrix(blocks: PsiBlocks, taus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(K, D) block τ's (0 where there is no block) and the (K, D) indicator of the blocks."""
    values = np.zeros((blocks.n_combos, blocks.n_draws))
    present = np.zeros((blocks.n_combos, blocks.n_draws))
    values[blocks.combo, blocks.draw] = taus
    present[blocks.combo, blocks.draw] = 1.0
    return values, present


def psi_units(blocks: PsiBlocks) -> int:
    """Independent units of the ψ bootstrap: K, or the draws when they are resampled and more numerous."""
    return max(blocks.n_combos, blocks.n_draws if resamples_draws(blocks.n_draws) else 0)


def psi_resampled(blocks: PsiBlocks, taus: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """(M, n_boot) ψ* of the two-way bootstrap (module doc) for the block τ's of M measures (rows of
    `taus`, (M, blocks); one measure may be given as a (blocks,) vector). The resamples are drawn in
    chunks of `CHUNK`: chunk c's weights are `bootstrap.two_way_weights(K, D, size, (seed, c), D ≥ 5)`,
    shared by every measure on these blocks."""
    taus = np.atleast_2d(np.asarray(taus, dtype=float))
    out = np.full((len(taus), max(n_boot, 0)), np.nan)
    present = block_matrix(blocks, np.ones(blocks.n_blocks))[1]
    values = np.stack([block_matrix(blocks, t)[0] for t in taus])  # (M, K, D)
    resample = resamples_draws(blocks.n_draws)
    for c, start in enumerate(range(0, max(n_boot, 0), CHUNK)):
        size = min(CHUNK, n_boot - start)
        u, v = two_way_weights(blocks.n_combos, blocks.n_draws, size, (seed, c), resample)
        if resample:  # Σ_d v_d · (u @ T_d)
            num = sum(v[:, d:d + 1] * (u @ values[:, :, d].T) for d in range(blocks.n_draws))
            den = sum(v[:, d] * (u @ present[:, d]) for d in range(blocks.n_draws))
        else:  # v ≡ 1: sum the draws first
            num = u @ values.sum(axis=2).T
            den = u @ present.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[:, start:start + size] = np.where(den[:, None] > 0, num / np.where(den > 0, den, 1.0)[:, None],
                                                  np.nan).T
    return out


def psi_untestable(blocks: PsiBlocks) -> str:
    """Why ψ_axis of these blocks cannot be tested ("" when it can)."""
    if not blocks.n_blocks:
        return "no block varies this axis alone"
    if psi_units(blocks) < MIN_UNITS:
        return (f"{blocks.n_combos} combination(s) of the other axes and {blocks.n_draws} draw(s): fewer than "
                f"{MIN_UNITS} independent units")
    return ""


def psi_pvalues(blocks: PsiBlocks, taus: np.ndarray, n_boot: int, seed: int) -> tuple[np.ndarray, str]:
    """((M,) p-values of ψ_axis by the two-way bootstrap for the block τ's of M measures, ""), or (NaN,
    why not). It draws `BOOT_FACTOR`·n_boot resamples (module doc)."""
    taus = np.atleast_2d(np.asarray(taus, dtype=float))
    why = psi_untestable(blocks) or ("" if n_boot > 0 else "no resamples")
    if why:
        return np.full(len(taus), np.nan), why
    boot = psi_resampled(blocks, taus, BOOT_FACTOR * n_boot, seed)
    return np.array([bootstrap_pvalue(b) for b in boot]), ""


def holm_family(p_values: np.ndarray) -> tuple[np.ndarray, int]:
    """(Holm-adjusted p-values of the (measures, axes) array `p_values` adjusted together, the family size:
    its finite entries). NaN entries are not tested and stay NaN."""
    p = np.asarray(p_values, dtype=float)
    return holm(p.ravel()).reshape(p.shape), int(np.isfinite(p).sum())
