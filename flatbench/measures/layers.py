"""The layers and weight matrices a measure works over, found by a forward pass, and what they leave out.

Norm- and curvature-based measures are defined per weight layer (`W_l` in MEASURES.md). Forward order
is taken from a forward pass (hooks record the order modules are called), so custom models whose
`modules()` order differs from execution order are still handled correctly.

Two selections:

- `weight_layers`: the Linear and Conv2d modules (`WEIGHT_LAYER_TYPES`), for the measures defined on a chain
  of such layers (minimum sharpness's layer-wise rescaling) and for plugins;
- `weight_matrices`: every weight matrix of the network (the norms, the normalized sharpness measures and
  Rangamani's metric): the weight of every Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, Embedding and
  EmbeddingBag module the forward pass calls, and of every `nn.MultiheadAttention` it calls, the query,
  key and value projections as three matrices (the rows `0:E`, `E:2E`, `2E:3E` of its stacked
  `in_proj_weight`, or its `q_proj_weight`, `k_proj_weight`, `v_proj_weight`: the same three maps either
  way) and `out_proj.weight`, which MultiheadAttention uses without calling `out_proj`. A parameter is one
  matrix however many layers share it (a tied embedding and output layer, an `out_proj` a model also calls
  itself): at its first use.

`left_out(model, covered)` names the parameters a selection leaves out, in three groups: `biases`,
`normalization` (BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm parameters) and `other` (every
other parameter: a raw `nn.Parameter` the forward pass uses itself, such as a positional embedding,
recurrent (RNN/LSTM/GRU) and Bilinear weights, a layer the forward pass does not call). The measures put it
in their result's `info["left_out"]`, so a parameter they do not cover is named, never skipped silently.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

WEIGHT_LAYER_TYPES = (nn.Linear, nn.Conv2d)

MATRIX_LAYER_TYPES = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding, nn.EmbeddingBag)
"""Modules whose `weight` is one weight matrix (convolutions: a kernel, a matrix per kernel position)."""

NORMALIZATION_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
"""Modules whose parameters are a normalization's affine map (BatchNorm and InstanceNorm are `_NormBase`)."""


@dataclass
class WeightLayer:
    name: str
    """The module's qualified name (its weight parameter is `<name>.weight`)."""
    module: nn.Module
    input_shape: tuple[int, ...]
    """Shape of one example's input to this layer (without the batch axis)."""


@dataclass
class WeightMatrix:
    name: str
    """Its name in a measure's keys: the layer's qualified name (`<name>.weight` is the parameter); for an
    attention's projections `<attn>.in_proj_weight.q` (`.k`, `.v`), `<attn>.q_proj_weight`, ... and
    `<attn>.out_proj`."""
    param: str
    """The qualified name of the parameter (as `named_parameters()` gives it) that holds the matrix."""
    parameter: nn.Parameter
    rows: slice | None
    """The rows of the parameter that are this matrix (an attention's stacked `in_proj_weight`), or None."""
    module: nn.Module
    """The layer (for an attention's projections: the MultiheadAttention)."""
    input_shape: tuple[int, ...] | None
    """One example's input shape to the layer (what a convolution operator acts on), else None."""

    @property
    def weight(self) -> torch.Tensor:
        """The matrix (detached; a view of the parameter's rows for a stacked projection)."""
        w = self.parameter.detach()
        return w if self.rows is None else w[self.rows]

    def part(self, tensor: torch.Tensor) -> torch.Tensor:
        """The entries of `tensor` (shaped like the parameter, e.g. its Hessian diagonal) that are this matrix."""
        return tensor if self.rows is None else tensor[self.rows]

    @property
    def is_conv(self) -> bool:
        return isinstance(self.module, nn.modules.conv._ConvNd)


def _record_calls(model: nn.Module, example: torch.Tensor, types: tuple[type, ...]
                  ) -> list[tuple[nn.Module, tuple[int, ...]]]:
    """The modules of `types` in the order a forward pass on `example` finishes calling them (first call), with
    one example's input shape. (A module with an inference fast path that calls none of its submodules,
    nn.TransformerEncoderLayer, leaves it while hooks are attached, so its layers are seen.)"""
    seen: list[tuple[nn.Module, tuple[int, ...]]] = []
    handles = []

    def hook(module: nn.Module, args: tuple, _out: torch.Tensor) -> None:
        if not any(m is module for m, _ in seen):
            shape = tuple(args[0].shape[1:]) if args and isinstance(args[0], torch.Tensor) else ()
            seen.append((module, shape))

    for module in model.modules():
        if isinstance(module, types):
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in handles:
            h.remove()
    return seen


def weight_layers(model: nn.Module, example: torch.Tensor) -> list[WeightLayer]:
    """Linear/Conv2d layers in the order a forward pass on `example` (shape (1, ...)) calls them."""
    names = {m: n for n, m in model.named_modules()}
    return [WeightLayer(names[m], m, shape) for m, shape in _record_calls(model, example, WEIGHT_LAYER_TYPES)]


def _attention_matrices(name: str, attn: nn.MultiheadAttention) -> list[tuple[str, nn.Parameter, slice | None]]:
    """(key, parameter, rows) of an attention's query, key, value and output projections."""
    prefix = f"{name}." if name else ""
    if attn.in_proj_weight is not None:
        e = attn.embed_dim
        parts = [(f"{prefix}in_proj_weight.{p}", attn.in_proj_weight, slice(i * e, (i + 1) * e))
                 for i, p in enumerate("qkv")]
    else:
        parts = [(f"{prefix}{p}_proj_weight", getattr(attn, f"{p}_proj_weight"), None) for p in "qkv"]
    return [*parts, (f"{prefix}out_proj", attn.out_proj.weight, None)]


def weight_matrices(model: nn.Module, example: torch.Tensor) -> list[WeightMatrix]:
    """Every weight matrix of `model` (the module docstring says which) in the order a forward pass on
    `example` (shape (1, ...)) calls their layers; a shared parameter once, at its first use."""
    names = {m: n for n, m in model.named_modules()}
    param_names = {id(p): n for n, p in model.named_parameters()}
    calls = _record_calls(model, example, (*MATRIX_LAYER_TYPES, nn.MultiheadAttention))
    out: list[WeightMatrix] = []
    taken: set[tuple[int, int | None]] = set()
    for module, shape in calls:
        if isinstance(module, nn.MultiheadAttention):
            parts = [(key, p, rows, module, None) for key, p, rows in _attention_matrices(names[module], module)]
        else:
            conv = isinstance(module, nn.modules.conv._ConvNd)
            parts = [(names[module], module.weight, None, module, shape if conv else None)]
        for key, p, rows, layer, input_shape in parts:
            ident = (id(p), None if rows is None else rows.start)
            if p is None or ident in taken or id(p) not in param_names:
                continue
            taken.add(ident)
            out.append(WeightMatrix(key, param_names[id(p)], p, rows, layer, input_shape))
    return out


def _is_bias(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("bias") or last.endswith("_bias")


def left_out(model: nn.Module, covered: Iterable[torch.Tensor]) -> dict[str, list[str]]:
    """The parameters of `model` that are none of the `covered` tensors (parameters, compared by identity), by
    group: `biases`, `normalization`, `other` (module docstring); a group with no parameter is not listed.
    A parameter is covered as a whole or not at all (an attention's three blocks of `in_proj_weight` together
    cover it)."""
    ids = {id(t) for t in covered}
    owner = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    groups: dict[str, list[str]] = {"biases": [], "normalization": [], "other": []}
    for name, p in model.named_parameters():
        if id(p) in ids:
            continue
        if isinstance(owner.get(id(p)), NORMALIZATION_TYPES):
            groups["normalization"].append(name)
        elif _is_bias(name):
            groups["biases"].append(name)
        else:
            groups["other"].append(name)
    return {k: v for k, v in groups.items() if v}
