"""Trace format round trip, regrading and the retry list."""

from hypothesis import given, settings, strategies as st

from ds4eval import regrade as rg
from ds4eval import trace as tr

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
    report = rg.regrade([r])
    assert (report.passed, report.failed, report.not_graded, report.changed) == (1, 0, 0, [])


def test_regrade_counts_only_finished_cases():
    records = [rec(index=1), rec(index=2, status="STOPPED", model_output="Answer: 9"),
               rec(index=3, status="STOPPED", model_output="")]
    report = rg.regrade(tr.parse_trace("".join(map(tr.format_record, records))).records)
    assert report.summary_line() == "passed=1 failed=0 not_graded=2 changed=0"


def test_regrade_lists_changed_verdicts_and_uses_lookup_for_old_traces():
    from ds4eval.cases import parse_case

    records = [rec(index=1, status="FAILED"),                       # extractor now reads it: changed
               rec(index=2, status="PASSED", model_output="Answer: 6"),  # changed the other way
               rec(index=3, status="PASSED", expected="", answer_kind="", id="k")]
    case = parse_case({"source": "sanity", "id": "k", "question": "q", "answer": "5", "answer_kind": "integer"})
    report = rg.regrade(records, lambda s, i: case if (s, i) == ("sanity", "k") else None)
    assert [(c.index, c.old_status, c.new_status) for c in report.changed] == [(1, "FAILED", "PASSED"),
                                                                            (2, "PASSED", "FAILED")]
    assert report.passed == 2 and report.failed == 1
    assert rg.regrade([records[2]]).not_graded == 1


def test_incomplete_uses_the_latest_block_per_case():
    records = [rec(id="a", status="STOPPED"), rec(id="b", status="ERROR"), rec(id="c", status="FAILED"),
               rec(id="a", status="PASSED")]
    assert rg.incomplete(records) == [("sanity", "b")]
