"""Locks on run and measure folders, so that two processes never train one run or write one measures.json at
once (moved out of `store`, which keeps the layout and the atomic writes). `RunLock` is a lock file holding
`host pid` (it survives the process, so a stale one is detected and taken over); `folder_lock` is a `flock`
on the folder itself, which the kernel releases when its holder dies, even by kill -9."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from flatbench.errors import FlatbenchError

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, blocking: bool = True) -> Iterator[bool]:
    """An exclusive lock on a folder (flock on the folder itself: no file is left behind, and the kernel
    releases it when the holding process dies, even by kill -9). Yields True when held; with
    `blocking=False` yields False at once if another process holds it. Where a folder cannot be locked
    (some network file systems), a lock file `.measures.lock` in it is locked instead."""
    import fcntl  # lazy: POSIX only; the rest of store imports on any platform

    folder = Path(folder)
    try:
        fd = os.open(folder, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # can this file system lock a folder at all?
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        pass  # it can, and someone holds it: wait for it (or not) below
    except OSError:
        try:
            os.close(fd)
        except (OSError, UnboundLocalError):
            pass
        fd = os.open(folder / ".measures.lock", os.O_CREAT | os.O_RDWR, 0o666 & ~_UMASK)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


LOCK_FILE = ".lock"


class RunLocked(FlatbenchError):
    """Another live process holds this run's lock."""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host is alive (a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """A lock file `<run>/.lock` holding `host pid`, so two jobs never train the same run at once.

    A lock left by a dead process on this host is stale and taken over; a lock from another host is
    honoured (its process cannot be checked from here) unless it is older than `stale_after` seconds.
    """

    def __init__(self, run_path: str | os.PathLike, stale_after: float = 24 * 3600):
        self.path = Path(run_path) / LOCK_FILE
        self.stale_after = stale_after
        self.held = False

    def is_stale(self) -> bool:
        try:
            host, pid = self.path.read_text().split()[:2]
            age = time.time() - self.path.stat().st_mtime
        except (OSError, ValueError):
            return True
        if host == socket.gethostname():
            return not pid_alive(int(pid)) or int(pid) == os.getpid()
        return age > self.stale_after

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if self.is_stale():
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
                    continue
                owner = self.path.read_text().strip() if self.path.exists() else "?"
                raise RunLocked(f"run {self.path.parent.name} is being trained by another process "
                                f"({owner}); remove {self.path} if that process is gone") from None
            with os.fdopen(fd, "w") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}\n")
            self.held = True
            return
        raise RunLocked(f"could not lock {self.path.parent.name}")

    def release(self) -> None:
        if self.held:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.held = False

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
