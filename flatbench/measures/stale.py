"""Stale entries: a result of a plugin measure whose plugin source changed since it was computed, or a result
computed with a loss file (`loss: file.py:function`) that changed since (`losses.loss_source`).

Every entry of a plugin measure records its plugin's source and sha256 (`evaluate.plugin_record`). The measure
stage recomputes an entry whose hash is not the loaded plugin's (`runner.up_to_date`); `flatbench status`
counts such entries as `stale` (not measured), and the report leaves them out with a one-line warning, so an
edited plugin never ranks results of its earlier version as if they were of the current one.

The current hash is the loaded plugin's (the study's `measure.plugins` and `--plugin`); for a measure that is
not loaded, the recorded source file's, where it still exists. A plugin that is neither loaded nor on disk
cannot be compared: its entries are kept as they are.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from flatbench.errors import FlatbenchError
from flatbench.measures.keys import parse_key
from flatbench.measures.registry import get_measure
from flatbench.userspec import current_sha256


def _file_sha256(source: Any) -> str | None:
    if not isinstance(source, str) or not source.endswith(".py"):
        return None
    path = Path(source)
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    except OSError:
        return None


def current_plugin_hash(name: str, source: Any) -> str | None:
    """The sha256 of measure `name`'s plugin as it is now: the loaded plugin's, else its recorded source
    file's; None when it cannot be told (neither loaded nor found, or a built-in measure now)."""
    try:
        spec = get_measure(name)
    except FlatbenchError:
        return _file_sha256(source)
    if spec.origin == "builtin":
        return None
    return spec.origin_sha256


def stale_reason(key: str, entry: Any) -> str | None:
    """Why a measures.json entry is stale (its plugin's source, or its loss file, changed since it was
    computed), else None."""
    if not isinstance(entry, dict):
        return None
    loss = entry.get("loss_source")
    if isinstance(loss, dict) and isinstance(loss.get("source"), str):
        now = current_sha256(loss["source"].rpartition(":")[0])
        if now is not None and now != loss.get("sha256"):
            return (f"computed with loss {loss['source']} at sha256 {str(loss.get('sha256'))[:12]}, which is now "
                    f"{now[:12]}")
    if not isinstance(entry.get("plugin"), dict):
        return None
    record = entry["plugin"]
    stored = record.get("sha256")
    current = current_plugin_hash(parse_key(key).measure, record.get("source"))
    if current is None or stored == current:
        return None
    return (f"computed with plugin {record.get('source')} at sha256 {str(stored)[:12]}, which is now "
            f"{current[:12]}")


def stale_keys(entries: dict[str, Any]) -> list[str]:
    """The keys of a measures.json's entries that are stale."""
    return [key for key, entry in entries.items() if stale_reason(key, entry)]


def drop_stale(records: list) -> dict[str, int]:
    """Remove the stale entries from report records (`analysis.table.RunRecord`, their `measures`); returns
    how many were removed per measure."""
    dropped: dict[str, int] = {}
    for rec in records:
        for key in stale_keys(rec.measures):
            del rec.measures[key]
            name = parse_key(key).measure
            dropped[name] = dropped.get(name, 0) + 1
    return dropped
