"""Every bad input a user can give flatbench, tried through the real CLI: exit code, stderr lines, message.

    python scripts/bad_inputs.py            # a markdown table (docs/guide/bad-input.md)

It trains one tiny study (mnist_mini, 3 runs, a few seconds) in a temporary folder, then runs each case on
a fresh copy of it, and checks that nothing finished was lost (the run folders' models and the report are
byte-for-byte the same afterwards, except where the case is a repair). tests/test_cli_errors.py asserts
the same cases one by one. The last rows are processes: two `measure` processes at once, kill -9 of
`train --workers 2` (are its workers gone?), SIGTERM as the first of two runs is saved.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

TINY = {
    "name": "tiny", "seed": 0,
    "data": {"dataset": "mnist_mini", "n_train": 300, "n_test": 200, "random_label_ratio": [0.0, 0.5, 1.0]},
    "model": {"name": "mlp", "widths": [32]},
    "train": {"epochs": 3, "batch_size": 64, "lr": 0.003},
    "measure": {"measures": ["frobenius_norm", "spectral_norm", "path_norm"], "n_examples": 200},
    "report": {"min_train_acc": 0.0},
}


def cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flatbench", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "MPLBACKEND": "Agg", **(env or {})})


def files(exp: Path) -> dict[str, bytes]:
    return {str(p.relative_to(exp)): p.read_bytes() for p in sorted(exp.rglob("*")) if p.is_file()}


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="flatbench-bad-"))
    cfg = root / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    done = cli("run", str(cfg), "--out", str(root / "base"), "--device", "cpu", "--quiet")
    if done.returncode:
        sys.exit(f"the tiny study failed: {done.stderr}")
    base = root / "base" / "tiny"
    (root / "afile").write_text("x")
    runs = sorted(p.name for p in (base / "runs").iterdir())

    def write(name: str, text: str) -> Path:
        path = root / name
        path.write_text(text)
        return path

    def edit_json(exp: Path) -> None:
        path = exp / "runs" / runs[1] / "run.json"
        info = json.loads(path.read_text())
        info["config"]["train"]["lr"] = 0.5
        path.write_text(json.dumps(info))

    def truncate(exp: Path) -> None:
        path = exp / "runs" / runs[0] / "measures.json"
        path.write_text(path.read_text()[:-40])

    def corrupt_model(exp: Path) -> None:
        (exp / "runs" / runs[0] / "model.pt").write_bytes(b"not a checkpoint")

    def swap_model(exp: Path) -> None:
        shutil.copyfile(exp / "runs" / runs[1] / "model.pt", exp / "runs" / runs[0] / "model.pt")

    def binary_run_json(exp: Path) -> None:
        (exp / "runs" / runs[0] / "run.json").write_bytes(b"\x89PNG\xff\x00")

    def list_run_json(exp: Path) -> None:
        (exp / "runs" / runs[0] / "run.json").write_text("[1, 2, 3]")

    def run_json_without_config(exp: Path) -> None:
        path = exp / "runs" / runs[0] / "run.json"
        info = json.loads(path.read_text())
        del info["config"]
        path.write_text(json.dumps(info))

    def binary_study(exp: Path) -> None:
        (exp / "study.yaml").write_bytes(b"\xff\xfe\x00")

    def empty_study(exp: Path) -> None:
        (exp / "study.yaml").write_text("")

    def list_study(exp: Path) -> None:
        (exp / "study.yaml").write_text("- data\n- model\n")

    def binary_measures(exp: Path) -> None:
        (exp / "runs" / runs[0] / "measures.json").write_bytes(b"\xff\xfe{\x00")

    def wrong_shaped_entries(exp: Path) -> None:
        path = exp / "runs" / runs[1] / "measures.json"
        entries = json.loads(path.read_text())
        entries["spectral_norm"] = {"status": "ok", "values": "12.5"}
        entries["path_norm"] = ["not", "an", "entry"]
        path.write_text(json.dumps(entries))

    def other_n_examples_on_one_shard(exp: Path) -> None:
        done = cli("measure", str(exp), "--shard", "0/3", "measure.n_examples=150", "--force", "--device", "cpu",
                   "--measures", "fisher_rao_norm,frobenius_norm")
        assert done.returncode == 0, done.stderr

    empty = write("empty.yaml", "")
    bad_yaml = write("bad.yaml", "data: {dataset: mnist_mini\n")
    binary = root / "binary.yaml"
    binary.write_bytes(b"\xff\xfe")
    nul_name = write("nul.yaml", yaml.safe_dump({**TINY, "name": "ti\x00ny"}))
    diverging = write("diverging.yaml", yaml.safe_dump({**TINY, "data": {**TINY["data"], "random_label_ratio": [0.0, 0.5]},
                                                        "train": {**TINY["train"], "optimizer": "sgd", "lr": 1e30}}))
    nodata = root / "nodata"
    nodata.mkdir()
    E = "EXP"  # replaced by the copy's experiment folder
    C = str(cfg)
    cases: list[tuple[str, list[str], Any]] = [
        ("`--out` is a file (run)", ["run", C, "--out", str(root / "afile")], None),
        ("`--out` is a file (train)", ["train", C, "--out", str(root / "afile")], None),
        ("`--out` under a file (train)", ["train", C, "--out", str(root / "afile" / "sub")], None),
        ("`--out` is a file (measure)", ["measure", C, "--out", str(root / "afile")], None),
        ("`--out` is a file (report)", ["report", E, "--out", str(root / "afile")], None),
        ("`--out` unwritable (report)", ["report", E, "--out", "/proc/flatbench"], None),
        ("`--out` is a file (audit, before computing)", ["audit", E, "--population", "--out", str(root / "afile")], None),
        ("empty config file", ["train", str(empty)], None),
        ("missing config file", ["train", str(root / "none.yaml")], None),
        ("invalid YAML", ["train", str(bad_yaml)], None),
        ("unknown top-level key", ["train", C, "trian.epochs=3"], None),
        ("unknown key in a section", ["train", C, "train.lrr=0.1"], None),
        ("wrong type", ["train", C, "train.epochs=three"], None),
        ("ratio outside [0, 1]", ["train", C, "data.random_label_ratio=2"], None),
        ("unknown dataset", ["train", C, "data.dataset=mnsit"], None),
        ("unknown model", ["train", C, "model.name=mpl"], None),
        ("unknown measure in the config", ["train", C, "measure.measures=[hesian_trace]"], None),
        ("unknown measure setting (train refuses before training)",
         ["train", C, "measure.settings={eps_sharpness: {eps_sharpnes: 1}}"], None),
        ("unknown measure setting, close to a valid one", ["train", C, "measure.settings={eps_sharpness: {epz: 1}}"], None),
        ("unknown measure on the command line", ["measure", E, "--measures", "frobenius"], None),
        ("unknown variant", ["measure", E, "--measures", "frobenius_norm:published"], None),
        ("override without `=`", ["train", C, "train.epochs"], None),
        ("bad `--shard`", ["train", C, "--shard", "3/2"], None),
        ("`--device cuda` without CUDA", ["train", C, "--device", "cuda"], None),
        ("`report --min-train-acc 2`", ["report", E, "--min-train-acc", "2"], None),
        ("`report --min-train-acc 1` (excludes every run)", ["report", E, "--min-train-acc", "1"], None),
        ("truncated measures.json (report)", ["report", E], truncate),
        ("truncated measures.json (status names it)", ["status", E], truncate),
        ("truncated measures.json (measure repairs it)", ["measure", E, "--device", "cpu"], truncate),
        ("corrupt model.pt (measure goes on, exits non-zero)", ["measure", E, "--force", "--device", "cpu"], corrupt_model),
        ("model.pt replaced by another run's (measure)", ["measure", E, "--force", "--device", "cpu"], swap_model),
        ("model.pt replaced (train)", ["train", C, "--out", "ROOT"], swap_model),
        ("hand-edited run.json (train)", ["train", C, "--out", "ROOT"], edit_json),
        ("missing dataset files", ["train", C, "data.dataset=mnist", "data.download=false", "--out", str(root / "nd")], None),
        ("`status` of a missing folder", ["status", str(root / "missing")], None),
        ("`report` of a missing folder", ["report", str(root / "missing")], None),
        ("`report` of a folder that is not an experiment", ["report", str(root)], None),
        ("`audit` of a file", ["audit", str(root / "afile")], None),
        ("bare `flatbench`", [], None),
        # issue 21: every reader, every value, every name
        ("binary config file", ["train", str(binary)], None),
        ("NUL byte in the name", ["train", str(nul_name)], None),
        ("binary study.yaml (status)", ["status", E], binary_study),
        ("empty study.yaml (report: damage, never a default study)", ["report", E], empty_study),
        ("study.yaml holds a list (measure)", ["measure", E, "--device", "cpu"], list_study),
        ("binary run.json (status: that run damaged, the others finished)", ["status", E], binary_run_json),
        ("binary run.json (measure goes on with the others, exits non-zero)",
         ["measure", E, "--force", "--measures", "frobenius_norm", "--device", "cpu"], binary_run_json),
        ("run.json holds a list (train)", ["train", C, "--out", "ROOT"], list_run_json),
        ("finished run.json without its config (status: damaged, not finished)", ["status", E],
         run_json_without_config),
        ("binary measures.json (report)", ["report", E], binary_measures),
        ("measures.json entries of the wrong shape (report keeps the good report)", ["report", E],
         wrong_shaped_entries),
        ("measures.json entries of the wrong shape (measure repairs them)", ["measure", E, "--device", "cpu"],
         wrong_shaped_entries),
        ("`train.lr=.nan` on a finished study", ["train", C, "--out", "ROOT", "train.lr=.nan"], None),
        ("`train.lr=.inf` on a finished study", ["train", C, "--out", "ROOT", "train.lr=.inf"], None),
        ("non-finite measure setting", ["train", C, "--out", "ROOT", "measure.settings={eps_sharpness: {eps: .inf}}"],
         None),
        ("`name=..` (outside --out)", ["train", C, "--out", "ROOT", "name=.."], None),
        ("empty list for a swept field", ["train", C, "--out", "ROOT", "data.random_label_ratio=[]"], None),
        ("`n_train` above the dataset's size", ["train", C, "--out", "ROOT", "data.n_train=100000"], None),
        ("two snapshot levels, one folder name", ["train", C, "--out", "ROOT",
                                                  "train.snapshot_losses=[0.001, 0.0010000001]"], None),
        ("training loss becomes NaN (lr 1e30)", ["train", str(diverging), "--out", str(root / "div"), "--quiet"], None),
        ("`report EXP EXP` (each run counted once)", ["report", E, E], None),
        ("values measured with another n_examples on one shard (report)", ["report", E],
         other_n_examples_on_one_shard),
    ]
    print("| bad input | command | exit | stderr lines | what it says |")
    print("| --- | --- | ---: | ---: | --- |")
    for i, (what, args, damage) in enumerate(cases):
        work = root / f"case{i}"
        exp = work / "tiny"
        shutil.copytree(base, exp)
        if damage:
            damage(exp)
        before = files(exp)
        args = [str(exp) if a == E else str(work) if a == "ROOT" else a for a in args]
        env = {"FLATBENCH_DATA": str(nodata)} if what == "missing dataset files" else None
        result = cli(*args, env=env)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        changed = sorted(k for k in before if files(exp).get(k) != before[k]
                         and not (args and args[0] == "measure" and "measures.json" in k)
                         and not (args and args[0] == "report" and not result.returncode))
        out = result.stdout.splitlines() or [""]
        shown_line = next((line for line in out if "is damaged" in line or "building" in line),
                          next((line for line in out if "damaged" in line), out[0]))
        message = (lines[0] if lines else shown_line).strip()
        message = message.replace(str(root), "…")[:160].replace("|", "\\|")
        if changed and result.returncode:
            message += f" (CHANGED: {', '.join(changed)})"
        shown = " ".join(a.replace(str(root), "…") for a in args)
        print(f"| {what} | `flatbench {shown}` | {result.returncode} | {len(lines)} | {message} |")
    # Ctrl-C while training
    slow = {**TINY, "data": {**TINY["data"], "n_train": 3000, "random_label_ratio": 0.5},
            "model": {"name": "mlp", "widths": [256, 256]}, "train": {"epochs": 2000, "batch_size": 32}}
    slow_cfg = write("slow.yaml", yaml.safe_dump(slow))
    proc = subprocess.Popen([sys.executable, "-m", "flatbench", "train", str(slow_cfg), "--out", str(root / "slow")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # SIGINT's default disposition even when this script runs in the background
                            # (a shell without job control starts it with SIGINT ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and not list((root / "slow").rglob("checkpoint.pt")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate()
    lines = [line for line in err.splitlines() if line.strip()]
    status = json.loads(next((root / "slow").rglob("run.json")).read_text())["status"]
    print(f"| Ctrl-C while training | `flatbench train slow.yaml` | {proc.returncode} | {len(lines)} | "
          f"{lines[0] if lines else ''} (run.json status: {status}) |")
    for what, line in process_cases(root, cfg, base, runs):
        print(line)
    shutil.rmtree(root, ignore_errors=True)


def process_cases(root: Path, cfg: Path, base: Path, runs: list[str]) -> list[tuple[str, str]]:
    """Concurrent writers and killed processes (issue 21): two `measure` processes at once, kill -9 of
    `train --workers 2`, SIGTERM as a run of a sequential `train` ends."""
    rows = []
    env = {**os.environ, "MPLBACKEND": "Agg"}
    exp = root / "concurrent" / "tiny"
    shutil.copytree(base, exp)
    sets = (["hessian_max_eig", "frobenius_norm"], ["eps_sharpness", "spectral_norm"])
    procs = [subprocess.Popen([sys.executable, "-m", "flatbench", "measure", str(exp), "--force", "--device", "cpu",
                               "--quiet", "--measures", ",".join(names)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for names in sets]
    codes = [p.wait() for p in procs]
    kept = all(all(n in json.loads((exp / "runs" / rid / "measures.json").read_text())
                   for n in (*sets[0], *sets[1])) for rid in runs)
    rows.append(("two measures", f"| two `measure` processes at once, other `--measures` | `flatbench measure EXP "
                 f"--measures {','.join(sets[0])}` ‖ `… {','.join(sets[1])}` | {codes[0]}, {codes[1]} | 0 | "
                 f"{'every run keeps the entries of both' if kept else 'ENTRIES LOST'} |"))
    slow = {**TINY, "data": {**TINY["data"], "n_train": 3000, "random_label_ratio": [0.0, 1.0]},
            "model": {"name": "mlp", "widths": [256, 256]}, "train": {"epochs": 2000, "batch_size": 32}}
    slow_cfg = root / "workers.yaml"
    slow_cfg.write_text(yaml.safe_dump(slow))
    proc = subprocess.Popen([sys.executable, "-m", "flatbench", "train", str(slow_cfg), "--out", str(root / "w"),
                             "--workers", "2", "--device", "cpu", "--quiet"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    pids: list[int] = []
    deadline = time.time() + 120
    while time.time() < deadline and len(pids) < 2:
        pids = [int(p.read_text().split()[1]) for p in (root / "w").rglob(".lock")]
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    rows.append(("kill -9 workers", f"| kill -9 of `train --workers 2` | `flatbench train workers.yaml --workers 2` "
                 f"| -9 | 0 | {len(pids)} workers; {'all ended with their parent' if not left else f'{len(left)} ORPHANED'} |"))
    two = {**TINY, "data": {**TINY["data"], "random_label_ratio": 0.5}, "train": {**TINY["train"], "epochs": [2, 2000]}}
    two_cfg = root / "two.yaml"
    two_cfg.write_text(yaml.safe_dump(two))
    proc = subprocess.Popen([sys.executable, "-m", "flatbench", "train", str(two_cfg), "--out", str(root / "t"),
                             "--device", "cpu", "--quiet"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list((root / "t").rglob("model.pt")):
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    try:
        _out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
    states = sorted(json.loads(p.read_text())["status"] for p in (root / "t").rglob("run.json"))
    lines = [line for line in err.splitlines() if line.strip()]
    rows.append(("sigterm", f"| SIGTERM as the first of two runs is saved | `flatbench train two.yaml` | "
                 f"{proc.returncode} | {len(lines)} | {(lines[0] if lines else '')[:100]} (run.json: "
                 f"{', '.join(states)}) |"))
    return rows


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


if __name__ == "__main__":
    main()
