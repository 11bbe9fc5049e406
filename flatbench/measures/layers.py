"""Finding the weight layers of a model: the Linear and Conv2d modules in forward order.

Norm- and curvature-based measures are defined per weight layer (`W_l` in MEASURES.md). Forward order
is taken from a forward pass (hooks record the order modules are called), so custom models whose
`modules()` order differs from execution order are still handled correctly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

WEIGHT_LAYER_TYPES = (nn.Linear, nn.Conv2d)


@dataclass
class WeightLayer:
    name: str
    """The module's qualified name (its weight parameter is `<name>.weight`)."""
    module: nn.Module
    input_shape: tuple[int, ...]
    """Shape of one example's input to this layer (without the batch axis)."""


def weight_layers(model: nn.Module, example: torch.Tensor) -> list[WeightLayer]:
    """Linear/Conv2d layers in the order a forward pass on `example` (shape (1, ...)) calls them."""
    names = {m: n for n, m in model.named_modules()}
    seen: list[WeightLayer] = []
    handles = []

    def hook(module: nn.Module, args: tuple, _out: torch.Tensor) -> None:
        if not any(layer.module is module for layer in seen):
            seen.append(WeightLayer(names[module], module, tuple(args[0].shape[1:])))

    for module in model.modules():
        if isinstance(module, WEIGHT_LAYER_TYPES):
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in handles:
            h.remove()
    return seen
