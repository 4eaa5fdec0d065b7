"""Repeated log lines: the first of each reason is logged, repeats within the interval are
counted in one summary line (`server.loglimit`), in the app's error lines too."""
from __future__ import annotations

import logging
import re
import time

from fastapi.testclient import TestClient

from server.loglimit import RepeatLimiter
from server_fake_engine import FakeModel
from server_support import fake_app

log = logging.getLogger("test.loglimit")


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, object]] = []

    def __call__(self) -> float:
        return self.now

    def schedule(self, delay: float, fn) -> None:
        self.timers.append((self.now + delay, fn))

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [t for t in self.timers if t[0] <= self.now]
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, fn in due:
            fn()


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_the_first_line_is_logged_and_repeats_are_summarised_once_the_interval_is_over(caplog):
    caplog.set_level(logging.INFO, logger=log.name)
    clock = ManualClock()
    limiter = RepeatLimiter(1.0, clock=clock, schedule=clock.schedule)
    assert limiter.log(log, logging.WARNING, "503", "503 to %s: busy", "10.0.0.1:1")
    for i in range(2, 101):
        clock.now += 0.001
        assert not limiter.log(log, logging.WARNING, "503", "503 to %s: busy", f"10.0.0.1:{i}")
    assert messages(caplog) == ["503 to 10.0.0.1:1: busy"]
    clock.advance(1.0)  # the flood stopped: the summary still comes
    assert messages(caplog) == ["503 to 10.0.0.1:1: busy",
                                "503 to 10.0.0.1:100: busy (99 more like this in the last 1.0 s)"]
    assert limiter.log(log, logging.WARNING, "503", "503 to %s: busy", "10.0.0.2:1")  # a new interval
    assert len(messages(caplog)) == 3
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == log.name)


def test_each_reason_has_its_own_interval_and_a_single_line_has_no_summary(caplog):
    caplog.set_level(logging.INFO, logger=log.name)
    clock = ManualClock()
    limiter = RepeatLimiter(1.0, clock=clock, schedule=clock.schedule)
    limiter.log(log, logging.INFO, "a", "line a")
    limiter.log(log, logging.INFO, "b", "line b")
    limiter.log(log, logging.INFO, "a", "line a")
    clock.advance(2.0)
    limiter.log(log, logging.INFO, "b", "line b")
    assert messages(caplog) == ["line a", "line b", "line a (1 more like this in the last 1.0 s)", "line b"]


def test_a_repeat_after_the_interval_writes_the_pending_summary_first_and_flush_writes_the_rest(caplog):
    caplog.set_level(logging.INFO, logger=log.name)
    clock = ManualClock()
    limiter = RepeatLimiter(1.0, clock=clock, schedule=lambda delay, fn: None)  # timers that never fire
    limiter.log(log, logging.INFO, "k", "x")
    limiter.log(log, logging.INFO, "k", "x")
    clock.now = 1.5
    limiter.log(log, logging.INFO, "k", "x")
    limiter.log(log, logging.INFO, "k", "x")
    limiter.log(log, logging.INFO, "k", "x")
    limiter.flush()
    assert messages(caplog) == ["x", "x (1 more like this in the last 1.0 s)", "x",
                                "x (2 more like this in the last 1.0 s)"]


def test_the_state_is_bounded_by_one_interval_of_distinct_lines():
    clock = ManualClock()
    limiter = RepeatLimiter(1.0, clock=clock, schedule=clock.schedule)
    for i in range(1000):
        clock.now += 0.01
        limiter.log(log, logging.DEBUG, i, "line %d", i)
    assert len(limiter) <= 101


def test_identical_error_answers_of_the_app_are_rate_limited_and_all_counted(caplog):
    caplog.set_level(logging.INFO, logger="ds4.server")
    n = 30
    started = time.monotonic()
    with TestClient(fake_app(FakeModel()), raise_server_exceptions=False) as c:
        for _ in range(n):
            assert c.post("/v1/chat/completions", content=b'{"messages": [',
                          headers={"Content-Type": "application/json"}).status_code == 400
        elapsed = time.monotonic() - started
    # The app's shutdown writes the pending summary.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("400 POST /v1/chat/completions")]
    counted = sum(int(m.group(1)) if (m := re.search(r"\((\d+) more like this", line)) else 1 for line in lines)
    assert counted == n
    assert lines[0].startswith("400 POST /v1/chat/completions: ") and "more like this" not in lines[0]
    # At most a line and a summary per second of the flood.
    assert len(lines) <= 2 * (int(elapsed) + 1) < n
