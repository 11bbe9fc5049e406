"""The one rule for "this run folder holds the run its run.json says, and that run's numbers can be true",
shared by `flatbench status` (a run that breaks it is `damaged`) and `flatbench report` (which refuses to be
built from such a run, naming it). The shape and ranges of run.json itself (accuracies in [0, 1], losses not
negative) are `store.run_info_problem`, which every reader of run.json applies.

A run.json symlinked or copied from another run, a run folder copied under another id, or a config edited
by hand describes another run than its folder: its measures would be paired with the other run's gap and
that run counted twice. `train` and `measure` refuse such a folder; so do `status` and `report`.
"""

from __future__ import annotations

import os
from pathlib import Path

from flatbench.config import run_config_from_dict
from flatbench.errors import CheckpointError, FlatbenchError
from flatbench.store import MODEL_FILE, RUN_JSON, check_model_hash


def recorded_run_problem(run_path: Path, info: dict) -> str | None:
    """Why a finished run's run.json does not describe the run of its folder, or None: a link to a run.json
    in another folder, a config that does not parse, a config or a run_id naming another run."""
    run_path = Path(run_path)
    where = run_path / RUN_JSON
    if os.path.islink(where) and where.resolve().parent != run_path.resolve():
        return f"{where} is a link to {os.readlink(where)}, another folder's run.json"
    try:
        stored = run_config_from_dict(info["config"])
    except FlatbenchError as exc:
        return f"{where} holds an invalid config ({exc})"
    if stored.run_id() != run_path.name:
        return f"{where} describes run {stored.run_id()}, not {run_path.name} (copied or edited by hand?)"
    if info.get("run_id") not in (None, run_path.name):
        return f"{where} names run {info['run_id']}, not {run_path.name} (copied or edited by hand?)"
    return None


def finished_run_problem(run_path: Path, info: dict, need_model: bool = True) -> str | None:
    """Why a run whose run.json says `finished` is damaged, or None: `recorded_run_problem`, or its model.pt
    missing (`need_model`: the report reads no weights, and the committed studies ship without them) or not
    the file the run wrote, or a snapshot it lists missing."""
    run_path = Path(run_path)
    model = run_path / MODEL_FILE
    if need_model and not model.is_file():
        return f"{model} is missing"
    if model.is_file():
        try:
            check_model_hash(run_path, info)
        except CheckpointError as exc:
            return str(exc)
    problem = recorded_run_problem(run_path, info)
    if problem or not need_model:
        return problem
    for snap in info.get("snapshots") or []:
        if not (run_path / snap["path"] / MODEL_FILE).is_file():
            return f"{run_path / snap['path'] / MODEL_FILE} (a snapshot run.json lists) is missing"
    return None
