"""Latency figures: nearest-rank percentiles, one case's figures from its marks, run summaries."""

import pytest
from hypothesis import given, settings, strategies as st

from ds4eval.run import latency as lt


def test_nearest_rank_percentile_is_an_observed_value():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert lt.percentile(values, 50) == 50.0
    assert lt.percentile(values, 90) == 90.0
    assert lt.percentile(values, 99) == 99.0
    assert lt.percentile(values, 100) == 100.0
    assert lt.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert lt.percentile([5.0], 1) == 5.0
    # 10 values: p90 is the 9th smallest, p99 the 10th (ceil(9.9) = 10).
    ten = [float(v) for v in range(10)]
    assert (lt.percentile(ten, 90), lt.percentile(ten, 99)) == (8.0, 9.0)


@pytest.mark.parametrize("values, q", [([], 50), ([1.0], 0), ([1.0], 101)])
def test_percentile_rejects_nothing_and_out_of_range(values, q):
    with pytest.raises(ValueError):
        lt.percentile(values, q)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=50), st.floats(0.01, 100))
@settings(max_examples=200, deadline=None)
def test_percentile_definition_holds(values, q):
    p = lt.percentile(values, q)
    assert p in values
    at_or_below = sum(v <= p for v in values)
    assert at_or_below >= q / 100 * len(values) - 1e-9
    # ...and it is the smallest such value.
    assert sum(v < p for v in values) < q / 100 * len(values) + 1e-9


def test_figures_per_token_when_the_count_covers_the_chunks():
    # Sent at 10, first text at 10.2, last at 11.2 after 5 arrivals, 21 tokens, end at 11.3.
    lat = lt.latency_from_marks(10.0, 10.2, 11.2, 11.3, 5, 0.4, 21)
    assert lat.ttft_s == pytest.approx(0.2) and lat.e2e_s == pytest.approx(1.3)
    assert lat.itl_s == pytest.approx(1.0 / 20) and lat.itl_per == "token" and lat.itl_max_s == 0.4


def test_figures_per_chunk_without_a_token_count_or_with_fewer_tokens_than_chunks():
    assert lt.latency_from_marks(0.0, 0.5, 1.5, 2.0, 5, 0.3, None).itl_s == pytest.approx(0.25)
    lat = lt.latency_from_marks(0.0, 0.5, 1.5, 2.0, 5, 0.3, 3)
    assert lat.itl_s == pytest.approx(0.25) and lat.itl_per == "chunk"


def test_no_gap_without_two_arrivals_and_no_ttft_without_any():
    one = lt.latency_from_marks(0.0, 0.5, 0.5, 0.6, 1, 0.0, 1)
    assert (one.ttft_s, one.itl_s, one.itl_max_s, one.itl_per) == (0.5, None, None, "")
    none = lt.latency_from_marks(0.0, None, None, 0.6, 0, 0.0, None)
    assert (none.ttft_s, none.itl_s, none.e2e_s) == (None, None, 0.6)


def test_clock_marks_arrivals_on_its_own_time_source():
    times = iter([1.0, 1.5, 1.6, 2.0, 2.1, 2.5])
    clock = lt.LatencyClock(now=lambda: next(times))  # starts at 1.0
    for _ in range(4):
        clock.arrival()  # 1.5, 1.6, 2.0, 2.1: gaps 0.1, 0.4, 0.1
    lat = clock.finish(4)  # ends at 2.5
    assert lat.ttft_s == pytest.approx(0.5) and lat.e2e_s == pytest.approx(1.5)
    assert lat.itl_s == pytest.approx(0.6 / 3) and lat.itl_max_s == pytest.approx(0.4)
    shared = lt.LatencyClock(0.25, now=lambda: 9.0)
    assert shared.start == 0.25 and shared.finish(end=1.25).e2e_s == 1.0


def test_summary_over_cases_with_the_longest_gap_as_the_itl_max():
    lats = [lt.Latency(ttft_s=0.1 * k, itl_s=0.01 * k, itl_max_s=0.05 * k, e2e_s=float(k), itl_per="token")
            for k in range(1, 11)]
    lats.append(lt.Latency(e2e_s=0.5))  # an empty answer: no first token, no gap
    s = lt.summarize(lats)
    assert s.cases == 11 and s.itl_per == "token"
    assert (s.ttft.count, s.ttft.p50, s.ttft.p90, s.ttft.max) == (10, pytest.approx(0.5), pytest.approx(0.9),
                                                                  pytest.approx(1.0))
    assert s.itl.p99 == pytest.approx(0.1) and s.itl.max == pytest.approx(0.5)
    assert (s.e2e.count, s.e2e.p50) == (11, 5.0)
    d = s.as_dict()
    assert d["ttft_s"]["p90"] == 0.9 and d["itl_per"] == "token" and d["e2e_s"]["count"] == 11


def test_summary_of_nothing_measured_is_none_and_units_can_mix():
    assert lt.summarize([]) is None and lt.summarize([lt.Latency()]) is None
    s = lt.summarize([lt.Latency(ttft_s=1, itl_s=0.1, itl_max_s=0.2, e2e_s=2, itl_per="token"),
                      lt.Latency(ttft_s=1, itl_s=0.1, itl_max_s=0.2, e2e_s=2, itl_per="chunk")])
    assert s.itl_per == "mixed"
    only_ttft = lt.summarize([lt.Latency(ttft_s=0.3, e2e_s=0.4)])
    assert only_ttft.itl is None and only_ttft.itl_per == "" and only_ttft.as_dict()["itl_s"] is None
