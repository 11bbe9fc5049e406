"""Walk a stage by its own calls, following the study: which files ("rooms") it visits, in order.

    python scripts/walk_stage.py measure      # the measure stage of a tiny trained study
    python scripts/walk_stage.py train
    python scripts/walk_stage.py audit        # the population audit of the measured study
    python scripts/walk_stage.py report

Every call into flatbench code whose frame holds the study object or one of its sections (as an argument or
a local) is a visit to that function's file. A *stay* is a run of consecutive visits to one file; a *return* is a stay in a
file the stage had already left; a *climb* is a stay on a higher floor (tests/test_structure.py's FLOORS)
than the stay before it. A stage that reads plan → compute → store enters each room once: few stays, no
returns. The numbers are printed with the sequence of rooms; tests/study/test_stage_walk.py asserts the
goal of issue 31 on the measure stage (at most 20 stays and 8 returns) and on the population audit (the same
walk for 3 runs and for 5). The report stage reads its settings once, then passes its runs' records, their
statistics and the document's context from room to room: its walk follows those too (`walk_report`).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLOORS = {"cli": 6, "study": 5, "api": 5, "measures": 4, "analysis": 4, "training": 3, "curvature": 3,
          "rescale": 3, "data": 2, "models": 2, "config": 1, "store": 1, "losses": 1}


def floor(room: str) -> int:
    return FLOORS.get(room.split("/")[0].removesuffix(".py"), 0)


def _rooms(call, followed) -> list[str]:
    """The rooms (files relative to flatbench/) of the calls, made while `call()` runs, whose frame holds a
    value `followed(value)` is true of."""
    package = str(ROOT / "flatbench")
    rooms: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(package) and any(followed(v) for v in frame.f_locals.values()):
            rooms.append(str(Path(path).relative_to(package)))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return rooms


def walk(call, study) -> list[str]:
    """The rooms of the calls, made while `call()` runs, whose frame holds `study` or one of its sections
    (`study.measure`, `study.report`: what the stage passes on)."""
    sections = (study, study.measure, study.report)
    return _rooms(call, lambda v: any(v is s for s in sections))


def walk_by_type(call) -> list[str]:
    """The rooms of the calls, made while `call()` runs, whose frame holds any Study, MeasureConfig or
    ReportConfig (the audit and report stages read their own from the experiment folder)."""
    from flatbench.config import MeasureConfig, ReportConfig, Study

    return _rooms(call, lambda v: isinstance(v, (Study, MeasureConfig, ReportConfig)))


def walk_report(call) -> list[str]:
    """The report stage's walk: `walk_by_type`'s, also following what the stage passes on (issue 43): a list
    of run records (the runs, as read), the statistics (`Analysis`) and the document's context
    (`ReportContext`). A single record, read where it is used, is not followed (only the lists handed on)."""
    from flatbench.analysis.sections import ReportContext
    from flatbench.analysis.stats import Analysis
    from flatbench.analysis.table import RunRecord
    from flatbench.config import MeasureConfig, ReportConfig, Study

    def followed(v) -> bool:
        if isinstance(v, list):
            return bool(v) and isinstance(v[0], RunRecord)
        return isinstance(v, (Study, MeasureConfig, ReportConfig, Analysis, ReportContext))

    return _rooms(call, followed)


def summarize(rooms: list[str]) -> dict:
    """Stays, returns and climbs of a sequence of visits."""
    stays = [r for i, r in enumerate(rooms) if i == 0 or rooms[i - 1] != r]
    returns = sum(1 for i, r in enumerate(stays) if r in stays[:i])
    climbs = sum(1 for a, b in zip(stays, stays[1:]) if floor(b) > floor(a))
    counts: dict[str, int] = {}
    for room in stays:
        counts[room] = counts.get(room, 0) + 1
    return {"stays": len(stays), "rooms": len(counts), "returns": returns, "climbs": climbs, "sequence": stays,
            "entered": counts}


def tiny_study(where: Path, measures: list[str], ratios: str = "0.0, 1.0"):
    """A study of the packaged MNIST subset, one run per random-label ratio (2 epochs)."""
    from flatbench.config import load_study
    from flatbench.study.train import train_study

    config = where / "tiny.yaml"
    config.write_text("name: tiny\ndata: {dataset: mnist_mini, n_train: 200, random_label_ratio: [" + ratios + "]}\n"
                      "model: {name: mlp, widths: [16]}\ntrain: {epochs: 2, batch_size: 50}\n"
                      f"measure: {{measures: [{', '.join(measures)}], n_examples: 100}}\n")
    study = load_study(config, out=str(where))
    return study, lambda: train_study(study, __import__("torch").device("cpu"), quiet=True)


def main() -> None:
    import torch

    from flatbench.study.measure import measure_study

    stage = sys.argv[1] if len(sys.argv) > 1 else "measure"
    with tempfile.TemporaryDirectory() as tmp:
        ratios = "0.0, 0.25, 0.5, 1.0" if stage in ("audit", "report") else "0.0, 1.0"  # both need ≥ 3 runs
        study, train = tiny_study(Path(tmp), ["frobenius_norm", "hessian_trace", "path_norm"], ratios)
        if stage == "train":
            result = summarize(walk(train, study))
        elif stage in ("audit", "report"):
            from flatbench.study.population import audit_population
            from flatbench.study.report import report_study

            train()
            measure_study(study, torch.device("cpu"), quiet=True, echo=lambda *a: None)
            if stage == "audit":
                call = lambda: audit_population(study.exp_dir, measures=["frobenius_norm", "path_norm"],  # noqa: E731
                                                draws=1, echo=lambda *a: None)
            else:
                call = lambda: report_study([study.exp_dir], quiet=True, echo=lambda *a: None, min_train_acc=0.0)  # noqa: E731
            result = summarize(walk_by_type(call) if stage == "audit" else walk_report(call))
        else:
            train()
            result = summarize(walk(lambda: measure_study(study, torch.device("cpu"), quiet=True,
                                                          echo=lambda *a: None), study))
    print(f"{stage} stage: {result['stays']} stays in {result['rooms']} rooms, {result['returns']} returns, "
          f"{result['climbs']} climbs")
    print(" -> ".join(result["sequence"]))
    print("entered:", ", ".join(f"{room} ×{n}" for room, n in sorted(result["entered"].items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
