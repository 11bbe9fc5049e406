"""The watchdog behind each measure's time limit: what SIGALRM alone cannot enforce (issue 44).

`isolation.time_limit` arms SIGALRM, which interrupts a measure blocked in a system call (a sleep, a read),
but a measure can ignore SIGALRM, block it, disarm the timer or catch the exception it raises. So each time
limit is also armed here: one daemon thread per process that, past the deadline, raises the time-out in the
measuring thread itself, every `KICK_EVERY_S` until the measure ends:

- as an asynchronous exception (`PyThreadState_SetAsyncExc`), which the thread gets at its next Python
  instruction (any thread: the API called from a thread of one's own is limited too);
- in the main thread also through a signal of its own (`KICK`, a real-time signal whose handler is installed
  once), which interrupts a blocking system call even where SIGALRM is ignored.

A measure that catches every exception (BaseException too) and goes on cannot be stopped from inside the
process. Past the hard deadline (`hard_after`: the limit plus a grace of 5-60 s), a process that flatbench
owns (the CLI and its worker processes: `owned_process`) is ended with a one-line error and exit code 2:
every entry written before is kept, the entry of that measure is missing (`flatbench status` shows the run
incomplete). Where flatbench does not own the process (the Python API, a notebook), it is never ended: the
watchdog goes on raising the time-out, and the documentation says what that leaves.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

KICK_EVERY_S = 0.25
"""How often the time-out is raised again in a measure past its deadline that goes on."""
EXIT_CODE = 2
"""The exit code of a process ended past a measure's hard deadline (the plugin is bad input: resubmitting the
same command meets it again)."""
KICK = signal.SIGRTMAX - 2 if hasattr(signal, "SIGRTMAX") else None
"""The real-time signal that interrupts the main thread's blocking call past a deadline (None: no such
signals on this platform; the asynchronous exception alone then)."""
_EXIT = os._exit
"""`os._exit` as it was when flatbench loaded (a measure may replace the module attribute)."""


OURS: set[threading.Thread] = set()
"""flatbench's own threads started during a measure (this watchdog): never taken for a thread a measure left."""
LEFT: list[threading.Thread] = []
"""Threads a measure left running that did not stop when asked (`end_if_threads_left`)."""


def hard_after(seconds: float) -> float:
    """The grace after a time limit before the owning process is ended: a tenth of the limit, 5 to 60 s."""
    return min(60.0, max(5.0, seconds / 10))


@dataclass
class _Arm:
    ident: int
    exc: type[BaseException]
    label: str
    seconds: float
    soft: float
    hard: float
    next: float
    fired: bool = False


def _raise_in(ident: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in the thread `ident` at its next Python instruction (None: clear one pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


class _Drained(BaseException):
    """The exception `_clear_own_pending` delivers to itself (never seen outside it)."""


def _clear_own_pending() -> None:
    """Clear a time-out still pending in the calling thread by delivering a private exception in its place.

    Clearing with `PyThreadState_SetAsyncExc(id, NULL)` is not enough in CPython 3.11: it leaves the
    interpreter's eval breaker signalled for good (only a delivered asynchronous exception resets it), so every
    later instruction of the process takes the slow path, and under `sys.setprofile` or `sys.settrace` the
    interpreter loops forever on one instruction (a profiler or a coverage run after a timed-out measure hung;
    the suite hung in CI). Delivering `_Drained` inside this `try` resets it."""
    try:
        _raise_in(threading.get_ident(), _Drained)
        for _ in range(100_000):  # the exception arrives at the next check of the eval breaker
            pass
    except _Drained:
        return
    _raise_in(threading.get_ident(), None)  # not delivered (cannot happen on CPython): clear it at least


class Watchdog:
    """The process's watchdog thread and its armed deadlines (see the module docstring)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.armed: dict[int, _Arm] = {}
        self.count = 0
        self.thread: threading.Thread | None = None
        self.owned = False
        self.kicked: dict[int, type[BaseException]] = {}
        """The main thread's time-out to raise from the KICK handler (by thread id)."""

    def arm(self, seconds: float, exc: type[BaseException], label: str) -> int:
        """Arm a deadline `seconds` from now for the calling thread; returns its token for `disarm`."""
        now = time.monotonic()
        with self.cond:
            self.count += 1
            self.armed[self.count] = _Arm(threading.get_ident(), exc, label, seconds, now + seconds,
                                          now + seconds + hard_after(seconds), now + seconds)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="flatbench-watchdog", daemon=True)
                OURS.add(self.thread)  # the guard must not take it for a thread a measure left
                self.thread.start()
            self.cond.notify()
        return self.count

    def disarm(self, token: int) -> bool:
        """Disarm a deadline; whether it fired (a time-out still pending in the thread is cleared)."""
        with self.cond:
            arm = self.armed.pop(token, None)
            self.kicked.pop(threading.get_ident(), None)
            if arm is not None and arm.fired:
                _clear_own_pending()  # arm.ident is this thread: `arm` arms the calling thread
            return arm is not None and arm.fired

    def _run(self) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                due = min((a.next for a in self.armed.values()), default=None)
                if due is None or due > now:
                    self.cond.wait(None if due is None else due - now)
                    continue
                for arm in list(self.armed.values()):
                    if arm.next <= now:
                        self._fire(arm, now)

    def _fire(self, arm: _Arm, now: float) -> None:
        """Raise the time-out in the measuring thread (and kick the main thread's blocking call); past the
        hard deadline, end a process flatbench owns."""
        if now >= arm.hard and self.owned:
            _end(arm)
        arm.fired = True
        arm.next = now + KICK_EVERY_S
        _raise_in(arm.ident, arm.exc)
        if KICK is not None and arm.ident == threading.main_thread().ident:
            self.kicked[arm.ident] = arm.exc
            with contextlib.suppress(OSError, ValueError):
                signal.pthread_kill(arm.ident, KICK)

    def kick_handler(self, _signum: int, _frame: Any) -> None:
        """The KICK signal's handler: the main thread's time-out, where one fired (else nothing)."""
        exc = self.kicked.get(threading.get_ident())
        if exc is not None:
            raise exc()


WATCHDOG = Watchdog()


def install_kick() -> None:
    """Install the KICK signal's handler once (from the main thread; elsewhere a no-op)."""
    if KICK is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(KICK) != WATCHDOG.kick_handler:
        signal.signal(KICK, WATCHDOG.kick_handler)


def _end(arm: _Arm) -> None:
    """End the process: a measure ignored its time limit past the hard deadline."""
    try:
        print(f"error: measure '{arm.label}' ignored its time limit of {arm.seconds:g} s (it caught or blocked the "
              f"time-out) and was still running {hard_after(arm.seconds):g} s later: the process is ended; the "
              "entries written before it are kept (fix or remove that measure)", file=sys.__stderr__)
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if stream is not None:
                stream.flush()
    finally:
        _EXIT(EXIT_CODE)


def end_if_threads_left(code: Any) -> None:
    """End the process now with `code` (output flushed first) when a measure left a non-daemon thread running:
    the interpreter would otherwise wait for it at exit, and a finished command would never end. Called by
    the CLI as a command ends; nothing happens where no such thread is alive."""
    alive = [t for t in LEFT if t.is_alive() and not t.daemon]
    if not alive:
        return
    status = code if isinstance(code, int) else (0 if code is None else 1)
    try:
        print(f"note: a measure left {len(alive)} non-daemon thread(s) running "
              f"({', '.join(t.name for t in alive[:3])}); ending the process (exit {status})", file=sys.__stderr__)
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if stream is not None:
                stream.flush()
    finally:
        _EXIT(status)


def own_process() -> None:
    """This process is flatbench's own from now on (a worker process): see `owned_process`."""
    WATCHDOG.owned = True


@contextlib.contextmanager
def owned_process() -> Iterator[None]:
    """Within the block this process is flatbench's own (a CLI command, a worker process): a measure past its
    hard deadline ends it."""
    before, WATCHDOG.owned = WATCHDOG.owned, True
    try:
        yield
    finally:
        WATCHDOG.owned = before
