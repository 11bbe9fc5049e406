"""The results layout on disk, and atomic writes.

    <out>/<experiment>/
        study.yaml                 the resolved study config (what `flatbench report` reads back)
        runs/<run_id>/run.json     config, dataset facts, label corruption, final metrics, status
        runs/<run_id>/model.pt     final weights (state_dict + what is needed to rebuild the model)
        runs/<run_id>/checkpoint.pt  last epoch checkpoint while training (removed when finished)
        runs/<run_id>/measures.json  one entry per measure (status, values, seconds, settings, info)
        table.csv, correlations.csv, plots/, report.md

Every write goes to a temporary file in the same folder and is then moved into place with
`os.replace`, so a killed job never leaves a half-written JSON file or checkpoint behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from flatbench.errors import CheckpointError, FlatbenchError

RUNS_DIR = "runs"
RUN_JSON = "run.json"
MODEL_FILE = "model.pt"
CHECKPOINT_FILE = "checkpoint.pt"
MEASURES_JSON = "measures.json"
STUDY_FILE = "study.yaml"
SNAPSHOTS_DIR = "snapshots"
SNAPSHOT_JSON = "snapshot.json"
_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; results are meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return sorted(obj) if isinstance(obj, (set, frozenset)) else list(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def _clean_floats(obj: Any) -> Any:
    """JSON has no NaN/inf: store them as null-free strings so files stay standard JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean_floats(v) for v in obj]
    return obj


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    text = json.dumps(_clean_floats(obj), indent=2, default=_json_default, allow_nan=False)
    atomic_write_text(path, text + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file written by flatbench; a corrupt file is a one-line `FlatbenchError`."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise FlatbenchError(f"{path} is damaged (not valid JSON: {exc.msg} at line {exc.lineno})") from None


def salvage_json_object(text: str) -> dict[str, Any]:
    """The complete top-level `"key": value` entries of a JSON object whose text is damaged (e.g. cut off
    by a full disk or a killed copy): each entry is decoded in turn until the first one that is not whole."""
    decoder = json.JSONDecoder()
    out: dict[str, Any] = {}
    i = text.find("{")
    if i < 0:
        return out
    i += 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "}":
            break
        try:
            key, i = decoder.raw_decode(text, i)
            while i < n and text[i] in " \t\r\n":
                i += 1
            if i >= n or text[i] != ":" or not isinstance(key, str):
                break
            i += 1
            while i < n and text[i] in " \t\r\n":
                i += 1
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        out[key] = value
    return out


def read_json_salvaged(path: str | os.PathLike) -> tuple[dict[str, Any], str | None]:
    """A JSON object file read whole, or, if it is damaged, its readable entries and what was wrong.

    Returns (entries, problem): problem is None for an intact file."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return salvage_json_object(text), f"{exc.msg} at line {exc.lineno}"
    if not isinstance(data, dict):
        return {}, "not a JSON object"
    return data, None


def atomic_torch_save(path: str | os.PathLike, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def torch_load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """Load a checkpoint or model file; any failure is a one-line `CheckpointError`."""
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged file
        raise CheckpointError(f"{path} is corrupt or not a flatbench file ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'}); "
                              "delete it and re-run to retrain") from None


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file (stored in run.json for model.pt, so that a replaced or edited one is detected)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_model_hash(run_path: str | os.PathLike, info: dict, model_file: Path | None = None,
                     recorded: str | None = None) -> None:
    """Refuse a model.pt (or a snapshot's) whose sha256 differs from the one recorded when it was written."""
    path = model_file or Path(run_path) / MODEL_FILE
    expected = recorded if recorded is not None else info.get("model_sha256")
    if expected is None:
        return  # written before hashes were recorded
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; delete the run folder to retrain it")
    if file_sha256(path) != expected:
        raise CheckpointError(f"{path} is not the file its run wrote (sha256 differs from run.json): it was "
                              "replaced or edited; delete the run folder to retrain it")


def runs_dir(exp_dir: str | os.PathLike) -> Path:
    return Path(exp_dir) / RUNS_DIR


def run_dir(exp_dir: str | os.PathLike, run_id: str) -> Path:
    return runs_dir(exp_dir) / run_id


def list_run_dirs(exp_dir: str | os.PathLike) -> list[Path]:
    """Run folders of an experiment that have a run.json, sorted by run id."""
    base = runs_dir(exp_dir)
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if (p / RUN_JSON).is_file())


def load_run_info(run_path: str | os.PathLike) -> dict:
    return read_json(Path(run_path) / RUN_JSON)


def is_finished(run_path: str | os.PathLike) -> bool:
    path = Path(run_path)
    if not (path / RUN_JSON).is_file() or not (path / MODEL_FILE).is_file():
        return False
    try:
        return read_json(path / RUN_JSON).get("status") == "finished"
    except FlatbenchError:
        return False


LOCK_FILE = ".lock"


class RunLocked(FlatbenchError):
    """Another live process holds this run's lock."""


def _pid_alive(pid: int) -> bool:
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

    def _is_stale(self) -> bool:
        import socket
        import time

        try:
            host, pid = self.path.read_text().split()[:2]
            age = time.time() - self.path.stat().st_mtime
        except (OSError, ValueError):
            return True
        if host == socket.gethostname():
            return not _pid_alive(int(pid)) or int(pid) == os.getpid()
        return age > self.stale_after

    def acquire(self) -> None:
        import socket

        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if self._is_stale():
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
