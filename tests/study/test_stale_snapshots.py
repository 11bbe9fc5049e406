"""A stale plugin entry (its plugin file edited since it was computed) is left out of the report at every
snapshot level too, not only for the final models."""

from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest

from tests.analysis.test_report import write_experiment


def _with_real_ids(exp):
    """Name each synthetic run folder by the run id of the config its run.json holds (the report refuses a
    folder whose run.json describes another run: `study.validity`)."""
    from flatbench.config import run_config_from_dict

    for run in sorted((exp / "runs").iterdir()):
        info = json.loads((run / "run.json").read_text())
        info["run_id"] = run_config_from_dict(info["config"]).run_id()
        (run / "run.json").write_text(json.dumps(info))
        run.rename(run.with_name(info["run_id"]))
    return exp


def _with_snapshots(exp, plugin, sha):
    """Give every run of `exp` a snapshot at train loss 0.5 whose measures.json holds `tracks` (copied from
    the final model's) and the plugin measure `versioned` recorded with plugin hash `sha`."""
    for run in sorted((exp / "runs").iterdir()):
        info = json.loads((run / "run.json").read_text())
        final = json.loads((run / "measures.json").read_text())
        folder = run / "snapshots" / "loss0.5"
        folder.mkdir(parents=True)
        entry = {"status": "ok", "values": {"versioned": final["tracks"]["values"]["tracks"]},
                 "larger_is_sharper": True, "plugin": {"source": str(plugin), "sha256": sha}}
        (folder / "measures.json").write_text(json.dumps({"tracks": final["tracks"], "versioned": entry}))
        info["snapshots"] = [{"level": 0.5, "path": "snapshots/loss0.5", "epoch": 5, "train_acc": 0.9,
                              "train_loss": 0.5, "test_acc": info["test_acc"], "test_loss": info["test_loss"],
                              "gap_acc": info["gap_acc"], "gap_loss": info["gap_loss"]}]
        (run / "run.json").write_text(json.dumps(info))


@pytest.mark.parametrize("edited", [False, True])
def test_a_stale_plugin_entry_is_left_out_at_every_snapshot_level(tmp_path, edited):
    from flatbench.study.report import report_study

    plugin = tmp_path / "versioned.py"
    plugin.write_text("VERSION = 1\n")
    recorded = hashlib.sha256(plugin.read_bytes()).hexdigest()
    exp = _with_real_ids(write_experiment(tmp_path, "exp"))
    _with_snapshots(exp, plugin, recorded)
    if edited:
        plugin.write_text("VERSION = 2\n")  # every recorded entry is now of the old file
    lines = []
    report_study([exp], include_stale=True, statistics_only=True, echo=lines.append)  # the synthetic runs are no study's
    by_level = pd.read_csv(exp / "correlations_by_level.csv")
    at_snapshot = set(by_level.loc[by_level["level"].astype(str) != "final", "measure"])
    assert "tracks" in at_snapshot
    assert ("versioned" in at_snapshot) is not edited, at_snapshot
    assert any("left out: stale" in line for line in lines) is edited, lines
