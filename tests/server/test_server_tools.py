"""Tool calls and thinking end to end through the server, with a fake engine that writes scripted calls.

Every syntax (hermes, dsml, glm, qwen-xml) x every API (OpenAI Chat, Anthropic Messages, Responses) x streaming
or not: a plain call, thinking followed by a call, a call cut by the token limit (repaired), a malformed call
(plain text, finish stop). Then exact replay across two turns, greedy sampling inside tool structure, and the
400s for tool objects that cannot be mapped. Responses are normalised to one shape so that the same assertions
cover all three APIs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server_support import fake_app
from server.tools import SYNTAXES, ToolCall, ToolCallParser, ToolsConfig, get_syntax
from server_fake_engine import FakeModel

SYNTAX_NAMES = sorted(SYNTAXES)
APIS = ["openai", "anthropic", "responses"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
TOOLS = {
    "openai": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                 "parameters": SCHEMA}}],
    "anthropic": [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}],
    "responses": [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": SCHEMA}],
}
ARGS = {"city": "Paris", "days": 2}
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages", "responses": "/v1/responses"}


def call_text(syntax: str, args: dict = ARGS) -> str:
    return get_syntax(syntax).render_calls([ToolCall("", "get_weather", args)])


def thinking(syntax: str, text: str) -> str:
    s = get_syntax(syntax)
    return f"{s.think_open}{text}{s.think_close}\n"


MALFORMED = {
    "hermes": '<tool_call>{"name": oops}</tool_call>',
    "dsml": "<｜DSML｜tool_calls><oops></｜DSML｜tool_calls>",
    "glm": "<tool_call>get_weather<arg_value>x</arg_value></tool_call>",
    "qwen-xml": "<tool_call><oops></tool_call>",
}


def scripted(syntax: str):
    """The fake model's reply, chosen by a scenario word in the last user message."""
    def reply(prompt: str) -> str:
        if "[think]" in prompt:
            return thinking(syntax, "The user wants the weather; I will call the tool.") + call_text(syntax)
        if "[malformed]" in prompt:
            return "Sure. " + MALFORMED[syntax]
        if "[call]" in prompt or "[truncate]" in prompt:
            return call_text(syntax)
        return "It is sunny in Paris."
    return reply


@pytest.fixture(scope="module", params=SYNTAX_NAMES)
def syntax_client(request):
    syntax = request.param
    model = FakeModel(scripted(syntax), n_ctx=8192)
    with TestClient(fake_app(model, tools=ToolsConfig(tool_syntax=syntax)), raise_server_exceptions=False) as c:
        yield syntax, c, model


# ---- requests and normalisation ---------------------------------------------------------------------------------

@dataclass
class Outcome:
    content: str
    reasoning: str
    calls: list[tuple[str, str, dict]]  # (id, name, arguments)
    finish: str                          # tool_calls | stop | length
    events: list = field(default_factory=list)


def body_for(api: str, user: str, stream: bool, max_tokens: int = 1000, history: list | None = None) -> dict:
    if api == "openai":
        messages = (history or []) + [{"role": "user", "content": user}] if user else history
        return {"messages": messages, "tools": TOOLS[api], "max_tokens": max_tokens, "stream": stream}
    if api == "anthropic":
        messages = (history or []) + [{"role": "user", "content": user}] if user else history
        return {"messages": messages, "tools": TOOLS[api], "max_tokens": max_tokens, "stream": stream}
    items = (history or []) + ([{"role": "user", "content": user}] if user else [])
    return {"input": items, "tools": TOOLS[api], "max_output_tokens": max_tokens, "stream": stream}


def sse(text: str) -> list[tuple[str | None, Any]]:
    out = []
    for frame in text.split("\n\n"):
        name, data = None, None
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            out.append((name, None if data == "[DONE]" else json.loads(data)))
    return out


def normalise(api: str, stream: bool, r) -> Outcome:
    assert r.status_code == 200, r.text
    if not stream:
        return _from_body(api, r.json())
    events = sse(r.text)
    if api == "openai":
        return _from_openai_stream(events)
    if api == "anthropic":
        return _from_anthropic_stream(events)
    final = [data for name, data in events if name in ("response.completed", "response.incomplete")]
    assert len(final) == 1
    out = _from_body(api, final[0]["response"])
    # The per-call events carry the same arguments as the final items.
    done = [data for name, data in events if name == "response.function_call_arguments.done"]
    assert [json.loads(d["arguments"]) for d in done] == [c[2] for c in out.calls]
    deltas = "".join(d["delta"] for name, d in events if name == "response.output_text.delta")
    assert deltas == out.content
    out.events = events
    return out


def _from_body(api: str, body: dict) -> Outcome:
    if api == "openai":
        (choice,) = body["choices"]
        m = choice["message"]
        calls = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in m.get("tool_calls") or []]
        assert all(c["type"] == "function" for c in m.get("tool_calls") or [])
        return Outcome(m["content"] or "", m.get("reasoning_content") or "", calls, choice["finish_reason"])
    if api == "anthropic":
        blocks = body["content"]
        kinds = [b["type"] for b in blocks]
        assert kinds == sorted(kinds, key=["thinking", "text", "tool_use"].index)
        stop = {"tool_use": "tool_calls", "end_turn": "stop", "max_tokens": "length"}[body["stop_reason"]]
        return Outcome("".join(b["text"] for b in blocks if b["type"] == "text"),
                       "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
                       [(b["id"], b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"], stop)
    items = body["output"]
    calls = [(i["call_id"], i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]
    finish = "tool_calls" if calls else ("length" if body["status"] == "incomplete" else "stop")
    assert body["status"] == ("incomplete" if finish == "length" else "completed")
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    reasoning = "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i["content"])
    return Outcome(text, reasoning, calls, finish)


def _from_openai_stream(events) -> Outcome:
    assert events[-1] == (None, None)
    content, reasoning, calls, finish = "", "", {}, None
    for _, chunk in events[:-1]:
        (choice,) = chunk["choices"]
        d = choice["delta"]
        content += d.get("content") or ""
        reasoning += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            slot["id"] = tc.get("id") or slot["id"]
            slot["name"] += tc["function"].get("name") or ""
            slot["arguments"] += tc["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    assert sorted(calls) == list(range(len(calls)))
    return Outcome(content, reasoning, [(c["id"], c["name"], json.loads(c["arguments"]))
                                        for _, c in sorted(calls.items())], finish, events)


def _from_anthropic_stream(events) -> Outcome:
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks: dict[int, dict] = {}
    open_index = None
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks[open_index] = dict(data["content_block"]) | {"json": ""}
        elif name == "content_block_delta":
            b, d = blocks[data["index"]], data["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "input_json_delta":
                b["json"] += d["partial_json"]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    for b in blocks.values():
        if b["type"] == "tool_use":
            b["input"] = json.loads(b["json"])
    body = {"content": [blocks[i] for i in sorted(blocks)], "stop_reason": events[-2][1]["delta"]["stop_reason"]}
    out = _from_body("anthropic", body)
    out.events = events
    return out


def ask(client: TestClient, api: str, user: str, stream: bool, **kw) -> Outcome:
    return normalise(api, stream, client.post(PATHS[api], json=body_for(api, user, stream, **kw)))


# ---- one scripted turn in every syntax x API x streaming ----------------------------------------------------------

ID_PREFIX = {"openai": "call_", "anthropic": "toolu_", "responses": "call_"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", APIS)
def test_a_scripted_call_becomes_the_apis_tool_call(syntax_client, api, stream):
    syntax, client, _ = syntax_client
    out = ask(client, api, "weather in Paris? [call]", stream)
    assert out.finish == "tool_calls"
    assert out.content == "" and out.reasoning == ""
    ((call_id, name, args),) = out.calls
    assert name == "get_weather" and args == ARGS
    assert call_id.startswith(ID_PREFIX[api]) and len(call_id) > len(ID_PREFIX[api]) + 16


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", APIS)
def test_thinking_then_a_call(syntax_client, api, stream):
    syntax, client, _ = syntax_client
    out = ask(client, api, "weather in Paris? [think]", stream)
    assert out.reasoning == "The user wants the weather; I will call the tool."
    assert out.content == ""
    assert [(n, a) for _, n, a in out.calls] == [("get_weather", ARGS)]
    assert out.finish == "tool_calls"
    if stream and api == "openai":
        # Reasoning arrives before the call, and no marker text leaks into any delta.
        deltas = [c["choices"][0]["delta"] for _, c in out.events[:-1]]
        first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
        assert all("tool_calls" not in d for d in deltas[:first_call])
        assert not any("<" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", APIS)
def test_a_call_cut_by_the_token_limit_is_repaired(syntax_client, api, stream):
    syntax, client, _ = syntax_client
    text = call_text(syntax)
    cut = text[:text.index("Paris") + 3]
    out = ask(client, api, "weather? [truncate]", stream, max_tokens=len(cut.encode()))
    assert out.finish == "tool_calls"
    assert [(n, a) for _, n, a in out.calls] == [("get_weather", {"city": "Par"})]
    assert out.content == ""


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", APIS)
def test_a_malformed_call_is_plain_text_with_finish_stop(syntax_client, api, stream):
    syntax, client, _ = syntax_client
    out = ask(client, api, "weather? [malformed]", stream)
    assert out.calls == []
    assert out.content == "Sure. " + MALFORMED[syntax]
    assert out.finish == "stop"


@pytest.mark.parametrize("api", APIS)
def test_cut_text_without_a_call_keeps_finish_length(syntax_client, api):
    _, client, _ = syntax_client
    out = ask(client, api, "just talk", False, max_tokens=5)
    assert out.calls == [] and out.content == "It is" and out.finish == "length"


# ---- exact replay across two turns ----------------------------------------------------------------------------

def second_turn_history(api: str, first: Outcome, user: str) -> list:
    (call_id, name, args), = first.calls
    if api == "openai":
        return [{"role": "user", "content": user},
                {"role": "assistant", "content": first.content or None, "reasoning_content": first.reasoning,
                 "tool_calls": [{"id": call_id, "type": "function",
                                 "function": {"name": name, "arguments": json.dumps(args)}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"}]
    if api == "anthropic":
        blocks = ([{"type": "thinking", "thinking": first.reasoning, "signature": ""}] if first.reasoning else [])
        blocks += [{"type": "tool_use", "id": call_id, "name": name, "input": args}]
        return [{"role": "user", "content": user}, {"role": "assistant", "content": blocks},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                              "content": "sunny, 21 C"}]}]
    items = [{"role": "user", "content": user}]
    if first.reasoning:
        items.append({"type": "reasoning", "id": "rs_1", "summary": [],
                      "content": [{"type": "reasoning_text", "text": first.reasoning}]})
    items += [{"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps(args)},
              {"type": "function_call_output", "call_id": call_id, "output": "sunny, 21 C"}]
    return items


@pytest.mark.parametrize("api", APIS)
def test_the_second_turn_replays_the_exact_generated_text(syntax_client, api, caplog):
    syntax, client, model = syntax_client
    memory = client.app.state.tools.memory
    user = "weather in Paris? [think]"
    first = ask(client, api, user, stream=True)
    before = dict(memory.stats())
    caplog.set_level(logging.INFO, logger="ds4.server.tools")
    r = client.post(PATHS[api], json=body_for(api, "", False, history=second_turn_history(api, first, user)))
    assert r.status_code == 200, r.text
    generated = thinking(syntax, "The user wants the weather; I will call the tool.") + call_text(syntax)
    prompt = model.rendered[-1]
    # The thinking block proves it: the canonical rendering of a call drops earlier reasoning.
    assert f"<|im_start|>assistant\n{generated}<|im_end|>" in prompt
    after = memory.stats()
    assert (after["replayed"] - before["replayed"], after["rerendered"] - before["rerendered"],
            after["missing"] - before["missing"]) == (1, 0, 0)
    assert any("1 replayed, 0 re-rendered, 0 missing" in rec.getMessage() for rec in caplog.records)


def test_replay_keeps_key_order_and_spacing_that_canonical_rendering_would_change():
    odd = '<tool_call>{"arguments": {"days": 2, "city": "Paris"},  "name": "get_weather"}</tool_call>'
    model = FakeModel(lambda p: odd if "[odd]" in p else "ok")
    with TestClient(fake_app(model)) as c:
        first = ask(c, "openai", "weather? [odd]", False)
        assert [(n, a) for _, n, a in first.calls] == [("get_weather", {"days": 2, "city": "Paris"})]
        ask(c, "openai", "", False, history=second_turn_history("openai", first, "weather? [odd]"))
        assert f"<|im_start|>assistant\n{odd}<|im_end|>" in model.rendered[-1]
        assert c.app.state.tools.memory.stats()["replayed"] == 1


def test_unknown_ids_and_disabled_replay_render_canonically():
    model = FakeModel(scripted("hermes"))
    with TestClient(fake_app(model, tools=ToolsConfig(disable_exact_tool_replay=True))) as c:
        first = ask(c, "openai", "weather? [think]", False)
        ask(c, "openai", "", False, history=second_turn_history("openai", first, "weather? [think]"))
        prompt = model.rendered[-1]
        assert "<think>" not in prompt and call_text("hermes") in prompt
        assert c.app.state.tools.memory.stats() == {"ids": 0, "bytes": 0, "replayed": 0, "rerendered": 1,
                                                          "missing": 0}
    with TestClient(fake_app(FakeModel(scripted("hermes")))) as c:
        unknown = Outcome("", "", [("call_unknown", "get_weather", ARGS)], "tool_calls")
        ask(c, "openai", "", False, history=second_turn_history("openai", unknown, "q"))
        assert c.app.state.tools.memory.stats()["missing"] == 1


def test_a_prompt_that_opens_thinking_is_parsed_and_remembered_with_its_opening():
    reply = "Checking the tool.</think>\n" + call_text("hermes")
    model = FakeModel(lambda p: reply if "[go]" in p else "done", generation_prefix="<think>\n")
    with TestClient(fake_app(model)) as c:
        first = ask(c, "anthropic", "weather? [go]", True)
        assert first.reasoning == "Checking the tool." and first.finish == "tool_calls"
        ask(c, "anthropic", "", False, history=second_turn_history("anthropic", first, "weather? [go]"))
        assert f"<|im_start|>assistant\n<think>\n{reply}<|im_end|>" in model.rendered[-1]


# ---- sampling inside tool structure ---------------------------------------------------------------------------

def test_tokens_inside_tool_structure_are_sampled_greedily():
    text = "Let me look.\n" + call_text("hermes")
    model = FakeModel(text)
    with TestClient(fake_app(model)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                 "tools": TOOLS["openai"], "temperature": 0.7, "seed": 1})
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
        stats = c.app.state.worker.wait_finished(1, timeout=5)
    # One token per byte: the parser's state before each sampled token decides.
    parser = ToolCallParser("hermes")
    expected = 0
    for ch in text:
        expected += parser.in_structure
        parser.feed(ch)
    expected += parser.in_structure  # the EOS token after the closed call
    assert stats.n_greedy == expected
    assert 10 < stats.n_greedy < len(text) - len("Let me look.")


# ---- client tool objects that cannot be mapped ----------------------------------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0]"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0]"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
])
def test_unmappable_tool_objects_are_openai_400s(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_unmappable_anthropic_tools_are_400s_in_the_anthropic_shape(client):
    r = client.post("/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                          "tools": [{"type": "bash_20250124", "name": "bash"}]})
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "tools[0]" in err["error"]["message"]
    r = client.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "x"}],
                                                       "tools": [{"type": "bash_20250124", "name": "bash"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_count_tokens_counts_the_rendered_tool_definitions(client):
    base = {"messages": [{"role": "user", "content": "x"}]}
    plain = client.post("/v1/messages/count_tokens", json=base).json()["input_tokens"]
    with_tools = client.post("/v1/messages/count_tokens", json=base | {"tools": TOOLS["anthropic"]}).json()
    assert with_tools["input_tokens"] > plain + len(json.dumps(SCHEMA))


def test_a_failing_parser_ends_the_stream_with_an_error_and_the_server_keeps_serving(monkeypatch):
    def broken(self, chunk):
        raise RuntimeError("parser bug")

    with TestClient(fake_app(FakeModel(scripted("hermes"))), raise_server_exceptions=False) as c:
        monkeypatch.setattr(ToolCallParser, "feed", broken)
        r = c.post("/v1/chat/completions", json=body_for("openai", "x [call]", True))
        (err,) = [data for _, data in sse(r.text) if data and "error" in data]
        assert err["error"]["code"] == "inference_failed" and "parser bug" not in r.text
        monkeypatch.undo()
        assert ask(c, "openai", "x [call]", False).finish == "tool_calls"
