"""Exit codes a scheduler can trust, through the real CLI (issue 30): runs asked to be measured that are not
trained exit 1 (named in one line), a finished run without its model.pt is damage (exit 2, named), and the
same codes come back from worker processes and from `--executor` tasks; stale plugin entries in `status`,
the report and `measure`; `--measures ''` and `measure-model --n-examples` above the data refused.

One tiny trained study (the plugin-isolation tests' SMALL) is copied for each test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap

import pytest
import yaml

from conftest import in_process
from test_isolation import HOSTILE, SMALL, cli, entries, failed_lines, one_line


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("exits")
    cfg = root / "small.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "name": "small"}))
    result = cli("run", str(cfg), "--out", str(root / "out"), "--device", "cpu", "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    plugin = root / "hostile.py"
    plugin.write_text(textwrap.dedent(HOSTILE))
    return root / "out" / "small", plugin


@pytest.fixture
def exp(trained, tmp_path):
    target = tmp_path / "small"
    shutil.copytree(trained[0], target)
    return target


def _runs(exp):
    return sorted((exp / "runs").iterdir())


def _last_error(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), result.stderr
    return lines[-1]


def test_measure_exits_1_naming_runs_not_trained_also_in_workers_and_2_for_a_missing_model(exp):
    first, second, third = _runs(exp)
    shutil.rmtree(first)  # never trained
    result = cli("measure", str(exp), "--device", "cpu", "--measures", "frobenius_norm,spectral_norm",
                 "measure.workers=2")
    assert result.returncode == 1, result.stdout + result.stderr
    line = _last_error(result)
    assert "1 run(s) not trained yet" in line and first.name in line and "Traceback" not in result.stderr
    for run in (second, third):  # the others are measured all the same
        assert json.loads((run / "measures.json").read_text())["spectral_norm"]["status"] == "ok"
    (second / "model.pt").unlink()  # finished, model gone: damage, never "not trained yet"
    damaged = cli("measure", str(exp), "--device", "cpu", "--force")
    line = one_line(damaged, "model.pt is missing", second.name)
    assert "not trained" not in line
    nothing = tmp_runs_removed(exp)
    result = in_process("measure", str(nothing), "--device", "cpu", "--quiet")
    assert result.returncode == 1 and "3 run(s) not trained yet" in _last_error(result), result.stderr


def test_only_a_finished_run_without_model_pt_is_damage_a_run_stopped_before_is_not_trained(exp):
    """The rule itself (`store.missing_model`): a run.json that says the run finished, with no model.pt, is
    damage (the model deleted or moved); a run stopped before it finished (interrupted, failed, running) has
    no model.pt either, and that is a run not trained yet (exit 1), never damage. (A finished run without
    model.pt is also refused when its model is loaded, which alone would hide a wrong rule from `measure`.)"""
    from flatbench.store import missing_model

    first, second, _ = _runs(exp)
    info = json.loads((second / "run.json").read_text())
    (second / "run.json").write_text(json.dumps({**info, "status": "interrupted"}))
    (second / "model.pt").unlink()
    assert missing_model(second) is None
    result = in_process("measure", str(exp), "--device", "cpu", "--quiet", "--measures", "frobenius_norm")
    assert result.returncode == 1, result.stdout + result.stderr
    line = _last_error(result)
    assert "1 run(s) not trained yet" in line and second.name in line and "missing" not in line
    (first / "model.pt").unlink()
    assert "although the run finished" in (missing_model(first) or "")
    finished = json.loads((first / "run.json").read_text())
    assert "although the run finished" in (missing_model(first, finished) or "")


def tmp_runs_removed(exp):
    """The study with no run trained (its folder and study.yaml there)."""
    for run in _runs(exp):
        shutil.rmtree(run)
    return exp


def test_a_complete_measure_exits_0(exp):
    assert in_process("measure", str(exp), "--device", "cpu", "--quiet").returncode == 0


def test_executor_tasks_propagate_exit_codes(trained, exp):
    _, plugin = trained
    first = _runs(exp)[0]
    shutil.rmtree(first)
    args = ("measure", str(exp), "--device", "cpu", "--executor", "local", "--wait", "--runs-per-task", "2",
            "--plugin", str(plugin))
    result = cli(*args, "--measures", "frobenius_norm,nan_value", timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    failed = failed_lines(result)
    assert any("nan_value" in line and line.startswith("failed: task ") for line in failed), result.stderr
    assert any("not trained yet" in line and first.name in line for line in failed), result.stderr
    assert "Traceback" not in result.stderr
    for run in entries(exp).values():
        assert run["nan_value"]["status"] == "non_finite" and run["frobenius_norm"]["status"] == "ok"
    second = _runs(exp)[0]
    (second / "model.pt").unlink()
    damaged = cli(*args, "--measures", "frobenius_norm", timeout=300)
    one_line(damaged, "could not be measured", second.name, "model.pt is missing")


def test_check_measured_and_task_error_classify_as_the_cli_does():
    from flatbench.errors import FlatbenchError
    from flatbench.study.cluster import EntriesFailed, check_measured, task_error
    from flatbench.study.measure import MeasureCounts

    check_measured(MeasureCounts(measured=3))
    check_measured(MeasureCounts(not_trained=1, not_trained_ids=["r1"]), locked=["r1"])  # another task's run
    with pytest.raises(EntriesFailed, match="r2"):
        check_measured(MeasureCounts(not_trained=1, not_trained_ids=["r2"]), locked=["r1"])
    with pytest.raises(EntriesFailed, match="1 measure entries failed: r3 m: boom"):
        check_measured(MeasureCounts(failed_entries=[("r3", "m", "boom")]))
    with pytest.raises(FlatbenchError, match="r4: gone"):
        check_measured(MeasureCounts(failed_entries=[("r3", "m", "x")], failed_runs={"r4": "gone"}))
    trace = ("Job (task=0) failed during processing with trace:\n----\nTraceback (most recent call last):\n"
             '  File "x.py", line 1, in f\nflatbench.study.cluster.EntriesFailed: 2 measure entries failed: a\n'
             "----\nYou can check full logs with ...\n  - /tmp/x.err\n")
    assert task_error(RuntimeError(trace)) == (1, "2 measure entries failed: a")
    assert task_error(RuntimeError(trace.replace("cluster.EntriesFailed", "errors.FlatbenchError")))[0] == 2
    assert task_error(RuntimeError(trace.replace("flatbench.study.cluster.EntriesFailed", "ValueError"))) == \
        (2, "ValueError: 2 measure entries failed: a")


def test_empty_measures_and_n_examples_above_the_data_are_refused_in_one_line(exp, tmp_path):
    for command in (("measure", str(exp)), ("run", str(exp / "study.yaml"))):
        one_line(in_process(*command, "--measures", ""), "--measures", "names no measure")
    one_line(in_process("measure", str(exp), "--measures", " , "), "names no measure")
    factory = tmp_path / "net.py"
    factory.write_text("from torch import nn\n\ndef make(input_shape, num_classes):\n"
                       "    return nn.Sequential(nn.Flatten(), nn.Linear(784, num_classes))\n")
    line = one_line(cli("measure-model", f"{factory}:make", "--data", "mnist_mini", "--n-examples", "1000000000"),
                    "n_examples=1000000000", "6000 training examples")
    assert "mnist_mini" in line
    one_line(in_process("measure-model", f"{factory}:make", "--data", "mnist_mini", "--measures", ""), "--measures")
    ok = in_process("measure-model", f"{factory}:make", "--data", "mnist_mini", "--n-examples", "6000",
                    "--measures", "frobenius_norm")
    assert ok.returncode == 0, ok.stderr


STALE_PLUGIN = '''
from flatbench import register_measure

@register_measure("versioned", description="a plugin measure whose file is edited")
def versioned(ctx):
    return VERSION
'''


def test_an_edited_plugin_makes_its_entries_stale_in_status_and_the_report_and_measure_recomputes_them(exp, tmp_path, own_registry):
    plugin = tmp_path / "versioned.py"
    plugin.write_text("VERSION = 1.0\n" + STALE_PLUGIN)
    measured = cli("measure", str(exp), "--device", "cpu", "--plugin", str(plugin), "--measures", "versioned")
    assert measured.returncode == 0, measured.stderr
    run = _runs(exp)[0]
    stored = json.loads((run / "measures.json").read_text())["versioned"]
    assert stored["values"] == {"versioned": 1.0} and len(stored["plugin"]["sha256"]) == 64
    ok = json.loads(in_process("status", str(exp), "--json").stdout)
    assert ok["stale_entries"] == 0 and ok["measured"] == 3

    plugin.write_text("VERSION = 2.0\n" + STALE_PLUGIN)  # edited: every stored entry is of the old file
    state = json.loads(in_process("status", str(exp), "--json").stdout)
    assert state["stale_entries"] == 3 and state["runs"][run.name]["stale_entries"] == ["versioned"]
    text = in_process("status", str(exp)).stdout
    assert "stale: 3 measure entries of an edited plugin" in text
    report = in_process("report", str(exp), "--quiet", "--plugin", str(plugin))
    assert report.returncode == 0, report.stderr
    warnings = [line for line in report.stdout.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "3 entries of versioned left out: stale" in warnings[0], report.stdout
    assert "versioned" not in (exp / "correlations.csv").read_text()
    again = in_process("measure", str(exp), "--device", "cpu", "--plugin", str(plugin), "--measures", "versioned")
    assert again.returncode == 0, again.stderr
    assert json.loads((run / "measures.json").read_text())["versioned"]["values"] == {"versioned": 2.0}
    assert json.loads(in_process("status", str(exp), "--json").stdout)["stale_entries"] == 0
    fresh = in_process("report", str(exp), "--quiet", "--plugin", str(plugin))
    assert "warning: " not in fresh.stdout and "versioned" in (exp / "correlations.csv").read_text()
