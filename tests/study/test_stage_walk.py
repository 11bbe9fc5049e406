"""Issue 31's goal, walked by the code's own calls (`scripts/walk_stage.py`): following the study through
the measure stage gives at most 20 stays and 8 returns, the same for 2 runs and for 5, and reads as
plan → compute → store (the study's config, its checks, then the registry's plan and the compute loop).
The population audit, following every study object it reads, gives the same walk for 3 runs and for 5: its
plan (every entry and every run's context) is made once, and the per-run loop works from the plan. The train
stage reads the study once, into its plan, on a fresh study as on a finished one: 4 stays, no return. The
report stage, following its settings and what it passes on (records, statistics, the document's context), is
one pass (issue 43): at most 15 stays and 5 returns, the statistics and the document in one stay of
analysis/report.py."""

from __future__ import annotations

from pathlib import Path

import torch
from project_scripts import load_script


def _walker():
    return load_script("walk_stage")


def _study(tmp_path: Path, runs: int):
    """A tiny study of `runs` MLPs (random-label ratios 0..1) with its output in `tmp_path`."""
    from flatbench.config import load_study

    tmp_path.mkdir(parents=True)
    config = tmp_path / "tiny.yaml"
    ratios = ", ".join(f"{i / (runs - 1):g}" for i in range(runs))
    config.write_text(f"name: tiny\ndata: {{dataset: mnist_mini, n_train: 200, random_label_ratio: [{ratios}]}}\n"
                      "model: {name: mlp, widths: [16]}\ntrain: {epochs: 2, batch_size: 50}\n"
                      "measure: {measures: [frobenius_norm, hessian_trace, path_norm], n_examples: 100}\n")
    return load_study(config, out=str(tmp_path))


def _trained(tmp_path: Path, runs: int):
    from flatbench.study.train import train_study

    study = _study(tmp_path, runs)
    train_study(study, torch.device("cpu"), quiet=True, echo=lambda *a: None)
    return study


def _walk_measure(tmp_path: Path, runs: int) -> dict:
    from flatbench.study.measure import measure_study

    walker = _walker()
    study = _trained(tmp_path, runs)
    rooms = walker.walk(lambda: measure_study(study, torch.device("cpu"), quiet=True, echo=lambda *a: None), study)
    return walker.summarize(rooms)


def _walk_audit(tmp_path: Path, runs: int) -> dict:
    from flatbench.study.measure import measure_study
    from flatbench.study.population import audit_population

    walker = _walker()
    study = _trained(tmp_path, runs)
    measure_study(study, torch.device("cpu"), quiet=True, echo=lambda *a: None)
    rooms = walker.walk_by_type(lambda: audit_population(study.exp_dir, measures=["frobenius_norm", "path_norm"],
                                                         draws=1, echo=lambda *a: None))
    return walker.summarize(rooms)


def test_the_measure_stage_enters_each_room_once_however_many_runs(tmp_path):
    two = _walk_measure(tmp_path / "two", 2)
    five = _walk_measure(tmp_path / "five", 5)
    assert five["stays"] <= 20 and five["returns"] <= 8, five
    assert five["sequence"] == two["sequence"], (two["sequence"], five["sequence"])  # no per-run back and forth
    assert five["returns"] == 0 and max(five["entered"].values()) == 1, five
    seq = five["sequence"]
    assert seq[0] == "study/measure.py" and seq[-1] == "measures/runner.py"  # plan first, the compute loop last
    assert seq.index("study/spec.py") < seq.index("measures/runner.py")


def test_the_population_audit_walks_the_same_however_many_runs(tmp_path):
    three = _walk_audit(tmp_path / "three", 3)
    five = _walk_audit(tmp_path / "five", 5)
    assert five["sequence"] == three["sequence"], (three["sequence"], five["sequence"])  # no per-run back and forth
    assert five["returns"] == three["returns"] <= 2 and five["stays"] <= 8, five  # the saved study's reading only
    seq = five["sequence"]
    assert seq.count("measures/runner.py") == 1 and seq.count("study/population.py") == 1, seq
    assert seq.index("study/audit.py") < seq.index("measures/runner.py") < seq.index("study/population.py")


def _walk_train(tmp_path: Path, runs: int, trained_first: bool = False) -> dict:
    """The train stage's walk on a fresh study (every run trained) or on a trained one (every run skipped)."""
    from flatbench.study.train import train_study

    walker = _walker()
    study = _trained(tmp_path, runs) if trained_first else _study(tmp_path, runs)
    rooms = walker.walk(lambda: train_study(study, torch.device("cpu"), quiet=True, echo=lambda *a: None), study)
    return walker.summarize(rooms)


def test_the_train_stage_reads_the_study_once_then_trains_from_its_plan(tmp_path):
    two = _walk_train(tmp_path / "two", 2)
    four = _walk_train(tmp_path / "four", 4)
    resumed = _walk_train(tmp_path / "resumed", 3, trained_first=True)
    assert four["sequence"] == two["sequence"] == resumed["sequence"], (two, four, resumed)
    assert four["returns"] == 0 and max(four["entered"].values()) == 1, four
    assert four["sequence"][0] == "study/train.py" and four["sequence"][-1] == "measures/runner.py", four


def test_the_report_stage_is_one_pass(tmp_path):
    """folders → records → tables → statistics → document: each room entered in that order, analysis/report.py
    once (it was entered 6 times: 32 stays, 20 returns)."""
    from flatbench.study.measure import measure_study
    from flatbench.study.report import report_study

    walker = _walker()
    study = _trained(tmp_path / "four", 4)
    measure_study(study, torch.device("cpu"), quiet=True, echo=lambda *a: None)
    walk = walker.summarize(walker.walk_report(lambda: report_study([study.exp_dir], quiet=True, echo=lambda *a: None,
                                                                    min_train_acc=0.0)))
    assert walk["stays"] <= 15 and walk["returns"] <= 5, walk
    seq = walk["sequence"]
    assert seq.count("analysis/report.py") == 1, seq
    rooms = ["analysis/table.py", "analysis/report.py", "analysis/figures.py", "analysis/verdict_block.py",
             "analysis/sections.py", "analysis/sections_detail.py"]
    assert all(seq.count(room) == 1 for room in rooms[2:]), seq
    assert [seq.index(room) for room in rooms] == sorted(seq.index(room) for room in rooms), seq
