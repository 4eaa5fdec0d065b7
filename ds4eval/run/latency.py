"""Latency of one case and of a run: time to first token, inter-token latency, end to end.

Contract
- `Latency` is one case's figures, in seconds: `ttft_s` (the case handed to the backend, i.e.
  the request sent, to the first generated token: the first stream chunk that carries
  reasoning or content text, or the engine's first sampled token), `e2e_s` (the case handed to
  the backend to the last byte of its stream, or the engine's last token), `itl_s` (the mean
  gap between tokens after the first) and `itl_max_s` (the longest silence between two
  token-bearing arrivals after the first: the worst stall a reader of the stream saw), and
  `itl_per`, the unit of `itl_s`: "token" or "chunk".
- The mean gap is the time from the first to the last token-bearing arrival divided by the
  arrivals after the first. A server's chunk may carry several tokens; when the generated
  token count is known (usage, `--tokenizer`) and is at least the number of chunks, the time
  is divided by that count less one instead ("token": the first chunk is taken to carry one
  token), else by the chunks less one ("chunk"). The engine gets one arrival per sampled
  token, so its figures are always per token. `itl_max_s` is never divided: a silence is a
  silence however many tokens end it. With fewer than two arrivals there is no gap: None.
- `LatencyClock` takes the marks on the hot path (one `perf_counter` call and a few float
  operations per arrival) and `finish(tokens)` turns them into a `Latency` with
  `latency_from_marks`, which is pure.
- `percentile(values, q)`: nearest rank, the smallest value with at least q% of the values at
  or below it (always an observed value; q = 100 is the maximum). `Percentiles` holds p50,
  p90, p99 and max of one figure.
- `summarize(latencies) -> LatencySummary | None`: percentiles of TTFT, ITL and e2e over the
  given cases (each case weighs one); the ITL percentiles are over the cases' mean gaps and
  its max is the longest single silence of any case (`itl_max_s`). Callers choose the cases:
  the reports use the graded ones (PASSED or FAILED), whose streams ran to their end.
It does not run cases, read traces or render anything.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Latency:
    """One case's latency figures (module docstring); None where nothing was measured."""

    ttft_s: float | None = None
    itl_s: float | None = None
    itl_max_s: float | None = None
    e2e_s: float | None = None
    itl_per: str = ""  # "token", "chunk", or "" when there is no ITL


def latency_from_marks(start: float, first: float | None, last: float | None, end: float, arrivals: int,
                       max_gap: float, tokens: int | None) -> Latency:
    """The figures of one case from its clock marks: `arrivals` token-bearing arrivals, the
    first at `first` and the last at `last`; `tokens` generated tokens when known."""
    e2e = max(0.0, end - start)
    if first is None or last is None:
        return Latency(e2e_s=e2e)
    ttft = max(0.0, first - start)
    if arrivals < 2:
        return Latency(ttft_s=ttft, e2e_s=e2e)
    per_token = tokens is not None and tokens >= arrivals
    gaps = (tokens if per_token else arrivals) - 1
    return Latency(ttft_s=ttft, itl_s=max(0.0, last - first) / gaps, itl_max_s=max_gap, e2e_s=e2e,
                   itl_per="token" if per_token else "chunk")


class LatencyClock:
    """The marks of one case: started when created (or at `start`, a time of the same clock,
    e.g. one request shared by several choices), `arrival()` per token-bearing chunk or
    sampled token. Not thread-safe: one thread marks at a time (a hand-over between threads
    through a queue is fine)."""

    __slots__ = ("_now", "start", "first", "last", "arrivals", "max_gap")

    def __init__(self, start: float | None = None, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self.start = now() if start is None else start
        self.first: float | None = None
        self.last: float | None = None
        self.arrivals = 0
        self.max_gap = 0.0

    def arrival(self) -> None:
        t = self._now()
        if self.last is None:
            self.first = t
        elif t - self.last > self.max_gap:
            self.max_gap = t - self.last
        self.last = t
        self.arrivals += 1

    def finish(self, tokens: int | None = None, end: float | None = None) -> Latency:
        """The figures now (or at `end`, a time from the same clock), `tokens` generated
        tokens when known."""
        return latency_from_marks(self.start, self.first, self.last, self._now() if end is None else end,
                                  self.arrivals, self.max_gap, tokens)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of `values` (not empty), 0 < q <= 100."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"percentile {q} outside (0, 100]")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


@dataclass(frozen=True)
class Percentiles:
    count: int
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float], maximum: float | None = None) -> "Percentiles | None":
        """p50, p90, p99 and the maximum of `values` (`maximum` when given); None for none."""
        if not values:
            return None
        ordered = sorted(values)
        p50, p90, p99 = (percentile(ordered, q) for q in PERCENTILES)
        return cls(len(ordered), p50, p90, p99, ordered[-1] if maximum is None else max(maximum, ordered[-1]))

    def as_dict(self, digits: int = 6) -> dict:
        return {"count": self.count, "p50": round(self.p50, digits), "p90": round(self.p90, digits),
                "p99": round(self.p99, digits), "max": round(self.max, digits)}


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles of one run's (or one source's) cases; a figure no case measured is None."""

    cases: int  # cases whose figures were given (some may lack one figure)
    ttft: Percentiles | None
    itl: Percentiles | None
    e2e: Percentiles | None
    itl_per: str  # "token", "chunk", "mixed", or "" without ITL

    def as_dict(self) -> dict:
        """The summary as plain data: seconds, rounded to microseconds."""
        def part(p: Percentiles | None) -> dict | None:
            return None if p is None else p.as_dict()

        return {"cases": self.cases, "ttft_s": part(self.ttft), "itl_s": part(self.itl), "e2e_s": part(self.e2e),
                "itl_per": self.itl_per}


def summarize(latencies: Iterable[Latency]) -> LatencySummary | None:
    """Percentiles over cases (module docstring); None when no case measured anything."""
    lats = [x for x in latencies if x.e2e_s is not None or x.ttft_s is not None]
    if not lats:
        return None
    itl = [x for x in lats if x.itl_s is not None]
    units = {x.itl_per for x in itl}
    longest = max((x.itl_max_s for x in itl if x.itl_max_s is not None), default=None)
    return LatencySummary(
        cases=len(lats),
        ttft=Percentiles.of([x.ttft_s for x in lats if x.ttft_s is not None]),
        itl=Percentiles.of([x.itl_s for x in itl], longest),
        e2e=Percentiles.of([x.e2e_s for x in lats if x.e2e_s is not None]),
        itl_per="" if not units else units.pop() if len(units) == 1 else "mixed")

