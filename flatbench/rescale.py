"""Function-preserving transformations with random factors: the invariance contract's four families.

Every transformation takes a model and a seeded `torch.Generator` and returns a transformed **deep copy**
(the model passed in is never modified). Factors are drawn log-uniformly in `[low, high]` (default
`[1/10, 10]`), in float64 on the generator's device.

- **layer** — one factor α per hidden layer: the layer's output (the weight layer's weights and bias,
  or, when a BatchNorm follows the weight layer, the BatchNorm's affine weight and bias, which is what
  the ReLU sees) × α, and the input of the next weight layer ÷ α. Composed over the layers this is
  exactly `W_l ← α_l W_l`, `b_l ← (Π_{k≤l} α_k) b_l`, `W_L ← W_L / Π_{k<L} α_k` for nets without
  BatchNorm (the transformation `minimum_sharpness` minimizes over).
- **node** — the same with one factor per hidden unit or channel: its incoming weights and bias (or its
  BatchNorm affine weight and bias) × c_i, its outgoing weights ÷ c_i. This passes through ReLU (any
  positively homogeneous activation), max- and average-pooling, dropout and flatten (a flattened
  channel's block of features is divided by its factor).
- **bn** — for every weight layer followed directly by a BatchNorm, one factor c: the weight layer's
  weights and bias × c, the BatchNorm's running mean × c and running variance × c². BatchNorm divides by
  `sqrt(var + eps)`, so `eps` is scaled by c² as well; with `var × c²` alone the function would change
  by a relative `eps (1 − c⁻²) / var`, which is not negligible for small variances.
- **logit_scale** — the last weight layer (weights and bias) × c. It changes the logits by the factor c
  (so the loss, but no prediction); `function_change` compares the logits up to a positive scale and a
  shift for this family. Only measures computed with `normalized_ce` are expected to be unchanged.

Architectures:

- `nn.Sequential` chains of Linear / Conv2d, BatchNorm directly after a weight layer, and positively
  homogeneous, channel-wise modules between weight layers (ReLU, LeakyReLU, max/avg pooling, dropout,
  flatten, identity) — this covers flatbench's `mlp` (with or without bias and BatchNorm) and `lenet`.
- flatbench's `wrn` (pre-activation WideResNet). **Node-wise and layer-wise** rescaling act on every
  BatchNorm → ReLU → conv junction, where the factor goes into the BatchNorm's affine weight and bias
  and out of every conv that reads the ReLU's output: `bn1` → `conv1` (and the 1×1 `shortcut`, which
  reads the same pre-activated input), `bn2` → `conv2`, and the final `bn` → `fc` (through global average
  pooling). They are **not** applied across the residual additions: scaling a channel of the residual
  stream would have to scale every conv that writes into the stream and rescale the running statistics
  of every BatchNorm that reads it per channel, which is not exact because of BatchNorm's `eps`
  (the single `eps` of a layer can absorb one common factor, not one per channel). **bn** acts on each
  block's `conv1` and the `bn2` that reads only it (the stem and `conv2` write into the residual stream
  and are left alone). **logit_scale** scales `fc`.

`applicable_families(model)` says, for every family, `True` or the reason it does not apply.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from flatbench.errors import FlatbenchError
from flatbench.models import WideResNet

FAMILIES = ("layer", "node", "bn", "logit_scale")

_WEIGHT = (nn.Linear, nn.Conv2d)
_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d)
_HOMOGENEOUS = (nn.ReLU, nn.LeakyReLU, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
                nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
                nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Flatten, nn.Identity)
"""Channel-wise modules that commute with a positive per-channel factor: g(c·x) = c·g(x)."""


@dataclass
class Junction:
    """A set of channels between a producer and the weight layers that read them (through ReLU etc.).

    Multiplying the producer's output channel i by c_i and dividing every consumer's input channel i by
    c_i leaves the network's function unchanged.
    """

    producer: nn.Module
    """A weight layer (rows and bias are scaled) or a BatchNorm (affine weight and bias are scaled)."""
    consumers: list[tuple[nn.Module, int]]
    """(weight layer, features per channel): a Linear after a flatten reads `features` inputs per channel."""
    channels: int
    name: str


@dataclass
class Structure:
    """What the transformations act on, found once per model (module references of that model)."""

    junctions: list[Junction] = field(default_factory=list)
    bn_pairs: list[tuple[nn.Module, nn.Module, str]] = field(default_factory=list)
    last: nn.Module | None = None
    unsupported: str = ""
    """Non-empty: why layer / node / bn rescaling cannot be applied to this model."""


class _Unsupported(Exception):
    pass


def _out_channels(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, nn.Conv2d):
        return module.out_channels
    return module.num_features


def _in_features(module: nn.Module) -> int:
    return module.in_features if isinstance(module, nn.Linear) else module.in_channels


def _check_bn(bn: nn.Module, where: str) -> None:
    if not bn.affine:
        raise _Unsupported(f"{where} has no affine weight and bias to rescale")
    if bn.running_mean is None or bn.running_var is None:
        raise _Unsupported(f"{where} has no running statistics")


def _sequential_structure(model: nn.Sequential) -> Structure:
    """Junctions of a flat Sequential of weight layers, BatchNorm and homogeneous channel-wise modules."""
    names = {m: n for n, m in model.named_children()}
    out = Structure()
    producer: nn.Module | None = None
    producer_weight: nn.Module | None = None
    between: list[nn.Module] = []
    for module in model.children():
        where = f"'{names[module]}' ({type(module).__name__})"
        if isinstance(module, _WEIGHT):
            if getattr(module, "groups", 1) != 1:
                raise _Unsupported(f"{where} is a grouped convolution")
            if producer is not None:
                channels = _out_channels(producer)
                feats = _in_features(module)
                if feats % channels:
                    raise _Unsupported(f"{where} reads {feats} features from {channels} channels")
                if isinstance(module, nn.Conv2d) and feats != channels:
                    raise _Unsupported(f"{where} reads {feats} channels from {channels}")
                out.junctions.append(Junction(producer, [(module, feats // channels)], channels,
                                              names[producer]))
            producer, producer_weight, between = module, module, []
        elif isinstance(module, _BATCHNORM):
            if producer_weight is None or producer is not producer_weight or between:
                raise _Unsupported(f"{where} does not directly follow a weight layer")
            _check_bn(module, where)
            out.bn_pairs.append((producer_weight, module, names[module]))
            producer = module
        elif isinstance(module, _HOMOGENEOUS):
            between.append(module)
        else:
            raise _Unsupported(f"{where} is not known to commute with positive per-channel scaling")
    out.last = producer_weight
    if producer is not producer_weight or between:
        # A BatchNorm or an activation after the last weight layer: the logits are not its output.
        out.last = None
    return out


def _wrn_structure(model: nn.Module) -> Structure:
    out = Structure(last=model.fc)
    names = {m: n for n, m in model.named_modules()}
    for block in model.blocks:
        for bn in (block.bn1, block.bn2):
            _check_bn(bn, names[bn])
        readers = [(block.conv1, 1)] + ([(block.shortcut, 1)] if block.shortcut is not None else [])
        out.junctions.append(Junction(block.bn1, readers, block.bn1.num_features, names[block.bn1]))
        out.junctions.append(Junction(block.bn2, [(block.conv2, 1)], block.bn2.num_features,
                                      names[block.bn2]))
        out.bn_pairs.append((block.conv1, block.bn2, names[block.bn2]))
    _check_bn(model.bn, "bn")
    out.junctions.append(Junction(model.bn, [(model.fc, 1)], model.bn.num_features, "bn"))
    return out


def _wrapped_hint(model: nn.Module) -> str:
    """What to do with a module that wraps a Sequential holding all its parameters (an MLP class whose
    forward calls `self.net(x)`): measure that Sequential itself."""
    n_params = sum(p.numel() for p in model.parameters())
    for name, child in model.named_children():
        if isinstance(child, nn.Sequential) and sum(p.numel() for p in child.parameters()) == n_params:
            return (f"; it wraps the Sequential '{name}' that holds all its parameters: measure that one "
                    f"(e.g. flatbench.measure(model.{name}, ...)) if the wrapper's forward only calls it")
    return "; write the model as an nn.Sequential of Linear/Conv2d, BatchNorm and ReLU layers"


def structure(model: nn.Module) -> Structure:
    """The junctions, BatchNorm pairs and last layer of a supported model (see the module docstring)."""
    try:
        if isinstance(model, WideResNet):
            return _wrn_structure(model)
        if isinstance(model, nn.Sequential):
            return _sequential_structure(model)
        raise _Unsupported(f"{type(model).__name__} is neither a Sequential chain nor flatbench's wrn"
                           + _wrapped_hint(model))
    except _Unsupported as exc:
        return Structure(unsupported=str(exc))


def applicable_families(model: nn.Module) -> dict[str, bool | str]:
    """For each family: True, or the reason it cannot be applied to this model."""
    s = structure(model)
    if s.unsupported:
        reason = f"unsupported architecture: {s.unsupported}"
        return {f: reason for f in FAMILIES}
    out: dict[str, bool | str] = {}
    out["layer"] = True if s.junctions else "no hidden layer (nothing between two weight layers to rescale)"
    out["node"] = out["layer"]
    out["bn"] = True if s.bn_pairs else "no BatchNorm directly after a weight layer"
    out["logit_scale"] = True if s.last is not None else "the logits are not the output of a weight layer"
    return out


# ---------------------------------------------------------------- factors and in-place primitives


def log_uniform(n: int, generator: torch.Generator, low: float = 0.1, high: float = 10.0) -> Tensor:
    """n factors log-uniform in [low, high] (float64, on the generator's device)."""
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got [{low}, {high}]")
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device)
    lo, hi = math.log(low), math.log(high)
    return torch.exp(lo + (hi - lo) * u.cpu())


def _shape_for(c: Tensor, ref: Tensor, axis: int) -> Tensor:
    shape = [1] * ref.dim()
    shape[axis] = -1
    return c.to(device=ref.device, dtype=ref.dtype).view(shape)


@torch.no_grad()
def _scale_outputs(module: nn.Module, c: Tensor) -> None:
    """Output channel i × c_i: weight rows and bias (weight layer) or affine weight and bias (BatchNorm)."""
    module.weight.mul_(_shape_for(c, module.weight, 0))
    if module.bias is not None:
        module.bias.mul_(c.to(device=module.bias.device, dtype=module.bias.dtype))


@torch.no_grad()
def _scale_inputs(module: nn.Module, c: Tensor, features_per_channel: int) -> None:
    """Input channel i ÷ c_i (a Linear after a flatten: its block of features_per_channel columns)."""
    full = c.repeat_interleave(features_per_channel) if features_per_channel > 1 else c
    module.weight.div_(_shape_for(full, module.weight, 1))


@torch.no_grad()
def _scale_bn_pair(weight_layer: nn.Module, bn: nn.Module, c: float) -> None:
    weight_layer.weight.mul_(c)
    if weight_layer.bias is not None:
        weight_layer.bias.mul_(c)
    bn.running_mean.mul_(c)
    bn.running_var.mul_(c * c)
    bn.eps = bn.eps * c * c


# ---------------------------------------------------------------- the families


def _copy_and_structure(model: nn.Module, family: str) -> tuple[nn.Module, Structure]:
    verdict = applicable_families(model)[family]
    if verdict is not True:
        raise ValueError(f"{family} rescaling does not apply to this model: {verdict}")
    clone = copy.deepcopy(model)
    return clone, structure(clone)


def _rescale_junctions(model: nn.Module, family: str, generator: torch.Generator, low: float, high: float,
                       per_unit: bool) -> nn.Module:
    """Scale each junction's producer outputs by c and its consumers' inputs by 1/c (ReLU commutes with
    c > 0): one c per junction (`layer`) or one per unit/channel (`node`)."""
    clone, s = _copy_and_structure(model, family)
    layer_factors = None if per_unit else log_uniform(len(s.junctions), generator, low, high)
    for i, junction in enumerate(s.junctions):
        c = (log_uniform(junction.channels, generator, low, high) if per_unit
             else layer_factors[i].expand(junction.channels))
        _scale_outputs(junction.producer, c)
        for consumer, per in junction.consumers:
            _scale_inputs(consumer, c, per)
    return clone


def rescale_layer(model: nn.Module, generator: torch.Generator, low: float = 0.1, high: float = 10.0
                  ) -> nn.Module:
    """One factor per hidden layer (junction): its output × α, the next weight layer's input ÷ α."""
    return _rescale_junctions(model, "layer", generator, low, high, per_unit=False)


def rescale_node(model: nn.Module, generator: torch.Generator, low: float = 0.1, high: float = 10.0
                 ) -> nn.Module:
    """One factor per hidden unit / channel: its incoming weights and bias × c_i, outgoing ÷ c_i."""
    return _rescale_junctions(model, "node", generator, low, high, per_unit=True)


def rescale_bn(model: nn.Module, generator: torch.Generator, low: float = 0.1, high: float = 10.0
               ) -> nn.Module:
    """One factor per (weight layer, BatchNorm) pair: the weight layer × c, the running statistics too."""
    clone, s = _copy_and_structure(model, "bn")
    factors = log_uniform(len(s.bn_pairs), generator, low, high)
    for (layer, bn, _name), c in zip(s.bn_pairs, factors):
        _scale_bn_pair(layer, bn, float(c))
    return clone


def rescale_logit_scale(model: nn.Module, generator: torch.Generator, low: float = 0.1, high: float = 10.0
                        ) -> nn.Module:
    """The last weight layer (weights and bias) × c: logits × c, predictions unchanged."""
    clone, s = _copy_and_structure(model, "logit_scale")
    c = log_uniform(1, generator, low, high)
    _scale_outputs(s.last, c.expand(_out_channels(s.last)))
    return clone


TRANSFORMS: dict[str, Callable[..., nn.Module]] = {
    "layer": rescale_layer, "node": rescale_node, "bn": rescale_bn, "logit_scale": rescale_logit_scale}


def transform(model: nn.Module, family: str, generator: torch.Generator, low: float = 0.1,
              high: float = 10.0) -> nn.Module:
    """Apply one family (see TRANSFORMS) with factors log-uniform in [low, high]; returns a copy."""
    if family not in TRANSFORMS:
        raise ValueError(f"unknown family '{family}' (choose from: {', '.join(FAMILIES)})")
    return TRANSFORMS[family](model, generator, low, high)


# ---------------------------------------------------------------- checking


def _normalized(logits: Tensor) -> Tensor:
    centered = logits - logits.mean(dim=-1, keepdim=True)
    return centered / centered.norm(dim=-1, keepdim=True).clamp_min(1e-300)


@torch.no_grad()
def function_change(original: nn.Module, transformed: nn.Module, inputs: Tensor, family: str = "layer",
                    chunk_size: int = 2000) -> float:
    """Largest relative deviation of the transformed model's logits from the original's.

    `max |f' − f| / max |f|` over the inputs; for `logit_scale` both sides are first centered and
    normalized per example (the family changes the logits by a positive factor on purpose).
    """
    worst, scale = 0.0, 0.0
    for i in range(0, int(inputs.shape[0]), chunk_size):
        x = inputs[i:i + chunk_size]
        a, b = original(x), transformed(x)
        if family == "logit_scale":
            a, b = _normalized(a), _normalized(b)
        worst = max(worst, float((a - b).abs().max()))
        scale = max(scale, float(a.abs().max()))
    return worst / max(scale, 1e-300)


def checked_transform(model: nn.Module, family: str, generator: torch.Generator, low: float, high: float,
                      inputs: Tensor, tol: float, where: str, chunk_size: int = 2000, advice: str = ""
                      ) -> tuple[nn.Module, float]:
    """A transformed copy (`transform`) and its `function_change` on `inputs`: the one check that the
    invariance contract and both audits make before they compare a measure across a rescaling, so that no
    value is ever compared with one of another function. Past `tol` (relative), a FlatbenchError."""
    out = transform(model, family, generator, low, high)
    change = function_change(model, out, inputs, family, chunk_size)
    if not change <= tol:
        raise FlatbenchError(f"{where}: the {family} transformation changed the logits by {change:.2e} (relative, "
                              f"tolerance {tol:g}); refusing to compare measures of different functions"
                              + (f" ({advice})" if advice else ""))
    return out, change
