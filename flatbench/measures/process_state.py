"""What a measure may change outside the model, seen and put back after every measure (issue 44).

A measure runs in the measuring process, beside the built-in measures and the caller's own code: besides the
model (`isolation.ModelGuard`) and the measurement set (`isolation.DataGuard`), it can reach the process
itself. `ProcessState` records before each measure what would change every later entry or the caller's
session, compares it afterwards, puts back what changed and names it:

- torch's settings: the default dtype and device, the number of threads (float32 sums depend on it), grad
  mode, anomaly detection, deterministic algorithms, the float32 matmul precision, cuDNN's flags;
- torch's global module hooks (`register_module_forward_hook` and its siblings) and nn.Module's call path
  (`__call__`, `_call_impl`), the functions of `torch`, `torch.nn.functional` and `torch.Tensor` (`torch.relu`
  replaced would change every later ReLU network), torch function and dispatch modes left entered;
- the process: the working directory, `sys.stdout` / `stderr` / `stdin`, a trace or profile function, the
  recursion limit, and (in the main thread) the handlers of SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGALRM and
  SIGHUP and the blocked-signal mask;
- threads the measure started that are still alive after it (`left_threads`): each is asked to stop (an
  asynchronous SystemExit, which it gets at its next Python instruction) and named; one that does not stop
  is still running, and `watchdog.end_if_threads_left` ends a command whose measure left a non-daemon thread behind,
  which would otherwise keep the finished process alive.

torch's CPU random generator is put back too, silently: a measure drawing from it without `ctx.generator`
is not wrong, but the caller's random stream and the next measure's must not depend on it.

`no_process_exit` turns `os._exit` in the measuring process into an exception while a measure runs. What
cannot be guarded in-process (a signal sent to the process, `posix._exit` or libc's `_exit` called directly,
a crash of native code, memory exhausted) is listed in docs/guide/bad-input.md ("Plugins, models and caches").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from flatbench.measures.watchdog import LEFT, OURS

_REAL_EXIT = os._exit
"""`os._exit` as it was when flatbench loaded (a measure may replace the module attribute)."""


class OutsideChange(RuntimeError):
    """A measure changed something outside the model (put back): its entry's error, naming what changed."""


class ProcessExitRefused(BaseException):
    """Raised in place of `os._exit` called by a measure in the measuring process."""


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _cudnn() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cudnn
    return b.enabled, b.benchmark, b.deterministic, b.allow_tf32


def _set_cudnn(value: tuple[bool, bool, bool, bool]) -> None:
    b = torch.backends.cudnn
    b.enabled, b.benchmark, b.deterministic, b.allow_tf32 = value


def _mode_stacks() -> tuple[int, int]:
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def _pop_modes(value: tuple[int, int]) -> None:
    """Leave the torch function and dispatch modes entered since (a stack shorter than it was stays so)."""
    from torch.utils._python_dispatch import _pop_mode

    while torch._C._len_torch_function_stack() > value[0]:
        torch._C._pop_torch_function_stack()
    while torch._C._len_torch_dispatch_stack() > value[1]:
        _pop_mode()


def _registry(name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Get and put back one of torch's global hook registries (an OrderedDict in torch.nn.modules.module,
    put back as the same object: a hook's handle removes itself from that object)."""
    def get() -> Any:
        d = getattr(torch_module, name)
        return d, tuple(d.items()) if isinstance(d, dict) else d

    def put(value: Any) -> None:
        d, items = value
        setattr(torch_module, name, d)
        if isinstance(d, dict):
            d.clear()
            d.update(items)
    return get, put


def _attributes(owner: Any, names: tuple[str, ...]) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Get and put back attributes of a class or module (the object each holds, or absent)."""
    missing = object()

    def get() -> Any:
        return tuple(owner.__dict__.get(n, missing) for n in names)

    def put(value: Any) -> None:
        for n, v in zip(names, value):
            if v is missing:
                if n in owner.__dict__:
                    delattr(owner, n)
            else:
                setattr(owner, n, v)
    return get, put


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _torch_own(value: Any) -> bool:
    """A function whose code lies in torch's own files: torch replacing one of its functions lazily (importing
    torch._dynamo wraps `torch.manual_seed`), not a measure's doing."""
    code = getattr(value, "__code__", None)
    return code is not None and code.co_filename.startswith(_TORCH_DIR)


class _Names(dict):
    """A namespace's names → objects, equal to another when each name holds the very same object (`==` on the
    objects themselves may be elementwise, raise, or call the measure's code), or one torch put there itself
    (`_torch_own`); a name added to a module (not a class) is no change: existing code does not read it."""

    taken = 0
    """How many snapshots were taken: a snapshot's serial tells the earlier of two (`__eq__`)."""

    def __init__(self, items: Any, added_counts: bool):
        super().__init__(items)
        self.added_counts = added_counts
        _Names.taken += 1
        self.serial = _Names.taken

    def differ(self, other: dict) -> list[str]:
        """The names of `other` (a later snapshot) that differ from these."""
        out = [k for k, v in self.items() if k not in other or other[k] is not v and not _torch_own(other[k])]
        return out + ([k for k in other if k not in self] if self.added_counts else [])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Names):
            return False
        earlier, later = (self, other) if self.serial < other.serial else (other, self)
        return not earlier.differ(later)

    __hash__ = None  # type: ignore[assignment]


def _namespace(owner: Any) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Get and put back every name of a module or class (`torch.relu`, `F.linear`, `torch.Tensor.relu`: a
    function replaced by a measure changes every later forward pass). Submodules are left out: torch imports
    some lazily, on first use, which is no change of a measure's."""
    added_counts = isinstance(owner, type)

    def get() -> Any:
        return _Names(((k, v) for k, v in vars(owner).items() if not isinstance(v, types.ModuleType)), added_counts)

    def put(value: Any) -> None:
        now = get()
        for key in value.differ(now):
            if key in value:
                setattr(owner, key, value[key])
            else:
                delattr(owner, key)
    return get, put


def _std_streams() -> tuple[Any, Any, Any]:
    return sys.stdin, sys.stdout, sys.stderr


def _set_std_streams(value: tuple[Any, Any, Any]) -> None:
    sys.stdin, sys.stdout, sys.stderr = value


SETTINGS: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = [
    ("torch's default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("torch's number of threads", torch.get_num_threads, torch.set_num_threads),
    ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("anomaly detection", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    ("deterministic algorithms", _deterministic, _set_deterministic),
    ("the float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("torch's default device", torch.get_default_device, torch.set_default_device),
    ("cuDNN's flags", _cudnn, _set_cudnn),
    ("torch function or dispatch modes (left entered)", _mode_stacks, _pop_modes),
    *((f"torch's {name.strip('_').replace('_', ' ')}", *_registry(name))
      for name in sorted(n for n in vars(torch_module) if n.startswith("_global_"))),
    ("nn.Module's call", *_attributes(nn.Module, ("__call__", "_call_impl", "_wrapped_call_impl", "__getattr__",
                                                  "__setattr__"))),
    ("torch.nn.functional", *_namespace(F)),
    ("the torch namespace", *_namespace(torch)),
    ("torch.Tensor's methods", *_namespace(torch.Tensor)),
    ("the working directory", os.getcwd, os.chdir),
    ("sys.stdin, sys.stdout or sys.stderr", _std_streams, _set_std_streams),
    ("the trace function (sys.settrace)", sys.gettrace, sys.settrace),
    ("the profile function (sys.setprofile)", sys.getprofile, sys.setprofile),
    ("the recursion limit", sys.getrecursionlimit, sys.setrecursionlimit),
]
"""(what, get, put back) of every process-wide setting `ProcessState` guards."""

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGHUP")
                if hasattr(signal, name))
"""The signals whose handlers a measure must leave as they were (Ctrl-C, preemption, the time limit)."""


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == fails or is not a truth value: compared by identity
        return False


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class ProcessState:
    """The process-wide state before a measure (see the module docstring): `restore()` after it puts back
    what changed and says what that was."""

    def __init__(self) -> None:
        self.values = [get() for _, get, _ in SETTINGS]
        self.rng = torch.get_rng_state()
        self.main = threading.current_thread() is threading.main_thread()
        self.signals = [signal.getsignal(s) for s in SIGNALS] if self.main else []
        self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if self.main and hasattr(signal, "pthread_sigmask") \
            else None
        self.threads = set(threading.enumerate())

    def restore(self) -> list[str]:
        """Put back everything that changed since; one phrase per change a measure must not make (the random
        generator is put back without one), threads it left running first (`left_threads`)."""
        changes = left_threads(self.threads)
        for (what, get, put), before in zip(SETTINGS, self.values):
            now = get()
            if not _same(now, before):
                plain = isinstance(before, (bool, int, float, str, torch.dtype, torch.device))
                changes.append(f"changed {what}" + (f" from {_shown(before)} to {_shown(now)}" if plain else "")
                               + " (restored)")
                put(before)
        if self.main:
            for sig, before in zip(SIGNALS, self.signals):
                if signal.getsignal(sig) is not before and before is not None:
                    changes.append(f"changed the handler of {signal.Signals(sig).name} (restored)")
                    signal.signal(sig, before)
            if self.mask is not None and signal.pthread_sigmask(signal.SIG_BLOCK, []) != self.mask:
                changes.append("changed the blocked signals (restored)")
                signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
        rng = torch.get_rng_state()
        if not torch.equal(rng, self.rng):
            torch.set_rng_state(self.rng)
        return changes


def _stop(thread: threading.Thread) -> None:
    """Ask a thread to stop: SystemExit raised in it at its next Python instruction (a thread blocked in
    native code gets it when it returns; one that catches it goes on)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit))


STOP_WAIT_S = 0.2
"""How long the threads a measure left are waited for after being asked to stop."""


def left_threads(before: set[threading.Thread]) -> list[str]:
    """A phrase for each thread started since `before` and still alive (asked to stop, waited for up to
    `STOP_WAIT_S`), naming it and whether it stopped; one still alive is kept in `LEFT`."""
    new = [t for t in threading.enumerate() if t not in before and t not in OURS and t.is_alive()
           and not isinstance(t, threading._DummyThread)]
    if not new:
        return []
    for t in new:
        _stop(t)
    for t in new:
        t.join(STOP_WAIT_S / len(new))
    running = [t for t in new if t.is_alive()]
    LEFT.extend(running)
    names = ", ".join(f"'{t.name}'" + ("" if t.daemon else " (non-daemon)") for t in new[:3])
    more = f" and {len(new) - 3} more" if len(new) > 3 else ""
    state = ("asked to stop: stopped" if not running else f"asked to stop: {len(running)} still running, which may "
             "change the model or the process later")
    return [f"left {len(new)} thread(s) running after it returned: {names}{more} ({state})"]


@contextlib.contextmanager
def no_process_exit(before: set[threading.Thread] | None = None) -> Iterator[None]:
    """While the block runs, `os._exit` called by its thread or a thread started since (not among `before`)
    raises `ProcessExitRefused`; flatbench's own threads and another process (a forked child) still exit."""
    pid, me = os.getpid(), threading.current_thread()
    before = set(threading.enumerate()) if before is None else before
    real = os._exit

    def refused(status: int = 0) -> None:
        current = threading.current_thread()
        if os.getpid() != pid or current in OURS or current is not me and current in before:
            _REAL_EXIT(status)
        raise ProcessExitRefused(f"os._exit({status!r}): the measure tried to end the process")

    os._exit = refused
    try:
        yield
    finally:
        os._exit = real
