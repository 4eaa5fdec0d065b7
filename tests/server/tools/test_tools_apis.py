"""Mapping between the three APIs' tool objects and the internal records."""

import json

import pytest

from server.tools.apis import (
    ToolInputError, messages_from_anthropic, messages_from_openai, messages_from_responses, tools_from_anthropic,
    tools_from_openai, tools_from_responses)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_tool_definitions_agree_across_apis():
    a = tools_from_openai([{"type": "function", "function": {"name": "weather", "description": "d",
                                                             "parameters": SCHEMA}}])
    b = tools_from_anthropic([{"name": "weather", "description": "d", "input_schema": SCHEMA}])
    c = tools_from_responses([{"type": "function", "name": "weather", "description": "d", "parameters": SCHEMA}])
    assert a == b == c


@pytest.mark.parametrize("bad", [[{"type": "function"}], [{"type": "function", "function": {"name": ""}}],
                                 ["x"], [{"type": "function", "function": {"name": "f", "parameters": []}}]])
def test_bad_openai_tools(bad):
    with pytest.raises(ToolInputError):
        tools_from_openai(bad)


def test_inputs_map_to_the_same_messages():
    args = {"city": "Zürich"}
    oa = messages_from_openai([
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    an = messages_from_anthropic("sys", [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "weather", "input": args}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": [{"type": "text", "text": "sunny"}]}]}])
    rs = messages_from_responses("sys", [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": json.dumps(args)},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert oa == an == rs
    assert [m.role for m in oa] == ["system", "user", "assistant", "tool"]


def test_responses_turn_grouping_and_reasoning():
    ms = messages_from_responses(None, [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "g", "arguments": ""},
        {"type": "function_call_output", "call_id": "b", "output": "B"},
        {"type": "function_call_output", "call_id": "a", "output": "A"}])
    assert [m.role for m in ms] == ["user", "assistant", "tool", "tool"]
    assert ms[1].content == "Let me see." and ms[1].reasoning == "think"
    assert [c.id for c in ms[1].tool_calls] == ["a", "b"]


@pytest.mark.parametrize("fn,args", [
    (messages_from_openai, ([{"role": "wizard", "content": "x"}],)),
    (messages_from_openai, ([{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{not json"}}]}],)),
    (messages_from_openai, ([{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}],)),
    (messages_from_openai, ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],)),
    (messages_from_openai, ([{"role": "tool", "content": "x"}],)),
    (messages_from_anthropic, (None, [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}])),
    (messages_from_responses, (None, [{"type": "computer_call"}])),
    (messages_from_responses, (None, 5)),
])
def test_bad_inputs_raise_tool_input_error(fn, args):
    with pytest.raises(ToolInputError) as e:
        fn(*args)
    assert str(e.value)
