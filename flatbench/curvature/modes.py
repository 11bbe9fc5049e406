"""Which derivative mode computes a Hessian-vector product, and the check that no mode is trusted unchecked.

A Hessian-vector product can be taken three ways: double backward (PyHessian's `autograd.grad(⟨∇L, v⟩)`),
reverse-over-forward (`grad(jvp(L))`) and forward-over-reverse (`jvp(grad(L))`). In exact arithmetic they
are the same product; in torch they are three different chains of derivative formulas, and a wrong formula
in one of them gives a wrong product with no error. In torch 2.14.1 reverse-over-forward is wrong through
`nn.LayerNorm` whose input depends on the parameters (0.18-0.58 relative error after a Linear; 2e-16 on the
data itself) and through `nn.InstanceNorm*` (0.2 to 1.4 against double backward: tests/curvature/
test_hvp_modes.py and test_modern_layers.py), so a transformer's λ_max and trace came out 40-50% too large
and `ok`; and it has no derivative at all through the fused kernels `nn.MultiheadAttention` and
`nn.TransformerEncoderLayer` take in eval mode.

So:

* `auto` is double backward (`AUTO_MODE`), the reference every other mode is checked against. It was
  chosen by `scripts/bench_hvp_modes.py`, which times the three modes over the catalogue of modern layers:
  double backward was not slower where it mattered (the table is in docs/performance.md);
* a torch.func mode (`rev_fwd`, `fwd_rev`, asked for by `measure.hvp_mode` / `hvp_mode=`) is checked on its
  first product on a model and loss: the product of one chunk and a seeded random vector against double
  backward's, to a relative tolerance of √ε of the dtype (`check_tolerance`: 1.5e-8 in float64, 3.5e-4 in
  float32). A mode that disagrees, or that has no forward-mode derivative for some operator (fused
  attention), is replaced by double backward for that model and loss; the outcome is kept per model
  (`ModeCheck`, weakly referenced) so the check runs once;
* every product is noted in the active `HvpLog` (a context variable): the measure runner opens one around
  each measure and puts what it holds into the entry's info (`info["hvp"]`: the mode used, the products,
  the check and a fallback's reason), so an entry says how its curvature was computed.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

HVP_MODES = ("auto", "rev_fwd", "fwd_rev", "double_backward")
"""Ways to compute a Hessian-vector product: auto (`AUTO_MODE`), reverse-over-forward, forward-over-reverse,
double backward."""
REFERENCE_MODE = "double_backward"
"""The mode every other one is checked against: two reverse passes, the derivative formulas every torch
operator with a gradient of its gradient has, and the one the dense Hessian of the tests uses too."""
AUTO_MODE = "double_backward"
"""What `auto` means (scripts/bench_hvp_modes.py decided it; see the module doc)."""
CHECKED_MODES = ("rev_fwd", "fwd_rev")
"""The modes that are checked against `REFERENCE_MODE` before they are used on a model."""

_MODE_OF: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
"""The HVP mode asked for a model (`use_hvp_mode`)."""
_CHECKS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, ModeCheck]] = weakref.WeakKeyDictionary()
"""Each model's mode checks, by (mode, loss, input shape and dtype)."""


def use_hvp_mode(model: nn.Module, mode: str) -> None:
    """Make every HVP of `model` (Hutchinson, Lanczos, the measures) use `mode` (one of HVP_MODES)."""
    if mode not in HVP_MODES:
        raise ValueError(f"hvp mode must be one of {', '.join(HVP_MODES)}, got {mode!r}")
    _MODE_OF[model] = mode


def hvp_mode_of(model: nn.Module) -> str:
    """The mode asked for `model`: its `use_hvp_mode`, else auto."""
    return _MODE_OF.get(model, "auto")


def check_tolerance(dtype: torch.dtype) -> float:
    """The relative difference a checked mode may have from double backward: √ε of the dtype (the two are
    different sums of the same terms, so they differ by rounding; a wrong derivative formula differs by
    far more: 0.2 and up where one was found)."""
    return float(torch.finfo(dtype).eps) ** 0.5


@dataclass(frozen=True)
class ModeCheck:
    """The outcome of checking `mode` against double backward on one model and loss."""

    mode: str
    passed: bool
    relative_difference: float | None
    """‖Hv_mode − Hv_reference‖ / ‖Hv_reference‖ on the check's vector (None where the mode failed)."""
    tolerance: float
    reason: str = ""
    """Why the mode is not used (a difference above tolerance, or a missing forward-mode derivative)."""

    def as_info(self) -> dict[str, Any]:
        return {"mode": self.mode, "passed": self.passed, "relative_difference": self.relative_difference,
                "tolerance": self.tolerance}


def forward_ad_missing(exc: BaseException) -> bool:
    """Whether an error says an operator has no forward-mode (JVP) derivative (e.g. the fused attention
    kernel `aten::_native_multi_head_attention`), so that double backward must be used instead."""
    text = str(exc).lower()
    return isinstance(exc, (NotImplementedError, RuntimeError)) and (
        "forward ad" in text or "forward-mode" in text or "jvp" in text or "forward mode" in text)


def loss_identity(loss: Callable) -> tuple:
    """What tells two losses apart for the cache of checks: a flatbench loss by name and temperature and
    the function of one's own it wraps, anything else by identity."""
    if hasattr(loss, "fn") and hasattr(loss, "name"):  # a flatbench LogitLoss: built in, or wrapping a function
        fn = loss.fn
        return ("LogitLoss", loss.name, getattr(loss, "tau", None), None if fn is None else id(fn))
    return (type(loss).__name__, id(loss))


def checked_mode(model: nn.Module, key: tuple, mode: str, run_check: Callable[[], ModeCheck]) -> ModeCheck:
    """The check of `mode` on `model` under `key` (loss and input), run once (`run_check`) and kept."""
    checks = _CHECKS.setdefault(model, {})
    full = (mode, *key)
    if full not in checks:
        checks[full] = run_check()
    return checks[full]


def compare_products(mode: str, got: torch.Tensor, reference: torch.Tensor) -> ModeCheck:
    """A `ModeCheck` from the two flat products of one vector."""
    tol = check_tolerance(reference.dtype)
    ref_norm = float(reference.double().norm())
    diff = float((got.double() - reference.double()).norm())
    rel = diff / ref_norm if ref_norm > 0 else (0.0 if diff == 0 else float("inf"))
    if rel <= tol:
        return ModeCheck(mode, True, rel, tol)
    return ModeCheck(mode, False, rel, tol,
                     f"{mode} disagreed with double backward on a random vector (relative difference {rel:.3g} > "
                     f"tolerance {tol:.2g}): double backward used")


def missing_forward_ad(mode: str, dtype: torch.dtype, exc: BaseException) -> ModeCheck:
    """A failed `ModeCheck` for a mode that has no forward-mode derivative on some operator."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return ModeCheck(mode, False, None, check_tolerance(dtype),
                     f"{mode} needs a forward-mode derivative that an operator lacks ({first}): double backward used")


@dataclass
class HvpLog:
    """The HVPs made while it is active (`hvp_log`): by the mode asked for and the mode used, with the
    checks that decided."""

    products: dict[tuple[str, str], int] = field(default_factory=dict)
    checks: dict[str, ModeCheck] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def note(self, asked: str, used: str, check: ModeCheck | None, reason: str = "") -> None:
        self.products[(asked, used)] = self.products.get((asked, used), 0) + 1
        if check is not None:
            self.checks[check.mode] = check
        if reason:
            self.reasons[used] = reason

    @property
    def count(self) -> int:
        return sum(self.products.values())

    def info(self) -> dict[str, Any]:
        """What an entry's info records of its HVPs: the mode(s) used, how many products, the mode asked for
        where another was used, the checks, and why a mode was replaced."""
        used = sorted({u for _, u in self.products})
        asked = sorted({a for a, _ in self.products})
        out: dict[str, Any] = {"mode": used[0] if len(used) == 1 else used, "products": self.count}
        named = [a for a in asked if a != "auto"]
        if named and named != used:
            out["asked"] = named[0] if len(named) == 1 else named
        if self.checks:
            out["checks"] = [c.as_info() for c in self.checks.values()]
        fallbacks = [c.reason for c in self.checks.values() if not c.passed] + list(self.reasons.values())
        if fallbacks:
            out["fallback"] = "; ".join(fallbacks)
        return out


_ACTIVE: contextvars.ContextVar[HvpLog | None] = contextvars.ContextVar("flatbench_hvp_log", default=None)


@contextlib.contextmanager
def hvp_log() -> Iterator[HvpLog]:
    """Note every HVP made inside (nested logs each get their own)."""
    log = HvpLog()
    token = _ACTIVE.set(log)
    try:
        yield log
    finally:
        _ACTIVE.reset(token)


def note_product(asked: str, used: str, check: ModeCheck | None, reason: str = "") -> None:
    """Note one HVP in the active log, if any."""
    log = _ACTIVE.get()
    if log is not None:
        log.note(asked, used, check, reason)
