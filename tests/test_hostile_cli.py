"""Issue 44 part A through the real CLI (a fresh process each, as a user runs it): a plugin that keeps a
non-daemon thread alive, swallows every exception past its time limit or calls os._exit cannot keep a command
from ending or pass for a complete measure; an edited loss file makes its entries stale; two loss files whose
functions share a name are refused; check-measure limits a plugin that sleeps (--timeout-s)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import yaml
from conftest import cli_ok, cli_one_line_error, run_cli

LOSS = "import torch.nn.functional as F\nSCALE = {scale}\n\ndef scaled(logits, targets):\n" \
       "    return SCALE * F.cross_entropy(logits, targets, reduction='none')\n"


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A two-run study (two, so that `--workers 2` measures in worker processes) on small blobs, trained and
    measured with a loss file of one's own."""
    root = tmp_path_factory.mktemp("hostile")
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 120)
    x = (rng.normal(size=(3, 5))[y] * 3 + rng.normal(size=(120, 5))).astype(np.float32)
    np.savez(root / "blobs.npz", x_train=x[:90], y_train=y[:90], x_test=x[90:], y_test=y[90:])
    (root / "loss_a.py").write_text(LOSS.format(scale=1.0))
    config = {"name": "hostile", "seed": 0, "out": "results",
              "data": {"dataset": "blobs.npz", "random_label_ratio": [0.0, 0.5]},
              "model": {"name": "mlp", "widths": [8]},
              "train": {"epochs": 1, "batch_size": 32, "lr": 0.01},
              "measure": {"measures": ["frobenius_norm", "hessian_trace"], "losses": ["ce", "loss_a.py:scaled"],
                          "timeout_s": 120},
              "report": {"min_train_acc": 0.0}}
    (root / "hostile.yaml").write_text(yaml.safe_dump(config))
    cli_ok(run_cli("train", "hostile.yaml", "--quiet", cwd=root))
    cli_ok(run_cli("measure", "hostile.yaml", "--quiet", cwd=root))
    return root


def _entries(root):
    run = sorted((root / "results" / "hostile" / "runs").iterdir())[0]
    return json.loads((run / "measures.json").read_text())


def _plugin(root, name, body):
    path = root / f"{name}.py"
    path.write_text("import os, threading, time\nfrom flatbench import register_measure\n\n"
                    f"@register_measure('{name}', description='hostile (tests)')\ndef {name}(ctx):\n{body}")
    return path


def _measure(root, plugin, name, timeout=120, workers=()):
    start = time.monotonic()
    result = run_cli("measure", "hostile.yaml", "--plugin", str(plugin), "--measures", f"{name},frobenius_norm",
                     "measure.timeout_s=2", "--force", *workers,
                     cwd=root, timeout=timeout)
    return result, time.monotonic() - start


def test_an_edited_loss_file_makes_its_entries_stale_and_measure_recomputes_them(study):
    key = "hessian_trace@scaled"
    first = _entries(study)
    assert first[key]["status"] == "ok" and first[key]["loss_source"]["sha256"]
    (study / "loss_a.py").write_text(LOSS.format(scale=2.0))
    state = json.loads(cli_ok(run_cli("status", "results/hostile", "--json", cwd=study)))
    assert state["stale_entries"] >= 1, state
    cli_ok(run_cli("measure", "hostile.yaml", "--measures", "hessian_trace", cwd=study))
    again = _entries(study)
    assert again[key]["values"][key] == pytest.approx(2 * first[key]["values"][key], rel=1e-9)
    assert again["hessian_trace"]["values"] == first["hessian_trace"]["values"]


def test_two_loss_files_whose_functions_share_a_name_are_refused(study):
    (study / "loss_b.py").write_text(LOSS.format(scale=3.0))
    cli_one_line_error(run_cli("measure", "hostile.yaml", "measure.losses=[ce,loss_a.py:scaled,loss_b.py:scaled]",
                               cwd=study), "loss_a.py:scaled", "loss_b.py:scaled")


WORKERS = pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["alone", "workers"])


@WORKERS
def test_a_non_daemon_thread_left_by_a_plugin_does_not_keep_the_command_alive(study, workers):
    plugin = _plugin(study, "_lingerer", "    def spin():\n        while True:\n            try:\n"
                     "                time.sleep(0.05)\n            except BaseException:\n                pass\n"
                     "    threading.Thread(target=spin, daemon=False).start()\n    return 1.0\n")
    result, took = _measure(study, plugin, "_lingerer", timeout=90, workers=workers)
    assert result.returncode == 1, result.stderr
    assert "_lingerer" in result.stderr and "thread" in result.stderr
    assert _entries(study)["_lingerer"]["status"] == "error"


def test_os_exit_in_a_plugin_is_a_failed_entry_never_exit_0(study):
    plugin = _plugin(study, "_quitter", "    os._exit(0)\n")
    result, _ = _measure(study, plugin, "_quitter")
    assert result.returncode == 1, result.stdout + result.stderr
    entries = _entries(study)
    assert entries["_quitter"]["status"] == "error" and entries["frobenius_norm"]["status"] == "ok"


@WORKERS
def test_a_plugin_that_swallows_every_exception_past_its_limit_ends_the_command_with_exit_2(study, workers):
    plugin = _plugin(study, "_immortal", "    while True:\n        try:\n            time.sleep(0.05)\n"
                     "        except BaseException:\n            pass\n")
    result, took = _measure(study, plugin, "_immortal", timeout=45, workers=workers)
    assert result.returncode == 2 and took < 40, (took, result.stderr)
    assert "_immortal" in result.stderr and "ignored its time limit" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_check_measure_limits_a_plugin_that_sleeps(study):
    plugin = _plugin(study, "_sleepy", "    time.sleep(600)\n    return 1.0\n")
    start = time.monotonic()
    result = run_cli("check-measure", "_sleepy", "--plugin", str(plugin), "--cases", "mlp", "--families", "layer",
                     "--timeout-s", "0.5", cwd=study, timeout=120)
    assert result.returncode == 1 and time.monotonic() - start < 90, result.stdout + result.stderr
    assert "timed out after 0.5 s" in result.stdout
