"""The user's own code named in a config or on the command line: `file.py:function` or `pkg.module:function`.

A file is given by its path (relative to where flatbench runs, or absolute) and imported under a name made
from its path and content hash; a module is imported by name (installed, or on PYTHONPATH). Any problem
(missing file, unknown module, no such function, an error while importing) is one `FlatbenchError` line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flatbench.errors import FlatbenchError


def is_factory_spec(text: str) -> bool:
    """Whether a model or loss name names the user's code (`where:function`) rather than a built-in."""
    return isinstance(text, str) and ":" in text and not text.startswith(":") and not text.endswith(":")


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def spec_file(text: str) -> Path | None:
    """The file whose code a `file.py:function` or `pkg.module:function` spec names (absolute), or None
    where it cannot be told (a module that cannot be found, a built-in module)."""
    where = str(text).rpartition(":")[0]
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser()
        return path.resolve() if path.is_file() else None
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        return None
    origin = getattr(found, "origin", None)
    return Path(origin).resolve() if origin and origin.endswith(".py") and Path(origin).is_file() else None


_HASHES: dict[tuple[str, int, int], str] = {}


def current_sha256(path: str | Path) -> str | None:
    """The sha256 of a file as it is now (None where it cannot be read), hashed again only when its size or
    modification time moved."""
    try:
        st = Path(path).stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key not in _HASHES:
            _HASHES[key] = file_sha256(path)
        return _HASHES[key]
    except OSError:
        return None


def import_file(path: str | Path, what: str = "file") -> Any:
    """Import a Python file as a module (once per path and content)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FlatbenchError(f"{what} {path} does not exist" if not path.exists() else f"{what} {path} is not a file")
    path = path.resolve()
    sha = file_sha256(path)
    name = f"flatbench_user_{''.join(c if c.isalnum() else '_' for c in path.stem)}_{sha[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    return exec_file(path, name, lambda exc: FlatbenchError(
        f"{what} {path} failed to import: {type(exc).__name__}: {exc}"), what=f"{what} {path}")


def exec_file(path: Path, name: str, failure: Callable[[BaseException], FlatbenchError], what: str) -> Any:
    """Import the Python file `path` as module `name` (registered in sys.modules); an exception of the
    user's code becomes `failure(exc)`, one line (a FlatbenchError it raises passes as it is). The one
    way flatbench runs a user's file: model factories, losses and measure plugins alike."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FlatbenchError(f"{what} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except FlatbenchError:
        sys.modules.pop(name, None)
        raise
    except KeyboardInterrupt:
        sys.modules.pop(name, None)
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's file failing (sys.exit included) is one line
        sys.modules.pop(name, None)
        raise failure(exc) from None
    return module


def load_object(text: str, what: str = "factory") -> Callable[..., Any]:
    """The callable named by `file.py:function` or `pkg.module:function`."""
    where, sep, attr = str(text).rpartition(":")
    if not sep or not where or not attr:
        raise FlatbenchError(f"{what} '{text}' must look like file.py:function or pkg.module:function")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = import_file(where, f"{what} file")
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise FlatbenchError(f"{what} '{text}': module '{exc.name or where}' cannot be found (installed, or on "
                                 "PYTHONPATH?); a file is given by its path, e.g. ./models.py:build") from None
        except Exception as exc:  # noqa: BLE001
            raise FlatbenchError(f"{what} '{text}': importing {where} failed: {type(exc).__name__}: {exc}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise FlatbenchError(f"{what} '{text}': {where} has no '{attr}' (it defines: {', '.join(found) or 'nothing'})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FlatbenchError(f"{what} '{text}': {attr} is not a function")
    return obj


def call_with_accepted(fn: Callable[..., Any], offered: dict[str, Any], kwargs: dict[str, Any], what: str) -> Any:
    """`fn(**kwargs, **the offered arguments its signature accepts by name)`; a function whose required
    positional parameters have other names, as many as offered, gets them positionally, in their order
    (`build(shape, classes)`). A TypeError there is one line."""
    args: list[Any] = []
    try:
        params = inspect.signature(fn).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        extra = {k: v for k, v in offered.items() if (takes_any or k in params) and k not in kwargs}
        positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                      and p.default is p.empty and p.name not in kwargs and p.name not in extra]
        if positional and not extra and len(positional) == len(offered):
            args = list(offered.values())
    except (TypeError, ValueError):
        extra = {}
    try:
        return fn(*args, **kwargs, **extra)
    except TypeError as exc:
        raise FlatbenchError(f"{what}: {exc}") from None
