"""Measure plugins from outside the package: files, importable modules and installed entry points.

    load_plugins(["my_measures.py", "mypkg.measures"])

A plugin is a Python file or an importable module whose import registers measures with
`flatbench.measures.plugin.register_measure` (exactly as the built-in measures in
`flatbench.measures.builtin` do). Installed packages can offer plugins through the entry-point group
`flatbench.measures` (`[project.entry-points."flatbench.measures"] mine = "mypkg.measures"`); those are
loaded with the built-in measures, whenever the registry is read.

Every plugin measure records its plugin's label and the sha256 of the plugin's source (the file, or the
module's file) in its `MeasureSpec`; the measure runner stores that with each result, so an edited plugin
recomputes its entries and the built-in measures' entries are untouched. A name that clashes with a
built-in measure (or with another plugin's) is refused in one line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

from flatbench.errors import FlatbenchError
from flatbench.userspec import exec_file

ENTRY_POINT_GROUP = "flatbench.measures"
PLUGIN_SOURCES: dict[str, tuple[str, str | None]] = {}
"""Module name → (plugin label, sha256 of its source) of the plugins loaded here; `register_measure` records
them as the origin of the measures those modules register."""
_FILES: dict[Path, tuple[str, str]] = {}
"""Resolved plugin file → (module name, sha256) of the version loaded in this process."""
_ENTRY_POINTS_LOADED = False


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


def _load_file(spec: str, forget: Callable[[str], None]) -> str:
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
    exec_file(path, module_name, lambda exc: _fail(spec, exc), what=f"plugin file {spec}")
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
    try:
        importlib.import_module(spec)
    except (FlatbenchError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - sys.exit() in a plugin's import is its failure, not ours
        raise _fail(spec, exc) from None
    return spec


def import_plugin(spec: str, forget: Callable[[str], None]) -> str:
    """Import one plugin (a file or a module name); `forget(origin)` is called to drop the measures of an
    earlier version of an edited file. Returns the module's name."""
    if not isinstance(spec, str) or not spec.strip():
        raise FlatbenchError(f"measure.plugins: expected a file or module name, got {spec!r}")
    spec = spec.strip()
    return _load_file(spec, forget) if is_file_spec(spec) else _load_module(spec)


def load_entry_points() -> None:
    """Import every installed `flatbench.measures` entry point (once per process)."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        module_name = ep.value.partition(":")[0].strip()
        label = f"entry point '{ep.name}' ({ep.value})"
        try:
            found = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            found = None
        origin = Path(found.origin) if found and found.origin and Path(found.origin).is_file() else None
        PLUGIN_SOURCES.setdefault(module_name, (module_name, _sha256(origin) if origin else None))
        try:
            ep.load()
        except FlatbenchError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _fail(label, exc) from None
