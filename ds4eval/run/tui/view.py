"""What the terminal UI shows, as plain data: a thread-safe event listener and pure view building.

Contract
- `LiveStats` is a runner listener (`on_event`, called from worker threads; quick and
  thread-safe). It keeps what the runner's `snapshot()` does not: run info (model, backend,
  context size), pause state, the run clock (stopped while paused or idle), per-case clocks and
  decode speed. `changed` is a `threading.Event` set on every event so the UI redraws only when
  something moved. `freeze(now)` returns an immutable `Live` copy.
- `build_view(states, live, suite, phase, message)` is pure: runner case states plus a `Live`
  in, an immutable `View` out; once every case finished (phase "done") it carries the latency
  percentiles of the graded cases (`ds4eval.run.latency`). `split_thinking(output)` splits
  model output into thinking and answer runs.
It does not draw, read keys, or control the runner.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from ds4eval.cases.extract import THINK_CLOSE, THINK_OPEN
from ds4eval.run import latency as lt
from ds4eval.run.runner import (CaseFinished, CaseState, Paused, Progress, RunFinished, RunStarted,
                                StatusChanged, TextDelta)
from ds4eval.run.summary import eta_s

RUNNING = ("PREFILL", "THINKING")
FINISHED = ("PASSED", "FAILED", "SKIPPED", "STOPPED", "ERROR")


@dataclass(frozen=True)
class CaseClock:
    """Live timing of one case: pause-free seconds since it started, and its decode speed."""
    elapsed_s: float = 0.0
    prefill_done: int = 0
    prefill_total: int = 0
    tokens_per_s: float = 0.0


@dataclass(frozen=True)
class Live:
    total: int = 0
    backend: str = ""
    model: str = ""
    n_ctx: int | None = None
    paused: bool = False
    finished: bool = False
    elapsed_s: float = 0.0
    clocks: dict = field(default_factory=dict)   # case index -> CaseClock


class _Stopwatch:
    def __init__(self) -> None:
        self.total = 0.0
        self.since: float | None = None

    def set_running(self, on: bool, now: float) -> None:
        if on and self.since is None:
            self.since = now
        elif not on and self.since is not None:
            self.total += now - self.since
            self.since = None

    def read(self, now: float) -> float:
        return self.total + (now - self.since if self.since is not None else 0.0)


class LiveStats:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.changed = threading.Event()
        self._info = RunStarted(0, "", "", None)
        self._paused = False
        self._finished = False
        self._running: set[int] = set()
        self._watch = _Stopwatch()
        self._clocks: dict[int, CaseClock] = {}
        # Per running case: (generated tokens, elapsed) at its first token, so the speed shown is
        # decode speed and does not include prefill.
        self._first: dict[int, tuple[int, float]] = {}

    def on_event(self, event: object) -> None:
        now = self._clock()
        with self._lock:
            if isinstance(event, RunStarted):
                self._info = event
            elif isinstance(event, Paused):
                self._paused = event.paused
            elif isinstance(event, StatusChanged):
                if event.status.value in RUNNING:
                    if event.status.value == "PREFILL":
                        self._clocks[event.index] = CaseClock()
                        self._first.pop(event.index, None)
                    self._running.add(event.index)
                else:
                    self._running.discard(event.index)
            elif isinstance(event, Progress):
                self._on_progress(event)
            elif isinstance(event, CaseFinished):
                st = event.state
                old = self._clocks.get(st.index, CaseClock())
                self._clocks[st.index] = CaseClock(st.elapsed_s, old.prefill_done, old.prefill_total,
                                                   old.tokens_per_s)
            elif isinstance(event, RunFinished):
                self._finished = True
                self._running.clear()
            elif not isinstance(event, TextDelta):
                return
            self._watch.set_running(bool(self._running) and not self._paused, now)
        self.changed.set()

    def _on_progress(self, ev: Progress) -> None:
        rate = 0.0
        if ev.gen_tokens > 0:
            g0, e0 = self._first.setdefault(ev.index, (ev.gen_tokens, ev.elapsed_s))
            if ev.elapsed_s > e0:
                rate = (ev.gen_tokens - g0) / (ev.elapsed_s - e0)
            else:
                rate = self._clocks.get(ev.index, CaseClock()).tokens_per_s
        self._clocks[ev.index] = CaseClock(ev.elapsed_s, ev.prefill_done, ev.prompt_tokens, rate)

    def freeze(self, now: float | None = None) -> Live:
        now = self._clock() if now is None else now
        with self._lock:
            i = self._info
            return Live(total=i.total, backend=i.backend, model=i.model, n_ctx=i.n_ctx,
                        paused=self._paused, finished=self._finished, elapsed_s=self._watch.read(now),
                        clocks=dict(self._clocks))


# ---------------------------------------------------------------- the view

@dataclass(frozen=True)
class CaseRow:
    index: int
    number: int
    source: str
    id: str
    title: str
    status: str
    picked: str | None
    expected: str
    prompt_tokens: int
    gen_tokens: int
    elapsed_s: float
    tokens_per_s: float
    prefill_done: int
    think_close: str
    error: str
    output: str
    runs: int

    @property
    def label(self) -> str:
        return f"{self.source}/{self.id}"

    @property
    def running(self) -> bool:
        return self.status in RUNNING

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


@dataclass(frozen=True)
class View:
    model: str
    suite: str
    backend: str
    n_ctx: int | None
    cases: tuple[CaseRow, ...]
    elapsed_s: float
    tokens_per_s: float
    ctx_used: int | None
    paused: bool
    phase: str          # "running", "stopping" or "done"
    message: str = ""
    latency: lt.LatencySummary | None = None  # the graded cases', once the run is done

    @property
    def done_count(self) -> int:
        return sum(c.finished for c in self.cases)

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.cases)

    @property
    def running_index(self) -> int | None:
        return next((c.index for c in self.cases if c.running), None)

    @property
    def eta_s(self) -> float | None:
        """Time left at the average pace of the finished cases (None before the first one)."""
        return eta_s(self.done_count, len(self.cases), self.elapsed_s)


def build_view(states: Sequence[CaseState], live: Live, suite: str, phase: str, message: str = "") -> View:
    rows = []
    repeated = any(st.repeat for st in states)
    for st in states:
        clock = live.clocks.get(st.index, CaseClock())
        running = st.status.value in RUNNING
        elapsed = clock.elapsed_s if running else st.elapsed_s
        rate = clock.tokens_per_s if running else (st.gen_tokens / st.elapsed_s if st.elapsed_s > 0 else 0.0)
        rows.append(CaseRow(
            index=st.index, number=st.number, source=st.case.source,
            id=f"{st.case.id} #{st.repeat}" if repeated else st.case.id, title=st.case.title,
            status=st.status.value, picked=st.picked, expected=st.case.answer,
            prompt_tokens=st.prompt_tokens or clock.prefill_total, gen_tokens=st.gen_tokens,
            elapsed_s=elapsed, tokens_per_s=rate, prefill_done=clock.prefill_done,
            think_close=st.think_close, error=st.error, output=st.output, runs=st.runs))
    running = [r for r in rows if r.running]
    ctx_used = None
    if running:
        ctx_used = sum(r.prompt_tokens + r.gen_tokens for r in running)
    if phase == "running" and rows and not running and all(r.finished for r in rows):
        phase = "done"
    latency = (lt.summarize(st.latency for st in states if st.status.value in ("PASSED", "FAILED"))
               if phase == "done" else None)
    return View(model=live.model, suite=suite, backend=live.backend, n_ctx=live.n_ctx, cases=tuple(rows),
                elapsed_s=live.elapsed_s, tokens_per_s=sum(r.tokens_per_s for r in running),
                ctx_used=ctx_used, paused=live.paused, phase=phase, message=message, latency=latency)


def split_thinking(output: str) -> list[tuple[str, bool]]:
    """Runs of (text, is_thinking); the `<think>` / `</think>` markers belong to the thinking runs.

    An unclosed block (the model is still thinking) runs to the end of the text.
    """
    runs: list[tuple[str, bool]] = []
    pos = 0
    while pos < len(output):
        start = output.find(THINK_OPEN, pos)
        if start < 0:
            runs.append((output[pos:], False))
            break
        if start > pos:
            runs.append((output[pos:start], False))
        end = output.find(THINK_CLOSE, start + len(THINK_OPEN))
        stop = len(output) if end < 0 else end + len(THINK_CLOSE)
        runs.append((output[start:stop], True))
        pos = stop
    return runs
