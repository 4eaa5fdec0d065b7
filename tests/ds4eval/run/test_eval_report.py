"""Report figures: token counts that are unknown stay unknown, per-case time against wall-clock
throughput, and the ETA of --plain lines."""

import io

from ds4eval.cases.case import parse_case
from ds4eval.run.runner import CaseFinished, CaseState, RunStarted, Status
from ds4eval.run.summary import PlainListener, build_summary, eta_s, format_clock, render_report


def state(i, status=Status.PASSED, gen=10, prompt=5, elapsed=2.0, known=True):
    c = parse_case({"source": "toy", "id": f"c{i}", "domain": "math", "question": f"q{i}?",
                    "answer": "4", "answer_kind": "integer"})
    return CaseState(index=i - 1, number=i, case=c, status=status, gen_tokens=gen, prompt_tokens=prompt,
                     elapsed_s=elapsed, tokens_known=known)


def test_concurrent_cases_report_both_summed_time_and_wall_throughput():
    # Three cases of 10 tokens in 2 s each, run at once: 5 tok/s per case, 15 tok/s wall-clock.
    s = build_summary([state(1), state(2), state(3)], 2.0, {})
    t = s["totals"]
    assert t["gen_s"] == 6.0 and t["tokens_per_s"] == 5.0 and t["wall_tokens_per_s"] == 15.0
    text = render_report(s)
    assert "per-case time summed 6.0 s (5.0 tok/s per case)" in text
    assert "wall-clock throughput 15.0 tok/s" in text


def test_unknown_token_counts_are_never_numbers():
    s = build_summary([state(1, gen=0, prompt=0, known=False), state(2)], 4.0, {})
    t = s["totals"]
    assert t["gen_tokens"] is None and t["prompt_tokens"] is None and t["tokens_per_s"] is None
    assert t["tokens_known"] is False and s["cases"][0]["gen_tokens"] is None
    assert s["cases"][1]["gen_tokens"] == 10
    text = render_report(s)
    assert "generation unknown tokens" in text
    # One case of two lacks counts: the line says so rather than that the server sent none.
    assert "token totals unknown: 1 of 2 cases have no counts" in text
    every = render_report(build_summary([state(1, gen=0, prompt=0, known=False)], 1.0, {}))
    assert "token counts unknown: the server sent no usage" in every
    total_row = next(ln for ln in text.splitlines() if ln.startswith("TOTAL"))
    assert total_row.split()[5:7] == ["unknown", "unknown"]


def test_eta_and_clock():
    assert eta_s(0, 10, 5.0) is None
    assert eta_s(2, 10, 20.0) == 80.0
    assert eta_s(10, 10, 20.0) == 0.0
    assert format_clock(None) == "?" and format_clock(83) == "1:23" and format_clock(3725) == "1:02:05"


def test_plain_lines_carry_the_eta_in_their_header():
    now = [100.0]
    out = io.StringIO()
    lst = PlainListener(4, out, clock=lambda: now[0])
    lst.on_event(RunStarted(4, "engine", "m", None))
    now[0] = 130.0
    lst.on_event(CaseFinished(state(1)))
    now[0] = 160.0
    lst.on_event(CaseFinished(state(2, known=False)))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[1/4 eta 1:30] PASSED  toy/c1")
    assert lines[1].startswith("[2/4 eta 1:00] PASSED  toy/c2") and "? tok 2.0s" in lines[1]


def test_latency_percentiles_over_graded_cases_beside_the_pass_rates():
    from ds4eval.run.latency import Latency

    states = []
    for i in range(1, 11):
        st = state(i, status=Status.PASSED if i % 2 else Status.FAILED)
        st.latency = Latency(ttft_s=0.1 * i, itl_s=0.001 * i, itl_max_s=0.5, e2e_s=float(i), itl_per="token")
        states.append(st)
    stopped = state(11, status=Status.STOPPED)  # not graded: its stream did not run to the end
    stopped.latency = Latency(ttft_s=99.0, e2e_s=99.0)
    s = build_summary(states + [stopped], 10.0, {"settings": {"concurrency": 8}})
    lat = s["latency"]
    assert lat["concurrency"] == 8 and lat["cases"] == 10 and lat["itl_per"] == "token"
    assert lat["ttft_s"] == {"count": 10, "p50": 0.5, "p90": 0.9, "p99": 1.0, "max": 1.0}
    assert lat["itl_s"]["p90"] == 0.009 and lat["itl_s"]["max"] == 0.5 and lat["e2e_s"]["max"] == 10.0
    assert s["cases"][0]["ttft_s"] == 0.1 and s["cases"][10]["e2e_s"] == 99.0
    text = render_report(s)
    assert "latency at concurrency 8, over 10 graded case(s)" in text
    ttft = next(ln for ln in text.splitlines() if ln.startswith("TTFT s"))
    assert ttft.split()[2:] == ["0.500", "0.900", "1.000", "1.000"]
    itl = next(ln for ln in text.splitlines() if ln.startswith("ITL ms per token"))
    assert itl.split()[4:] == ["5.0", "9.0", "10.0", "500.0"]


def test_no_latency_part_when_nothing_was_measured():
    s = build_summary([state(1)], 1.0, {})
    assert "latency" not in s and s["cases"][0]["ttft_s"] is None
    assert "latency" not in render_report(s)
