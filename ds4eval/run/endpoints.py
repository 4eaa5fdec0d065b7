"""Several OpenAI-compatible endpoints behind one run: which one gets the next request, which ones
are out of rotation, and when a run with none left gives up.

Contract
- `EndpointPool(urls, policy, clock=, sleep=, rand=, note=)` is thread-safe; `clock` (seconds,
  monotonic), `sleep` and `rand` (uniform in [0, 1), for jitter) are injectable so that tests
  run on a fake clock.
- `acquire(avoid)` hands out the endpoint in rotation with the fewest requests in flight, ties
  going to the next one in rotation order after the last one handed out; endpoints in `avoid`
  (those a case already failed on) are passed over while another is in rotation. None when no
  endpoint is in rotation. Every `acquire` is matched by one `release(endpoint, ok, reason)`.
- `release(..., ok=False)` counts a failure; `policy.max_failures` consecutive failures take the
  endpoint out of rotation. An endpoint out of rotation is re-probed, with backoff
  (`policy.probe`), by whoever calls `take` once its probe is due; the first probe it answers
  puts it back. Every removal and return is one `note` line.
- `take(probe, cancelled, avoid)` is the dispatch loop of one request: it runs the re-probes
  that are due (`probe(url) -> bool`, called without the pool's lock), then `acquire`s; with no
  endpoint in rotation it waits and re-probes, and once none has been in rotation for
  `policy.wait_s` the pool gives up for good (one note) and `take` returns None from then on,
  as it does at once when `cancelled()` says so.
- `retry_delay(attempt, retry_after_s)`: how long a case waits before its next attempt
  (jittered exponential backoff, or the server's Retry-After, both bounded).
- `stats()`: per endpoint, requests sent, failures, times taken out, whether it is out now.
- `configured_urls(urls, url_file)`: the endpoints a run was given, --url first, then the
  --url-file's (read here; `read_url_list` parses it: one URL per line, `#` comments and blank
  lines ignored), duplicates dropped; `EndpointListError` (one line) for an unreadable file, a
  file that lists none or a line that is not a URL. `retry_after_seconds(value)` parses a
  Retry-After header.
It sends nothing itself (the backend's `probe` callback does) and knows nothing of HTTP bodies.
"""

from __future__ import annotations

import email.utils
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Sequence

from ds4eval.config import ConfigError, check_url

POLL_S = 0.2  # how often a waiting request looks again (a stop must not wait longer than this)


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: attempt a waits between half and all of
    min(cap_s, base_s * 2**a), so that many cases failing at once do not come back at once."""

    base_s: float
    cap_s: float

    def delay(self, attempt: int, rand: float) -> float:
        full = min(self.cap_s, self.base_s * 2 ** max(0, attempt))
        return full * (0.5 + 0.5 * rand)


@dataclass(frozen=True)
class PoolPolicy:
    max_failures: int = 3
    """Consecutive failed requests that take an endpoint out of rotation."""
    retry: Backoff = Backoff(0.25, 4.0)
    """Between a failed request and the case's next attempt."""
    probe: Backoff = Backoff(1.0, 15.0)
    """Between re-probes of an endpoint out of rotation."""
    wait_s: float = 60.0
    """With no endpoint in rotation, how long to keep re-probing before the pool gives up."""
    retry_after_cap_s: float = 30.0
    """The longest Retry-After (429/503) a case waits for."""


@dataclass(frozen=True)
class EndpointStats:
    url: str
    requests: int
    failures: int
    removals: int
    out_of_rotation: bool


class Endpoint:
    """One endpoint's state; only the pool changes it, under its lock."""

    def __init__(self, url: str, index: int):
        self.url, self.index = url, index
        self.in_flight = self.requests = self.failures = self.removals = 0
        self.streak = 0            # consecutive failures
        self.out = False           # out of rotation
        self.probes_failed = 0     # re-probes it did not answer since it went out
        self.probe_at = 0.0        # when it is next due for a re-probe (while out)
        self.probing = False       # a re-probe is under way


class EndpointPool:
    """See the module docstring."""

    def __init__(self, urls: Sequence[str], policy: PoolPolicy = PoolPolicy(), *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 rand: Callable[[], float] = random.random, note: Callable[[str], None] = lambda line: None):
        if not urls:
            raise ValueError("an endpoint pool needs at least one URL")
        self.endpoints = [Endpoint(u, i) for i, u in enumerate(urls)]
        self.policy = policy
        self._clock, self._sleep, self._rand, self._note = clock, sleep, rand, note
        self._lock = threading.Lock()
        self._cursor = 0              # rotation: ties go to the first endpoint at or after this index
        self._none_since: float | None = None  # when the last endpoint in rotation went out
        self._gave_up = False

    # ------------------------------------------------------------ dispatch

    def acquire(self, avoid: Collection[str] = ()) -> Endpoint | None:
        with self._lock:
            live = [e for e in self.endpoints if not e.out]
            fresh = [e for e in live if e.url not in avoid] or live
            if not fresh or self._gave_up:
                return None
            n = len(self.endpoints)
            pick = min(fresh, key=lambda e: (e.in_flight, (e.index - self._cursor) % n))
            self._cursor = (pick.index + 1) % n
            pick.in_flight += 1
            pick.requests += 1
            return pick

    def release(self, endpoint: Endpoint, ok: bool, reason: str = "") -> None:
        line = None
        with self._lock:
            endpoint.in_flight -= 1
            if ok:
                endpoint.streak = 0
                return
            endpoint.failures += 1
            endpoint.streak += 1
            if endpoint.out or endpoint.streak < self.policy.max_failures:
                return
            now = self._clock()
            endpoint.out, endpoint.removals, endpoint.probes_failed = True, endpoint.removals + 1, 0
            endpoint.probe_at = now + self.policy.probe.delay(0, self._rand())
            left = sum(not e.out for e in self.endpoints)
            if left == 0:
                self._none_since = now
            line = (f"endpoint {endpoint.url} is out of rotation after {endpoint.streak} consecutive failures"
                    + (f" (last: {reason})" if reason else "")
                    + f"; {left} of {len(self.endpoints)} left, re-probing it")
        self._note(line)

    def take(self, probe: Callable[[str], bool], cancelled: Callable[[], bool],
             avoid: Collection[str] = ()) -> Endpoint | None:
        while True:
            while (due := self._claim_probe()) is not None:
                self._probed(due, probe(due.url))
            got = self.acquire(avoid)
            if got is not None:
                return got
            if self._give_up_now() or cancelled():
                return None
            self._sleep(min(POLL_S, max(0.0, self._next_probe_in())))

    @property
    def gave_up(self) -> bool:
        """Whether no endpoint was in rotation for `policy.wait_s`: the run is to stop."""
        return self._gave_up

    def retry_delay(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds before attempt `attempt` + 1 of a case whose attempt `attempt` failed (0-based):
        the server's Retry-After when it sent one, else the jittered backoff; both bounded."""
        if retry_after_s is not None:
            return min(max(0.0, retry_after_s), self.policy.retry_after_cap_s)
        return self.policy.retry.delay(attempt, self._rand())

    def sleep(self, seconds: float) -> None:
        self._sleep(seconds)

    def stats(self) -> list[EndpointStats]:
        with self._lock:
            return [EndpointStats(e.url, e.requests, e.failures, e.removals, e.out) for e in self.endpoints]

    # ------------------------------------------------------------ re-probes

    def _claim_probe(self) -> Endpoint | None:
        with self._lock:
            now = self._clock()
            for e in self.endpoints:
                if e.out and not e.probing and e.probe_at <= now and not self._gave_up:
                    e.probing = True
                    return e
        return None

    def _probed(self, endpoint: Endpoint, answered: bool) -> None:
        with self._lock:
            endpoint.probing = False
            if not answered:
                endpoint.probes_failed += 1
                endpoint.probe_at = self._clock() + self.policy.probe.delay(endpoint.probes_failed, self._rand())
                return
            endpoint.out, endpoint.streak = False, 0
            self._none_since = None
            left = sum(not e.out for e in self.endpoints)
        self._note(f"endpoint {endpoint.url} answers again: back in rotation ({left} of {len(self.endpoints)})")

    def _next_probe_in(self) -> float:
        with self._lock:
            due = [e.probe_at for e in self.endpoints if e.out and not e.probing]
            return (min(due) - self._clock()) if due else POLL_S

    def _give_up_now(self) -> bool:
        with self._lock:
            if self._gave_up:
                return True
            if self._none_since is None or any(not e.out for e in self.endpoints):
                return False
            if self._clock() - self._none_since < self.policy.wait_s:
                return False
            self._gave_up = True
        self._note(f"no endpoint has answered for {self.policy.wait_s:g} s: stopping the run (the cases "
                   f"not yet graded end STOPPED; `ds4-eval retry TRACE` runs them again)")
        return True


# ---------------------------------------------------------------- the configured endpoints

class EndpointListError(ValueError):
    """The endpoints a run was given cannot be read; the message is one line."""


def configured_urls(urls: Sequence[str], url_file: str | None) -> list[str]:
    """--url's URLs, then those of --url-file, each once, in that order (see the module docstring)."""
    found = list(urls)
    if url_file:
        try:
            text = Path(url_file).read_text(encoding="utf-8")
        except OSError as e:
            raise EndpointListError(f"cannot read {url_file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise EndpointListError(f"{url_file} is not UTF-8 text") from None
        listed = read_url_list(text)
        if not listed:
            raise EndpointListError(f"{url_file} lists no URL (one a line; # starts a comment)")
        for url in listed:
            try:
                check_url(url)
            except ConfigError as e:
                raise EndpointListError(f"{url_file}: {e}") from None
        found += listed
    return list(dict.fromkeys(found))


# ---------------------------------------------------------------- pure helpers

def read_url_list(text: str) -> list[str]:
    """The URLs of a --url-file: one a line, surrounding blanks stripped; blank lines and lines
    whose first non-blank character is `#` are skipped (a `#` inside a URL is kept)."""
    urls = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            urls.append(line)
    return urls


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header as seconds from now: delta-seconds or an HTTP date (`now`, Unix time,
    defaults to the current time); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
