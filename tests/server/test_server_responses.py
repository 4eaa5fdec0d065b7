"""OpenAI Responses over the fake engine: items in, items and typed events out, and the SDK."""

from __future__ import annotations

import openai
import pytest

from server_support import fake_app, live_server
from server_fake_engine import DEFAULT_REPLY
from test_server_anthropic import sse_events


def test_string_input(client):
    r = client.post("/v1/responses", json={"input": "hi", "instructions": "be brief", "max_output_tokens": 64})
    body = r.json()
    assert body["object"] == "response" and body["status"] == "completed"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"][0] == {"type": "output_text", "text": DEFAULT_REPLY, "annotations": [], "logprobs": []}
    u = body["usage"]
    assert u["output_tokens"] == len(DEFAULT_REPLY) + 1
    assert u["input_tokens_details"] == {"cached_tokens": 0}
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert body["instructions"] == "be brief"


def test_incomplete_when_the_limit_is_hit(client):
    body = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4}).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == DEFAULT_REPLY[:4]


def test_previous_output_items_are_passed_back(client, fake_model):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me check", "annotations": []}]},
        {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": "{\"c\": 2}"},
        {"type": "function_call_output", "call_id": "call_9", "output": "rain"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "developer", "content": "short answers"},
    ]
    r = client.post("/v1/responses", json={"input": items, "max_output_tokens": 1,
                                           "tools": [{"type": "function", "name": "get_weather",
                                                      "parameters": {"type": "object"}}]})
    assert r.status_code == 200, r.text
    prompt = fake_model.rendered[-1]
    assert 'let me check\n<tool_call>\n{"name": "get_weather", "arguments": {"c": 2}}\n</tool_call>' in prompt
    assert "<tool_response>\nrain\n</tool_response>" in prompt
    assert "<|im_start|>system\nshort answers" in prompt


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": 5}, "input"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "frobnicate"}}}},
     "text.format.schema"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
])
def test_errors(client, body, param):
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_event_sequence(client):
    r = client.post("/v1/responses", json={"input": "hi", "stream": True, "max_output_tokens": 3})
    events = sse_events(r.text)
    names = [n for n, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert deltas == DEFAULT_REPLY[:3]
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == DEFAULT_REPLY[:3]
    assert final["usage"]["output_tokens"] == 3


def test_official_sdk_create_and_stream():
    with live_server(fake_app()) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        resp = client.responses.create(model="m", input="hi")
        assert resp.output_text == DEFAULT_REPLY
        assert resp.usage.output_tokens == len(DEFAULT_REPLY) + 1
        stream = client.responses.create(model="m", input="hi", stream=True)
        kinds, text, final = [], "", None
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                final = event.response
        assert text == DEFAULT_REPLY
        assert final is not None and final.output_text == DEFAULT_REPLY
        assert final.usage.input_tokens_details.cached_tokens > 0
