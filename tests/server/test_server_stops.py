"""Stop-sequence matching over streamed text: hold-back, release and chunking invariance."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from server.stops import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.push(p) for p in pieces) + m.flush()
    return out, m.matched


def test_no_stops_passes_everything():
    assert run([], ["ab", "c"]) == ("abc", None)


def test_stop_split_across_pieces_is_not_leaked():
    m = StopMatcher(["</end>"])
    assert m.push("hello </e") == "hello "
    assert m.push("nd> tail") == ""
    assert m.matched == "</end>"
    assert m.flush() == ""


def test_false_start_is_released():
    m = StopMatcher(["STOP"])
    assert m.push("ST") == ""
    assert m.push("ay") == "STay"
    assert m.flush() == ""


def test_held_text_is_flushed_at_end():
    assert run(["STOP"], ["abc ST"]) == ("abc ST", None)


def test_earliest_stop_wins():
    assert run(["bbb", "a"], ["xxbbba"]) == ("xx", "bbb")


def test_a_longer_stop_starting_earlier_is_awaited():
    # "<" + ">" already contains the stop ">", but "<><" starts earlier and may still come.
    m = StopMatcher(["<><", ">"])
    assert m.push("x<") == "x"
    assert m.push(">") == ""
    assert m.matched is None
    assert m.push("<") == ""
    assert m.matched == "<><"


def test_a_pending_match_is_decided_at_the_end():
    m = StopMatcher(["<><", ">"])
    assert m.push("x<>") == "x"
    assert m.flush() == "<"
    assert m.matched == ">"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abc<>/", max_size=40),
       stops=st.lists(st.text(alphabet="abc<>/", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_result_is_independent_of_chunking(text, stops, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = run(stops, [text])
    assert run(stops, pieces) == whole
    found = [(text.find(s), s) for s in stops if s in text]
    if found:
        at = min(found)[0]
        assert whole[0] == text[:at]
    else:
        assert whole == (text, None)
