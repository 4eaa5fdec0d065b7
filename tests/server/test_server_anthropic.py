"""Anthropic Messages over the fake engine: shapes, event sequence, errors, and the SDK."""

from __future__ import annotations

import anthropic
import pytest
from fastapi.testclient import TestClient

from server_support import fake_app, live_server
from server_fake_engine import DEFAULT_REPLY, FakeModel

USER = [{"role": "user", "content": "hi"}]


def sse_events(text: str) -> list[tuple[str, dict]]:
    import json
    out = []
    for frame in text.split("\n\n"):
        lines = frame.splitlines()
        name = next((l[7:] for l in lines if l.startswith("event: ")), None)
        data = next((l[6:] for l in lines if l.startswith("data: ")), None)
        if name and data:
            out.append((name, json.loads(data)))
    return out


def test_message_non_streaming(client):
    r = client.post("/v1/messages", json={"model": "claude-x", "max_tokens": 100, "messages": USER,
                                          "system": "be nice"})
    assert r.status_code == 200
    body = r.json()
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["id"].startswith("msg_")
    assert body["content"] == [{"type": "text", "text": DEFAULT_REPLY}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    u = body["usage"]
    assert u["output_tokens"] == len(DEFAULT_REPLY) + 1
    assert u["cache_read_input_tokens"] == 0 and u["cache_creation_input_tokens"] == 0


def test_stop_reasons(client):
    body = client.post("/v1/messages", json={"max_tokens": 3, "messages": USER}).json()
    assert body["stop_reason"] == "max_tokens"
    body = client.post("/v1/messages", json={"max_tokens": 100, "messages": USER,
                                             "stop_sequences": ["world"]}).json()
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "world"
    assert body["content"][0]["text"] == "Hello, "


def test_cache_read_tokens_and_input_tokens_split(client):
    client.post("/v1/messages", json={"max_tokens": 2, "messages": USER})
    body = client.post("/v1/messages", json={"max_tokens": 2, "messages": USER}).json()
    u = body["usage"]
    assert u["cache_read_input_tokens"] > 0
    assert u["input_tokens"] + u["cache_read_input_tokens"] == 21


def test_event_sequence(client):
    r = client.post("/v1/messages", json={"max_tokens": 5, "messages": USER, "stream": True})
    events = sse_events(r.text)
    names = [n for n, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(n == "content_block_delta" for n in names[3:-3])
    assert all(d["type"] == n for n, d in events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == DEFAULT_REPLY[:5]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == 5


def test_tool_use_and_tool_result_blocks_reach_the_prompt(client, fake_model):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "checking"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "thanks"}]},
    ]
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}]
    r = client.post("/v1/messages", json={"max_tokens": 1, "messages": messages, "tools": tools,
                                          "system": [{"type": "text", "text": "sys"}]})
    assert r.status_code == 200, r.text
    prompt = fake_model.rendered[-1]
    system = prompt.split("<|im_start|>user")[0]
    # Tool definitions come first, canonically rendered, then the client's system prompt.
    assert '{"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}' in system
    assert system.endswith("</tool_call>\n\nsys<|im_end|>\n")
    assert ('<|im_start|>assistant\nchecking\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            "\n</tool_call><|im_end|>") in prompt
    assert prompt.index("<tool_response>\nsunny\n</tool_response>") < prompt.index("<|im_start|>user\nthanks")


@pytest.mark.parametrize("body,fragment", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 5, "messages": USER, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 5, "messages": USER, "ignore_eos": True}, "ignore_eos"),
])
def test_errors_use_the_anthropic_shape(client, body, fragment):
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error"
    assert fragment in err["error"]["message"]


def test_context_length_in_anthropic_shape():
    with TestClient(fake_app(FakeModel(n_ctx=64))) as c:
        r = c.post("/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "x" * 80}]})
        assert r.status_code == 400
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["n_ctx"] == 64 and err["error"]["n_prompt_tokens"] >= 64
        assert "64" in err["error"]["message"]


def test_bad_json_in_anthropic_shape(client):
    r = client.post("/v1/messages", content=b'{"max_tokens": 1, "max_tokens": 2}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_count_tokens(client):
    r = client.post("/v1/messages/count_tokens", json={"messages": USER})
    assert r.json() == {"input_tokens": 21}


def test_official_sdk_create_and_stream():
    with live_server(fake_app()) as srv:
        client = anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0)
        msg = client.messages.create(model="m", max_tokens=64, messages=USER)
        assert msg.content[0].text == DEFAULT_REPLY
        assert msg.stop_reason == "end_turn"
        assert msg.usage.output_tokens == len(DEFAULT_REPLY) + 1
        with client.messages.stream(model="m", max_tokens=64, messages=USER) as stream:
            pieces = list(stream.text_stream)
            final = stream.get_final_message()
        assert "".join(pieces) == DEFAULT_REPLY
        assert final.stop_reason == "end_turn"
        assert final.usage.cache_read_input_tokens > 0
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model="m", max_tokens=5, messages=USER, extra_body={"temperature": 3.0})
        assert err.value.status_code == 400
