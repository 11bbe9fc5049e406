"""Every bad input a user can give flatbench, tried through the real CLI: exit code, stderr lines, message.

    python scripts/bad_inputs.py            # a markdown table (the README's "Bad input" section)

It trains one tiny study (mnist_mini, 3 runs, a few seconds) in a temporary folder, then runs each case on
a fresh copy of it, and checks that nothing finished was lost (the run folders' models and the report are
byte-for-byte the same afterwards, except where the case is a repair). tests/test_cli_errors.py asserts
the same cases one by one.
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

    empty = write("empty.yaml", "")
    bad_yaml = write("bad.yaml", "data: {dataset: mnist_mini\n")
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
                         and not (args and args[0] == "measure" and "measures.json" in k))
        message = (lines[0] if lines else (result.stdout.splitlines() or [""])[0])
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
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
