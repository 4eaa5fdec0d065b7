"""Request preparation off the event loop: JSON parsing, prompt rendering and tokenizing on a few threads.

`PrepareExecutor(workers, max_waiting)`:
  await prep.run(fn, *args) -> fn(*args), run on one of `workers` threads
      At most `workers` preparations run at once and at most `max_waiting` more wait for a
      thread; a request beyond that is refused at once with a 503 (`ApiError`, code
      "server_busy"), so a burst of huge bodies cannot queue unbounded work or memory.
  prep.close()      stop the threads (waits for running preparations); a later run starts
                    them again (an app may go through several lifespans in tests)
  prep.running, prep.waiting   current counts (for `/health`)

Why a pool of its own: the default thread pool of the ASGI server has dozens of threads, and
each preparation of a large prompt holds its body, its parsed form, the rendered text and the
tokenizer's working memory; a small fixed pool makes that memory a small multiple of one
request's instead of dozens of them, and keeps the event loop free to answer `/health` and
stream other responses meanwhile.

It does not cancel a running preparation (Python threads cannot be stopped; a chat template
render aborts itself at its time limit, see `engine.chat_template`), and knows nothing of what
the functions it runs do.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from server.errors import ApiError

T = TypeVar("T")

DEFAULT_WORKERS = 2
DEFAULT_MAX_WAITING = 32


class PrepareExecutor:
    """A bounded pool for request preparation (see the module docstring). Thread-safe."""

    def __init__(self, workers: int = DEFAULT_WORKERS, max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        if workers < 1 or max_waiting < 0:
            raise ValueError(f"workers must be >= 1 and max_waiting >= 0, got {workers}, {max_waiting}")
        self.workers = workers
        self.max_waiting = max_waiting
        self._pool: ThreadPoolExecutor | None = None  # started by the first run, again after close
        self._lock = threading.Lock()
        self._admitted = 0  # running + waiting
        self._running = 0

    @property
    def running(self) -> int:
        with self._lock:
            return self._running

    @property
    def waiting(self) -> int:
        with self._lock:
            return self._admitted - self._running

    def _admit(self) -> None:
        with self._lock:
            if self._admitted >= self.workers + self.max_waiting:
                raise ApiError(503, f"the server is busy: {self._admitted} requests are being prepared or "
                                    "wait for it; retry later", type="server_error", code="server_busy")
            self._admitted += 1

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        with self._lock:
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._running -= 1
                self._admitted -= 1

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        self._admit()
        try:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="ds4-prepare")
                pool = self._pool
            future = pool.submit(self._call, fn, args)
        except BaseException:
            with self._lock:
                self._admitted -= 1
            raise
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
