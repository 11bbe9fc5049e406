"""A plugin cannot harm a study (issue 30): isolation of measures, typed output, a timeout per measure,
exit codes a scheduler can trust (0 all done, 1 an entry failed, 2 bad input), and strict YAML.

Each class is tested through the real CLI (a subprocess importing this checkout) on a copy of one tiny
trained study, with hostile plugin measures written to a temporary file; the API's side in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from conftest import TINY, in_process

ROOT = Path(__file__).resolve().parents[1]

HOSTILE = '''
import sys, time
import torch
from flatbench import MeasureOutput, register_measure

@register_measure("doubler", description="doubles the weights in place (hostile)")
def doubler(ctx):
    with torch.no_grad():
        for p in ctx.model.parameters():
            p.mul_(2.0)
    return 1.0

@register_measure("trainer", description="puts the model in train mode (hostile)")
def trainer(ctx):
    ctx.model.train()
    return {"trainer": 1.0}

@register_measure("freezer", description="freezes a parameter (hostile)")
def freezer(ctx):
    next(ctx.model.parameters()).requires_grad_(False)
    return 1.0

@register_measure("exiter", description="ends the process (hostile)")
def exiter(ctx):
    sys.exit(0)

@register_measure("stringy", description="a string value")
def stringy(ctx):
    return {"stringy": "1e3"}

@register_measure("booly", description="a bool value")
def booly(ctx):
    return True

@register_measure("nan_value", description="NaN")
def nan_value(ctx):
    return float("nan")

@register_measure("inf_value", description="inf")
def inf_value(ctx):
    return {"inf_value": torch.tensor(float("inf"))}

@register_measure("no_headline", description="no headline key")
def no_headline(ctx):
    return {"something_else": 1.0}

@register_measure("bad_info", description="info JSON cannot hold")
def bad_info(ctx):
    return MeasureOutput({"bad_info": 1.0}, info={"handle": object()})

@register_measure("sleeper", description="never returns in time")
def sleeper(ctx):
    time.sleep(60)
    return 1.0

@register_measure("tensor_value", description="a 0-d tensor and a numpy scalar: fine")
def tensor_value(ctx):
    import numpy as np
    return {"tensor_value": torch.tensor(2.5), "tensor_value/np": np.float32(1.5)}
'''

SMALL = {**TINY, "data": {**TINY["data"], "n_train": 100, "n_test": 50, "random_label_ratio": [0.0, 0.5, 1.0]},
         "train": {**TINY["train"], "epochs": 1}, "measure": {**TINY["measure"], "measures": ["frobenius_norm"],
                                                                "n_examples": 60}}


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m flatbench ARGS` importing this checkout (not another installed copy)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flatbench", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny trained and measured study (never modified: tests copy it) and the hostile plugin file."""
    root = tmp_path_factory.mktemp("iso")
    cfg = root / "small.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "name": "small"}))
    result = cli("run", str(cfg), "--out", str(root / "out"), "--device", "cpu", "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr  # every entry ok: exit 0
    exp = root / "out" / "small"
    plugin = root / "hostile.py"
    plugin.write_text(textwrap.dedent(HOSTILE))
    return exp, plugin


@pytest.fixture
def exp(trained, tmp_path):
    target = tmp_path / "small"
    shutil.copytree(trained[0], target)
    return target


def entries(exp: Path) -> dict[str, dict]:
    """Each run's measures.json."""
    return {run.name: json.loads((run / "measures.json").read_text())
            for run in sorted((exp / "runs").iterdir()) if (run / "measures.json").is_file()}


def failed_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("failed: ")]


def test_a_measure_that_changes_the_model_or_exits_is_an_error_and_the_others_see_the_model_as_trained(trained, exp):
    _, plugin = trained
    before = entries(exp)
    result = cli("measure", str(exp), "--force", "--device", "cpu", "--plugin", str(plugin),
                 "--measures", "doubler,frobenius_norm,trainer,freezer,exiter,spectral_norm")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    after = entries(exp)
    for run, got in after.items():
        for name, what in (("doubler", "parameter 1.weight"), ("trainer", "(now train)"), ("freezer", "requires_grad")):
            assert got[name]["status"] == "error" and "changed the model" in got[name]["error"], got[name]
            assert what in got[name]["error"]
            assert "values" not in got[name]  # nothing computed on a changed model is kept
        # computed after the doubling: the value of the model as trained, bit for bit
        assert got["frobenius_norm"]["values"] == before[run]["frobenius_norm"]["values"]
        assert got["spectral_norm"]["status"] == "ok"
        # sys.exit in a measure: that entry's error, never the process's exit 0
        assert got["exiter"]["status"] == "error" and "SystemExit" in got["exiter"]["error"]
    lines = failed_lines(result)
    assert len(lines) == 4 * len(after), result.stderr  # one line per failed entry: run, measure, reason
    assert sum("changed the model" in line for line in lines) == 3 * len(after)
    assert all(line.startswith(f"failed: {run} ") for run in after for line in lines if run in line)


def test_sys_exit_at_a_plugins_import_is_one_line_and_exit_2(exp, tmp_path):
    plugin = tmp_path / "leaving.py"
    plugin.write_text("import sys\nsys.exit(0)\n")
    result = cli("measure", str(exp), "--force", "--device", "cpu", "--plugin", str(plugin))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "SystemExit" in lines[0] and "leaving.py" in lines[0]


def test_values_are_finite_real_numbers_and_bad_output_never_stops_the_stage(trained, exp):
    _, plugin = trained
    result = cli("measure", str(exp), "--force", "--device", "cpu", "--plugin", str(plugin), "--measures",
                 "stringy,booly,nan_value,inf_value,no_headline,bad_info,tensor_value,frobenius_norm")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    got = entries(exp)
    assert len(got) == 3  # the stage went on to the other runs
    for run in got.values():
        for name in ("stringy", "booly", "no_headline", "bad_info"):
            assert run[name]["status"] == "error", run[name]
            assert f"measure '{name}'" in run[name]["error"]
        assert "JSON" in run["bad_info"]["error"] and "headline" in run["no_headline"]["error"]
        for name in ("nan_value", "inf_value"):
            assert run[name]["status"] == "non_finite" and name in run[name]["reason"], run[name]
        assert run["tensor_value"]["status"] == "ok"
        assert run["tensor_value"]["values"] == {"tensor_value": 2.5, "tensor_value/np": 1.5}
        assert run["frobenius_norm"]["status"] == "ok"
    assert len(failed_lines(result)) == 6 * len(got)


def test_a_measure_past_its_timeout_is_an_error_entry_also_in_worker_processes(trained, exp):
    _, plugin = trained
    start = time.monotonic()
    result = cli("measure", str(exp), "--force", "--device", "cpu", "--plugin", str(plugin),
                 "--measures", "sleeper,frobenius_norm", "measure.timeout_s=1", "measure.workers=2")
    assert time.monotonic() - start < 50
    assert result.returncode == 1, result.stdout + result.stderr
    for run in entries(exp).values():
        assert run["sleeper"] == {**run["sleeper"], "status": "error", "error": "timed out after 1 s"}
        assert run["frobenius_norm"]["status"] == "ok"


def test_a_finished_run_whose_model_is_missing_is_damage(exp):
    run = sorted((exp / "runs").iterdir())[0]
    (run / "model.pt").unlink()
    result = in_process("measure", str(exp), "--force", "--device", "cpu", "--quiet")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.pt is missing" in lines[0] and run.name in lines[0]
    assert "not trained yet" not in result.stdout.replace("0 runs not trained yet", "")


# ---------------------------------------------------------------- in-process: the CLI's own entry point



def one_line(result: subprocess.CompletedProcess, *parts: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def test_a_duplicate_key_in_a_config_is_refused_with_the_key_and_line(tmp_path):
    text = yaml.safe_dump(SMALL, sort_keys=False) + "train:\n  lr: 0.5\n"
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    line = one_line(cli("train", str(path), "--out", str(tmp_path / "o")), "duplicate key 'train'", "line")
    assert f"line {len(text.splitlines()) - 1}," in line  # the second train: key
    assert not (tmp_path / "o").exists()
    nested = tmp_path / "nested.yaml"
    nested.write_text("name: x\ntrain:\n  lr: 0.1\n  epochs: 2\n  lr: 0.5\n")
    one_line(in_process("train", str(nested)), "duplicate key 'lr'", "line 5")
    one_line(in_process("train", str(nested), "measure.settings={eps_sharpness: {eps: 1, eps: 2}}"), "duplicate key")


def test_a_duplicate_key_in_study_yaml_is_damage_named_in_one_line(exp):
    study = exp / "study.yaml"
    study.write_text(study.read_text() + "report:\n  min_train_acc: 0.5\n")
    one_line(in_process("report", str(exp), "--quiet"), "study.yaml", "duplicate key 'report'")


def test_timeout_s_is_bounded(exp):
    for value in ("0", "-1", ".nan", "1e9"):
        one_line(in_process("measure", str(exp), f"measure.timeout_s={value}"), "measure.timeout_s")


def test_measure_model_exits_1_when_an_entry_failed(trained, tmp_path):
    _, plugin = trained
    factory = tmp_path / "net.py"
    factory.write_text("from torch import nn\n\ndef make(input_shape, num_classes):\n"
                       "    return nn.Sequential(nn.Flatten(), nn.Linear(784, num_classes))\n")
    args = ("measure-model", f"{factory}:make", "--data", "mnist_mini", "--n-examples", "20", "--plugin", str(plugin))
    ok = in_process(*args, "--measures", "frobenius_norm")
    assert ok.returncode == 0, ok.stderr
    bad = in_process(*args, "--measures", "frobenius_norm,nan_value,doubler")
    assert bad.returncode == 1, bad.stderr
    assert len(failed_lines(bad)) == 2 and "Traceback" not in bad.stderr


# ---------------------------------------------------------------- the API, in-process



def _bn_dropout_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)


def _values(df) -> dict[str, float]:
    return dict(zip(df["key"], df["value"]))


def test_the_api_measures_in_eval_mode_with_every_parameter_and_leaves_the_callers_model_as_it_was(own_registry):
    import flatbench

    @flatbench.register_measure("_api_trainable")
    def _api_trainable(ctx):
        """What a measure differentiating the trainable parameters sees: how many there are, and the mode."""
        return {"_api_trainable": sum(p.numel() for p in ctx.model.parameters() if p.requires_grad),
                "_api_trainable/training": sum(m.training for m in ctx.model.modules())}

    names = ["hessian_trace", "frobenius_norm", "fisher_rao_norm", "_api_trainable"]
    reference = _bn_dropout_model().eval()
    expected = _values(flatbench.measure(reference, _data(), names))
    model = _bn_dropout_model().train()  # the caller's model: train mode, the first layer frozen
    for p in model[0].parameters():
        p.requires_grad_(False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    df = flatbench.measure(model, _data(), names)
    assert (df["status"] == "ok").all(), df
    assert _values(df) == expected  # eval mode (dropout off, running statistics) and every parameter
    assert expected["_api_trainable"] == sum(p.numel() for p in model.parameters())
    assert expected["_api_trainable/training"] == 0
    assert all(m.training for m in model.modules())
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True, True, True]
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # running stats untouched


def test_the_api_isolates_measures_types_their_output_and_times_them_out(own_registry):
    import flatbench

    @flatbench.register_measure("_api_doubler")
    def _api_doubler(ctx):
        with torch.no_grad():
            for p in ctx.model.parameters():
                p.mul_(2.0)
        return 1.0

    @flatbench.register_measure("_api_string")
    def _api_string(ctx):
        return "1e3"

    @flatbench.register_measure("_api_exit")
    def _api_exit(ctx):
        raise SystemExit(3)

    @flatbench.register_measure("_api_sleep")
    def _api_sleep(ctx):
        time.sleep(30)
        return 1.0

    model = _bn_dropout_model().eval()
    alone = _values(flatbench.measure(model, _data(), ["frobenius_norm"]))["frobenius_norm"]
    start = time.monotonic()
    df = flatbench.measure(model, _data(), ["_api_doubler", "frobenius_norm", "_api_string", "_api_exit",
                                            "_api_sleep"], timeout_s=0.5)
    assert time.monotonic() - start < 10
    rows = {row["key"]: row for _, row in df.iterrows()}
    assert rows["_api_doubler"]["status"] == "error" and "changed the model" in rows["_api_doubler"]["reason"]
    assert rows["frobenius_norm"]["value"] == alone
    assert rows["_api_string"]["status"] == "error" and "'1e3'" in rows["_api_string"]["reason"]
    assert rows["_api_exit"]["status"] == "error" and "SystemExit" in rows["_api_exit"]["reason"]
    assert rows["_api_sleep"]["status"] == "error" and rows["_api_sleep"]["reason"] == "timed out after 0.5 s"
    from flatbench.errors import FlatbenchError

    with pytest.raises(FlatbenchError, match="timeout_s"):
        flatbench.measure(model, _data(), ["frobenius_norm"], timeout_s=0)


def test_as_output_refuses_what_is_not_a_real_number():
    import numpy as np

    from flatbench.measures.registry import MeasureOutput, MeasureOutputError, as_output

    assert as_output(np.int64(3), "m").values == {"m": 3.0}
    assert as_output(torch.tensor([2.0]), "m").values == {"m": 2.0}
    assert as_output(MeasureOutput({"m": 1, "m/x": np.float32(0.5)}, {"a": 1}), "m").values == {"m": 1.0, "m/x": 0.5}
    for bad in ("1e3", True, np.bool_(True), {"m": "2"}, {"other": 1.0}, torch.ones(2), None, [1.0], {"m": 1j}):
        with pytest.raises(MeasureOutputError):
            as_output(bad, "m")


def test_a_change_is_described_and_undone():
    from flatbench.measures.isolation import guarded_call

    model = _bn_dropout_model().eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def harm():
        model[1].train()
        model[4].weight = nn.Parameter(torch.zeros(2, 2))  # replaced, with another shape
        model[0].bias.requires_grad_(False)
        return 7

    result, error, change = guarded_call(model, harm)
    assert result == 7 and error is None
    assert "4.weight" in change and "mode of 1" in change and "requires_grad of 0.bias" in change
    assert not any(m.training for m in model.modules()) and all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert guarded_call(model, lambda: 1) == (1, None, None)


# ---------------------------------------------------------------- damage is never data

def outputs(exp: Path) -> dict[str, bytes]:
    """The report's files (everything outside runs/), to check that a refused report changed nothing."""
    return {str(p.relative_to(exp)): p.read_bytes() for p in sorted(exp.rglob("*"))
            if p.is_file() and not p.is_symlink() and "runs" not in p.relative_to(exp).parts}


def test_a_measures_json_that_is_a_folder_is_refused_and_the_good_report_kept(exp):
    before = outputs(exp)
    path = sorted((exp / "runs").iterdir())[0] / "measures.json"
    path.unlink()
    path.mkdir()
    one_line(cli("report", str(exp), "--quiet"), str(path), "a folder, not a file")
    assert outputs(exp) == before


@pytest.mark.parametrize("damage", ["devnull", "empty"])
def test_damaged_study_yaml_and_run_json_are_refused_never_read_as_something_else(exp, damage):
    before = outputs(exp)
    study = exp / "study.yaml"
    study.unlink()
    if damage == "devnull":
        study.symlink_to("/dev/null")
    else:
        study.write_text("")
    what = "not a regular file" if damage == "devnull" else "empty"
    one_line(in_process("report", str(exp), "--quiet"), "study.yaml", what)
    one_line(in_process("measure", str(exp), "--device", "cpu"), "study.yaml", "damaged")
    assert {k: v for k, v in outputs(exp).items() if k != "study.yaml"} == {k: v for k, v in before.items()
                                                                           if k != "study.yaml"}
    study.unlink()
    study.write_bytes(before["study.yaml"])
    run_json = sorted((exp / "runs").iterdir())[1] / "run.json"
    run_json.write_text("")
    one_line(in_process("report", str(exp), "--quiet"), str(run_json), "empty")
    assert outputs(exp) == before


CUTS = {
    "cut mid-row": lambda text: text[: text.index("\n", text.index("\n") + 1) + 12],
    "garbage": lambda text: "this is not, a table\nat all\n",
    "binary": lambda text: "\x00\x01\x02",
    "no measure column": lambda text: text.replace("measure,", "meas,", 1),
    "tau not a number": lambda text: _with_tau(text, "abc"),
}


def _with_tau(text: str, tau: str) -> str:
    """correlations.csv with the first row's kendall_tau replaced by `tau`."""
    import csv
    import io

    rows = list(csv.reader(io.StringIO(text, newline="")))
    rows[1][rows[0].index("kendall_tau")] = tau
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue()


def test_compare_refuses_a_damaged_correlations_csv_in_one_line(exp, tmp_path):
    good = (exp / "correlations.csv").read_text()
    assert in_process("compare", str(exp), "--out", str(tmp_path / "ok")).returncode == 0
    for name, cut in CUTS.items():
        text = cut(good)
        (exp / "correlations.csv").write_bytes(text.encode("latin-1") if name == "binary" else text.encode())
        one_line(in_process("compare", str(exp), "--out", str(tmp_path / name)), "correlations.csv")
    (exp / "correlations.csv").write_text("")
    one_line(cli("compare", str(exp), "--out", str(tmp_path / "empty")), "correlations.csv", "empty")


def test_report_seed_must_be_a_seed(exp):
    result = in_process("report", str(exp), "--seed", "-1")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "--seed" in lines[0], result.stderr


# ---------------------------------------------------------------- bounds

@pytest.mark.parametrize("override, fragment", [
    ("train.epochs=1000000", "train.epochs must be at most 100,000, got 1000000"),
    ("train.batch_size=100000000", "train.batch_size must be at most"),
    ("model.widths=[100000000]", "model.widths must be at most"),
    ("measure.n_examples=10000000000", "measure.n_examples must be at most"),
    ("measure.settings={spectral_norm: {iters: 1000000000000}}", "spectral_norm.iters must be at most 10,000,000"),
    ("measure.settings={hessian_trace: {probes: 100000000}}", "hessian_trace.probes must be at most"),
    ('name="a\\nb"', "without control characters"),
    ('name="a\\tb"', "without control characters"),
])
def test_sizes_counts_and_names_are_bounded(tmp_path, override, fragment):
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "name": "s"}))
    one_line(in_process("train", str(cfg), "--out", str(tmp_path / "o"), override), fragment)
    assert not (tmp_path / "o").exists()


def test_values_at_the_bounds_are_accepted():
    from flatbench.config import parse_study
    from flatbench.study.spec import _check_setting_types

    study = parse_study({**SMALL, "name": "s", "train": {**SMALL["train"], "epochs": 100_000},
                         "measure": {**SMALL["measure"], "n_examples": None, "workers": 1024}})
    assert study.runs[0][1].train.epochs == 100_000
    _check_setting_types({"spectral_norm": {"iters": 10**7}})


def _npz(path: Path, n_train: int, n_test: int) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.normal(size=(n_train, 5)).astype("float32"), y_train=np.arange(n_train) % 3,
             x_test=rng.normal(size=(n_test, 5)).astype("float32"), y_test=np.arange(n_test) % 3)
    return path


def test_a_dataset_without_test_or_training_examples_is_refused_before_training(tmp_path):
    cfg = tmp_path / "s.yaml"
    data = {"n_train": None, "n_test": None, "random_label_ratio": 0.0}
    sizes = {"notest": (40, 0), "notrain": (0, 40)}
    for name, (n_train, n_test) in sizes.items():
        npz = _npz(tmp_path / f"{name}.npz", n_train, n_test)
        raw = {**SMALL, "name": name, "data": {**data, "dataset": str(npz)},
               "measure": {**SMALL["measure"], "n_examples": None}}
        cfg.write_text(yaml.safe_dump(raw))
        run = cli if name == "notest" else in_process
        which = "test" if name == "notest" else "training"
        one_line(run("train", str(cfg), "--out", str(tmp_path / "o")), f"has 0 {which} examples", "gap")
        assert not (tmp_path / "o").exists()


def test_measure_and_status_name_a_measures_json_or_run_json_that_is_no_file(exp):
    first, second = sorted((exp / "runs").iterdir())[:2]
    (first / "measures.json").unlink()
    (first / "measures.json").mkdir()
    (second / "run.json").unlink()
    (second / "run.json").symlink_to("/dev/null")
    result = in_process("measure", str(exp), "--device", "cpu", "--quiet")
    line = one_line(result, "could not be measured", "damaged")
    assert "measures.json" in line or "run.json" in line
    assert (first / "measures.json").is_dir()  # never overwritten
    third = sorted((exp / "runs").iterdir())[2]
    assert json.loads((third / "measures.json").read_text())["frobenius_norm"]["status"] == "ok"
    status = in_process("status", str(exp), "--json")
    state = json.loads(status.stdout)
    assert state["runs"][second.name]["state"] == "damaged"
    assert "not a regular file" in json.dumps(state["runs"][second.name])
    assert "a folder, not a file" in in_process("status", str(exp)).stdout
