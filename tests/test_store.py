"""store's atomic writes: a writer killed between writing and renaming leaves a temporary that the next
write into the folder removes, while the temporaries of live writers stay."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from flatbench import store

KILLED_WRITER = """
import os, sys
from flatbench import store
os.replace = lambda *a: os.kill(os.getpid(), 9)  # die after the temporary is written, before the rename
store.atomic_write_bytes(sys.argv[1], b"half")
"""


@pytest.fixture(autouse=True)
def _fresh_sweep(monkeypatch):
    monkeypatch.setattr(store, "_swept", set())


def _temporaries(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "table.csv"
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(target)], capture_output=True)
    assert proc.returncode == -9
    left = _temporaries(tmp_path)
    assert len(left) == 1 and left[0].startswith(".table.csv.")
    assert left[0].endswith(f"@{socket.gethostname()}.tmp")
    assert not target.exists()
    store.atomic_write_bytes(tmp_path / "other.csv", b"x")
    assert _temporaries(tmp_path) == []
    assert (tmp_path / "other.csv").read_bytes() == b"x"


def test_temporaries_of_live_writers_and_young_foreign_ones_stay(tmp_path):
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = tmp_path / f".a.json.xyz.{os.getpid()}@{host}.tmp"
        alive = tmp_path / f".b.json.xyz.{live.pid}@{host}.tmp"
        young_foreign = tmp_path / ".c.json.xyz.123@elsewhere.tmp"
        old_foreign = tmp_path / ".d.json.xyz.123@elsewhere.tmp"
        old_unnamed = tmp_path / ".e.json.abc123.tmp"
        for p in (mine, alive, young_foreign, old_foreign, old_unnamed):
            p.write_bytes(b"t")
        old = time.time() - store.TEMP_STALE_AFTER - 60
        for p in (old_foreign, old_unnamed):
            os.utime(p, (old, old))
        removed = store.sweep_temporaries(tmp_path)
        assert sorted(p.name for p in removed) == [old_foreign.name, old_unnamed.name]
        assert _temporaries(tmp_path) == sorted([mine.name, alive.name, young_foreign.name])
    finally:
        live.kill()
        live.wait()
    store.sweep_temporaries(tmp_path)
    assert alive.name not in _temporaries(tmp_path)  # its writer is dead now


def test_a_sweep_leaves_other_files_alone(tmp_path):
    (tmp_path / "results.tmp").write_bytes(b"a user's file")  # not hidden: not one of ours
    (tmp_path / ".hidden").write_bytes(b"b")
    store.sweep_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "results.tmp"]
