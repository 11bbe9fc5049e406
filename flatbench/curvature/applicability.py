"""Which networks the exact Hessian diagonal applies to, and what a forward pass computes.

The exact diagonal (`curvature.diagonal`) rests on one premise: the logits are piecewise linear in every
single parameter. It is decided here twice over: by a walk over the modules (known parametrized layers,
piecewise-linear leaves, containers whose forward is torch's own or registered with
`register_piecewise_linear_container`), and by tracing the aten operations one forward pass calls
(`traced_ops`), which also catches a functional call (`F.gelu`) inside a container's forward. The measures
that need a ReLU network (path norm, the rescaling families) ask the same trace.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode  # torch's public way to see aten calls

PARAM_LEAVES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d)
"""Parametrized leaves whose per-example squared gradients this module knows how to assemble."""

_PIECEWISE_LINEAR_LEAVES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.Hardtanh, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Unflatten,
    nn.Identity, nn.ZeroPad2d, nn.ConstantPad2d)
"""Parameter-free leaves that are piecewise linear in their input (second derivative zero a.e.)."""

_DROPOUTS: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout)

_TORCH_CONTAINERS: tuple[type[nn.Module], ...] = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

_EXTRA_CONTAINERS: set[type[nn.Module]] = set()


def register_piecewise_linear_container(cls: type[nn.Module]) -> type[nn.Module]:
    """Vouch that `cls.forward` only combines its children with piecewise-linear ops (e.g. a residual add).

    A container's forward may do anything (an `F.gelu` between two children would break the exact
    premise silently), so classes outside torch's containers and `flatbench.models` are not trusted
    unless registered here. Usable as a class decorator.
    """
    _EXTRA_CONTAINERS.add(cls)
    return cls


def _is_known_container(module: nn.Module) -> bool:
    cls = type(module)
    return (isinstance(module, _TORCH_CONTAINERS) or cls in _EXTRA_CONTAINERS
            or cls.__module__ == "flatbench.models" or cls.__module__.startswith("flatbench.models."))


def _unmodified_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """A subclass of a known layer is only trusted when it keeps the base class's forward."""
    return getattr(type(module), "forward", None) is base.forward


PIECEWISE_LINEAR_OPS = frozenset({
    "convolution", "addmm", "mm", "t", "view", "_unsafe_view", "reshape", "flatten", "relu", "relu_",
    "threshold", "hardtanh", "hardtanh_", "leaky_relu", "leaky_relu_", "max_pool2d_with_indices", "max_pool2d",
    "max_pool1d", "avg_pool2d", "avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "mean", "sum", "add",
    "add_", "sub", "sub_", "cat", "stack", "clone", "detach", "alias", "expand", "permute", "transpose",
    "unsqueeze", "squeeze", "slice", "select", "constant_pad_nd", "native_batch_norm",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "empty", "empty_like", "zeros_like",
    "copy_", "contiguous", "split", "chunk", "max_pool2d_with_indices_backward", "neg", "_to_copy",
    "adaptive_max_pool2d", "lift_fresh"})
"""aten operations that are piecewise linear in each of their tensor inputs (sums, copies, shape changes,
ReLU, pooling, convolution and matrix products, BatchNorm with running statistics); `mul` and `div` count
only with a constant (`traced_ops`: a number, or a one-element tensor not computed from the parameters)."""
POSITIVELY_HOMOGENEOUS_OPS = PIECEWISE_LINEAR_OPS - {"hardtanh", "hardtanh_", "sub", "sub_", "neg"}
"""The subset with g(c·x) = c·g(x) for c > 0 that keeps positive inputs positive (what the path norm's
squared-weights network needs): no clipping, no subtraction."""


def traced_ops(model: nn.Module, example: Tensor) -> dict[str, str]:
    """The aten operations a forward pass of `model` on `example` calls (name → a call that shows it), with
    `mul`/`div` by a constant as `mul_scalar`, and BatchNorm with batch statistics as `batch_norm_train`.

    A constant is a plain number or a one-element tensor that does not depend on the parameters (a buffer, a
    number computed from the input alone): the trace follows which tensors are computed from a parameter, so
    that a division by a per-example number computed from the activations (h / (1 + Σ_j h_j): one element
    per example on the one-example trace) is not taken for a division by a constant. The trace runs without
    autograd, which leaves no flag to tell the two apart (every intermediate has requires_grad False)."""
    seen: dict[str, str] = {}
    dependent: dict[int, Tensor] = {id(p): p for p in model.parameters()}
    """The tensors computed from a parameter, by id (held, so that no id is reused during the trace)."""

    def depends(value: object) -> bool:
        if isinstance(value, Tensor):
            return id(value) in dependent
        if isinstance(value, (list, tuple)):
            return any(depends(v) for v in value)
        if isinstance(value, dict):
            return any(depends(v) for v in value.values())
        return False

    def mark(value: object) -> None:
        if isinstance(value, Tensor):
            dependent[id(value)] = value
        elif isinstance(value, (list, tuple)):
            for v in value:
                mark(v)

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name in ("mul", "mul_", "div", "div_") and len(args) > 1:
                other = args[1]
                if isinstance(other, (int, float)) or (isinstance(other, Tensor) and other.numel() == 1
                                                       and not other.requires_grad and not depends(other)):
                    name = "mul_scalar"
            if name in ("native_batch_norm", "_native_batch_norm_legit") and len(args) > 5 and args[5] is True:
                name = "batch_norm_train"
            seen.setdefault(name, str(func))
            out = func(*args, **kwargs)
            if depends(args) or depends(kwargs):
                mark(out)
            return out

    with torch.no_grad(), _Record():
        model(example)
    return seen


def ops_outside(ops: dict[str, str], allowed: frozenset[str]) -> list[str]:
    """The traced operations not in `allowed` (a plain-number `mul` is always allowed)."""
    return sorted(op for op in ops if op not in allowed and op != "mul_scalar")


def exact_applicable(model: nn.Module, example: Tensor | None = None) -> tuple[bool, str]:
    """Whether the exact-diagonal premise holds for `model`, and if not, why.

    The premise is that the logits are piecewise linear in every single parameter; it is decided by a
    walk over the modules: known parametrized layers (Linear, Conv2d, BatchNorm with running statistics
    in eval mode), piecewise-linear parameter-free leaves, dropout that is inactive, and containers whose
    forward is trusted (torch containers, `flatbench.models` classes, registered classes) that hold no
    parameters of their own. Anything else, or a parameter shared by two modules, means no, except that a
    parameter-free module of unknown forward (a residual block written as a plain `nn.Module`, such as
    torchvision's ResNet blocks) is accepted when `example` is given and a forward pass on it calls only
    piecewise-linear operations (`traced_ops`).
    """
    owners: dict[int, str] = {}
    unknown: list[str] = []
    for name, module in model.named_modules():
        where = f"'{name or type(module).__name__}' ({type(module).__name__})"
        direct = list(module.named_parameters(recurse=False))
        for pname, param in direct:
            if id(param) in owners:
                return False, f"parameter {name}.{pname} is shared with {owners[id(param)]} (weight sharing)"
            owners[id(param)] = f"{name}.{pname}"
        base = next((b for b in PARAM_LEAVES if isinstance(module, b)), None)
        if base is not None:
            if not _unmodified_forward(module, base):
                return False, f"{where} overrides the forward of {base.__name__}"
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                if module.training:
                    return False, f"{where} is in train mode (batch statistics couple the examples)"
                if module.running_mean is None or module.running_var is None:
                    return False, f"{where} has no running statistics (it always uses batch statistics)"
            continue
        if direct:
            return False, f"{where} holds parameters the exact diagonal does not know how to handle"
        if isinstance(module, _PIECEWISE_LINEAR_LEAVES):
            continue
        if isinstance(module, _DROPOUTS):
            if module.training and module.p > 0:
                return False, f"{where} is active (train mode)"
            continue
        if _is_known_container(module):
            continue
        if next(module.children(), None) is None:
            unknown.append(f"{where} is not known to be piecewise linear")
        else:
            unknown.append(f"{where} is a container whose forward is not known to be piecewise linear "
                           f"(see register_piecewise_linear_container)")
    if not unknown:
        return True, "piecewise linear in every single parameter"
    if example is None:
        return False, unknown[0]
    try:
        ops = traced_ops(model, example)
    except Exception as exc:  # noqa: BLE001 - a forward that cannot be traced is not trusted
        return False, f"{unknown[0]}; its forward could not be traced ({type(exc).__name__})"
    bad = ops_outside(ops, PIECEWISE_LINEAR_OPS)
    if bad:
        return False, f"{unknown[0]}, and its forward calls {', '.join(bad[:4])} (not piecewise linear)"
    return True, "piecewise linear in every single parameter (forward traced: piecewise-linear operations only)"
