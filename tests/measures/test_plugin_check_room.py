"""Issue 31's "the plugin check in one room", walked by the code's own calls (the `sys.setprofile` technique of
`scripts/walk_stage.py`): loading a plugin file goes to the registry (`measures/registry.py`), which has
`measures/plugin_import.py` find the file and run its import (userspec's `exec_file`, the one way flatbench
runs a user's file), gets back what the import's `register_measure` calls recorded, checks all of it after
the import, and stores the checked specs once. No check runs during the import."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import flatbench
from flatbench.errors import FlatbenchError

PACKAGE = Path(flatbench.__file__).resolve().parent
PLUGIN = '''
from flatbench import register_measure

@register_measure("room_a", description="a test plugin's first measure", invariant_to=("layer",),
                  defaults={"k": 1}, settings_help={"k": "a count"}, variants={"two": {"k": 2}})
def room_a(ctx):
    return 1.0

@register_measure("room_b", description="a test plugin's second measure", cost="gradient")
def room_b(ctx):
    return 2.0
'''
PASSING_THROUGH = {"userspec.py", "__init__.py"}
"""Rooms a plugin's import passes through on its way: userspec's `exec_file` and the packages' lazy
re-exports (`from flatbench import register_measure`)."""


def _calls(call, plugin: Path) -> list[tuple[str, str]]:
    """(room, function) of every call into flatbench or into the plugin file while `call()` runs; the
    plugin file's room is "<plugin>"."""
    plugin_file = str(plugin.resolve())
    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path == plugin_file:
            calls.append(("<plugin>", frame.f_code.co_name))
        elif path.startswith(str(PACKAGE)):
            calls.append((str(Path(path).relative_to(PACKAGE)), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return calls


def _stays(rooms: list[str]) -> list[str]:
    return [r for i, r in enumerate(rooms) if i == 0 or rooms[i - 1] != r]


def test_a_plugin_is_loaded_and_checked_in_one_room_then_stored_once(tmp_path, own_registry):
    flatbench.load_plugins([])  # the built-in measures first: the walk is the plugin's own
    plugin = tmp_path / "room_measures.py"
    plugin.write_text(textwrap.dedent(PLUGIN))
    calls = _calls(lambda: flatbench.load_plugins([str(plugin)]), plugin)
    rooms = [room for room, _ in calls]
    assert "<plugin>" in rooms and "userspec.py" in rooms  # the import did run, through exec_file
    assert set(rooms) - PASSING_THROUGH - {"<plugin>"} == {"measures/registry.py", "measures/plugin_import.py"}, \
        _stays(rooms)
    mechanics = {fn for room, fn in calls if room == "measures/plugin_import.py"}
    assert mechanics - {"<genexpr>"} == {"is_file_spec", "plugin_file", "file_module_name", "run_file"}, mechanics
    checks = [i for i, (room, fn) in enumerate(calls) if fn == "_checked"]
    assert len(checks) == 2 and all(calls[i][0] == "measures/registry.py" for i in checks)
    last_in_plugin = max(i for i, (room, _) in enumerate(calls) if room == "<plugin>")
    assert last_in_plugin < checks[0]  # every check after the import, none during it
    stores = [i for i, (room, fn) in enumerate(calls) if fn == "_check_and_store"]
    assert len(stores) == 1 and stores[0] < checks[0]  # one batch: checked, then stored at once
    spec = flatbench.measures.registry.get_measure("room_a:two")
    assert spec.origin == str(plugin.resolve()) and spec.family == "room_measures" and spec.preset == {"k": 2}


def test_a_failed_check_stores_nothing_of_the_plugin_and_fails_again_on_the_next_load(tmp_path, own_registry):
    from flatbench.measures.registry import all_measures

    plugin = tmp_path / "half_bad.py"
    plugin.write_text(textwrap.dedent(PLUGIN + '''
@register_measure("room_c", cost="expensive")
def room_c(ctx):
    return 3.0
'''))
    for _ in range(2):  # a plugin that failed is not taken as loaded
        with pytest.raises(FlatbenchError, match="^measure 'room_c': cost must be one of cheap, gradient, "
                                                 "hessian, search, got 'expensive'$"):
            flatbench.load_plugins([str(plugin)])
        assert not {"room_a", "room_b", "room_c"} & set(all_measures())


def test_a_direct_registration_is_checked_at_once_by_the_same_check(own_registry):
    with pytest.raises(FlatbenchError, match="unknown invariance families"):
        flatbench.register_measure("room_direct", invariant_to=("nonsense",))(lambda ctx: 0.0)
    with pytest.raises(ValueError, match="variant 'v' sets unknown settings"):
        flatbench.register_measure("room_direct", variants={"v": {"x": 1}})(lambda ctx: 0.0)
    flatbench.register_measure("room_direct")(lambda ctx: 0.0)
    assert flatbench.measures.registry.get_measure("room_direct").origin == __name__
