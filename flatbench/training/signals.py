"""Stopping training on request: Slurm's and submitit's signals, and Ctrl-C.

SIGTERM / SIGUSR1 (what Slurm sends before a preemption or the time limit) or SIGUSR2 (submitit's
preemption and timeout signal) stops training at the next batch; the last epoch checkpoint stays on disk,
the run is marked `preempted` and `Preempted` propagates so that the process can exit and be requeued
(the CLI with exit code 143; a submitit job requeues itself, see `flatbench.study.cluster`).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any


class Preempted(Exception):
    """Training was asked to stop by a signal; the last epoch checkpoint is on disk."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, name))
"""Signals that make training checkpoint and stop (Slurm: TERM, USR1 via --signal; submitit: USR2)."""


class StopFlag:
    """Set by SIGTERM/SIGUSR1/SIGUSR2 while training; checked between batches, before each run and when
    the outermost training context ends.

    One flag per process: the handlers are installed by the outermost `with StopFlag()` (a whole train
    stage, or one `train_run`) and kept until it exits, so a signal that arrives while a run is evaluated or
    saved, or between two runs, is never dropped: the run being finished is finished, no other run starts,
    and `Preempted` is raised (at the next check, or when the outermost context exits).
    """

    _signal: int | None = None
    _depth = 0
    _old: dict[int, Any] = {}

    def __enter__(self) -> "StopFlag":
        cls = type(self)
        if cls._depth == 0:
            cls._signal = None
            cls._old = {}
            if sys.platform != "win32":
                if threading.current_thread() is threading.main_thread():
                    for sig in STOP_SIGNALS:
                        cls._old[sig] = signal.signal(sig, cls._handle)
        cls._depth += 1
        return self

    @staticmethod
    def _handle(signum: int, _frame: Any) -> None:
        StopFlag._signal = signum

    @property
    def signal(self) -> int | None:
        return type(self)._signal

    @classmethod
    def record(cls, signum: int) -> None:
        """Note a stop signal received by another handler (the worker pool's, which forwards it)."""
        cls._signal = signum

    def check(self) -> None:
        """Raise `Preempted` if a stop signal arrived."""
        if type(self)._signal is not None:
            raise Preempted(f"signal {type(self)._signal}", type(self)._signal)

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        cls = type(self)
        cls._depth -= 1
        if cls._depth > 0:
            return
        for sig, handler in cls._old.items():
            signal.signal(sig, handler)
        cls._old = {}
        pending, cls._signal = cls._signal, None
        if pending is not None and exc_type is None:
            raise Preempted(f"signal {pending}", pending)


def hold_stop_signals() -> None:
    """Install the stop-signal handlers for the rest of this process (a training worker: a signal that
    arrives between two jobs stops the next one before it trains)."""
    StopFlag().__enter__()
