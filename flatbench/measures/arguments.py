"""The arguments of `flatbench.measure`, checked before any work: every bad one is one line.

A user's mistake used to surface deep inside a measure as a torch traceback (55 lines for a model whose input
shape does not fit the data, torch's raw error for `device="cuda"` on a machine without CUDA, a bare functorch
error for a model that BackPACK's `extend()` had hooked). Here each is a `FlatbenchError` naming the argument
and what to do, raised before the first measure runs:

* `check_options`: the device (exists, CUDA available), the dtype (floating point), the HVP mode, the chunk
  size and memory budget, the seed;
* `trial_forward`: one forward pass on two examples, in the dtype and on the device of the measurement: a
  model that cannot run on the data (shapes, integer inputs to a float model) is refused with torch's first
  line and a hint, logits that are not (n, classes) likewise, class targets out of range and regression
  targets of another width than the outputs too; the loss on those logits must give one value per example
  (a scalar loss is named as such, with the `reduction='none'` fix);
* `copy_model`: the copy that is measured, taken through the module's forward: tensors a hook left on a
  module (BackPACK's `input0` / `output`, part of another graph) are not copied, and BackPACK's forward hooks
  are removed from the copy (the caller's model keeps them).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from flatbench.curvature import HVP_MODES
from flatbench.errors import FlatbenchError

FLOAT_DTYPES = (torch.float64, torch.float32)


def check_device(device: Any) -> torch.device:
    """`device` as a torch.device that exists on this machine, or one line saying why not."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise FlatbenchError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise FlatbenchError(f"device {str(dev)!r}: CUDA is not available on this machine (torch "
                                 f"{torch.__version__}); use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise FlatbenchError(f"device {str(dev)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise FlatbenchError(f"device {str(dev)!r}: MPS is not available on this machine; use device='cpu'")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise FlatbenchError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FlatbenchError(f"{name} must be a positive integer, got {value!r}")


def check_options(*, device: Any, dtype: Any, hvp_mode: Any, chunk_size: Any, max_memory_mb: Any,
                  seed: Any) -> torch.device:
    """The plain arguments of `flatbench.measure`; returns the device."""
    if dtype not in FLOAT_DTYPES:
        raise FlatbenchError(f"dtype must be torch.float64 or torch.float32 (the dtype the model is measured in), "
                             f"got {dtype!r}")
    if hvp_mode not in HVP_MODES:
        raise FlatbenchError(f"hvp_mode must be one of {', '.join(HVP_MODES)}, got {hvp_mode!r}")
    _positive_int("chunk_size", chunk_size)
    _positive_int("max_memory_mb", max_memory_mb)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise FlatbenchError(f"seed must be an integer, got {seed!r}")
    return check_device(device)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def trial_forward(net: nn.Module, x: Tensor, y: Tensor, loss_fn: Any) -> int:
    """Run the model (already on its device and in its dtype) on the first two examples and the loss on its
    logits; returns the number of classes. Whatever fails is one line naming the inputs."""
    sample, targets = x[:2], y[:2]
    try:
        with torch.no_grad():
            out = net(sample)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's forward is reported, in one line
        hint = ""
        if not x.dtype.is_floating_point:
            hint = (f"; the inputs are {x.dtype}, given to the model as they are (token ids, for a model that "
                    "starts with nn.Embedding): a network on images or features takes floating-point inputs "
                    "(convert them, e.g. x.float() / 255)")
        raise FlatbenchError(f"the model cannot run on the data: inputs of shape {tuple(x.shape[1:])} (one example) "
                             f"and dtype {x.dtype} give {_first_line(exc)}{hint}") from None
    if not isinstance(out, Tensor) or out.ndim != 2 or out.shape[0] != sample.shape[0]:
        raise FlatbenchError(f"the model must return logits of shape (n, classes), got "
                             f"{tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__} for "
                             f"{sample.shape[0]} examples")
    if not out.dtype.is_floating_point:
        raise FlatbenchError(f"the model returns {out.dtype} outputs: logits must be floating point (an integer or "
                             "boolean output, e.g. an argmax or a cast, has no derivatives and no loss)")
    classes = int(out.shape[1])
    if y.dtype.is_floating_point:  # regression targets (n,) or (n, k): mse compares them with the outputs
        width = int(y.shape[1]) if y.ndim == 2 else 1
        if getattr(loss_fn, "fn", None) is None and width != classes:
            raise FlatbenchError(f"the regression targets have {width} value(s) per example "
                                 f"{tuple(y.shape)}, the model {classes} outputs: mse needs one output per target "
                                 "value (targets (n,) for one output, (n, k) for k)")
    else:
        low, high = (int(v) for v in torch.aminmax(y))
        if high >= classes or low < 0:
            raise FlatbenchError(f"targets must lie in 0..{classes - 1} (the model has {classes} outputs)")
    try:
        with torch.no_grad():
            values = loss_fn.fn(out, targets) if getattr(loss_fn, "fn", None) is not None else None
    except Exception as exc:  # noqa: BLE001
        raise FlatbenchError(f"loss '{loss_fn.name}' fails on the model's logits: {_first_line(exc)}") from None
    if values is not None:
        if isinstance(values, Tensor) and values.ndim == 0:
            raise FlatbenchError(f"loss '{loss_fn.name}' returned a scalar: it must return one loss per example, "
                                 f"shape (n,); compute it with reduction='none' (e.g. "
                                 "F.cross_entropy(logits, targets, reduction='none'))")
        if not isinstance(values, Tensor) or tuple(values.shape) != (sample.shape[0],):
            raise FlatbenchError(f"loss '{loss_fn.name}' must return one loss per example, shape (n,), got "
                                 f"{tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__}"
                                 f" for {sample.shape[0]} examples")
    return classes


def _is_backpack_hook(hook: Any) -> bool:
    return str(getattr(hook, "__module__", "") or "").startswith("backpack")


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy of `model` through its forward: tensors that a forward hook stored on a module (BackPACK's
    `input0`, `output`: non-leaf tensors of another graph, which cannot be deep-copied) are left out of the
    copy, and BackPACK's forward hooks are removed from it (they would store tensors during flatbench's
    transforms). The caller's model is left exactly as it was."""
    stashed: list[tuple[nn.Module, str, Tensor]] = []
    for module in model.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, Tensor) and not isinstance(value, nn.Parameter) and value.grad_fn is not None:
                stashed.append((module, key, value))
                del module.__dict__[key]
    try:
        net = copy.deepcopy(model)
    finally:
        for module, key, value in stashed:
            module.__dict__[key] = value
    for module in net.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks):
            for handle_id in [k for k, h in hooks.items() if _is_backpack_hook(h)]:
                del hooks[handle_id]
    return net
