"""I/O errors injected by path, for tests that must run as root (where chmod does not bite): reading or
writing any file under a folder raises the OSError a permission problem, a read-only file system or a full
disk would."""

from __future__ import annotations

import builtins
import errno
import io
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _path(arg: object) -> Path | None:
    if isinstance(arg, (str, bytes, os.PathLike)):
        try:
            return Path(os.fsdecode(arg)).absolute()
        except (TypeError, ValueError):
            return None
    return None


@contextmanager
def denied(monkeypatch, under: Path | Callable[[Path], bool], *, read: bool = False, write: bool = False,
           code: int = errno.EACCES) -> Iterator[list[Path]]:
    """Within the block, opening a file under `under` (a folder, or a test on the path) for reading
    (`read`) or writing (`write`) raises OSError(`code`); yields the list of paths refused."""
    hit = under if callable(under) else (lambda p, base=Path(under).absolute(): p == base or base in p.parents)
    refused: list[Path] = []
    real_open, real_io_open, real_os_open = builtins.open, io.open, os.open

    def refuse(path: Path | None, writing: bool) -> None:
        if path is not None and hit(path) and ((writing and write) or (not writing and read)):
            refused.append(path)
            raise OSError(code, os.strerror(code), str(path))

    def fake_open(file, mode="r", *args, **kwargs):
        refuse(_path(file), any(c in mode for c in "wax+"))
        return real_open(file, mode, *args, **kwargs)

    def fake_io_open(file, mode="r", *args, **kwargs):
        refuse(_path(file), any(c in mode for c in "wax+"))
        return real_io_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if not (os.path.isdir(path) and not flags & WRITE_FLAGS):  # a folder opened to lock it
            refuse(_path(path), bool(flags & WRITE_FLAGS))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_io_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    try:
        yield refused
    finally:
        monkeypatch.setattr(builtins, "open", real_open)
        monkeypatch.setattr(io, "open", real_io_open)
        monkeypatch.setattr(os, "open", real_os_open)
