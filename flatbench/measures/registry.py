"""The measure registry: one decorator, plain functions, declared invariances.

    @register_measure("frobenius_norm", description="...", invariant_to=(), cost="cheap")
    def frobenius_norm(ctx: MeasureContext) -> dict[str, float]: ...

A measure function takes a `MeasureContext` and returns either a dict of result values (the key equal to
the measure's name is its headline value; keys with a "/" are per-layer details) or a `MeasureOutput`
with extra `info` (method, iterations, standard errors, sample counts). A measure that does not apply to
a model raises `NotApplicable(reason)`. Declared invariances feed the invariance test matrix, so a new
measure joins it by registering.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from flatbench.errors import FlatbenchError

FAMILIES = ("layer", "node", "bn", "logit_scale")
COST_CLASSES = ("cheap", "gradient", "hessian", "search")


class NotApplicable(Exception):
    """Raised by a measure that is not defined for this model; recorded as status 'not_applicable'."""


@dataclass
class MeasureOutput:
    values: dict[str, float]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MeasureSpec:
    name: str
    fn: Callable[..., Any]
    description: str
    invariant_to: frozenset[str]
    cost: str
    defaults: dict[str, Any]
    uses_loss: bool
    """Computed once per configured loss (`measure.losses`); non-ce results get an `@loss` suffix."""
    stochastic: bool
    """Monte-Carlo estimate: invariance is checked within its reported standard error."""
    larger_is_sharper: bool
    """Direction: True when a larger value means a sharper / worse-generalizing model."""
    exact: bool
    """An exact (deterministic, non-iterative-approximate) quantity; invariances checked to 1e-4."""


_REGISTRY: dict[str, MeasureSpec] = {}


def register_measure(name: str, *, description: str, invariant_to: tuple[str, ...] | set[str] = (),
                     cost: str = "cheap", defaults: dict[str, Any] | None = None, uses_loss: bool = False,
                     stochastic: bool = False, larger_is_sharper: bool = True,
                     exact: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    unknown = set(invariant_to) - set(FAMILIES)
    if unknown:
        raise ValueError(f"{name}: unknown invariance families {sorted(unknown)}")
    if cost not in COST_CLASSES:
        raise ValueError(f"{name}: cost must be one of {COST_CLASSES}")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"measure '{name}' is registered twice")
        _REGISTRY[name] = MeasureSpec(name=name, fn=fn, description=description,
                                      invariant_to=frozenset(invariant_to), cost=cost,
                                      defaults=dict(defaults or {}), uses_loss=uses_loss,
                                      stochastic=stochastic, larger_is_sharper=larger_is_sharper,
                                      exact=exact and not stochastic)
        return fn

    return decorator


def all_measures() -> dict[str, MeasureSpec]:
    _load_builtin_measures()
    return dict(sorted(_REGISTRY.items()))


def get_measure(name: str) -> MeasureSpec:
    registry = all_measures()
    if name not in registry:
        raise FlatbenchError(f"unknown measure '{name}' (available: {', '.join(registry)})")
    return registry[name]


def resolve_names(names: list[str] | tuple[str, ...]) -> list[str]:
    """Expand `all` and check every name; unknown names are one clear error."""
    registry = all_measures()
    out: list[str] = []
    for name in names:
        for part in (p.strip() for p in name.split(",")):
            if not part:
                continue
            chosen = list(registry) if part == "all" else [get_measure(part).name]
            out.extend(n for n in chosen if n not in out)
    return out


def _load_builtin_measures() -> None:
    import importlib
    import pkgutil

    import flatbench.measures as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name not in ("registry", "context", "runner"):
            importlib.import_module(f"flatbench.measures.{mod.name}")
