"""Training one run: seeded, resumable, with atomic per-epoch checkpoints.

Determinism: the initial weights come from a seed derived from the run id, and every epoch's batch
order, augmentation and dropout come from seeds derived from (run id, epoch). A run resumed from its
epoch-k checkpoint therefore replays epochs k+1… exactly as an uninterrupted run does, and ends with
bit-identical weights on the CPU.

Preemption: SIGTERM / SIGUSR1 (what Slurm sends before a preemption or the time limit) or SIGUSR2
(submitit's preemption and timeout signal) stops training at the next batch; the last epoch checkpoint
stays on disk, the run is marked `preempted` and the process exits so that it can be requeued (the CLI
with exit code 143; a submitit job requeues itself, see `flatbench.cluster`). Re-running resumes from
the checkpoint.

Speed (`train.precision`, `train.compile`, `train.channels_last`): the data sit on the device and batches
are index slices, loss and accuracy accumulate on the device, so an epoch has no host synchronization
until its end. Groups of small runs train at once in `flatbench.vectorized`.
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

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, name))
"""Signals that make training checkpoint and stop (Slurm: TERM, USR1 via --signal; submitit: USR2)."""


class _StopFlag:
    """Set by SIGTERM/SIGUSR1/SIGUSR2 while a run trains; checked between batches."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopFlag":
        if sys.platform != "win32":
            import threading

            if threading.current_thread() is threading.main_thread():
                for sig in STOP_SIGNALS:
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal = signum

    def check(self) -> None:
        """Raise `Preempted` if a stop signal arrived."""
        if self.signal is not None:
            raise Preempted(f"signal {self.signal}", self.signal)

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
    return make_optimizer_for(model.parameters(), cfg)


def make_optimizer_for(params: Any, cfg: RunConfig) -> torch.optim.Optimizer:
    """The run's optimizer over `params` (also used on a vectorized group's stacked parameters: Adam and
    SGD act elementwise, so one optimizer over stacked tensors is one optimizer per run)."""
    t = cfg.train
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, nesterov=t.nesterov,
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


def uses_channels_last(model: nn.Module, cfg: RunConfig, device: torch.device) -> bool:
    """channels_last pays for convolutions on CUDA only."""
    return (cfg.train.channels_last and device.type == "cuda"
            and any(isinstance(m, nn.Conv2d) for m in model.modules()))


def training_forward(model: nn.Module, cfg: RunConfig, device: torch.device
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Prepare `model` for training on `device` (channels_last in place) and return the forward to train
    with: the model itself, or its `torch.compile`d version. Weights, state_dict and optimizer stay the
    model's own, so checkpoints are the same either way."""
    if uses_channels_last(model, cfg, device):
        model.to(memory_format=torch.channels_last)
    if cfg.train.compile:
        return torch.compile(model)
    return model


def autocast(cfg: RunConfig, device: torch.device) -> Any:
    """bf16 autocast when `train.precision` is bf16, else a no-op context."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16")


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
                epoch: int, stop: _StopFlag, forward: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> EpochStats:
    """One pass over the training set; loss/accuracy accumulate on the device (no per-step sync).

    `forward` (default: the model) is what computes the logits, e.g. from `training_forward`.
    """
    from flatbench.data import augment_batch, epoch_batches

    forward = forward if forward is not None else model
    channels_last = uses_channels_last(model, cfg, ds.x_train.device)

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
        stop.check()
        x = ds.x_train[idx]
        if cfg.data.augment:
            x = augment_batch(x, aug_gen, flip=flip, pad=pad)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = ds.y_train[idx]
        with autocast(cfg, device):
            logits = forward(x)
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
        if check_run_dir(run_path, run_id, cfg) == "finished":  # finished by another job while we waited
            return read_json(run_path / RUN_JSON)
        ds = load_dataset(cfg.data, cfg.seed, device=device)
        model, opt, sched, start_epoch, history = restore_run(run_id, cfg, run_path, ds, device)
        forward = training_forward(model, cfg, device)
        ckpt_path = run_path / CHECKPOINT_FILE
        info = start_info(run_id, cfg, ds, device, sweep_axes, history)
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
                stats = train_epoch(model, opt, ds, cfg, run_id, epoch, stop, forward)
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
        return finish_run(run_id, cfg, run_path, model, ds, info, history, epoch,
                          prior_seconds + time.perf_counter() - t0, progress=progress, echo=echo)


def restore_run(run_id: str, cfg: RunConfig, run_path: Path, ds: Any, device: torch.device
                ) -> tuple[nn.Module, torch.optim.Optimizer, Any, int, list[dict]]:
    """The run's model, optimizer and scheduler: fresh (seeded init), or from its epoch checkpoint."""
    model = init_model(run_id, cfg, ds.input_shape, ds.num_classes, device)
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg)
    ckpt_path = Path(run_path) / CHECKPOINT_FILE
    start_epoch, history = 0, []
    if ckpt_path.is_file():
        start_epoch, history = _load_checkpoint(ckpt_path, model, opt, sched, cfg.config_hash(), device)
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


def finish_run(run_id: str, cfg: RunConfig, run_path: Path, model: nn.Module, ds: Any, info: dict[str, Any],
               history: list[dict], epoch: int, seconds: float, *, progress: bool = True,
               echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Evaluate the trained model, write model.pt and the final run.json, drop the checkpoint."""
    run_path = Path(run_path)
    train_loss, train_acc = evaluate(model, ds.x_train, ds.y_train, cfg.train.eval_batch_size)
    test_loss, test_acc = evaluate(model, ds.x_test, ds.y_test, cfg.train.eval_batch_size)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}  # channels_last → standard layout
    atomic_torch_save(run_path / MODEL_FILE, {"state_dict": state, "run_id": run_id,
                                              "config": cfg.to_dict(), "input_shape": list(ds.input_shape),
                                              "num_classes": ds.num_classes})
    info.update(status="finished", history=history, epochs=epoch, train_acc=train_acc, train_loss=train_loss,
                test_acc=test_acc, test_loss=test_loss, gap_acc=train_acc - test_acc,
                gap_loss=test_loss - train_loss if math.isfinite(test_loss) else float("nan"),
                seconds=round(seconds, 3))
    atomic_write_json(run_path / RUN_JSON, info)
    (run_path / CHECKPOINT_FILE).unlink(missing_ok=True)
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
