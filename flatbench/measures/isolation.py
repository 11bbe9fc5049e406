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

Beyond the tensors (issue 44), the guard keeps what else of the model a forward pass reads: each module's
hooks, submodules, a `forward` patched on the instance or its class, and plain settings such as a
BatchNorm's eps (`_module_attrs`; where only known code runs, none of these can change and they are not
kept). `DataGuard` keeps the measurement inputs and targets (often the caller's own tensors) and
`process_state.ProcessState` what the process holds for every later entry: torch's settings and global
hooks, signal handlers, threads the measure left running. Each change is put back and makes the entry an
`error` naming it.

`time_limit` stops a measure that runs past its `measure.timeout_s`: SIGALRM in the main thread of a
process, where signals are delivered (it interrupts a blocking call), and a watchdog thread in any thread
(`watchdog`: the time-out raised again until the measure ends, whatever it did to SIGALRM; a process
flatbench owns is ended past a hard deadline). `MeasureTimeout` derives from BaseException so that a
measure's own `except Exception` cannot swallow it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from flatbench.measures.process_state import OutsideChange, ProcessState, no_process_exit
from flatbench.measures.watchdog import KICK, WATCHDOG, install_kick

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


_PLAIN = (bool, int, float, str, type(None))
_WORDS = {"_modules": "submodules", "_parameters": "parameters", "_buffers": "buffers",
          "_non_persistent_buffers_set": "non-persistent buffers"}
_MISSING = object()


def _module_attrs(module: nn.Module) -> dict[str, tuple[Any, Any]]:
    """What of a module's `__dict__` the guard keeps: every dict and set in it (hook registries, submodules,
    parameters, buffers: the object and its items), a function set on the instance (a patched `forward`),
    and plain values (eps, momentum, inplace, a flag); not tensors (compared as parameters and buffers) nor
    other objects a forward pass may keep (a stored activation). The train flag is the modes' part."""
    out: dict[str, tuple[Any, Any]] = {}
    for key, value in module.__dict__.items():
        if isinstance(value, dict):
            out[key] = (value, tuple(value.items()))
        elif isinstance(value, set):
            out[key] = (value, frozenset(value))
        elif key != "training" and (type(value) in _PLAIN or callable(value) and not isinstance(value, nn.Module)):
            out[key] = (value, None)
    return out


def _same_attr(now: tuple[Any, Any], then: tuple[Any, Any]) -> bool:
    (obj, content), (saved, kept) = now, then
    if isinstance(saved, dict):
        return obj is saved and len(content) == len(kept) and all(
            a[0] == b[0] and a[1] is b[1] for a, b in zip(content, kept))
    if isinstance(saved, set):
        return obj is saved and content == kept
    return obj is saved or (type(obj) is type(saved) and type(obj) in _PLAIN and obj == saved)


_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _tensor_hooks(model: nn.Module) -> dict[tuple[str, str], tuple[dict, tuple]]:
    """Each parameter's gradient hooks (`register_hook`, `register_post_accumulate_grad_hook`): the registry
    dict torch reads them from, and its items (a hook left on a parameter would change every later gradient
    of the caller's model)."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        for kind in _TENSOR_HOOKS:
            hooks = getattr(p, kind, None)
            if isinstance(hooks, dict):
                out[(name, kind)] = (hooks, tuple(hooks.items()))
    return out


def _classes(model: nn.Module) -> dict[type, Any]:
    """Every class in the model's modules' MROs (below nn.Module) → its own `forward` (or `_MISSING`)."""
    classes = {c for m in model.modules() for c in type(m).__mro__ if issubclass(c, nn.Module) and c is not nn.Module}
    return {c: c.__dict__.get("forward", _MISSING) for c in classes}


class ModelGuard:
    """The state a model was in before a measure, to compare with (`change`) and to put back (`restore`).
    `bitwise=False` (only flatbench's and torch's code runs: `known_code`) lets a tensor that is the same
    object with the same version counter count as unchanged without comparing its bytes, and leaves the
    modules' attributes out (torch's modules and flatbench's measures set none); otherwise each module's
    hooks, submodules, patched `forward` and plain settings (`_module_attrs`) and its classes' `forward` are
    kept too."""

    def __init__(self, model: nn.Module, bitwise: bool = True):
        tensors, self.modes, self.grads = _walk(model)
        self.tensors = {label: (name, t.detach().clone(memory_format=torch.contiguous_format))
                        for label, (name, t) in tensors.items()}
        self.held = {} if bitwise else {label: (t, _version(t), t.data_ptr(), t.dtype, t.shape)
                                        for label, (_, t) in tensors.items()}
        self.attrs = [(name or "(model)", m, _module_attrs(m)) for name, m in model.named_modules(remove_duplicate=False)
                      ] if bitwise else []
        self.classes = _classes(model) if bitwise else {}
        self.root = model
        self.hooks = _tensor_hooks(model) if bitwise else None

    def _same(self, label: str, now: torch.Tensor) -> bool:
        held, version, pointer, dtype, shape = self.held.get(label, (None, None, None, None, None))
        if (now is held and version is not None and _version(now) == version and now.data_ptr() == pointer
                and now.dtype == dtype and now.shape == shape):
            return True  # no in-place change through torch, nor new data under it (`.data =`, `.double()`)
        return same_bits(now, self.tensors[label][1])

    def _attr_changes(self) -> list[str]:
        """Each module attribute and class `forward` that differs from the kept one, in a few words."""
        out = []
        for name, module, kept in self.attrs:
            now = _module_attrs(module)
            for key in sorted(now.keys() | kept.keys()):
                if key in ("_parameters", "_buffers") or key in now and key in kept and _same_attr(now[key], kept[key]):
                    continue  # the tensors are compared (and named) one by one
                out.append(f"{_WORDS.get(key, key.strip('_').replace('_', ' '))} of {name}")
        out += [f"{c.__name__}.forward" for c, f in self.classes.items() if c.__dict__.get("forward", _MISSING) is not f]
        if self.hooks is not None:
            now = _tensor_hooks(self.root)
            out += sorted({f"gradient hooks of {name}" for key, (_, items) in now.items()
                           if items and self.hooks.get(key, (None, ()))[1] != items for name in key[:1]})
        return out

    def change(self, model: nn.Module) -> str | None:
        """A few words on what differs between the model now and as guarded (None when nothing does)."""
        now, modes_now, grads_now = _walk(model)
        attrs = self._attr_changes() if self.attrs else []
        if (not attrs and now.keys() == self.tensors.keys() and modes_now == self.modes and grads_now == self.grads
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
        if attrs:
            parts.append(_names(attrs))
        return "; ".join(parts) or None

    def _restore_attrs(self) -> None:
        """Put back each module's kept attributes (the same dict and set objects, refilled) and the classes'
        `forward`; an attribute a measure added among them is removed."""
        for _, module, kept in self.attrs:
            now = _module_attrs(module)
            for key in now.keys() - kept.keys():
                del module.__dict__[key]
            for key, (obj, content) in kept.items():
                if key in now and _same_attr(now[key], (obj, content)):
                    continue
                module.__dict__[key] = obj
                if isinstance(obj, dict):
                    obj.clear()
                    obj.update(content)
                elif isinstance(obj, set):
                    obj.clear()
                    obj.update(content)
        for key, (hooks, items) in (_tensor_hooks(self.root) if self.hooks is not None else {}).items():
            kept = self.hooks.get(key, (None, ()))[1]
            if items != kept:  # the same registry object, refilled: torch reads the hooks from it
                hooks.clear()
                hooks.update(kept)
        for cls, forward in self.classes.items():
            if cls.__dict__.get("forward", _MISSING) is not forward:
                if forward is _MISSING:
                    delattr(cls, "forward")
                else:
                    setattr(cls, "forward", forward)

    def restore(self, model: nn.Module) -> None:
        """Put the model back as guarded: its modules' attributes (`_restore_attrs`), tensors copied in place
        (or the saved ones put back where a measure replaced, resized or moved one), modes and requires_grad
        flags set."""
        self._restore_attrs()
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


def measurement_data(ctx: Any) -> dict[str, torch.Tensor]:
    """What of a measure context `DataGuard` keeps: its inputs and targets, by what an error calls them."""
    return {"the measurement inputs": ctx.inputs, "the measurement targets": ctx.targets}


class DataGuard:
    """The measurement set as it was before a measure (inputs and targets, by what they are called): a copy of
    each tensor, compared after it (bitwise, or by the version counter where only flatbench's and torch's
    code ran) and copied back where it changed: the caller's own tensors are often measured as they are."""

    def __init__(self, tensors: dict[str, torch.Tensor], bitwise: bool = True):
        self.kept = {what: (t, t.detach().clone(), _version(t), t.data_ptr(), bitwise)
                     for what, t in tensors.items() if isinstance(t, torch.Tensor)}

    def restore(self) -> list[str]:
        """Put back each tensor that changed; one phrase each."""
        changes = []
        for what, (t, saved, version, pointer, bitwise) in self.kept.items():
            if (not bitwise and version is not None and _version(t) == version and t.data_ptr() == pointer) or \
                    same_bits(t, saved):
                continue
            with torch.no_grad():
                if t.shape == saved.shape and t.dtype == saved.dtype and t.device == saved.device:
                    t.copy_(saved)
                else:
                    t.data = saved
            changes.append(f"changed {what} (restored)")
        return changes


def guarded_call(model: nn.Module, fn: Callable[[], Any], bitwise: bool = True,
                 data: dict[str, torch.Tensor] | None = None) -> tuple[Any, BaseException | None, str | None]:
    """Call `fn` (one measure on `model`) and return (its result, the exception it raised, what it changed
    in the model). The model is after the call as it was before it (put back when the measure changed it),
    and so are the tensors of `data` (`DataGuard`: the measurement inputs and targets) and the process
    (`process_state.ProcessState`: torch's settings and global hooks, threads, signal handlers, ...): a change
    to these is put back and returned as the error, an `OutsideChange` naming it. `os._exit` raises while `fn`
    runs. `bitwise=False` where only flatbench's and torch's code runs (`ModelGuard`). KeyboardInterrupt
    passes through, everything put back: the stage's interrupt handling stops the stage."""
    guard = ModelGuard(model, bitwise)
    kept = DataGuard(data or {}, bitwise)
    state = ProcessState()
    result, error = None, None
    try:
        with no_process_exit(state.threads):
            result = fn()
    except KeyboardInterrupt:
        state.restore()
        kept.restore()
        guard.restore(model)
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit, a timeout, any error of the user's code
        error = exc
    outside = state.restore() + kept.restore()
    if outside:
        also = "" if error is None else f"; it also raised {type(error).__name__}: {str(error)[:200]}"
        error = OutsideChange("; ".join(outside) + also)
    change = guard.change(model)
    if change:
        guard.restore(model)
    return result, error, change


class time_limit:  # noqa: N801 - used as a function: `with time_limit(seconds):`
    """Raise `MeasureTimeout` in the block after `seconds` (None: no limit), in any thread: SIGALRM in the
    main thread of a process that has it (it interrupts a blocking call), and the watchdog everywhere
    (`watchdog.WATCHDOG`: the time-out raised again in the measuring thread until the block ends, whatever it
    did to SIGALRM; a process flatbench owns ended past the hard deadline). A block that caught its time-out
    and went on still raises it as it ends. The previous handler, timer and signal mask are put back."""

    def __init__(self, seconds: float | None, label: str = ""):
        self.seconds, self.label = seconds, label
        self.text = "" if seconds is None else f"timed out after {seconds:g} s"
        self.main = (seconds is not None and hasattr(signal, "setitimer")
                     and threading.current_thread() is threading.main_thread())
        self.alarmed = False

    def _alarm(self, _signum: int, _frame: Any) -> None:
        self.alarmed = True
        raise MeasureTimeout(self.text)

    def __enter__(self) -> time_limit:
        if self.seconds is None:
            return self
        seconds = self.seconds
        if self.main:
            install_kick()
            self.previous = signal.signal(signal.SIGALRM, self._alarm)
            self.mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [s for s in (signal.SIGALRM, KICK) if s])
            signal.setitimer(signal.ITIMER_REAL, float(seconds))
        self.token = WATCHDOG.arm(seconds, MeasureTimeout, self.label)
        return self

    def _cleanup(self) -> bool:
        """Disarm the watchdog and the timer, put the handler and mask back; whether the limit fired (a
        time-out raised here, as this runs, is taken as fired and the cleanup done again)."""
        fired = False
        while True:
            try:
                fired = WATCHDOG.disarm(self.token) or fired
                if self.main:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, self.previous)
                    signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
                return fired or self.alarmed
            except MeasureTimeout:
                self.alarmed = True

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if self.seconds is None:
            return False
        fired = self._cleanup()
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            return False
        if fired or (kind is not None and issubclass(kind, MeasureTimeout)):
            caught = kind is None or not issubclass(kind, MeasureTimeout)
            raise MeasureTimeout(self.text + (" (the measure caught its time-out and went on)" if caught else "")
                                 ) from None
        return False
