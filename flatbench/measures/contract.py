"""The invariance contract (MEASURES.md), as the project's tests apply it and `flatbench check-measure`
offers it to every measure, built-in or plugin.

A catalogue of small trained float64 models (`CASES`: MLPs with and without biases and BatchNorm, a
bias-free MLP with equal hidden widths, LeNet-5, a tiny WRN), each trained briefly on a seeded subset of
the packaged mnist_mini, is transformed by every rescaling family that applies to it (`flatbench.rescale`)
with large random factors (log-uniform in [1/10, 10]); the function is checked to be unchanged, then:

- a **declared** family must leave the measure's headline value within its tolerance (`tolerance`, by
  the measure's class; a stochastic measure also within 3 of its reported standard errors);
- an **undeclared** family is shown: it breaks the measure (a relative change above `CHANGE_REL`) or
  happens to hold on that case;
- the measure must be finite and deterministic (the same value twice), unless it is stochastic and
  reports its standard error (`info["stderr"]`).

`check_measure(name)` returns one row per (case, family) and the problems found; tests/measures/test_invariance.py
runs the same checks as a pytest matrix over every registered measure.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn

from flatbench import rescale
from flatbench.config import DataConfig, ModelConfig
from flatbench.data import load_dataset
from flatbench.measures.context import MeasureContext
from flatbench.measures.evaluate import evaluate
from flatbench.measures.registry import MeasureOutput, MeasureSpec, NotApplicable, get_measure
from flatbench.models import MLP, LeNet5, WideResNet, model_families

DTYPE = torch.float64
N_EXAMPLES = 64
NUM_CLASSES = 10


@dataclass(frozen=True)
class Spec:
    """How a case is built: the architecture, its input resolution, and the training run."""

    arch: str
    """mlp, lenet or wrn."""
    pool: int = 1
    """mnist_mini images average-pooled by this factor (28 → 28 / pool pixels a side)."""
    widths: tuple[int, ...] = ()
    bias: bool = True
    batch_norm: bool = False
    steps: int = 40
    lr: float = 5e-3
    seed: int = 0
    n: int = N_EXAMPLES


SPECS: dict[str, Spec] = {
    "mlp": Spec("mlp", pool=4, widths=(16, 12)),
    "mlp_nobias": Spec("mlp", pool=4, widths=(16, 12), bias=False, seed=1),
    "mlp_bn": Spec("mlp", pool=4, widths=(16, 12), batch_norm=True, seed=2),
    "mlp_psi": Spec("mlp", pool=7, widths=(5, 5), bias=False, seed=3, steps=60, lr=1e-2),
    "lenet": Spec("lenet", seed=4, steps=30, lr=3e-3),
    "wrn": Spec("wrn", pool=4, seed=5, steps=30, lr=3e-3),
}
CASES: tuple[str, ...] = tuple(SPECS)

FAMILIES_OF: dict[str, frozenset[str]] = {
    name: model_families(ModelConfig(name=s.arch, widths=s.widths, bias=s.bias, batch_norm=s.batch_norm))
    for name, s in SPECS.items()}
"""The rescaling families that apply to each case, as its model's registration declares them (known without
building it; tests/test_rescale.py checks it against `flatbench.rescale.applicable_families`)."""


@dataclass(frozen=True)
class Case:
    name: str
    model: nn.Module
    """The trained model, float64, eval mode. Shared: do not modify (see `copy`)."""
    inputs: Tensor
    targets: Tensor
    num_classes: int
    config: dict[str, Any] = field(default_factory=dict)
    """The build spec (architecture, widths, input shape, training steps, learning rate, seed)."""

    def copy(self) -> nn.Module:
        """A deep copy of the model, to modify freely."""
        return copy.deepcopy(self.model)


@cache
def _mnist_mini(n: int, pool: int) -> tuple[Tensor, Tensor]:
    ds = load_dataset(DataConfig(dataset="mnist_mini", n_train=n, n_test=10), seed=0)
    x = ds.x_train.to(DTYPE)
    if pool > 1:
        x = nn.functional.avg_pool2d(x, pool)
    return x, ds.y_train


def _build(spec: Spec, shape: tuple[int, ...]) -> nn.Module:
    if spec.arch == "mlp":
        return MLP(shape[0] * shape[1] * shape[2], spec.widths, NUM_CLASSES, bias=spec.bias,
                   batch_norm=spec.batch_norm)
    if spec.arch == "lenet":
        return LeNet5(shape[0], shape[1], NUM_CLASSES)
    return WideResNet(shape[0], NUM_CLASSES, depth=10, width=1)


@cache
def case(name: str) -> Case:
    """The trained case `name` (one of CASES), built once per process; the global torch RNG is untouched."""
    if name not in SPECS:
        raise KeyError(f"unknown case '{name}' (cases: {', '.join(CASES)})")
    spec = SPECS[name]
    x, y = _mnist_mini(spec.n, spec.pool)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = _build(spec, tuple(x.shape[1:])).to(DTYPE)
        opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
        model.train()
        for _ in range(spec.steps):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    config = {"arch": spec.arch, "widths": spec.widths, "bias": spec.bias, "batch_norm": spec.batch_norm,
              "input_shape": tuple(x.shape[1:]), "n": spec.n, "steps": spec.steps, "lr": spec.lr,
              "seed": spec.seed, "data": f"mnist_mini train rows, avg-pooled by {spec.pool}"}
    return Case(name, model, x, y, NUM_CLASSES, config)


def context(which: str | Case, model: nn.Module | None = None, **kwargs: Any) -> MeasureContext:
    """A MeasureContext on a case's measurement set (its model, or `model`, e.g. a transformed copy)."""
    c = case(which) if isinstance(which, str) else which
    return MeasureContext(model=c.model if model is None else model, inputs=c.inputs, targets=c.targets,
                          num_classes=c.num_classes, run_id=f"case-{c.name}", **kwargs)


# ---------------------------------------------------------------- tolerances (see tests/measures/test_invariance.py)

EXACT_RTOL = 1e-10
SOLVER_RTOL = 1e-9
ITERATIVE_RTOL = 1e-9
STOCHASTIC_RTOL = 1e-9
SOLVERS = ("minimum_sharpness", "normalized_sharpness", "normalized_sharpness_nce")
STDERRS = 3.0
CHANGE_REL = 1e-2
"""An undeclared family breaks a measure when it moves it by more than this (relative)."""
FUNCTION_RTOL = 1e-10
"""A transformation must leave the logits unchanged to this relative tolerance (float64)."""
FACTORS = {"invariance": (0.1, 10.0), "change": (3.0, 10.0), "shrink": (0.01, 0.1)}


def tolerance(spec: MeasureSpec | str) -> tuple[float, str]:
    """The relative tolerance of a declared invariance, and the class it comes from."""
    spec = get_measure(spec) if isinstance(spec, str) else spec
    if spec.stochastic:
        return STOCHASTIC_RTOL, "stochastic, common random numbers"
    if not spec.exact:
        return ITERATIVE_RTOL, "deterministic iterative search"
    if spec.name in SOLVERS:
        return SOLVER_RTOL, "exact solver"
    return EXACT_RTOL, "exact closed form"


# ---------------------------------------------------------------- transformed cases and outputs


@cache
def transformed(name: str, family: str | None, factors: str = "invariance") -> nn.Module:
    """The case's model after one seeded `family` transformation (the case's own model for None); the
    function is checked to be unchanged (`rescale.checked_transform`)."""
    model = case(name).model
    if family is None:
        return model
    seed = 1000 + CASES.index(name) * 10 + rescale.FAMILIES.index(family) + 100 * list(FACTORS).index(factors)
    return rescale.checked_transform(model, family, torch.Generator().manual_seed(seed), *FACTORS[factors],
                                     case(name).inputs, FUNCTION_RTOL, name)[0]


def transformed_case(c: Case, family: str, seed: int = 0) -> nn.Module:
    """A case of one's own (`own_case`) after one seeded `family` transformation with invariance factors; the
    function is checked to be unchanged."""
    generator = torch.Generator().manual_seed(7000 + seed + rescale.FAMILIES.index(family))
    return rescale.checked_transform(c.model, family, generator, *FACTORS["invariance"], c.inputs, FUNCTION_RTOL,
                                     c.name)[0]


def own_case(name: str, model: nn.Module, inputs: Tensor, targets: Tensor, num_classes: int,
             config: dict[str, Any] | None = None) -> Case:
    """A model of one's own as a case of the contract (`check-measure --factory`): a float64 copy in eval
    mode on its data (floating inputs in float64)."""
    net = copy.deepcopy(model).to(DTYPE).eval()
    x = inputs.to(DTYPE) if inputs.is_floating_point() else inputs
    return Case(name, net, x, targets, num_classes, dict(config or {}))


def families_of(c: str | Case) -> frozenset[str]:
    """The rescaling families that apply to a case (a catalogue case's are known without building it)."""
    if isinstance(c, str):
        return FAMILIES_OF.get(c, frozenset())
    return frozenset(f for f, ok in rescale.applicable_families(c.model).items() if ok is True)


@cache
def shared_context(name: str, family: str | None, factors: str = "invariance") -> MeasureContext:
    """One context (and cache) per case and transformation, shared by every measure."""
    return context(name, transformed(name, family, factors))


Result = MeasureOutput | NotApplicable | BaseException


def run_measure(spec: MeasureSpec, ctx: MeasureContext, settings: dict[str, Any] | None = None,
                timeout_s: float | None = None) -> Result:
    """The measure on a context with its defaults updated by `settings`: its output, NotApplicable, or the
    exception it raised. It runs as the measure stage runs it (`evaluate.evaluate`: guarded, a change of the
    model, the measurement set or the process put back and returned as an `OutsideChange`; limited to
    `timeout_s`, a `MeasureTimeout`), and the contract judges the measure's own answer (a NaN, say)."""
    merged = {**spec.settings(), **{k: v for k, v in (settings or {}).items() if k in spec.defaults}}
    record = evaluate(spec=spec, ctx=ctx, settings=merged, timeout_s=timeout_s)
    return record.output if record.output is not None else record.exception


def headline(out: Result, spec: MeasureSpec) -> float:
    """The headline value of an output (KeyError when the measure did not return one)."""
    return float(out.values[spec.base_name if spec.base_name in out.values else spec.name])


def stderr_of(out: MeasureOutput, name: str) -> float:
    se = out.info.get("stderr")
    if isinstance(se, dict):
        se = se.get(name)
    try:
        return float(se) if se is not None and math.isfinite(float(se)) else 0.0
    except (TypeError, ValueError):
        return 0.0


def rel_change(v0: float, v1: float) -> float:
    """|v1 − v0| / |v0|, the one relative change of every invariance check (the contract and both audits):
    relative for values of any size (no floor that would make a small value's change absolute), 0 between
    two zeros and inf from 0 to anything else, NaN where either value is NaN (a failed evaluation)."""
    if math.isnan(v0) or math.isnan(v1):
        return math.nan
    if v0 == 0:
        return 0.0 if v1 == 0 else math.inf
    return abs(v1 - v0) / abs(v0)


def declares(spec: MeasureSpec, family: str) -> bool:
    """Whether a measure declares invariance to `family`: the one rule of the contract and both audits; a
    variant (a preset of its base's settings, e.g. a solver stopped early) declares none."""
    return not spec.base and family in spec.invariant_to


def within_declared(spec: MeasureSpec, before: MeasureOutput, after: MeasureOutput) -> tuple[bool, float, float]:
    """Whether a declared invariance holds between two outputs: (ok, relative change, tolerance)."""
    v0, v1 = headline(before, spec), headline(after, spec)
    rel = rel_change(v0, v1)
    tol, _ = tolerance(spec)
    ok = rel <= tol
    if ok and spec.stochastic:
        allowed = STDERRS * math.hypot(stderr_of(before, spec.name), stderr_of(after, spec.name))
        ok = abs(v1 - v0) <= allowed
    return ok, rel, tol


# ---------------------------------------------------------------- check-measure


@dataclass
class CheckRow:
    case: str
    family: str
    """A rescaling family, or "-" for the case's own checks (finite, deterministic)."""
    declared: bool
    before: float
    after: float
    rel_change: float
    tolerance: float
    verdict: str
    """ok | FAIL | breaks | holds | not applicable | error."""
    note: str = ""


@dataclass
class CheckReport:
    measure: str
    rows: list[CheckRow]
    problems: list[str]
    """Why the check fails (a declared invariance broken, a non-finite or nondeterministic value)."""


def check_measure(name: str, *, cases: tuple[str | Case, ...] | list[str | Case] = CASES,
                  families: tuple[str, ...] | list[str] = rescale.FAMILIES,
                  settings: dict[str, Any] | None = None, timeout_s: float | None = None) -> CheckReport:
    """Apply the contract to one registered measure on the catalogue (see the module docstring); a case may
    also be a model of one's own (`own_case`), rescaled by every family that applies to it. Each call of the
    measure runs guarded and limited to `timeout_s` (`run_measure`)."""
    spec = get_measure(name)
    rows: list[CheckRow] = []
    problems: list[str] = []
    applies_somewhere = False
    broken: dict[str, list[str]] = {}
    for which in cases:
        cname = which if isinstance(which, str) else which.name
        ctx = context(which)  # a fresh cache: the measure's own work, not another's
        first = run_measure(spec, ctx, settings, timeout_s)
        if isinstance(first, NotApplicable):
            rows.append(CheckRow(cname, "-", False, math.nan, math.nan, math.nan, math.nan, "not applicable",
                                 str(first)))
            continue
        if isinstance(first, BaseException) or spec.base_name not in first.values and spec.name not in first.values:
            what = f"{type(first).__name__}: {first}" if isinstance(first, BaseException) else "no headline value"
            rows.append(CheckRow(cname, "-", False, math.nan, math.nan, math.nan, math.nan, "error", what))
            problems.append(f"{cname}: {what}")
            continue
        applies_somewhere = True
        v0 = headline(first, spec)
        second = run_measure(spec, context(which), settings, timeout_s)
        v_again = headline(second, spec) if isinstance(second, MeasureOutput) else math.nan
        note, verdict = "finite, deterministic", "ok"
        if not math.isfinite(v0):
            verdict, note = "FAIL", f"not finite ({v0})"
            problems.append(f"{cname}: value {v0} is not finite")
        elif v_again != v0:
            if spec.stochastic and stderr_of(first, spec.name) > 0:
                note = f"stochastic: {v0:.6g} then {v_again:.6g}, standard error {stderr_of(first, spec.name):.3g}"
            else:
                verdict = "FAIL"
                note = (f"nondeterministic: {v0:.15g} then {v_again:.15g}" + (
                    "" if spec.stochastic else " (declare stochastic=True and report info['stderr'])")
                    + ("" if not spec.stochastic else " without a standard error in info['stderr']"))
                problems.append(f"{cname}: {note}")
        rows.append(CheckRow(cname, "-", False, v0, v_again, rel_change(v0, v_again) if math.isfinite(v_again)
                             else math.nan, 0.0, verdict, note))
        for family in families:
            if family not in families_of(which):
                continue
            declared = declares(spec, family)
            model = transformed(cname, family) if isinstance(which, str) else transformed_case(which, family)
            after = run_measure(spec, context(which, model), settings, timeout_s)
            if isinstance(after, BaseException):
                rows.append(CheckRow(cname, family, declared, v0, math.nan, math.nan, math.nan, "error",
                                     f"{type(after).__name__}: {after}"))
                if declared:
                    problems.append(f"{family} on {cname}: {type(after).__name__} after the rescaling: {after}")
                continue
            v1 = headline(after, spec)
            if declared:
                ok, rel, tol = within_declared(spec, first, after)
                rows.append(CheckRow(cname, family, True, v0, v1, rel, tol, "ok" if ok else "FAIL"))
                if not ok:
                    broken.setdefault(family, []).append(f"{cname} by {rel:.2e} ({v0:.8g} → {v1:.8g})")
            else:
                rel = rel_change(v0, v1)
                rows.append(CheckRow(cname, family, False, v0, v1, rel, CHANGE_REL,
                                     "breaks" if rel > CHANGE_REL else "holds"))
    tried = {f: sum(1 for r in rows if r.family == f and r.declared) for f in broken}
    hint = ("; a stochastic measure is compared with the same seeded draws before and after (ctx.generator()): "
            "its noise must move with the rescaling, and the values must agree to the tolerance and within "
            f"{STDERRS:g} standard errors") if spec.stochastic else ""
    for family, where in broken.items():
        problems.append(f"declared invariant to {family}, but it changed on {len(where)} of {tried[family]} cases "
                        f"(relative tolerance {tolerance(spec)[0]:g}, {tolerance(spec)[1]}): {'; '.join(where[:3])}"
                        + ("; ..." if len(where) > 3 else "") + hint)
    if not applies_somewhere:
        problems.append("the measure applies to no case of the catalogue")
    return CheckReport(spec.name, rows, problems)


def format_report(report: CheckReport) -> list[str]:
    """The check as a table (one line per case and family) and a verdict line."""
    def num(v: float) -> str:
        return "-" if not math.isfinite(v) else f"{v:.6g}"

    header = ("case", "family", "declared", "before", "after", "rel change", "tolerance", "verdict")
    table = [header] + [(r.case, r.family, "yes" if r.declared else "no" if r.family != "-" else "-", num(r.before),
                         num(r.after), num(r.rel_change) if r.family != "-" else "-",
                         num(r.tolerance) if r.family != "-" else "-",
                         r.verdict + (f"  {r.note}" if r.note else "")) for r in report.rows]
    widths = [max(len(row[c]) for row in table) for c in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1] for row in table]
    spec = get_measure(report.measure)
    broken = sorted({r.family for r in report.rows if r.verdict == "breaks"})
    held = sorted({r.family for r in report.rows if r.verdict == "holds"} - set(broken))
    lines.append("")
    lines.append(f"declared invariant to: {', '.join(sorted(spec.invariant_to)) or 'none'}; undeclared families "
                 f"that break it: {', '.join(broken) or 'none'}"
                 + (f"; undeclared, yet unchanged on every case tried: {', '.join(held)}" if held else ""))
    if report.problems:
        lines.append(f"FAILED: {report.measure}: " + "; ".join(report.problems))
    else:
        lines.append(f"passed: {report.measure} keeps every declared invariance, is finite and "
                     + ("reports its standard error" if spec.stochastic else "deterministic"))
    return lines
