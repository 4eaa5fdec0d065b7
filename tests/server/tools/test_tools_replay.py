"""Exact replay memory and conversation rendering: bounds, counters, result ordering, system placement."""

from server.tools import (
    Message, ReplayMemory, ToolCall, ToolsConfig, ToolSpec, get_syntax, parse_tool_output, render_conversation)

import pytest

TOOLS = [ToolSpec("read", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}})]


def test_memory_bounds_oldest_out():
    m = ReplayMemory(max_ids=3, max_bytes=1000)
    for i in range(5):
        m.remember([f"call_{i}"], f"text {i}")
    assert len(m) == 3 and m.lookup("call_0") is None and m.lookup("call_4") == "text 4"
    m = ReplayMemory(max_ids=100, max_bytes=10)
    m.remember(["a"], "12345")
    m.remember(["b"], "6789é")  # 6 bytes: total 11 > 10, so "a" goes
    assert m.lookup("a") is None and m.lookup("b") == "6789é" and m.total_bytes == 6
    m.remember(["big"], "x" * 11)  # larger than the bound: not stored, nothing evicted
    assert m.lookup("big") is None and m.lookup("b")


def test_shared_turn_text_counts_once():
    m = ReplayMemory(max_ids=10, max_bytes=100)
    m.remember(["a", "b", "c", "a"], "x" * 40)
    assert m.total_bytes == 40 and len(m) == 3
    m.remember(["d"], "y" * 40)
    assert m.total_bytes == 80
    m.remember(["e"], "z" * 40)  # 120 > 100: a, b, c leave together with their one text
    assert m.total_bytes == 80 and m.lookup("a") is None and m.lookup("d")


def test_disabled_memory_stores_nothing():
    m = ToolsConfig(disable_exact_tool_replay=True).new_memory()
    m.remember(["a"], "t")
    assert m.lookup("a") is None and len(m) == 0


def test_config_validation():
    with pytest.raises(ValueError):
        ToolsConfig(tool_syntax="nope")
    with pytest.raises(ValueError):
        ToolsConfig(tool_memory_max_ids=-1)


def _turn(syntax, text, memory):
    """Simulate generation: parse, remember, and return the assistant message as a client would send it back
    (arguments re-serialised by the client with other spacing and key order)."""
    r = parse_tool_output(syntax, text, tools=TOOLS)
    memory.remember([c.id for c in r.tool_calls], text)
    calls = [ToolCall(c.id, c.name, dict(reversed(list(c.arguments.items())))) for c in r.tool_calls]
    return Message("assistant", r.content, tool_calls=calls), r


@pytest.mark.parametrize("syntax", ["hermes", "dsml", "glm", "qwen-xml"])
def test_replay_uses_exact_text(syntax):
    s = get_syntax(syntax)
    weird = s.render_calls([ToolCall("x", "read", {"path": "a.py", "mode": "r"})]).replace("\n", "\n\n", 1)
    text = f"<think>look first</think>Reading.\n{weird}"
    memory = ReplayMemory()
    msg, r = _turn(syntax, text, memory)
    assert len(r.tool_calls) == 1
    conv = [Message("user", "hi"), msg, Message("tool", "contents", tool_call_id=r.tool_calls[0].id)]
    out = render_conversation(syntax, conv, TOOLS, memory)
    assert out.messages[2] == {"role": "assistant", "content": text}
    assert (out.replayed, out.rerendered, out.missing) == (1, 0, 0)
    assert memory.stats()["replayed"] == 1
    # Edited by the client: the calls no longer match, so the turn is rendered canonically.
    msg.tool_calls[0].arguments["path"] = "b.py"
    out = render_conversation(syntax, conv, TOOLS, memory)
    assert out.messages[2]["content"] == s.render_assistant("Reading.", msg.tool_calls)
    assert (out.replayed, out.rerendered, out.missing) == (0, 1, 0)
    # Unknown ids are missing; disabled memory re-renders.
    msg.tool_calls[0].id = "call_unknown"
    assert render_conversation(syntax, conv, TOOLS, memory).missing == 1
    assert render_conversation(syntax, conv, TOOLS, ReplayMemory(enabled=False)).rerendered == 1
    assert memory.stats() == {"ids": 1, "bytes": len(text.encode()), "replayed": 1, "rerendered": 1, "missing": 1}


def test_parallel_results_are_reordered_to_call_order():
    calls = [ToolCall(f"call_{i}", "read", {"path": f"{i}.txt"}) for i in range(3)]
    conv = [Message("user", "go"), Message("assistant", "", tool_calls=calls),
            Message("tool", "two", tool_call_id="call_2"), Message("tool", "zero", tool_call_id="call_0"),
            Message("tool", "stray", tool_call_id="call_9"), Message("tool", "one", tool_call_id="call_1"),
            Message("user", "thanks")]
    out = render_conversation("hermes", conv, TOOLS)
    body = out.messages[3]["content"]
    assert out.messages[3]["role"] == "user"
    assert [body.index(w) < body.index(v) for w, v in [("zero", "one"), ("one", "two"), ("two", "stray")]] == \
        [True, True, True]
    assert out.messages[4] == {"role": "user", "content": "thanks"}


def test_tools_go_before_the_system_prompt():
    s = get_syntax("hermes")
    out = render_conversation("hermes", [Message("system", "Be brief."), Message("user", "hi")], TOOLS)
    assert out.messages[0] == {"role": "system", "content": s.render_tools(TOOLS) + "\n\nBe brief."}
    out = render_conversation("hermes", [Message("user", "hi")], TOOLS)
    assert out.messages[0] == {"role": "system", "content": s.render_tools(TOOLS)}
    out = render_conversation("hermes", [Message("user", "hi")], [])
    assert out.messages == [{"role": "user", "content": "hi"}]
