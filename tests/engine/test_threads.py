"""engine.threads: the engine thread's contract, the thread-count decision and its governor."""
from __future__ import annotations

import sys
import threading

import pytest
import torch

from engine import threads
from engine.threads import CpuTimes, EngineThread, ThreadGovernor, choose_threads


def test_call_runs_on_the_engine_thread_and_returns_or_raises():
    with EngineThread("t-call") as t:
        assert t.call(lambda: threading.current_thread().name) == "t-call"
        assert t.call(lambda a, b=0: a + b, 2, b=3) == 5
        with pytest.raises(ZeroDivisionError):
            t.call(lambda: 1 / 0)
        # The thread survives a failed call.
        assert t.call(lambda: "still here") == "still here"


def test_call_from_the_engine_thread_runs_inline():
    with EngineThread("t-inline") as t:
        # Without the inline path this would wait for itself forever.
        assert t.call(lambda: t.call(lambda: t.is_current())) is True
        assert not t.is_current()


def test_submissions_run_one_at_a_time_in_order():
    with EngineThread("t-order") as t:
        seen = []
        gate = threading.Event()
        first = t.submit(gate.wait, 5)
        rest = [t.submit(seen.append, i) for i in range(20)]
        assert not rest[0].done()  # the first task still owns the thread
        gate.set()
        first.result(5)
        for f in rest:
            f.result(5)
        assert seen == list(range(20))


def test_close_finishes_queued_work_joins_and_refuses_more():
    t = EngineThread("t-close")
    out = []
    t.submit(out.append, 1)
    assert t.close(timeout=5) is True
    assert out == [1] and t.closed
    with pytest.raises(RuntimeError, match="closed"):
        t.submit(out.append, 2)
    assert t.close(timeout=5) is True  # idempotent


def test_fixed_threads_are_set_on_the_engine_thread():
    before = torch.get_num_threads()
    try:
        with EngineThread("t-fixed", threads=1) as t:
            assert t.call(torch.get_num_threads) == 1
            assert t.threads_now == 1 and t.governor is None
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError):
        EngineThread("t-bad", threads=0)


def test_an_engine_thread_lowers_the_switch_interval():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        with EngineThread("t-gil"):
            assert sys.getswitchinterval() == pytest.approx(threads.SWITCH_INTERVAL_S)
        sys.setswitchinterval(0.0001)  # a lower one chosen by the user is kept
        with EngineThread("t-gil2"):
            assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("current,max_threads,others,pending,want", [
    (2, 2, 0.0, False, (2, False)),     # idle machine: every core
    (2, 2, 0.4, False, (2, False)),     # a little noise: keep both
    (2, 2, 0.7, False, (1, False)),     # a busy core beside us: drop at once
    (2, 2, 1.0, False, (1, False)),
    (1, 2, 2.5, False, (1, False)),     # never below one
    (1, 2, 0.1, False, (1, True)),      # a rise waits for a second window...
    (1, 2, 0.1, True, (2, False)),      # ...and happens when it agrees
    (1, 2, 0.9, True, (1, False)),      # a window that disagrees cancels it
    (8, 8, 2.4, False, (6, False)),     # rounded to the nearest core
    (4, 8, 0.0, True, (8, False)),
])
def test_choose_threads(current, max_threads, others, pending, want):
    assert choose_threads(current, max_threads, others, pending) == want


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_governor_drops_on_a_busy_window_and_rises_after_two_quiet_ones():
    clock, applied = FakeClock(), []
    # Machine CPU seconds and our own, sampled at t = 0, 1, 2, ...
    samples = iter([CpuTimes(0, 0), CpuTimes(2.0, 1.2), CpuTimes(3.9, 2.2), CpuTimes(5.9, 4.1),
                    CpuTimes(7.9, 6.0), CpuTimes(9.9, 7.9)])
    g = ThreadGovernor(2, interval_s=1.0, read=lambda: next(samples), apply=applied.append, clock=clock)
    g.start()
    assert applied == [2]
    g.tick()  # within the interval: nothing read
    clock.t = 1.0
    g.tick()  # others used 0.8 cores
    assert g.threads == 1 and applied == [2, 1]
    clock.t = 2.0
    g.tick()  # others 0.9
    clock.t = 3.0
    g.tick()  # others 0.1: a rise is pending
    assert g.threads == 1
    clock.t = 4.0
    g.tick()  # others 0.1 again: up
    assert g.threads == 2 and applied == [2, 1, 2]
    clock.t = 5.0
    g.tick()  # others 0.1: stays
    assert applied == [2, 1, 2]


def test_governor_without_cpu_times_keeps_its_threads():
    clock, applied = FakeClock(), []
    g = ThreadGovernor(4, interval_s=0.5, read=lambda: None, apply=applied.append, clock=clock)
    g.start()
    for t in range(1, 5):
        clock.t = float(t)
        g.tick()
    assert g.threads == 4 and applied == [4]


def test_before_forward_ticks_only_a_governed_engine_thread(monkeypatch):
    ticks = []
    monkeypatch.setattr(ThreadGovernor, "tick", lambda self: ticks.append(threading.current_thread().name))
    threads.before_forward()  # not an engine thread
    with EngineThread("t-fixed", threads=1) as fixed:
        fixed.call(threads.before_forward)
    before = torch.get_num_threads()
    try:
        with EngineThread("t-governed") as governed:
            governed.call(threads.before_forward)
    finally:
        torch.set_num_threads(before)
    assert ticks == ["t-governed"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_read_cpu_times_counts_this_process():
    a = threads.read_cpu_times()
    x = 0
    for i in range(3_000_000):
        x += i
    b = threads.read_cpu_times()
    assert a is not None and b is not None
    assert b.own_s >= a.own_s and b.machine_s >= a.machine_s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_niced_process_counts_niced_work_as_others_and_its_own_time_in_full():
    # Niced, this process's user time is in /proc/stat's nice column: counted on both sides, so
    # that other niced processes (which compete with it on equal terms) are seen.
    import subprocess
    code = ("import os; os.nice(5); from engine import threads; a = threads.read_cpu_times(); x = 0\n"
            "for i in range(3_000_000): x += i\n"
            "b = threads.read_cpu_times(); print(b.own_s - a.own_s, b.machine_s - a.machine_s)")
    own, machine = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout.split())
    assert own > 0.05 and machine >= own - 0.02  # the machine's busy time includes ours
