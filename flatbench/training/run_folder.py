"""A run's folder: checkpoints, snapshots, run.json, and the checks that refuse a folder that is not
the run's.

Every file is written atomically (`flatbench.store`), so an interrupted write never leaves a half
checkpoint; run.json records the model's sha256 so that a replaced or edited model.pt is refused later.
"""

from __future__ import annotations

import importlib.metadata
import platform
import socket
from pathlib import Path
from typing import Any

import torch
from torch import nn

import flatbench
from flatbench.config import RunConfig, identity_diff, run_config_from_dict, snapshot_folder_name
from flatbench.errors import CheckpointError, FlatbenchError
from flatbench.store import (CHECKPOINT_FILE, MODEL_FILE, RUN_JSON, SNAPSHOT_JSON, SNAPSHOTS_DIR, atomic_torch_save,
                             atomic_write_json, check_model_hash, file_sha256, load_run_info, read_json, torch_load)
from flatbench.training.calibration import calibration_record
from flatbench.training.setup import init_model, make_optimizer, make_scheduler


def _installed_version(package: str) -> str:
    """The installed version of `package`, read from its metadata: importing torchvision only to read its
    version costs seconds (it imports torch's compiler stack) in every training process."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def library_versions() -> dict[str, str]:
    return {"flatbench": flatbench.__version__, "torch": torch.__version__,
            "torchvision": _installed_version("torchvision"), "python": platform.python_version()}


def write_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, epoch: int,
                      history: list[dict], config_hash: str) -> None:
    atomic_torch_save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "scheduler": sched.state_dict() if sched else None, "epoch": epoch,
                             "history": history, "config_hash": config_hash,
                             "rng": {"torch": torch.get_rng_state()}})


def load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
                     config_hash: str, device: torch.device) -> tuple[int, list[dict]]:
    ckpt = torch_load(path, map_location=device)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "epoch" not in ckpt:
        raise CheckpointError(f"{path} is not a flatbench checkpoint; delete it to retrain the run")
    if ckpt.get("config_hash") != config_hash:
        raise CheckpointError(f"{path} was written for a different config; delete it to retrain the run")
    try:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        if sched is not None and ckpt.get("scheduler"):
            sched.load_state_dict(ckpt["scheduler"])
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path} does not match the model ({str(exc).splitlines()[0]}); "
                              "delete it to retrain the run") from None
    return int(ckpt["epoch"]), list(ckpt.get("history", []))


def check_run_dir(run_path: Path, run_id: str, cfg: RunConfig) -> str:
    """'new', 'finished' or 'resume'.

    A folder whose run.json holds another config than the run's (a hand-edited run.json, an id collision)
    or whose model.pt does not match the hash recorded at the end of training is refused with one line
    naming what differs: it is never overwritten, retrained or measured.
    """
    if not (run_path / RUN_JSON).is_file():
        return "new"
    info = load_run_info(run_path)
    check_identity(run_path, info, cfg)
    if info.get("status") == "finished" and (run_path / MODEL_FILE).is_file():
        check_model_hash(run_path, info)
        return "finished"
    return "resume"


def check_identity(run_path: Path, info: dict, cfg: RunConfig) -> None:
    """Refuse a run folder whose stored config is not `cfg` (one line naming the differing keys)."""
    stored = info.get("config")
    if not isinstance(stored, dict):
        raise FlatbenchError(f"{run_path / RUN_JSON} has no config; delete the folder to retrain the run")
    try:
        stored_cfg = run_config_from_dict(stored)
    except FlatbenchError as exc:
        raise FlatbenchError(f"{run_path / RUN_JSON} holds an invalid config ({exc})") from None
    diff = identity_diff(stored_cfg, cfg)
    if diff:
        raise FlatbenchError(f"{run_path} holds another run than its id says ({'; '.join(diff)}); it was "
                             "edited by hand or two configs collide: move it away or delete it")
    if stored_cfg.run_id() != run_path.name:
        raise FlatbenchError(f"{run_path}: its run.json describes run {stored_cfg.run_id()}, not "
                             f"{run_path.name}; move it away or delete it")


def snapshot_path(run_path: Path, level: float) -> Path:
    """Folder of the model kept when the training loss first reached `level`."""
    return Path(run_path) / SNAPSHOTS_DIR / snapshot_folder_name(level)


def save_snapshots(model: nn.Module, cfg: RunConfig, run_path: Path, history: list[dict], ds: Any
                   ) -> list[float]:
    """Keep the model at every `train.snapshot_losses` level that the last evaluation reached for the first
    time: `snapshots/loss_<level>/model.pt` and `snapshot.json` (epoch, losses, accuracies, gaps, the
    model's sha256, its `calibration` of `training.calibration`). Returns the levels saved now. A level
    already on disk is kept (a resumed run)."""
    last = history[-1] if history else {}
    loss = last.get("eval_train_loss")
    if loss is None:
        return []
    saved = []
    for level in sorted(cfg.train.snapshot_losses, reverse=True):
        folder = snapshot_path(run_path, level)
        if loss > level or (folder / SNAPSHOT_JSON).is_file():
            continue
        atomic_torch_save(folder / MODEL_FILE, model_blob(model, cfg, Path(run_path).name, ds))
        record = {"level": level, "epoch": last["epoch"], "train_loss": loss, "train_acc": last["eval_train_acc"],
                  "test_loss": last["test_loss"], "test_acc": last["test_acc"],
                  "gap_acc": last["eval_train_acc"] - last["test_acc"],
                  "gap_loss": last["test_loss"] - loss, "model_sha256": file_sha256(folder / MODEL_FILE)}
        calibration = calibration_record(model, ds, cfg.train.eval_batch_size)
        if calibration is not None:
            record["calibration"] = calibration
        atomic_write_json(folder / SNAPSHOT_JSON, record)
        saved.append(level)
    return saved


def list_snapshots(run_path: Path) -> list[dict]:
    """The snapshot records of a run, largest loss level first."""
    base = Path(run_path) / SNAPSHOTS_DIR
    if not base.is_dir():
        return []
    records = []
    for folder in base.iterdir():
        if (folder / SNAPSHOT_JSON).is_file():
            rec = read_json(folder / SNAPSHOT_JSON)
            if not isinstance(rec, dict) or not isinstance(rec.get("level"), (int, float)) \
                    or isinstance(rec.get("level"), bool):
                raise CheckpointError(f"{folder / SNAPSHOT_JSON} is damaged (not a snapshot record); delete "
                                      f"{folder} to keep the run without it, or the run folder to retrain it")
            rec["path"] = f"{SNAPSHOTS_DIR}/{folder.name}"
            records.append(rec)
    return sorted(records, key=lambda r: -float(r["level"]))


def model_blob(model: nn.Module, cfg: RunConfig, run_id: str, ds: Any) -> dict[str, Any]:
    """What model.pt holds: the weights (standard layout) and what is needed to rebuild the model."""
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    return {"state_dict": state, "run_id": run_id, "config": cfg.to_dict(),
            "input_shape": list(ds.input_shape), "num_classes": ds.num_classes}


def restore_run(run_id: str, cfg: RunConfig, run_path: Path, ds: Any, device: torch.device
                ) -> tuple[nn.Module, torch.optim.Optimizer, Any, int, list[dict]]:
    """The run's model, optimizer and scheduler: fresh (seeded init), or from its epoch checkpoint."""
    model = init_model(run_id, cfg, ds.input_shape, ds.num_classes, device)
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg)
    ckpt_path = Path(run_path) / CHECKPOINT_FILE
    start_epoch, history = 0, []
    if ckpt_path.is_file():
        start_epoch, history = load_checkpoint(ckpt_path, model, opt, sched, cfg.config_hash(), device)
    return model, opt, sched, start_epoch, history


def start_info(run_id: str, cfg: RunConfig, ds: Any, device: torch.device, sweep_axes: tuple | list,
               history: list[dict]) -> dict[str, Any]:
    """run.json while the run trains (status `running`)."""
    return {
        "run_id": run_id, "status": "running", "config": cfg.to_dict(), "config_hash": cfg.config_hash(),
        "sweep_axes": list(sweep_axes),
        "dataset": {"name": ds.name, "num_classes": ds.num_classes, "input_shape": list(ds.input_shape),
                    "n_train": ds.n_train, "n_test": ds.n_test},
        "labels": ds.label_info, "device": str(device), "host": socket.gethostname(),
        "versions": library_versions(), "history": history,
    }
