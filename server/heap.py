"""The process heap of ds4-server: glibc malloc settings that keep its resident size near what it uses.

- `limit_arenas(n)`: at most `n` malloc arenas (glibc's `mallopt(M_ARENA_MAX)`), unless the
  environment sets `MALLOC_ARENA_MAX` itself. glibc gives each thread that allocates
  concurrently an arena of its own, up to 8 per core; each arena keeps the high-water mark of
  what its threads once held. The server's threads (event loop, the request-preparation pool,
  the inference thread, torch's workers) parse, render and tokenize bodies of up to 64 MiB on
  whichever arena they hold, so without a bound every arena grows to a large request's size.
  Called once at startup, before the threads exist.
- `trim()`: return the free memory at the top and in the middle of the heap to the system
  (`malloc_trim(0)`); what a large request left behind once it is gone.
- `HeapTrim(app, threshold)`: ASGI middleware that calls `trim()` on a worker thread after a
  request whose body was at least `threshold` bytes (by its Content-Length) has been answered;
  trims of overlapping requests are coalesced into one.

Measured in docs/server.md ("Hostile requests and model files"). Elsewhere than glibc (musl, macOS)
every function is a no-op. It does not bound memory: the body limit, the preparation pool
and the caches' budgets do (`server.prepare`, `server.tools.replay`, `server.kvstore`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import threading
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

DEFAULT_ARENAS = 2
# Bodies from this size on are followed by a trim: below it a request's garbage is a few
# MiB that the next requests reuse anyway.
DEFAULT_TRIM_BYTES = 4 * 2**20
_M_ARENA_MAX = -8  # glibc's malloc.h


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _libc()
AVAILABLE = _LIBC is not None
"""Whether malloc is glibc's (elsewhere every function here is a no-op)."""


def limit_arenas(n: int = DEFAULT_ARENAS) -> int | None:
    """Bound the malloc arenas to `n`; the bound in effect (the environment's, if it sets one),
    or None where malloc is not glibc's."""
    if _LIBC is None:
        return None
    if os.environ.get("MALLOC_ARENA_MAX"):
        value = os.environ["MALLOC_ARENA_MAX"]
        return int(value) if value.isdigit() else None
    return n if _LIBC.mallopt(_M_ARENA_MAX, n) == 1 else None


def trim() -> bool:
    """Give free heap memory back to the system; True if some was."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


class HeapTrim:
    """ASGI middleware: `trim()` after a large request has been answered (module docstring)."""

    def __init__(self, app: ASGIApp, threshold: int = DEFAULT_TRIM_BYTES) -> None:
        self.app, self.threshold = app, threshold
        self._lock = threading.Lock()
        self._pending = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _LIBC is None or not self._large(scope):
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            with self._lock:
                start, self._pending = not self._pending, True
            if start:
                asyncio.get_running_loop().run_in_executor(None, self._trim)

    def _large(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                return value.isdigit() and int(value) >= self.threshold
        return False

    def _trim(self) -> None:
        with self._lock:
            self._pending = False
        trim()
