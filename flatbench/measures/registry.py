"""The measure registry: one decorator, plain functions, declared invariances.

    @register_measure("frobenius_norm", description="...", invariant_to=(), cost="cheap")
    def frobenius_norm(ctx: MeasureContext) -> dict[str, float]: ...

A measure function takes a `MeasureContext` and returns either a dict of result values (the key equal to
the measure's name is its headline value; keys with a "/" are per-layer details) or a `MeasureOutput`
with extra `info` (method, iterations, standard errors, sample counts). A measure that does not apply to
a model raises `NotApplicable(reason)`. Declared invariances feed the invariance test matrix, so a new
measure joins it by registering.

*Variants.* A measure may declare named presets of its settings, `variants={"published": {"solver":
"published"}}`; `name:variant` (e.g. `minimum_sharpness:published`) is then a measure of its own: the same
function with those settings, its results stored under `name:variant` (so both can sit side by side in one
study and one report). `all` means the base measures only; variants are asked for by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from flatbench.errors import FlatbenchError

from flatbench.rescale import FAMILIES  # noqa: E402 - the families are defined with their transformations
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
    """An exact (deterministic, non-iterative-approximate) quantity; its invariances are tested to 1e-10 (closed
    forms) or 1e-9 (exact solvers) relative in float64 (tests/test_invariance.py)."""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Named presets of settings: `name:variant` is this measure with those settings (see module doc)."""
    base: str = ""
    """For a variant, the name of the measure it is a preset of (its result keys are renamed from it)."""
    preset: dict[str, Any] = field(default_factory=dict)
    """For a variant, the settings it fixes (they win over `measure.settings` of the base measure)."""

    def settings(self, user: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The settings a computation uses: defaults, then the user's `measure.settings`, then the preset."""
        return {**self.defaults, **(user or {}).get(self.base_name, {}), **self.preset}

    @property
    def base_name(self) -> str:
        return self.base or self.name


_REGISTRY: dict[str, MeasureSpec] = {}


def register_measure(name: str, *, description: str, invariant_to: tuple[str, ...] | set[str] = (),
                     cost: str = "cheap", defaults: dict[str, Any] | None = None, uses_loss: bool = False,
                     stochastic: bool = False, larger_is_sharper: bool = True,
                     exact: bool = True, variants: dict[str, dict[str, Any]] | None = None
                     ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
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
                                      exact=exact and not stochastic,
                                      variants={k: dict(v) for k, v in (variants or {}).items()})
        for vname, preset in (variants or {}).items():
            unknown_settings = set(preset) - set(defaults or {})
            if unknown_settings:
                raise ValueError(f"{name}: variant '{vname}' sets unknown settings {sorted(unknown_settings)}")
        return fn

    return decorator


def all_measures() -> dict[str, MeasureSpec]:
    _load_builtin_measures()
    return dict(sorted(_REGISTRY.items()))


def get_measure(name: str) -> MeasureSpec:
    """The spec of a registered measure, or of a variant `name:variant` (a preset of its settings)."""
    registry = all_measures()
    base, sep, variant = name.partition(":")
    if base not in registry:
        raise FlatbenchError(f"unknown measure '{name}'{did_you_mean(base, registry)} "
                             "(`flatbench list-measures` lists them)")
    spec = registry[base]
    if not sep:
        return spec
    if variant not in spec.variants:
        offered = ", ".join(f"{base}:{v}" for v in spec.variants) or "none"
        raise FlatbenchError(f"measure '{base}' has no variant '{variant}' (variants: {offered})")
    return replace(spec, name=name, base=base, preset=dict(spec.variants[variant]),
                   variants={}, description=f"{spec.description} [variant {variant}: "
                   + ", ".join(f"{k}={v}" for k, v in spec.variants[variant].items()) + "]")


def did_you_mean(word: str, choices: Any) -> str:
    """' (did you mean 'x'?)' for the closest of `choices`, or '' when none is close."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


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


NOT_MEASURE_MODULES = ("registry", "context", "runner", "shared", "layers", "keys")
"""Modules of this package that register no measure (the plugin modules are all the others)."""


def _load_builtin_measures() -> None:
    import importlib
    import pkgutil
    from pathlib import Path

    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if mod.name not in NOT_MEASURE_MODULES:
            importlib.import_module(f"flatbench.measures.{mod.name}")
