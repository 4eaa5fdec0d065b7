"""Turn SIGINT and SIGTERM into a request to stop, instead of an exception at a random place.

Contract
- `StopSignals()` is a context manager for the main thread: while it is active, SIGINT and
  SIGTERM (and SIGHUP where it exists) only record the signal (`fired`, the first signal's
  number; `count`, how many arrived). The previous handlers are restored on exit.
- A SIGINT that the process inherited as ignored (a background job, `nohup`) stays ignored,
  as Python itself leaves it.
- Off the main thread it installs nothing (Python allows handlers only there) and never fires.
It does not stop anything itself: the caller polls `fired` and asks the runner to stop.

Why not KeyboardInterrupt: an exception raised inside `Thread.join()` leaves the thread
looking finished on Python 3.11 (`is_alive()` false while it still runs), so the report was
printed before the running case had stopped and the process exited under the engine's
running kernels ("terminate called without an active exception", SIGABRT).
"""

from __future__ import annotations

import signal
import threading

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a job stopped by Ctrl+C


def _signals() -> list[int]:
    sigs = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP"):
        sigs.append(signal.SIGHUP)
    return sigs


class StopSignals:
    def __init__(self) -> None:
        self.fired: int | None = None
        self.count = 0
        self._old: dict[int, object] = {}

    def _on_signal(self, signum, _frame) -> None:
        if self.fired is None:
            self.fired = signum
        self.count += 1

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in _signals():
            old = signal.getsignal(sig)
            if sig == signal.SIGINT and old == signal.SIG_IGN:
                continue
            self._old[sig] = old
            signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
