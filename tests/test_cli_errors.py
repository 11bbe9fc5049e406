"""Every bad input through the real CLI: one line on stderr, exit code 2, nothing finished lost.

Each case says what it does, what the one line must contain, and (where something was there before) that
it is still there afterwards. `scripts/bad_inputs.py` prints the same catalogue as a table (exit code and
stderr line count per case) for the README.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import TINY, run_cli
from flatbench.config import parse_study

RUN_IDS = sorted(parse_study(TINY).run_ids())


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A finished tiny study with its report (never modified: tests copy it)."""
    root = tmp_path_factory.mktemp("bad")
    cfg = root / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    result = run_cli("run", str(cfg), "--out", str(root / "out"), "--device", "cpu", "--quiet")
    assert result.returncode == 0, result.stderr
    return cfg, root / "out" / "tiny"


@pytest.fixture
def copy(study, tmp_path):
    cfg, exp = study
    target = tmp_path / "out" / "tiny"
    shutil.copytree(exp, target)
    return cfg, target


def one_line_error(result: subprocess.CompletedProcess, fragment: str, code: int = 2) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, (result.returncode, result.stdout[-500:], result.stderr)
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def snapshot(exp: Path) -> dict[str, bytes]:
    """Every file of an experiment folder, to check that a refused command changed nothing."""
    return {str(p.relative_to(exp)): p.read_bytes() for p in sorted(exp.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- the output place


@pytest.mark.parametrize("command", ["run", "train", "measure"])
def test_out_pointing_at_a_file(study, tmp_path, command):
    cfg, _ = study
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    result = run_cli(command, str(cfg), "--out", str(afile), "--device", "cpu")
    one_line_error(result, "afile" if command == "measure" else "lies under the file")
    assert afile.read_text() == "keep me"


def test_out_under_a_file(study, tmp_path):
    cfg, _ = study
    (tmp_path / "afile").write_text("x")
    one_line_error(run_cli("train", str(cfg), "--out", str(tmp_path / "afile" / "sub")), "lies under the file")


def test_report_out_at_a_file_keeps_the_report(copy, tmp_path):
    _cfg, exp = copy
    before = snapshot(exp)
    (tmp_path / "afile").write_text("x")
    one_line_error(run_cli("report", str(exp), "--out", str(tmp_path / "afile")), "is a file")
    assert snapshot(exp) == before


def test_report_out_unwritable(copy):
    _cfg, exp = copy
    one_line_error(run_cli("report", str(exp), "--out", "/proc/flatbench-report"), "cannot write to the report folder")


def test_audit_checks_its_out_before_computing(copy, tmp_path):
    _cfg, exp = copy
    (tmp_path / "afile").write_text("x")
    one_line_error(run_cli("audit", str(exp), "--population", "--out", str(tmp_path / "afile")), "is a file")
    assert not (exp / "audit_correlations.csv").exists()


# ---------------------------------------------------------------- configs


def test_empty_config_file(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    one_line_error(run_cli("train", str(empty), "--out", str(tmp_path / "o")), "is empty")
    assert not (tmp_path / "o").exists()


def test_missing_config_file(tmp_path):
    one_line_error(run_cli("train", str(tmp_path / "none.yaml")), "config file not found")


def test_invalid_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {dataset: mnist_mini\n")
    one_line_error(run_cli("train", str(bad)), "invalid YAML")


@pytest.mark.parametrize("changes, fragment", [
    ({"trian": {"epochs": 1}}, "unknown key 'trian' (did you mean 'train'?)"),
    ({"train": {"epoch": 1}}, "did you mean 'epochs'?"),
    ({"train": {"epochs": "three"}}, "expected an integer"),
    ({"data": {"random_label_ratio": 2}}, "must be in [0, 1]"),
    ({"model": {"name": "mpl"}}, "unknown model 'mpl' (did you mean 'mlp'?)"),
    ({"data": {"dataset": "mnsit"}}, "unknown dataset 'mnsit' (did you mean 'mnist'?)"),
    ({"measure": {"measures": ["hesian_trace"]}}, "unknown measure 'hesian_trace' (did you mean 'hessian_trace'?)"),
    ({"measure": {"settings": {"eps_sharpness": {"eps_sharpnes": 1}}}}, "unknown setting 'eps_sharpnes'"),
    ({"measure": {"settings": {"pacbayes_flatness": {"probez": 3}}}}, "unknown setting 'probez'"),
    ({"measure": {"settings": {"eps_sharpness": {"epz": 3}}}}, "unknown setting 'epz' for measure 'eps_sharpness' "
                                                                "(did you mean 'eps'?)"),
    ({"measure": {"losses": ["nce"]}}, "unknown loss 'nce'"),
    ({"train": {"target_train_loss": -1}}, "train.target_train_loss must be positive"),
])
def test_bad_config_stops_every_command_before_any_work(write_config, tmp_path, changes, fragment):
    cfg = write_config(changes)
    for command in ("train", "run"):
        one_line_error(run_cli(command, str(cfg), "--out", str(tmp_path / "o"), "--device", "cpu"), fragment)
    assert not (tmp_path / "o").exists(), "a refused config must not create anything"


def test_settings_typo_stops_train_of_a_finished_study(copy):
    """`train` validates the measure section too: a typo is found before (not after) all the training."""
    cfg, exp = copy
    before = snapshot(exp)
    result = run_cli("train", str(cfg), "--out", str(exp.parent), "measure.settings={eps_sharpness: {eps_sharpnes: 1}}")
    one_line_error(result, "unknown setting 'eps_sharpnes' for measure 'eps_sharpness' (valid: eps, iters)")
    assert snapshot(exp) == before


@pytest.mark.parametrize("args, fragment", [
    (["train.epochs"], "not of the form key=value"),
    (["bogus.x=1"], "unknown key 'bogus'"),
    (["train.lrr=0.1"], "did you mean 'lr'?"),
    (["--shard", "3/2"], "need 0 ≤ I < N"),
    (["--shard", "x"], "--shard must look like I/N"),
    (["--device", "cuda"], "no CUDA device"),
])
def test_bad_command_line(study, tmp_path, args, fragment):
    cfg, _ = study
    if args == ["--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    one_line_error(run_cli("train", str(cfg), "--out", str(tmp_path / "o"), *args), fragment)


def test_unknown_measure_on_the_command_line(study):
    _cfg, exp = study
    one_line_error(run_cli("measure", str(exp), "--measures", "frobenius"), "did you mean 'frobenius_norm'?")


def test_unknown_variant(study):
    _cfg, exp = study
    one_line_error(run_cli("measure", str(exp), "--measures", "frobenius_norm:published"), "has no variant")


# ---------------------------------------------------------------- report settings


def test_report_min_train_acc_out_of_range_keeps_the_report(copy):
    _cfg, exp = copy
    before = snapshot(exp)
    one_line_error(run_cli("report", str(exp), "--min-train-acc", "2"), "must be a train accuracy in [0, 1]")
    assert snapshot(exp) == before


def test_report_excluding_every_run_keeps_the_good_report(copy):
    _cfg, exp = copy
    before = snapshot(exp)
    one_line_error(run_cli("report", str(exp), "--min-train-acc", "1"), "a report needs at least")
    assert snapshot(exp) == before


# ---------------------------------------------------------------- damaged files


def test_truncated_measures_json_report_refuses_and_names_it(copy):
    _cfg, exp = copy
    path = exp / "runs" / RUN_IDS[0] / "measures.json"
    path.write_text(path.read_text()[:-40])
    before = snapshot(exp)
    one_line_error(run_cli("report", str(exp)), f"{RUN_IDS[0]}/measures.json is damaged")
    assert snapshot(exp) == before
    status = run_cli("status", str(exp))
    assert status.returncode == 0 and f"{RUN_IDS[0]}/measures.json is damaged" in status.stdout


def test_truncated_measures_json_measure_keeps_readable_entries(copy):
    _cfg, exp = copy
    path = exp / "runs" / RUN_IDS[0] / "measures.json"
    entries = json.loads(path.read_text())
    kept = json.dumps({k: entries[k] for k in list(entries)[:2]}, indent=2)
    path.write_text(kept[:-2] + ',\n  "path_norm": {"status": "ok", "val')  # the third entry cut off
    result = run_cli("measure", str(exp), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert f"{RUN_IDS[0]}/measures.json was damaged" in result.stdout and "kept its 2 readable entries" in result.stdout
    repaired = json.loads(path.read_text())
    for key in list(entries)[:2]:
        assert repaired[key] == entries[key]  # kept, not recomputed
    assert repaired["path_norm"]["values"] == entries["path_norm"]["values"]  # recomputed
    assert (path.parent / "measures.json.damaged").is_file()
    assert run_cli("report", str(exp), "--quiet").returncode == 0


def test_corrupt_model_file_measure_goes_on_and_exits_non_zero(copy):
    _cfg, exp = copy
    model = exp / "runs" / RUN_IDS[0] / "model.pt"
    kept = json.loads((exp / "runs" / RUN_IDS[0] / "measures.json").read_text())["frobenius_norm"]
    model.write_bytes(b"not a checkpoint")
    result = run_cli("measure", str(exp), "--force", "--measures", "frobenius_norm,fisher_rao_norm", "--device", "cpu")
    one_line_error(result, "could not be measured")
    assert model.read_bytes() == b"not a checkpoint"
    other = json.loads((exp / "runs" / RUN_IDS[1] / "measures.json").read_text())
    assert other["frobenius_norm"]["status"] == "ok" and other["fisher_rao_norm"]["status"] == "ok"
    failed = json.loads((exp / "runs" / RUN_IDS[0] / "measures.json").read_text())
    assert failed["frobenius_norm"] == kept  # computed before the damage: kept, not replaced by an error
    assert failed["fisher_rao_norm"]["status"] == "error" and "could not be loaded" in failed["fisher_rao_norm"]["error"]
    status = run_cli("status", str(exp), "--json")
    state = json.loads(status.stdout)
    assert state["runs"][RUN_IDS[0]]["state"] == "damaged" and state["counts"]["finished"] == len(RUN_IDS) - 1


def test_corrupt_training_checkpoint(write_config, tmp_path):
    cfg = write_config({"data": {"random_label_ratio": 0.0}})
    from flatbench.config import load_study
    from flatbench.store import atomic_write_json

    rid, run_cfg = load_study(cfg).runs[0]
    run = tmp_path / "o" / "tiny" / "runs" / rid
    run.mkdir(parents=True)
    atomic_write_json(run / "run.json", {"run_id": rid, "status": "running", "config": run_cfg.to_dict(),
                                         "config_hash": run_cfg.config_hash()})
    (run / "checkpoint.pt").write_bytes(b"\x00garbage")
    one_line_error(run_cli("train", str(cfg), "--out", str(tmp_path / "o"), "--device", "cpu"),
                   "checkpoint.pt is corrupt")
    assert (run / "checkpoint.pt").read_bytes() == b"\x00garbage"


# ---------------------------------------------------------------- data, folders, interruption


def test_missing_dataset_creates_nothing(write_config, tmp_path):
    cfg = write_config({"data": {"dataset": "mnist", "download": False}})
    empty = tmp_path / "nodata"
    empty.mkdir()
    result = run_cli("train", str(cfg), "--out", str(tmp_path / "o"), env={"FLATBENCH_DATA": str(empty)})
    one_line_error(result, "dataset 'mnist' not found")
    assert "training" not in result.stdout
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["status", "report", "audit", "measure"])
def test_missing_experiment_folder(command, tmp_path):
    missing = str(tmp_path / "missing")
    fragment = "does not exist" if command != "measure" else "config file not found"
    one_line_error(run_cli(command, missing), fragment)


def test_folder_that_is_not_an_experiment(tmp_path):
    one_line_error(run_cli("report", str(tmp_path)), "not a flatbench experiment folder")
    one_line_error(run_cli("status", str(tmp_path)), "not a flatbench experiment folder")


def test_audit_of_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    one_line_error(run_cli("audit", str(tmp_path / "afile")), "is a file")


def _default_sigint() -> None:
    """The child gets SIGINT's default disposition: a suite started in the background by a shell without job
    control inherits SIGINT ignored, and so would the child (Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_marks_the_run_interrupted_and_says_so(write_config, tmp_path):
    # Far more epochs than the test lets it train (the signal comes after the first checkpoint): on a busy
    # machine a 40-epoch run could finish before the signal arrived, and the test then saw exit 0.
    cfg = write_config({"data": {"n_train": 3000, "random_label_ratio": 0.5}, "model": {"widths": [256, 256]},
                        "train": {"epochs": 2000, "batch_size": 32}})
    rid = parse_study(yaml.safe_load(cfg.read_text())).run_ids()[0]
    run = tmp_path / "o" / "tiny" / "runs" / rid
    proc = subprocess.Popen([sys.executable, "-m", "flatbench", "train", str(cfg), "--out", str(tmp_path / "o"),
                             "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MPLBACKEND": "Agg"}, preexec_fn=_default_sigint)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "checkpoint.pt").exists():
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["interrupted: finished runs and the last checkpoints are kept; the same command resumes"]
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "interrupted" and (run / "checkpoint.pt").exists()
