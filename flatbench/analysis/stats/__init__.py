"""The statistics of a report, one module per family:

    kernels.py        τ-b / ρ / r batched over explicit resamples and over bootstrap weights; the
                      permutation p-value of τ (enumerated, scipy's exact null, or Monte Carlo); bootstrap p
    design.py         configurations (cells), data draws, training and data axes (never a replicate field)
    bootstrap.py      the two-way cluster bootstrap of configurations × data draws (Owen's pigeonhole)
    compare.py        paired comparisons of measures, Holm's procedure, the best group
    jiang.py          Jiang et al.'s ψ per axis (its blocks), Ψ, psi_data and CMI score
    psi_inference.py  the two-way bootstrap test of each ψ, Holm over every ψ test of a study
    robust.py         Dziugaite et al.'s sign errors with their noise filter; replicate-pair concordance
    plan.py           the measure-independent structures of one set of runs; every point statistic, batched
    rows.py           one row of correlations.csv: point statistics and their inference
    references.py     the floor (`ref.random`) and the ceiling (`ref.replicate_gap`) rows
    core.py           exclusions, directions and `analyze`, which puts all of it in one table

Everything a caller needs is importable from `flatbench.analysis.stats`.
"""

from flatbench.analysis.stats.bootstrap import (
    MIN_DRAWS,
    MIN_UNITS,
    TwoWay,
    multinomial_counts,
    two_way_bootstrap,
    two_way_weights,
)
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
    Analysis,
    agreement_matrix,
    analyze,
    directions,
    exclusion_reasons,
    gap_column,
    kendall_tests,
    oriented,
    usable,
)
from flatbench.analysis.stats.design import (
    REPLICATE_AXES,
    Design,
    axis_codes,
    axis_text,
    design_of,
    draw_labels,
    is_data_axis,
)
from flatbench.analysis.stats.jiang import (
    MIN_CMI_PAIRS,
    CMIResult,
    PsiBlocks,
    cmi_plan,
    conditional_mi,
    granulated_kendall,
    psi_blocks,
)
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
from flatbench.analysis.stats.plan import DesignPlan, Point, design_plan, point_statistics
from flatbench.analysis.stats.psi_inference import holm_family, psi_pvalues, psi_resampled, psi_untestable
from flatbench.analysis.stats.references import N_RANDOM, RANDOM, REPLICATE_GAP, replicate_gap
from flatbench.analysis.stats.robust import (
    MIN_ENV_PAIRS,
    NOISE_Z,
    SignErrors,
    environment_plan,
    pair_weight,
    replicate_pairs,
    replicate_pvalue,
    replicate_sd,
    sign_errors,
)
from flatbench.analysis.stats.rows import SE_NOTE_RATIO

__all__ = [name for name in dir() if not name.startswith("_")]
