"""Shared helpers of the curvature routines: chunking, flat parameter vectors, probes, the loss as a
function of the parameters, and a context that turns autograd on for a frozen model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call


def chunks(inputs: Tensor, targets: Tensor, chunk_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    for i in range(0, int(inputs.shape[0]), max(1, int(chunk_size))):
        yield inputs[i:i + chunk_size], targets[i:i + chunk_size]


def detached_params(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def flatten(tensors: dict[str, Tensor], names: list[str], dtype: torch.dtype | None = None) -> Tensor:
    return torch.cat([tensors[n].reshape(-1).to(dtype or tensors[n].dtype) for n in names])


def unflatten(flat: Tensor, like: dict[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    offset = 0
    for name, ref in like.items():
        size = ref.numel()
        out[name] = flat[offset:offset + size].view_as(ref).to(dtype or ref.dtype)
        offset += size
    if offset != flat.numel():
        raise ValueError(f"vector has {flat.numel()} entries, the model has {offset} parameters")
    return out


def rademacher(like: dict[str, Tensor], generator: torch.Generator) -> dict[str, Tensor]:
    """±1 probes, drawn on the generator's device (so a seed gives the same probes on any machine of
    that device type) and moved to each parameter's device."""
    out = {}
    for name, ref in like.items():
        bits = torch.randint(0, 2, ref.shape, generator=generator, device=generator.device)
        out[name] = (bits * 2 - 1).to(device=ref.device, dtype=ref.dtype)
    return out


class NoGradientGraph(RuntimeError):
    """The loss (or the model's output) does not depend on the parameters through autograd: its derivatives
    cannot be computed, and are never reported as 0."""


NO_GRAPH = ("the model's forward pass does not depend on its parameters through autograd (runs under "
            "torch.no_grad()? detaches its output?): its derivatives cannot be computed, and are not 0")


def require_graph(value: Tensor, model: nn.Module | None = None) -> Tensor:
    """`value`, a loss or a model output computed from parameters that require grad (`model`'s, where
    given; else the caller's leaves), unless autograd holds no graph from them to it: `NoGradientGraph`
    then, where backward passes would find no graph or, through hooks, silently give zeros."""
    if not value.requires_grad and (model is None or any(p.requires_grad for p in model.parameters())):
        raise NoGradientGraph(NO_GRAPH)
    return value


class GradMode:
    """Enable autograd and make every parameter require grad for the duration (measures may run under
    `torch.no_grad()` or on frozen models); restores both afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.saved: list[tuple[Tensor, bool]] = []
        self.ctx = torch.enable_grad()

    def __enter__(self) -> None:
        self.ctx.__enter__()
        for p in self.model.parameters():
            self.saved.append((p, p.requires_grad))
            p.requires_grad_(True)

    def __exit__(self, *exc: object) -> None:
        for p, flag in self.saved:
            p.requires_grad_(flag)
        self.ctx.__exit__(*exc)


def loss_fn(model: nn.Module, buffers: dict[str, Tensor], x: Tensor, y: Tensor, loss: Callable,
             weight: float) -> Callable[[dict[str, Tensor]], Tensor]:
    """The chunk's share of the mean loss as a function of the parameters (for torch.func)."""
    def fn(params: dict[str, Tensor]) -> Tensor:
        return loss(functional_call(model, (params, buffers), (x,)), y) * weight
    return fn


def detached_buffers(model: nn.Module) -> dict[str, Tensor]:
    """Buffers for functional_call; cloned when some module is in train mode so that BatchNorm's
    running statistics of the model are not updated by a measurement."""
    bufs = dict(model.named_buffers())
    if any(m.training for m in model.modules()):
        bufs = {k: v.clone() for k, v in bufs.items()}
    return bufs




class Welford:
    """Running mean and variance in float64 (numerically stable, one pass over the probes)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean: Any = 0.0
        self.m2: Any = 0.0

    def add(self, x: Any) -> None:
        self.count += 1
        delta = x - self.mean
        self.mean = self.mean + delta / self.count
        self.m2 = self.m2 + delta * (x - self.mean)

    def stderr(self) -> Any:
        if self.count < 2:
            return self.m2 * float("nan") if isinstance(self.m2, Tensor) else float("nan")
        var = self.m2 / (self.count - 1)
        return (var / self.count) ** 0.5
