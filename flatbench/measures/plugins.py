"""Loading and checking measures, in one place: the built-in measures, plugin files, importable modules
and installed entry points.

    load_plugins(["my_measures.py", "mypkg.measures"])

A plugin is a Python file or an importable module whose import registers measures with
`flatbench.measures.plugin.register_measure` (exactly as the built-in measures in
`flatbench.measures.builtin` do). Installed packages can offer plugins through the entry-point group
`flatbench.measures` (`[project.entry-points."flatbench.measures"] mine = "mypkg.measures"`); those are
loaded with the built-in measures, whenever the registry is read.

The import of a plugin only records its registrations; they are checked here after the import (invariance
families, settings, cost, precision, name, a clash with another measure, variants), all of them or none
stored (`flatbench.measures.specs.store`). A registration outside a load (a notebook's own
`@register_measure`) is checked and stored at once, by the same check.

Every plugin measure records its plugin's label and the sha256 of the plugin's source (the file, or the
module's file) in its `MeasureSpec`; the measure runner stores that with each result, so an edited plugin
recomputes its entries and the built-in measures' entries are untouched. A name that clashes with a
built-in measure (or with another plugin's) is refused in one line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from flatbench.errors import FlatbenchError
from flatbench.measures import builtin
from flatbench.measures.specs import COST_CLASSES, PRECISIONS, REGISTERED, MeasureSpec, forget, store
from flatbench.rescale import FAMILIES
from flatbench.userspec import exec_file

ENTRY_POINT_GROUP = "flatbench.measures"
BUILTIN_PACKAGE = "flatbench.measures.builtin"
PLUGIN_SOURCES: dict[str, tuple[str, str | None]] = {}
"""Module name → (plugin label, sha256 of its source) of the plugins loaded here: the origin of the measures
those modules register."""
_FILES: dict[Path, tuple[str, str]] = {}
"""Resolved plugin file → (module name, sha256) of the version loaded in this process."""
_INSTALLED_LOADED = False
_BATCHES: list[list[Registration]] = []
"""The registrations recorded by the imports under way (innermost last); empty outside a load."""


MEASURE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
"""A measure's name: what the built-in ones use (letters, digits, `_`, `.`) and `-`; never `@` (a loss
follows it in an entry key), `:` (a variant), `/` (a detail key), `,` (a list of names) or whitespace."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def module_source_hash(module_name: str) -> str | None:
    """sha256 of an imported module's source file (None when it has none, e.g. `__main__` in a notebook)."""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if not path or not Path(path).is_file():
        return None
    return _sha256(Path(path))


def is_file_spec(spec: str) -> bool:
    """A plugin or factory given as a file (`x.py`, `dir/x.py`) rather than as an importable module."""
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def _fail(label: str, exc: BaseException) -> FlatbenchError:
    where = ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = f" ({Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno})"
    return FlatbenchError(f"plugin {label} failed to import: {type(exc).__name__}: {exc}{where}")


def _load_file(spec: str) -> str:
    path = Path(spec).expanduser()
    if not path.is_file():
        what = "is a folder, not a Python file" if path.is_dir() else "does not exist"
        raise FlatbenchError(f"plugin file {spec} {what} (give a .py file or an importable module name)")
    path = path.resolve()
    sha = _sha256(path)
    loaded = _FILES.get(path)
    if loaded and loaded[1] == sha:
        return loaded[0]
    if loaded:  # edited since it was loaded in this process: its old measures make way for the new ones
        forget(str(path))
    module_name = f"flatbench_plugin_{''.join(c if c.isalnum() else '_' for c in path.stem)}_{sha[:12]}"
    PLUGIN_SOURCES[module_name] = (str(path), sha)
    recorded = _recording(lambda: exec_file(path, module_name, lambda exc: _fail(spec, exc),
                                            what=f"plugin file {spec}"))
    _check_and_store(recorded, spec, module_name)
    _FILES[path] = (module_name, sha)
    return module_name


def _load_module(spec: str) -> str:
    if spec in sys.modules:
        return spec
    try:
        found = importlib.util.find_spec(spec)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise FlatbenchError(f"plugin module '{spec}' cannot be found (is it installed, or on PYTHONPATH?); "
                             "a file is given by its path, e.g. ./my_measures.py")
    origin = Path(found.origin) if found.origin and Path(found.origin).is_file() else None
    PLUGIN_SOURCES[spec] = (spec, _sha256(origin) if origin else None)
    recorded = _recording(lambda: _import_module(spec))
    _check_and_store(recorded, spec, spec)
    return spec


def _import_module(spec: str) -> None:
    try:
        importlib.import_module(spec)
    except (FlatbenchError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - sys.exit() in a plugin's import is its failure, not ours
        raise _fail(spec, exc) from None


def import_plugin(spec: str) -> str:
    """Import one plugin (a file or a module name) and store its checked measures; an edited file's earlier
    measures make way for the new ones. Returns the module's name."""
    if not isinstance(spec, str) or not spec.strip():
        raise FlatbenchError(f"measure.plugins: expected a file or module name, got {spec!r}")
    spec = spec.strip()
    return _load_file(spec) if is_file_spec(spec) else _load_module(spec)


def _load_entry_points() -> None:
    """Import every installed `flatbench.measures` entry point and store its checked measures."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        module_name = ep.value.partition(":")[0].strip()
        label = f"entry point '{ep.name}' ({ep.value})"
        try:
            found = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            found = None
        origin = Path(found.origin) if found and found.origin and Path(found.origin).is_file() else None
        PLUGIN_SOURCES.setdefault(module_name, (module_name, _sha256(origin) if origin else None))
        _check_and_store(_recording(lambda ep=ep, label=label: _load_entry_point(ep, label)), label, None)


def _load_entry_point(ep: Any, label: str) -> None:
    try:
        ep.load()
    except FlatbenchError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _fail(label, exc) from None


def load_installed() -> None:
    """The built-in measures (every module of `flatbench.measures.builtin`, registered exactly as an outside
    plugin is), then those of installed `flatbench.measures` entry points: once per process."""
    global _INSTALLED_LOADED
    if _INSTALLED_LOADED:
        return
    _INSTALLED_LOADED = True
    for mod in pkgutil.iter_modules(builtin.__path__):
        name = f"{BUILTIN_PACKAGE}.{mod.name}"
        _check_and_store(_recording(lambda name=name: importlib.import_module(name)), name, None)
    _load_entry_points()


def load_plugins(specs: list[str] | tuple[str, ...] | None) -> list[str]:
    """Load measure plugins: import each of `specs` (a Python file, `my_measures.py`, or an importable
    module, `mypkg.measures`) after the built-in measures, and check and store the measures its import
    registers (`register_measure`), all of a plugin's or none. Returns the names they registered. Loading a
    plugin twice is a no-op, unless its file changed since."""
    load_installed()  # the built-in measures first, so that a clash is found and named
    before = set(REGISTERED)
    for spec in specs or ():
        import_plugin(spec)
    return sorted(set(REGISTERED) - before)


# ---------------------------------------------------------------- registration: recorded, then checked


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
                     added_settings: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
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
        family: the report's grouping (default: the plugin's name).
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
    """
    declared = dict(description=description, invariant_to=invariant_to, cost=cost, defaults=defaults,
                    uses_loss=uses_loss, stochastic=stochastic, larger_is_sharper=larger_is_sharper, exact=exact,
                    variants=variants, family=family, precision=precision, settings_help=settings_help,
                    in_all=in_all, fixed_loss=fixed_loss, check=check, added_settings=added_settings)

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
        raise _fail(label, exc) from None
    store(batch)


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
    doc = (fn.__doc__ or "").strip().splitlines()
    return MeasureSpec(name=name, fn=fn, description=d["description"] or (doc[0] if doc else name),
                       invariant_to=frozenset(d["invariant_to"]), cost=d["cost"], defaults=dict(defaults),
                       uses_loss=d["uses_loss"], stochastic=d["stochastic"],
                       larger_is_sharper=d["larger_is_sharper"], exact=d["exact"] and not d["stochastic"],
                       variants={k: dict(v) for k, v in variants.items()}, origin=origin, origin_sha256=sha,
                       family=d["family"] or ("" if origin == "builtin" else _plugin_name(origin)),
                       precision=d["precision"], settings_help=dict(d["settings_help"] or {}),
                       in_all=bool(d["in_all"]), fixed_loss=str(d["fixed_loss"]), check=d["check"],
                       added_settings=frozenset(d["added_settings"]))


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
