"""Trace format round trip, regrading and the retry list."""

import pytest
from hypothesis import given, settings, strategies as st

from ds4eval.run import trace as tr
from ds4eval.verdict import regrade

TRICKY = ["", "\n", "%%end", "%%%", "line\n%%block MODEL_OUTPUT chars=3\n%%end\n", "a\r\nb\rc", "\u2028x\x0b\x1c",
          "no final newline", "trailing\n\n", "%%case 1 v1\nindex: 2"]


def rec(**kw):
    base = dict(index=1, source="sanity", id="int-add-small", status="PASSED", picked="5", expected="5",
                answer_kind="integer", model_output="Answer: 5")
    base.update(kw)
    return tr.TraceRecord(**base)


@given(st.text(), st.text(), st.text(), st.one_of(st.none(), st.text(min_size=1)), st.sampled_from(TRICKY))
@settings(max_examples=150, deadline=None)
def test_any_text_round_trips(sys_p, q, out, picked, tricky):
    r = rec(system_prompt=sys_p + tricky, question_prompt=tricky + q, model_output=out + tricky + out,
            picked=picked, error=tricky, aliases=[tricky, q])
    parsed = tr.parse_trace(tr.format_record(r) * 2)
    assert parsed.problems == []
    assert parsed.records == [r, r]


def test_file_round_trip_keeps_carriage_returns(tmp_path):
    path = tmp_path / "t.trace"
    records = [rec(index=i, model_output=t) for i, t in enumerate(TRICKY)]
    with tr.TraceWriter(path) as w:
        for r in records:
            w.write(r)
    assert tr.read_trace(path).records == records


def test_truncated_and_garbled_blocks_are_reported_not_fatal():
    good = tr.format_record(rec())
    text = good + good.replace("chars=9", "chars=99") + good[: len(good) // 2]
    parsed = tr.parse_trace(text)
    assert len(parsed.records) == 1 and len(parsed.problems) == 2


def test_old_trace_without_status_is_graded():
    text = tr.format_record(rec(status=None))
    assert "status: \n" in text
    r = tr.parse_trace(text).records[0]
    assert r.status is None
    report = regrade.regrade([r])
    assert (report.passed, report.failed, report.not_graded, report.changed) == (1, 0, 0, [])


def test_regrade_counts_only_finished_cases():
    records = [rec(index=1, id="a"), rec(index=2, id="b", status="STOPPED", model_output="Answer: 9"),
               rec(index=3, id="c", status="STOPPED", model_output="")]
    report = regrade.regrade(tr.parse_trace("".join(map(tr.format_record, records))).records)
    assert report.summary_line() == "passed=1 failed=0 not_graded=2 changed=0"


def test_regrade_counts_the_latest_record_of_each_case_and_repeat_like_compare():
    """A retried trace: 41 cases, each written twice (STOPPED, then its retry); regrade counts
    41, as --compare and the run report do, and says how many records it left out."""
    first = [rec(index=i, id=f"c{i}", status="STOPPED", model_output="") for i in range(1, 42)]
    retried = [rec(index=i, id=f"c{i}", status="FAILED" if i % 2 else "PASSED",
                   model_output="Answer: 4" if i % 2 else "Answer: 5") for i in range(1, 42)]
    report = regrade.regrade(first + retried)
    assert report.passed + report.failed + report.not_graded == 41 and report.not_graded == 0
    assert report.superseded == 41 and report.summary_line().endswith(" superseded=41")
    # Repeats are cases of their own: both repeats of a case count.
    repeats = [rec(index=1, id="r", repeat=0), rec(index=1, id="r", repeat=1), rec(index=1, id="r", repeat=1)]
    assert regrade.latest(repeats) == ([repeats[0], repeats[2]], 1)
    from ds4eval.reports.run import latest_records
    assert latest_records(first + retried)[1] == 41


def test_regrade_lists_changed_verdicts_and_uses_lookup_for_old_traces():
    from ds4eval.cases.case import parse_case

    records = [rec(index=1, id="a", status="FAILED"),                       # extractor now reads it: changed
               rec(index=2, id="b", status="PASSED", model_output="Answer: 6"),  # changed the other way
               rec(index=3, status="PASSED", expected="", answer_kind="", id="k")]
    case = parse_case({"source": "sanity", "id": "k", "question": "q", "answer": "5", "answer_kind": "integer"})
    report = regrade.regrade(records, lambda s, i: case if (s, i) == ("sanity", "k") else None)
    assert [(c.index, c.old_status, c.new_status) for c in report.changed] == [(1, "FAILED", "PASSED"),
                                                                            (2, "PASSED", "FAILED")]
    assert report.passed == 2 and report.failed == 1
    assert regrade.regrade([records[2]]).not_graded == 1


def test_incomplete_uses_the_latest_block_per_case():
    records = [rec(id="a", status="STOPPED"), rec(id="b", status="ERROR"), rec(id="c", status="FAILED"),
               rec(id="a", status="PASSED")]
    assert regrade.incomplete(records) == [("sanity", "b", 0)]


# ---------------------------------------------------------------- torn writes

def _blocks(n, start=1):
    # Non-ASCII output so that cuts land inside multi-byte characters too.
    return [rec(index=i, id=f"case-{i}", model_output=f"Réponse {i}: ≈ {'é' * i}\n%%end\nAnswer: {i}",
                status="FAILED") for i in range(start, start + n)]


def test_torn_tail_is_repaired_before_appending_and_the_next_block_is_read(tmp_path):
    path = tmp_path / "t.trace"
    first = _blocks(3)
    data = "".join(map(tr.format_record, first)).encode()
    cut = data.rindex(b"Answer: 3") + 3  # inside the last block's text, mid-line
    path.write_bytes(data[:cut])
    warnings = []
    later = _blocks(2, start=4)
    with tr.TraceWriter(path, warn=warnings.append) as w:
        for r in later:
            w.write(r)
    parsed = tr.read_trace(path)
    assert parsed.records == first[:2] + later
    assert len(warnings) == 1 and "torn" in warnings[0] and f"byte {cut}" in warnings[0]
    assert len(parsed.problems) == 1
    assert "case block 3 (sanity/case-3) skipped: block MODEL_OUTPUT has" in parsed.problems[0]


def test_a_torn_final_utf8_character_spoils_only_its_block():
    data = "".join(map(tr.format_record, _blocks(3))).encode()
    cut = data.rindex("é".encode()) + 1  # one byte of a two-byte character
    parsed = tr.parse_trace_bytes(data[:cut])
    assert [r.index for r in parsed.records] == [1, 2]
    assert len(parsed.problems) == 1 and parsed.problems[0].startswith("line ")
    assert "case block 3 (sanity/case-3) skipped:" in parsed.problems[0]


def test_reader_names_every_skipped_block_and_why():
    good = [tr.format_record(r) for r in _blocks(4)]
    bad_count = good[1].replace("chars=", "chars=9", 1)
    torn = good[2][: good[2].rindex("%%end")]  # ends at a line start, where the marker was
    parsed = tr.parse_trace(good[0] + bad_count + torn + good[3])
    assert [r.index for r in parsed.records] == [1, 4]
    assert len(parsed.problems) == 2
    assert "case block 2 (sanity/case-2) skipped: block SYSTEM_PROMPT has 0 chars, header says 90" in parsed.problems[0]
    assert "case block 3 (sanity/case-3) skipped: block not terminated" in parsed.problems[1]


def test_a_marker_glued_to_a_torn_line_is_recovered():
    # Traces appended to by writers that did not repair torn tails.
    good = [tr.format_record(r) for r in _blocks(3)]
    text = good[0] + good[1][:200] + good[2]
    parsed = tr.parse_trace(text)
    assert [r.index for r in parsed.records] == [1, 3]
    assert any("case block 2" in p for p in parsed.problems)


def test_writers_killed_at_random_byte_offsets_lose_only_the_torn_block(tmp_path):
    import random

    rng = random.Random(15)
    header = tr.format_run_header(tr.RunHeader("sanity", tuple((i, "sanity", f"case-{i}") for i in range(1, 6))))
    first = _blocks(5)
    pieces = [header.encode()] + [tr.format_record(r).encode() for r in first]
    data = b"".join(pieces)
    ends = [sum(len(p) for p in pieces[: k + 1]) for k in range(len(pieces))]
    later = _blocks(2, start=6)
    offsets = sorted(rng.sample(range(1, len(data)), 120)) + [e - 1 for e in ends] + ends
    for n, cut in enumerate(offsets):
        path = tmp_path / f"k{n}.trace"
        path.write_bytes(data[:cut])
        with tr.TraceWriter(path, warn=lambda m: None) as w:
            for r in later:
                w.write(r)
        parsed = tr.read_trace(path)
        # A cut between a block's `%%end` and its newline leaves the block complete.
        complete = [first[k - 1] for k in range(1, len(pieces)) if ends[k] - 1 <= cut]
        assert parsed.records == complete + later, cut
        torn = cut not in ends and cut + 1 not in ends
        assert len(parsed.problems) == (1 if torn else 0), (cut, parsed.problems)
        assert len(parsed.runs) == (1 if ends[0] - 1 <= cut else 0)


_KILLED_WRITER = r"""
import os, sys
from ds4eval.run import trace as tr
path, = sys.argv[1:]
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
i = 0
while True:
    i += 1
    block = tr.format_record(tr.TraceRecord(index=i, source="sanity", id=f"k-{i}", status="FAILED",
                                            model_output="é" * 50 + " Answer: 1")).encode()
    for j in range(0, len(block), 7):  # small writes, so a kill can land anywhere in a block
        os.write(fd, block[j:j + 7])
"""


def test_a_writer_process_killed_mid_block(tmp_path):
    import random
    import signal
    import subprocess
    import sys
    import time

    rng = random.Random(7)
    for n in range(3):
        path = tmp_path / f"p{n}.trace"
        child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)])
        target = rng.randrange(2000, 20000)
        while not path.exists() or path.stat().st_size < target:
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
        child.wait()
        data = path.read_bytes()
        with tr.TraceWriter(path, warn=lambda m: None) as w:
            w.write(rec(index=999, id="after"))
        parsed = tr.read_trace(path)
        complete = data.count(b"\n%%end\n")
        assert [r.index for r in parsed.records] == list(range(1, complete + 1)) + [999]
        assert len(parsed.problems) <= 1


# ---------------------------------------------------------------- run header and retry

def test_run_header_round_trips_and_old_readers_skip_nothing_else():
    h = tr.RunHeader("sanity", ((1, "sanity", "a"), (2, "sanity", "b b"), (3, "x/y", "c\\d")))
    parsed = tr.parse_trace(tr.format_run_header(h) + tr.format_record(rec(id="a")))
    assert parsed.runs == [h] and parsed.problems == [] and [r.id for r in parsed.records] == ["a"]


def test_incomplete_includes_cases_that_never_started_and_is_idempotent():
    h = tr.RunHeader("sanity", ((1, "sanity", "a"), (2, "sanity", "b"), (3, "sanity", "c"), (4, "sanity", "d")))
    killed = [rec(index=1, id="a", status="PASSED"), rec(index=2, id="b", status="STOPPED")]
    todo = regrade.incomplete(killed, [h])
    assert todo == [("sanity", "b", 0), ("sanity", "c", 0), ("sanity", "d", 0)]
    assert regrade.case_numbers(killed, [h]) == {("sanity", "a"): 1, ("sanity", "b"): 2, ("sanity", "c"): 3,
                                           ("sanity", "d"): 4}
    # The retry writes its own header (the subset) and blocks; a second retry asks for what is left.
    retry_h = tr.RunHeader("sanity", tuple((n, s, i) for n, (s, i, _) in zip((2, 3, 4), todo)))
    retried = killed + [rec(index=2, id="b", status="FAILED"), rec(index=3, id="c", status="ERROR")]
    assert regrade.incomplete(retried, [h, retry_h]) == [("sanity", "c", 0), ("sanity", "d", 0)]
    done = retried + [rec(index=3, id="c", status="PASSED"), rec(index=4, id="d", status="FAILED")]
    assert regrade.incomplete(done, [h, retry_h, retry_h]) == []


def test_a_header_in_another_layout_reads_the_same_values():
    # Older and newer writers: fields reordered, one missing, an unknown key, "key:" without
    # its space. The line-by-line reader must agree with the one that matches the written layout.
    r = rec(picked="a\\b", aliases=["x"], elapsed_s=1.5, rendered_prompt="<|im_start|>user\nhi\\n")
    block = tr.format_record(r)
    head, rest = block.split("\n%%block", 1)
    lines = head.split("\n")
    marker, fields = lines[0], lines[1:]
    fields = [f for f in fields if not f.startswith("error: ")]
    fields = fields[::-1] + ["from_a_newer_writer: 1"]
    fields = [f[:-1] if f.endswith(": ") else f for f in fields]
    moved = "\n".join([marker] + fields) + "\n%%block" + rest
    parsed = tr.parse_trace(moved)
    assert parsed.problems == []
    assert parsed.records == [r]


def test_every_cut_of_a_trace_keeps_the_whole_blocks_before_it():
    records = [rec(index=i, model_output=t, picked=t or None) for i, t in enumerate(TRICKY)]
    text = "".join(map(tr.format_record, records))
    ends = [len("".join(map(tr.format_record, records[:k + 1]))) for k in range(len(records))]
    for cut in range(0, len(text), 7):
        parsed = tr.parse_trace(text[:cut])
        whole = sum(1 for e in ends if e - 1 <= cut)  # a block is whole without its final newline
        assert parsed.records == records[:whole], cut
        assert len(parsed.problems) <= 1, (cut, parsed.problems)


def test_incomplete_with_repeats_asks_for_each_unfinished_repeat():
    h = tr.RunHeader("sanity", ((1, "sanity", "a"), (2, "sanity", "b")), repeats=3)
    assert tr.parse_trace(tr.format_run_header(h)).runs == [h]
    killed = [rec(index=1, id="a", status="PASSED", repeat=r) for r in range(3)] + \
        [rec(index=2, id="b", status="FAILED", repeat=0), rec(index=2, id="b", status="STOPPED", repeat=1)]
    assert regrade.incomplete(killed, [h]) == [("sanity", "b", 1), ("sanity", "b", 2)]
    done = killed + [rec(index=2, id="b", status="PASSED", repeat=1), rec(index=2, id="b", status="FAILED", repeat=2)]
    assert regrade.incomplete(done, [h]) == []
    # A header without the line is one repeat; a bad count spoils only the header.
    assert tr.parse_trace(tr.format_run_header(tr.RunHeader("s", ((1, "s", "x"),)))).runs[0].repeats == 1
    bad = tr.format_run_header(h).replace("repeats: 3", "repeats: 0")
    assert tr.parse_trace(bad).runs == [] and "bad repeats line" in tr.parse_trace(bad).problems[0]


def test_latency_and_concurrency_round_trip_exactly():
    r = rec(ttft_s=0.213457, itl_s=0.012, itl_max_s=0.5, itl_per="chunk", e2e_s=3.25, concurrency=8)
    text = tr.format_record(r)
    assert "ttft_s: 0.213457\n" in text and "itl_per: chunk\n" in text and "concurrency: 8\n" in text
    back = tr.parse_trace(text).records[0]
    assert back == r and tr.format_record(back) == text
    assert back.latency().itl_s == 0.012


def test_unmeasured_latency_is_written_empty_and_read_back_as_none():
    text = tr.format_record(rec())
    assert "ttft_s: \n" in text and "e2e_s: \n" in text
    back = tr.parse_trace(text).records[0]
    assert (back.ttft_s, back.itl_s, back.itl_max_s, back.e2e_s, back.itl_per, back.concurrency) == \
        (None, None, None, None, "", 0)


def test_a_trace_from_before_latency_reads_it_as_unknown():
    new_keys = ("ttft_s", "itl_s", "itl_max_s", "itl_per", "e2e_s", "concurrency")
    text = tr.format_record(rec(ttft_s=1.0, e2e_s=2.0, concurrency=4))
    old = "".join(line for line in text.splitlines(keepends=True) if line.split(":")[0] not in new_keys)
    assert "ttft_s" not in old
    parsed = tr.parse_trace(old)
    assert parsed.problems == []
    back = parsed.records[0]
    assert (back.ttft_s, back.e2e_s, back.concurrency) == (None, None, 0)
    assert back == rec()


def test_the_traces_shipped_with_the_repository_still_parse():
    import pathlib

    paths = sorted(pathlib.Path(__file__).resolve().parents[3].joinpath("traces").glob("*.trace"))
    assert paths
    for path in paths:
        parsed = tr.read_trace(path)
        assert parsed.problems == [] and parsed.records, path
        assert all(r.ttft_s is None and r.concurrency == 0 for r in parsed.records)


# ---------------------------------------------------------------- hostile counts and pieces

def _wrong_counts(block: str, how: str) -> str:
    import re

    def wrong(m):
        n = int(m[1])
        return "chars=" + str({"huge": 10**9, "over": n + 1, "under": max(0, n - 1), "next": n + 40}[how])
    return re.sub(r"chars=(\d+)", wrong, block)


@pytest.mark.parametrize("how", ["huge", "over", "under", "next"])
def test_a_wrong_count_spoils_only_its_own_block(how):
    good = _blocks(6)
    blocks = [tr.format_record(r) if i % 2 == 0 else _wrong_counts(tr.format_record(r), how)
              for i, r in enumerate(good)]
    parsed = tr.parse_trace("".join(blocks))
    assert parsed.records == good[0::2]
    assert len(parsed.problems) == 3 and all(f"(sanity/case-{i})" in p for i, p in zip((2, 4, 6), parsed.problems))
    # Each problem names the marker line of its block.
    starts = [sum(b.count("\n") for b in blocks[:i]) + 1 for i in (1, 3, 5)]
    assert [int(p.split(":")[0].split()[1]) for p in parsed.problems] == starts


def test_reading_in_pieces_gives_what_reading_at_once_gives(monkeypatch):
    """Pieces are cut only where a line starts a block; line numbers stay the file's, a line of
    invalid UTF-8 spoils its own block, and a torn block stays one problem."""
    good = [tr.format_record(r) for r in _blocks(8)]
    header = tr.format_run_header(tr.RunHeader("sanity", ((1, "sanity", "case-1"),)))
    torn = good[2].encode()[: len(good[2]) // 2]
    data = (header.encode() + good[0].encode() + _wrong_counts(good[1], "huge").encode() + torn + b"\n"
            + good[3].encode().replace("Réponse".encode(), b"R\xff") + good[4].encode() + b"stray text\n"
            + "".join(good[5:]).encode())
    whole = tr.parse_trace_bytes(data)
    assert [r.id for r in whole.records] == ["case-1", "case-5", "case-6", "case-7", "case-8"]
    assert len(whole.problems) == 4
    for piece in (1, 64, 700, 5000):
        monkeypatch.setattr(tr, "PIECE_BYTES", piece)
        parts = tr.parse_trace_bytes(data)
        assert (parts.records, parts.problems, parts.runs) == (whole.records, whole.problems, whole.runs), piece


def test_read_input_refuses_what_is_not_a_regular_file_without_waiting(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a character device"), (tmp_path, "a directory")):
        with pytest.raises(tr.InputFileError) as e:
            tr.read_input(path)
        assert str(e.value) == f"{path}: it is {kind}, not a regular file"
    big = tmp_path / "big.trace"
    big.write_bytes(b"x" * 1000)
    with pytest.raises(tr.InputFileError, match="1,000 bytes, more than the limit of an input file"):
        tr.read_input(big, limit=999)
    assert tr.read_input(big, limit=1000) == b"x" * 1000
    assert tr.MAX_INPUT_BYTES == 4 << 30


# ---------------------------------------------------------------- one writer at a time

def test_a_second_writer_of_a_trace_is_refused_while_the_first_is_open(tmp_path):
    path = tmp_path / "t.trace"
    assert not tr.being_written(path)  # no file yet
    with tr.TraceWriter(path) as w:
        w.write(rec())
        assert tr.being_written(path)
        with pytest.raises(tr.TraceBusy, match="is being written by another ds4-eval process"):
            tr.TraceWriter(path)
        w.write(rec(index=2, id="b"))  # the first writer is unharmed
        assert [r.index for r in tr.read_trace(path).records] == [1, 2]  # readers take no lock
    assert not tr.being_written(path)
    with tr.TraceWriter(path) as w:
        w.write(rec(index=3, id="c"))
    assert len(tr.read_trace(path).records) == 3
