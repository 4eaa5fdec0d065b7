"""A long agent conversation per syntax and API: 32 tool schemas, 24 turns of calls with escapes and emoji.

Each turn: the "model" writes calls (rendered by the syntax, with thinking and odd spacing), the streaming parser
reads them in random chunks, the server remembers the text, the client sends the history back through its API's
objects (re-serialising arguments its own way), and the renderer must reproduce every earlier turn byte for byte,
so each prompt extends the previous one."""

import json
import random

import pytest

from server.tools import (
    ReplayMemory, ToolCall, ToolCallEnd, ToolCallParser, ToolResult, get_syntax, render_conversation)
from server.tools.apis import (
    ID_PREFIX, messages_from_anthropic, messages_from_openai, messages_from_responses, tools_from_openai)

N_TOOLS, N_TURNS = 32, 24
NASTY = ["</tool_call>", "</parameter>", "</arg_value>", "</｜DSML｜parameter>", "</think>", "<think>", "🎉", "é",
         "\\n", "\\", '"', "&amp;", "<b>", "\x00", "\n", "{}", "[1, 2]", "  ", "</tool_response>", "</tool_result>"]


def make_tools():
    tools = []
    for i in range(N_TOOLS):
        props = {"path": {"type": "string", "description": f"file {i} — ünïcode 🎉"},
                 "count": {"type": "integer"},
                 "opts": {"type": "object", "properties": {"deep": {"type": "boolean"}}}}
        tools.append({"type": "function", "function": {
            "name": f"tool_{i:02d}", "description": f"Tool number {i} with a NUL \x00 and <tags>",
            "parameters": {"type": "object", "properties": props, "required": ["path"]}}})
    return tools


def make_args(rnd):
    text = "".join(rnd.choice(NASTY + ["abc", "def "]) for _ in range(rnd.randint(0, 12)))
    args = {"path": text}
    if rnd.random() < 0.7:
        args["count"] = rnd.randint(-5, 10**6)
    if rnd.random() < 0.5:
        args["opts"] = {"deep": rnd.random() < 0.5}
    return args


def client_history(api, conv):
    """The conversation as the client sends it back, in its API's shapes (ids are whatever the server issued)."""
    if api == "openai":
        msgs = [{"role": "system", "content": "You are terse."}]
        for m in conv:
            if m[0] == "user":
                msgs.append({"role": "user", "content": m[1]})
            elif m[0] == "assistant":
                # The client re-serialises arguments with its own spacing and escaping.
                msgs.append({"role": "assistant", "content": m[1] or None, "tool_calls": [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": json.dumps(c.arguments, separators=(",", ":"))}}
                    for c in m[2]]})
            else:
                msgs.append({"role": "tool", "tool_call_id": m[1], "content": m[2]})
        return messages_from_openai(msgs)
    if api == "anthropic":
        msgs = []
        for m in conv:
            if m[0] == "user":
                msgs.append({"role": "user", "content": m[1]})
            elif m[0] == "assistant":
                blocks = ([{"type": "text", "text": m[1]}] if m[1] else []) + [
                    {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(json.dumps(c.arguments))}
                    for c in m[2]]
                msgs.append({"role": "assistant", "content": blocks})
            else:
                block = {"type": "tool_result", "tool_use_id": m[1], "content": m[2]}
                if msgs[-1]["role"] == "user" and isinstance(msgs[-1]["content"], list):
                    msgs[-1]["content"].append(block)
                else:
                    msgs.append({"role": "user", "content": [block]})
        return messages_from_anthropic("You are terse.", msgs)
    items = []
    for m in conv:
        if m[0] == "user":
            items.append({"role": "user", "content": m[1]})
        elif m[0] == "assistant":
            if m[1]:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": m[1]}]})
            items += [{"type": "function_call", "call_id": c.id, "name": c.name,
                       "arguments": json.dumps(c.arguments, indent=1)} for c in m[2]]
        else:
            items.append({"type": "function_call_output", "call_id": m[1], "output": m[2]})
    return messages_from_responses("You are terse.", items)


@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
@pytest.mark.parametrize("syntax", ["hermes", "dsml", "glm", "qwen-xml"])
def test_long_conversation_replays_exactly(syntax, api, replay):
    """With replay every turn comes back as sampled; without it, canonically, and still prefix-stable."""
    rnd = random.Random(f"{syntax}/{api}")
    s = get_syntax(syntax)
    specs = tools_from_openai(make_tools())
    memory = ReplayMemory(enabled=replay)
    conv: list = []
    previous: list = []
    n_calls = counted = 0
    for turn in range(N_TURNS):
        conv.append(("user", f"step {turn} 🎯"))
        wanted = [ToolCall("", f"tool_{rnd.randrange(N_TOOLS):02d}", make_args(rnd))
                  for _ in range(rnd.randint(1, 3))]
        generated = s.render_assistant(f"Turn {turn}: calling.", wanted)
        if turn % 3 == 0:
            generated = f"<think>Plan {turn}: use {wanted[0].name} </tool_call>\n</think>\n\n" + generated
        if turn % 4 == 1:
            generated = generated.replace("\n", "\n\n", 1)  # layout the canonical renderer would not produce
        # Generation, streamed in random chunks.
        p = ToolCallParser(syntax, tools=specs, id_prefix=ID_PREFIX[api])
        ends = []
        i = 0
        while i < len(generated):
            k = rnd.randint(1, 9)
            ends += [e for e in p.feed(generated[i:i + k]) if isinstance(e, ToolCallEnd)]
            i += k
        r = p.finish()
        assert [(c.name, c.arguments) for c in r.tool_calls] == [(c.name, c.arguments) for c in wanted], generated
        assert [e.call for e in ends] + [e.call for e in r.events if isinstance(e, ToolCallEnd)] == r.tool_calls
        assert r.content == f"Turn {turn}: calling." and r.finish_reason == "tool_calls"
        memory.remember([c.id for c in r.tool_calls], generated)
        n_calls += len(r.tool_calls)
        conv.append(("assistant", r.content, r.tool_calls))
        # Results come back in a shuffled order.
        results = [("tool", c.id, f"result of {c.name}: " + "".join(rnd.choice(NASTY) for _ in range(4)))
                   for c in r.tool_calls]
        rnd.shuffle(results)
        conv += results
        # The client sends everything back; every earlier turn must render byte for byte as before.
        out = render_conversation(syntax, client_history(api, conv), specs, memory)
        assert out.messages[:len(previous)] == previous
        if replay:
            assert (out.missing, out.rerendered, out.replayed) == (0, 0, n_calls)
            assert out.messages[-2] == {"role": "assistant", "content": generated}
        else:
            assert (out.missing, out.rerendered, out.replayed) == (0, n_calls, 0)
            assert out.messages[-2] == {"role": "assistant", "content": s.render_assistant(r.content, r.tool_calls)}
        call_order = [c.id for c in r.tool_calls]
        in_order = sorted(results, key=lambda x: call_order.index(x[1]))
        assert out.messages[-1] == {"role": s.result_role,
                                    "content": s.render_results([ToolResult(x[1], x[2]) for x in in_order])}
        previous = out.messages
        counted += n_calls
    assert len(out.messages) > 2 * N_TURNS
    assert memory.stats()["replayed" if replay else "rerendered"] == counted

