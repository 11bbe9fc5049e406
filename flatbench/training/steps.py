"""One epoch of one run, step by step: its seeded batches, augmentation and dropout, and its state at any
step, so that an epoch can be replayed from a step it passed (the step-level endpoint, `crossing`).

`train_epoch` is the whole epoch at once; `EpochRun` the same epoch one optimizer step at a time, with
`capture` / `restore` of everything a step depends on: the weights and buffers, the optimizer's and the
schedule's state, the position in the epoch's batches, the augmentation generator and the global torch
random state (dropout), and the running loss and accuracy so far. A restored run replays its steps exactly
as it took them (bit-identical on the CPU).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from flatbench.config import RunConfig
from flatbench.seeding import augment_generator, batch_generator, dropout_seed
from flatbench.training.batches import augment_batch, epoch_batches
from flatbench.training.endpoint import EpochStats
from flatbench.training.setup import autocast, steps_per_batch, uses_channels_last


@dataclass
class StepState:
    """An `EpochRun`'s state after some of its steps (what `EpochRun.capture` returns); `weights_only`
    captures hold the position and the model's weights and buffers alone (not restorable)."""

    position: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    schedule: dict[str, Any] | None = None
    augment: torch.Tensor | None = None
    rng: torch.Tensor | None = None
    cuda_rng: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    seen: int = 0


class EpochRun:
    """One epoch of a run, one optimizer step at a time (`step`), in the order `train_epoch` takes them.

    `forward` (default: the model) is what computes the logits, e.g. from `setup.training_forward`. `sched`
    is stepped after every minibatch when the schedule is per step (`steps_per_batch`); an epoch schedule is
    the caller's to step.
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, ds: Any, cfg: RunConfig, epoch: int,
                 stop: Any, forward: Callable[[torch.Tensor], torch.Tensor] | None = None, sched: Any = None):
        self.model, self.opt, self.ds, self.cfg, self.stop, self.sched = model, opt, ds, cfg, stop, sched
        self.per_step = sched if sched is not None and steps_per_batch(cfg) else None
        self.forward = forward if forward is not None else model
        self.channels_last = uses_channels_last(model, cfg, ds.x_train.device)
        self.device = ds.x_train.device
        self.batches = epoch_batches(ds.n_train, cfg.train.batch_size, batch_generator(cfg, epoch, device=self.device))
        self.aug_gen = augment_generator(cfg, epoch, device=self.device)
        torch.manual_seed(dropout_seed(cfg, epoch))
        self.augment = ds.augment_params()
        model.train()
        self.position = 0
        self.seen = 0
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.correct = torch.zeros((), dtype=torch.long, device=self.device)

    @property
    def done(self) -> bool:
        return self.position >= len(self.batches)

    def step(self) -> None:
        """The next optimizer step (on the next minibatch)."""
        idx = self.batches[self.position]
        self.stop.check()
        cfg = self.cfg
        x = self.ds.x_train[idx]
        if cfg.data.augment:
            x = augment_batch(x, self.aug_gen, **self.augment)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = self.ds.y_train[idx]
        with autocast(cfg, self.device):
            logits = self.forward(x)
            loss = F.cross_entropy(logits, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.per_step is not None:
            self.per_step.step()
        self.loss_sum += loss.detach().double() * idx.numel()
        self.correct += (logits.detach().argmax(dim=1) == y).sum()
        self.position += 1
        self.seen += int(idx.numel())

    def stats(self) -> EpochStats:
        """The running loss and accuracy of the steps taken (the whole epoch's once it is done)."""
        n = self.ds.n_train if self.done else max(self.seen, 1)
        return EpochStats(float(self.loss_sum) / n, int(self.correct) / n)

    def capture(self, weights_only: bool = False) -> StepState:
        """The run's state after the steps taken so far (copies: later steps do not change it)."""
        model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if weights_only:
            return StepState(self.position, model)
        cuda = self.device.type == "cuda"
        return StepState(
            position=self.position, model=model, seen=self.seen,
            optimizer=copy.deepcopy(self.opt.state_dict()),
            schedule=copy.deepcopy(self.sched.state_dict()) if self.sched is not None else None,
            augment=self.aug_gen.get_state() if self.cfg.data.augment else None,
            rng=torch.get_rng_state(), cuda_rng=torch.cuda.get_rng_state(self.device) if cuda else None,
            loss_sum=self.loss_sum.clone(), correct=self.correct.clone())

    def restore(self, state: StepState) -> None:
        """Go back to a captured state; the steps after it are then taken again as they were."""
        if state.optimizer is None or state.rng is None or state.loss_sum is None or state.correct is None:
            raise ValueError("a weights-only capture cannot be restored")
        self.model.load_state_dict(state.model)
        self.opt.load_state_dict(copy.deepcopy(state.optimizer))
        if self.sched is not None and state.schedule is not None:
            self.sched.load_state_dict(copy.deepcopy(state.schedule))
        if state.augment is not None:
            self.aug_gen.set_state(state.augment)
        torch.set_rng_state(state.rng)
        if state.cuda_rng is not None:
            torch.cuda.set_rng_state(state.cuda_rng, self.device)
        self.position, self.seen = state.position, state.seen
        self.loss_sum, self.correct = state.loss_sum.clone(), state.correct.clone()


def train_epoch(model: nn.Module, opt: torch.optim.Optimizer, ds: Any, cfg: RunConfig, run_id: str,
                epoch: int, stop: Any, forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
                sched: Any = None) -> EpochStats:
    """One pass over the training set; loss/accuracy accumulate on the device (no per-step sync).

    `forward` (default: the model) is what computes the logits, e.g. from `training_forward`. `sched` is
    stepped after every minibatch when the schedule is per step (`steps_per_batch`); an epoch schedule is
    the caller's to step.
    """
    del run_id
    run = EpochRun(model, opt, ds, cfg, epoch, stop, forward, sched)
    while not run.done:
        run.step()
    return run.stats()
