"""The results layout on disk, and atomic writes.

    <out>/<experiment>/
        study.yaml                 the resolved study config (what `flatbench report` reads back)
        runs/<run_id>/run.json     config, dataset facts, label corruption, final metrics, status
        runs/<run_id>/model.pt     final weights (state_dict + what is needed to rebuild the model)
        runs/<run_id>/checkpoint.pt  last epoch checkpoint while training (removed when finished)
        runs/<run_id>/measures.json  one entry per measure (status, values, seconds, settings, info)
        table.csv, correlations.csv, plots/, report.md

Every write goes to a temporary file in the same folder and is then moved into place with
`os.replace`, so a killed job never leaves a half-written JSON file or checkpoint behind. A job killed
between the write and the rename leaves its temporary (`.<name>.<random>.<pid>@<host>.tmp`); the next write
into that folder removes it, once its writer is known dead (`sweep_temporaries`).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import re
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from flatbench.errors import CheckpointError, ConfigError, FlatbenchError, one_line
from flatbench.locks import pid_alive

GAPS = ("acc", "loss", "calibrated")
"""The generalization gaps a run records (table.csv columns gap_acc, gap_loss, gap_calibrated: the loss gap
of the temperature-calibrated network, `training.calibration`) and a report correlates with."""


def gap_column(gap: str, what: str = "gap") -> str:
    """The table column of `gap` (one of `GAPS`); anything else is one error line naming `what`."""
    if gap not in GAPS:
        raise ConfigError(f"{what} must be one of {', '.join(GAPS)}, got {gap!r}")
    return f"gap_{gap}"

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


TEMP_STALE_AFTER = 24 * 3600
"""Seconds after which a temporary from another host (whose writer cannot be asked) counts as left over."""
_TEMP_WRITER = re.compile(r"\.(\d+)@([^@/]+)\.tmp$")
_swept: set[str] = set()


def _temp_suffix() -> str:
    """The end of this process's temporary names: `.<pid>@<host>.tmp`, so that a later process can tell a
    temporary whose writer died (kill -9 between write and rename) from one still being written."""
    return f".{os.getpid()}@{socket.gethostname()}.tmp"


def _left_over(name: str, age: float) -> bool:
    """Whether the temporary `name` belongs to no live writer: a dead process on this host, or (another
    host, or a name without its writer) older than `TEMP_STALE_AFTER`."""
    writer = _TEMP_WRITER.search(name)
    if writer and writer.group(2) == socket.gethostname():
        pid = int(writer.group(1))
        return pid != os.getpid() and not pid_alive(pid)
    return age > TEMP_STALE_AFTER


def sweep_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporaries `atomic_write_bytes` left in `folder` when its writer was killed between
    writing and renaming; returns what it removed. Temporaries of live writers are kept."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        if not (entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.is_file(follow_symlinks=False)):
            continue
        try:
            if _left_over(entry.name, time.time() - entry.stat(follow_symlinks=False).st_mtime):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            pass  # gone already, or not ours to remove
    return removed


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one. The first write
    into a folder in a process also removes the temporaries a killed writer left there, so a resumed stage
    leaves the folder as an uninterrupted one would. A link at `path` is refused (an OSError: one run's failure):
    replacing it cuts the link; writing through it overwrites what it points to, perhaps another run's file."""
    path = Path(path)
    if path.is_symlink():
        raise OSError(errno.ELOOP, f"a link ({os.readlink(path)}) where flatbench writes a file of its own: put a "
                      "copy or nothing in its place", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = str(path.parent.resolve())
    if folder not in _swept:
        sweep_temporaries(folder)
        _swept.add(folder)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_temp_suffix(), dir=path.parent)
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


def json_problem(obj: Any) -> str | None:
    """Why `obj` cannot be written by `atomic_write_json` (None when it can): checked before a measure's
    info is stored, so that one bad value is that measure's error, not a crash of the stage."""
    try:
        json.dumps(_clean_floats(obj), default=_json_default, allow_nan=False)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        return one_line(str(exc))[:120]
    return None


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
        with open(path, "rb") as f:
            data = f.read()
        return json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise FlatbenchError(f"{path} is damaged (not valid JSON: {exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise FlatbenchError(f"{path} is damaged (not UTF-8 text at byte {exc.start})") from None
    except RecursionError:
        raise FlatbenchError(f"{path} is damaged (nested too deeply)") from None


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
    check = ENTRY_CHECKS.get(Path(path).name)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        problem = f"{exc.msg} at line {exc.lineno}"
        try:
            data = salvage_json_object(text)
        except RecursionError:
            data = {}
    except RecursionError:
        return {}, "nested too deeply"
    else:
        if not isinstance(data, dict):
            return {}, "not a JSON object"
        problem = None
    if check is not None:
        bad = {key: why for key, why in ((k, check(v)) for k, v in data.items()) if why}
        if bad:
            key, why = next(iter(bad.items()))
            data = {k: v for k, v in data.items() if k not in bad}
            problem = "; ".join(p for p in (problem, f"{len(bad)} entr{'y' if len(bad) == 1 else 'ies'} of the "
                                            f"wrong shape, e.g. {key!r}: {why}") if p)
    return data, problem


def _is_number(value: Any) -> bool:
    """A number as flatbench writes it: int or float (not bool), or "nan" / "inf" / "-inf"."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or value in ("nan", "inf", "-inf")


def measure_entry_problem(entry: Any) -> str | None:
    """What is wrong with the shape of one measures.json entry, or None for a well-formed one."""
    if not isinstance(entry, dict):
        return f"a {type(entry).__name__}, not an object"
    status = entry.get("status")
    if status not in ("ok", "error", "not_applicable", "non_finite", "not_converged"):
        return f"status {status!r} is not ok, error, not_applicable, non_finite or not_converged"
    if status == "ok":
        values = entry.get("values")
        if not isinstance(values, dict) or not values:
            return "an ok entry without its values"
        for key, value in values.items():
            if not _is_number(value):
                return f"value {key!r} is {value!r}, not a number"
    for key in ("settings", "context", "info"):
        if key in entry and not isinstance(entry[key], dict):
            return f"{key} is a {type(entry[key]).__name__}, not an object"
    if "seconds" in entry and not _is_number(entry["seconds"]):
        return f"seconds is {entry['seconds']!r}, not a number"
    if entry.get("larger_is_sharper") not in (None, True, False):
        return f"larger_is_sharper is {entry['larger_is_sharper']!r}, not true or false"
    return None


ENTRY_CHECKS = {MEASURES_JSON: measure_entry_problem}
"""Files read with `read_json_salvaged` whose entries have a shape: a wrong-shaped entry is damage (left out,
and the file reported damaged), never read as a value."""


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
    """The folder of run folders; a file in its place is bad input (exit 2), not a study with no runs."""
    path = Path(exp_dir) / RUNS_DIR
    if path.exists() and not path.is_dir():
        raise FlatbenchError(f"{path} is a file, not the folder of the experiment's runs: move it away")
    return path


def run_dir(exp_dir: str | os.PathLike, run_id: str) -> Path:
    return runs_dir(exp_dir) / run_id


def list_run_dirs(exp_dir: str | os.PathLike) -> list[Path]:
    """Run folders of an experiment that have a run.json, sorted by run id."""
    base = runs_dir(exp_dir)
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if (p / RUN_JSON).is_file())


RUN_STATUSES = ("running", "finished", "preempted", "interrupted", "failed")


def run_info_problem(info: Any) -> str | None:
    """What is wrong with the shape of a run.json, or None. A finished run must hold its config and its
    final metrics; any run's fields that are there must have their types."""
    if not isinstance(info, dict):
        return f"a {type(info).__name__}, not a JSON object"
    status = info.get("status")
    if status not in RUN_STATUSES:
        return f"status {status!r} is not one of {', '.join(RUN_STATUSES)}"
    for key in ("run_id", "model_sha256", "config_hash", "error"):
        if info.get(key) is not None and not isinstance(info[key], str):
            return f"{key} is {info[key]!r}, not a string"
    for key, kind in (("config", dict), ("dataset", dict), ("labels", dict), ("history", list),
                      ("snapshots", list), ("sweep_axes", list), ("endpoint", dict)):
        if key in info and not isinstance(info[key], kind):
            return f"{key} is a {type(info[key]).__name__}, not a{'n object' if kind is dict else ' list'}"
    if any(not isinstance(h, dict) for h in info.get("history", [])):
        return "history holds an entry that is not an object"
    for snap in info.get("snapshots", []):
        if not (isinstance(snap, dict) and _is_number(snap.get("level")) and isinstance(snap.get("path"), str)
                and not Path(snap["path"]).is_absolute() and ".." not in Path(snap["path"]).parts):
            return f"snapshots holds {snap!r}, not a snapshot record (level, path inside the run)"
        if snap.get("model_sha256") is not None and not isinstance(snap["model_sha256"], str):
            return f"a snapshot's model_sha256 is {snap['model_sha256']!r}, not a string"
    if status == "finished":
        if not isinstance(info.get("config"), dict):
            return "a finished run without its config"
        if not isinstance(info.get("run_id"), str):
            return "a finished run without its run_id"
        for key in ("train_acc", "test_acc", "train_loss", "test_loss"):
            if not _is_number(info.get(key)):
                return f"a finished run whose {key} is {info.get(key)!r}, not a number"
            problem = _metric_range_problem(key, float(info[key]))
            if problem:
                return f"a finished run whose {problem}"
    return None


def _metric_range_problem(key: str, value: float) -> str | None:
    """An impossible final metric: an accuracy not a finite number in [0, 1], a loss below 0 (a loss may be
    nan or inf: a diverged training records it so)."""
    if key.endswith("_acc") and not 0.0 <= value <= 1.0:
        return f"{key} is {value!r}, not an accuracy in [0, 1]"
    if key.endswith("_loss") and value < 0:
        return f"{key} is {value!r}, a negative loss"
    return None


def endpoint_miss(endpoint: Any) -> str | None:
    """The one rule for "did a run meet its step-level endpoint" (run.json's `endpoint`, written with
    `train.endpoint_tolerance`): None when its final train loss is in [(1 − tolerance)·target, target], else
    why not, in a few words. A run.json without the record, or a record without a tolerance, meets it (None):
    runs trained without the setting are judged as before."""
    if not isinstance(endpoint, dict) or endpoint.get("tolerance") is None:
        return None
    target, tol, final = (endpoint.get(k) for k in ("target", "tolerance", "final"))
    if not all(_is_number(v) for v in (target, tol, final)):
        return f"an endpoint record without its numbers (target {target!r}, tolerance {tol!r}, final {final!r})"
    target, tol, final = float(target), float(tol), float(final)
    if not final <= target:  # also NaN
        return f"did not reach train loss {target:g} (ended at {final:.4g})"
    if final < (1 - tol) * target:
        return (f"ended at train loss {final:.4g}, below the endpoint's band [{(1 - tol) * target:.4g}, {target:g}] "
                f"(train.endpoint_tolerance {tol:g})")
    return None


def load_run_info(run_path: str | os.PathLike) -> dict:
    """A run's run.json, its shape checked (`run_info_problem`): damage is a one-line `FlatbenchError`."""
    path = Path(run_path) / RUN_JSON
    info = read_json(path)
    problem = run_info_problem(info)
    if problem:
        raise FlatbenchError(f"{path} is damaged ({problem}); move the run folder away or delete it to retrain")
    return info


def run_info_or_problem(run_path: str | os.PathLike) -> tuple[dict | None, str | None]:
    """A run folder's run.json read once: (its content, None), or (None, why it cannot be used: unreadable
    or of the wrong shape), or (None, None) when there is none. A run.json that is a folder, a link to
    /dev/null or empty is damage, never "not started"."""
    problem = file_problem(Path(run_path) / RUN_JSON)
    if problem:
        return None, (f"{Path(run_path) / RUN_JSON} is damaged ({problem}); move the run folder away or delete "
                      "it to retrain")
    if not (Path(run_path) / RUN_JSON).is_file():
        return None, None
    try:
        return load_run_info(run_path), None
    except FlatbenchError as exc:
        return None, str(exc)


def run_json_problem(run_path: str | os.PathLike) -> str | None:
    """Why a run folder's run.json cannot be used, or None (also when there is none): `run_info_or_problem`."""
    return run_info_or_problem(run_path)[1]


def is_finished(run_path: str | os.PathLike) -> bool:
    """A finished run: its run.json readable, well-formed and `finished`, and its model.pt there."""
    path = Path(run_path)
    if not (path / RUN_JSON).is_file() or not (path / MODEL_FILE).is_file():
        return False
    try:
        return load_run_info(path).get("status") == "finished"
    except FlatbenchError:
        return False


def file_problem(path: str | os.PathLike) -> str | None:
    """Why `path`, which is there, cannot be a file flatbench wrote: a folder, something that is not a regular
    file (a link to /dev/null, a dangling link, a device) or an empty file. None for a regular file with
    something in it, and for nothing at all (a missing file is each reader's own case). Damage is never read
    as data: an empty or absent measures.json would otherwise be a run without values, a study.yaml that
    reads as nothing a default study."""
    p = Path(path)
    if not os.path.lexists(p):
        return None
    link = f" (a link to {os.readlink(p)})" if p.is_symlink() else ""
    try:
        st = p.stat()
    except OSError as exc:
        return f"unreadable{link}: {exc.strerror}"
    if stat.S_ISDIR(st.st_mode):
        return f"a folder, not a file{link}"
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file{link}"
    if st.st_size == 0:
        return f"empty{link}"
    return None


def missing_model(run_path: str | os.PathLike, info: dict | None = None) -> str | None:
    """Why a run that says it finished cannot be: its model.pt is gone (deleted or moved). That is damage,
    not a run still to train; None for any other run. `info`: its run.json when the caller has read it."""
    path = Path(run_path)
    if (path / MODEL_FILE).exists():
        return None
    if info is None:
        if not (path / RUN_JSON).is_file():
            return None
        try:
            info = load_run_info(path)
        except FlatbenchError:
            return None
    if info.get("status") != "finished":
        return None
    return (f"{path / MODEL_FILE} is missing although the run finished (deleted or moved?); restore it, or "
            "move the run folder away to retrain it")
