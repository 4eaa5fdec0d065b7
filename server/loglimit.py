"""Repeated log lines under a flood: the first of a kind is logged, repeats are counted.

    limiter = RepeatLimiter(interval=1.0)
    limiter.log(logger, logging.WARNING, key, "503 to %s: ...", peer)

A line whose `key` (its reason: a status and what caused it, without the peer address or
counts that change from line to line) was not logged in the last `interval` seconds is
logged at once. Repeats within the interval are only counted; when the interval is over a
summary line says how many there were: the last of them, then "(N more like this in the
last 1.0 s)", so a flood of identical refusals is at most two lines per reason per
interval and nothing goes unreported. The summary is written by a timer (`schedule`, a
`threading.Timer` by default), so it comes even when the flood stops; `flush()` writes
the pending summaries at once (at shutdown).

Thread-safe (one lock). Keys are forgotten once their interval is over and summarised, so
the state is bounded by the distinct reasons of one interval. It formats and filters lines,
nothing else: the logger's handlers decide where they go.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

Schedule = Callable[[float, Callable[[], None]], None]


def _timer(delay: float, fn: Callable[[], None]) -> None:
    t = threading.Timer(delay, fn)
    t.daemon = True
    t.start()


@dataclass
class _Window:
    started: float
    logger: logging.Logger
    level: int
    repeats: int = 0
    last: str = ""


class RepeatLimiter:
    """At most one line per key and interval, plus a summary of the repeats (module docstring)."""

    def __init__(self, interval: float = 1.0, *, clock: Callable[[], float] = time.monotonic,
                 schedule: Schedule = _timer) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        self.interval = interval
        self._clock = clock
        self._schedule = schedule
        self._lock = threading.Lock()
        self._windows: dict[Hashable, _Window] = {}

    def __len__(self) -> int:
        """Reasons whose interval is open (or over but not yet summarised)."""
        with self._lock:
            return len(self._windows)

    def log(self, logger: logging.Logger, level: int, key: Hashable, msg: str, *args: Any) -> bool:
        """Log `msg % args` unless a line of `key` was logged less than `interval` ago; True if it was."""
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window.started < self.interval:
                if window.repeats == 0:
                    self._schedule(max(window.started + self.interval - now, 0.0), lambda: self._summarise(key))
                window.repeats += 1
                window.last = msg % args if args else msg
                return False
            summary = self._close(key, self._windows.pop(key)) if window is not None else None
            self._prune(now)
            self._windows[key] = _Window(now, logger, level)
        if summary is not None:
            summary()
        logger.log(level, msg, *args)
        return True

    def flush(self) -> None:
        """Write every pending summary now."""
        with self._lock:
            pending = [self._close(key, w) for key, w in list(self._windows.items())]
            self._windows.clear()
        for summary in pending:
            if summary is not None:
                summary()

    def _prune(self, now: float) -> None:
        # Windows are in the order they opened; the old ones without repeats are done (those
        # with repeats end by their timer).
        for key, window in list(self._windows.items()):
            if now - window.started < self.interval or window.repeats:
                break
            del self._windows[key]

    def _summarise(self, key: Hashable) -> None:
        with self._lock:
            window = self._windows.pop(key, None)
            summary = self._close(key, window) if window is not None else None
        if summary is not None:
            summary()

    def _close(self, key: Hashable, window: _Window) -> Callable[[], None] | None:
        """The summary of a finished window (to call outside the lock), None when it had no repeats."""
        if window.repeats == 0:
            return None
        n, last, interval = window.repeats, window.last, self.interval
        return lambda: window.logger.log(window.level, "%s (%d more like this in the last %.1f s)",
                                         last, n, interval)
