"""Rendering: golden bytes per syntax, canonical JSON, delimiter escaping, render -> parse -> render round trips."""

import pytest
from hypothesis import given, settings, strategies as st

from server.tools import (
    SYNTAXES, DelimiterEscaper, ToolCall, ToolResult, ToolSpec, canonical_json, detect_syntax, get_syntax,
    new_call_id, parse_tool_output)

CALLS = [ToolCall("call_1", "read_file", {"path": "src/a.py", "limit": 20}),
         ToolCall("call_2", "note", {"text": "x</parameter>y 🎉", "ok": True})]


def test_canonical_json_rules():
    assert canonical_json({"b": 1, "a": [1, 2], "c": {"d": None}}) == '{"b": 1, "a": [1, 2], "c": {"d": null}}'
    assert canonical_json({"s": "é🎉 <&>"}) == '{"s": "é🎉 <&>"}'
    nul = canonical_json({"s": "a\x00b"})
    assert nul == '{"s": "a\\u0000b"}'
    assert parse_tool_output("hermes", f'<tool_call>{{"name": "f", "arguments": {nul}}}</tool_call>') \
        .tool_calls[0].arguments == {"s": "a\x00b"}
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_escaper_is_reversible_and_minimal():
    e = DelimiterEscaper(["</parameter>"])
    assert e.escape("a</parameter>b") == "a<\\/parameter>b"
    assert e.escape("a<\\/parameter>b") == "a<\\\\/parameter>b"
    assert e.escape("<p> & </param> </tool_call>") == "<p> & </param> </tool_call>"


@given(st.text(alphabet=st.sampled_from(list("</\\>parmet &x")), max_size=40))
@settings(max_examples=300, deadline=None)
def test_escaper_round_trip(s):
    e = DelimiterEscaper(["</parameter>"])
    assert e.unescape(e.escape(s)) == s
    assert "</parameter>" not in e.escape(s)


def test_call_ids_are_random_and_prefixed():
    ids = {new_call_id("toolu_") for _ in range(200)}
    assert len(ids) == 200 and all(i.startswith("toolu_") and len(i) == 30 for i in ids)


GOLDEN_CALLS = {
    "hermes":
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a.py", "limit": 20}}\n</tool_call>\n'
        '<tool_call>\n{"name": "note", "arguments": {"text": "x</parameter>y 🎉", "ok": true}}\n</tool_call>',
    "qwen-xml":
        "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=limit>\n20\n"
        "</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=note>\n<parameter=text>\nx<\\/parameter>y 🎉\n</parameter>\n<parameter=ok>\ntrue\n"
        "</parameter>\n</function>\n</tool_call>",
    "glm":
        "<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>src/a.py</arg_value>\n<arg_key>limit</arg_key>\n"
        "<arg_value>20</arg_value>\n</tool_call>\n"
        "<tool_call>note\n<arg_key>text</arg_key>\n<arg_value>x</parameter>y 🎉</arg_value>\n<arg_key>ok</arg_key>\n"
        "<arg_value>true</arg_value>\n</tool_call>",
    "dsml":
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="read_file">\n'
        '<｜DSML｜parameter name="path" string="true">src/a.py</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="limit" string="false">20</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="note">\n'
        '<｜DSML｜parameter name="text" string="true">x</parameter>y 🎉</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="ok" string="false">true</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>",
}

RESULTS = [ToolResult("call_1", "line </tool_response> </tool_result> <b>&amp;</b>")]
GOLDEN_RESULTS = {
    "hermes": "<tool_response>\nline <\\/tool_response> </tool_result> <b>&amp;</b>\n</tool_response>",
    "qwen-xml": "<tool_response>\nline <\\/tool_response> </tool_result> <b>&amp;</b>\n</tool_response>",
    "glm": "<tool_response>\nline <\\/tool_response> </tool_result> <b>&amp;</b>\n</tool_response>",
    "dsml": "<tool_result>line </tool_response> <\\/tool_result> <b>&amp;</b></tool_result>",
}


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_golden_calls(name):
    assert get_syntax(name).render_calls(CALLS) == GOLDEN_CALLS[name]


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_golden_results(name):
    assert get_syntax(name).render_results(RESULTS) == GOLDEN_RESULTS[name]


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_tool_definitions_are_canonical_and_api_neutral(name):
    schema = {"type": "object", "properties": {"q": {"type": "string", "description": "régime 🎉"}},
              "required": ["q"]}
    s = get_syntax(name)
    a = s.render_tools([ToolSpec("search", "Find things", schema)])
    b = s.render_tools([ToolSpec("search", "Find things", dict(schema))])
    line = ('{"type": "function", "function": {"name": "search", "description": "Find things", "parameters": '
            '{"type": "object", "properties": {"q": {"type": "string", "description": "régime 🎉"}}, '
            '"required": ["q"]}}}')
    assert a == b and line in a


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_render_parse_render_identical(name):
    s = get_syntax(name)
    text = s.render_calls(CALLS)
    r = parse_tool_output(name, text)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [(c.name, c.arguments) for c in CALLS]
    assert s.render_calls(r.tool_calls) == text
    assert r.content == "" and r.finish_reason == "tool_calls"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)
# Payloads built from the characters and closing tags that could end a value early.
payload_text = st.lists(st.sampled_from(list("ab </>\\\n{}\"'&🎉é\x00") + [
    "</parameter>", "</arg_value>", "</｜DSML｜parameter>", "</tool_call>", "</think>", "<think>",
    "<\\/parameter>"]), max_size=10).map("".join)


@pytest.mark.parametrize("name", sorted(SYNTAXES))
@given(args=st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), payload_text | json_values, max_size=4))
@settings(max_examples=60, deadline=None)
def test_round_trip_property(name, args):
    s = get_syntax(name)
    spec = ToolSpec("f", "", {"type": "object", "properties": {
        k: {"type": "string" if isinstance(v, str) else "object"} for k, v in args.items()}})
    text = s.render_calls([ToolCall("call_x", "f", args)])
    r = parse_tool_output(name, "Intro " + text, tools=[spec])
    assert r.content == "Intro" and len(r.tool_calls) == 1, text
    assert r.tool_calls[0].arguments == args
    assert s.render_calls(r.tool_calls) == text


def test_glm_and_qwen_use_schema_types():
    spec = ToolSpec("f", "", {"properties": {"zip": {"type": "string"}, "n": {"type": "integer"}}})
    text = get_syntax("qwen-xml").render_calls([ToolCall("c", "f", {"zip": "007", "n": 7})])
    assert parse_tool_output("qwen-xml", text, tools=[spec]).tool_calls[0].arguments == {"zip": "007", "n": 7}
    text = get_syntax("glm").render_calls([ToolCall("c", "f", {"zip": "123", "n": 7})])
    assert parse_tool_output("glm", text, tools=[spec]).tool_calls[0].arguments == {"zip": "123", "n": 7}
    # Without a schema, text that is JSON for a non-string is taken as JSON; other text stays text.
    assert parse_tool_output("glm", text).tool_calls[0].arguments == {"zip": 123, "n": 7}


def test_dsml_nested_parameters_and_variants():
    text = ("<|DSML| function_calls>\n<|DSML|invoke name=\"f\">\n"
            '<|DSML|parameter name="opts">\n'
            '  <｜DSML｜parameter name="depth" string="false">2</｜DSML｜parameter>\n'
            '  <｜DSML｜parameter name="inner">\n'
            '    <｜DSML｜parameter name="tag" string="true">a"b</｜DSML｜parameter>\n'
            "  </｜DSML｜parameter>\n"
            "</｜DSML｜parameter>\n"
            '<｜DSML｜parameter name="plain">[1, 2]</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜ calls>")
    r = parse_tool_output("dsml", text)
    assert r.tool_calls[0].arguments == {"opts": {"depth": 2, "inner": {"tag": 'a"b'}}, "plain": [1, 2]}


def test_detect_syntax():
    assert detect_syntax(chat_template="{{ '<｜DSML｜tool_calls>' }}") == "dsml"
    assert detect_syntax(chat_template="<arg_key>{{k}}</arg_key>") == "glm"
    assert detect_syntax(chat_template="<function={{n}}><parameter={{k}}>") == "qwen-xml"
    assert detect_syntax(chat_template="<tool_call>\n{{ tc | tojson }}") == "hermes"
    assert detect_syntax(model_name="GLM-4.5-Air", architecture="glm4moe") == "glm"
    assert detect_syntax(model_name="SmolLM2-135M-Instruct", architecture="llama") == "hermes"
    assert detect_syntax(model_name="GLM-4.5", override="qwen-xml") == "qwen-xml"
    with pytest.raises(ValueError, match="known: dsml, glm, hermes, qwen-xml"):
        detect_syntax(override="nope")


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_prompt_opens_thinking(name):
    s = get_syntax(name)
    assert s.prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not s.prompt_opens_thinking("<|im_start|>assistant\n")
