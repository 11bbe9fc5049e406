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
study and one report). `all` means the base measures only; variants are asked for by name, and so are
measures registered with `in_all=False` (e.g. `hessian_density`, whose output is a spectrum to plot rather
than a value to rank by: adding it to `all` would change every study that asks for `all`).

The registry reads the measures; `flatbench.measures.plugins` loads and checks them (the built-in ones, the
plugins, a direct `register_measure`) and `flatbench.measures.specs` stores the checked specs.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from flatbench.errors import FlatbenchError, did_you_mean
from flatbench.measures.plugins import load_installed, load_plugins, register_measure
from flatbench.measures.specs import COST_CLASSES, COST_MEANING, PRECISIONS, REGISTERED, MeasureSpec
from flatbench.rescale import FAMILIES

__all__ = ["COST_CLASSES", "COST_MEANING", "FAMILIES", "PRECISIONS", "MeasureOutput", "MeasureOutputError",
           "MeasureSpec", "NotApplicable", "all_measures", "as_output", "as_value", "get_measure", "load_plugins",
           "register_measure", "resolve_names", "setting_range"]
"""`register_measure` and `load_plugins` are `flatbench.measures.plugins`' (where every measure is loaded and
checked), `MeasureSpec` and the cost and precision classes `flatbench.measures.specs`' (where the checked
specs are stored); they are offered here with the lookups."""


class NotApplicable(Exception):
    """Raised by a measure that is not defined for this model; recorded as status 'not_applicable'."""


@dataclass
class MeasureOutput:
    """A measure's result: its values and what it reports besides them."""

    values: dict[str, float]
    """The values: the headline under the measure's name, details under `name/detail`; finite numbers."""
    info: dict[str, Any] = field(default_factory=dict)
    """Method, iterations, residuals, standard errors (`info["stderr"]` for a stochastic measure): anything
    JSON can hold."""
    not_converged: str | None = None
    """Why an iterative computation stopped before its tolerance (an iteration cap, an HVP budget), with the
    residual it reached; the runner records the entry as status `not_converged` with this reason (its
    estimate kept in `info["values"]`, not among the values the statistics read)."""


class MeasureOutputError(TypeError):
    """A measure returned something that is not a result (a string, a bool, no headline value...)."""


def as_value(value: Any, name: str, key: str) -> float:
    """One value of a measure's result as a float: an int, a float, a one-element tensor or a numpy scalar
    (NaN and inf pass here: the runner records them as `non_finite`). A string or a bool is refused, never
    read as a number: `"1e3"` is not 1000 and `True` is not 1.0."""
    what = f"measure '{name}' gave {key!r} = {value!r:.60} ({type(value).__name__})"
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise MeasureOutputError(f"{what}; a value is a real number (int, float, 0-d tensor, numpy scalar)")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise MeasureOutputError(f"measure '{name}' gave {key!r} = a {value.dtype} tensor of shape "
                                     f"{tuple(value.shape)}; a value is one real number")
        return float(value.detach().reshape(()).item())
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise MeasureOutputError(f"{what}; a value is a real number (int, float, 0-d tensor, numpy scalar)")


def as_output(out: Any, name: str) -> MeasureOutput:
    """What a measure function returned, as a MeasureOutput of float values: a MeasureOutput, a dict of
    values, or a bare number (the headline value under the measure's name). The headline value (the key
    `name`) is required; anything else is a `MeasureOutputError` naming the measure."""
    if isinstance(out, MeasureOutput):
        values, info = out.values, out.info
    elif isinstance(out, dict):
        values, info = out, {}
    elif isinstance(out, (numbers.Real, torch.Tensor, np.ndarray)) and not isinstance(out, (bool, np.bool_)):
        values, info = {name: out}, {}
    else:
        raise MeasureOutputError(f"measure '{name}' returned {out!r:.60} ({type(out).__name__}); return a number, a "
                                 "dict of values or a MeasureOutput (a value is a real number, not a string or a bool)")
    if not isinstance(values, dict) or not isinstance(info, dict):
        raise MeasureOutputError(f"measure '{name}' returned a MeasureOutput whose values or info is not a dict")
    if name not in values:
        given = ", ".join(repr(k) for k in list(values)[:3]) or "no values"
        raise MeasureOutputError(f"measure '{name}' returned no headline value {name!r} (got {given}); the key "
                                 "equal to the measure's name is its headline value")
    bad = [k for k in values if not isinstance(k, str)]
    if bad:
        raise MeasureOutputError(f"measure '{name}' returned the key {bad[0]!r}; result keys are strings")
    not_converged = out.not_converged if isinstance(out, MeasureOutput) else None
    return MeasureOutput({k: as_value(v, name, k) for k, v in values.items()}, info,
                         None if not_converged is None else str(not_converged))


def setting_range(name: str, settings: dict[str, Any], rules: dict[str, tuple[str, Any]]) -> None:
    """Check settings against `rules`: key -> ("min", m) (≥ m, and an integer at most MAX_COUNT), ("gt", m)
    (> m), ("range", (lo, hi)) or ("in", choices); a value outside is one line naming the measure, the
    setting and what is valid (a measure's `check`)."""
    for key, (kind, bound) in rules.items():
        if key not in settings:
            continue
        value = settings[key]
        if kind == "min" and isinstance(value, int) and value > MAX_COUNT:  # iters=10**12: a hang, not a setting
            raise FlatbenchError(f"measure.settings.{name}.{key}: must be at most {MAX_COUNT}, got {value!r}")
        bad = (kind == "min" and not value >= bound) or (kind == "gt" and not value > bound) or \
            (kind == "in" and value not in bound) or (kind == "range" and not bound[0] <= value <= bound[1])
        if bad:
            want = f"at least {bound}" if kind == "min" else f"greater than {bound}" if kind == "gt" else \
                f"in [{bound[0]}, {bound[1]}]" if kind == "range" else "one of " + ", ".join(str(b) for b in bound)
            raise FlatbenchError(f"measure.settings.{name}.{key}: must be {want}, got {value!r}")


MAX_COUNT = 10_000_000
"""The largest count setting (iterations, probes, samples, grid points) a measure accepts: beyond it a
measure would run for days or run out of memory instead of answering."""


def all_measures() -> dict[str, MeasureSpec]:
    """Every registered measure: the built-in ones, those of installed `flatbench.measures` entry points,
    and those of the plugins loaded so far (`flatbench.measures.plugins.load_plugins`)."""
    load_installed()
    return dict(sorted(REGISTERED.items()))


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


def resolve_names(names: list[str] | tuple[str, ...]) -> list[str]:
    """Expand `all` and check every name; unknown names are one clear error."""
    registry = all_measures()
    out: list[str] = []
    for name in names:
        for part in (p.strip() for p in name.split(",")):
            if not part:
                continue
            chosen = [n for n, s in registry.items() if s.in_all] if part == "all" else [get_measure(part).name]
            out.extend(n for n in chosen if n not in out)
    return out
