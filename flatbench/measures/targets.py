"""What the measure stage measures: a *target*, one trained model (a run's final model.pt or one of its
snapshots, `train.snapshot_losses`), with its own measures.json; or a rescaled copy of one (`Rescaling`, what the
audits measure); and what measures.json holds as read from disk.

Reading a target is kept apart from computing on it (`flatbench.measures.runner`): the stage's plan reads
every run.json and measures.json once, here, and passes the targets down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flatbench.errors import FlatbenchError
from flatbench.store import (
    MEASURES_JSON,
    MODEL_FILE,
    RUN_JSON,
    file_problem,
    load_run_info,
    read_json_salvaged,
)


@dataclass(frozen=True)
class Rescaling:
    """A function-preserving rescaling of a target's model (`rescale.transform`): family, factors log-uniform in
    [1/F, F] drawn with `seeding.make_generator(*seed)` (run, family, range, draw: each copy reproducible on
    its own), so that a rescaled copy is measured as any target is loaded (`runner.load_context`)."""

    family: str
    max_factor: float
    draw: int
    seed: tuple = ()


@dataclass(frozen=True)
class Target:
    """One trained model to measure: a run's final model or one of its snapshots, or a rescaled copy of one."""

    run_path: Path
    level: float | None = None
    """The snapshot's train-loss level; None for the final model."""
    folder: Path | None = None
    """Where its model.pt and measures.json are (the run folder for the final model)."""
    sha256: str | None = None
    """A snapshot's recorded model hash (the final model's is in run.json)."""
    info: dict | None = field(default=None, compare=False, repr=False)
    """The run's run.json as the stage's plan read it (None: read it when needed), so that a stage reads
    each run.json once."""
    rescaling: Rescaling | None = None
    """A rescaled copy of the model (its values go to the audit's files, not to measures.json); None: as trained."""

    @property
    def where(self) -> Path:
        return self.folder or self.run_path

    @property
    def measures_file(self) -> Path:
        return self.where / MEASURES_JSON

    @property
    def model_file(self) -> Path:
        return self.where / MODEL_FILE

    @property
    def label(self) -> str:
        r, level = self.rescaling, "" if self.level is None else f"@loss{self.level:g}"
        return self.run_path.name + level + (f" ({r.family}, F = {r.max_factor:g}, draw {r.draw})" if r else "")


def measure_targets(run_path: Path, snapshots: bool = True, info: dict | None = None) -> list[Target]:
    """A finished run's final model and, with `snapshots`, the models it kept at its loss levels. `info`:
    its run.json when the caller has read it (it travels with the targets)."""
    run_path = Path(run_path)
    if info is None:
        try:
            info = load_run_info(run_path)
        except FlatbenchError:
            return [Target(run_path)]
    targets = [Target(run_path, info=info)]
    if snapshots:
        for snap in info.get("snapshots") or []:
            targets.append(Target(run_path, float(snap["level"]), run_path / snap["path"], snap.get("model_sha256"),
                                  info=info))
    return targets


def as_target(target: Target | Path) -> Target:
    return target if isinstance(target, Target) else Target(Path(target))


def not_a_file(path: Path) -> str | None:
    """Why a measures.json that is there is no file at all (a folder, a link to /dev/null): damage that no
    repair can read (an empty or cut-off file is repaired: `read_entries`)."""
    problem = file_problem(path)
    return None if problem is None or problem.startswith("empty") else problem


def read_entries(target: Target | Path) -> tuple[dict[str, Any], str | None]:
    """A target's measures.json entries and, if the file is damaged, what is wrong with it."""
    path = as_target(target).measures_file
    problem = not_a_file(path)
    if problem:
        return {}, problem
    if not path.is_file():
        return {}, None
    entries, problem = read_json_salvaged(path)
    return {k: v for k, v in entries.items() if isinstance(v, dict)}, problem


def model_hash(target: Target | Path) -> str | None:
    """The sha256 of the target's model file as training recorded it (run.json for the final model, the
    snapshot's record for a snapshot); None when none is recorded."""
    target = as_target(target)
    if target.level is not None:
        return target.sha256
    if target.info is not None:
        value = target.info.get("model_sha256")
        return value if isinstance(value, str) else None
    if not (target.run_path / RUN_JSON).is_file():
        return None
    try:
        value = load_run_info(target.run_path).get("model_sha256")
    except FlatbenchError:
        return None
    return value if isinstance(value, str) else None
