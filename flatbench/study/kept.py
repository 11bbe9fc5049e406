"""A report written all or nothing: `kept_on_failure(folder)` notes every file under the report folder
(hard links, so no space is needed and nothing is copied), and if the block fails (a full disk, a
read-only plot folder, an interrupt) puts every file back as it was and removes what the block added. The
run folders (`runs/`) and the executors' logs are the stages' own, never the report's, and are left alone."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flatbench.locks import pid_alive
from flatbench.store import RUNS_DIR

NOT_THE_REPORTS = (RUNS_DIR, "slurm", "local")
"""Top-level folders of an experiment that a report never writes into (and that other stages may be
writing into meanwhile)."""
PREFIX = ".report-kept-"


def _walk(folder: Path) -> tuple[list[Path], list[Path]]:
    """(files, folders) under `folder`, relative, without the stages' own folders and the kept copies."""
    files, dirs = [], []
    for top, subdirs, names in os.walk(folder):
        rel = Path(top).relative_to(folder)
        if rel == Path("."):
            subdirs[:] = [d for d in subdirs if d not in NOT_THE_REPORTS and PREFIX not in d]
        dirs += [rel / d for d in subdirs]
        files += [rel / n for n in names]
    return files, dirs


@contextmanager
def kept_on_failure(folder: Path) -> Iterator[None]:
    """Run the block; if it raises, `folder` is put back as it was before it (every file's content, no new
    file or folder), then the exception goes on."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kept = _kept_folder(folder)
    try:
        files, dirs = _walk(folder)
        for rel in files:
            (kept / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(folder / rel, kept / rel, follow_symlinks=False)
            except OSError:
                shutil.copy2(folder / rel, kept / rel, follow_symlinks=False)
        try:
            yield
        except BaseException:
            _restore(folder, kept, set(files), set(dirs))
            raise
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def _kept_folder(folder: Path) -> Path:
    """A fresh folder for the kept links: beside `folder`, not in it, so that nothing reading the report
    folder while the report is written (the audit digest looks for audit folders in it) takes the kept copies
    for the report's own; in it (a hidden folder the readers skip) only where its parent cannot be written.
    Folders left by a report killed with kill -9 (their pid dead) are removed first."""
    parent = folder.resolve().parent
    prefix = f".{folder.resolve().name}{PREFIX}"
    for left in parent.glob(f"{prefix}*"):
        pid = left.name[len(prefix):].split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
    for where in (parent, folder):
        try:
            return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=where))
        except OSError:
            continue
    raise OSError(f"cannot write beside or in {folder}")


def _restore(folder: Path, kept: Path, files: set[Path], dirs: set[Path]) -> None:
    now_files, now_dirs = _walk(folder)
    for rel in now_files:
        if rel not in files:
            (folder / rel).unlink(missing_ok=True)
    for rel in files:
        target = folder / rel
        if not (os.path.lexists(target) and os.path.samefile(kept / rel, target)) or target.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(kept / rel, target)
    for rel in sorted((d for d in now_dirs if d not in dirs), key=lambda d: -len(d.parts)):
        try:
            (folder / rel).rmdir()
        except OSError:
            pass
