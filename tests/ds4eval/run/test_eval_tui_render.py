"""The terminal UI's pure parts: cell widths, clipping and wrapping, the live stats listener,
view building and the layout renderer at every screen size (no terminal needed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4eval.cases.case import parse_case
from ds4eval.run.runner import CaseState, Paused, Progress, RunFinished, RunStarted, Status, StatusChanged
from ds4eval.run.tui import text as tx
from ds4eval.run.tui.render import Nav, follow, layout, render
from ds4eval.run.tui.view import CaseRow, LiveStats, View, build_view, split_thinking

# ---------------------------------------------------------------- text


def test_sanitize_leaves_only_one_and_two_cell_characters():
    s = tx.sanitize("a\tb\x1b[31mc\x07 e\u0301 👨\u200d👩 ❤\ufe0f 中")
    assert s == "a    b?[31mc? é 👨👩 ❤ 中"
    assert all(tx.char_width(ch) in (1, 2) for ch in s)
    assert tx.width("中a") == 3 and tx.width("abc") == 3


def test_clip_never_splits_a_wide_character():
    assert tx.clip("中文字", 4) == "中… "       # the cut lands inside 文: pad instead of half a glyph
    assert tx.clip("中文字", 6) == "中文字"
    assert tx.clip("abcdef", 4) == "abc…"
    assert tx.clip("ab", 4) == "ab  " and tx.clip("ab", 4, pad=False) == "ab"
    assert tx.clip("中", 1) == "…" and tx.clip("x", 0) == ""


def test_wrap_spans_breaks_words_and_keeps_styles():
    lines = tx.wrap_spans([("hello big ", "a"), ("world\nnext", "b")], 9)
    assert lines == [[("hello big", "a")], [("world", "b")], [("next", "b")]]
    assert tx.wrap_spans([("中文字符", "x")], 3) == [[("中", "x")], [("文", "x")], [("字", "x")], [("符", "x")]]
    assert tx.wrap_spans([("中", "x")], 1) == [[("?", "x")]]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80), st.integers(min_value=1, max_value=30))
def test_wrap_and_clip_respect_the_width(text, n):
    clean = tx.sanitize(text)
    for line in tx.wrap_spans([(clean, "s")], n):
        assert tx.spans_width(line) <= n
    # Nothing but spaces at line breaks and placeholders for too-wide glyphs is lost.
    joined = "".join(t for line in tx.wrap_spans([(clean, "s")], n) for t, _ in line)
    if n >= 2:
        assert joined.replace(" ", "") == clean.replace(" ", "").replace("\n", "")
    assert tx.width(tx.clip(clean.replace("\n", " "), n)) == n


# ---------------------------------------------------------------- view


def test_split_thinking():
    assert split_thinking("Answer: 4") == [("Answer: 4", False)]
    assert split_thinking("<think>\nhm</think>\nAnswer: 4") == [("<think>\nhm</think>", True), ("\nAnswer: 4", False)]
    assert split_thinking("x<think>still going") == [("x", False), ("<think>still going", True)]
    assert split_thinking("") == []


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_live_stats_clock_stops_while_paused_and_idle_and_speed_excludes_prefill():
    clock = Clock()
    ls = LiveStats(clock)
    ls.on_event(RunStarted(3, "openai", "m", 4096))
    assert ls.changed.is_set()
    clock.t += 5  # nothing running yet
    ls.on_event(StatusChanged(0, Status.PREFILL))
    ls.on_event(Progress(0, 100, 100, 0, 2.0))          # 2 s of prefill
    ls.on_event(Progress(0, 100, 100, 1, 2.0))          # first token
    clock.t += 3
    ls.on_event(Paused(True))
    clock.t += 50
    assert ls.freeze().elapsed_s == pytest.approx(3.0)
    ls.on_event(Paused(False))
    clock.t += 1
    ls.on_event(Progress(0, 100, 100, 41, 4.0))         # 40 tokens in 2 s after the first
    live = ls.freeze()
    assert live.elapsed_s == pytest.approx(4.0) and live.paused is False
    assert live.clocks[0].tokens_per_s == pytest.approx(20.0)
    ls.on_event(StatusChanged(0, Status.PASSED))
    clock.t += 10
    assert ls.freeze().elapsed_s == pytest.approx(4.0)
    ls.on_event(RunFinished((), 4.0, True))
    assert ls.freeze().finished and (live.model, live.n_ctx, live.total) == ("m", 4096, 3)


def _case(i, answer="4"):
    return parse_case({"source": "toy", "id": f"c{i}", "question": f"q{i}?", "answer": answer,
                       "answer_kind": "integer"})


def test_build_view_counts_context_and_done():
    states = [CaseState(0, 1, _case(0), Status.PASSED, picked="4", gen_tokens=10, elapsed_s=2.0),
              CaseState(1, 2, _case(1), Status.THINKING, prompt_tokens=50, gen_tokens=7),
              CaseState(2, 3, _case(2))]
    ls = LiveStats(Clock())
    ls.on_event(RunStarted(3, "engine", "m", 8192))
    v = build_view(states, ls.freeze(), "sanity", "running")
    assert (v.done_count, v.count("PASSED"), v.ctx_used, v.running_index, v.phase) == (1, 1, 57, 1, "running")
    assert v.cases[0].tokens_per_s == pytest.approx(5.0) and v.cases[0].label == "toy/c0"
    states[1].status, states[2].status = Status.FAILED, Status.SKIPPED
    v = build_view(states, ls.freeze(), "sanity", "running")
    assert v.phase == "done" and v.ctx_used is None
    assert follow(Nav(selected=0), v).selected == 0


# ---------------------------------------------------------------- render


def _row(i, status, picked=None, output="", source="sanity"):
    return CaseRow(index=i, number=i + 1, source=source, id=f"case-{i}-宽", title=f"What is {i}+{i}? 数学 🙂",
                   status=status, picked=picked, expected=str(2 * i), prompt_tokens=40, gen_tokens=12,
                   elapsed_s=1.5, tokens_per_s=8.0, prefill_done=40, think_close="none", error="", output=output,
                   runs=1)


def _view(n=4, paused=False, phase="running", message="hi", sources=("sanity", "sanity", "sanity", "other")):
    statuses = ["PASSED", "FAILED", "THINKING"] + ["PENDING"] * (n - 3)
    cases = tuple(_row(i, s, "0" if s == "PASSED" else ("3" if s == "FAILED" else None),
                       "<think>\nLet me think 中文字符 about it.\n</think>\nAnswer: 4 🙂" if s == "THINKING" else "",
                       sources[i % len(sources)])
                  for i, s in enumerate(statuses[:n]))
    return View(model="fake-model", suite="sanity", backend="openai", n_ctx=4096, cases=cases, elapsed_s=75.0,
                tokens_per_s=12.3, ctx_used=52, paused=paused, phase=phase, message=message)


def _coverage(frame):
    grid = [[0] * frame.cols for _ in range(frame.rows)]
    for p in frame.pieces:
        x = p.x
        for ch in p.text:
            for k in range(tx.char_width(ch)):
                grid[p.y][x + k] += 1
            x += tx.char_width(ch)
    return grid


@pytest.mark.parametrize("pane", ["list", "output"])
def test_every_size_is_covered_exactly_once(pane):
    """From 1x1 up, each cell is drawn once and nothing is drawn off screen (no curses errors)."""
    views = [_view(), _view(40, paused=True), _view(3, phase="stopping", message="")]
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 10, 13, 26):
        for cols in (1, 2, 5, 20, 33, 59, 60, 61, 132):
            for v in views:
                for sel in (0, 2, len(v.cases) - 1):
                    frame = render(v, Nav(selected=sel, pane=pane), rows, cols)
                    assert all(c == 1 for r in _coverage(frame) for c in r), (rows, cols, sel)


def test_wide_layout():
    lines = render(_view(), Nav(selected=2), 16, 100).text_lines()
    assert lines[0].startswith(" ds4-eval  model fake-model · suite sanity · backend openai") and \
        lines[0].endswith(" RUNNING ")
    assert lines[1].startswith(" 2/4  passed 1  failed 1  elapsed 1:15  eta 1:15  12.3 tok/s  ctx 52/4096")
    assert "┬─ #3 sanity/case-2-宽 THINKING · 12 tok · 1.5 s " in lines[2]
    assert lines[3].startswith(" 1 PASSED   sanity/case-0-宽") and lines[3].rstrip().endswith("0|0│What is 2+2? 数学 🙂")
    assert lines[-1].startswith(" p pause  q quit  ↑↓ PgUp PgDn select  Enter run now  r re-run  f follow")
    assert lines[-1].endswith(" hi ")
    assert lines[2].startswith("─ cases (4)  picked|expected ─")
    one = render(_view(sources=("sanity",)), Nav(selected=2), 16, 100).text_lines()
    assert one[2].startswith("─ cases (4) · sanity  picked|expected ─") and one[3].startswith(" 1 PASSED   case-0-宽 ")
    assert any(line.endswith("│Answer: 4 🙂" + " " * (100 - 41 - 13)) or "│Answer: 4 🙂" in line for line in lines)


def test_small_screens_get_one_pane_and_a_short_header():
    assert not layout(24, 59).two_panes and layout(24, 60).two_panes
    lines = render(_view(paused=True), Nav(selected=0), 6, 20).text_lines()
    assert lines[0] == " PAUSED  1/4  passed" or lines[0].startswith(" PAUSED ")
    assert lines[1].startswith(" 1 PASS sanity/case")
    out = render(_view(), Nav(selected=2, pane="output"), 6, 20).text_lines()
    assert "Answer: 4" in "\n".join(out) and "│" not in "\n".join(out)


def test_list_scrolls_to_keep_the_selection_visible():
    v = _view(40)
    frame = render(v, Nav(selected=35, list_top=0), 12, 80)
    assert frame.list_top == 35 - 8 + 1  # 12 rows: 2 header, 1 rule, 1 footer, 8 list rows
    assert any(line.startswith(" 36 ") for line in frame.text_lines())
    assert "cases 29-36 of 40" in frame.text_lines()[2]
    assert render(v, Nav(selected=3, list_top=frame.list_top), 12, 80).list_top == 3


def test_long_output_wraps_only_its_tail():
    from ds4eval.run.tui.render import _tail_lines

    words = " ".join(f"w{i}{'中' * (i % 3)}" + ("\n" if i % 17 == 0 else "") for i in range(40000))
    out = "<think>" + words + "</think>\nAnswer: 42"
    full = tx.wrap_spans([(tx.sanitize(t), "thinking" if k else "answer") for t, k in split_thinking(out)], 37)
    assert _tail_lines(out, 37, 12)[-12:] == full[-12:]
    v = View(model="m", suite="s", backend="b", n_ctx=None, tokens_per_s=0, ctx_used=None, paused=False,
             phase="running", elapsed_s=0, cases=(_row(0, "THINKING", output=out),))
    import time

    start = time.perf_counter()
    lines = render(v, Nav(), 40, 120).text_lines()
    assert time.perf_counter() - start < 0.1  # cheap enough for 20 frames a second while streaming
    assert "Answer: 42" in "\n".join(lines)


def test_header_eta_follows_the_pace_of_finished_cases():
    # 2 of 8 finished in 75 s: 6 more at 37.5 s each.
    lines = render(_view(n=8), Nav(selected=2), 16, 120).text_lines()
    assert "elapsed 1:15  eta 3:45  12.3 tok/s" in lines[1]
    done = render(_view(n=8, phase="stopping"), Nav(selected=2), 16, 120).text_lines()
    assert "eta" not in done[1]


def test_the_done_screen_shows_latency_percentiles_of_the_graded_cases():
    from ds4eval.run.latency import Latency

    states = [CaseState(i, i + 1, _case(i), Status.PASSED, picked="4", gen_tokens=10, elapsed_s=2.0,
                        latency=Latency(ttft_s=0.1 * (i + 1), itl_s=0.01, itl_max_s=0.02, e2e_s=1.0, itl_per="token"))
              for i in range(4)]
    ls = LiveStats(Clock())
    ls.on_event(RunStarted(4, "openai", "m", 8192))
    v = build_view(states, ls.freeze(), "sanity", "running")
    assert v.phase == "done" and v.latency.ttft.p50 == pytest.approx(0.2)
    header = render(v, Nav(), 16, 132).text_lines()[1]
    assert "TTFT p50/p90 0.20/0.40 s" in header and "ITL p50/p90 10.0/10.0 ms" in header
    states[3].status = Status.THINKING  # while running: no latency in the header
    assert build_view(states, ls.freeze(), "sanity", "running").latency is None
    for rows, cols in ((1, 40), (2, 60), (16, 80)):  # a narrow screen drops groups, never overflows
        frame = render(v, Nav(), rows, cols)
        assert all(c == 1 for r in _coverage(frame) for c in r)
