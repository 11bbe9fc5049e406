"""Tsuzuku et al.'s matrix-normalized and normalized sharpness, from the exact Hessian diagonal.

For a weight layer with weights W (out × in, conv kernels reduced over their spatial axes) and the
Hessian diagonal H of the loss over the same entries (Q = W²):

**matrix_normalized_sharpness** (§4): one posterior variance s per matrix,
`min_s Σ_ij (H_ij s + Q_ij / s) = 2 ‖W‖_F sqrt(Tr H_W)`, summed over the layers. Closed form.

**normalized_sharpness** (§5): row × column variances s_ij = σ_i σ'_j,

    NS_l = min_{σ > 0, σ' > 0}  f(σ, σ') = Σ_ij H_ij σ_i σ'_j + Q_ij / (σ_i σ'_j).

f is convex in (log σ, log σ') with one flat direction (σ·t, σ'/t). `solve_normalized_sharpness` runs
the exact block updates σ_i = sqrt(B_i / A_i), A = H σ', B = Q (1/σ'), then the symmetric update of σ',
in float64; it starts from the matrix-normalized optimum σ_i σ'_j = ‖W‖_F / sqrt(Tr H), so
NS_l ≤ 2 ‖W‖_F sqrt(Tr H_W) from the first iterate on, and every update can only lower f, while
2 Σ_ij |W_ij| sqrt(H_ij) ≤ NS_l always (each term H s + Q / s ≥ 2 sqrt(HQ)).

*Stopping rule.* A sweep is converged only when both (1) the relative change of f over the sweep is at
most `rtol` (1e-10) and (2) the KKT residual is at most `kkt_tol` (1e-10). The KKT residual is the
relative imbalance of the row conditions, max_i |σ_i A_i − B_i/σ_i| / (σ_i A_i + B_i/σ_i), i.e. the
gradient in log σ_i relative to row i's own terms, at the current iterate (after the column update; the
column conditions are then exact by construction, so their residual is 0 up to rounding and is not
tested). The change alone is not enough: alternating minimization contracts linearly, at a rate close to
1 when the problem is nearly decomposable (a weak cut between groups of rows and columns, e.g. H and W²
nearly block-diagonal), and then one sweep changes f by far less than the remaining gap: on an 11 × 11
problem of two blocks coupled by 1e-8 (tests/measures/test_solvers.py) the change rule alone declared
convergence after 8 sweeps, 1.2e-7 (relative) above the optimum, and with a coupling of 1e-4 after
1,200–1,500 sweeps, 1.1e-8 to 1.4e-8 above it. Near the optimum the gap is about ½ gᵀ K⁻¹ g (K the
Hessian in log space), so a residual of 1e-10 leaves a gap of order 1e-20 / (the weak direction's
curvature). On trained layers (MLP 784-128-64-10 and LeNet-5 on 512 mnist_mini examples, ce and
normalized_ce) the residual falls below 1e-10 within 5–9 sweeps (2 for LeNet's 6 × 1 first layer; the
change rule alone stopped 1–4 sweeps earlier, at residuals around 1e-5, there without a visible error)
and, iterated further, bottoms out at 1e-16 to 2e-16 (float64 rounding of the row sums), so
`kkt_tol` = 1e-10 is met with a margin of six orders of magnitude.

*Newton steps.* On a nearly decomposable layer the sweeps need on the order of 1/(coupling) iterations
(3,900–4,900 for a coupling of 1e-4 to reach the residual above; more than `max_iter` below about
3e-5). After `NEWTON_AFTER` (30) sweeps without convergence, each sweep is therefore preceded by a damped
Newton step on f in (log σ, log σ') (`_newton_step`: the Hessian is the signless Laplacian of the
bipartite graph with weights P_ij = H_ij σ_i σ'_j + Q_ij/(σ_i σ'_j), solved through its Schur complement
on the smaller side, O(min(out, in)² · max(out, in)) per step, with a backtracking line search, so f
still only decreases). The Newton step resolves the weak direction the sweeps crawl along (the problems
above converge in 34–35 iterations, 4–5 of them Newton steps, at couplings from 1e-4 to 1e-8, in
about 2 ms, to within 3e-16 of an independent reference optimum); trained layers converge before it is
ever used. The iterations (sweeps, Newton steps included in the count), the Newton steps, the final
relative change and the KKT residual are reported per layer; a layer that does not meet both tolerances
within `max_iter` sweeps is reported with `converged: false`.

*The published solver* (`solver: published`; registered as the variants
`normalized_sharpness:published` and `normalized_sharpness_nce:published`). Ibayashi et al.'s public
code (their comparison with Tsuzuku et al.; it matches the "earlier public reimplementation" MEASURES.md
mentions) did not solve the problem: per layer it ran `published_steps` (10,000) plain SGD steps (no
momentum) on (log σ, log σ'), from σ = σ' = 1 (the trained scale), with learning rate
lr_t = lr / (1 + decay·t) (`published_lr` = 1e-3, `published_decay` = 1e-3), in float64 (flatbench runs the
steps in float32 by default, `published_dtype`: several times faster, the same value to ~1e-8), on the layer's
objective divided by its own value at the start, Σ H + Σ W² (so it starts at 1): the normalization is
**per layer**, each layer its own problem. The value is the un-normalized objective at the last iterate
the reference evaluates (the one its final step starts from), summed over the layers.
`solve_normalized_sharpness_published` reproduces it with closed-form gradients
(∂f/∂log σ_i = σ_i A_i − B_i/σ_i and the symmetric one; about 0.2 s for a 10 × 64 layer and 0.7 s for
128 × 784 on one CPU core). It is an upper bound of the exact value and is *not* invariant to any
rescaling (it starts from the trained scale and stops early); it exists to show whether a paper's
correlation comes from the measure or from stopping its solver early. With the per-layer normalization
each log σ_i only gets its row's share of the layer's objective as gradient, so at lr = 1e-3 the iterate
barely moves on layers with many units: on the trained layers above the final objective is 0.96–0.99 of
its start for layers of 64 or more units (0.63–0.90 for the small ones), 1.02 to 8 times the exact
optimum. The info gives per layer the final objective relative to its start
(`final_relative_objective`) and the exact optimum (`exact_value`), and in total `gap_to_exact`.

*Dead units.* A row or column of H (a unit that no example's loss curvature reaches, e.g. a dead ReLU) or
of Q (a unit with all-zero weights) that is zero makes the infimum unattained: its σ runs to ∞ (H row
zero) or 0 (W row zero) and its terms to 0. Such units are clamped at that limit, i.e. their terms
contribute exactly their infimum 0 and they leave the problem, which is then solved on the remaining
rows and columns (repeated until no row or column is dead, since removing a row can empty a column).
A row or column counts as zero when its sum is at most `DEAD_EPS` (1e-30) times the layer's total of
H (resp. Q): its terms could then contribute at most about sqrt(1e-30) = 1e-15 of the layer's value.
The counts are reported (`dead_rows`, `dead_cols` per layer and `dead_units` in total).

*Negative curvature.* The loss `normalized_ce` has a logit Hessian that is not positive semi-definite, so
H_ii can be negative; the measures are defined for H ≥ 0 (with a negative entry f is unbounded below),
so negative diagonal entries are clamped to 0 and counted (`negative_diagonal_clamped`). A rescaling
multiplies every H_ii by a positive factor, so clamping does not break any invariance. With `ce` the
exact diagonal is non-negative.

*Which matrices.* Every weight matrix of the network (`flatbench.measures.layers.weight_matrices`): Linear,
Conv1d/2d/3d and ConvTranspose kernels (reduced over their spatial axes), Embedding tables, and an
nn.MultiheadAttention's query, key, value and output projections, each its own problem. Tsuzuku et al.'s
PAC-Bayes argument holds for any weight matrix (its posterior variances σ_i σ'_j are a choice of
parametrization, not a property of the layer type), and the row × column variances make the value
invariant to the attention's own symmetries as well (a query row × c with the matching key row ÷ c; a value
row × c with the output projection's column ÷ c). Biases and normalization layers' affine parameters are
not included (Tsuzuku et al. define the measures on the weight matrices), nor any other parameter (a raw
positional embedding, recurrent weights): `info["left_out"]` names them by group. Invariances:
matrix-normalized sharpness is invariant to layer-wise and BN-wise rescaling (each matrix is rescaled as
a whole); normalized sharpness also to node-wise rescaling (rows and columns are rescaled), and computed
with `normalized_ce` also to scaling the logits (`normalized_sharpness_nce`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flatbench.errors import FlatbenchError
from flatbench.measures import shared
from flatbench.measures.builtin import TSUZUKU
from flatbench.measures.plugin import MeasureContext, MeasureOutput, register_measure
from flatbench.measures.registry import setting_range


DEAD_EPS = 1e-30
"""A row / column of H or W² whose sum is ≤ DEAD_EPS × the layer's total is dead (see the module doc)."""

KKT_TOL = 1e-10
"""Default bound on the relative row-condition imbalance (module doc: what float64 reaches, 1e-16)."""

NEWTON_AFTER = 30
"""Sweeps of plain alternating updates before each sweep is preceded by a Newton step (module doc)."""

SOLVERS = ("exact", "published")

NS_DEFAULTS = {"rtol": 1e-10, "kkt_tol": KKT_TOL, "max_iter": 10000, "solver": "exact",
               "published_steps": 10000, "published_lr": 1e-3, "published_decay": 1e-3,
               "published_dtype": "float32"}
"""Solver settings: converged when one sweep changes the layer's value by at most rtol (relative) and the
KKT residual is at most kkt_tol; `solver: published` runs the published SGD procedure instead (module doc),
its steps in `published_dtype` (float32: several times faster on a CPU than float64, the same value to ~1e-8)."""

NS_HELP = {
    "rtol": "solver exact: a sweep converges when it changes the layer's value by at most rtol (relative); > 0",
    "kkt_tol": "solver exact: ... and the KKT residual (row-condition imbalance) is at most kkt_tol; > 0",
    "max_iter": "solver exact: at most this many sweeps per layer; integer ≥ 1",
    "solver": "exact (the convex problem solved to rtol, invariant) | published (Tsuzuku et al.'s SGD on "
              "log σ, not invariant; the variant normalized_sharpness:published)",
    "published_steps": "solver published: SGD steps; integer ≥ 1",
    "published_lr": "solver published: SGD learning rate; > 0",
    "published_decay": "solver published: learning-rate decay; ≥ 0",
    "published_dtype": "solver published: float32 | float64, the dtype of its steps"}
NS_RULES = {"rtol": ("gt", 0), "kkt_tol": ("gt", 0), "max_iter": ("min", 1), "solver": ("in", SOLVERS),
            "published_steps": ("min", 1), "published_lr": ("gt", 0), "published_decay": ("min", 0),
            "published_dtype": ("in", ("float32", "float64"))}


# ---------------------------------------------------------------- the per-layer problem


def reduce_layer(h_diag: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(H, Q = W²) as float64 out × in matrices; conv kernels are summed over their spatial axes."""
    h = h_diag.detach().to(torch.float64)
    q = weight.detach().to(torch.float64).pow(2)
    if h.dim() > 2:
        dims = tuple(range(2, h.dim()))
        h, q = h.sum(dims), q.sum(dims)
    return h, q


def matrix_normalized(h: Tensor, q: Tensor) -> float:
    """min_s Σ (H s + Q / s) = 2 sqrt(ΣQ) sqrt(ΣH) (0 when either is 0)."""
    return 2.0 * math.sqrt(max(float(q.sum()), 0.0)) * math.sqrt(max(float(h.sum()), 0.0))


def lower_bound(h: Tensor, q: Tensor) -> float:
    """2 Σ_ij sqrt(H_ij Q_ij) = 2 Σ |W| sqrt(H): the value with one free variance per entry."""
    return 2.0 * float((h.clamp_min(0) * q).sqrt().sum())


@dataclass
class NSResult:
    value: float
    sigma: Tensor
    """Row variances factor (out,): +inf for rows with zero curvature, 0 for zero weight rows."""
    sigma_prime: Tensor
    """Column factor (in,), same conventions."""
    iterations: int
    rel_change: float
    kkt_residual: float
    converged: bool
    dead_rows: int
    dead_cols: int
    seconds: float
    newton_steps: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"value": self.value, "iterations": self.iterations, "newton_steps": self.newton_steps,
                "rel_change": self.rel_change, "kkt_residual": self.kkt_residual, "converged": self.converged,
                "dead_rows": self.dead_rows, "dead_cols": self.dead_cols, "seconds": round(self.seconds, 6)}


def _live(h: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Masks of the live rows and columns, and the limit (inf / 0) each dead one is clamped at."""
    rows = torch.ones(h.shape[0], dtype=torch.bool)
    cols = torch.ones(h.shape[1], dtype=torch.bool)
    row_limit = torch.full((h.shape[0],), float("nan"), dtype=torch.float64)
    col_limit = torch.full((h.shape[1],), float("nan"), dtype=torch.float64)
    h_tol = DEAD_EPS * float(h.sum())
    q_tol = DEAD_EPS * float(q.sum())
    while rows.any() and cols.any():
        hs, qs = h[rows][:, cols], q[rows][:, cols]
        r_h, r_q = hs.sum(1) <= h_tol, qs.sum(1) <= q_tol
        c_h, c_q = hs.sum(0) <= h_tol, qs.sum(0) <= q_tol
        dead_r, dead_c = r_h | r_q, c_h | c_q
        if not dead_r.any() and not dead_c.any():
            break
        ri, ci = rows.nonzero().squeeze(1), cols.nonzero().squeeze(1)
        # zero curvature → σ → ∞ (its Q terms vanish); zero weights → σ → 0 (its H terms vanish)
        zero = torch.zeros((), dtype=torch.float64)
        inf = torch.full((), float("inf"), dtype=torch.float64)
        row_limit[ri[dead_r]] = torch.where(r_q[dead_r], zero, inf)
        col_limit[ci[dead_c]] = torch.where(c_q[dead_c], zero, inf)
        rows[ri[dead_r]] = False
        cols[ci[dead_c]] = False
    return rows, cols, row_limit, col_limit


def _row_kkt(s: Tensor, a_row: Tensor, b_row: Tensor) -> float:
    """max_i |σ_i A_i − B_i/σ_i| / (σ_i A_i + B_i/σ_i): the row conditions' relative imbalance."""
    up, down = s * a_row, b_row / s
    return float(((up - down).abs() / (up + down)).max())


def _newton_step(hs: Tensor, qs: Tensor, s: Tensor, sp: Tensor) -> tuple[Tensor, Tensor, bool]:
    """One damped Newton step on f in (u, v) = (log σ, log σ'); returns the new (σ, σ') and whether it moved.

    The Hessian is [[diag(P 1), P], [Pᵀ, diag(Pᵀ 1)]] with P_ij = H_ij σ_i σ'_j + Q_ij / (σ_i σ'_j) ≥ 0: the
    signless Laplacian of a weighted bipartite graph, whose null vector is the flat direction (1, −1) (and
    the gradient is orthogonal to it). The larger block is eliminated, leaving the Schur complement
    S = diag(r) − P diag(c)⁻¹ Pᵀ on the smaller side (r, c the row and column sums of P, S 1 = 0); the flat
    direction is fixed by adding mean(r)/m · 1 1ᵀ. The step is halved until f decreases by the Armijo
    amount; no step is taken when none does (at the rounding floor) or when S is singular.
    """
    u, v = s.log(), sp.log()
    e = torch.exp(u[:, None] + v[None, :])
    he, qe = hs * e, qs / e
    value = float(he.sum() + qe.sum())
    p, g = he + qe, he - qe
    gu, gv = g.sum(1), g.sum(0)
    flip = hs.shape[0] > hs.shape[1]
    if flip:  # eliminate the rows instead: the same equations with the roles of u and v exchanged
        p, gu, gv = p.t(), gv, gu
    r, c = p.sum(1), p.sum(0)
    pc = p / c
    schur = torch.diag(r) - pc @ p.t()
    m = schur.shape[0]
    schur += float(r.mean()) / m
    # [[diag r, P], [Pᵀ, diag c]] (dx, dy) = −(gx, gy):  S dx = −gx + P C⁻¹ gy,  dy = −C⁻¹ (gy + Pᵀ dx)
    try:
        dx = torch.linalg.solve(schur, pc @ gv - gu)
    except RuntimeError:  # singular (an exactly decomposable problem has more flat directions): no step
        return s, sp, False
    dy = -(gv + p.t() @ dx) / c
    slope = float(gu @ dx + gv @ dy)
    du, dv = (dy, dx) if flip else (dx, dy)
    if not math.isfinite(slope) or slope >= 0:
        return s, sp, False
    t = 1.0
    while t >= 1e-10:
        nu, nv = u + t * du, v + t * dv
        e = torch.exp(nu[:, None] + nv[None, :])
        trial = float((hs * e).sum() + (qs / e).sum())
        if trial <= value + 1e-4 * t * slope:
            return nu.exp(), nv.exp(), True
        t *= 0.5
    return s, sp, False


def solve_normalized_sharpness(h: Tensor, q: Tensor, rtol: float = 1e-10, max_iter: int = 10000,
                               kkt_tol: float = KKT_TOL, newton_after: int = NEWTON_AFTER) -> NSResult:
    """min over σ, σ' > 0 of Σ H_ij σ_i σ'_j + Q_ij / (σ_i σ'_j) by exact alternating block updates.

    `h` and `q` are non-negative out × in matrices (converted to float64). Converged when one sweep changes
    f by at most `rtol` (relative) and the KKT residual is at most `kkt_tol`; after `newton_after` sweeps
    each sweep is preceded by a Newton step. See the module docstring for the stopping rule, dead rows /
    columns and the reported diagnostics.
    """
    start = time.perf_counter()
    h = h.detach().to("cpu", torch.float64).clamp_min(0)
    q = q.detach().to("cpu", torch.float64)
    rows, cols, row_limit, col_limit = _live(h, q)
    dead_rows, dead_cols = int((~rows).sum()), int((~cols).sum())
    sigma = row_limit.clone()
    sigma_p = col_limit.clone()
    if not rows.any() or not cols.any():
        sigma[rows] = float("inf")
        sigma_p[cols] = float("inf")
        return NSResult(0.0, sigma, sigma_p, 0, 0.0, 0.0, True, dead_rows, dead_cols,
                        time.perf_counter() - start)
    hs, qs = h[rows][:, cols].contiguous(), q[rows][:, cols].contiguous()
    hs_t, qs_t = hs.t().contiguous(), qs.t().contiguous()
    s0 = (float(qs.sum()) / float(hs.sum())) ** 0.25
    s = torch.full((hs.shape[0],), s0, dtype=torch.float64)
    sp = torch.full((hs.shape[1],), s0, dtype=torch.float64)
    a_row, b_row = hs @ sp, qs @ (1 / sp)
    value = float(s @ a_row + (1 / s) @ b_row)
    kkt = _row_kkt(s, a_row, b_row)
    rel, iterations, newton_steps, converged = float("inf"), 0, 0, False
    while True:
        if iterations and rel <= rtol and kkt <= kkt_tol:
            converged = True
            break
        if iterations >= max_iter:
            break
        iterations += 1
        if iterations > newton_after:
            s, sp, moved = _newton_step(hs, qs, s, sp)
            if moved:
                newton_steps += 1
                a_row, b_row = hs @ sp, qs @ (1 / sp)
        s = torch.sqrt(b_row / a_row)
        a_col, b_col = hs_t @ s, qs_t @ (1 / s)
        sp = torch.sqrt(b_col / a_col)
        # after the column update: f = Σ_j (a_j σ'_j + b_j / σ'_j) = 2 Σ_j sqrt(a_j b_j)
        new = float(2.0 * torch.sqrt(a_col * b_col).sum())
        rel = abs(value - new) / max(abs(new), 1e-300)
        value = new
        a_row, b_row = hs @ sp, qs @ (1 / sp)
        kkt = _row_kkt(s, a_row, b_row)
    sigma[rows] = s
    sigma_p[cols] = sp
    return NSResult(value, sigma, sigma_p, iterations, rel, kkt, converged, dead_rows, dead_cols,
                    time.perf_counter() - start, newton_steps)


@dataclass
class PublishedResult:
    """One layer solved by the published procedure: `steps` SGD steps on the normalized objective."""

    value: float
    """The un-normalized objective at the last evaluated iterate."""
    start: float
    """The objective at σ = σ' = 1 (the normalization constant)."""
    steps: int
    seconds: float

    @property
    def relative(self) -> float:
        """Final objective over its start (1 when nothing moved; 0 / 0 is reported as 1)."""
        return self.value / self.start if self.start > 0 else 1.0

    def summary(self) -> dict[str, Any]:
        return {"value": self.value, "objective_start": self.start,
                "final_relative_objective": self.relative, "steps": self.steps,
                "seconds": round(self.seconds, 6)}


def sgd_lr(lr: float, decay: float, t: int) -> float:
    """The published schedule: step t (0-based) uses lr / (1 + decay·t) (a LambdaLR stepped per step)."""
    return lr / (1.0 + decay * t)


def solve_normalized_sharpness_published(h: Tensor, q: Tensor, steps: int = 10000, lr: float = 1e-3,
                                         decay: float = 1e-3, dtype: torch.dtype = torch.float64
                                         ) -> PublishedResult:
    """The published procedure for one layer: SGD on (log σ, log σ') from 0, objective normalized to 1.

    Each step evaluates f / f(0) and its gradient at the current iterate, then moves by −lr_t × the
    gradient; the value returned is f at the iterate of the last step (before that step's move), as the
    reference code returns it. Closed-form gradients on the CPU, the steps in `dtype` (the normalization
    f(0) and the returned value in float64); no dead-unit handling (a dead row's log σ simply drifts).

    Speed: 10,000 steps of a dozen small vector operations each, so the steps run in NumPy (a few μs per
    operation where a torch call costs 10-20 μs), and each step reads the layer's two matrices twice (four
    matrix-vector products, the transposed ones without transposed copies): the large layers are bound by
    memory traffic, which float32 halves, and a layer of up to ~10^6 weights then stays in the CPU's cache.
    A 512 x 784 layer took 2.3 s in float32 against 13.4 s with torch in float64 on the 2-core CPU.
    """
    t0 = time.perf_counter()
    h64 = h.detach().to("cpu", torch.float64).clamp_min(0).numpy()
    q64 = q.detach().to("cpu", torch.float64).numpy()
    f0 = float(h64.sum() + q64.sum())
    if f0 <= 0 or steps <= 0:
        return PublishedResult(f0, f0, max(int(steps), 0), time.perf_counter() - t0)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    hn, qn = (h64 / f0).astype(np_dtype), (q64 / f0).astype(np_dtype)
    u = np.zeros(h64.shape[0], dtype=np_dtype)
    v = np.zeros(h64.shape[1], dtype=np_dtype)
    value = 1.0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # divergence is checked below
        for t in range(int(steps)):
            eu, ev = np.exp(u), np.exp(v)
            ieu, iev = 1.0 / eu, 1.0 / ev
            a, b = hn @ ev, qn @ iev
            if t == steps - 1:  # the objective at the last iterate, evaluated in float64
                value = float(eu.astype(np.float64) @ (h64 @ ev.astype(np.float64))
                              + ieu.astype(np.float64) @ (q64 @ iev.astype(np.float64))) / f0
            gu = eu * a - ieu * b                              # ∂/∂ log σ_i
            gv = ev * (eu @ hn) - iev * (ieu @ qn)             # ∂/∂ log σ'_j
            lr_t = np_dtype(sgd_lr(lr, decay, t))
            u -= lr_t * gu
            v -= lr_t * gv
    if not math.isfinite(value):
        raise RuntimeError("published normalized-sharpness SGD diverged (non-finite objective); "
                           "use a smaller published_lr")
    return PublishedResult(value * f0, f0, int(steps), time.perf_counter() - t0)


# ---------------------------------------------------------------- the measures


def _context_for_loss(ctx: MeasureContext, loss_name: str) -> MeasureContext:
    if ctx.loss_name == loss_name:
        return ctx
    return ctx.for_measure(ctx.measure_name, ctx.settings, loss_name=loss_name)


def layer_problems(ctx: MeasureContext, loss_name: str | None = None
                   ) -> tuple[list[tuple[str, Tensor, Tensor]], dict[str, Any]]:
    """Per weight matrix (`shared.matrices`, forward order): (name, H, Q) from the exact (or estimated)
    Hessian diagonal.

    Returns the problems and diagnostics: the diagonal's method, the number of negative diagonal entries
    clamped to 0 and the parameters left out (`left_out`: biases, normalization layers, other).
    """
    sub = _context_for_loss(ctx, loss_name or ctx.loss_name)
    result = shared.hessian_diagonal(sub)
    problems, negative = [], 0
    for matrix in shared.matrices(ctx):
        diag = matrix.part(result.diag[matrix.param])
        negative += int((diag < 0).sum())
        h, q = reduce_layer(diag.clamp_min(0), matrix.weight)
        problems.append((matrix.name, h, q))
    info = {"loss": sub.loss_name, "diagonal_method": result.method, "negative_diagonal_clamped": negative,
            "left_out": shared.left_out(ctx)}
    if sub.loss_name == "normalized_ce":
        info["normalized_ce_tau"] = sub.normalized_ce_tau
    return problems, info


@register_measure(
    "matrix_normalized_sharpness", family="rescaled curvature", papers=(TSUZUKU,),
    description="Tsuzuku et al. §4: Σ_l 2‖W_l‖_F sqrt(Tr H_{W_l}), one variance per weight matrix "
                "(closed form)",
    invariant_to=("layer", "bn"), cost="hessian", uses_loss=True)
def matrix_normalized_sharpness(ctx: MeasureContext) -> MeasureOutput:
    """Over every weight matrix (Linear, Conv, Embedding weights; an attention's q, k, v and output
    projections, each its own); biases, normalization layers and other parameters are named in
    `info["left_out"]` (module docstring: which matrices)."""
    problems, info = layer_problems(ctx)
    per_layer = {f"matrix_normalized_sharpness/{name}": matrix_normalized(h, q) for name, h, q in problems}
    return MeasureOutput({"matrix_normalized_sharpness": sum(per_layer.values()), **per_layer}, info)


def solver_setting(ctx: MeasureContext, defaults: dict[str, Any]) -> str:
    """The `solver` setting, checked (a bad value is the user's error, reported before any work is lost)."""
    solver = str(ctx.settings.get("solver", defaults["solver"]))
    if solver not in SOLVERS:
        raise FlatbenchError(f"measure setting solver: '{solver}' is not one of {', '.join(SOLVERS)}")
    return solver


def published_dtype(name: Any) -> torch.dtype:
    """The `published_dtype` setting (float32 | float64) as a torch dtype; another value is the user's error."""
    dtypes = {"float32": torch.float32, "float64": torch.float64}
    if name not in dtypes:
        raise FlatbenchError(f"measure setting published_dtype: '{name}' is not float32 or float64")
    return dtypes[name]


def _normalized_sharpness(ctx: MeasureContext, key: str, loss_name: str) -> MeasureOutput:
    problems, info = layer_problems(ctx, loss_name)
    setting = lambda name: ctx.settings.get(name, NS_DEFAULTS[name])
    solver = solver_setting(ctx, NS_DEFAULTS)
    rtol, kkt_tol, max_iter = float(setting("rtol")), float(setting("kkt_tol")), int(setting("max_iter"))
    values: dict[str, float] = {}
    layers: dict[str, Any] = {}
    exact: dict[str, NSResult] = {}
    for name, h, q in problems:
        exact[name] = solve_normalized_sharpness(h, q, rtol=rtol, max_iter=max_iter, kkt_tol=kkt_tol)
        if solver == "exact":
            values[f"{key}/{name}"] = exact[name].value
            layers[name] = exact[name].summary()
        else:
            pub = solve_normalized_sharpness_published(h, q, steps=int(setting("published_steps")),
                                                       lr=float(setting("published_lr")),
                                                       decay=float(setting("published_decay")),
                                                       dtype=published_dtype(setting("published_dtype")))
            values[f"{key}/{name}"] = pub.value
            layers[name] = {**pub.summary(), "exact_value": exact[name].value}
    info.update(
        solver=solver, layers=layers,
        dead_units=sum(r.dead_rows + r.dead_cols for r in exact.values()),
        solver_seconds=round(sum(l["seconds"] for l in layers.values()), 6))
    if solver == "exact":
        info.update(
            rtol=rtol, kkt_tol=kkt_tol, converged=all(l["converged"] for l in layers.values()),
            iterations_max=max((l["iterations"] for l in layers.values()), default=0),
            newton_steps=sum(l["newton_steps"] for l in layers.values()),
            rel_change_max=max((l["rel_change"] for l in layers.values()), default=0.0),
            kkt_residual_max=max((l["kkt_residual"] for l in layers.values()), default=0.0))
    else:
        exact_total = sum(r.value for r in exact.values())
        info.update(
            published_steps=int(setting("published_steps")), published_lr=float(setting("published_lr")),
            published_decay=float(setting("published_decay")), published_dtype=str(setting("published_dtype")),
            final_relative_objective={n: l["final_relative_objective"] for n, l in layers.items()},
            exact_value=exact_total, exact_converged=all(r.converged for r in exact.values()),
            gap_to_exact=(sum(values.values()) - exact_total) / exact_total if exact_total > 0 else 0.0)
    return MeasureOutput({key: sum(values.values()), **values}, info)


PUBLISHED = {"published": {"solver": "published"}}
"""The registered variant: `<measure>:published` runs the published SGD procedure (module doc)."""


@register_measure(
    "normalized_sharpness", family="rescaled curvature", papers=(TSUZUKU,),
    description="Tsuzuku et al. §5: Σ_l min_{σ,σ'} Σ_ij H_ij σ_iσ'_j + W_ij²/(σ_iσ'_j), cross-entropy",
    invariant_to=("layer", "node", "bn"), cost="hessian", defaults=NS_DEFAULTS, variants=PUBLISHED, fixed_loss="ce",
    settings_help=NS_HELP, check=lambda s: setting_range("normalized_sharpness", s, NS_RULES))
def normalized_sharpness(ctx: MeasureContext) -> MeasureOutput:
    """Normalized sharpness with the Hessian of the cross-entropy (Tsuzuku et al. §6.2's variant), over every
    weight matrix (an attention's q, k, v and output projections each its own problem); what it leaves out is
    named in `info["left_out"]` (module docstring: which matrices).

    The `published` variant (`solver: published`) is not invariant to any rescaling (module doc).
    """
    return _normalized_sharpness(ctx, "normalized_sharpness", "ce")


@register_measure(
    "normalized_sharpness_nce", family="rescaled curvature", papers=(TSUZUKU,),
    description="Tsuzuku et al. §5.4: normalized sharpness with the normalized-softmax cross-entropy "
                "(flatbench's normalized_ce, τ = measure.normalized_ce_tau)",
    invariant_to=("layer", "node", "bn", "logit_scale"), cost="hessian",
    defaults=NS_DEFAULTS, variants=PUBLISHED, fixed_loss="normalized_ce",
    settings_help=NS_HELP, check=lambda s: setting_range("normalized_sharpness_nce", s, NS_RULES))
def normalized_sharpness_nce(ctx: MeasureContext) -> MeasureOutput:
    """Normalized sharpness with the Hessian of `normalized_ce` (the paper's §6.1 choice), over the weight
    matrices of `normalized_sharpness`; what it leaves out is named in `info["left_out"]`.

    The `published` variant (`solver: published`) is not invariant to any rescaling (module doc).
    """
    return _normalized_sharpness(ctx, "normalized_sharpness_nce", "normalized_ce")
