"""Each measure sees the model as trained: a copy before, a bitwise comparison after, a restore when it changed.

A measure is the user's code (a plugin) as often as ours, and one context serves every measure of a model:
a measure that doubles the weights in place, calls `.train()` on a BatchNorm network or freezes a layer
would silently change every value computed after it. Before each measure `ModelGuard` keeps a copy of
every parameter and buffer (non-persistent buffers included), the train/eval mode of every module and the
`requires_grad` flag of every parameter. `guarded_call` compares the model with that copy after the
measure, bit for bit (each tensor's bytes, so NaN equals NaN and -0.0 differs from 0.0; its dtype, shape and
device too): a change is described in a few words and the model is put back, so the next measure sees the
model as trained. The copy is needed for the restore anyway, so comparing against it costs one pass over
the bytes, where hashing them before and after cost two hashes on top of the copy (issue 29: the API's
overhead over the kernel). (The guard is taken per call, not once per model: code outside the measures,
such as the audit's rescaling of its own copies, may change a model between measures.)

Where only flatbench's and torch's code can touch the model (`known_code`: a built-in measure, a built-in
loss, modules of torch.nn and flatbench only, no hooks), the comparison is first made by torch's version
counters: every in-place change made through a tensor or a view of it (`mul_`, `copy_`, indexing, an
optimizer's step, BatchNorm's running statistics) bumps the counter, so a tensor that is the same object
with the same counter, over the same memory (new data set under it, `.data = ...` or a module's
`.double()`, moves no counter), holds the same bytes; only a tensor where one of these moved is compared
bit for bit.
What escapes the counters, a write through `.data`, numpy or a raw pointer, is not in that code (flatbench's
measures never write through `.data`; tests/test_in_place.py measures the built-ins in place and compares
every bit afterwards); a plugin measure, a loss or a model of the caller's may use it, so theirs are always
compared bit for bit. On issue 29's MLP this takes the guard's comparison from a pass over 0.9 MB to a
look at six counters.

`time_limit` stops a measure that runs past its `measure.timeout_s` (SIGALRM in the main thread of a
process, where signals are delivered: the CLI and every worker process; elsewhere, e.g. the API called
from a thread, there is no limit). `MeasureTimeout` derives from BaseException so that a measure's own
`except Exception` cannot swallow it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

MAX_NAMES = 3
"""Names listed in a "changed the model" reason before the rest are counted."""


class MeasureTimeout(BaseException):
    """Raised in a measure that ran past its time limit (a BaseException: `except Exception` passes it on)."""


def _walk(model: nn.Module) -> tuple[dict[str, tuple[str, torch.Tensor]], dict[str, bool], dict[str, bool]]:
    """In one pass over the modules: every parameter and buffer by label ("parameter NAME", "buffer NAME") →
    (NAME, tensor), every module's train flag by name ("(model)" for the root), every parameter's
    `requires_grad` by NAME. (What `named_parameters`, `named_buffers` and `named_modules` give, tied and
    repeated ones included, without walking the module tree three times: a third of the guard's cost on a
    small model.)"""
    tensors: dict[str, tuple[str, torch.Tensor]] = {}
    modes: dict[str, bool] = {}
    flags: dict[str, bool] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        modes[prefix or "(model)"] = module.training
        for key, p in module._parameters.items():
            if p is not None:
                name = f"{prefix}.{key}" if prefix else key
                tensors[f"parameter {name}"] = (name, p)
                flags[name] = p.requires_grad
        for key, b in module._buffers.items():
            if b is not None:
                name = f"{prefix}.{key}" if prefix else key
                tensors[f"buffer {name}"] = (name, b)
    return tensors, modes, flags


def model_tensors(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `model` by label ("parameter NAME", "buffer NAME") → (NAME, tensor)."""
    return _walk(model)[0]


_SAME_SIZE_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16}
"""An integer dtype of each element size: a bitwise comparison of floats (NaN equal to NaN, -0.0 not to 0.0)."""


def same_bits(now: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether `now` holds exactly `saved` (a contiguous copy): dtype, shape, device and every byte. On the CPU
    the words are compared by numpy (`torch.equal` is single-threaded there and several times slower: 80 µs
    against 20 on 100k words)."""
    if now.dtype != saved.dtype or now.shape != saved.shape or now.device != saved.device:
        return False
    if not saved.numel():
        return True
    as_int = _SAME_SIZE_INT.get(saved.element_size(), torch.uint8)  # bytes compared a word at a time
    flat = now.detach().reshape(-1).contiguous().view(as_int)
    kept = saved.reshape(-1).view(as_int)
    if flat.device.type == "cpu":
        return bool(np.array_equal(flat.numpy(), kept.numpy()))
    return torch.equal(flat, kept)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES])
    return shown + (f" and {len(names) - MAX_NAMES} more" if len(names) > MAX_NAMES else "")


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None for an inference tensor, which has none)."""
    try:
        return t._version
    except RuntimeError:
        return None


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def hooked(module: nn.Module) -> bool:
    """Whether a hook is registered on the module itself (forward, forward-pre, backward or backward-pre)."""
    return any(getattr(module, attr, None) for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                        "_backward_pre_hooks"))


def known_code(model: nn.Module) -> bool:
    """Whether running `model` runs only torch's and flatbench's code: every module a class of torch.nn or of
    flatbench, no hook on any module nor a global one (a hook, like a model class of the caller's, may write
    through `.data`, which the version counters do not see)."""
    from torch.nn.modules import module as torch_module

    if any(getattr(torch_module, name, None) for name in _GLOBAL_HOOKS):
        return False
    return all(type(m).__module__.startswith(("torch.nn.", "flatbench.")) and not hooked(m) for m in model.modules())


class ModelGuard:
    """The state a model was in before a measure, to compare with (`change`) and to put back (`restore`).
    `bitwise=False` (only flatbench's and torch's code runs: `known_code`) lets a tensor that is the same
    object with the same version counter count as unchanged without comparing its bytes."""

    def __init__(self, model: nn.Module, bitwise: bool = True):
        tensors, self.modes, self.grads = _walk(model)
        self.tensors = {label: (name, t.detach().clone(memory_format=torch.contiguous_format))
                        for label, (name, t) in tensors.items()}
        self.held = {} if bitwise else {label: (t, _version(t), t.data_ptr(), t.dtype, t.shape)
                                        for label, (_, t) in tensors.items()}

    def _same(self, label: str, now: torch.Tensor) -> bool:
        held, version, pointer, dtype, shape = self.held.get(label, (None, None, None, None, None))
        if (now is held and version is not None and _version(now) == version and now.data_ptr() == pointer
                and now.dtype == dtype and now.shape == shape):
            return True  # no in-place change through torch, nor new data under it (`.data =`, `.double()`)
        return same_bits(now, self.tensors[label][1])

    def change(self, model: nn.Module) -> str | None:
        """A few words on what differs between the model now and as guarded (None when nothing does)."""
        now, modes_now, grads_now = _walk(model)
        if (now.keys() == self.tensors.keys() and modes_now == self.modes and grads_now == self.grads
                and all(self._same(k, t) for k, (_, t) in now.items())):
            return None  # the common case in one pass, without the sets that name what changed
        tensors = sorted(set(now) ^ set(self.tensors)
                         | {k for k in now.keys() & self.tensors.keys() if not same_bits(now[k][1], self.tensors[k][1])})
        parts = [_names(tensors)] if tensors else []
        modes = sorted(k for k in self.modes.keys() | modes_now.keys() if self.modes.get(k) != modes_now.get(k))
        if modes:
            parts.append(f"the mode of {_names(modes)} (now {'train' if modes_now.get(modes[0]) else 'eval'})")
        grads = sorted(k for k in self.grads.keys() | grads_now.keys() if self.grads.get(k) != grads_now.get(k))
        if grads:
            parts.append(f"requires_grad of {_names(grads)}")
        return "; ".join(parts) or None

    def restore(self, model: nn.Module) -> None:
        """Put the model back as guarded: tensors copied in place (or the saved ones put back where a measure
        replaced, resized or moved one), modes and requires_grad flags set."""
        now = model_tensors(model)
        with torch.no_grad():
            for label, (name, saved) in self.tensors.items():
                current = now.get(label, (name, None))[1]
                if current is not None and same_bits(current, saved):
                    continue
                if (current is not None and current.shape == saved.shape and current.dtype == saved.dtype
                        and current.device == saved.device):
                    current.copy_(saved)
                else:
                    _put(model, name, saved.clone(), parameter=label.startswith("parameter "))
        for name, module in model.named_modules(remove_duplicate=False):
            if (name or "(model)") in self.modes:
                module.training = self.modes[name or "(model)"]
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in self.grads and p.requires_grad != self.grads[name]:
                p.requires_grad_(self.grads[name])


def _put(model: nn.Module, key: str, value: torch.Tensor, *, parameter: bool) -> None:
    """Set the parameter or buffer `key` (its dotted name) to `value` where a measure replaced it."""
    path, _, leaf = key.rpartition(".")
    owner = model.get_submodule(path) if path else model
    if parameter or leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=True)
    else:
        owner._buffers[leaf] = value


def guarded_call(model: nn.Module, fn: Callable[[], Any], bitwise: bool = True
                 ) -> tuple[Any, BaseException | None, str | None]:
    """Call `fn` (one measure on `model`) and return (its result, the exception it raised, what it changed
    in the model). The model is after the call as it was before it (put back when the measure changed it).
    `bitwise=False` where only flatbench's and torch's code runs (`ModelGuard`). KeyboardInterrupt passes
    through: the stage's interrupt handling stops the stage."""
    guard = ModelGuard(model, bitwise)
    result, error = None, None
    try:
        result = fn()
    except KeyboardInterrupt:
        guard.restore(model)
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit, a timeout, any error of the user's code
        error = exc
    change = guard.change(model)
    if change:
        guard.restore(model)
    return result, error, change


@contextlib.contextmanager
def time_limit(seconds: float | None, label: str = "") -> Iterator[None]:
    """Raise `MeasureTimeout` in the block after `seconds` (SIGALRM; only in the main thread of a process
    that has it, else no limit). The previous handler and timer are put back."""
    usable = (seconds is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def alarm(_signum: int, _frame: Any) -> None:
        raise MeasureTimeout(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
