"""The grammar of whole tool calls, per syntax: it takes every call `render_calls` writes for the
tools' schemas (one block per call), and nothing that would not parse or fit the schema. Checked
byte by byte over the fake model's byte-level vocabulary with llguidance itself."""

from __future__ import annotations

import llguidance
import pytest

from engine_fakes import FakeModel
from server.constraints import grammar_tokenizer
from server.tools import SYNTAXES, ToolCall, ToolSpec, parse_tool_output
from server.tools.grammar import call_grammar_error, calls_grammar

WEATHER = ToolSpec("get_weather", "w", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                   "unit": {"type": "string", "enum": ["c", "f"]},
                   "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}}},
    "required": ["city", "days"], "additionalProperties": False})
CLOCK = ToolSpec("get_time", "", {})
TOOLS = [WEATHER, CLOCK]
PARIS = ToolCall("a", "get_weather", {"city": "Paris", "days": 3, "unit": "c"})
FULL = ToolCall("b", "get_weather", {"city": "Nice", "days": 0, "unit": "f", "opts": {"hourly": True}})
TIME = ToolCall("c", "get_time", {})


@pytest.fixture(scope="module")
def vocabulary():
    return FakeModel(), grammar_tokenizer(FakeModel())


def takes(vocabulary, syntax, text: str, max_calls: int = 1, tools=TOOLS) -> bool:
    """Whether the grammar of `max_calls` calls of `tools` matches exactly `text`."""
    model, tok = vocabulary
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(calls_grammar(syntax, tools, max_calls)),
                                   log_level=0)
    return all(matcher.consume_token(t) for t in model.tokenize(text)) and matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_the_grammar_takes_what_the_syntax_renders_and_it_parses(vocabulary, name):
    syntax = SYNTAXES[name]
    for calls in ([PARIS], [FULL], [TIME]):
        assert takes(vocabulary, syntax, syntax.render_calls(calls)), calls
    both = "\n".join(syntax.render_calls([c]) for c in (PARIS, TIME))
    assert takes(vocabulary, syntax, both, max_calls=2) and not takes(vocabulary, syntax, both, max_calls=1)
    parsed = parse_tool_output(syntax, both, tools=TOOLS)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", PARIS.arguments), ("get_time", {})]


@pytest.mark.parametrize("name", sorted(SYNTAXES))
@pytest.mark.parametrize("bad", [
    ToolCall("x", "get_wether", {"city": "Paris", "days": 3}),        # no such tool
    ToolCall("x", "get_weather", {"city": "Paris"}),                  # a required argument left out
    ToolCall("x", "get_weather", {"city": "Paris", "days": "three"}),  # not an integer
    ToolCall("x", "get_weather", {"city": "Paris", "days": 3, "unit": "k"}),  # not in the enum
    ToolCall("x", "get_weather", {"city": "Paris", "days": 3, "wind": 1}),    # not in the schema
    ToolCall("x", "get_weather", {"city": "Pariiiiiiiiiiiis", "days": 3}),   # past maxLength
])
def test_the_grammar_refuses_a_call_that_does_not_fit(vocabulary, name, bad):
    syntax = SYNTAXES[name]
    assert not takes(vocabulary, syntax, syntax.render_calls([bad]))


def test_only_object_schemas_get_a_grammar():
    assert call_grammar_error(TOOLS) is None
    assert "not an object schema" in call_grammar_error([ToolSpec("f", "", {"type": "string"})])
    assert "not schemas" in call_grammar_error([ToolSpec("f", "", {"type": "object", "properties": {"a": 1}})])
    with pytest.raises(ValueError):
        calls_grammar(SYNTAXES["hermes"], [], 1)


# ---- string values in the XML-style syntaxes --------------------------------------------------------------------

XML_SYNTAXES = sorted(n for n, s in SYNTAXES.items() if not s.json_arguments)
NOTE = ToolSpec("save_note", "", {
    "type": "object",
    "properties": {"text": {"type": "string"},
                   "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                   "tag": {"type": "string", "pattern": "ab"},
                   "day": {"type": "string", "format": "date"},
                   "short": {"type": "string", "minLength": 2, "maxLength": 4}},
    "required": ["text"], "additionalProperties": False})


def note_takes(vocabulary, syntax, **arguments) -> bool:
    return takes(vocabulary, syntax, syntax.render_calls([ToolCall("n", "save_note", arguments)]), tools=[NOTE])


@pytest.mark.parametrize("name", XML_SYNTAXES)
@pytest.mark.parametrize("text", [
    "two\nlines", "a < b and c > d", "<b>bold</b> and </tool_call> and </think>", "if (a<b) {\n  x = 1;\n}\n",
    "ends with a newline\n", "\nstarts with one", "", "a closing tag as text: </parameter></arg_value>",
    "</｜DSML｜parameter> and <\\/parameter>"])
def test_a_free_string_value_may_be_any_text_and_parses_back_as_itself(vocabulary, name, text):
    syntax = SYNTAXES[name]
    rendered = syntax.render_calls([ToolCall("n", "save_note", {"text": text})])
    assert takes(vocabulary, syntax, rendered, tools=[NOTE])
    parsed = parse_tool_output(syntax, rendered, tools=[NOTE])
    assert [c.arguments for c in parsed.tool_calls] == [{"text": text}]


@pytest.mark.parametrize("name", XML_SYNTAXES)
def test_a_value_never_holds_its_own_closing_text_unescaped(vocabulary, name):
    syntax = SYNTAXES[name]
    opening, closing = syntax.param_literals("text", True)
    end = syntax.value_ends[0]
    raw = syntax.call_prefix("save_note") + opening + f"a{end}b" + closing + syntax.call_suffix
    assert not takes(vocabulary, syntax, raw, tools=[NOTE])


@pytest.mark.parametrize("name", XML_SYNTAXES)
@pytest.mark.parametrize("arguments, fits", [
    ({"code": "AB-123"}, True), ({"code": "AB-1234"}, False), ({"code": "ab-123"}, False),
    ({"code": "AB-123\n"}, False),
    ({"tag": "ab"}, True), ({"tag": "xxabyy\nz"}, True), ({"tag": "a b"}, False),   # unanchored: anywhere
    ({"day": "2026-12-04"}, True), ({"day": "2026-13-04"}, False), ({"day": "04/12/2026"}, False),
    ({"day": "2026-11-31"}, False), ({"day": "2028-02-29"}, True), ({"day": "2000-02-29"}, True),
    ({"day": "2026-02-29"}, False), ({"day": "2100-02-29"}, False), ({"day": "0000-01-01"}, True),
    ({"day": "0000-02-29"}, True), ({"day": "0400-02-29"}, True), ({"day": "0001-01-01"}, True),
    ({"short": "ab"}, True), ({"short": "a\n<c"}, True), ({"short": "a"}, False), ({"short": "abcde"}, False),
    ({"short": "<\\/parameter>"[:4]}, True),
])
def test_string_patterns_formats_and_lengths_are_enforced(vocabulary, name, arguments, fits):
    syntax = SYNTAXES[name]
    assert note_takes(vocabulary, syntax, text="t", **arguments) is fits, arguments


@pytest.mark.parametrize("name", XML_SYNTAXES)
def test_a_constrained_value_holds_no_escaped_delimiter(vocabulary, name):
    # The text a pattern checks must be the value the tool receives, so no escape is written in it.
    syntax = SYNTAXES[name]
    tag = ToolSpec("tag", "", {"type": "object", "properties": {"t": {"type": "string", "pattern": "^[^x]*$"}}})
    end = syntax.value_ends[0]
    opening, closing = syntax.param_literals("t", True)
    escaped = end[0] + "\\" + end[1:]
    raw = syntax.call_prefix("tag") + opening + f"a{escaped}" + closing + syntax.call_suffix
    plain = syntax.call_prefix("tag") + opening + "a<b" + closing + syntax.call_suffix
    assert takes(vocabulary, syntax, plain, tools=[tag]) and not takes(vocabulary, syntax, raw, tools=[tag])


@pytest.mark.parametrize("fmt, good, bad", [
    ("date-time", ["2026-12-04T05:06:07Z", "2026-12-04t05:06:07.25+01:00"], ["2026-12-04 05:06", "2026-12-04"]),
    ("time", ["23:59:60Z", "05:06:07-08:00"], ["24:00:00Z", "05:06"]),
    ("duration", ["P3D", "PT1H30M", "P1Y2M", "P2W"], ["P", "PT", "P1DT", "3D"]),
    ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
    ("ipv4", ["192.168.0.1", "0.0.0.0"], ["256.1.1.1", "1.2.3"]),
    ("ipv6", ["::1", "fe80::1:2", "1:2:3:4:5:6:7:8", "::"], ["1:2:3:4:5:6:7:8:9", "1::2::3", "g::1"]),
    ("hostname", ["example.com", "a-b.c"], ["-a.com", "a..b", "a b"]),
    ("email", ["ann.lee@example.org"], ["ann@", "ann lee@example.org", "ann@localhost"]),
    ("uri", ["https://example.com/a?b=c", "urn:isbn:123"], ["example.com", "http://a b"]),
])
def test_every_known_format_takes_its_forms_and_refuses_others(vocabulary, fmt, good, bad):
    syntax = SYNTAXES["glm"]
    tool = ToolSpec("f", "", {"type": "object", "properties": {"v": {"type": "string", "format": fmt}},
                              "required": ["v"]})
    for value, fits in [(v, True) for v in good] + [(v, False) for v in bad]:
        text = syntax.render_calls([ToolCall("x", "f", {"v": value})])
        assert takes(vocabulary, syntax, text, tools=[tool]) is fits, (fmt, value)


def test_an_unknown_format_or_a_bad_bound_gets_no_grammar():
    def tool(sub):
        return [ToolSpec("f", "", {"type": "object", "properties": {"v": {"type": "string", **sub}}})]

    assert "format 'colour'" in call_grammar_error(tool({"format": "colour"}))
    assert "pattern" in call_grammar_error(tool({"pattern": 3}))
    assert "length bounds" in call_grammar_error(tool({"maxLength": "4"}))
    assert call_grammar_error(tool({"format": "date", "pattern": "^2", "minLength": 1})) is None


@pytest.mark.parametrize("pattern, inside, outside", [
    ("a|^b$", ["xax", "b"], ["xbx"]),
    ("^(a|b)c", ["acx", "bc"], ["xac"]),
    ("\\$$", ["cost $"], ["$x"]),
    ("x\\\\$", ["ax\\"], ["ax\\y"]),
    ("\\d+", ["a12"], ["a\u0663"]),  # JSON Schema's \d is ASCII
])
def test_a_pattern_is_searched_as_json_schema_says(pattern, inside, outside):
    import re as stdlib_re

    from server.tools.grammar import search_regex

    whole = stdlib_re.compile(search_regex(pattern), stdlib_re.DOTALL)
    assert all(whole.fullmatch(t) for t in inside) and not any(whole.fullmatch(t) for t in outside)
