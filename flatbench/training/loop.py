"""Training one run: seeded, resumable, with atomic per-epoch checkpoints.

Determinism: the initial weights, every epoch's batch order, augmentation and dropout come from seeds
derived from the config fields that shape them (`flatbench.seeding`), never from the run id. A run
resumed from its epoch-k checkpoint therefore replays epochs k+1... exactly as an uninterrupted run does,
and ends with bit-identical weights on the CPU.

Speed (`train.precision`, `train.compile`, `train.channels_last`): the data sit on the device and batches
are index slices, loss and accuracy accumulate on the device, so an epoch has no host synchronization
until its end. Groups of small runs train at once in `flatbench.training.vectorized`.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from flatbench.config import RunConfig
from flatbench.data import load_dataset
from flatbench.locks import RunLock
from flatbench.store import (CHECKPOINT_FILE, MODEL_FILE, RUN_JSON, SNAPSHOTS_DIR, atomic_torch_save, atomic_write_json,
                             file_sha256, read_json)
from flatbench.training.calibration import calibration_record
from flatbench.training.crossing import back_to, crossed, end_check, keep_start, record_stop, seek_crossing
from flatbench.training.endpoint import (check_finite_loss, endpoint_summary, epoch_record, evaluate,
                                         progress_fields, reached_endpoint, target_met)
from flatbench.training.run_folder import (check_run_dir, list_snapshots, model_blob, restore_run, save_snapshots,
                                           start_info, write_checkpoint)
from flatbench.training.setup import channels_last_data, steps_per_batch, training_forward, uses_channels_last
from flatbench.training.signals import Preempted, StopFlag
from flatbench.training.steps import train_epoch

__all__ = ["finish_run", "train_epoch", "train_run"]


def train_run(run_id: str, cfg: RunConfig, run_path: Path, device: torch.device, *, sweep_axes: tuple = (),
              progress: bool = True, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train one run to its endpoint (or resume it); returns its run.json content.

    The endpoint: `train.epochs`, or earlier `train.target_train_acc` / `train.target_train_loss`
    (`reached_endpoint`); with `train.endpoint_tolerance`, the optimizer step at which the loss target is
    crossed (`crossing`). Every `train.eval_every` epochs the whole training set (eval mode) and the test
    set are evaluated (`epoch_record`); models are kept at `train.snapshot_losses` (`save_snapshots`).
    """
    run_path = Path(run_path)
    state = check_run_dir(run_path, run_id, cfg)
    if state == "finished":
        return read_json(run_path / RUN_JSON)
    with RunLock(run_path), StopFlag() as stop:
        stop.check()  # a stop signal before this run started: it does not start
        if check_run_dir(run_path, run_id, cfg) == "finished":  # finished by another job while we waited
            return read_json(run_path / RUN_JSON)
        ds = load_dataset(cfg.data, cfg.data_seed, device=device)
        model, opt, sched, start_epoch, history = restore_run(run_id, cfg, run_path, ds, device)
        if start_epoch == 0:  # trained from the start: snapshots on disk belong to an earlier training
            shutil.rmtree(run_path / SNAPSHOTS_DIR, ignore_errors=True)
        forward = training_forward(model, cfg, device)
        if uses_channels_last(model, cfg, device):
            ds = channels_last_data(ds)
        info = start_info(run_id, cfg, ds, device, sweep_axes, history)
        atomic_write_json(run_path / RUN_JSON, info)
        bar = None
        if progress:
            bar = tqdm(total=cfg.train.epochs, initial=start_epoch, desc=run_id, unit="ep", leave=False,
                       dynamic_ncols=True)
        t0 = time.perf_counter()
        prior_seconds = sum(h.get("seconds", 0.0) for h in history)
        epoch, seek = start_epoch, None
        try:
            epoch, seek = _train_epochs(cfg, run_path, (model, opt, sched, forward), ds, stop, history, epoch, bar)
        except (Preempted, KeyboardInterrupt) as exc:
            status = "preempted" if isinstance(exc, Preempted) else "interrupted"
            info.update(status=status, history=history, epochs=len(history))
            atomic_write_json(run_path / RUN_JSON, info)
            raise
        finally:
            if bar is not None:
                bar.close()
        return finish_run(run_id, cfg, run_path, model, ds, info, history, epoch,
                          prior_seconds + time.perf_counter() - t0, progress=progress, echo=echo, seek=seek)


def _train_epochs(cfg: RunConfig, run_path: Path, trained: tuple, ds: Any, stop: StopFlag, history: list[dict],
                  epoch: int, bar: Any) -> tuple[int, dict | None]:
    """The epochs of a run from `epoch` to its endpoint, each recorded in `history` (with its snapshots and
    checkpoints); returns the number of epochs and, where a step-level endpoint stopped the run inside an
    epoch, what the search for its step found (`crossing.Crossing.seek_info`)."""
    model, opt, sched, forward = trained
    last = history[-1] if history else {}
    last_check = last.get("eval_train_loss")  # the training-set loss at the last epoch's end, where checked
    while epoch < cfg.train.epochs and not reached_endpoint(cfg, history):
        e0 = time.perf_counter()
        start = keep_start(model, opt, sched, cfg)
        stats = train_epoch(model, opt, ds, cfg, "", epoch, stop, forward, sched)
        check_finite_loss(stats.loss, epoch + 1)
        train_eval = end_check(model, ds, cfg, epoch + 1, stats.loss, history)
        if start is not None and crossed(cfg, train_eval):  # the target crossed in this epoch: find the step
            back_to(start, model, opt, sched)
            found = seek_crossing(model, opt, sched, ds, cfg, epoch, stop, forward, last_check)
            if found.crossed:
                record_stop(found, model, ds, cfg, epoch + 1, opt.param_groups[0]["lr"], time.perf_counter() - e0,
                            history)
                save_snapshots(model, cfg, run_path, history, ds)
                return (history[-1]["epoch"] if history else 0), found.seek_info()
            stats, train_eval = found.stats, end_check(model, ds, cfg, epoch + 1, found.stats.loss, history)
        if sched is not None and not steps_per_batch(cfg):
            sched.step()
        epoch += 1
        history.append(epoch_record(model, ds, cfg, epoch, stats, opt.param_groups[0]["lr"],
                                    time.perf_counter() - e0, history, train_eval))
        last_check = train_eval[0] if train_eval is not None else None
        save_snapshots(model, cfg, run_path, history, ds)
        if epoch % cfg.train.checkpoint_every == 0:
            write_checkpoint(run_path / CHECKPOINT_FILE, model, opt, sched, epoch, history, cfg.config_hash())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(progress_fields(history[-1]))
    return epoch, None


def finish_run(run_id: str, cfg: RunConfig, run_path: Path, model: nn.Module, ds: Any, info: dict[str, Any],
               history: list[dict], epoch: int, seconds: float, *, progress: bool = True,
               echo: Callable[[str], None] = print, seek: dict | None = None) -> dict[str, Any]:
    """Evaluate the trained model, write model.pt (and its hash) and the final run.json (with its
    `calibration`, the temperature-calibrated cross-entropies of `training.calibration`, and its `endpoint`
    record where the run has a step-level endpoint; `seek`: what the search for its step found), drop the
    checkpoint, and say how the run ended (one line, also without progress bars)."""
    run_path = Path(run_path)
    train_loss, train_acc = evaluate(model, ds.x_train, ds.y_train, cfg.train.eval_batch_size)
    test_loss, test_acc = evaluate(model, ds.x_test, ds.y_test, cfg.train.eval_batch_size)
    atomic_torch_save(run_path / MODEL_FILE, model_blob(model, cfg, run_id, ds))
    reached = target_met(cfg, running_acc=history[-1]["train_acc"] if history else None, eval_loss=train_loss)
    info.update(status="finished", history=history, epochs=epoch, train_acc=train_acc, train_loss=train_loss,
                test_acc=test_acc, test_loss=test_loss, gap_acc=train_acc - test_acc,
                gap_loss=test_loss - train_loss if math.isfinite(test_loss) else float("nan"),
                reached_target=reached, snapshots=list_snapshots(run_path),
                model_sha256=file_sha256(run_path / MODEL_FILE), seconds=round(seconds, 3))
    calibration = calibration_record(model, ds, cfg.train.eval_batch_size)
    if calibration is not None:
        info["calibration"] = calibration
    endpoint = endpoint_summary(cfg, train_loss, history, ds.n_train, seek)
    if endpoint is not None:
        info["endpoint"] = endpoint
    atomic_write_json(run_path / RUN_JSON, info)
    (run_path / CHECKPOINT_FILE).unlink(missing_ok=True)
    ended = "" if reached is None else (", target reached" if reached else ", target NOT reached")
    if endpoint is not None and not endpoint["within_tolerance"]:
        ended += f", endpoint missed: {endpoint['missed']}"
    echo(f"{run_id}: train acc {train_acc:.4g}, test acc {test_acc:.4g}, gap {train_acc - test_acc:.4g}, "
         f"train loss {train_loss:.4g} ({epoch} epochs{ended}, {info['seconds']:.1f}s)")
    return info
