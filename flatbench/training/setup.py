"""What a run trains with: its device, seeded initial model, optimizer, schedule and forward pass.

Determinism: the initial weights come from `seeding.init_seed` (the seed and model fields, never the
run id), so a run built twice, or resumed, starts from the same weights.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from flatbench.config import RunConfig
from flatbench.errors import FlatbenchError
from flatbench.models import build_model
from flatbench.seeding import init_seed


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
    params = list(params)
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay, **_fused(params))
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, nesterov=t.nesterov,
                           weight_decay=t.weight_decay)


def _fused(params: list[Any]) -> dict[str, bool]:
    """Adam's fused kernel (one pass per parameter instead of a dozen tensor operations: a training step of
    a small MLP 20-30% faster on the CPU, scripts/bench_train.py) where every parameter is a floating-point
    tensor on the CPU or CUDA; the same update, rounded in another order."""
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    ok = bool(tensors) and all(isinstance(p, torch.Tensor) and p.dtype.is_floating_point
                               and p.device.type in ("cpu", "cuda") for p in tensors)
    return {"fused": True} if ok else {}


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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed(cfg))
        model = build_model(cfg.model, input_shape, num_classes)
    return model.to(device)


def uses_channels_last(model: nn.Module, cfg: RunConfig, device: torch.device) -> bool:
    """Whether a conv net trains in the channels_last memory format (`train.channels_last`, on by default):
    faster convolutions on CUDA and on the CPU too (LeNet-5 on the 2-core CPU, one thread: a training step
    of 128 MNIST images 42.8 -> 28.4 ms, evaluating 2,000 CIFAR-10 images 334 -> 228 ms; `device` is kept
    for callers that ask per device). The values are those of the same model, in another order of
    summation."""
    del device
    return cfg.train.channels_last and any(isinstance(m, nn.Conv2d) for m in model.modules())


def channels_last_data(ds: Any) -> Any:
    """The dataset with its image tensors in channels_last (the same values), for a channels_last model:
    every batch and every evaluation slice is then in the layout its convolutions run fastest in."""
    if ds.x_train.dim() != 4:
        return ds
    return replace(ds, x_train=ds.x_train.contiguous(memory_format=torch.channels_last),
                   x_test=ds.x_test.contiguous(memory_format=torch.channels_last))


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
