"""Ibayashi et al.'s minimum sharpness: the smallest Hessian trace over layer-wise rescalings.

A ReLU network without normalization layers computes the same function after

    W_l ← α_l W_l,  b_l ← (Π_{k≤l} α_k) b_l   (l < L),    W_L ← W_L / Π_{k<L} α_k,  b_L unchanged,

and under it the per-layer Hessian traces change as T^W_l / α_l², T^b_l / (Π_{k≤l} α_k)² and
T^W_L (Π_{k<L} α_k)². With the traces of the exact diagonal at the trained weights:

    MinSharp = min_{α > 0} Σ_{l<L} [T^W_l / α_l² + T^b_l / (Π_{k≤l} α_k)²] + T^W_L (Π_{k<L} α_k)² + T^b_L

Each term is c·exp(⟨g, a⟩) in a = log α, so the objective is convex in a; `solve_minimum_sharpness` runs
Newton's method in float64 with a backtracking line search, started from the bias-free optimum, until the
Newton decrement λ²/2 (an upper bound of the remaining gap near the optimum) is at most `rtol` × the
value. Without biases all L terms are equal at the optimum, which gives the closed form
`L · (Π_l T^W_l)^{1/L}`.

*The loss.* With `normalized_ce` the measure is not applicable (both solvers): that loss normalizes the
logits, so it is unchanged when the last layer is scaled, (W_L, b_L) ← c (W_L, b_L) for any c > 0, which
leaves every other layer's Hessian unchanged and divides T^W_L and T^b_L by c². Adding that symmetry of
the loss to the layer-wise ones, c → ∞ and then α → ∞ drive every term to 0: the minimum over the
loss's own symmetries is 0 for every model (degenerate), so `minimum_sharpness@normalized_ce` is
reported as not applicable with that reason.

*Negative curvature.* With `normalized_ce` (whose logit Hessian is indefinite) diagonal entries can be
negative, and a layer with a negative trace would make the minimum −∞ (scale that layer's weights down
without limit). As for normalized sharpness, negative diagonal entries are clamped to 0 before the
traces are summed (a rescaling multiplies every entry by a positive factor, so the clamping does not
break the invariance) and their number is reported (`negative_diagonal_clamped`); with `ce` the exact
diagonal is non-negative.

*The published solver* (`solver: published`, the registered variant `minimum_sharpness:published`).
Ibayashi et al.'s public code did not solve the problem: it ran `published_steps` (10,000) plain SGD
steps (no momentum) on a = log α (one per layer l < L, the objective above), from α = 1 (the trained
scale), with learning rate lr_t = lr / (1 + decay·t) (`published_lr` = 1e-3, `published_decay` = 1e-3), in
float64, on the objective divided by its value at the start (the untransformed Tr H, so it starts at 1;
the normalization is over the **whole** objective, all layers together). The value is the
un-normalized objective at the last iterate the reference evaluates (the one its final step starts from);
its logs show the objective still falling there. `solve_minimum_sharpness_published` reproduces it with
the closed-form gradient Σ_t c_t e^{g_t·a} g_t. It is an upper bound of the exact minimum and is *not*
invariant to layer-wise rescaling (it starts from the trained scale and stops early): it exists to show
whether a paper's correlation comes from the measure or from stopping its solver early. The result info
gives the steps, the final objective relative to its start (`final_relative_objective`) and the exact
minimum (`exact_value`, `gap_to_exact`). Measured (10,000 steps, 0.05–0.13 s on one CPU core): the
final objective is 0.89–0.93 of its start on small MLPs 20-12-10-4 (0.01–0.04% above the exact
minimum), 0.78 on an MLP 784-128-64-10 and 0.50 on LeNet-5 trained on 512 mnist_mini examples (0.08%
and 16.5% above the exact minimum): how far it stops from the minimum depends on how unbalanced the
trained layers' traces are.

Applies to chains of Linear / Conv2d layers separated by positively homogeneous modules (flatbench's
`mlp` without BatchNorm and `lenet`). With BatchNorm after a weight layer (mlp with batch_norm, and
`wrn`, whose every conv feeds a BatchNorm or the residual stream) the transformation above is not
function-preserving, and the weight layer's scale becomes a free symmetry of its own (the `bn` family:
scaling W_l up divides T^W_l without limit), so the minimum would be 0: the measure reports
not applicable with that reason. Invariant to layer-wise rescaling (the minimum over the orbit).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from flatbench.errors import FlatbenchError
from flatbench.measures import shared
from flatbench.measures.plugin import MeasureContext, MeasureOutput, NotApplicable, register_measure
from flatbench.measures.registry import setting_range
from flatbench.rescale import structure


SOLVERS = ("exact", "published")

MS_DEFAULTS = {"rtol": 1e-14, "max_iter": 200, "solver": "exact", "published_steps": 10000,
               "published_lr": 1e-3, "published_decay": 1e-3}
"""Newton stops when the decrement λ²/2 is at most rtol × the value; `solver: published` runs the
published SGD procedure instead (module doc)."""
MS_HELP = {
    "rtol": "solver exact: Newton stops when its decrement λ²/2 is at most rtol × the value; > 0",
    "max_iter": "solver exact: at most this many Newton steps; integer ≥ 1",
    "solver": "exact (Newton on the convex problem in log α, invariant) | published (the paper's SGD, not "
              "invariant; the variant minimum_sharpness:published)",
    "published_steps": "solver published: SGD steps; integer ≥ 1",
    "published_lr": "solver published: SGD learning rate; > 0",
    "published_decay": "solver published: learning-rate decay; ≥ 0"}
MS_RULES = {"rtol": ("gt", 0), "max_iter": ("min", 1), "solver": ("in", SOLVERS), "published_steps": ("min", 1),
            "published_lr": ("gt", 0), "published_decay": ("min", 0)}


@dataclass
class MinSharpResult:
    value: float
    alpha: list[float]
    """The optimal α_l (l < L) relative to the trained weights."""
    iterations: int
    decrement: float
    """Final Newton decrement λ²/2 relative to the value."""
    converged: bool
    seconds: float
    closed_form: float | None
    """L·(Π T^W)^{1/L} when there are no bias traces (the solver must agree with it)."""


def _terms(tw: list[float], tb: list[float]) -> tuple[Tensor, Tensor, float]:
    """(coefficients c, exponent rows g, constant): objective = Σ c_t exp(g_t · a) + constant."""
    L = len(tw)
    coeffs, rows = [], []
    for l in range(L - 1):
        g = torch.zeros(L - 1, dtype=torch.float64)
        g[l] = -2.0
        coeffs.append(tw[l])
        rows.append(g)
        if tb[l] > 0:
            g = torch.zeros(L - 1, dtype=torch.float64)
            g[:l + 1] = -2.0
            coeffs.append(tb[l])
            rows.append(g)
    coeffs.append(tw[L - 1])
    rows.append(torch.full((L - 1,), 2.0, dtype=torch.float64))
    c = torch.tensor(coeffs, dtype=torch.float64)
    keep = c > 0
    return c[keep], torch.stack(rows)[keep], float(tb[L - 1])


def solve_minimum_sharpness(tw: list[float], tb: list[float] | None = None, rtol: float = 1e-14,
                            max_iter: int = 200) -> MinSharpResult:
    """Minimize the layer-wise-rescaled Hessian trace over α > 0 (Newton in log α, float64).

    `tw[l]`, `tb[l]` are the traces of the Hessian over layer l's weights and biases (0 for no bias).
    Negative traces are clamped to 0 (the problem is unbounded below otherwise).
    """
    start = time.perf_counter()
    L = len(tw)
    tw = [max(float(t), 0.0) for t in tw]
    tb = [max(float(t), 0.0) for t in (tb or [0.0] * L)]
    closed = None
    if not any(tb) and all(t > 0 for t in tw):
        closed = L * math.exp(sum(math.log(t) for t in tw) / L)
    if L == 1:
        return MinSharpResult(tw[0] + tb[0], [], 0, 0.0, True, time.perf_counter() - start, closed)
    c, g, const = _terms(tw, tb)

    def objective(a: Tensor) -> float:
        return float((c * torch.exp(g @ a)).sum()) + const

    # start at the bias-free optimum: α_l² = T^W_l / m with m = (Π T^W)^{1/L}
    a = torch.zeros(L - 1, dtype=torch.float64)
    if all(t > 0 for t in tw):
        log_m = sum(math.log(t) for t in tw) / L
        a = torch.tensor([0.5 * (math.log(tw[l]) - log_m) for l in range(L - 1)], dtype=torch.float64)
    value = objective(a)
    decrement, converged, iterations = float("inf"), False, 0
    for iterations in range(1, max_iter + 1):
        e = c * torch.exp(g @ a)
        grad = g.t() @ e
        hess = (g.t() * e) @ g
        # a tiny Levenberg term keeps the step defined when some traces are 0 (flat directions)
        damp = 1e-13 * float(hess.diagonal().abs().max().clamp_min(1e-300))
        step = -torch.linalg.solve(hess + damp * torch.eye(L - 1, dtype=torch.float64), grad)
        decrement = float(-(grad @ step)) / 2.0
        if decrement <= rtol * max(value, 1e-300):
            converged = True
            break
        t = 1.0
        while True:
            trial = objective(a + t * step)
            if trial <= value - 0.25 * t * 2 * decrement or t < 1e-12:
                break
            t *= 0.5
        if trial > value:
            break
        a, value = a + t * step, trial
    return MinSharpResult(value, [math.exp(x) for x in a.tolist()], iterations,
                          decrement / max(value, 1e-300), converged, time.perf_counter() - start, closed)


@dataclass
class PublishedMinSharpResult:
    value: float
    """The un-normalized objective at the last evaluated iterate."""
    start: float
    """The objective at α = 1 (the trained model's Tr H), the normalization constant."""
    alpha: list[float]
    """α_l (l < L) at the last evaluated iterate."""
    steps: int
    seconds: float

    @property
    def relative(self) -> float:
        return self.value / self.start if self.start > 0 else 1.0


def solve_minimum_sharpness_published(tw: list[float], tb: list[float] | None = None, steps: int = 10000,
                                      lr: float = 1e-3, decay: float = 1e-3) -> PublishedMinSharpResult:
    """The published procedure: `steps` SGD steps on log α from 0 on the objective divided by its start.

    Step t (0-based) evaluates the normalized objective and its gradient at the current iterate and moves
    by −lr/(1 + decay·t) × the gradient; the value returned is the objective at the iterate of the last
    step (before that step's move), as the reference code returns it, times the normalization constant.
    """
    t0 = time.perf_counter()
    L = len(tw)
    tw = [max(float(t), 0.0) for t in tw]
    tb = [max(float(t), 0.0) for t in (tb or [0.0] * L)]
    f0 = sum(tw) + sum(tb)
    if L == 1 or f0 <= 0 or steps <= 0:
        return PublishedMinSharpResult(f0, f0, [1.0] * (L - 1), max(int(steps), 0), time.perf_counter() - t0)
    c, g, const = _terms(tw, tb)
    cn, g_t = c / f0, g.t().contiguous()
    a = torch.zeros(L - 1, dtype=torch.float64)
    value, at = 1.0, a.clone()
    for t in range(int(steps)):
        e = cn * torch.exp(g @ a)
        if t == steps - 1:
            value, at = float(e.sum()) + const / f0, a.clone()
        a.sub_(g_t @ e, alpha=lr / (1.0 + decay * t))
    if not math.isfinite(value):
        raise RuntimeError("published minimum-sharpness SGD diverged (non-finite objective); "
                           "use a smaller published_lr")
    return PublishedMinSharpResult(value * f0, f0, [math.exp(x) for x in at.tolist()], int(steps),
                                   time.perf_counter() - t0)


def layer_traces(ctx: MeasureContext) -> tuple[list[str], list[float], list[float], str, int]:
    """Names, weight traces and bias traces of the weight layers (forward order), the diagonal method and
    the number of negative diagonal entries clamped to 0.

    Raises NotApplicable when the layer-wise rescaling is not function-preserving for this model.
    """
    s = structure(ctx.model)
    if s.unsupported:
        raise NotApplicable(f"layer-wise rescaling is not defined for this architecture ({s.unsupported})")
    if s.bn_pairs:
        raise NotApplicable("BatchNorm follows a weight layer: W_l ← α W_l is then not function-preserving, "
                            "and scaling W_l with the BatchNorm statistics (the bn symmetry) drives its "
                            "trace to 0, so the minimum over rescalings is 0")
    if any(not isinstance(j.producer, (torch.nn.Linear, torch.nn.Conv2d)) for j in s.junctions):
        raise NotApplicable("a hidden layer's output is not a weight layer's output")
    layers = shared.layers(ctx)
    others = [n for group in shared.left_out(ctx, [p for l in layers for p in l.module.parameters()]).values()
              for n in group]
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise NotApplicable(f"{len(others)} parameter{'s' if len(others) > 1 else ''} outside the Linear/Conv2d "
                            f"layers ({shown}) not covered by the layer-wise rescaling")
    result = shared.hessian_diagonal(ctx)
    names = [l.name for l in layers]
    negative = sum(int((d < 0).sum()) for d in result.diag.values())

    def trace(key: str) -> float:
        return float(result.diag[key].clamp_min(0).sum()) if key in result.diag else 0.0

    tw = [trace(f"{n}.weight") for n in names]
    tb = [trace(f"{n}.bias") for n in names]
    return names, tw, tb, result.method, negative


@register_measure(
    "minimum_sharpness", family="rescaled curvature",
    papers=("Ibayashi, Hamaguchi, Imaizumi. Minimum sharpness: scale-invariant "
            "parameter-robustness of neural networks. 2021",),
    description="Ibayashi et al. 2021: min over layer-wise rescalings α of Tr H (Newton in log α on the "
                "per-layer traces of the exact diagonal)",
    invariant_to=("layer",), cost="hessian", uses_loss=True, defaults=MS_DEFAULTS,
    variants={"published": {"solver": "published"}}, settings_help=MS_HELP,
    check=lambda s: setting_range("minimum_sharpness", s, MS_RULES))
def minimum_sharpness(ctx: MeasureContext) -> MeasureOutput:
    """Minimum sharpness (module doc); the `published` variant is not invariant to layer rescaling."""
    if ctx.loss_name == "normalized_ce":
        raise NotApplicable("normalized_ce is unchanged by scaling the last layer's weights and bias by "
                            "c > 0, a symmetry of the loss itself that divides that layer's traces by c²; "
                            "with the layer-wise rescalings the minimum of Tr H is then 0 (degenerate)")
    solver = str(ctx.settings.get("solver", MS_DEFAULTS["solver"]))
    if solver not in SOLVERS:
        raise FlatbenchError(f"measure setting solver: '{solver}' is not one of {', '.join(SOLVERS)}")
    names, tw, tb, method, negative = layer_traces(ctx)
    setting = lambda name: ctx.settings.get(name, MS_DEFAULTS[name])
    res = solve_minimum_sharpness(tw, tb, rtol=float(setting("rtol")), max_iter=int(setting("max_iter")))
    info = {"loss": ctx.loss_name, "diagonal_method": method, "solver": solver,
            "trace_unscaled": sum(tw) + sum(tb), "weight_traces": dict(zip(names, tw)),
            "bias_traces": dict(zip(names, tb)), "negative_diagonal_clamped": negative}
    if res.closed_form is not None:
        info["closed_form"] = res.closed_form
    if solver == "exact":
        info.update(alpha=dict(zip(names[:-1], res.alpha)), iterations=res.iterations,
                    newton_decrement=res.decrement, converged=res.converged,
                    solver_seconds=round(res.seconds, 6))
        return MeasureOutput({"minimum_sharpness": res.value}, info)
    pub = solve_minimum_sharpness_published(tw, tb, steps=int(setting("published_steps")),
                                            lr=float(setting("published_lr")),
                                            decay=float(setting("published_decay")))
    info.update(alpha=dict(zip(names[:-1], pub.alpha)), published_steps=pub.steps,
                published_lr=float(setting("published_lr")),
                published_decay=float(setting("published_decay")),
                objective_start=pub.start, final_relative_objective=pub.relative,
                exact_value=res.value, exact_converged=res.converged,
                gap_to_exact=(pub.value - res.value) / res.value if res.value > 0 else 0.0,
                solver_seconds=round(pub.seconds, 6))
    return MeasureOutput({"minimum_sharpness": pub.value}, info)
