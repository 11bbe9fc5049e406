"""What the statistics need of one set of runs, built once, and every point statistic for a batch of measures.

The within-design statistics (ψ per axis, Ψ, psi_data, CMI, sign errors, replicate pairs) rest on
structures that depend only on the design and the gap: the blocks of ψ and their pairs, the CMI cells,
the environments and their counted pairs, the replicate pairs. `design_plan` builds them once for a set of
runs (the runs where a measure has a value: most measures share one), and `point_statistics` evaluates
every statistic for a (R, n) batch of measure values at once: one row for a measure, R rows for the random
reference (`references`). The measures and the references therefore go through the same code.

Every statistic over pairs of runs compares runs of one data draw (issue 42: the draw's shared offset of
the gap is not something a measure of one network can know): τ is stratified by draw (`blocked`), ψ's
blocks hold one draw, and the CMI's pairs and the sign errors' environments are pairs within a draw. The
pooled τ (`kendall_tau_pooled`) and the within-cell τ (pairs of one configuration, across draws or
seeds) are given beside it. With one draw every statistic is the pooled one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flatbench.analysis.stats.blocked import stratified_kendall
from flatbench.analysis.stats.design import Design
from flatbench.analysis.stats.jiang import CMIPlan, PsiBlocks, cmi_plan, mean_defined, psi_blocks
from flatbench.analysis.stats.kernels import STATISTICS
from flatbench.analysis.stats.robust import EnvironmentPlan, ReplicatePairs, environment_plan, replicate_pairs


@dataclass
class DesignPlan:
    """The measure-independent structures of the statistics over one set of runs (module doc)."""

    design: Design
    """The design of these runs (`Design.subset`)."""
    gap: np.ndarray
    psi: dict[str, PsiBlocks]
    cmi: CMIPlan
    environments: EnvironmentPlan
    replicates: ReplicatePairs


def design_plan(design: Design, gap: np.ndarray, noise_sd: float) -> DesignPlan:
    """The plan of the runs of `design` (already the subset) with these gaps; `noise_sd` is the replicate
    standard deviation of the gap of the whole study (`robust.replicate_sd`), the noise filter's scale."""
    gap = np.asarray(gap, dtype=float)
    axes = design.axes
    psi = {a: psi_blocks(design.codes, axes, a, design.draws) for a in axes}
    return DesignPlan(design, gap, psi, cmi_plan(gap, design.codes, axes, draws=design.draws),
                      environment_plan(gap, design.codes, axes, noise_sd, draws=design.draws),
                      replicate_pairs(gap, design.cells))


@dataclass
class Point:
    """Every point statistic for a batch of R measures (rows), as (R,) arrays in `values`."""

    values: dict[str, np.ndarray]
    """kendall_tau (within draws), kendall_tau_pooled, kendall_tau_within_cell, spearman_rho, pearson_r, psi_<axis>, psi, psi_data, cmi, sign_error_mean,
    sign_error_worst, seed_pairs_concordant."""
    block_taus: dict[str, np.ndarray] = field(default_factory=dict)
    """Per axis, the (R, blocks) τ inside every block of ψ (what its bootstrap resamples)."""
    cmi_condition: list[str] = field(default_factory=list)
    environment_errors: np.ndarray | None = None
    """(R, environments) sign error of every environment of the plan (NaN without a counted pair)."""


def point_statistics(plan: DesignPlan, measures: np.ndarray) -> Point:
    """Every point statistic of every row of `measures` (R, n) against the plan's gap (module doc)."""
    x = np.atleast_2d(np.asarray(measures, dtype=float))
    r = len(x)
    gap = np.broadcast_to(plan.gap, x.shape)
    values = {stat: np.asarray(fn(x, gap), dtype=float) for stat, fn in STATISTICS.items()}
    design = plan.design
    values["kendall_tau_pooled"] = values["kendall_tau"]
    if design.n_draws > 1:  # the headline τ: pairs within one draw (`blocked`)
        values["kendall_tau"] = stratified_kendall(x, plan.gap, design.draws)
    values["kendall_tau_within_cell"] = (stratified_kendall(x, plan.gap, design.cells) if design.n_cells < len(plan.gap)
                                         else np.full(r, np.nan))
    point = Point(values)
    for axis, blocks in plan.psi.items():
        taus = blocks.block_taus(x, plan.gap)
        point.block_taus[axis] = taus
        values[f"psi_{axis}"] = taus.mean(axis=1) if taus.shape[1] else np.full(r, np.nan)
    values["psi"] = mean_defined([values[f"psi_{a}"] for a in design.training_axes], r)
    values["psi_data"] = mean_defined([values[f"psi_{a}"] for a in design.data_axes], r)
    scores, names, _ = plan.cmi.scores(x)
    values["cmi"] = scores
    point.cmi_condition = names
    errors = plan.environments.errors(x)
    point.environment_errors = errors
    values["sign_error_mean"], values["sign_error_worst"] = plan.environments.summary(errors)
    values["seed_pairs_concordant"] = plan.replicates.shares(x)
    return point
