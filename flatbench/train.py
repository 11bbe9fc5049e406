"""Training one run: seeded, resumable, with atomic per-epoch checkpoints.

Determinism: the initial weights come from a seed derived from the run id, and every epoch's batch
order, augmentation and dropout come from seeds derived from (run id, epoch). A run resumed from its
epoch-k checkpoint therefore replays epochs k+1… exactly as an uninterrupted run does, and ends with
bit-identical weights on the CPU.

Preemption: SIGTERM / SIGUSR1 (what Slurm sends before a preemption or the time limit) stops training at
the next batch; the last epoch checkpoint stays on disk, the run is marked `preempted` and the process
exits so that it can be requeued. Re-running resumes from the checkpoint.
"""

from __future__ import annotations

import math
import platform
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import flatbench
from flatbench.config import RunConfig, run_config_from_dict
from flatbench.errors import CheckpointError, FlatbenchError
from flatbench.seeding import derive_seed, make_generator
from flatbench.store import (CHECKPOINT_FILE, MODEL_FILE, RUN_JSON, RunLock, atomic_torch_save,
                             atomic_write_json, read_json, torch_load)


class Preempted(Exception):
    """Training was asked to stop by a signal; the last epoch checkpoint is on disk."""


class _StopFlag:
    """Set by SIGTERM/SIGUSR1 while a run trains; checked between batches."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopFlag":
        if sys.platform != "win32":
            import threading

            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGUSR1):
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise FlatbenchError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return torch.device(device)


def make_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    t = cfg.train
    if t.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, nesterov=t.nesterov,
                           weight_decay=t.weight_decay)


def make_scheduler(opt: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LRScheduler | None:
    t = cfg.train
    if t.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t.epochs)
    if t.schedule == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=t.step_size, gamma=t.gamma)
    return None


def init_model(run_id: str, cfg: RunConfig, input_shape: tuple[int, ...], num_classes: int,
               device: torch.device) -> nn.Module:
    """The run's initial model: built under a seed derived from the run id."""
    from flatbench.models import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed("init", run_id, cfg.seed))
        model = build_model(cfg.model, input_shape, num_classes)
    return model.to(device)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of `model` (eval mode) on (x, y)."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.long, device=x.device)
    for i in range(0, x.shape[0], batch_size):
        logits = model(x[i:i + batch_size])
        target = y[i:i + batch_size]
        loss_sum += F.cross_entropy(logits.float(), target, reduction="sum").double()
        correct += (logits.argmax(dim=1) == target).sum()
    model.train(was_training)
    n = max(int(x.shape[0]), 1)
    return float(loss_sum) / n, int(correct) / n


def library_versions() -> dict[str, str]:
    import torchvision

    return {"flatbench": flatbench.__version__, "torch": torch.__version__,
            "torchvision": torchvision.__version__, "python": platform.python_version()}


@dataclass
class EpochStats:
    loss: float
    acc: float


def train_epoch(model: nn.Module, opt: torch.optim.Optimizer, ds: Any, cfg: RunConfig, run_id: str,
                epoch: int, stop: _StopFlag) -> EpochStats:
    """One pass over the training set; loss/accuracy accumulate on the device (no per-step sync)."""
    from flatbench.data import augment_batch, epoch_batches

    device = ds.x_train.device
    gen = make_generator("batches", run_id, cfg.seed, epoch, device=device)
    aug_gen = make_generator("augment", run_id, cfg.seed, epoch, device=device)
    torch.manual_seed(derive_seed("dropout", run_id, cfg.seed, epoch))
    pad = 4 if ds.x_train.shape[-1] >= 32 else 2
    flip = ds.name == "cifar10"
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    for idx in epoch_batches(ds.n_train, cfg.train.batch_size, gen):
        if stop.signal is not None:
            raise Preempted(f"signal {stop.signal}")
        x = ds.x_train[idx]
        if cfg.data.augment:
            x = augment_batch(x, aug_gen, flip=flip, pad=pad)
        y = ds.y_train[idx]
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.detach().double() * idx.numel()
        correct += (logits.detach().argmax(dim=1) == y).sum()
    return EpochStats(float(loss_sum) / ds.n_train, int(correct) / ds.n_train)


def _write_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, epoch: int,
                      history: list[dict], config_hash: str) -> None:
    atomic_torch_save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "scheduler": sched.state_dict() if sched else None, "epoch": epoch,
                             "history": history, "config_hash": config_hash,
                             "rng": {"torch": torch.get_rng_state()}})


def _load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
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
    """'new', 'finished' or 'resume'; a folder holding a different config is an error (never overwritten)."""
    if not (run_path / RUN_JSON).is_file():
        return "new"
    info = read_json(run_path / RUN_JSON)
    if info.get("config_hash") != cfg.config_hash():
        raise FlatbenchError(f"{run_path} holds run '{run_id}' trained with a different config; "
                             "use another --out or experiment name, or delete that folder")
    if info.get("status") == "finished" and (run_path / MODEL_FILE).is_file():
        return "finished"
    return "resume"


def train_run(run_id: str, cfg: RunConfig, run_path: Path, device: torch.device, *, sweep_axes: tuple = (),
              progress: bool = True, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train one run to completion (or resume it); returns its run.json content."""
    from flatbench.data import load_dataset

    run_path = Path(run_path)
    state = check_run_dir(run_path, run_id, cfg)
    if state == "finished":
        return read_json(run_path / RUN_JSON)
    with RunLock(run_path), _StopFlag() as stop:
        ds = load_dataset(cfg.data, cfg.seed, device=device)
        model = init_model(run_id, cfg, ds.input_shape, ds.num_classes, device)
        opt = make_optimizer(model, cfg)
        sched = make_scheduler(opt, cfg)
        ckpt_path = run_path / CHECKPOINT_FILE
        start_epoch, history = 0, []
        if ckpt_path.is_file():
            start_epoch, history = _load_checkpoint(ckpt_path, model, opt, sched, cfg.config_hash(), device)
        info: dict[str, Any] = {
            "run_id": run_id, "status": "running", "config": cfg.to_dict(), "config_hash": cfg.config_hash(),
            "sweep_axes": list(sweep_axes),
            "dataset": {"name": ds.name, "num_classes": ds.num_classes, "input_shape": list(ds.input_shape),
                        "n_train": ds.n_train, "n_test": ds.n_test},
            "labels": ds.label_info, "device": str(device), "host": socket.gethostname(),
            "versions": library_versions(), "history": history,
        }
        atomic_write_json(run_path / RUN_JSON, info)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.train.epochs, initial=start_epoch, desc=run_id, unit="ep", leave=False,
                       dynamic_ncols=True)
        t0 = time.perf_counter()
        prior_seconds = sum(h.get("seconds", 0.0) for h in history)
        epoch = start_epoch
        try:
            while epoch < cfg.train.epochs:
                if history and cfg.train.target_train_acc is not None \
                        and history[-1]["train_acc"] >= cfg.train.target_train_acc:
                    break
                e0 = time.perf_counter()
                stats = train_epoch(model, opt, ds, cfg, run_id, epoch, stop)
                if sched is not None:
                    sched.step()
                epoch += 1
                history.append({"epoch": epoch, "train_loss": stats.loss, "train_acc": stats.acc,
                                "lr": opt.param_groups[0]["lr"], "seconds": round(time.perf_counter() - e0, 3)})
                _write_checkpoint(ckpt_path, model, opt, sched, epoch, history, cfg.config_hash())
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{stats.loss:.3f}", acc=f"{stats.acc:.3f}")
        except Preempted:
            info.update(status="preempted", history=history, epochs=epoch)
            atomic_write_json(run_path / RUN_JSON, info)
            raise
        finally:
            if bar is not None:
                bar.close()
        train_loss, train_acc = evaluate(model, ds.x_train, ds.y_train, cfg.train.eval_batch_size)
        test_loss, test_acc = evaluate(model, ds.x_test, ds.y_test, cfg.train.eval_batch_size)
        atomic_torch_save(run_path / MODEL_FILE, {"state_dict": model.state_dict(), "run_id": run_id,
                                                  "config": cfg.to_dict(), "input_shape": list(ds.input_shape),
                                                  "num_classes": ds.num_classes})
        info.update(status="finished", history=history, epochs=epoch, train_acc=train_acc, train_loss=train_loss,
                    test_acc=test_acc, test_loss=test_loss, gap_acc=train_acc - test_acc,
                    gap_loss=test_loss - train_loss if math.isfinite(test_loss) else float("nan"),
                    seconds=round(prior_seconds + time.perf_counter() - t0, 3))
        atomic_write_json(run_path / RUN_JSON, info)
        ckpt_path.unlink(missing_ok=True)
        if not progress:
            echo(f"{run_id}: train acc {train_acc:.3f}, test acc {test_acc:.3f}, gap {train_acc - test_acc:.3f}"
                 f" ({epoch} epochs, {info['seconds']:.1f}s)")
        return info


def load_model(run_path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a finished run's model from model.pt (corrupt files give a one-line CheckpointError)."""
    from flatbench.models import build_model

    path = Path(run_path) / MODEL_FILE
    blob = torch_load(path, map_location=device)
    if not isinstance(blob, dict) or "state_dict" not in blob or "config" not in blob:
        raise CheckpointError(f"{path} is not a flatbench model file; delete the run folder to retrain")
    cfg = run_config_from_dict(blob["config"])
    model = build_model(cfg.model, tuple(blob["input_shape"]), int(blob["num_classes"]))
    try:
        model.load_state_dict(blob["state_dict"])
    except RuntimeError as exc:
        raise CheckpointError(f"{path} does not match its model config ({str(exc).splitlines()[0]})") from None
    return model.to(device).eval()
