"""Measuring the caller's model itself rather than a copy, and putting it back exactly as it came.

`flatbench.measure` used to deep-copy the caller's model before every call, so that the eval mode, the
trainable flags and whatever a measure did could never reach the caller. On a small model the deep copy
(Python's recursion over every module's `__dict__`) was the largest part of the API's overhead over the
kernel (issue 29: 0.56 ms of a 5.6 ms exact trace). When only flatbench's code sees the model, the copy
guards against nothing that is not already guarded: each measure runs under `isolation.guarded_call`, which
compares every parameter and buffer bit for bit afterwards and puts back any that changed, with the modes
and `requires_grad` flags. What the guard does not cover, `InPlace` saves and puts back around the whole
call: the modules' train/eval modes and the flags (which the API itself changes: eval, every parameter
trainable), and the `.grad` of every parameter (a measure's backward pass would accumulate into them).

`measurable_in_place` says when this is exact: the model already lies on the device in the dtype of the
measurement (else moving it would change it), the HVP mode is auto (a mode is attached to the measured
model), and no module carries a hook (a hook of the caller's, BackPACK's `extend()`, may store tensors
during the measures' passes; `arguments.copy_model` removes BackPACK's from the copy).
"""

from __future__ import annotations

from types import TracebackType

import torch
from torch import nn

from flatbench.measures.isolation import hooked


def measurable_in_place(model: nn.Module, device: torch.device, dtype: torch.dtype, hvp_mode: str) -> bool:
    """Whether `model` can be measured as it is (see the module docstring): every floating-point parameter and
    buffer already of `dtype` on `device`, the HVP mode auto, no hooks."""
    if hvp_mode != "auto" or device.type != "cpu" and device.index is None:
        return False
    tensors = [*model.parameters(), *(b for b in model.buffers() if b is not None)]
    return (all(t.device == device and (t.dtype == dtype or not t.dtype.is_floating_point) for t in tensors)
            and not any(hooked(m) for m in model.modules()))


class InPlace:
    """Around a measurement of the caller's model itself: on entry saves every module's mode, every
    parameter's `requires_grad` flag and `.grad` (and clears the gradients, so that a backward pass makes
    new ones rather than adding into the caller's); on exit, error or not, puts all three back."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self) -> nn.Module:
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.params = [(p, p.requires_grad, p.grad) for p in self.model.parameters()]
        for p, _, grad in self.params:
            if grad is not None:
                p.grad = None
        return self.model

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for module, training in self.modes:
            module.training = training
        for p, flag, grad in self.params:  # each setter only where needed: a C call each, per parameter
            if p.grad is not None:
                p.grad = None  # before the flag: a gradient cannot stay on a parameter made untrainable
            if p.requires_grad != flag:
                p.requires_grad_(flag)
            if grad is not None:
                p.grad = grad
