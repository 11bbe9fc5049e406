"""Each measure sees the model as trained: a fingerprint before and after, a restore when it changed.

A measure is the user's code (a plugin) as often as ours, and one context serves every measure of a model:
a measure that doubles the weights in place, calls `.train()` on a BatchNorm network or freezes a layer
would silently change every value computed after it. Before each measure `ModelGuard` keeps a copy of
the model's state (parameters and buffers), the train/eval mode of every module and the `requires_grad`
flag of every parameter, and a cheap fingerprint of them (a hash of each tensor's bytes: exact, and a few
milliseconds for a million parameters). `guarded_call` compares the fingerprint after the measure: a
change is described in a few words and the model is put back, so the next measure sees the model as
trained. (The guard is taken per call, not once per model: code outside the measures, such as the audit's
rescaling of its own copies, may change a model between measures.)

`time_limit` stops a measure that runs past its `measure.timeout_s` (SIGALRM in the main thread of a
process, where signals are delivered: the CLI and every worker process; elsewhere, e.g. the API called
from a thread, there is no limit). `MeasureTimeout` derives from BaseException so that a measure's own
`except Exception` cannot swallow it.
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MAX_NAMES = 3
"""Names listed in a "changed the model" reason before the rest are counted."""


class MeasureTimeout(BaseException):
    """Raised in a measure that ran past its time limit (a BaseException: `except Exception` passes it on)."""


def _tensor_digest(t: torch.Tensor) -> str:
    """An exact fingerprint of a tensor: its dtype, shape and the hash of its bytes."""
    flat = t.detach().reshape(-1).contiguous()
    data = flat.view(torch.uint8) if flat.numel() else flat
    raw = data.cpu().numpy().tobytes() if data.numel() else b""
    return f"{flat.dtype}{tuple(t.shape)}:{hashlib.blake2b(raw, digest_size=16).hexdigest()}"


@dataclass(frozen=True)
class Fingerprint:
    """What a measure must leave as it found it: tensors (by name), module modes, requires_grad flags."""

    tensors: dict[str, str]
    modes: dict[str, bool]
    grads: dict[str, bool]


def fingerprint(model: nn.Module) -> Fingerprint:
    """The model's fingerprint (parameters and buffers hashed, every module's mode, every requires_grad)."""
    tensors = {f"parameter {n}": _tensor_digest(p) for n, p in model.named_parameters(remove_duplicate=False)}
    tensors.update({f"buffer {n}": _tensor_digest(b) for n, b in model.named_buffers(remove_duplicate=False)
                    if b is not None})
    modes = {n or "(model)": m.training for n, m in model.named_modules(remove_duplicate=False)}
    grads = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
    return Fingerprint(tensors, modes, grads)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES])
    return shown + (f" and {len(names) - MAX_NAMES} more" if len(names) > MAX_NAMES else "")


def describe_change(before: Fingerprint, after: Fingerprint) -> str | None:
    """A few words on what differs between two fingerprints (None when nothing does)."""
    parts = []
    tensors = sorted(set(before.tensors) ^ set(after.tensors)
                     | {k for k in before.tensors.keys() & after.tensors.keys() if before.tensors[k] != after.tensors[k]})
    if tensors:
        parts.append(f"{_names(tensors)}")
    modes = sorted(k for k in before.modes.keys() | after.modes.keys() if before.modes.get(k) != after.modes.get(k))
    if modes:
        now = "train" if after.modes.get(modes[0]) else "eval"
        parts.append(f"the mode of {_names(modes)} (now {now})")
    grads = sorted(k for k in before.grads.keys() | after.grads.keys() if before.grads.get(k) != after.grads.get(k))
    if grads:
        parts.append(f"requires_grad of {_names(grads)}")
    return "; ".join(parts) or None


class ModelGuard:
    """The state a model was in before a measure, to compare with and to put back."""

    def __init__(self, model: nn.Module):
        self.state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items() if v is not None}
        self.modes = {n: m.training for n, m in model.named_modules(remove_duplicate=False)}
        self.grads = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
        self.print = fingerprint(model)

    def restore(self, model: nn.Module) -> None:
        """Put the model back as guarded: tensors copied in place (or the saved ones put back where a measure
        replaced or resized one), modes and requires_grad flags set."""
        current = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, saved in self.state.items():
                now = current.get(key)
                if now is not None and now.shape == saved.shape and now.dtype == saved.dtype:
                    now.copy_(saved)
                else:
                    _put(model, key, saved.clone())
        for name, module in model.named_modules(remove_duplicate=False):
            if name in self.modes:
                module.training = self.modes[name]
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in self.grads and p.requires_grad != self.grads[name]:
                p.requires_grad_(self.grads[name])


def _put(model: nn.Module, key: str, value: torch.Tensor) -> None:
    """Set the parameter or buffer `key` (a state-dict name) to `value` where a measure replaced it."""
    path, _, leaf = key.rpartition(".")
    owner = model.get_submodule(path) if path else model
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=True)
    else:
        owner._buffers[leaf] = value


def guarded_call(model: nn.Module, fn: Callable[[], Any]) -> tuple[Any, BaseException | None, str | None]:
    """Call `fn` (one measure on `model`) and return (its result, the exception it raised, what it changed
    in the model). The model is after the call as it was before it (put back when the measure changed it).
    KeyboardInterrupt passes through: the stage's interrupt handling stops the stage."""
    guard = ModelGuard(model)
    result, error = None, None
    try:
        result = fn()
    except KeyboardInterrupt:
        guard.restore(model)
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit, a timeout, any error of the user's code
        error = exc
    change = describe_change(guard.print, fingerprint(model))
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
