"""The endpoint pool on a fake clock: dispatch, rotation, failures, re-probes, giving up."""

import pytest

from ds4eval.run.endpoints import Backoff, EndpointPool, PoolPolicy, read_url_list, retry_after_seconds

A, B, C = "http://a", "http://b", "http://c"


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def pool(urls=(A, B, C), rand=lambda: 1.0, **policy):
    clock, notes = FakeClock(), []
    p = EndpointPool(list(urls), PoolPolicy(**policy), clock=clock, sleep=clock.sleep, rand=rand, note=notes.append)
    return p, clock, notes


def urls(endpoints):
    return [e.url for e in endpoints]


def test_least_in_flight_wins_and_ties_go_round_in_rotation():
    p, _, _ = pool()
    first = [p.acquire() for _ in range(3)]
    assert urls(first) == [A, B, C]  # all idle: rotation order
    p.release(first[1], ok=True)     # B is now the only one with nothing in flight
    assert p.acquire().url == B
    for e in first[::2]:
        p.release(e, ok=True)        # A and C idle, B busy: ties resume after B, at C
    assert urls([p.acquire(), p.acquire()]) == [C, A]


def test_rotation_spreads_sequential_requests():
    p, _, _ = pool()
    seen = []
    for _ in range(6):
        e = p.acquire()
        seen.append(e.url)
        p.release(e, ok=True)
    assert seen == [A, B, C, A, B, C]


def test_avoid_passes_over_an_endpoint_unless_it_is_the_only_one():
    p, _, _ = pool(urls=(A, B))
    assert p.acquire(avoid={A}).url == B
    p2, _, _ = pool(urls=(A,))
    assert p2.acquire(avoid={A}).url == A


def test_k_consecutive_failures_take_an_endpoint_out_and_a_success_resets_the_streak():
    p, _, notes = pool(max_failures=3)
    a = p.endpoints[0]
    for ok in (False, False, True, False, False):
        p.release(p.acquire(avoid={B, C}), ok=ok, reason="boom")
    assert not a.out and notes == []
    p.release(p.acquire(avoid={B, C}), ok=False, reason="ConnectError: refused")
    assert a.out
    assert notes == ["endpoint http://a is out of rotation after 3 consecutive failures "
                     "(last: ConnectError: refused); 2 of 3 left, re-probing it"]
    assert {p.acquire().url for _ in range(4)} == {B, C}
    s = {st.url: st for st in p.stats()}
    assert (s[A].requests, s[A].failures, s[A].removals, s[A].out_of_rotation) == (6, 5, 1, True)
    assert (s[B].failures, s[B].out_of_rotation) == (0, False)


def knock_out(p, url, k=3):
    for _ in range(k):
        p.release(p.acquire(avoid=[u for u in (A, B, C) if u != url]), ok=False)


def test_an_endpoint_out_of_rotation_is_reprobed_with_backoff_and_returns_when_it_answers():
    p, clock, notes = pool(probe=Backoff(1.0, 4.0))
    knock_out(p, A)
    answers, probed = [False, False, True], []

    def probe(url):
        probed.append((url, clock.now))
        return answers.pop(0)

    never = lambda: False  # noqa: E731
    p.release(p.take(probe, never), ok=True)  # not due yet (1 s after it went out): no probe
    assert probed == []
    clock.now = 1.0
    p.release(p.take(probe, never), ok=True)   # due: probed, does not answer; next after 2 s
    clock.now = 2.5
    p.release(p.take(probe, never), ok=True)   # not due yet
    clock.now = 3.0
    p.release(p.take(probe, never), ok=True)   # due: no answer; next after 4 s (the cap)
    clock.now = 7.0
    e = p.take(probe, never)                   # answers: back, and idle, so it gets this request
    assert probed == [(A, 1.0), (A, 3.0), (A, 7.0)]
    assert e.url == A and not p.endpoints[0].out
    assert notes[-1] == "endpoint http://a answers again: back in rotation (3 of 3)"


def test_with_none_in_rotation_take_waits_reprobing_then_gives_up_for_good():
    p, clock, notes = pool(urls=(A,), wait_s=10.0, probe=Backoff(1.0, 2.0))
    knock_out(p, A)
    probed = []
    assert p.take(lambda url: probed.append(clock.now) or False, lambda: False) is None
    assert p.gave_up and 10.0 <= clock.now < 10.5
    assert probed and all(b - a <= 2.0 + 1e-9 for a, b in zip(probed, probed[1:]))
    assert max(clock.slept) <= 0.2 + 1e-9  # a waiting case looks at its stop often
    assert notes[-1].startswith("no endpoint has answered for 10 s: stopping the run")
    before = len(probed)
    assert p.take(lambda url: True, lambda: False) is None and len(probed) == before  # no way back
    assert p.acquire() is None


def test_a_waiting_take_comes_back_when_the_endpoint_returns():
    p, clock, _ = pool(urls=(A,), wait_s=60.0, probe=Backoff(1.0, 1.0))
    knock_out(p, A)
    e = p.take(lambda url: clock.now >= 5.0, lambda: False)
    assert e.url == A and 5.0 <= clock.now < 7.0 and not p.gave_up


def test_a_cancelled_take_returns_at_once():
    p, clock, _ = pool(urls=(A,), wait_s=60.0)
    knock_out(p, A)
    assert p.take(lambda url: False, lambda: True) is None
    assert not p.gave_up and clock.now < 1.0


@pytest.mark.parametrize("rand", [0.0, 0.5, 0.999])
def test_retry_backoff_is_jittered_exponential_and_bounded(rand):
    p, _, _ = pool(rand=lambda: rand, retry=Backoff(0.25, 4.0), retry_after_cap_s=30.0)
    delays = [p.retry_delay(a) for a in range(10)]
    for a, d in enumerate(delays):
        full = min(4.0, 0.25 * 2 ** a)
        assert full / 2 <= d <= full
    assert max(delays) <= 4.0
    assert p.retry_delay(0, retry_after_s=7.0) == 7.0
    assert p.retry_delay(0, retry_after_s=3600.0) == 30.0


def test_read_url_list_skips_comments_and_blank_lines():
    text = "# the cluster\nhttp://a:8000\n\n   \n  http://b:8000/v1  \n  # off for now: http://c\n"
    assert read_url_list(text) == ["http://a:8000", "http://b:8000/v1"]


def test_retry_after_seconds():
    assert retry_after_seconds("12") == 12.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:30 GMT", now=1445412500.0) == 10.0
