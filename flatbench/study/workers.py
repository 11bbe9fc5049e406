"""Several runs at once on one device: a pool of worker processes, one run (or measure target) per job.

Small models leave a device idle (a WRN-16-4 at batch 128 does not fill an H200; an MLP at batch 128 does
not keep two CPU cores busy), so `train.workers: N` / `measure.workers: N` train or measure up to N runs
concurrently, each in its own process on the same device. Each job runs exactly the code a run runs alone
(`train.train_run`, `measures.runner.measure_run`), so its files are the same as when trained alone (on the
CPU bit for bit when the thread count is the same; see docs/guide/cluster.md for CUDA).

Processes are started with `spawn` (a fork of a process holding torch's thread pools can deadlock). On the
CPU each worker gets `torch.get_num_threads() // N` threads (at least one), so N workers share the cores
instead of oversubscribing them. Stop signals (SIGTERM, SIGUSR1, SIGUSR2: what Slurm and submitit send
before a preemption) are forwarded to the workers, which checkpoint and stop as a lone run does; the
caller then raises `train.Preempted`. Ctrl-C reaches the workers through the terminal's process group.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import util as mp_util
from typing import Any

import torch

from flatbench.errors import FlatbenchError, silence_library_noise
from flatbench.measures.watchdog import end_if_threads_left, own_process
from flatbench.training.signals import STOP_SIGNALS, StopFlag, hold_stop_signals


def _init_worker(threads: int, parent: int, hold_signals: bool = False) -> None:
    die_with_parent(parent)
    own_process()  # a measure past its hard time limit ends this worker (the parent reports the task)
    # a non-daemon thread a measure left would keep this worker, and the pool's shutdown, waiting forever:
    # ended as the worker exits, before multiprocessing joins the threads (`watchdog.end_if_threads_left`)
    mp_util.Finalize(None, end_if_threads_left, args=(0,), exitpriority=100)
    if hold_signals:
        hold_stop_signals()
    torch.set_num_threads(max(1, threads))
    silence_library_noise()


def die_with_parent(parent: int) -> None:
    """End this worker when the process that started it dies, however it dies (kill -9 included): on Linux
    the kernel sends SIGKILL (prctl PR_SET_PDEATHSIG); elsewhere a thread watches the parent. A run being
    trained keeps its last epoch checkpoint, as when a lone training is killed, and resumes from it."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="flatbench-parent-watch", daemon=True).start()


def threads_per_worker(workers: int, device: torch.device) -> int:
    """CPU threads of each worker: the cores divided among the workers (a CUDA worker needs few)."""
    total = torch.get_num_threads()
    if torch.device(device).type == "cuda":
        return max(1, min(2, total // max(1, workers)))
    return max(1, total // max(1, workers))


def run_jobs(fn: Callable[..., Any], jobs: Iterable[tuple], workers: int, device: torch.device,
             on_result: Callable[[tuple, Any], None], hold_signals: bool = False) -> None:
    """Run `fn(*job)` for every job in a pool of `workers` processes, calling `on_result(job, result)` in
    this process as each finishes (in completion order). `fn` must be a module-level function and the
    jobs picklable. An exception in a job is raised here after the pool is shut down. The workers die
    with this process (`die_with_parent`). `hold_signals`: the workers keep the training stop flag
    (`training.hold_stop_signals`) from their start, and a stop signal forwarded to them is also recorded here
    (`training.StopFlag.record`)."""
    jobs = list(jobs)
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=max(1, min(workers, len(jobs))), mp_context=ctx,
                               initializer=_init_worker,
                               initargs=(threads_per_worker(workers, device), os.getpid(), hold_signals))
    forwarded: dict[int, Any] = {}

    def forward(signum: int, _frame: Any) -> None:
        if hold_signals:
            StopFlag.record(signum)
        for proc in list(getattr(pool, "_processes", {}).values()):
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass

    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            forwarded[sig] = signal.signal(sig, forward)
    try:
        pending: dict[Future, tuple] = {pool.submit(fn, *job): job for job in jobs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                job = pending.pop(future)
                on_result(job, future.result())
    except BrokenProcessPool:
        pool.shutdown(wait=True, cancel_futures=True)
        raise FlatbenchError("a worker process ended abruptly (its own error line is above: e.g. a measure that "
                             "ignored its time limit); the entries written before are kept, `flatbench status` "
                             "shows what is missing") from None
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
    pool.shutdown(wait=True)
