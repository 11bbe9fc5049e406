"""The measure registry, in one module: `MeasureSpec` and the store, `register_measure` and its checks, the
loading of the built-in measures and plugins, and the lookups (`all_measures`, `get_measure`, `resolve_names`).

    @register_measure("frobenius_norm", description="...", cost="cheap", family="norm", papers=(JIANG,))
    def frobenius_norm(ctx: MeasureContext) -> dict[str, float]: ...

A measure function takes a `MeasureContext` and returns a dict of values (the key equal to its name is the
headline value; keys with a "/" are details), a bare number, or a `MeasureOutput` with extra `info`; it
raises `NotApplicable(reason)` where the model lacks a structure it needs. Everything known about a measure
(its invariances, which feed the invariance matrix; its family in the report; its papers) is an argument of
its registration, kept on its spec and nowhere else.

*Variants.* `variants={"published": {"solver": "published"}}` makes `name:published` a measure of its own:
the same function with those settings, stored under its own key (both can sit side by side in one study).
`all` means the base measures only; variants are asked for by name, and so are measures registered with
`in_all=False` (`hessian_density`, a spectrum to plot rather than a value to rank by).

*Loading.* The built-in measures and those of installed entry points are loaded when the registry is first
read, plugins by `load_plugins` (`flatbench.measures.plugin_import` finds and imports them). An import only
records its registrations; they are checked after it, all stored or none. A plugin measure keeps its
plugin's label and source sha256, stored with each result: an edited plugin recomputes its entries.
"""

from __future__ import annotations

import importlib
import numbers
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flatbench.errors import FlatbenchError, did_you_mean
from flatbench.measures import builtin
from flatbench.measures.plugin_import import (failure, file_module_name, installed, is_file_spec, module_hash,
                                              module_source_hash, plugin_file, run_file, run_guarded)
from flatbench.rescale import FAMILIES

__all__ = ["COST_CLASSES", "COST_MEANING", "FAMILIES", "PRECISIONS", "MeasureOutput", "MeasureOutputError",
           "MeasureSpec", "NotApplicable", "all_measures", "as_output", "as_value", "get_measure", "load_plugins",
           "register_measure", "resolve_names", "setting_range"]

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
    PAC-Bayes, or one's own): every built-in measure names its own; a plugin measure that names none is in
    the family named after its plugin (the file's or module's name)."""
    papers: tuple[str, ...] = ()
    """The papers behind the measure, one citation each (its reference page lists them)."""
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


# ---------------------------------------------------------------- the store


REGISTERED: dict[str, MeasureSpec] = {}
"""Name → spec of every registered measure, checked before it is stored here; read it as it is (no loading:
`all_measures` loads first)."""
PLUGIN_SOURCES: dict[str, tuple[str, str | None]] = {}
"""Module name → (plugin label, sha256 of its source) of the plugins loaded here: the origin of the measures
those modules register."""
_FILES: dict[Path, tuple[str, str]] = {}
"""Resolved plugin file → (module name, sha256) of the version loaded in this process."""
_INSTALLED_LOADED = False
MEASURE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
"""A measure's name: what the built-in ones use (letters, digits, `_`, `.`) and `-`; never `@` (a loss
follows it in an entry key), `:` (a variant), `/` (a detail key), `,` (a list of names) or whitespace."""


# ---------------------------------------------------------------- loading


def _load_file(spec: str) -> str:
    path, sha = plugin_file(spec)
    loaded = _FILES.get(path)
    if loaded and loaded[1] == sha:
        return loaded[0]
    if loaded:  # edited since it was loaded in this process: its old measures make way for the new ones
        for name in [n for n, s in REGISTERED.items() if s.origin == str(path)]:
            del REGISTERED[name]
    module_name = file_module_name(path, sha)
    PLUGIN_SOURCES[module_name] = (str(path), sha)
    _check_and_store(_recording(lambda: run_file(path, module_name, spec)), spec, module_name)
    _FILES[path] = (module_name, sha)
    return module_name


def _load_module(spec: str) -> str:
    if spec in sys.modules:
        return spec
    PLUGIN_SOURCES[spec] = (spec, module_hash(spec))
    _check_and_store(_recording(lambda: run_guarded(spec, lambda: importlib.import_module(spec))), spec, spec)
    return spec


def load_installed() -> None:
    """The built-in measures (every module of `flatbench.measures.builtin`, registered exactly as an outside
    plugin is), then those of installed `flatbench.measures` entry points: once per process."""
    global _INSTALLED_LOADED
    if _INSTALLED_LOADED:
        return
    _INSTALLED_LOADED = True
    for mod in pkgutil.iter_modules(builtin.__path__):
        name = f"{builtin.__name__}.{mod.name}"
        _check_and_store(_recording(lambda name=name: importlib.import_module(name)), name, None)
    for ep, module_name, label, sha in installed():
        PLUGIN_SOURCES.setdefault(module_name, (module_name, sha))
        _check_and_store(_recording(lambda ep=ep, label=label: run_guarded(label, ep.load)), label, None)


def load_plugins(specs: list[str] | tuple[str, ...] | None) -> list[str]:
    """Load measure plugins: import each of `specs` (a Python file, `my_measures.py`, or an importable
    module, `mypkg.measures`) after the built-in measures, and check and store the measures its import
    registers (`register_measure`), all of a plugin's or none. Returns the names they registered. Loading a
    plugin twice is a no-op, unless its file changed since."""
    load_installed()  # the built-in measures first, so that a clash is found and named
    before = set(REGISTERED)
    for spec in specs or ():
        if not isinstance(spec, str) or not spec.strip():
            raise FlatbenchError(f"measure.plugins: expected a file or module name, got {spec!r}")
        (_load_file if is_file_spec(spec.strip()) else _load_module)(spec.strip())
    return sorted(set(REGISTERED) - before)


# ---------------------------------------------------------------- registration: recorded, then checked


_BATCHES: list[list[Registration]] = []
"""The registrations recorded by the imports under way (innermost last); empty outside a load."""


@dataclass(frozen=True)
class Registration:
    """One `register_measure(name, **declared)(fn)` as a plugin's import made it, not yet checked."""
    name: Any
    fn: Callable[..., Any]
    declared: dict[str, Any]


def register_measure(name: str, *, description: str = "", invariant_to: tuple[str, ...] | set[str] = (),
                     cost: str = "cheap", defaults: dict[str, Any] | None = None, uses_loss: bool = False,
                     stochastic: bool = False, larger_is_sharper: bool = True,
                     exact: bool = True, variants: dict[str, dict[str, Any]] | None = None,
                     family: str | None = None, precision: str = "float64",
                     settings_help: dict[str, str] | None = None, in_all: bool = True,
                     fixed_loss: str = "", check: Callable[[dict[str, Any]], None] | None = None,
                     added_settings: tuple[str, ...] = (),
                     papers: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a measure: a decorator of a function `(ctx: MeasureContext) -> dict | MeasureOutput | number`.

    The function returns its headline value under the key `name` (a bare number is that value) and, under
    keys `name/detail`, per-layer or per-parameter details; it raises `NotApplicable(reason)` where the model
    lacks a structure it needs. The registration is checked at once (or, inside a plugin file or module,
    when its import is done): a bad declaration, an unknown family or a name that clashes with another
    measure is one line.

    Args:
        name: the measure's name (letters, digits, `_`), as configs and `flatbench.measure` ask for it.
        description: one line for `flatbench list-measures` (default: the first line of the function's
            docstring).
        invariant_to: the function-preserving rescaling families the measure is declared invariant to:
            `layer`, `node`, `bn`, `logit_scale`; `flatbench check-measure NAME` checks each declaration.
        cost: `cheap` | `gradient` | `hessian` | `search`.
        defaults: its settings and their defaults (`measure.settings.NAME`, `settings=` override them).
        uses_loss: computed once per configured loss (the entry key gets `@loss` for a loss other than ce).
        stochastic: a Monte-Carlo estimate (give its standard error as `info["stderr"]`).
        larger_is_sharper: whether a larger value means a sharper (less flat) model.
        exact: a deterministic closed form or exact solver (a tighter invariance tolerance).
        variants: named presets of its settings, `{"published": {...}}`, asked for as `name:published`.
        family: the report's grouping: `norm`, `curvature`, `rescaled curvature`, `sharpness`, `PAC-Bayes`
            or one's own (default: the plugin's name; a built-in measure must name one).
        precision: `float64` (default), or `float32` for an estimate that float32 rounding does not change
            (computed in float32 under `measure.dtype: auto`).
        settings_help: per setting, its meaning and valid range (shown by `flatbench describe`).
        in_all: whether `all` includes it (False: only asked for by name).
        fixed_loss: the one loss a measure that does not `uses_loss` computes with (its entry says so when
            another loss is asked for).
        check: `check(settings)` raises a `FlatbenchError` for a bad setting value, called before any work
            (settings of the defaults' type are checked for every measure).
        added_settings: settings added to `defaults` after results were stored, whose defaults compute what
            the measure computed without them (a stored entry lacking one stays up to date).
        papers: the papers behind the measure, one citation each (listed on its reference page).
    """
    declared = dict(description=description, invariant_to=invariant_to, cost=cost, defaults=defaults,
                    uses_loss=uses_loss, stochastic=stochastic, larger_is_sharper=larger_is_sharper, exact=exact,
                    variants=variants, family=family, precision=precision, settings_help=settings_help,
                    in_all=in_all, fixed_loss=fixed_loss, check=check, added_settings=added_settings,
                    papers=papers)

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        registration = Registration(name, fn, declared)
        if _BATCHES:  # a load is under way: it checks what its import recorded once the import is done
            _BATCHES[-1].append(registration)
        else:  # the user's own code registering directly: checked and stored now, by the same check
            _check_and_store([registration], None, None)
        return fn

    return decorator


def _recording(load: Callable[[], Any]) -> list[Registration]:
    """Run `load()` (an import) and return the registrations it recorded, unchecked."""
    _BATCHES.append([])
    try:
        load()
    finally:
        recorded = _BATCHES.pop()
    return recorded


def _check_and_store(recorded: list[Registration], label: str | None, module_name: str | None) -> None:
    """Check every registration an import recorded and store them all, or none: a failed check is one line
    (a FlatbenchError as it is; anything else as the plugin's failure, when it came from a load), and the
    plugin's module is forgotten so that loading it again checks it again."""
    batch: dict[str, MeasureSpec] = {}
    try:
        for registration in recorded:
            batch[registration.name] = _checked(registration, {**REGISTERED, **batch})
    except BaseException as exc:
        if module_name is not None:
            sys.modules.pop(module_name, None)
        if label is None or isinstance(exc, (FlatbenchError, KeyboardInterrupt)):
            raise
        raise failure(label, exc) from None
    REGISTERED.update(batch)


def _checked(registration: Registration, known: dict[str, MeasureSpec]) -> MeasureSpec:
    """The spec of one registration, after every check of what it declares and of its name against the
    measures `known` (the error messages name the measure)."""
    name, fn, d = registration.name, registration.fn, registration.declared
    defaults, variants = d["defaults"] or {}, d["variants"] or {}
    unknown = set(d["invariant_to"]) - set(FAMILIES)
    if unknown:
        raise FlatbenchError(f"measure '{name}': unknown invariance families {sorted(unknown)} (families: "
                             f"{', '.join(FAMILIES)})")
    stray = (set(d["settings_help"] or {}) | set(d["added_settings"])) - set(defaults)
    if stray:
        raise FlatbenchError(f"measure '{name}': settings_help for unknown settings {sorted(stray)}")
    if d["precision"] not in PRECISIONS:
        raise FlatbenchError(f"measure '{name}': precision must be float64 or float32, got {d['precision']!r}")
    if d["cost"] not in COST_CLASSES:
        raise FlatbenchError(f"measure '{name}': cost must be one of {', '.join(COST_CLASSES)}, got {d['cost']!r}")
    if not isinstance(name, str) or not MEASURE_NAME.fullmatch(name) or name == "all":
        raise FlatbenchError(f"measure name {name!r} must be a non-empty name without ':', '@', '/' or ',' "
                             "(and not 'all'): letters, digits, '_', '.' and '-' only (no spaces, tabs or newlines: "
                             "`x@mse` would read as measure x with loss mse)")
    origin, sha = _origin(fn)
    if name in known and known[name].fn is not fn:
        other = known[name].origin
        where = "a built-in measure" if other == "builtin" else f"a measure of {other}"
        raise FlatbenchError(f"measure '{name}'" + (f" of {origin}" if origin != "builtin" else "")
                             + f" clashes with {where} of that name; give it another name")
    for vname, preset in variants.items():
        unknown_settings = set(preset) - set(defaults)
        if unknown_settings:
            raise ValueError(f"{name}: variant '{vname}' sets unknown settings {sorted(unknown_settings)}")
    if origin == "builtin" and not d["family"]:
        raise FlatbenchError(f"measure '{name}': a built-in measure names its family (`family=`)")
    if isinstance(d["papers"], str) or not all(isinstance(p, str) for p in d["papers"]):
        raise FlatbenchError(f"measure '{name}': papers must be a tuple of citations (strings)")
    doc = (fn.__doc__ or "").strip().splitlines()
    return MeasureSpec(name=name, fn=fn, description=d["description"] or (doc[0] if doc else name),
                       invariant_to=frozenset(d["invariant_to"]), cost=d["cost"], defaults=dict(defaults),
                       uses_loss=d["uses_loss"], stochastic=d["stochastic"],
                       larger_is_sharper=d["larger_is_sharper"], exact=d["exact"] and not d["stochastic"],
                       variants={k: dict(v) for k, v in variants.items()}, origin=origin, origin_sha256=sha,
                       family=d["family"] or _plugin_name(origin),
                       precision=d["precision"], settings_help=dict(d["settings_help"] or {}),
                       in_all=bool(d["in_all"]), fixed_loss=str(d["fixed_loss"]), check=d["check"],
                       added_settings=frozenset(d["added_settings"]), papers=tuple(d["papers"]))


def _plugin_name(origin: str) -> str:
    """`my_measures` for /path/to/my_measures.py, `measures` for mypkg.measures."""
    name = origin.replace("\\", "/").rsplit("/", 1)[-1]
    return name[:-3] if name.endswith(".py") else name.rsplit(".", 1)[-1]


def _origin(fn: Callable[..., Any]) -> tuple[str, str | None]:
    """Where a measure function comes from: "builtin", or its plugin's label and source hash (a module
    imported by the user's own code counts as a plugin named after the module)."""
    module = getattr(fn, "__module__", None) or "__main__"
    if module == builtin.__name__ or module.startswith(builtin.__name__ + "."):
        return "builtin", None
    if module in PLUGIN_SOURCES:
        return PLUGIN_SOURCES[module]
    return module, module_source_hash(module)


# ---------------------------------------------------------------- lookups


def all_measures() -> dict[str, MeasureSpec]:
    """Every registered measure: the built-in ones, those of installed `flatbench.measures` entry points,
    and those of the plugins loaded so far (`load_plugins`)."""
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
