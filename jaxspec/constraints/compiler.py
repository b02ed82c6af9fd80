"""Compiling constraints in worker processes, each job bounded in time and memory, abandonable at any moment.

outlines-core's compile of a small spec can run for minutes, take gigabytes or abort the process (its Rust
allocator does on failure), and cannot be interrupted from Python. So it runs in `worker.py`, a process that
imports no jax (spawning it is cheap next to a compile, and workers persist), under the job's address-space and
CPU-time limits and at a lower priority; the parent waits on it, killing it when its `cancel` event is set or
when a worker starved of the CPU overruns `wall_seconds`, and starts a fresh one for the next job. A worker
that dies mid-job means the job needed more than its budget: SIGXCPU its CPU time, anything else (the Rust
allocator's abort, a MemoryError) its memory.

At most `max_workers` jobs run at once (default: half the cores, 2 to 4; two, so that one slow compile does
not hold every other constrained request behind it; niced, so the engine keeps its cores); more wait their
turn, and beyond `max_waiting` waiting ones a job is refused (`CompilerBusy`) rather than queued.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

from .limits import ConstraintLimits, ConstraintTooLarge

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
_POLL_S = 0.05  # how often a waiting parent looks at its cancel event


class CompileCancelled(Exception):
    """The compile's cancel event was set (its client left): the worker was killed, nothing was compiled."""


class CompilerBusy(RuntimeError):
    """Too many compiles are waiting for a worker; retry later."""


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.3g} MiB"


def wall_seconds(limits: ConstraintLimits) -> float:
    """How long the parent waits for a job: the worker stops itself after `time_s` seconds of CPU (RLIMIT_CPU);
    this bound catches a worker starved of the CPU for much longer than that on a busy machine."""
    return 3 * limits.time_s + 5


def _too_slow(job: dict, limits: ConstraintLimits) -> ConstraintTooLarge:
    return ConstraintTooLarge(f"compiling {job['what']} needed more than {limits.time_s:g} s of CPU time "
                              f"(time_s={limits.time_s:g})", "time_s", limits.time_s)


class Worker:
    """One worker process and the vocabularies it holds."""

    def __init__(self):
        parent, child = socket.socketpair()
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.process = subprocess.Popen([sys.executable, WORKER, str(child.fileno())], pass_fds=(child.fileno(),),
                                        stdin=subprocess.DEVNULL, env=env)
        child.close()
        self.conn = Connection(parent.detach())
        self.fingerprints: set[str] = set()  # vocabularies sent to it

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        self.conn.close()

    def run(self, job: dict, vocabulary: tuple, limits: ConstraintLimits,
            cancel: threading.Event | None) -> dict:
        """The tables the worker compiles for `job` (see worker.py), within `limits.time_s`; ConstraintTooLarge
        for a budget or limit exceeded, ValueError for a spec outlines-core refuses, CompileCancelled. On any of
        those but a refusal the worker is killed (`alive()` turns False)."""
        deadline = time.monotonic() + wall_seconds(limits)
        fingerprint = job["fingerprint"]
        try:
            self.conn.send(("compile", job, None if fingerprint in self.fingerprints else vocabulary))
            self.fingerprints.add(fingerprint)
            while not self.conn.poll(_POLL_S):
                if cancel is not None and cancel.is_set():
                    self.kill()
                    raise CompileCancelled("the compile was cancelled")
                if time.monotonic() > deadline:
                    self.kill()
                    raise _too_slow(job, limits)
            reply = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            if self.process.returncode == -signal.SIGXCPU:
                raise _too_slow(job, limits) from None
            raise ConstraintTooLarge(f"compiling {job['what']} needed more than {_gib(limits.memory_bytes)} "
                                     f"(memory_bytes={limits.memory_bytes}; the compile worker exited with "
                                     f"{self.process.returncode})", "memory_bytes", limits.memory_bytes) from None
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "refused":
            _, limit, maximum, value, message = reply
            raise ConstraintTooLarge(message, limit, maximum, value)
        raise ValueError(reply[1])


class Compiler:
    """A pool of `Worker`s: `slot()` waits for one (at most `max_workers` busy, `max_waiting` waiting)."""

    def __init__(self, max_workers: int | None = None, max_waiting: int = 16):
        if max_workers is None:
            max_workers = max(2, min(4, (os.cpu_count() or 2) // 2))
        if max_workers < 1 or max_waiting < 0:
            raise ValueError(f"max_workers={max_workers} must be >= 1 and max_waiting={max_waiting} >= 0")
        self.max_workers = max_workers  # compiles running at once
        self.max_waiting = max_waiting  # compiles waiting for a worker beyond those; more raise CompilerBusy
        self._cond = threading.Condition()
        self._idle: list[Worker] = []
        self._busy = 0
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Compiles waiting for a worker now."""
        return self._waiting

    @contextlib.contextmanager
    def slot(self, cancel: threading.Event | None = None) -> Iterator[Worker]:
        """A worker of this pool's for one job (an idle one, or a new one); CompilerBusy when max_waiting jobs
        already wait, CompileCancelled when `cancel` is set while waiting."""
        with self._cond:
            if self._busy >= self.max_workers and self._waiting >= self.max_waiting:
                raise CompilerBusy(f"{self._waiting} constraint compiles are waiting for {self.max_workers} "
                                   "workers; retry later")
            self._waiting += 1
            try:
                while self._busy >= self.max_workers:
                    if cancel is not None and cancel.is_set():
                        raise CompileCancelled("the compile was cancelled while waiting for a worker")
                    self._cond.wait(_POLL_S)
            finally:
                self._waiting -= 1
            self._busy += 1
            worker = self._idle.pop() if self._idle else None
        try:
            if worker is None or not worker.alive():
                worker = Worker()
            yield worker
        finally:
            with self._cond:
                self._busy -= 1
                if worker is not None and worker.alive():
                    self._idle.append(worker)
                self._cond.notify()

    def close(self) -> None:
        """Stop the idle workers (busy ones stop when their job ends and nobody takes them)."""
        with self._cond:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


__all__ = ["CompileCancelled", "Compiler", "CompilerBusy", "Worker"]
