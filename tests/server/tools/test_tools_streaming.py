"""Streaming parser: the same result for every chunking, deltas that add up to it, no partial-marker leaks."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from server.tools import (
    ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallParser, ToolCallStart,
    SYNTAXES, parse_tool_output)

DSML_CALL = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Beijing </tool_call> </think></｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">5</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>")

CASES = {
    "hermes": [
        'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "a</tool_call>b.py", "n": [1, {"x": "}"}]}}'
        '\n</tool_call>\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>',
        '<think>\nI should call <tool_call>{"name": "x"}</tool_call> maybe\n</think>\n\nOK 🎉 done.',
        '<think>plan</think><tool_call>{"name": "run", "arguments": {"cmd": "echo \\"</think>\\" && ls <x>"}}'
        '</tool_call>',
        'Text with <tool_call> no json here and <b>tags</b> <thin and </thi',
        '<tool_call>{"name": "write", "arguments": {"text": "trunc\\',
        '<think>unclosed <tool_call>{"name": "f", "arguments": {"a": "</think>"}}</tool_call> and more',
    ],
    "qwen-xml": [
        "I will run it.\n<tool_call>\n<function=bash>\n<parameter=cmd>\nls -la </tool_call> </think> <x>\n"
        "</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>",
        "<think>maybe <tool_call>\n<function=bash></think>After thinking: done",
        "<tool_call>\n<function=edit>\n<parameter=text>\nline1\nline2 <\\/parameter>",
        "<tool_call>\nnot a function</tool_call> trailing",
    ],
    "glm": [
        "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>cats </tool_call> & dogs</arg_value>\n"
        "<arg_key>limit</arg_key>\n<arg_value>10</arg_value>\n</tool_call>",
        "<think>x</think>Answer.\n<tool_call>get_time\n</tool_call>",
        "<tool_call>two words here</tool_call>",
        "<tool_call>partial\n<arg_key>a</arg_key>\n<arg_value>unfinished",
    ],
    "dsml": [
        "<think>I need weather.</think>\n\n" + DSML_CALL,
        "Sure " + DSML_CALL.replace("｜DSML｜tool_calls", "｜DSML｜ calls"),
        DSML_CALL[:-30],
        "<｜DSML｜tool_calls>\nplain words\n",
        "<think>unclosed and " + DSML_CALL + " trailing",
    ],
}
ALL = [(s, t) for s, texts in CASES.items() for t in texts]


def run(syntax, pieces, **kw):
    ids = iter(range(10_000))
    p = ToolCallParser(syntax, id_factory=lambda: f"call_{next(ids)}", **kw)
    events = []
    for piece in pieces:
        events += p.feed(piece)
    result = p.finish("length")
    return events + result.events, result


def summary(result):
    return (result.content, result.reasoning, [(c.id, c.name, c.arguments, c.raw, c.repaired)
                                                for c in result.tool_calls],
            result.finish_reason, result.repaired, result.malformed)


def chunkings(text, seed):
    rnd = random.Random(seed)
    yield [text]
    yield list(text)  # one character at a time
    b = text.encode("utf-8")  # one UTF-8 byte at a time, decoded the way a token stream would surface it
    pieces, cur = [], b""
    for i in range(len(b)):
        cur += b[i:i + 1]
        try:
            pieces.append(cur.decode("utf-8"))
            cur = b""
        except UnicodeDecodeError:
            pieces.append("")
    yield pieces
    for _ in range(6):
        cuts = sorted(rnd.sample(range(1, len(text)), min(len(text) - 1, rnd.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("syntax,text", ALL)
def test_same_result_for_any_chunking(syntax, text):
    _, whole = run(syntax, [text])
    for i, pieces in enumerate(chunkings(text, hash(text) & 0xFFFF)):
        events, result = run(syntax, pieces)
        assert summary(result) == summary(whole), f"chunking #{i}"
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == result.content
        assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == result.reasoning
        assert [e.call for e in events if isinstance(e, ToolCallEnd)] == result.tool_calls
        for idx, call in enumerate(result.tool_calls):
            starts = [e for e in events if isinstance(e, ToolCallStart) and e.index == idx]
            args = "".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta) and e.index == idx)
            assert [(s.id, s.name) for s in starts] == [(call.id, call.name)]
            assert args == call.arguments_json


@pytest.mark.parametrize("syntax,text", ALL)
def test_one_shot_equals_streaming(syntax, text):
    r = parse_tool_output(syntax, text, finish_reason="length")
    _, s = run(syntax, list(text))
    assert (r.content, r.reasoning, [(c.name, c.arguments) for c in r.tool_calls]) == \
        (s.content, s.reasoning, [(c.name, c.arguments) for c in s.tool_calls])


def test_split_think_close_never_leaks():
    p = ToolCallParser("hermes", starts_in_thinking=True)
    seen = p.feed("pondering</thi")
    assert seen == [ReasoningDelta("pondering")]
    seen = p.feed("nk>Hello")
    assert seen == [ContentDelta("Hello")]
    assert p.finish().reasoning == "pondering"


@pytest.mark.parametrize("syntax,marker", [("hermes", "<tool_call>"), ("dsml", "<｜DSML｜tool_calls>"),
                                           ("glm", "<tool_call>"), ("qwen-xml", "<tool_call>")])
def test_partial_start_marker_is_held_back(syntax, marker):
    p = ToolCallParser(syntax)
    out = []
    for ch in "Hi " + marker:
        out += p.feed(ch)
        assert all("<" not in e.text for e in out if isinstance(e, ContentDelta))
    assert "".join(e.text for e in out if isinstance(e, ContentDelta)) == "Hi"
    assert p.in_structure


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
def test_every_marker_has_one_angle_bracket_and_it_comes_first(syntax):
    """What the parser's shortcuts rest on: text without "<" holds no marker and no start of one,
    so it goes out as it is (`_step_content`), and only the last "<" in reach can start a
    marker (`_partial_tail`)."""
    s = SYNTAXES[syntax]
    for marker in (s.think_open, s.think_close, *s.call_starts):
        assert marker.startswith("<") and marker.count("<") == 1, marker


def test_text_without_markers_goes_out_token_by_token_with_structure_whitespace_held():
    p = ToolCallParser("hermes")
    assert p.feed("Hello") == [ContentDelta("Hello")]
    assert p.feed(" world  ") == [ContentDelta(" world")]  # trailing space: maybe before a marker
    assert p.feed("again\n") == [ContentDelta("  again")]
    assert p.feed("<tool") == []
    assert p.finish().content == "Hello world  again\n<tool"


def test_in_structure_tracks_payload_hermes():
    p = ToolCallParser("hermes")
    states = []
    text = '<tool_call>{"name": "w", "arguments": {"path": "x.txt", "n": 5}}</tool_call>after'
    for ch in text:
        p.feed(ch)
        states.append(p.in_structure)
    # Inside the "x.txt" value the sampler may use the request's temperature; in tags, keys and numbers it may not.
    v = text.index('"x.txt"')
    assert states[v] is False and states[v + 3] is False
    assert states[text.index('"path"') + 2] is True
    assert states[text.index('"w"') + 1] is True  # the function name is structure
    assert states[text.index("5}")] is True
    assert states[-1] is False  # back in content


@pytest.mark.parametrize("syntax,text,value", [
    ("qwen-xml", "<tool_call>\n<function=f>\n<parameter=a>\nhello world\n</parameter>\n</function>\n</tool_call>",
     "hello world"),
    ("glm", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>hello world</arg_value>\n</tool_call>", "hello world"),
    ("dsml", DSML_CALL, "Beijing"),
])
def test_in_structure_tracks_payload_xml(syntax, text, value):
    p = ToolCallParser(syntax)
    states = []
    for ch in text:
        p.feed(ch)
        states.append(p.in_structure)
    v = text.index(value)
    assert states[v + 2] is False
    assert states[text.index("name=\"" if syntax == "dsml" else "f") + 1] is True
    assert states[-1] is False


def test_long_value_streams_in_linear_time():
    body = "x = 1  # </tool_call> </think>\n" * 4000
    text = "<tool_call>\n<function=write>\n<parameter=text>\n" + body + "\n</parameter>\n</function>\n</tool_call>"
    p = ToolCallParser("qwen-xml")
    for i in range(0, len(text), 3):
        p.feed(text[i:i + 3])
    r = p.finish()
    assert r.tool_calls[0].arguments["text"] == body


# Random outputs assembled from the pieces that make parsing hard: markers, half markers, JSON and XML fragments.
FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {', '"a": "', '"', "}", "}}", "\\", ", ",
               ": ", "[1, ", "]"],
    "qwen-xml": ["<tool_call>", "</tool_call>", "\n<function=f>\n", "<parameter=a>\n", "\n</parameter>\n",
                 "</function>", "<\\/parameter>", "<function=", "<parameter="],
    "glm": ["<tool_call>", "</tool_call>", "f\n", "<arg_key>", "a", "</arg_key>", "<arg_value>", "</arg_value>",
            "\n"],
    "dsml": ["<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", '<｜DSML｜invoke name="f">', "</｜DSML｜invoke>",
             '<｜DSML｜parameter name="a" string="true">', '<｜DSML｜parameter name="o">', "</｜DSML｜parameter>",
             "<｜DSML｜ calls>", "</｜DSML｜ calls>", "<｜DSML｜"],
}
COMMON = ["<think>", "</think>", "</thi", "<tool_", "hello", " ", "\n", "🎉", "<", ">", "x"]


@pytest.mark.parametrize("syntax", sorted(FRAGMENTS))
@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_random_outputs_are_chunking_invariant(syntax, data):
    parts = data.draw(st.lists(st.sampled_from(FRAGMENTS[syntax] + COMMON), max_size=25))
    text = "".join(parts)
    thinking = data.draw(st.booleans())
    _, whole = run(syntax, [text], starts_in_thinking=thinking)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for chunks in (pieces, list(text)):
        events, result = run(syntax, chunks, starts_in_thinking=thinking)
        assert summary(result) == summary(whole)
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == result.content
        assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == result.reasoning
    # Without calls and thinking markers nothing is dropped: malformed blocks come back as the exact text.
    if not whole.tool_calls and not thinking and "<think>" not in text and "</think>" not in text:
        assert whole.content == text
