"""Issue 44 part B ("nothing silently wrong"): damaged run folders that `report` trusted, impossible
correlations and cut files in `compare`, one run's I/O error stopping a stage, a failed report changing
files, YAML that expands without bound, a `measure-model` factory that misbehaves, the API's arguments, and
the smaller cases of docs/guide/bad-input.md. In-process CLI calls (`in_process`) on one small trained study,
copied per test."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FEW = settings(max_examples=12, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def one_line(result, *parts: str, code: int = 2) -> str:
    """A refused command: exit `code`, one `error:` line on stderr holding `parts`, no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, (result.returncode, result.stdout[-800:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Three runs on small blobs, trained, measured and reported (never modified: tests copy it)."""
    root = tmp_path_factory.mktemp("hostile_b")
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 120)
    x = (rng.normal(size=(3, 5))[y] * 3 + rng.normal(size=(120, 5))).astype(np.float32)
    np.savez(root / "blobs.npz", x_train=x[:90], y_train=y[:90], x_test=x[90:], y_test=y[90:])
    config = {"name": "hb", "seed": 0, "out": str(root / "results"),
              "data": {"dataset": str(root / "blobs.npz"), "random_label_ratio": [0.0, 0.5, 1.0]},
              "model": {"name": "mlp", "widths": [8]},
              "train": {"epochs": 1, "batch_size": 32, "lr": 0.01},
              "measure": {"measures": ["frobenius_norm", "spectral_norm"]},
              "report": {"min_train_acc": 0.0}}
    (root / "hb.yaml").write_text(yaml.safe_dump(config))
    for stage in ("train", "measure"):
        result = in_process(stage, str(root / "hb.yaml"), "--quiet", "--device", "cpu")
        assert result.returncode == 0, result.stderr
    result = in_process("report", str(root / "results" / "hb"), "--quiet")
    assert result.returncode == 0, result.stderr
    return root


@pytest.fixture
def exp(study, tmp_path):
    """A copy of the study's experiment folder."""
    target = tmp_path / "hb"
    shutil.copytree(study / "results" / "hb", target)
    return target


def _runs(exp: Path) -> list[Path]:
    return sorted(p for p in (exp / "runs").iterdir() if p.is_dir())


def _edit_info(run: Path, **changes) -> None:
    info = json.loads((run / "run.json").read_text())
    for key, value in changes.items():
        if key == "lr":
            info["config"]["train"]["lr"] = value
        else:
            info[key] = value
    (run / "run.json").write_text(json.dumps(info))


def _status(exp: Path) -> dict:
    result = in_process("status", str(exp), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "runs" not in p.relative_to(folder).parts}


# ---------------------------------------------------------------- 1. report trusts damaged run folders

def _damage(exp: Path, how: str) -> str:
    """Damage the study in one of the ways `status` calls damaged; returns the run folder's name named."""
    a, b, c = _runs(exp)
    if how == "symlinked run.json":
        (b / "run.json").unlink()
        (b / "run.json").symlink_to(a / "run.json")
        return b.name
    if how == "copied run.json":
        shutil.copyfile(a / "run.json", b / "run.json")
        return b.name
    if how == "folder copied under another id":
        shutil.rmtree(c)
        shutil.copytree(a, c)
        return c.name
    if how == "edited config":
        _edit_info(a, lr=0.5)
        return a.name
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["symlinked run.json", "copied run.json", "folder copied under another id",
                                 "edited config"])
def test_report_refuses_a_run_that_status_calls_damaged(exp, how):
    name = _damage(exp, how)
    assert _status(exp)["runs"][name]["state"] == "damaged"
    before = _files(exp)
    one_line(in_process("report", str(exp), "--quiet"), "damaged run", name)
    assert _files(exp) == before


def test_a_run_folder_linked_into_two_experiments_counts_once(exp, tmp_path):
    other = tmp_path / "other"
    (other / "runs").mkdir(parents=True)
    (other / "runs" / _runs(exp)[0].name).symlink_to(_runs(exp)[0])
    one_line(in_process("report", str(exp), str(other), "--out", str(tmp_path / "rep"), "--quiet"),
             "count twice")


@FEW
@given(key=st.sampled_from(["train_acc", "test_acc", "train_loss", "test_loss"]),
       value=st.one_of(st.floats(min_value=1.0, exclude_min=True, max_value=1e6),
                       st.floats(max_value=0.0, exclude_max=True, min_value=-1e6)))
def test_impossible_accuracies_and_losses_are_damage(exp, key, value):
    if key.endswith("_loss") and value > 1:
        value = -value  # a loss above 1 is possible; its negative is not
    run = _runs(exp)[0]
    original = (run / "run.json").read_text()
    try:
        _edit_info(run, **{key: value})
        assert _status(exp)["runs"][run.name]["state"] == "damaged"
        one_line(in_process("report", str(exp), "--quiet"), key, run.name)
    finally:
        (run / "run.json").write_text(original)


def test_the_undamaged_study_still_reports(exp):
    assert in_process("report", str(exp), "--quiet").returncode == 0
    assert _status(exp)["counts"]["damaged"] == 0


# ---------------------------------------------------------------- 2. compare: impossible values, cut files

@pytest.mark.parametrize("column,value", [("kendall_tau", "5.0"), ("kendall_tau_lo", "-1.5"),
                                          ("spearman_rho", "2"), ("pearson_r", "-inf"), ("kendall_p", "1.5"),
                                          ("kendall_p", "-0.1"), ("kendall_tau", "abc")])
def test_compare_refuses_an_impossible_correlation_or_p_value(exp, tmp_path, column, value):
    import pandas as pd

    path = exp / "correlations.csv"
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    frame.loc[0, column] = value
    frame.to_csv(path, index=False)
    one_line(in_process("compare", str(exp), "--out", str(tmp_path / "cmp")), column, "correlations.csv")
    assert not (tmp_path / "cmp").exists()


def test_compare_on_a_correlations_file_cut_anywhere_gives_one_line_or_a_whole_comparison(exp, tmp_path):
    whole = (exp / "correlations.csv").read_bytes()
    step = max(1, len(whole) // 40)
    for cut in [*range(1, len(whole), step), len(whole) - 1]:
        (exp / "correlations.csv").write_bytes(whole[:cut])
        result = in_process("compare", str(exp), "--out", str(tmp_path / f"cmp{cut}"))
        if whole[:cut].endswith(b"\n") and whole[:cut].count(b"\n") > 1:
            assert result.returncode == 0, (cut, result.stderr)  # cut at a row's end: fewer rows, nothing cut
        else:
            one_line(result, "correlations.csv")


# ---------------------------------------------------------------- 3. one run's I/O error stops the stage

def _entry_seconds(run: Path) -> dict:
    return {k: v.get("seconds") for k, v in json.loads((run / "measures.json").read_text()).items()}


@pytest.mark.parametrize("how", ["unreadable model.pt", "read-only run folder"])
def test_one_runs_io_error_leaves_the_other_runs_measured(exp, monkeypatch, how):
    from denied_io import denied

    bad, *good = _runs(exp)
    for run in good:  # drop an entry, to see it measured again
        entries = json.loads((run / "measures.json").read_text())
        del entries["spectral_norm"]
        (run / "measures.json").write_text(json.dumps(entries))
    if how == "unreadable model.pt":
        ctx = denied(monkeypatch, bad / "model.pt", read=True)
    else:
        ctx = denied(monkeypatch, lambda p: p.parent == bad and p.name != "model.pt" and p.name != "run.json",
                     write=True, code=errno.EROFS)
    with ctx as refused:
        result = in_process("measure", str(exp), "--measures", "frobenius_norm,spectral_norm", "--force",
                            "--device", "cpu", "--quiet")
    assert refused
    line = one_line(result, "could not be measured", bad.name)
    assert "Permission denied" in line or "Read-only" in line, line
    for run in good:
        assert "spectral_norm" in json.loads((run / "measures.json").read_text())


def test_the_worker_job_turns_an_io_error_into_this_models_failure(exp, monkeypatch):
    """`--workers`: the job a worker process runs (`study.measure._worker_measure`) fails its one model."""
    from denied_io import denied

    from flatbench.measures.targets import measure_targets
    from flatbench.study.measure import _worker_measure
    from flatbench.study.spec import read_saved_study

    cfg = read_saved_study(exp).measure
    run = _runs(exp)[0]
    target = measure_targets(run, snapshots=False)[0]
    with denied(monkeypatch, run / "model.pt", read=True):
        report, _, lines = _worker_measure(target, ["frobenius_norm"], cfg, "cpu", True, False)
    assert report.failure and "Permission denied" in report.failure, report


# ---------------------------------------------------------------- 4. a failed report changes files

@pytest.mark.parametrize("fail_at", [1, 2, 4, 7, 12, -1])
def test_a_report_that_fails_part_way_leaves_the_previous_report_whole(exp, monkeypatch, fail_at):
    """A full disk (ENOSPC) at the fail_at-th file the report writes (-1: the last one, report.html)."""
    from flatbench import store

    before = _files(exp)
    real = store.atomic_write_bytes
    writes: list[str] = []

    def full_disk(path, data):
        writes.append(Path(path).name)
        if len(writes) == fail_at or (fail_at == -1 and Path(path).name == "report.html"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    monkeypatch.setattr(store, "atomic_write_bytes", full_disk)
    line = one_line(in_process("report", str(exp), "--quiet", "--seed", "1"), "No space left on device")
    assert writes and "kept" not in line
    after = _files(exp)
    assert after.keys() == before.keys(), set(after) ^ set(before)
    assert after == before
    assert not [p for p in exp.iterdir() if p.name.startswith(".report-kept-")]
    monkeypatch.setattr(store, "atomic_write_bytes", real)
    assert in_process("report", str(exp), "--quiet", "--seed", "1").returncode == 0
    assert _files(exp) != before  # another seed: another report, written whole


# ---------------------------------------------------------------- 5. YAML that expands without bound

def _laughs(levels: int, width: int = 10) -> str:
    lines = ["name: laughs", "lol0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [6, 9, 30])
def test_a_billion_laughs_config_is_refused_at_once(tmp_path, levels):
    import time

    path = tmp_path / "laughs.yaml"
    path.write_text(_laughs(levels))
    start = time.monotonic()
    one_line(in_process("train", str(path), "--quiet"), "billion laughs")
    assert time.monotonic() - start < 10


def test_a_recursive_alias_and_a_small_shared_anchor(tmp_path):
    from flatbench import strict_yaml

    path = tmp_path / "loop.yaml"
    path.write_text("name: loop\ndata: &d {dataset: mnist_mini, extra: [*d]}\n")
    one_line(in_process("train", str(path), "--quiet"), "recursive alias")
    assert strict_yaml.load("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}
    assert strict_yaml.load(_laughs(4)) is not None  # 10 000 values: under the bound


# ---------------------------------------------------------------- 6. measure-model's factory

FACTORIES = '''
import math, sys
from torch import nn

def value_error(): raise ValueError("bad width")
def runtime_error(): raise RuntimeError("no")
def recursion(): return recursion()
def memory(): raise MemoryError()
def exit0(): sys.exit(0)
def exit3(): sys.exit(3)
def exit_none(): sys.exit()

class IntNet(nn.Module):
    def __init__(self, n, c):
        super().__init__()
        self.l = nn.Linear(n, c)
    def forward(self, x):
        return (self.l(x.flatten(1)) * 100).long()

def int_outputs(input_shape, num_classes):
    return IntNet(math.prod(input_shape), num_classes)
'''


@pytest.mark.parametrize("name,said", [("value_error", "raised ValueError: bad width"),
                                       ("runtime_error", "raised RuntimeError"),
                                       ("recursion", "raised RecursionError"), ("memory", "raised MemoryError"),
                                       ("exit0", "sys.exit(0)"), ("exit3", "sys.exit(3)"),
                                       ("exit_none", "sys.exit(None)"), ("int_outputs", "torch.int64 outputs")])
def test_a_misbehaving_factory_is_one_line(tmp_path, name, said):
    (tmp_path / "factories.py").write_text(FACTORIES)
    one_line(in_process("measure-model", f"{tmp_path / 'factories.py'}:{name}", "--data", "mnist_mini",
                        "--measures", "frobenius_norm", "--n-examples", "16"), said)


# ---------------------------------------------------------------- 7. the API's arguments

def _api_cases():
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    torch.manual_seed(0)
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))

    class Lists(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return [x[i].tolist(), int(y[i])]

    class Ragged(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return x[i][: 4 if i < 10 else 3], y[i]

    meta = nn.Sequential(nn.Flatten(), nn.Linear(4, 3, device="meta"))
    frob = ["frobenius_norm"]
    return {
        "measures None": (dict(model=net, data=(x, y), measures=None), "measures must be"),
        "measures int": (dict(model=net, data=(x, y), measures=3), "measures must be"),
        "measures dict": (dict(model=net, data=(x, y), measures={"a": 1}), "measures must be"),
        "plugins as one string": (dict(model=net, data=(x, y), measures=frob, plugins="no_such_plugin.py"),
                                  "no_such_plugin.py"),
        "plugins int": (dict(model=net, data=(x, y), measures=frob, plugins=7), "plugins must be"),
        "loader of lists": (dict(model=net, data=DataLoader(Lists(), batch_size=5), measures=frob), "a list"),
        "ragged loader": (dict(model=net, data=DataLoader(Ragged(), batch_size=10), measures=frob), "one shape"),
        "meta model": (dict(model=meta, data=(x, y), measures=frob), "meta device"),
        "n_examples above the data": (dict(model=net, data=(x, y), measures=frob, n_examples=21), "more than the 20"),
        "huge iters": (dict(model=net, data=(x, y), measures=["hessian_max_eig"],
                            settings={"hessian_max_eig": {"iters": 10**12}}), "at most"),
        "huge density grid": (dict(model=net, data=(x, y), measures=["hessian_density"],
                                   settings={"hessian_density": {"grid": 10**9}}), "grid"),
        "density sigma finer than its grid": (dict(model=net, data=(x, y), measures=["hessian_density"],
                                                   settings={"hessian_density": {"sigma": 1e-6}}), "integrate to 1"),
    }


@pytest.mark.parametrize("case", list(_api_cases()))
def test_bad_api_arguments_are_one_flatbench_error(case, own_registry):
    import flatbench
    from flatbench.errors import FlatbenchError

    kwargs, said = _api_cases()[case]
    with pytest.raises(FlatbenchError) as info:
        flatbench.measure(**kwargs)
    assert said in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_the_density_at_its_finest_allowed_sigma_integrates_to_one():
    import torch

    import flatbench

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, y = torch.randn(30, 4), torch.randint(0, 3, (30,))
    grid = 60
    df = flatbench.measure(net, (x, y), ["hessian_density"],
                           settings={"hessian_density": {"grid": grid, "sigma": 1.1 / (grid - 7)}})
    info = df.attrs["info"]["hessian_density"]
    mass = float(torch.trapezoid(torch.tensor(info["density"]), torch.tensor(info["grid"])))
    assert mass == pytest.approx(1.0, abs=1e-3)


# ---------------------------------------------------------------- 8. smaller cases

def test_settings_in_exponent_form_are_numbers(write_config):
    from flatbench import strict_yaml
    from flatbench.api import settings_from_overrides

    assert strict_yaml.load("a: 1e-3\nb: -5E4\nc: '1e-3'\nd: 1e") == {"a": 1e-3, "b": -5e4, "c": "1e-3", "d": "1e"}
    assert settings_from_overrides(["hessian_max_eig.tol=1e-3"]) == {"hessian_max_eig": {"tol": 1e-3}}
    result = in_process("measure-model", "flatbench.models:MLP", "--data", "mnist_mini", "--measures",
                        "hessian_max_eig", "--set", "hessian_max_eig.tol=1e-3", "--n-examples", "1")
    assert "expected a number" not in result.stderr, result.stderr


@pytest.mark.parametrize("name", ["x@mse", "a\tb", "a\nb", "a b", "x:v", "", "é"])
def test_plugin_measure_names_with_whitespace_or_separators_are_refused(tmp_path, name, own_registry):
    plugin = tmp_path / "named.py"
    plugin.write_text(f"from flatbench import register_measure\n@register_measure({name!r}, description='d')\n"
                      "def m(ctx):\n    return 1.0\n")
    one_line(in_process("list-measures", "--plugin", str(plugin)), "measure name")


def test_describe_and_list_measures_escape_terminal_sequences(tmp_path, own_registry):
    plugin = tmp_path / "loud.py"
    plugin.write_text("from flatbench import register_measure\n"
                      "@register_measure('loud', description='red \\x1b[31mtext\\x1b[0m \\x07 bell')\n"
                      "def loud(ctx):\n    return 1.0\n")
    for args in (("describe", "loud"), ("describe", "loud", "--markdown"), ("list-measures",)):
        result = in_process(*args, "--plugin", str(plugin))
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout
        assert "\\x1b[31m" in result.stdout


def test_every_measure_setting_the_docs_name_exists():
    """`MEASURE.KEY=VALUE` (as `--set` and overrides write them) and `measure.settings.MEASURE.KEY` in the
    docs, the README, the configs and the examples name settings the measure has (a doc once said
    `eps_sharpness.steps`, which does not exist)."""
    import re

    from flatbench.measures import all_measures

    root = Path(__file__).resolve().parents[1]
    registry = all_measures()
    files = [root / "README.md", *(root / "docs").rglob("*.md"), *(root / "configs").rglob("*.yaml"),
             *(root / "examples").rglob("*.*")]
    named, wrong = 0, []
    pattern = re.compile(r"(?:settings\.)?\b([a-z][a-z0-9_]*)\.([a-z][a-z0-9_]*)=")
    for path in files:
        if not path.is_file() or path.suffix not in (".md", ".yaml", ".py", ".sh", ".ipynb"):
            continue
        for name, key in pattern.findall(path.read_text(errors="replace")):
            if name in registry:
                named += 1
                if key not in registry[name].defaults:
                    wrong.append(f"{path.relative_to(root)}: {name}.{key}")
    assert named, "no setting found in the docs: the pattern is wrong"
    assert not wrong, wrong


@pytest.mark.parametrize("stage", ["measure", "report", "status"])
def test_runs_replaced_by_a_file_is_bad_input(exp, stage):
    shutil.rmtree(exp / "runs")
    (exp / "runs").write_text("not a folder")
    one_line(in_process(stage, str(exp)), "is a file, not the folder of the experiment's runs")


@pytest.mark.parametrize("name", ["measures.json"])
def test_a_linked_result_file_is_neither_replaced_nor_written_through(exp, tmp_path, name):
    """A link where flatbench writes a file of its own: that run's failure, named; the link and the file it
    points to unchanged, the other runs measured."""
    bad, *good = _runs(exp)
    elsewhere = tmp_path / f"elsewhere-{name}"
    elsewhere.write_bytes((bad / name).read_bytes())
    (bad / name).unlink()
    (bad / name).symlink_to(elsewhere)
    before = elsewhere.read_bytes()
    for run in good:
        entries = json.loads((run / "measures.json").read_text())
        entries.pop("spectral_norm", None)
        (run / "measures.json").write_text(json.dumps(entries))
    result = in_process("measure", str(exp), "--measures", "frobenius_norm,spectral_norm", "--force",
                        "--device", "cpu", "--quiet")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert bad.name in result.stderr and "link" in result.stderr, result.stderr
    assert (bad / name).is_symlink() and elsewhere.read_bytes() == before
    for run in good:
        assert "spectral_norm" in json.loads((run / "measures.json").read_text())


@pytest.mark.parametrize("where", ["folder", "file parent"])
def test_plot_onto_a_folder_is_refused_before_anything_is_computed(tmp_path, monkeypatch, where):
    import flatbench.api as api

    monkeypatch.setattr(api, "measure_records", lambda *a, **k: pytest.fail("measured before the refusal"))
    if where == "folder":
        target = tmp_path / "spectrum.png"
        target.mkdir()
        said = "is a folder"
    else:
        (tmp_path / "notes").write_text("")
        target = tmp_path / "notes" / "spectrum.png"
        said = "is a file, not a folder"
    line = one_line(in_process("measure-model", "flatbench.models:build_model", "--data", "mnist_mini",
                               "--plot", str(target), "--n-examples", "16"), said, str(target))
    assert ".tmp" not in line
