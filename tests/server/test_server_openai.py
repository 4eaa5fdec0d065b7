"""OpenAI Chat Completions and Completions over the fake engine (in-process client)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from server_support import fake_app
from server_fake_engine import DEFAULT_REPLY, FakeModel

USER = [{"role": "user", "content": "hi"}]
# ChatML prompt for USER: "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
USER_PROMPT_TOKENS = 1 + len("user\nhi") + 1 + 1 + 1 + len("assistant\n")


def sse_payloads(text: str) -> list:
    out = []
    for frame in text.split("\n\n"):
        for line in frame.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_non_streaming(client):
    r = client.post("/v1/chat/completions", json={"model": "anything", "messages": USER})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "fake-model"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": DEFAULT_REPLY, "refusal": None}
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] == USER_PROMPT_TOKENS
    # The scripted reply plus the EOS token that ended it.
    assert usage["completion_tokens"] == len(DEFAULT_REPLY) + 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_inference_runs_on_the_worker_thread(client, fake_model):
    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
    (session,) = fake_model.sessions
    assert session.owner_thread == client.app.state.worker.engine_thread.ident


def test_cached_tokens_from_prefix_reuse(client):
    first = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    longer = USER + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = client.post("/v1/chat/completions", json={"messages": longer, "max_tokens": 3}).json()
    # The first turn's prompt is a prefix of the second's.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == USER_PROMPT_TOKENS


def test_chat_streaming_with_usage(client):
    r = client.post("/v1/chat/completions", json={
        "messages": USER, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == DEFAULT_REPLY
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["stop"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(DEFAULT_REPLY) + 1
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stream_without_usage_option_has_no_usage_member(client):
    r = client.post("/v1/chat/completions", json={"messages": USER, "stream": True, "max_tokens": 2})
    chunks = sse_payloads(r.text)[:-1]
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_truncates_and_reports_stop(client, stream):
    r = client.post("/v1/chat/completions", json={"messages": USER, "stop": ["world", "zzz"],
                                                  "stream": stream})
    if stream:
        chunks = sse_payloads(r.text)[:-1]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text = r.json()["choices"][0]["message"]["content"]
        finish = r.json()["choices"][0]["finish_reason"]
    assert text == "Hello, "
    assert finish == "stop"


def test_max_tokens_gives_length(client):
    body = client.post("/v1/chat/completions", json={"messages": USER, "max_completion_tokens": 5}).json()
    assert body["choices"][0]["message"]["content"] == DEFAULT_REPLY[:5]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


def test_chat_logprobs(client):
    body = client.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == list(DEFAULT_REPLY[:3])
    for e in content:
        assert e["logprob"] < 0
        assert e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["token"] == e["token"]
        assert e["top_logprobs"][1]["logprob"] < e["top_logprobs"][0]["logprob"]


def test_completion_logprobs_and_offsets(client):
    body = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "logprobs": 1}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == list(DEFAULT_REPLY[:4])
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert all(tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"]))


def test_completion_defaults_to_16_tokens(client):
    body = client.post("/v1/completions", json={"prompt": "abc", "temperature": 0}).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == DEFAULT_REPLY[:16]
    assert body["usage"]["prompt_tokens"] == 3


def test_completion_accepts_token_ids_and_echo(client):
    body = client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2, "echo": True}).json()
    assert body["choices"][0]["text"] == "hi" + DEFAULT_REPLY[:2]
    assert body["usage"]["prompt_tokens"] == 2


def test_completion_streaming(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == DEFAULT_REPLY[:6]
    assert events[-2]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": USER, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": USER, "n": 129}, "n"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 100}, "n"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[1], [100000]]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 100000]}, "prompt"),
    ("/v1/chat/completions", {"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "temperature": 7}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 99}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": USER, "ignore_eos": True, "max_tokens": 3}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": USER, "ignore_eos": True, "temperature": 0.7}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_requests_are_400_with_param(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["message"]


def test_n_equal_one_is_fine(client):
    assert client.post("/v1/chat/completions", json={"messages": USER, "n": 1, "max_tokens": 1}).status_code == 200


def test_ignore_eos_decodes_exactly_max_tokens_greedily(client):
    n = len(DEFAULT_REPLY) + 5
    body = client.post("/v1/chat/completions", json={
        "messages": USER, "ignore_eos": True, "temperature": 0, "max_tokens": n}).json()
    assert body["choices"][0]["message"]["content"] == DEFAULT_REPLY + "....."
    assert body["usage"]["completion_tokens"] == n
    assert body["choices"][0]["finish_reason"] == "length"


def test_ignore_eos_that_cannot_fit_is_rejected():
    with TestClient(fake_app(FakeModel(n_ctx=64))) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 30, "ignore_eos": True, "temperature": 0,
                                            "max_tokens": 40})
        assert r.status_code == 400
        assert "34" in r.json()["error"]["message"]


def test_max_tokens_is_clamped_to_the_context():
    with TestClient(fake_app(FakeModel(reply="y" * 100, n_ctx=64))) as c:
        body = c.post("/v1/completions", json={"prompt": "x" * 60, "max_tokens": 1000}).json()
        assert body["usage"]["completion_tokens"] == 4
        assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 100}]}, "messages"),
    ("/v1/completions", {"prompt": "x" * 64}, "prompt"),
    ("/v1/responses", {"input": "x" * 100}, "input"),
])
def test_context_length_exceeded(path, body, param):
    model = FakeModel(n_ctx=64)
    with TestClient(fake_app(model)) as c:
        r = c.post(path, json=body)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded"
        assert err["param"] == param
        assert err["n_ctx"] == 64
        assert err["n_prompt_tokens"] >= 64
        assert str(err["n_prompt_tokens"]) in err["message"] and "64" in err["message"]
        assert model.sessions == []  # rejected before it was queued
        assert not c.app.state.worker.finished


def test_prompt_of_exactly_n_ctx_minus_one_is_accepted():
    with TestClient(fake_app(FakeModel(n_ctx=64))) as c:
        assert c.post("/v1/completions", json={"prompt": "x" * 63, "max_tokens": 1}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x" * 64, "max_tokens": 1}).status_code == 400


def test_tools_and_calls_are_rendered_by_the_tool_syntax(client, fake_model):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object", "properties": {}}}}]
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"c\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}]
    r = client.post("/v1/chat/completions", json={"messages": history, "tools": tools, "tool_choice": "auto",
                                                  "max_tokens": 1})
    assert r.status_code == 200
    prompt = fake_model.rendered[-1]
    assert '{"type": "function", "function": {"name": "get_weather"' in prompt.split("<|im_start|>user")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"c": 1}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt


def test_developer_role_and_content_parts(client, fake_model):
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_tokens": 1})
    assert r.status_code == 200
    assert fake_model.rendered[-1].startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nab")


def test_sampling_with_seed_is_reproducible(client):
    body = {"messages": USER, "temperature": 1.5, "seed": 7, "max_tokens": 8, "top_p": 0.9, "top_k": 5, "min_p": 0.01}
    a = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    b = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert a == b


def test_inference_failure_is_a_500_json_error_and_the_server_survives():
    calls = {"n": 0}

    def reply(prompt: str) -> str:
        calls["n"] += 1
        if "boom" in prompt:
            raise RuntimeError("kaput")
        return "fine"

    with TestClient(fake_app(FakeModel(reply=reply)), raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "boom"}]})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "inference_failed"
        assert "kaput" not in r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "boom"}], "stream": True})
        events = sse_payloads(r.text)
        assert events[-1]["error"]["code"] == "inference_failed"
        assert "[DONE]" not in events
        ok = c.post("/v1/chat/completions", json={"messages": USER})
        assert ok.json()["choices"][0]["message"]["content"] == "fine"


def test_models_health_and_model_lookup(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "fake-model" and card["context_length"] == 1024
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"] == "fake-model"


def test_models_list_the_files_sha256_and_how_usage_counts_tokens(client, tmp_path):
    import hashlib
    import time

    meta = client.get("/v1/models").json()["data"][0]["meta"]
    assert meta["sha256"] is None and meta["completion_tokens_include_eos"] is True  # no file behind the fake
    gguf = tmp_path / "weights.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 9000)
    with TestClient(fake_app(FakeModel(path=str(gguf)))) as c:
        deadline = time.monotonic() + 10
        while (meta := c.get("/v1/models").json()["data"][0]["meta"])["sha256"] is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert c.get("/v1/models/fake-model").json()["meta"]["sha256"] == meta["sha256"]
    assert meta["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest() and meta["path"] == "weights.gguf"


def test_unknown_endpoint_and_method(client):
    r = client.post("/v1/nope", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_body_over_limit_is_413():
    with TestClient(fake_app(max_body_mb=0.01)) as c:
        big = {"messages": [{"role": "user", "content": "x" * 20000}]}
        r = c.post("/v1/chat/completions", json=big)
        assert r.status_code == 413
        assert "limit" in r.json()["error"]["message"]
        r = c.post("/v1/messages", json={"max_tokens": 1, **big})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        assert c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).status_code == 200


def test_cors_preflight_only_when_enabled():
    headers = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "content-type,authorization"}
    with TestClient(fake_app(cors=("http://example.com",))) as c:
        r = c.options("/v1/chat/completions", headers=headers)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://example.com"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = c.get("/v1/models", headers={"Origin": "http://example.com"})
        assert r.headers["access-control-allow-origin"] == "http://example.com"
        # Origins that were not named get no CORS headers, so their pages cannot read answers.
        assert c.options("/v1/chat/completions", headers={**headers, "Origin": "http://evil.example"}).status_code == 400
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": "http://evil.example"}).headers
    with TestClient(fake_app(cors=("*",), api_key="k")) as c:
        # Any origin together with a key: the preflight needs none, the request does.
        r = c.options("/v1/chat/completions", headers=headers)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = c.get("/v1/models", headers={"Origin": "http://example.com"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        r = c.get("/v1/models", headers={"Origin": "http://example.com", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    with TestClient(fake_app()) as c:
        assert c.options("/v1/chat/completions", headers=headers).status_code == 405
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": "http://x"}).headers


def test_openapi_document_describes_the_request_bodies(client):
    doc = client.get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        name = ref.rsplit("/", 1)[1]
        assert name in doc["components"]["schemas"]
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    assert doc["components"]["schemas"]["MessagesRequest"]["required"] == ["max_tokens", "messages"]
