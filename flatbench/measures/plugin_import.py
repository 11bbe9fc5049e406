"""How a measure plugin is found and imported: a Python file, an importable module, an installed entry point.

These are the mechanics only (where the file is, its hash, the module name it is imported under, the one
line a failing import becomes); `flatbench.measures.registry` decides what to load, records what the
import registers and checks it. Kept apart so that the registry reads as the registry.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from flatbench.errors import FlatbenchError
from flatbench.userspec import exec_file, file_sha256

ENTRY_POINT_GROUP = "flatbench.measures"


def is_file_spec(spec: str) -> bool:
    """A plugin or factory given as a file (`x.py`, `dir/x.py`) rather than as an importable module."""
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def module_source_hash(module_name: str) -> str | None:
    """sha256 of an imported module's source file (None when it has none, e.g. `__main__` in a notebook)."""
    path = getattr(sys.modules.get(module_name), "__file__", None)
    return file_sha256(path) if path and Path(path).is_file() else None


def failure(label: str, exc: BaseException) -> FlatbenchError:
    """A plugin's failed import as one line, naming the plugin and the line of its code that failed."""
    where = ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = f" ({Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno})"
    return FlatbenchError(f"plugin {label} failed to import: {type(exc).__name__}: {exc}{where}")


def plugin_file(spec: str) -> tuple[Path, str]:
    """The resolved path of a plugin file and the sha256 of its source; one line when it is not a file."""
    path = Path(spec).expanduser()
    if not path.is_file():
        what = "is a folder, not a Python file" if path.is_dir() else "does not exist"
        raise FlatbenchError(f"plugin file {spec} {what} (give a .py file or an importable module name)")
    path = path.resolve()
    return path, file_sha256(path)


def file_module_name(path: Path, sha: str) -> str:
    """The module name a plugin file is imported under: its stem and its hash, so an edited file is new."""
    return f"flatbench_plugin_{''.join(c if c.isalnum() else '_' for c in path.stem)}_{sha[:12]}"


def run_file(path: Path, module_name: str, spec: str) -> None:
    """Import a plugin file as `module_name` (userspec's `exec_file`, the one way flatbench runs a user's file)."""
    exec_file(path, module_name, lambda exc: failure(spec, exc), what=f"plugin file {spec}")


def _found(module_name: str) -> tuple[bool, str | None]:
    """Whether a module can be found, and the sha256 of its source file (None: no file), without importing it."""
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        found = None
    origin = Path(found.origin) if found and found.origin and Path(found.origin).is_file() else None
    return found is not None, file_sha256(origin) if origin else None


def module_hash(spec: str) -> str | None:
    """The sha256 of a plugin module's source; one line when the module cannot be found."""
    exists, sha = _found(spec)
    if not exists:
        raise FlatbenchError(f"plugin module '{spec}' cannot be found (is it installed, or on PYTHONPATH?); "
                             "a file is given by its path, e.g. ./my_measures.py")
    return sha


def run_guarded(label: str, load: Callable[[], Any]) -> None:
    """Import a plugin module or load an entry point: anything its code raises (sys.exit included) but a
    FlatbenchError or Ctrl-C is one line naming the plugin."""
    try:
        load()
    except (FlatbenchError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - sys.exit() in a plugin's import is its failure, not ours
        raise failure(label, exc) from None


def installed() -> list[tuple[Any, str, str, str | None]]:
    """Every installed `flatbench.measures` entry point: (entry point, module name, label, source sha256)."""
    out = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        module_name = ep.value.partition(":")[0].strip()
        out.append((ep, module_name, f"entry point '{ep.name}' ({ep.value})", _found(module_name)[1]))
    return out

