"""The step-level endpoint (`train.endpoint_tolerance`): the optimizer step at which a run's training-set loss
crossed its target.

Checking the whole training set after every optimizer step of a run would cost a forward pass over it per
step, for hundreds of epochs. Instead the training loop checks the end of every epoch near the target
(`endpoint.checks_epoch_end`) and keeps each epoch's start in memory (`keep_start`); when an epoch ends at or
below the target, it goes back to the epoch's start and `seek_crossing` replays the epoch (the same batches,
augmentation and dropout: bit-identical on the CPU) with a check every `train.endpoint_check_steps` steps, to
the first check at which the loss is at most the target T:

- within the band [(1 − tolerance)·T, T]: the run stops there;
- below the band after more than one step since the last check above T: back to that check, then one step at
  a time;
- below the band after a single step (one step jumped over the whole band): the step is taken scaled
  (`train.endpoint_scale_step`, the default): the weights move a fraction s of the way from before the step to
  after it, which for Adam and SGD is the step taken with its learning rate times s (their state's update does
  not depend on the learning rate); s is found by bisection, the loss being continuous in s, and recorded.
  Without the scaled step (or when bisection does not land in the band), the full step is kept and the run is
  recorded as having missed its endpoint.

The run's trajectory up to the stop is the trajectory it has without the setting (the epoch replayed is the
epoch trained), so the endpoint costs one more pass over the crossing epoch plus its checks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from flatbench.config import RunConfig
from flatbench.training.endpoint import (EpochStats, StepEndpoint, checks_epoch_end, crossing_record, evaluate,
                                         step_endpoint)
from flatbench.training.steps import EpochRun

MAX_BISECTIONS = 40
"""Bisections of the scaled last step before the run is recorded as having missed its endpoint."""


@dataclass
class Crossing:
    """What replaying an epoch found: the stop (`crossed`), or the epoch's end above the target (the replay
    of an epoch whose first pass ended at or below it, possible only where training is not deterministic)."""

    crossed: bool
    steps: int
    """Optimizer steps of the epoch taken up to the stop (0: the epoch's start is the stop)."""
    stats: EpochStats | None
    """Running loss and accuracy of those steps (None without a step)."""
    train_eval: tuple[float, float] | None
    """The training set's loss and accuracy at the stop (the check that stopped the run)."""
    checks: int
    scale: float | None = None
    """The fraction of its step that the last step was taken at (None: a full step)."""
    note: str | None = None

    def seek_info(self) -> dict[str, Any]:
        """What run.json's endpoint record takes from the search (`endpoint.endpoint_summary`)."""
        return {"checks": self.checks, "scale": self.scale, "note": self.note}


@dataclass
class EpochStart:
    """A run's model, optimizer and schedule at the start of an epoch (copies), to replay the epoch."""

    model: dict[str, torch.Tensor]
    optimizer: dict[torch.Tensor, dict[str, Any]]
    groups: list[dict[str, Any]]
    schedule: dict[str, Any] | None


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def keep_start(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, cfg: RunConfig) -> EpochStart | None:
    """The epoch's start, kept where the run has a step-level endpoint (None otherwise). Tensors are cloned
    one by one (a deep copy of the optimizer's state_dict costs as much as an epoch of a small MLP at batch
    256)."""
    if step_endpoint(cfg) is None:
        return None
    return EpochStart({k: v.detach().clone() for k, v in model.state_dict().items()},
                      {p: {k: _copy(v) for k, v in st.items()} for p, st in opt.state.items()},
                      [{k: _copy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
                      copy.deepcopy(sched.state_dict()) if sched is not None else None)


def back_to(start: EpochStart, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    """Put the run back at a kept epoch start."""
    model.load_state_dict(start.model)
    opt.state.clear()
    for p, st in start.optimizer.items():
        opt.state[p] = {k: _copy(v) for k, v in st.items()}
    for group, kept in zip(opt.param_groups, start.groups):
        group.update({k: _copy(v) for k, v in kept.items()})
    if sched is not None and start.schedule is not None:
        sched.load_state_dict(copy.deepcopy(start.schedule))


def end_check(model: nn.Module, ds: Any, cfg: RunConfig, epoch: int, running_loss: float,
              history: list[dict]) -> tuple[float, float] | None:
    """The training set's loss and accuracy at the end of `epoch` (1-based) where it is evaluated
    (`endpoint.checks_epoch_end`), else None."""
    if not checks_epoch_end(cfg, epoch, running_loss, history):
        return None
    return evaluate(model, ds.x_train, ds.y_train, cfg.train.eval_batch_size)


def crossed(cfg: RunConfig, train_eval: tuple[float, float] | None) -> bool:
    """Whether an epoch's end check found the loss at or below a step-level endpoint's target."""
    endpoint = step_endpoint(cfg)
    return endpoint is not None and train_eval is not None and train_eval[0] <= endpoint.target


def seek_crossing(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, ds: Any, cfg: RunConfig, epoch: int,
                  stop: Any, forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  start_loss: float | None = None) -> Crossing:
    """Replay epoch `epoch` (0-based; the model, optimizer and schedule at its start) with a check of the whole
    training set's loss (eval mode) every `train.endpoint_check_steps` optimizer steps, and stop at the first
    check at which it is at most the target (see the module's doc). `start_loss`: the loss at the epoch's
    start where it was checked (else it is checked first: a start at or below the target is the stop)."""
    endpoint = step_endpoint(cfg)
    if endpoint is None:
        raise ValueError("seek_crossing needs train.endpoint_tolerance")
    count = [0]

    def check() -> tuple[float, float]:
        count[0] += 1
        return evaluate(model, ds.x_train, ds.y_train, cfg.train.eval_batch_size)

    if start_loss is None:
        start = check()
        if start[0] <= endpoint.target:
            return Crossing(True, 0, None, start, count[0])
    run = EpochRun(model, opt, ds, cfg, epoch, stop, forward, sched)
    every = endpoint.check_steps
    anchor = run.capture(weights_only=every == 1)
    while not run.done:
        run.step()
        if run.position - anchor.position < every and not run.done:
            continue
        found = check()
        if found[0] > endpoint.target:
            anchor = run.capture(weights_only=every == 1)
        elif found[0] >= endpoint.floor:
            return Crossing(True, run.position, run.stats(), found, count[0])
        elif run.position - anchor.position > 1:  # the band passed between two sparse checks: one step at a time
            run.restore(anchor)
            every = 1
            anchor = run.capture(weights_only=True)
        else:
            return _last_step(run, anchor.model, found, endpoint, check, count)
    return Crossing(False, run.position, run.stats(), None, count[0])


def _last_step(run: EpochRun, before: dict[str, torch.Tensor], after_eval: tuple[float, float],
               endpoint: StepEndpoint, check: Callable[[], tuple[float, float]], count: list[int]) -> Crossing:
    """One step took the loss from above the target to below the band: take it scaled (bisection over the
    fraction s of the step, weights before + s·(after − before)), or keep it and record the miss."""
    jump = (f"one optimizer step took the training-set loss from above {endpoint.target:g} to "
            f"{after_eval[0]:.4g}, below the band")
    if not endpoint.scale_step:
        return Crossing(True, run.position, run.stats(), after_eval, count[0],
                        note=f"{jump}; train.endpoint_scale_step is off")
    params = dict(run.model.named_parameters())
    after = {name: p.detach().clone() for name, p in params.items()}
    lo, hi = 0.0, 1.0
    for _ in range(MAX_BISECTIONS):
        s = (lo + hi) / 2
        _move(params, before, after, s)
        found = check()
        if found[0] > endpoint.target:
            lo = s
        elif found[0] < endpoint.floor:
            hi = s
        else:
            return Crossing(True, run.position, run.stats(), found, count[0], scale=s,
                            note=f"{jump}: taken at {s:.4g} of its size")
    _move(params, before, after, 1.0)
    return Crossing(True, run.position, run.stats(), after_eval, count[0],
                    note=f"{jump}; no fraction of it found within the band in {MAX_BISECTIONS} bisections")


@torch.no_grad()
def _move(params: dict[str, nn.Parameter], before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
          s: float) -> None:
    for name, p in params.items():
        p.copy_(after[name] if s == 1.0 else torch.lerp(before[name], after[name], s))


def record_stop(found: Crossing, model: nn.Module, ds: Any, cfg: RunConfig, epoch: int, lr: float, seconds: float,
                history: list[dict]) -> None:
    """The history entry of the epoch (1-based `epoch`) in which the run stopped: appended with its steps
    (`endpoint.crossing_record`); a stop at the epoch's start (no step: the previous epoch's end, which was not
    checked, is at or below the target) completes the previous epoch's entry instead."""
    if found.steps == 0 and history:
        last = history[-1]
        last["eval_train_loss"], last["eval_train_acc"] = found.train_eval
        if "test_loss" not in last:
            last["test_loss"], last["test_acc"] = evaluate(model, ds.x_test, ds.y_test, cfg.train.eval_batch_size)
        return
    stats = found.stats if found.stats is not None else EpochStats(*found.train_eval)
    history.append(crossing_record(model, ds, cfg, epoch, stats, lr, seconds, found.steps, found.train_eval))
