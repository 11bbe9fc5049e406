"""The real CLI: an end-to-end tiny study, run identity, re-runs, stale runs and readable output.

Every bad input has its own test in tests/test_cli_errors.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
import pytest
import yaml

from conftest import TINY, in_process, run_cli
from flatbench.config import load_study, parse_study

RUN_IDS = sorted(parse_study(TINY).run_ids())


@pytest.fixture(scope="module")
def finished_study(tmp_path_factory):
    """One tiny study run end to end through `flatbench run` (shared by the tests below; copy it to
    change it)."""
    root = tmp_path_factory.mktemp("e2e")
    cfg = root / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    result = run_cli("run", str(cfg), "--out", str(root / "out"), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    return cfg, root / "out" / "tiny", result


def _copy(finished_study, tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the finished study: (its config pointing at the copy's root, the experiment)."""
    cfg, exp, _ = finished_study
    exp_copy = tmp_path / "out" / "tiny"
    shutil.copytree(exp, exp_copy)
    return cfg, exp_copy


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- end to end


def test_run_writes_every_file_and_column(finished_study):
    _cfg, exp, result = finished_study
    for rid in RUN_IDS:
        run = exp / "runs" / rid
        assert (run / "run.json").is_file() and (run / "model.pt").is_file()
        assert (run / "measures.json").is_file()
        info = json.loads((run / "run.json").read_text())
        assert info["model_sha256"] == _sha(run / "model.pt")
    for name in ("table.csv", "correlations.csv", "report.md", "study.yaml"):
        assert (exp / name).is_file(), name
    assert (exp / "plots").is_dir() and list((exp / "plots").glob("*.png"))
    table = pd.read_csv(exp / "table.csv")
    assert sorted(table["run_id"]) == RUN_IDS
    for column in ("data.random_label_ratio", "model.widths", "train_acc", "test_acc", "train_loss", "test_loss",
                   "gap_acc", "frobenius_norm", "spectral_norm", "path_norm"):
        assert column in table.columns, column
    corr = pd.read_csv(exp / "correlations.csv")
    assert {"measure", "kendall_tau", "spearman_rho", "pearson_r", "n"} <= set(corr.columns)
    assert "frobenius_norm" in result.stdout


def test_training_output_ends_each_run_with_its_accuracies_and_gap(finished_study):
    _cfg, exp, result = finished_study
    for rid in RUN_IDS:
        info = json.loads((exp / "runs" / rid / "run.json").read_text())
        line = next(l for l in result.stdout.splitlines() if l.startswith(f"{rid}: train acc"))
        assert f"test acc {info['test_acc']:.4g}" in line and f"gap {info['gap_acc']:.4g}" in line


def test_values_are_printed_with_four_significant_digits(finished_study):
    _cfg, exp, result = finished_study
    entries = json.loads((exp / "runs" / RUN_IDS[0] / "measures.json").read_text())
    value = entries["frobenius_norm"]["values"]["frobenius_norm"]
    line = next(l for l in result.stdout.splitlines() if RUN_IDS[0] in l and "frobenius_norm" in l)
    assert f"{value:.4g}" in line.split() and repr(value) not in line


def test_redirected_output_has_no_progress_bars(finished_study):
    _cfg, _exp, result = finished_study
    assert "\r" not in result.stdout and "\r" not in result.stderr
    assert "it/s" not in result.stderr and "ep/s" not in result.stderr


def test_rerun_skips_finished_runs_and_measures(finished_study, tmp_path):
    cfg, exp = _copy(finished_study, tmp_path)
    run = exp / "runs" / RUN_IDS[0]
    before = ((run / "model.pt").stat().st_mtime_ns, (run / "measures.json").read_text())
    again = run_cli("run", str(cfg), "--out", str(exp.parent), "--device", "cpu", "--quiet")
    assert again.returncode == 0, again.stderr
    assert ((run / "model.pt").stat().st_mtime_ns, (run / "measures.json").read_text()) == before


def test_measure_force_recomputes_only_the_chosen_measure(finished_study, tmp_path):
    _cfg, exp = _copy(finished_study, tmp_path)
    path = exp / "runs" / RUN_IDS[0] / "measures.json"
    before = json.loads(path.read_text())
    result = run_cli("measure", str(exp), "--measures", "frobenius_norm", "--force", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "measured 3 models" in result.stdout
    after = json.loads(path.read_text())
    assert after["frobenius_norm"]["values"] == before["frobenius_norm"]["values"]  # deterministic
    assert after["spectral_norm"] == before["spectral_norm"]  # not recomputed: byte-for-byte the same entry


def test_changed_measure_settings_recompute_the_entry(finished_study, tmp_path):
    """An entry computed with other settings is not mixed into a study that asks for new ones."""
    _cfg, exp = _copy(finished_study, tmp_path)
    result = run_cli("measure", str(exp), "measure.settings={spectral_norm: {iters: 7}}", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    entry = json.loads((exp / "runs" / RUN_IDS[0] / "measures.json").read_text())["spectral_norm"]
    assert entry["settings"]["iters"] == 7
    assert entry["context"] == {"n_examples": 200, "dtype": "float64", "normalized_ce_tau": 1.0}


# ---------------------------------------------------------------- run identity


def test_growing_a_study_keeps_its_finished_runs(finished_study, tmp_path):
    cfg, exp = _copy(finished_study, tmp_path)
    before = {rid: _sha(exp / "runs" / rid / "model.pt") for rid in RUN_IDS}
    grown = run_cli("train", str(cfg), "--out", str(exp.parent), "--device", "cpu", "--quiet",
                    "model.widths=[[32], [16]]")
    assert grown.returncode == 0, grown.stderr
    assert "3 trained, 3 already finished" in grown.stdout
    for rid, sha in before.items():
        assert _sha(exp / "runs" / rid / "model.pt") == sha
    assert len(list((exp / "runs").iterdir())) == 6


def test_another_lr_is_other_runs_and_the_old_ones_are_not_in_the_study(finished_study, tmp_path):
    cfg, exp = _copy(finished_study, tmp_path)
    result = run_cli("run", str(cfg), "--out", str(exp.parent), "--device", "cpu", "--quiet", "train.lr=0.01")
    assert result.returncode == 0, result.stderr
    new_ids = sorted(load_study(cfg, ["train.lr=0.01"]).run_ids())
    assert not set(new_ids) & set(RUN_IDS)
    table = pd.read_csv(exp / "table.csv")
    assert sorted(table["run_id"]) == new_ids
    assert (table["train.lr"] == 0.01).all()
    report = (exp / "report.md").read_text()
    for rid in RUN_IDS:
        assert re.search(rf"`{rid}`.*not in this study", report), rid
    status = in_process("status", str(exp))
    assert "3 run folder(s) not in this study" in status.stdout
    both = in_process("report", str(exp), "--include-stale", "--quiet")
    assert both.returncode == 0, both.stderr
    assert sorted(pd.read_csv(exp / "table.csv")["run_id"]) == sorted(new_ids + RUN_IDS)


def test_hand_edited_run_json_is_refused_naming_the_keys(finished_study, tmp_path):
    cfg, exp = _copy(finished_study, tmp_path)
    path = exp / "runs" / RUN_IDS[1] / "run.json"
    info = json.loads(path.read_text())
    info["config"]["train"]["lr"] = 0.5
    path.write_text(json.dumps(info))
    result = in_process("train", str(cfg), "--out", str(exp.parent), "--device", "cpu")
    assert result.returncode == 2
    assert "train.lr: stored 0.5, expected 0.003" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    measured = in_process("measure", str(exp), "--force", "--device", "cpu", "--quiet")
    assert measured.returncode == 2 and f"{RUN_IDS[1]}/run.json describes run" in measured.stderr


def test_replaced_model_file_is_detected(finished_study, tmp_path):
    cfg, exp = _copy(finished_study, tmp_path)
    a, b = (exp / "runs" / rid / "model.pt" for rid in RUN_IDS[:2])
    shutil.copyfile(b, a)  # a valid model file, but not the one this run wrote
    measured = run_cli("measure", str(exp), "--force", "--device", "cpu", "--quiet")
    assert measured.returncode == 2 and "sha256 differs" in measured.stderr
    other = json.loads((exp / "runs" / RUN_IDS[1] / "measures.json").read_text())
    assert all(e["status"] == "ok" for e in other.values())  # the other run was measured
    status = in_process("status", str(exp))
    assert re.search(r"1\s+damaged", status.stdout) and "sha256 differs" in status.stdout
    trained = in_process("train", str(cfg), "--out", str(exp.parent), "--device", "cpu")
    assert trained.returncode == 2 and "sha256 differs" in trained.stderr


# ---------------------------------------------------------------- output a person reads


def test_help_does_not_import_torch():
    """`flatbench --help` must be instant: the CLI module imports neither torch nor the stages."""
    code = "import sys, flatbench.cli; print(sorted(m for m in ('torch', 'pandas', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_bare_flatbench_shows_help_and_exits_0():
    result = run_cli()
    assert result.returncode == 0 and "Usage:" in result.stdout and "run" in result.stdout
    assert result.stderr == ""


def test_list_measures_columns_stay_aligned():
    result = run_cli("list-measures")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    header = lines[0]
    starts = [header.index(col) for col in ("invariant to", "cost", "dtype", "description")]
    for line in lines[1:]:
        for start in starts:
            assert line[start - 2:start] == "  " and line[start] != " ", line
    for name in ("frobenius_norm", "spectral_norm", "path_norm", "normalized_sharpness"):
        assert any(l.startswith(name + " ") for l in lines)


def test_the_quickstart_page_shows_the_real_config():
    root = Path(__file__).resolve().parents[1]
    readme = (root / "docs" / "getting-started" / "quickstart.md").read_text()
    config = (root / "configs" / "quickstart.yaml").read_text()
    match = re.search(r"<!-- configs/quickstart\.yaml -->\n```yaml\n(.*?)```", readme, re.S)
    assert match, "the quickstart page must show configs/quickstart.yaml in a ```yaml block after its marker"
    assert match.group(1) == config


# ---------------------------------------------------------------- training endpoint


def test_loss_target_snapshots_and_the_verdict_by_level(write_config, tmp_path):
    """Runs stop at a common train loss, keep snapshots on the way, and the report gives each measure's τ
    at every level with its figure; a study whose runs end far apart in loss is warned about."""
    cfg = write_config({"train": {"epochs": 60, "batch_size": 64, "lr": 0.003, "target_train_loss": 0.2,
                                  "snapshot_losses": [1.0, 0.5]},
                        "measure": {"measures": ["frobenius_norm", "hessian_trace"], "n_examples": 100},
                        "report": {"min_train_acc": 0.0, "max_train_loss": 0.5}})
    result = run_cli("run", str(cfg), "--out", str(tmp_path / "o"), "--device", "cpu", "--quiet")
    assert result.returncode == 0, result.stderr
    exp = tmp_path / "o" / "tiny"
    table = pd.read_csv(exp / "table.csv")
    assert (table["train_loss"] <= 0.2).all() and table["reached_target"].all()
    levels = pd.read_csv(exp / "correlations_by_level.csv")
    assert list(dict.fromkeys(levels["level"])) == ["1.0", "0.5", "final"]
    assert set(levels["measure"]) == {"frobenius_norm", "hessian_trace"}
    for rid in parse_study(yaml.safe_load(cfg.read_text())).run_ids():
        for level in ("1", "0.5"):
            snap = exp / "runs" / rid / "snapshots" / f"loss_{level}"
            entries = json.loads((snap / "measures.json").read_text())
            assert entries["hessian_trace"]["status"] == "ok"
    frob_final = levels[(levels["level"] == "final") & (levels["measure"] == "frobenius_norm")]
    corr = pd.read_csv(exp / "correlations.csv").set_index("measure")
    assert frob_final["kendall_tau"].iloc[0] == pytest.approx(corr.loc["frobenius_norm", "kendall_tau"])
    assert (exp / "plots" / "tau_by_level.png").is_file() and (exp / "plots" / "training_curves.png").is_file()
    report = (exp / "report.md").read_text()
    assert "## Verdict by training-loss level" in report and "## Training endpoint" in report
    assert "WARNING" not in result.stdout  # every run ended at loss <= 0.2, within 10x of each other
    # the same runs judged against a lower loss bar: warned, not hidden
    from flatbench.analysis.report import write_report
    from flatbench.config import ReportConfig

    summary = write_report([exp], tmp_path / "r", ReportConfig(min_train_acc=0.0, max_train_loss=1e-3), n_boot=10,
                           echo=lambda _m: None)
    assert any("ended above train loss 0.001" in w for w in summary.warnings)


# ---------------------------------------------------------------- several runs at once (--workers)


def _weights(run: Path) -> dict:
    from flatbench.models import load_model

    return {k: v.clone() for k, v in load_model(run).state_dict().items()}


def test_workers_give_the_files_of_runs_trained_and_measured_alone(write_config, tmp_path):
    """--workers 2: two runs at a time in worker processes, one CPU thread each; every run's weights and
    measures equal those of the same run trained and measured alone with one thread."""
    cfg = write_config({"measure": {"measures": ["frobenius_norm", "hessian_trace", "fisher_rao_norm"],
                                    "n_examples": 100}})
    alone = run_cli("run", str(cfg), "--out", str(tmp_path / "alone"), "--device", "cpu", "--quiet",
                    env={"OMP_NUM_THREADS": "1"})
    assert alone.returncode == 0, alone.stderr
    pooled = run_cli("run", str(cfg), "--out", str(tmp_path / "pooled"), "--device", "cpu", "--workers", "2",
                     env={"OMP_NUM_THREADS": "2"})
    assert pooled.returncode == 0, pooled.stderr
    assert "in 2 worker processes" in pooled.stdout
    for rid in RUN_IDS:
        a, b = (tmp_path / where / "tiny" / "runs" / rid for where in ("alone", "pooled"))
        wa, wb = _weights(a), _weights(b)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), rid
        ma, mb = (json.loads((p / "measures.json").read_text()) for p in (a, b))
        assert {k: e["values"] for k, e in ma.items()} == {k: e["values"] for k, e in mb.items()}
    assert json.loads((tmp_path / "pooled" / "tiny" / "runs" / RUN_IDS[0] / "run.json").read_text())["config"][
        "train"]["workers"] == 2


def test_a_stop_signal_reaches_every_worker(write_config, tmp_path):
    """SIGTERM to `flatbench train --workers 2` (what Slurm sends before a preemption): the workers
    checkpoint and stop, the command exits 143, and the same command resumes to the end."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cfg = write_config({"data": {"n_train": 2000, "random_label_ratio": [0.0, 1.0]}, "model": {"widths": [128]},
                        "train": {"epochs": 30, "batch_size": 32}})
    ids = parse_study(yaml.safe_load(cfg.read_text())).run_ids()
    runs = tmp_path / "o" / "tiny" / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "flatbench", "train", str(cfg), "--out", str(tmp_path / "o"),
                             "--device", "cpu", "--workers", "2", "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "MPLBACKEND": "Agg"})
    deadline = time.time() + 180
    while time.time() < deadline and not all((runs / rid / "checkpoint.pt").exists() for rid in ids):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, err
    states = {rid: json.loads((runs / rid / "run.json").read_text())["status"] for rid in ids}
    assert set(states.values()) == {"preempted"}, states
    resumed = run_cli("train", str(cfg), "--out", str(tmp_path / "o"), "--device", "cpu", "--workers", "2",
                      "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert all(json.loads((runs / rid / "run.json").read_text())["status"] == "finished" for rid in ids)
