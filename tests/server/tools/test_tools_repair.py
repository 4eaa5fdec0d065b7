"""Thinking isolation, truncation repair and malformed blocks, per syntax."""

import pytest

from server.tools import get_syntax, parse_tool_output, ToolCall

FULL = {name: get_syntax(name).render_calls([ToolCall("c", "edit", {"path": "a.py", "text": "def f():\n    return 1"})])
        for name in ("hermes", "qwen-xml", "glm", "dsml")}


@pytest.mark.parametrize("name", sorted(FULL))
def test_every_truncation_is_repaired_or_plain_text(name):
    """Cut the block at every position: the result is either a repaired call to `edit` or the text itself."""
    text = FULL[name]
    repaired = set()
    for cut in range(1, len(text)):
        r = parse_tool_output(name, text[:cut], finish_reason="length")
        if r.tool_calls:
            assert r.finish_reason == "tool_calls" and r.repaired
            assert [c.name for c in r.tool_calls] == ["edit"] and r.tool_calls[0].repaired
            assert r.tool_calls[0].raw == text[:cut]  # the replay text is what was sampled, not the repair
            assert r.content == ""
            repaired.add(cut)
        else:
            # A cut inside the start marker is plain text without ever having been a block.
            assert r.finish_reason == "length"
            assert r.malformed == (1 if cut >= len(get_syntax(name).call_starts[0]) else 0)
            assert r.content == text[:cut]
    # Once the last value has started, every cut is repaired.
    assert set(range(text.index("def f") + 1, len(text))) <= repaired


@pytest.mark.parametrize("name", sorted(FULL))
def test_repair_closes_an_open_value(name):
    text = FULL[name]
    cut = text.index("return 1") + len("return")
    r = parse_tool_output(name, text[:cut], finish_reason="length")
    assert r.tool_calls[0].arguments["text"].rstrip() == "def f():\n    return"
    assert r.tool_calls[0].arguments["path"] == "a.py"


@pytest.mark.parametrize("name", sorted(FULL))
def test_malformed_block_is_plain_text_with_stop(name):
    marker = get_syntax(name).call_starts[0]
    text = f"See {marker} this is not a call {marker[:-1]}"
    r = parse_tool_output(name, text)
    assert r.tool_calls == [] and r.finish_reason == "stop" and r.content == text and r.malformed == 1
    assert parse_tool_output(name, text, finish_reason="length").finish_reason == "length"


@pytest.mark.parametrize("name", sorted(FULL))
def test_malformed_then_valid_call(name):
    marker = get_syntax(name).call_starts[0]
    r = parse_tool_output(name, f"{marker}???\n{FULL[name]}")
    assert [c.name for c in r.tool_calls] == ["edit"] and r.content == f"{marker}???" and r.malformed == 1


@pytest.mark.parametrize("name", sorted(FULL))
def test_call_inside_closed_thinking_is_not_executed(name):
    text = f"<think>Maybe:\n{FULL[name]}\nno.</think>Final answer."
    r = parse_tool_output(name, text)
    assert r.tool_calls == [] and r.content == "Final answer." and FULL[name] in r.reasoning
    assert r.finish_reason == "stop"


@pytest.mark.parametrize("name", sorted(FULL))
def test_complete_call_in_unclosed_thinking_is_recovered(name):
    r = parse_tool_output(name, f"I will edit.\n{FULL[name]}", starts_in_thinking=True)
    assert [c.name for c in r.tool_calls] == ["edit"] and r.reasoning == "I will edit." and r.content == ""


@pytest.mark.parametrize("name", sorted(FULL))
def test_truncated_call_in_unclosed_thinking_stays_reasoning(name):
    text = FULL[name][:-8]
    r = parse_tool_output(name, f"<think>hmm {text}", finish_reason="length")
    assert r.tool_calls == [] and r.reasoning == f"hmm {text}".strip() and r.finish_reason == "length"


@pytest.mark.parametrize("name", ["hermes", "qwen-xml", "glm", "dsml"])
def test_values_may_hold_other_closing_tags(name):
    args = {"text": "a </tool_call> b </think> c <think> d </function> e"}
    block = get_syntax(name).render_calls([ToolCall("c", "w", args)])
    r = parse_tool_output(name, "<think>t</think>" + block + "tail")
    assert r.tool_calls[0].arguments == args and r.content == "tail" and r.reasoning == "t"


def test_close_marker_inside_value_of_call_in_open_thinking():
    # The </think> sits inside an argument value: thinking is still open, and the call is recovered at the end.
    block = get_syntax("qwen-xml").render_calls([ToolCall("c", "w", {"t": "x</think>y"})])
    r = parse_tool_output("qwen-xml", "<think>plan " + block)
    assert r.reasoning == "plan" and r.tool_calls[0].arguments == {"t": "x</think>y"}


def test_stray_think_close_and_whitespace():
    r = parse_tool_output("hermes", "reasoning leaked</think>\n\nAnswer\n")
    assert r.content == "reasoning leakedAnswer\n"
    r = parse_tool_output("hermes", "<think>\n  a  \n</think>\n\nb")
    assert (r.reasoning, r.content) == ("a", "b")


def test_hermes_accepts_string_arguments_and_parameters_key():
    r = parse_tool_output("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                                    '<tool_call>{"name": "g", "parameters": {"b": 2}}</tool_call>')
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("f", {"a": 1}), ("g", {"b": 2})]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
    '<tool_call>{"name": "f"]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}} extra</tool_call>',
])
def test_hermes_invalid_objects_are_text(text):
    r = parse_tool_output("hermes", text)
    assert r.tool_calls == [] and r.content == text and r.finish_reason == "stop"
