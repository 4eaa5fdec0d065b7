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
