"""The endpoint of a run: evaluation, the training targets, and what each epoch records.

A run stops at `train.epochs`, or earlier at `train.target_train_acc` (running accuracy of an epoch) or
`train.target_train_loss` (the whole training set's loss in eval mode, evaluated every `train.eval_every`
epochs together with the test set, and only once the running loss is near the next loss level:
`evaluates_at`, `train.lazy_eval`), so that every run of a study ends at a comparable point.
`target_met` is the one rule for "did the run reach its target", used both to stop and to record
`reached_target` in run.json.

With `train.endpoint_tolerance` the loss target is checked at step resolution (`step_endpoint`): the end of
every epoch near the target is checked (`checks_epoch_end`), and the epoch in which the loss crossed the
target is replayed step by step (`flatbench.training.crossing`); run.json's `endpoint` record
(`endpoint_summary`) says where the run stopped and whether that is within the tolerance
(`store.endpoint_miss`, the rule the report applies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flatbench.config import RunConfig
from flatbench.store import endpoint_miss


class TrainingDiverged(Exception):
    """The training loss became NaN or infinite: the run fails (its error names the epoch)."""


def check_finite_loss(loss: float, epoch: int) -> None:
    """Raise `TrainingDiverged` when an epoch's (1-based) running training loss is not finite."""
    if not math.isfinite(loss):
        raise TrainingDiverged(f"the training loss became {loss} in epoch {epoch}; lower train.lr or check the "
                               "data")


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


@dataclass
class EpochStats:
    loss: float
    acc: float


def next_loss_level(cfg: RunConfig, history: list[dict]) -> float | None:
    """The largest loss level (snapshot levels and the target) that no evaluation in `history` reached yet;
    None when there is none left (or none configured)."""
    t = cfg.train
    levels = set(t.snapshot_losses) | ({t.target_train_loss} if t.target_train_loss is not None else set())
    best = min((h["eval_train_loss"] for h in history if h.get("eval_train_loss") is not None),
               default=math.inf)
    pending = [level for level in levels if best > level]
    return max(pending) if pending else None


def evaluates_at(cfg: RunConfig, epoch: int, running_loss: float | None = None,
                 history: list[dict] | tuple = ()) -> bool:
    """Whether the end of `epoch` (1-based) evaluates the whole training and test sets: every
    `train.eval_every` epochs and at the last, except that with `train.lazy_eval` = K > 0 an evaluation
    epoch is skipped while the epoch's running loss is above K times the next loss level to check
    (`next_loss_level`); epochs that are powers of two are always evaluated (the curves' early points)."""
    t = cfg.train
    if epoch >= t.epochs:
        return True
    if epoch % t.eval_every:
        return False
    if not t.lazy_eval or epoch & (epoch - 1) == 0 or running_loss is None or not math.isfinite(running_loss):
        return True
    level = next_loss_level(cfg, list(history))
    return level is None or running_loss <= t.lazy_eval * level


def epoch_record(model: nn.Module, ds: Any, cfg: RunConfig, epoch: int, stats: EpochStats, lr: float,
                 seconds: float, history: list[dict] | tuple = (),
                 train_eval: tuple[float, float] | None = None) -> dict[str, Any]:
    """One history entry: the epoch's running train loss/accuracy (training mode, as the optimizer saw
    them), and at evaluation epochs (`evaluates_at`, given the run's `history` so far) the whole training
    set's loss/accuracy in eval mode on the labels trained on (`eval_train_*`, what the loss target and
    snapshots use; `train_eval` when the caller has evaluated it already) and, where `tests_at` says so,
    the test set's."""
    record: dict[str, Any] = {"epoch": epoch, "train_loss": stats.loss, "train_acc": stats.acc, "lr": float(lr),
                              "seconds": round(seconds, 3)}
    if evaluates_at(cfg, epoch, stats.loss, history):
        bs = cfg.train.eval_batch_size
        if train_eval is None:
            train_eval = evaluate(model, ds.x_train, ds.y_train, bs)
        record["eval_train_loss"], record["eval_train_acc"] = train_eval
        if tests_at(cfg, epoch, record, history):
            record["test_loss"], record["test_acc"] = evaluate(model, ds.x_test, ds.y_test, bs)
    return record


# ---------------------------------------------------------------- the step-level endpoint


@dataclass(frozen=True)
class StepEndpoint:
    """`train.endpoint_tolerance` and its settings: stop at the first check (every `check_steps` optimizer
    steps) at which the training-set loss is at most `target`, within the band [`floor`, `target`]."""

    target: float
    tolerance: float
    check_steps: int
    scale_step: bool

    @property
    def floor(self) -> float:
        """The lowest loss within the tolerance: (1 − tolerance)·target."""
        return (1 - self.tolerance) * self.target


def step_endpoint(cfg: RunConfig) -> StepEndpoint | None:
    """The run's step-level endpoint, or None (no `train.endpoint_tolerance`: epoch-level checks only)."""
    t = cfg.train
    if t.endpoint_tolerance is None or t.target_train_loss is None:
        return None
    return StepEndpoint(t.target_train_loss, t.endpoint_tolerance, t.endpoint_check_steps, t.endpoint_scale_step)


def checks_epoch_end(cfg: RunConfig, epoch: int, running_loss: float, history: list[dict] | tuple = ()) -> bool:
    """Whether the end of `epoch` (1-based) evaluates the whole training set: where the history records an
    evaluation (`evaluates_at`), and with the step-level endpoint also at every epoch whose running loss is at
    most `train.lazy_eval` times the target (every epoch with lazy_eval 0), whatever `train.eval_every`, so
    that the epoch in which the loss crosses the target is the one found."""
    if evaluates_at(cfg, epoch, running_loss, history):
        return True
    endpoint = step_endpoint(cfg)
    if endpoint is None:
        return False
    k = cfg.train.lazy_eval
    return not k or not math.isfinite(running_loss) or running_loss <= k * endpoint.target


def crossing_record(model: nn.Module, ds: Any, cfg: RunConfig, epoch: int, stats: EpochStats, lr: float,
                    seconds: float, steps: int, train_eval: tuple[float, float]) -> dict[str, Any]:
    """The history entry of the epoch in which a run stopped at its step-level endpoint after `steps` of its
    optimizer steps: the running loss/accuracy of those steps, the training set's at the stop (`train_eval`,
    the check that stopped it) and the test set's."""
    bs = cfg.train.eval_batch_size
    record: dict[str, Any] = {"epoch": epoch, "train_loss": stats.loss, "train_acc": stats.acc, "lr": float(lr),
                              "seconds": round(seconds, 3), "steps": steps}
    record["eval_train_loss"], record["eval_train_acc"] = train_eval
    record["test_loss"], record["test_acc"] = evaluate(model, ds.x_test, ds.y_test, bs)
    return record


def endpoint_summary(cfg: RunConfig, final_loss: float, history: list[dict], n_train: int,
                     seek: dict[str, Any] | None) -> dict[str, Any] | None:
    """run.json's `endpoint` record of a run with a step-level endpoint (None without one): the target, the
    tolerance, the final train loss, whether it was reached and is within the tolerance (`store.endpoint_miss`,
    the report's rule, and why not), the optimizer steps taken, the checks made to find the crossing step and
    the scale of the last step where it was taken scaled (`seek`: what `crossing.seek_crossing` found)."""
    endpoint = step_endpoint(cfg)
    if endpoint is None:
        return None
    per_epoch = math.ceil(n_train / cfg.train.batch_size)
    seek = seek or {}
    record: dict[str, Any] = {
        "target": endpoint.target, "tolerance": endpoint.tolerance, "final": final_loss,
        "reached": final_loss <= endpoint.target, "within_tolerance": True,
        "steps": sum(int(h.get("steps", per_epoch)) for h in history), "epochs": len(history),
        "check_steps": endpoint.check_steps, "checks": int(seek.get("checks", 0)),
        "scaled_step": seek.get("scale")}
    miss = endpoint_miss(record)
    if miss is not None:
        record.update(within_tolerance=False, missed=miss)
    if seek.get("note"):
        record["note"] = seek["note"]
    return record


def tests_at(cfg: RunConfig, epoch: int, record: dict[str, Any], history: list[dict] | tuple = ()) -> bool:
    """Whether an evaluated epoch (its training-set evaluation in `record`) also evaluates the test set. The
    test set stops nothing, so with `train.test_every` = K > 0 it is evaluated only where something is read
    from it: epochs 1, 2, 4, 8, ... and every K-th (the curves), the last epoch, and any epoch at which the
    run stops or keeps a snapshot (its accuracies and gaps). 0: at every evaluated epoch."""
    t = cfg.train
    if not t.test_every or epoch >= t.epochs or epoch & (epoch - 1) == 0 or epoch % t.test_every == 0:
        return True
    level = next_loss_level(cfg, list(history))
    if level is not None and record["eval_train_loss"] <= level:
        return True  # a snapshot level or the target loss reached: the run keeps a snapshot or stops here
    return bool(target_met(cfg, running_acc=record["train_acc"], eval_loss=record["eval_train_loss"]))


def target_met(cfg: RunConfig, *, running_acc: float | None, eval_loss: float | None) -> bool | None:
    """The one rule for "did the run reach its target": None without a target; else whether the running
    train accuracy reached `target_train_acc` or the evaluated whole-training-set loss reached
    `target_train_loss` (either, when both are set). A value that was not measured (None) reaches nothing.
    """
    t = cfg.train
    if t.target_train_acc is None and t.target_train_loss is None:
        return None
    if t.target_train_acc is not None and running_acc is not None and running_acc >= t.target_train_acc:
        return True
    return t.target_train_loss is not None and eval_loss is not None and eval_loss <= t.target_train_loss


def reached_endpoint(cfg: RunConfig, history: list[dict]) -> bool:
    """Whether training stops early after the last epoch in `history` (`target_met` on its record)."""
    if not history:
        return False
    last = history[-1]
    return bool(target_met(cfg, running_acc=last["train_acc"], eval_loss=last.get("eval_train_loss")))


def progress_fields(record: dict) -> dict[str, str]:
    """What the progress bar shows after an epoch."""
    fields = {"loss": f"{record.get('eval_train_loss', record['train_loss']):.3g}",
              "acc": f"{record.get('eval_train_acc', record['train_acc']):.3f}"}
    if "test_acc" in record:
        fields["test"] = f"{record['test_acc']:.3f}"
    return fields
