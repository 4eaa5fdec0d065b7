"""The engine thread: one OS thread that runs all of a process's torch work, load to shutdown.

Why it exists.  torch's CPU ops and the engine's compiled kernels parallelise with OpenMP
(GNU libgomp in torch's wheels).  libgomp keeps one pool of worker threads per thread that
starts a parallel region, and keeps it until that thread exits.  A model loaded on one
thread and run on another therefore leaves two pools: with 2 threads per pool on 2 cores,
libgomp counts more managed threads than CPUs and switches every pool from spin-waiting to
its throttled, near-passive wait, so each of the hundreds of parallel regions per token
pays a futex wake-up.  Measured on the embedded model (2 cores, same run): decoding on the
thread that loaded the model runs at the speed of OMP_WAIT_POLICY=PASSIVE only when another
thread loaded it (see docs/engine.md, "Threads").  Keeping every torch call of a process on one
thread keeps one pool and the fast wait.

The same spin-waiting makes a pool of N threads on N cores collapse when another process
keeps a core busy: every parallel region then waits for a thread that is not running (the
embedded model fell from about 70 to 5-18 tok/s beside one busy process, where one thread
ran at 40).  So by default the engine thread governs its own thread count: every
`interval_s` (checked before each forward pass, on the engine thread) it reads how much CPU
other processes used (/proc/stat less this process; niced processes left out since they
yield to us, unless this process is niced too) and uses the cores they leave free, at least
one; it drops at once and rises only after two windows agree, so that a passing spike does
not make it flap.  The engine's
decode output does not depend on the thread count (its kernels are thread-count invariant,
and a model test holds greedy outputs to it), so this changes speed only.  A second cause of
lost speed is the GIL: each torch op releases it, and a Python thread that grabbed it
meanwhile (an HTTP loop, a UI) keeps it for up to the interpreter's switch interval (5 ms by
default) before the engine thread gets it back, so an engine thread lowers the switch
interval to `SWITCH_INTERVAL_S`.

Contract
- `EngineThread(name, threads=None)` starts a daemon thread that runs submitted callables
  one at a time, in submission order.  `threads` fixes torch's CPU thread count on that
  thread before anything else runs; None governs it as above, between 1 and the number of
  cores this process may use (`ThreadGovernor`).  `threads_now` is the count in use.
- `call(fn, *args, **kw)` runs fn there and returns its result or raises its exception in the
  caller.  Called from the engine thread itself it runs fn directly, so code that may run on
  either side needs no special case.
- `submit(fn, *args, **kw) -> concurrent.futures.Future`, for long tasks: a loop submitted this
  way (a server's job loop, a batch scheduler) owns the thread until it returns, and calls
  made meanwhile from other threads wait behind it.
- `close(timeout=None) -> bool`: let queued work finish, end the thread, join it; True when it
  ended.  Later submissions raise RuntimeError.  Idempotent.
- `is_current()`: whether the calling thread is the engine thread; `closed`: whether
  `close()` was called.
- `before_forward()`: called by the engine before every forward pass; on a governed engine
  thread it may re-read the CPU load and change the thread count, elsewhere it does nothing.
- `choose_threads(...)` is the pure decision; `read_cpu_times()` the Linux I/O behind it.
It does not decide what runs on it: the server, ds4-eval and ds4-bench route their engine
work here (and the engine itself never starts threads of its own).
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")

log = logging.getLogger("ds4.engine.threads")

SWITCH_INTERVAL_S = 0.0005
_STOP = object()
_local = threading.local()


# ---------------------------------------------------------------- thread-count governor

@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds used so far: by the whole machine (niced processes excluded unless we are
    niced too) and by us."""

    machine_s: float
    own_s: float


def read_cpu_times() -> CpuTimes | None:
    """From /proc/stat and /proc/self/stat; None where they cannot be read (not Linux)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        with open("/proc/self/stat", "rb") as f:
            own = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    # cpu user nice system idle iowait irq softirq steal ...: all busy time but nice's, unless
    # this process is niced itself: then niced processes compete with it on equal terms (a
    # pool of two threads beside other niced work collapsed to seconds per token, unseen).
    user, nice, system, irq, softirq = (int(fields[i]) for i in (1, 2, 3, 6, 7))
    steal = int(fields[8]) if len(fields) > 8 else 0
    utime, stime = int(own[11]), int(own[12])  # fields 14 and 15 of the stat line
    niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
    # This process's user time is in the nice column exactly when it is niced: counted either way.
    busy = user + system + irq + softirq + steal + (nice if niced else 0)
    return CpuTimes(busy / tick, (utime + stime) / tick)


def choose_threads(current: int, max_threads: int, others_cores: float, pending_up: bool) -> tuple[int, bool]:
    """(threads to use, whether a rise is pending) when other processes keep `others_cores` busy.

    The target is the cores they leave, rounded to the nearest whole core, at least 1 and at
    most `max_threads`.  Going down happens at once (a spinning pool beside a busy core is what
    collapses); going up needs the target to be higher in two windows in a row. Pure."""
    target = max(1, min(max_threads, int(max_threads - others_cores + 0.5)))
    if target < current:
        return target, False
    if target > current:
        return (target, False) if pending_up else (current, True)
    return current, False


class ThreadGovernor:
    """Applies `choose_threads` every `interval_s` on the thread that owns the torch pool."""

    def __init__(self, max_threads: int, interval_s: float = 0.5,
                 read: Callable[[], CpuTimes | None] = read_cpu_times,
                 apply: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max(1, max_threads)
        self.interval_s = interval_s
        self.threads = self.max_threads
        self._read, self._clock = read, clock
        self._apply = apply or _set_torch_threads
        self._last = read()
        self._last_t = clock()
        self._pending_up = False

    def start(self) -> None:
        self._apply(self.threads)

    def tick(self) -> None:
        now = self._clock()
        if now - self._last_t < self.interval_s:
            return
        sample = self._read()
        if sample is None or self._last is None:
            self._last, self._last_t = sample, now
            return
        dt = now - self._last_t
        others = max(0.0, (sample.machine_s - self._last.machine_s) - (sample.own_s - self._last.own_s)) / dt
        self._last, self._last_t = sample, now
        threads, self._pending_up = choose_threads(self.threads, self.max_threads, others, self._pending_up)
        if threads != self.threads:
            log.info("engine threads %d -> %d: other processes use %.1f cores", self.threads, threads, others)
            self.threads = threads
            self._apply(threads)


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def before_forward() -> None:
    governor = getattr(_local, "governor", None)
    if governor is not None:
        governor.tick()


class EngineThread:
    """A single worker thread that owns torch's CPU thread pool for the whole process."""

    def __init__(self, name: str = "ds4-engine", threads: int | None = None) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.name = name
        self.threads = threads
        self.governor = ThreadGovernor(usable_cores()) if threads is None else None
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- callers

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> "Future[T]":
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"engine thread {self.name!r} is closed")
            self._inbox.put((fut, fn, args, kwargs))
        return fut

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        if self.is_current():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def ident(self) -> int | None:
        """The engine thread's `threading.get_ident()`."""
        return self._thread.ident

    def close(self, timeout: float | None = None) -> bool:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._inbox.put(_STOP)
        if self.is_current():
            return False  # the thread ends once the task that called close() returns
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> "EngineThread":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the thread

    @property
    def threads_now(self) -> int:
        return self.governor.threads if self.governor is not None else int(self.threads or 1)

    def _run(self) -> None:
        if self.governor is not None:
            self.governor.start()
            _local.governor = self.governor
        else:
            _set_torch_threads(int(self.threads or 1))
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # handed to the caller, who decides what it means
                fut.set_exception(e)
            else:
                fut.set_result(result)
