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

from conftest import TINY, in_process, run_cli
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
    run = run_cli if command == "run" else in_process  # one through a subprocess
    result = run(command, str(cfg), "--out", str(afile), "--device", "cpu")
    one_line_error(result, "afile" if command == "measure" else "lies under the file")
    assert afile.read_text() == "keep me"


def test_out_under_a_file(study, tmp_path):
    cfg, _ = study
    (tmp_path / "afile").write_text("x")
    one_line_error(in_process("train", str(cfg), "--out", str(tmp_path / "afile" / "sub")), "lies under the file")


def test_report_out_at_a_file_keeps_the_report(copy, tmp_path):
    _cfg, exp = copy
    before = snapshot(exp)
    (tmp_path / "afile").write_text("x")
    one_line_error(in_process("report", str(exp), "--out", str(tmp_path / "afile")), "is a file")
    assert snapshot(exp) == before


def test_report_out_unwritable(copy):
    _cfg, exp = copy
    one_line_error(in_process("report", str(exp), "--out", "/proc/flatbench-report"), "cannot write to the report folder")


def test_audit_checks_its_out_before_computing(copy, tmp_path):
    _cfg, exp = copy
    (tmp_path / "afile").write_text("x")
    one_line_error(in_process("audit", str(exp), "--population", "--out", str(tmp_path / "afile")), "is a file")
    assert not (exp / "audit_correlations.csv").exists()


# ---------------------------------------------------------------- configs


def test_empty_config_file(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    one_line_error(run_cli("train", str(empty), "--out", str(tmp_path / "o")), "is empty")
    assert not (tmp_path / "o").exists()


def test_missing_config_file(tmp_path):
    one_line_error(in_process("train", str(tmp_path / "none.yaml")), "config file not found")


def test_invalid_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {dataset: mnist_mini\n")
    one_line_error(in_process("train", str(bad)), "invalid YAML")


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
    run = run_cli if "trian" in changes else in_process  # the first case through a subprocess, as a user runs it
    for command in ("train", "run"):
        one_line_error(run(command, str(cfg), "--out", str(tmp_path / "o"), "--device", "cpu"), fragment)
    assert not (tmp_path / "o").exists(), "a refused config must not create anything"


def test_settings_typo_stops_train_of_a_finished_study(copy):
    """`train` validates the measure section too: a typo is found before (not after) all the training."""
    cfg, exp = copy
    before = snapshot(exp)
    result = in_process("train", str(cfg), "--out", str(exp.parent), "measure.settings={eps_sharpness: {eps_sharpnes: 1}}")
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
    run = run_cli if args == ["--device", "cuda"] else in_process  # one through a subprocess
    one_line_error(run("train", str(cfg), "--out", str(tmp_path / "o"), *args), fragment)


def test_unknown_measure_on_the_command_line(study):
    _cfg, exp = study
    one_line_error(in_process("measure", str(exp), "--measures", "frobenius"), "did you mean 'frobenius_norm'?")


def test_unknown_variant(study):
    _cfg, exp = study
    one_line_error(in_process("measure", str(exp), "--measures", "frobenius_norm:published"), "has no variant")


# ---------------------------------------------------------------- report settings


def test_report_min_train_acc_out_of_range_keeps_the_report(copy):
    _cfg, exp = copy
    before = snapshot(exp)
    one_line_error(in_process("report", str(exp), "--min-train-acc", "2"), "must be a train accuracy in [0, 1]")
    assert snapshot(exp) == before


def test_report_excluding_every_run_keeps_the_good_report(copy):
    _cfg, exp = copy
    before = snapshot(exp)
    one_line_error(in_process("report", str(exp), "--min-train-acc", "1"), "a report needs at least")
    assert snapshot(exp) == before


# ---------------------------------------------------------------- damaged files


def test_truncated_measures_json_report_refuses_and_names_it(copy):
    _cfg, exp = copy
    path = exp / "runs" / RUN_IDS[0] / "measures.json"
    path.write_text(path.read_text()[:-40])
    before = snapshot(exp)
    one_line_error(in_process("report", str(exp)), f"{RUN_IDS[0]}/measures.json is damaged")
    assert snapshot(exp) == before
    status = in_process("status", str(exp))
    assert status.returncode == 0 and f"{RUN_IDS[0]}/measures.json is damaged" in status.stdout


def test_truncated_measures_json_measure_keeps_readable_entries(copy):
    _cfg, exp = copy
    path = exp / "runs" / RUN_IDS[0] / "measures.json"
    entries = json.loads(path.read_text())
    kept = json.dumps({k: entries[k] for k in list(entries)[:2]}, indent=2)
    path.write_text(kept[:-2] + ',\n  "path_norm": {"status": "ok", "val')  # the third entry cut off
    result = in_process("measure", str(exp), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert f"{RUN_IDS[0]}/measures.json was damaged" in result.stdout and "kept its 2 readable entries" in result.stdout
    repaired = json.loads(path.read_text())
    for key in list(entries)[:2]:
        assert repaired[key] == entries[key]  # kept, not recomputed
    assert repaired["path_norm"]["values"] == entries["path_norm"]["values"]  # recomputed
    assert (path.parent / "measures.json.damaged").is_file()
    assert in_process("report", str(exp), "--quiet").returncode == 0


def test_corrupt_model_file_measure_goes_on_and_exits_non_zero(copy):
    _cfg, exp = copy
    model = exp / "runs" / RUN_IDS[0] / "model.pt"
    kept = json.loads((exp / "runs" / RUN_IDS[0] / "measures.json").read_text())["frobenius_norm"]
    model.write_bytes(b"not a checkpoint")
    result = in_process("measure", str(exp), "--force", "--measures", "frobenius_norm,fisher_rao_norm", "--device", "cpu")
    one_line_error(result, "could not be measured")
    assert model.read_bytes() == b"not a checkpoint"
    other = json.loads((exp / "runs" / RUN_IDS[1] / "measures.json").read_text())
    assert other["frobenius_norm"]["status"] == "ok" and other["fisher_rao_norm"]["status"] == "ok"
    failed = json.loads((exp / "runs" / RUN_IDS[0] / "measures.json").read_text())
    assert failed["frobenius_norm"] == kept  # computed before the damage: kept, not replaced by an error
    assert failed["fisher_rao_norm"]["status"] == "error" and "could not be loaded" in failed["fisher_rao_norm"]["error"]
    status = in_process("status", str(exp), "--json")
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
    run = run_cli if command == "status" else in_process  # one through a subprocess
    one_line_error(run(command, missing), fragment)


def test_folder_that_is_not_an_experiment(tmp_path):
    one_line_error(in_process("report", str(tmp_path)), "not a flatbench experiment folder")
    one_line_error(in_process("status", str(tmp_path)), "not a flatbench experiment folder")


def test_audit_of_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    one_line_error(in_process("audit", str(tmp_path / "afile")), "is a file")


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


# ---------------------------------------------------------------- issue 21: every reader, every value, every name




def _status(exp: Path) -> dict:
    result = in_process("status", str(exp), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_binary_config_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe")
    one_line_error(run_cli("train", str(bad), "--out", str(tmp_path / "o")), f"{bad} is not UTF-8 text")
    assert not (tmp_path / "o").exists()


def test_a_config_section_of_the_wrong_shape_names_the_file(tmp_path):
    bad = tmp_path / "shape.yaml"
    bad.write_text("name: shape\ndata: 5\n")
    one_line_error(in_process("train", str(bad), "--out", str(tmp_path / "o")),
                   f"{bad}: 'data' must be a mapping of keys")
    assert not (tmp_path / "o").exists()


def test_nul_byte_in_a_name_is_one_line(write_config, tmp_path):
    cfg = write_config()
    cfg.write_text(cfg.read_text().replace("name: tiny", 'name: "ti\\0ny"'))
    one_line_error(in_process("train", str(cfg), "--out", str(tmp_path / "o")), "a NUL byte is not allowed")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content, command, fragment", [
    (b"\xff\xfe\x00", "status", "study.yaml is damaged (not UTF-8 text"),
    (b"", "report", "study.yaml is damaged (empty)"),
    (b"- data\n- model\n", "measure", "study.yaml is damaged (a list, not a mapping"),
    (b"data: {n_train: -5}\n", "status", "study.yaml is damaged (data.n_train must be positive"),
])
def test_damaged_study_yaml_is_damage_never_a_default_study(copy, content, command, fragment):
    """An empty or unreadable study.yaml is never read as a default study (which would make every real run
    'not in this study'): one line naming the file, nothing changed."""
    _cfg, exp = copy
    (exp / "study.yaml").write_bytes(content)
    before = snapshot(exp)
    run = run_cli if content.startswith(b"\xff") else in_process  # one through a subprocess
    one_line_error(run(command, str(exp), "--device", "cpu") if command == "measure" else run(command, str(exp)),
                   fragment)
    assert snapshot(exp) == before


@pytest.mark.parametrize("damage", ["binary", "list", "no_config"])
def test_damaged_run_json_is_that_run_damaged_and_the_others_carry_on(copy, damage):
    cfg, exp = copy
    path = exp / "runs" / RUN_IDS[0] / "run.json"
    if damage == "binary":
        path.write_bytes(b"\x89PNG\xff\x00")
    elif damage == "list":
        path.write_text("[1, 2, 3]")
    else:
        info = json.loads(path.read_text())
        del info["config"]
        path.write_text(json.dumps(info))
    state = _status(exp)
    assert state["runs"][RUN_IDS[0]]["state"] == "damaged", state
    assert "run.json is damaged" in state["runs"][RUN_IDS[0]]["detail"]
    assert state["counts"]["finished"] == len(RUN_IDS) - 1
    if damage == "list":
        return
    run = run_cli if damage == "binary" else in_process  # one through a subprocess
    result = run("measure", str(exp), "--force", "--measures", "frobenius_norm", "--device", "cpu")
    one_line_error(result, f"could not be measured: {RUN_IDS[0]} ({RUN_IDS[0]}: {path} is damaged")
    for rid in RUN_IDS[1:]:
        assert f"{rid}: 1 measure entries" in result.stdout or f"{rid}  frobenius_norm" in result.stdout
    if damage == "binary":
        before = snapshot(exp)
        one_line_error(in_process("train", str(cfg), "--out", str(exp.parent)), f"{path} is damaged (not UTF-8")
        assert snapshot(exp) == before


def test_binary_measures_json_is_named_by_status_and_refused_by_report(copy):
    _cfg, exp = copy
    path = exp / "runs" / RUN_IDS[0] / "measures.json"
    path.write_bytes(b"\xff\xfe{\x00")
    before = snapshot(exp)
    one_line_error(in_process("report", str(exp)), f"{path} is damaged (not UTF-8")
    assert snapshot(exp) == before
    assert any(str(path) in p for p in _status(exp)["damaged_files"])


def test_wrong_shaped_measure_entries_never_replace_a_good_report(copy):
    """Entries of the wrong shape are damage: report refuses (the good report is kept), status names the
    file, measure keeps the well-formed entries and recomputes the others."""
    _cfg, exp = copy
    path = exp / "runs" / RUN_IDS[1] / "measures.json"
    entries = json.loads(path.read_text())
    good = entries["frobenius_norm"]
    entries["spectral_norm"] = {"status": "ok", "values": "12.5"}
    entries["path_norm"] = ["not", "an", "entry"]
    path.write_text(json.dumps(entries))
    before = snapshot(exp)
    one_line_error(in_process("report", str(exp)), "entries of the wrong shape")
    assert snapshot(exp) == before
    assert any("wrong shape" in p for p in _status(exp)["damaged_files"])
    result = in_process("measure", str(exp), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    repaired = json.loads(path.read_text())
    assert repaired["frobenius_norm"] == good
    assert repaired["spectral_norm"]["status"] == "ok" and isinstance(repaired["spectral_norm"]["values"], dict)
    assert isinstance(repaired["path_norm"], dict) and (path.parent / "measures.json.damaged").is_file()


@pytest.mark.parametrize("override, fragment", [
    ("train.lr=.nan", "train.lr: expected a finite number, got nan"),
    ("train.lr=.inf", "train.lr: expected a finite number, got inf"),
    ("data.random_label_ratio=[]", "data.random_label_ratio: an empty list sweeps over nothing"),
    ("name=..", "name must be a plain folder name"),
    ("data.n_train=100000", "data.n_train=100000 is more than the"),
    ("data.n_test=100000", "data.n_test=100000 is more than the"),
    ("train.snapshot_losses=[0.001, 0.0010000001]", "would share the snapshot folder loss_0.001"),
    ("measure.settings={eps_sharpness: {eps: .inf}}", "measure.settings.eps_sharpness.eps: expected a finite number"),
])
def test_values_and_names_are_refused_on_a_finished_study_before_anything_is_written(copy, override, fragment):
    """NaN / inf values, an empty sweep, a name outside --out, an n_train or n_test the dataset does not have,
    more measurement examples than training examples, snapshot levels that share a folder: one line, and the finished study is exactly as it was."""
    cfg, exp = copy
    before = snapshot(exp)
    outside = sorted(p.name for p in exp.parent.parent.iterdir())
    run = run_cli if override == "train.lr=.nan" else in_process  # one through a subprocess
    one_line_error(run("train", str(cfg), "--out", str(exp.parent), override, "--device", "cpu"), fragment)
    assert snapshot(exp) == before
    assert sorted(p.name for p in exp.parent.parent.iterdir()) == outside


def test_more_measurement_examples_than_training_examples_are_refused_before_measuring(copy):
    cfg, exp = copy
    before = snapshot(exp)
    one_line_error(in_process("measure", str(exp), "measure.n_examples=100000", "--device", "cpu"),
                   "measure.n_examples=100000 is more than the")
    assert snapshot(exp) == before


def test_a_run_whose_loss_becomes_nan_fails_with_its_epoch(write_config, tmp_path):
    cfg = write_config({"data": {"random_label_ratio": [0.0, 0.5]},
                        "train": {"optimizer": "sgd", "lr": 1e30, "epochs": 3}})
    result = run_cli("train", str(cfg), "--out", str(tmp_path / "o"), "--device", "cpu", "--quiet")
    one_line_error(result, "2 run(s) failed to train")
    for path in (tmp_path / "o" / "tiny" / "runs").iterdir():
        info = json.loads((path / "run.json").read_text())
        assert info["status"] == "failed" and "training loss became nan in epoch 1" in info["error"], info
    assert "training loss became nan in epoch 1" in result.stdout


def test_report_of_one_folder_given_twice_counts_each_run_once(copy):
    _cfg, exp = copy
    result = in_process("report", str(exp), str(exp.parent / ".." / exp.parent.name / exp.name), "--quiet")
    assert result.returncode == 0, result.stderr
    import pandas as pd

    table = pd.read_csv(exp / "table.csv")
    assert sorted(table["run_id"]) == RUN_IDS


def test_report_refuses_values_measured_with_different_settings(copy):
    """`measure --shard 0/3 measure.n_examples=150 --force` then `report`: one run's values on 150 examples,
    the others' on 200; the report refuses (naming both) and keeps the good report."""
    _cfg, exp = copy
    result = in_process("measure", str(exp), "--shard", "0/3", "measure.n_examples=150", "--force", "--device",
                        "cpu", "--measures", "fisher_rao_norm,frobenius_norm")
    assert result.returncode == 0, result.stderr
    before = snapshot(exp)
    one_line_error(in_process("report", str(exp)), "was computed with different measurement settings: n_examples=")
    assert snapshot(exp) == before


# ---------------------------------------------------------------- issue 21: concurrent writers, processes


def test_two_measure_processes_with_different_measures_keep_both(copy):
    """Two `measure` processes at once on one study, each with its own --measures: every run's
    measures.json ends with the entries of both (each model folder is locked while its file is read,
    computed into and written)."""
    _cfg, exp = copy
    env = {**os.environ, "MPLBACKEND": "Agg"}
    sets = (["hessian_max_eig", "frobenius_norm"], ["eps_sharpness", "spectral_norm"])
    procs = [subprocess.Popen([sys.executable, "-m", "flatbench", "measure", str(exp), "--force", "--device", "cpu",
                               "--quiet", "--measures", ",".join(names)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for names in sets]
    for proc in procs:
        _out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    for rid in RUN_IDS:
        entries = json.loads((exp / "runs" / rid / "measures.json").read_text())
        for name in (*sets[0], *sets[1], "path_norm"):
            assert name in entries and entries[name]["status"] == "ok", (rid, name, sorted(entries))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_train_with_workers_ends_the_workers(write_config, tmp_path):
    cfg = write_config({"data": {"n_train": 3000, "random_label_ratio": [0.0, 1.0]}, "model": {"widths": [256, 256]},
                        "train": {"epochs": 2000, "batch_size": 32}})
    runs = tmp_path / "o" / "tiny" / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "flatbench", "train", str(cfg), "--out", str(tmp_path / "o"),
                             "--device", "cpu", "--workers", "2", "--quiet"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "MPLBACKEND": "Agg"})
    pids: list[int] = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(pids) < 2:
            pids = [int(p.read_text().split()[1]) for p in runs.glob("*/.lock")] if runs.is_dir() else []
            time.sleep(0.1)
        assert len(pids) == 2 and proc.pid not in pids, pids
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), "the workers outlived their parent"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def test_sigterm_as_a_run_ends_stops_before_the_next_run(write_config, tmp_path):
    """SIGTERM sent while the first of two runs is evaluated and saved is kept: that run is finished, the
    second does not train, and the process exits with 143 (resumable)."""
    cfg = write_config({"data": {"random_label_ratio": 0.5}, "train": {"epochs": [2, 2000]}})
    rids = parse_study(yaml.safe_load(cfg.read_text())).run_ids()
    runs = tmp_path / "o" / "tiny" / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "flatbench", "train", str(cfg), "--out", str(tmp_path / "o"),
                             "--device", "cpu", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "MPLBACKEND": "Agg"})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (runs / rids[0] / "model.pt").exists():
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert json.loads((runs / rids[0] / "run.json").read_text())["status"] == "finished"
    second = runs / rids[1] / "run.json"
    assert not second.exists() or json.loads(second.read_text())["status"] == "preempted"


def test_a_stop_signal_during_the_final_save_is_kept_until_the_stage_ends(write_config, monkeypatch):
    """In process, deterministic: the signal arrives inside `finish_run` of the first run."""
    import torch

    import flatbench.training.loop as loop_mod
    from flatbench.training import Preempted
    from flatbench.config import load_study
    from flatbench.study.train import train_study

    cfg = write_config({"data": {"random_label_ratio": [0.0, 0.5]}, "train": {"epochs": 1}})
    study = load_study(cfg, out=str(cfg.parent / "o"))
    original = loop_mod.finish_run
    calls = []

    def finish_with_a_signal(*args, **kwargs):
        calls.append(args[0])
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(loop_mod, "finish_run", finish_with_a_signal)
    with pytest.raises(Preempted):
        train_study(study, torch.device("cpu"), quiet=True, echo=lambda m: None)
    first, second = study.run_ids()
    assert calls == [first]
    assert json.loads((study.exp_dir / "runs" / first / "run.json").read_text())["status"] == "finished"
    assert not (study.exp_dir / "runs" / second).exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_a_vectorized_run_whose_loss_becomes_nan_fails_and_leaves_the_group(write_config, tmp_path):
    cfg = write_config({"data": {"random_label_ratio": [0.0, 0.5]},
                        "train": {"optimizer": "sgd", "lr": 1e30, "epochs": 3, "vectorize": 2}})
    result = in_process("train", str(cfg), "--out", str(tmp_path / "o"), "--device", "cpu", "--quiet")
    one_line_error(result, "2 run(s) failed to train")
    for path in (tmp_path / "o" / "tiny" / "runs").iterdir():
        info = json.loads((path / "run.json").read_text())
        assert info["status"] == "failed" and "training loss became nan in epoch 1" in info["error"], info
        assert info["vectorized_group"] == 2
