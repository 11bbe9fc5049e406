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
"""

from __future__ import annotations

import importlib
import numbers
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from flatbench.errors import FlatbenchError, did_you_mean
from flatbench.measures import builtin
from flatbench.measures.plugins import PLUGIN_SOURCES, import_plugin, load_entry_points, module_source_hash
from flatbench.rescale import FAMILIES

COST_CLASSES = ("cheap", "gradient", "hessian", "search")
COST_MEANING = {
    "cheap": "from the weights alone or one forward pass; no gradients",
    "gradient": "gradients or forward-mode products over the measurement set",
    "hessian": "the Hessian diagonal or Hessian-vector products over the measurement set",
    "search": "an iterative search or sampling over perturbed weights (many loss evaluations)"}
"""What each cost class means (`flatbench describe` prints it)."""
PRECISIONS = ("float64", "float32")
"""What a measure needs (`precision`): float64, or float32 for an estimate whose own error (Monte-Carlo,
a search, an iterative eigen-solver) is far above float32 rounding."""


class NotApplicable(Exception):
    """Raised by a measure that is not defined for this model; recorded as status 'not_applicable'."""


@dataclass
class MeasureOutput:
    values: dict[str, float]
    info: dict[str, Any] = field(default_factory=dict)
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
    """Check settings against `rules`: key -> ("min", m) (≥ m), ("gt", m) (> m) or ("in", choices); a value
    outside is one line naming the measure, the setting and what is valid (a measure's `check`)."""
    for key, (kind, bound) in rules.items():
        if key not in settings:
            continue
        value = settings[key]
        bad = (kind == "min" and not value >= bound) or (kind == "gt" and not value > bound) or \
            (kind == "in" and value not in bound)
        if bad:
            want = f"at least {bound}" if kind == "min" else f"greater than {bound}" if kind == "gt" else \
                "one of " + ", ".join(str(b) for b in bound)
            raise FlatbenchError(f"measure.settings.{name}.{key}: must be {want}, got {value!r}")


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
    forms) or 1e-9 (exact solvers) relative in float64 (tests/measures/test_invariance.py)."""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Named presets of settings: `name:variant` is this measure with those settings (see module doc)."""
    base: str = ""
    """For a variant, the name of the measure it is a preset of (its result keys are renamed from it)."""
    preset: dict[str, Any] = field(default_factory=dict)
    """For a variant, the settings it fixes (they win over `measure.settings` of the base measure)."""
    origin: str = "builtin"
    """Where the measure comes from: "builtin", or the plugin (file or module) that registered it."""
    family: str = ""
    """The family the report groups the measure with (norm, curvature, rescaled curvature, sharpness,
    PAC-Bayes, or one's own); "" for the built-in measures, whose module decides. A plugin measure that
    names none is in the family named after its plugin (the file's or module's name)."""
    origin_sha256: str | None = None
    """A plugin measure: the sha256 of its plugin's source, recorded with every result (a changed plugin
    recomputes its entries); None for the built-in measures."""
    in_all: bool = True
    """Whether `all` includes the measure (False: asked for by name only)."""
    settings_help: dict[str, str] = field(default_factory=dict)
    """Per setting: its meaning and valid range (`flatbench describe` prints it; a setting without an entry
    is listed with its default only)."""
    precision: str = "float64"
    """The precision the measure needs. Under `measure.dtype: auto` (the default) an exact quantity or solver
    is computed in float64 and a measure registered with `precision="float32"` (Monte-Carlo estimates,
    searches, the Lanczos eigenvalue baseline: their own error is far above float32 rounding) in float32,
    which is 2-4x faster on a CPU; `measure.dtype: float64` or `float32` puts every measure in that dtype."""
    fixed_loss: str = ""
    """A measure that is not computed per configured loss but uses one loss of its own (`ce` for
    `normalized_sharpness` and `fisher_rao_norm`): asked for with another loss, its entry says so in `reason`."""
    check: Callable[[dict[str, Any]], None] | None = None
    """Checks the values of the measure's settings (raises `FlatbenchError` with one line) before any work."""
    added_settings: frozenset[str] = frozenset()
    """Settings added after results were stored whose default keeps the earlier computation (e.g. `rtol` = 0,
    no early stopping): a stored entry without one of them counts as computed at its default, so adding the
    setting does not make earlier results stale."""

    def settings(self, user: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The settings a computation uses: defaults, then the user's `measure.settings`, then the preset."""
        return {**self.defaults, **(user or {}).get(self.base_name, {}), **self.preset}

    @property
    def base_name(self) -> str:
        return self.base or self.name


_REGISTRY: dict[str, MeasureSpec] = {}
BUILTIN_PACKAGE = "flatbench.measures.builtin"


def _plugin_name(origin: str) -> str:
    """`my_measures` for /path/to/my_measures.py, `measures` for mypkg.measures."""
    name = origin.replace("\\", "/").rsplit("/", 1)[-1]
    return name[:-3] if name.endswith(".py") else name.rsplit(".", 1)[-1]


def _origin(fn: Callable[..., Any]) -> tuple[str, str | None]:
    """Where a measure function comes from: "builtin", or its plugin's label and source hash (a module
    imported by the user's own code counts as a plugin named after the module)."""
    module = getattr(fn, "__module__", None) or "__main__"
    if module == BUILTIN_PACKAGE or module.startswith(BUILTIN_PACKAGE + "."):
        return "builtin", None
    if module in PLUGIN_SOURCES:
        return PLUGIN_SOURCES[module]
    return module, module_source_hash(module)


def register_measure(name: str, *, description: str = "", invariant_to: tuple[str, ...] | set[str] = (),
                     cost: str = "cheap", defaults: dict[str, Any] | None = None, uses_loss: bool = False,
                     stochastic: bool = False, larger_is_sharper: bool = True,
                     exact: bool = True, variants: dict[str, dict[str, Any]] | None = None,
                     family: str | None = None, precision: str = "float64",
                     settings_help: dict[str, str] | None = None, in_all: bool = True,
                     fixed_loss: str = "", check: Callable[[dict[str, Any]], None] | None = None,
                     added_settings: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register `fn(ctx) -> dict | MeasureOutput` as the measure `name` (see the module docstring).

    `invariant_to`: the rescaling families (`flatbench.rescale.FAMILIES`) the measure is declared invariant
    to; `flatbench check-measure NAME` checks each declaration. `cost`: cheap | gradient | hessian | search.
    `defaults`: its settings (`measure.settings.NAME` overrides them). `uses_loss`: computed once per
    configured loss. `stochastic`: a Monte-Carlo estimate (give its standard error as `info["stderr"]`).
    `description`: one line for `list-measures` (default: the first line of the function's docstring).
    `exact`: a deterministic closed form or exact solver (tighter invariance tolerance). `family`: the
    report's grouping (default: the plugin's name). `precision`: float64 (default), or float32 for an
    estimate that float32 rounding does not change (computed in float32 under `measure.dtype: auto`).
    `settings_help`: per setting, its meaning and valid range (shown by `flatbench describe`). `in_all`:
    whether `all` includes it (False: only asked for by name). `fixed_loss`: the one loss a measure that does not
    `uses_loss` computes with (its entry says so when another loss is asked for). `check(settings)`: raises a
    `FlatbenchError` for a bad setting value, called before any work (settings of the defaults' type are
    checked for every measure). `added_settings`: settings added to `defaults` after results were stored, whose
    defaults compute what the measure computed without them (a stored entry lacking one stays up to date)."""
    unknown = set(invariant_to) - set(FAMILIES)
    if unknown:
        raise FlatbenchError(f"measure '{name}': unknown invariance families {sorted(unknown)} (families: "
                             f"{', '.join(FAMILIES)})")
    stray = (set(settings_help or {}) | set(added_settings)) - set(defaults or {})
    if stray:
        raise FlatbenchError(f"measure '{name}': settings_help for unknown settings {sorted(stray)}")
    if precision not in PRECISIONS:
        raise FlatbenchError(f"measure '{name}': precision must be float64 or float32, got {precision!r}")
    if cost not in COST_CLASSES:
        raise FlatbenchError(f"measure '{name}': cost must be one of {', '.join(COST_CLASSES)}, got {cost!r}")
    if not isinstance(name, str) or not name or any(c in name for c in ":@/,") or name == "all":
        raise FlatbenchError(f"measure name {name!r} must be a non-empty name without ':', '@', '/' or ',' "
                             "(and not 'all')")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        origin, sha = _origin(fn)
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            other = _REGISTRY[name].origin
            where = "a built-in measure" if other == "builtin" else f"a measure of {other}"
            raise FlatbenchError(f"measure '{name}'" + (f" of {origin}" if origin != "builtin" else "")
                                 + f" clashes with {where} of that name; give it another name")
        for vname, preset in (variants or {}).items():
            unknown_settings = set(preset) - set(defaults or {})
            if unknown_settings:
                raise ValueError(f"{name}: variant '{vname}' sets unknown settings {sorted(unknown_settings)}")
        doc = (fn.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = MeasureSpec(name=name, fn=fn, description=description or (doc[0] if doc else name),
                                      invariant_to=frozenset(invariant_to), cost=cost,
                                      defaults=dict(defaults or {}), uses_loss=uses_loss,
                                      stochastic=stochastic, larger_is_sharper=larger_is_sharper,
                                      exact=exact and not stochastic,
                                      variants={k: dict(v) for k, v in (variants or {}).items()},
                                      origin=origin, origin_sha256=sha,
                                      family=family or ("" if origin == "builtin" else _plugin_name(origin)),
                                      precision=precision, settings_help=dict(settings_help or {}),
                                      in_all=bool(in_all), fixed_loss=str(fixed_loss), check=check,
                                      added_settings=frozenset(added_settings))
        return fn

    return decorator


_LOADED = False


def all_measures() -> dict[str, MeasureSpec]:
    """Every registered measure: the built-in ones, those of installed `flatbench.measures` entry points,
    and those of the plugins loaded so far (`flatbench.measures.plugins.load_plugins`)."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        _load_builtin_measures()
        load_entry_points()
    return dict(sorted(_REGISTRY.items()))


def load_plugins(specs: list[str] | tuple[str, ...] | None) -> list[str]:
    """Import the measure plugins `specs` (Python files or importable module names, see
    `flatbench.measures.plugins`) after the built-in measures; returns the names they registered. Loading
    a plugin twice is a no-op, unless its file changed since."""
    all_measures()  # the built-in measures first, so that a clash is found and named
    before = set(_REGISTRY)

    def forget(origin: str) -> None:
        for name in [n for n, s in _REGISTRY.items() if s.origin == origin]:
            del _REGISTRY[name]

    for spec in specs or ():
        import_plugin(spec, forget)
    return sorted(set(_REGISTRY) - before)


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


def _load_builtin_measures() -> None:
    """Import every module of `flatbench.measures.builtin`: each registers its measures exactly as an
    outside plugin does."""
    for mod in pkgutil.iter_modules(builtin.__path__):
        importlib.import_module(f"{builtin.__name__}.{mod.name}")
