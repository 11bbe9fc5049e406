"""The measure stage is planned once (issue 31): the registry and the study checks are asked a fixed number of
times per study, however many runs and snapshots it has, and each run.json and measures.json is read once."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

from flatbench.config import load_study
from flatbench.study.measure import measure_study
from flatbench.study.train import train_study

LOOKUPS = {("registry.py", "get_measure"), ("registry.py", "all_measures"), ("registry.py", "load_plugins"),
           ("registry.py", "resolve_names"), ("spec.py", "check_study"), ("runner.py", "plan_measures"),
           ("runner.py", "check_settings")}


def _trained(where: Path, ratios: list[float]):
    where.mkdir(parents=True, exist_ok=True)
    config = where / "tiny.yaml"
    config.write_text("name: tiny\ndata: {dataset: mnist_mini, n_train: 200}\nmodel: {name: mlp, widths: [16]}\n"
                      "train: {epochs: 2, batch_size: 50, snapshot_losses: [2.25]}\n"
                      "measure: {measures: [frobenius_norm, path_norm, hessian_trace], n_examples: 50}\n")
    study = load_study(config, [f"data.random_label_ratio={ratios}"], out=str(where))
    train_study(study, torch.device("cpu"), quiet=True, echo=lambda *a: None)
    return study


def _measure_counting(study, force: bool = False) -> tuple[collections.Counter, collections.Counter, int]:
    calls: collections.Counter = collections.Counter()
    reads: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        where = (Path(frame.f_code.co_filename).name, frame.f_code.co_name)
        if where in LOOKUPS:
            calls[where] += 1
        if where in (("store.py", "read_json"), ("store.py", "read_json_salvaged")):
            reads[Path(frame.f_locals["path"]).name] += 1

    sys.setprofile(profile)
    try:
        counts = measure_study(study, torch.device("cpu"), quiet=True, echo=lambda *a: None, force=force)
    finally:
        sys.setprofile(None)
    return calls, reads, counts.measured


def test_the_measure_stage_asks_the_registry_and_the_checks_once_per_study(tmp_path):
    small = _trained(tmp_path / "a", [0.0, 1.0])
    large = _trained(tmp_path / "b", [0.0, 0.25, 0.5, 1.0])
    calls_small, reads_small, models_small = _measure_counting(small)
    calls_large, reads_large, models_large = _measure_counting(large)
    assert models_large > models_small >= 2
    assert calls_small == calls_large, (calls_small, calls_large)  # independent of the number of models
    assert calls_small[("spec.py", "check_study")] == 1
    assert calls_small[("runner.py", "plan_measures")] == 1  # snapshots measure the same measures here
    assert calls_small[("registry.py", "get_measure")] <= 3 * 3  # per name: checked, its settings checked, planned
    runs = len(large.runs)
    assert reads_large["run.json"] == runs, reads_large  # once per run, though each has a snapshot too
    _, again, models = _measure_counting(large, force=True)  # every measures.json is there now
    assert again["measures.json"] == models, again  # once per model (none was written by another process)
    assert again["run.json"] == runs, again


def test_a_measures_file_written_by_another_process_after_planning_is_read_again(tmp_path):
    """The plan's read of measures.json is not trusted once another process wrote the file: the model is
    planned again under its lock, so nothing that process computed is lost or computed twice."""
    from flatbench.measures.runner import measure_planned, plan_measures, plan_target
    from flatbench.store import read_json
    from flatbench.study.measure import plan_measure_stage

    study = _trained(tmp_path, [0.0])
    plan = plan_measure_stage(study, quiet=True, echo=lambda *a: None)
    first = plan.targets[0]
    assert len(first.todo) == 3
    # another process measures frobenius_norm meanwhile
    other = plan_target(first.target, plan_measures(["frobenius_norm"], study.measure))
    measure_planned(other, study.measure, torch.device("cpu"))
    before = read_json(first.target.measures_file)["frobenius_norm"]
    report = measure_planned(first, study.measure, torch.device("cpu"))
    after = read_json(first.target.measures_file)
    assert after["frobenius_norm"] == before  # kept, not recomputed
    assert {"path_norm", "hessian_trace"} <= set(after) and report.errors == 0
