"""The physical floor of a finished study: the FLOPs each stage needs and how far from the CPU's matmul rate
it runs.

    python scripts/study_flops.py results/cpu/yi_mnist [results/cpu/hyperparameters ...]

Per study (a folder written by `flatbench run`, its runs' weights present):

- **train**: counted from the run files: every epoch's optimizer steps (forward + backward ≈ 3 forward
  passes per example) and every evaluation the history records (the whole training and test sets, one
  forward pass per example), plus the final evaluation; a forward pass's FLOPs are the model's
  multiply-adds (Linear, Conv2d) × 2, counted by the torch profiler on one example;
- **measure**: the measure stage of the study's first run (every entry, each in the dtype the study's
  `measure.dtype` gives it, as `flatbench measure` computes them) run again under the torch profiler, which
  counts the FLOPs of matrix products and convolutions, scaled by the number of models measured;
- **audit**: the population audit's rescaled copies of the first run, likewise, scaled by the runs.

It prints each stage's GFLOP (float32 and float64 apart), its wall seconds (walltime.txt and the run
files) and the rate that implies, against the 2-core matmul rate measured in the same process (a 1024 ×
1024 matrix product in float32 and float64, all threads). Element-wise work (activations, the solvers'
vector updates, random numbers) is not counted: the rates are a lower bound of the work done, and the gap
to the matmul rate says how much of a stage is not dense linear algebra, or runs on matrices too small to
reach it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbench.measures.runner import build_context  # noqa: E402
from flatbench.models import load_model  # noqa: E402
from flatbench.store import list_run_dirs, read_json  # noqa: E402
from flatbench.study.audit import measure_config, measure_entry, plan_entries, transform_checked  # noqa: E402
from flatbench.study.population import population_generator  # noqa: E402


def matmul_rate(dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> float:
    """GFLOP/s of an n × n matrix product in `dtype` on all of this process's threads."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n ** 3 * repeats / (time.perf_counter() - t0) / 1e9


def profiled_flops(fn) -> dict[str, float]:
    """FLOPs of the matrix products and convolutions `fn()` runs, by dtype of their inputs."""
    with profile(activities=[ProfilerActivity.CPU], with_flops=True, record_shapes=True) as prof:
        fn()
    out = {"float32": 0.0, "float64": 0.0}
    for event in prof.events():
        flops = getattr(event, "flops", 0) or 0
        if flops:
            dtypes = " ".join(map(str, getattr(event, "input_types", []) or []))
            out["float64" if "double" in dtypes.lower() else "float32"] += float(flops)
    return out


def forward_flops(model: torch.nn.Module, example: torch.Tensor) -> float:
    with torch.no_grad():
        counted = profiled_flops(lambda: model(example[:1]))
    return counted["float32"] + counted["float64"]


def training_flops(runs: list[Path]) -> tuple[float, float]:
    """(FLOPs, seconds recorded in run.json) of training every run, from its history."""
    total, seconds = 0.0, 0.0
    cache: dict[str, float] = {}
    for run in runs:
        info = read_json(run / "run.json")
        data = info["dataset"]
        n_train, n_test = int(data.get("n_train", 0)), int(data.get("n_test", 0))
        key = json.dumps(info["config"]["model"], sort_keys=True) + str(data.get("input_shape"))
        if key not in cache:
            model = load_model(run)
            shape = tuple(data.get("input_shape") or next(model.parameters()).shape[1:])
            cache[key] = forward_flops(model.float(), torch.zeros((1, *shape)))
        fwd = cache[key]
        evals = sum(1 for h in info["history"] if "eval_train_loss" in h) + 1  # + the final evaluation
        total += fwd * (3 * n_train * int(info["epochs"]) + evals * (n_train + n_test))
        seconds += float(info.get("seconds", 0.0))
    return total, seconds


def measure_flops(run: Path) -> dict[str, float]:
    """FLOPs of measuring one run as the study does (every entry in its dtype, one shared context)."""
    cfg = measure_config(run.parent.parent)
    entries = plan_entries(None, cfg)
    ctx = build_context(run, cfg, torch.device("cpu"))
    return profiled_flops(lambda: [measure_entry(ctx, e) for e in entries])


def audit_flops(run: Path, measures: list[str]) -> dict[str, float]:
    """FLOPs of the population audit's six copies of one run (3 draws in each of two factor ranges)."""
    cfg = measure_config(run.parent.parent)
    entries = plan_entries(measures, cfg)
    ctx = build_context(run, cfg, torch.device("cpu"))

    def copies() -> None:
        for factor in (2.0, 100.0):
            for draw in range(3):
                sub, _ = transform_checked(ctx, "node", population_generator(ctx.run_id, "node", factor, draw),
                                           factor, run.name)
                for entry in entries:
                    measure_entry(sub, entry)
    return profiled_flops(copies)


def walltimes(study: Path) -> dict[str, float]:
    """Wall seconds of `flatbench run` and `flatbench audit` from the study's walltime.txt."""
    out: dict[str, float] = {}
    path = study / "walltime.txt"
    for line in path.read_text().splitlines() if path.is_file() else []:
        m = re.match(r"(\d+) s\s+flatbench (run|audit)", line)
        if m:
            out[m.group(2)] = out.get(m.group(2), 0.0) + float(m.group(1))
    return out


def audited_measures(study: Path) -> list[str]:
    """The measures the study's population audit covered (from its audit_correlations.csv)."""
    import pandas as pd

    path = study / "audit_correlations.csv"
    if not path.is_file():
        return []
    names = {str(m).split("@")[0] for m in pd.read_csv(path)["measure"]}
    return sorted(names)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="+")
    args = p.parse_args()
    peak = {"float32": matmul_rate(torch.float32), "float64": matmul_rate(torch.float64)}
    print(f"matmul rate on {torch.get_num_threads()} threads: float32 {peak['float32']:.0f} GFLOP/s, "
          f"float64 {peak['float64']:.0f} GFLOP/s")
    print("| study | stage | GFLOP float32 | GFLOP float64 | wall s | GFLOP/s | % of the matmul rate |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for folder in args.studies:
        study = Path(folder)
        runs = [r for r in list_run_dirs(study) if (r / "model.pt").is_file()]
        if not runs:
            print(f"| {study.name} | (no weights: run the study first) | | | | | |")
            continue
        wall = walltimes(study)
        models = sum(1 + len(read_json(r / "run.json").get("snapshots", [])) for r in runs)
        train_flops, train_seconds = training_flops(runs)
        stages = {"train": {"float32": train_flops, "float64": 0.0}}
        one = measure_flops(runs[0])
        stages["measure"] = {k: v * models for k, v in one.items()}
        measures = audited_measures(study)
        if measures:
            one = audit_flops(runs[0], measures)
            stages["audit"] = {k: v * len(runs) for k, v in one.items()}
        # `flatbench run` is train + measure + report: training's wall time is its runs' recorded seconds over
        # the worker processes that trained them side by side; the rest of the run's wall time is measure
        # and report (the report's ~30 s included)
        workers = max(1, int(read_json(runs[0] / "run.json")["config"]["train"].get("workers", 1)))
        train_s = train_seconds / workers
        seconds = {"train": train_s, "measure": max(wall.get("run", 0.0) - train_s, 0.0),
                   "audit": wall.get("audit", 0.0)}
        for stage, flops in stages.items():
            secs = seconds.get(stage, 0.0)
            rate = (flops["float32"] + flops["float64"]) / 1e9 / secs if secs else float("nan")
            share = flops["float64"] / max(flops["float32"] + flops["float64"], 1.0)
            ceiling = 1 / ((1 - share) / peak["float32"] + share / peak["float64"])
            print(f"| {study.name} | {stage} | {flops['float32'] / 1e9:.0f} | {flops['float64'] / 1e9:.0f} | "
                  f"{secs:.0f} | {rate:.1f} | {100 * rate / ceiling:.1f}% |")


if __name__ == "__main__":
    main()
