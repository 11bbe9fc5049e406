"""`flatbench describe MEASURE`: generated from the registry for every built-in measure and variant, and
for a plugin's measure through the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flatbench.errors import FlatbenchError
from flatbench.measures import all_measures
from flatbench.measures.describe import describe_measure
from flatbench.measures.registry import get_measure, register_measure

ROOT = Path(__file__).resolve().parents[2]


def _names() -> list[str]:
    return [name for name, spec in all_measures().items() if spec.origin == "builtin"] + [
        f"{name}:{v}" for name, spec in all_measures().items() if spec.origin == "builtin" for v in spec.variants]


@pytest.mark.parametrize("name", _names())
def test_every_builtin_measure_is_described(name: str) -> None:
    spec = get_measure(name)
    page = describe_measure(name)
    assert page.splitlines()[0] == name and spec.description in page
    for section in ("Invariant to", "Facts", f"Settings (measure.settings.{spec.base_name})", "Example"):
        assert f"\n{section}\n" in page, section
    assert f"cost: {spec.cost} (" in page
    for fam in spec.invariant_to:
        assert f"  {fam}: " in page
    settings_block = page.split("Settings (")[1].split("\nExample")[0]
    for key, default in spec.defaults.items():
        line = next((x for x in settings_block.splitlines() if x.strip().startswith(key + " ")), None)
        assert line is not None and "default " in line, (key, settings_block)
        if key in spec.settings_help:
            assert spec.settings_help[key] in line
    if not spec.defaults:
        assert "  none" in settings_block
    config = yaml.safe_load("\n".join(x[2:] for x in page.split("study config:\n")[1].split("command line:")[0]
                                      .splitlines()))
    assert config["measure"]["measures"] == [name]
    assert set(config["measure"].get("settings", {}).get(spec.base_name, {})) <= set(spec.defaults) - set(spec.preset)
    assert f'flatbench.measure(model, (x, y), ["{name}"]' in page


def test_every_setting_of_every_builtin_measure_is_explained() -> None:
    for name, spec in all_measures().items():
        if spec.origin == "builtin":
            assert set(spec.settings_help) == set(spec.defaults), name
            page = describe_measure(name)
            for key, text in spec.settings_help.items():
                assert text in page, (name, key)


def test_the_defaults_pass_every_builtin_measures_own_check() -> None:
    from flatbench.config import MeasureConfig
    from flatbench.measures.runner import check_settings

    names = [n for n in _names()]
    check_settings(names, MeasureConfig(settings={}))


def test_the_trace_and_eigenvalue_settings_are_all_explained() -> None:
    for name in ("hessian_trace", "hessian_max_eig"):
        spec = get_measure(name)
        assert set(spec.settings_help) == set(spec.defaults), name
    assert "Hutch++" in describe_measure("hessian_trace") and "exact_max_params" in describe_measure("hessian_trace")


def test_settings_help_for_an_unknown_setting_is_refused() -> None:
    with pytest.raises(FlatbenchError, match="settings_help for unknown settings"):
        register_measure("describe_test_stray", defaults={"a": 1}, settings_help={"b": "?"})(lambda ctx: 0.0)


def test_describe_a_plugin_measure_from_the_command_line(tmp_path: Path) -> None:
    plugin = tmp_path / "my_measures.py"
    plugin.write_text(
        "from flatbench.measures.plugin import register_measure\n\n"
        "@register_measure('weight_lp', invariant_to=(), cost='cheap', defaults={'p': 2.0, 'skip_bias': True},\n"
        "                  settings_help={'p': 'the exponent; > 0'})\n"
        "def weight_lp(ctx):\n"
        "    \"\"\"Σ |θ|^p over the parameters.\n\n    The plugin's own words.\"\"\"\n"
        "    return 0.0\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "flatbench", "describe", "weight_lp", "--plugin", str(plugin)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "p          default 2.0: the exponent; > 0" in run.stdout and "skip_bias  default true" in run.stdout
    assert "The plugin's own words." in run.stdout and f"origin: {plugin}" in run.stdout
    with pytest.raises(FlatbenchError, match="did you mean 'hessian_trace'"):
        describe_measure("hesian_trace")
