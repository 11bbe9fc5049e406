"""Training one run: seeded, resumable, with atomic per-epoch checkpoints.

Determinism: the initial weights, every epoch's batch order, augmentation and dropout come from seeds
derived from the config fields that shape them (`flatbench.seeding`), never from the run id. A run
resumed from its epoch-k checkpoint therefore replays epochs k+1… exactly as an uninterrupted run does,
and ends with bit-identical weights on the CPU.

Endpoint: a run stops at `train.epochs`, or earlier at `train.target_train_acc` (running accuracy of an
epoch) or `train.target_train_loss` (the loss of the whole training set in eval mode, evaluated every
`train.eval_every` epochs together with the test set), so that every run of a study ends at a comparable
point; models are kept at `train.snapshot_losses` on the way. run.json records whether the target was
reached and the model's sha256 (so a replaced or edited model.pt is refused later).

Preemption: SIGTERM / SIGUSR1 (what Slurm sends before a preemption or the time limit) or SIGUSR2
(submitit's preemption and timeout signal) stops training at the next batch; the last epoch checkpoint
stays on disk, the run is marked `preempted` and the process exits so that it can be requeued (the CLI
with exit code 143; a submitit job requeues itself, see `flatbench.study.cluster`). Ctrl-C marks it
`interrupted` the same way. Re-running resumes from the checkpoint.

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
from flatbench.config import RunConfig, identity_diff, run_config_from_dict
from flatbench.errors import CheckpointError, FlatbenchError
from flatbench.seeding import augment_generator, batch_generator, dropout_seed, init_seed
from flatbench.store import (CHECKPOINT_FILE, MODEL_FILE, RUN_JSON, SNAPSHOT_JSON, SNAPSHOTS_DIR, RunLock, check_model_hash, file_sha256,
                             atomic_torch_save, atomic_write_json, read_json, torch_load)


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


class InverseTimeDecay:
    """lr_t = lr / (1 + decay·t) after t minibatch steps (the minimum-sharpness reference code's schedule).

    A class rather than a lambda so that LambdaLR's state_dict (and so a checkpoint) records it."""

    def __init__(self, decay: float):
        self.decay = decay

    def __call__(self, step: int) -> float:
        return 1.0 / (1.0 + self.decay * step)


def make_scheduler(opt: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The run's schedule; it steps once per epoch, except `inverse_time`, which steps once per minibatch
    (see `steps_per_batch`)."""
    t = cfg.train
    if t.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t.epochs)
    if t.schedule == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=t.step_size, gamma=t.gamma)
    if t.schedule == "inverse_time":
        return torch.optim.lr_scheduler.LambdaLR(opt, InverseTimeDecay(t.lr_decay))
    return None


def steps_per_batch(cfg: RunConfig) -> bool:
    """Whether the schedule steps after every minibatch (inverse_time) instead of every epoch."""
    return cfg.train.schedule == "inverse_time"


def init_model(run_id: str, cfg: RunConfig, input_shape: tuple[int, ...], num_classes: int,
               device: torch.device) -> nn.Module:
    """The run's initial model, built under `seeding.init_seed` (seed and model fields, not the run id)."""
    from flatbench.models import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed(cfg))
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
                epoch: int, stop: _StopFlag, forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
                sched: Any = None) -> EpochStats:
    """One pass over the training set; loss/accuracy accumulate on the device (no per-step sync).

    `forward` (default: the model) is what computes the logits, e.g. from `training_forward`. `sched` is
    stepped after every minibatch when the schedule is per step (`steps_per_batch`); an epoch schedule is
    the caller's to step.
    """
    per_step = sched if sched is not None and steps_per_batch(cfg) else None
    from flatbench.data import augment_batch, epoch_batches

    forward = forward if forward is not None else model
    channels_last = uses_channels_last(model, cfg, ds.x_train.device)

    device = ds.x_train.device
    gen = batch_generator(cfg, epoch, device=device)
    aug_gen = augment_generator(cfg, epoch, device=device)
    torch.manual_seed(dropout_seed(cfg, epoch))
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
        if per_step is not None:
            per_step.step()
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
    """'new', 'finished' or 'resume'.

    A folder whose run.json holds another config than the run's (a hand-edited run.json, an id collision)
    or whose model.pt does not match the hash recorded at the end of training is refused with one line
    naming what differs: it is never overwritten, retrained or measured.
    """
    if not (run_path / RUN_JSON).is_file():
        return "new"
    info = read_json(run_path / RUN_JSON)
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


def train_run(run_id: str, cfg: RunConfig, run_path: Path, device: torch.device, *, sweep_axes: tuple = (),
              progress: bool = True, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train one run to its endpoint (or resume it); returns its run.json content.

    The endpoint: `train.epochs`, or earlier `train.target_train_acc` / `train.target_train_loss`
    (`reached_endpoint`). Every `train.eval_every` epochs the whole training set (eval mode) and the test
    set are evaluated (`epoch_record`); models are kept at `train.snapshot_losses` (`save_snapshots`).
    """
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
            while epoch < cfg.train.epochs and not reached_endpoint(cfg, history):
                e0 = time.perf_counter()
                stats = train_epoch(model, opt, ds, cfg, run_id, epoch, stop, forward, sched)
                if sched is not None and not steps_per_batch(cfg):
                    sched.step()
                epoch += 1
                history.append(epoch_record(model, ds, cfg, epoch, stats, opt.param_groups[0]["lr"],
                                            time.perf_counter() - e0))
                save_snapshots(model, cfg, run_path, history, ds)
                _write_checkpoint(ckpt_path, model, opt, sched, epoch, history, cfg.config_hash())
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(progress_fields(history[-1]))
        except (Preempted, KeyboardInterrupt) as exc:
            status = "preempted" if isinstance(exc, Preempted) else "interrupted"
            info.update(status=status, history=history, epochs=epoch)
            atomic_write_json(run_path / RUN_JSON, info)
            raise
        finally:
            if bar is not None:
                bar.close()
        return finish_run(run_id, cfg, run_path, model, ds, info, history, epoch,
                          prior_seconds + time.perf_counter() - t0, progress=progress, echo=echo)


# ---------------------------------------------------------------- the endpoint: evaluation, targets, snapshots


def evaluates_at(cfg: RunConfig, epoch: int) -> bool:
    """Whether the end of `epoch` (1-based) evaluates the whole training and test sets."""
    return epoch % cfg.train.eval_every == 0 or epoch >= cfg.train.epochs


def epoch_record(model: nn.Module, ds: Any, cfg: RunConfig, epoch: int, stats: EpochStats, lr: float,
                 seconds: float) -> dict[str, Any]:
    """One history entry: the epoch's running train loss/accuracy (training mode, as the optimizer saw
    them), and at evaluation epochs the whole training set's loss/accuracy in eval mode on the labels
    trained on (`eval_train_*`, what the loss target and snapshots use) and the test set's."""
    record: dict[str, Any] = {"epoch": epoch, "train_loss": stats.loss, "train_acc": stats.acc, "lr": float(lr),
                              "seconds": round(seconds, 3)}
    if evaluates_at(cfg, epoch):
        bs = cfg.train.eval_batch_size
        record["eval_train_loss"], record["eval_train_acc"] = evaluate(model, ds.x_train, ds.y_train, bs)
        record["test_loss"], record["test_acc"] = evaluate(model, ds.x_test, ds.y_test, bs)
    return record


def reached_endpoint(cfg: RunConfig, history: list[dict]) -> bool:
    """Whether training stops after the last epoch in `history`: its running train accuracy reached
    `target_train_acc`, or its evaluated whole-training-set loss reached `target_train_loss`."""
    if not history:
        return False
    last = history[-1]
    t = cfg.train
    if t.target_train_acc is not None and last["train_acc"] >= t.target_train_acc:
        return True
    loss = last.get("eval_train_loss")
    return t.target_train_loss is not None and loss is not None and loss <= t.target_train_loss


def progress_fields(record: dict) -> dict[str, str]:
    """What the progress bar shows after an epoch."""
    fields = {"loss": f"{record.get('eval_train_loss', record['train_loss']):.3g}",
              "acc": f"{record.get('eval_train_acc', record['train_acc']):.3f}"}
    if "test_acc" in record:
        fields["test"] = f"{record['test_acc']:.3f}"
    return fields


def snapshot_path(run_path: Path, level: float) -> Path:
    """Folder of the model kept when the training loss first reached `level`."""
    return Path(run_path) / SNAPSHOTS_DIR / f"loss_{level:g}"


def save_snapshots(model: nn.Module, cfg: RunConfig, run_path: Path, history: list[dict], ds: Any
                   ) -> list[float]:
    """Keep the model at every `train.snapshot_losses` level that the last evaluation reached for the first
    time: `snapshots/loss_<level>/model.pt` and `snapshot.json` (epoch, losses, accuracies, gaps, the
    model's sha256). Returns the levels saved now. A level already on disk is kept (a resumed run)."""
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
            rec["path"] = f"{SNAPSHOTS_DIR}/{folder.name}"
            records.append(rec)
    return sorted(records, key=lambda r: -float(r["level"]))


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


def model_blob(model: nn.Module, cfg: RunConfig, run_id: str, ds: Any) -> dict[str, Any]:
    """What model.pt holds: the weights (standard layout) and what is needed to rebuild the model."""
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    return {"state_dict": state, "run_id": run_id, "config": cfg.to_dict(),
            "input_shape": list(ds.input_shape), "num_classes": ds.num_classes}


def finish_run(run_id: str, cfg: RunConfig, run_path: Path, model: nn.Module, ds: Any, info: dict[str, Any],
               history: list[dict], epoch: int, seconds: float, *, progress: bool = True,
               echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Evaluate the trained model, write model.pt (and its hash) and the final run.json, drop the
    checkpoint, and say how the run ended (one line, also without progress bars)."""
    run_path = Path(run_path)
    train_loss, train_acc = evaluate(model, ds.x_train, ds.y_train, cfg.train.eval_batch_size)
    test_loss, test_acc = evaluate(model, ds.x_test, ds.y_test, cfg.train.eval_batch_size)
    atomic_torch_save(run_path / MODEL_FILE, model_blob(model, cfg, run_id, ds))
    t = cfg.train
    reached = None
    if t.target_train_loss is not None:
        reached = train_loss <= t.target_train_loss
    elif t.target_train_acc is not None:
        reached = bool(history) and history[-1]["train_acc"] >= t.target_train_acc
    info.update(status="finished", history=history, epochs=epoch, train_acc=train_acc, train_loss=train_loss,
                test_acc=test_acc, test_loss=test_loss, gap_acc=train_acc - test_acc,
                gap_loss=test_loss - train_loss if math.isfinite(test_loss) else float("nan"),
                reached_target=reached, snapshots=list_snapshots(run_path),
                model_sha256=file_sha256(run_path / MODEL_FILE), seconds=round(seconds, 3))
    atomic_write_json(run_path / RUN_JSON, info)
    (run_path / CHECKPOINT_FILE).unlink(missing_ok=True)
    ended = "" if reached is None else (", target reached" if reached else ", target NOT reached")
    echo(f"{run_id}: train acc {train_acc:.4g}, test acc {test_acc:.4g}, gap {train_acc - test_acc:.4g}, "
         f"train loss {train_loss:.4g} ({epoch} epochs{ended}, {info['seconds']:.1f}s)")
    return info
