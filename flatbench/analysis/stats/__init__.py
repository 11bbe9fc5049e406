"""The statistics of a report, one module per family:

    kernels.py  τ-b / ρ / r batched over explicit resamples and over bootstrap weights; the permutation
                p-value of τ (enumerated, scipy's exact null, or Monte Carlo); bootstrap p-values
    design.py   hyperparameter axes (never `seed`), cells, bootstrap strata and resampling weights
    compare.py  paired comparisons of measures, Holm's procedure, the best group
    jiang.py    Jiang et al.'s granulated Kendall Ψ (one ψ per hyperparameter axis) and CMI score
    psi_test.py the within-group permutation test of each ψ (exact sign test for pairs)
    robust.py   Dziugaite et al.'s sign errors per environment; the ordering of seed replicates (sign test)
    core.py     exclusions, directions and `analyze`, which puts all of it in one table

Everything a caller needs is importable from `flatbench.analysis.stats`.
"""

from flatbench.analysis.stats.compare import (
    ALPHA,
    COMPARISON_COLUMNS,
    CI_LEVEL,
    MIN_CI_RUNS,
    MIN_RUNS,
    Resamples,
    best_group,
    holm,
    paired_comparisons,
    wald_p,
)
from flatbench.analysis.stats.core import (
    N_BOOT,
    SE_NOTE_RATIO,
    Analysis,
    agreement_matrix,
    analyze,
    directions,
    exclusion_reasons,
    gap_column,
    oriented,
    usable,
)
from flatbench.analysis.stats.design import (
    REPLICATE_AXES,
    Bootstrap,
    Design,
    Strata,
    axis_codes,
    axis_text,
    design_bootstrap,
    design_of,
    pair_weights,
    resample_weights,
    spread_factor,
    strata_of,
)
from flatbench.analysis.stats.jiang import MIN_CMI_PAIRS, CMIResult, conditional_mi, granulated_kendall
from flatbench.analysis.stats.kernels import (
    N_PERM,
    STATISTICS,
    WEIGHTED,
    bootstrap_ci,
    bootstrap_pvalue,
    kendall_batch,
    kendall_permutation_p,
    kendall_permutation_pvalues,
    kendall_tau_a,
    pearson_batch,
    permutation_method,
    spearman_batch,
    weighted_kendall,
    weighted_pearson,
    weighted_spearman,
)
from flatbench.analysis.stats.psi_test import N_PSI_PERM, psi_pvalue, psi_pvalues
from flatbench.analysis.stats.robust import SignErrors, seed_pairs, seed_pairs_pvalue, sign_errors

__all__ = [name for name in dir() if not name.startswith("_")]
