"""End to end against the embedded model: official SDKs as clients, raw sockets for
disconnects and keepalives. Needs the weights (`-m model`)."""

from __future__ import annotations

import json
import time

import anthropic
import openai
import pytest

from server_support import live_server, raw_request
from server.app import create_app
from server.config import ServerConfig
from test_server_streaming import read_until

pytestmark = pytest.mark.model

HI = [{"role": "user", "content": "Name three primary colors."}]


@pytest.fixture(scope="module")
def model():
    from engine import load_model
    return load_model()


@pytest.fixture(scope="module")
def server(model):
    with live_server(create_app(model, ServerConfig(keepalive_sec=0.2))) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0)


def long_prompt(model, n_tokens: int, tag: str = "") -> str:
    """About n_tokens of filler; a distinct tag up front defeats prefix reuse between tests."""
    words = "the quick brown fox jumps over the lazy dog and keeps running through the field "
    text = tag + " " + words * (n_tokens // 10)
    while len(model.tokenize(text)) > n_tokens:
        text = text[: int(len(text) * 0.95)]
    return text


def test_models_endpoint_reports_the_loaded_model(oai, model):
    (card,) = list(oai.models.list())
    assert card.id == model.name
    assert card.model_dump()["context_length"] == model.n_ctx


def test_chat_greedy_streaming_equals_non_streaming(oai, model):
    out = oai.chat.completions.create(model="x", messages=HI, temperature=0, max_tokens=24)
    text = out.choices[0].message.content
    assert text.strip()
    assert out.choices[0].finish_reason in ("stop", "length")
    expected_prompt = len(model.tokenize(model.render_chat(HI), special=True))
    assert out.usage.prompt_tokens == expected_prompt
    stream = oai.chat.completions.create(model="x", messages=HI, temperature=0, max_tokens=24, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert usage.completion_tokens == out.usage.completion_tokens
    # Same prompt again: everything but the last prompt token comes from the KV cache.
    assert usage.prompt_tokens_details.cached_tokens >= expected_prompt - 1


def test_completions_and_logprobs(oai):
    out = oai.completions.create(model="x", prompt="The capital of France is", max_tokens=5, temperature=0,
                                 logprobs=2)
    choice = out.choices[0]
    assert choice.text
    assert len(choice.logprobs.tokens) == out.usage.completion_tokens
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)


def test_ignore_eos_gives_exactly_max_tokens(oai):
    out = oai.chat.completions.create(model="x", messages=HI, temperature=0, max_tokens=40,
                                      extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 40
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="x", messages=HI, max_tokens=4, extra_body={"ignore_eos": True})


def test_anthropic_sdk(claude, oai):
    msg = claude.messages.create(model="x", max_tokens=24, messages=HI, extra_body={"temperature": 0})
    assert msg.content[0].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(model="x", max_tokens=24, messages=HI, extra_body={"temperature": 0}) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == msg.content[0].text
    assert final.usage.cache_read_input_tokens > 0
    greedy = oai.chat.completions.create(model="x", messages=HI, temperature=0, max_tokens=24)
    assert greedy.choices[0].message.content == msg.content[0].text


def test_responses_sdk(oai):
    resp = oai.responses.create(model="x", input=HI[0]["content"], instructions="Answer briefly.",
                                temperature=0, max_output_tokens=24)
    assert resp.output_text.strip()
    text = ""
    for event in oai.responses.create(model="x", input=HI[0]["content"], instructions="Answer briefly.",
                                      temperature=0, max_output_tokens=24, stream=True):
        if event.type == "response.output_text.delta":
            text += event.delta
    assert text == resp.output_text


def test_context_length_exceeded_with_the_real_tokenizer(oai, model):
    text = long_prompt(model, model.n_ctx + 200, "overflow") + " more" * 400
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="x", messages=[{"role": "user", "content": text}], max_tokens=1)
    body = err.value.body
    assert body["code"] == "context_length_exceeded"
    assert body["n_ctx"] == model.n_ctx and body["n_prompt_tokens"] >= model.n_ctx


def test_keepalive_during_a_real_prefill(server, model):
    body = json.dumps({"messages": [{"role": "user", "content": long_prompt(model, 600, "keepalive")}],
                       "stream": True, "max_tokens": 2, "temperature": 0}).encode()
    sock = raw_request(server.port, "POST", "/v1/chat/completions", body)
    data = read_until(sock, b"data: [DONE]", 120)
    sock.close()
    stream = data.partition(b"\r\n\r\n")[2]
    before_text = stream.split(b'"delta":{"content":')[0]
    assert before_text.count(b": prefill\n\n") >= 1
    assert b"data: [DONE]\n\n" in stream


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_disconnect_to_cancel_under_200ms(server, model, phase):
    worker = server.worker
    # Let the previous test's job be recorded first, then watch for a newer one.
    deadline = time.monotonic() + 30
    while (worker.busy or worker.queue_depth) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    last_id = worker.finished[-1].job_id if worker.finished else 0
    if phase == "prefill":
        content, marker = long_prompt(model, 2000, "cancel"), b"data: "
    else:
        content, marker = "Write a long story about a dragon.", b'"content":"'
    body = json.dumps({"messages": [{"role": "user", "content": content}], "stream": True,
                       "max_tokens": 2000, "temperature": 0, "ignore_eos": True}).encode()
    sock = raw_request(server.port, "POST", "/v1/chat/completions", body)
    read_until(sock, marker, 60)
    if phase == "decode":
        read_until(sock, b'"content":"', 60)
    else:
        time.sleep(0.5)
    t0 = time.monotonic()
    sock.close()
    stats = worker.wait_finished(last_id + 1, 30)
    assert stats is not None
    latency = stats.finished_at - t0
    print(f"{phase}: disconnect -> cancel {latency * 1000:.0f} ms (generated {stats.n_generated})")
    assert stats.status == "cancelled"
    if phase == "prefill":
        assert stats.first_token_at is None
    # The server notices the disconnect at once; the worker stops at the engine's next safe
    # point: the next decode step, or (during prefill) the next layer of the current chunk.
    assert stats.cancel_requested_at - t0 < 0.05
    print(f"{phase}: longest prefill chunk {stats.longest_prefill_chunk_s * 1000:.0f} ms")
    assert latency < 0.2, f"disconnect -> cancel took {latency * 1000:.0f} ms"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


def _check_openai_message(message, finish):
    assert finish in ("stop", "length", "tool_calls")
    assert (finish == "tool_calls") == bool(message.tool_calls)
    for call in message.tool_calls or []:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name
        assert isinstance(json.loads(call.function.arguments), dict)


def test_tool_requests_render_and_run_in_every_api(server, oai, claude):
    # The embedded model (SmolLM2) writes hermes calls; it may or may not call the tool: check the pipeline.
    assert server.app.state.tools.syntax.name == "hermes"
    plain = oai.chat.completions.create(model="x", messages=ASK_WEATHER, temperature=0, max_tokens=1)
    out = oai.chat.completions.create(model="x", messages=ASK_WEATHER, tools=[WEATHER_TOOL], temperature=0,
                                      max_tokens=48)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the rendered definitions
    _check_openai_message(out.choices[0].message, out.choices[0].finish_reason)

    chunks = list(oai.chat.completions.create(model="x", messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                              temperature=0, max_tokens=48, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert text == (out.choices[0].message.content or "")
    assert [tc.function.name for tc in calls] == [c.function.name for c in out.choices[0].message.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason

    msg = claude.messages.create(model="x", max_tokens=48, messages=ASK_WEATHER, extra_body={"temperature": 0},
                                 tools=[{"name": "get_weather", "description": "Current weather of a city",
                                         "input_schema": WEATHER_TOOL["function"]["parameters"]}])
    assert {b.type for b in msg.content} <= {"text", "tool_use"}
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert (msg.stop_reason == "tool_use") == any(b.type == "tool_use" for b in msg.content)

    resp = oai.responses.create(model="x", input=ASK_WEATHER[0]["content"], temperature=0, max_output_tokens=48,
                                tools=[{"type": "function", "name": "get_weather",
                                        "parameters": WEATHER_TOOL["function"]["parameters"]}])
    assert {item.type for item in resp.output} <= {"message", "function_call"}
    assert resp.status in ("completed", "incomplete")


def test_a_tool_result_turn_runs_on_the_real_template(server, oai):
    memory = server.app.state.tools.memory
    missing = memory.stats()["missing"]
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_from_elsewhere", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_from_elsewhere", "content": "sunny, 21 C"}]
    out = oai.chat.completions.create(model="x", messages=history, tools=[WEATHER_TOOL], temperature=0,
                                      max_tokens=24)
    _check_openai_message(out.choices[0].message, out.choices[0].finish_reason)
    assert memory.stats()["missing"] == missing + 1


def test_required_tool_choice_makes_the_model_call(oai, claude):
    # Asked about colors, the model answers in prose; forced, it must still write a parseable call.
    free = oai.chat.completions.create(model="x", messages=HI, tools=[WEATHER_TOOL], temperature=0, max_tokens=12)
    assert not free.choices[0].message.tool_calls
    out = oai.chat.completions.create(model="x", messages=HI, tools=[WEATHER_TOOL], temperature=0, max_tokens=64,
                                      tool_choice="required", parallel_tool_calls=False)
    assert out.choices[0].finish_reason == "tool_calls"
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    msg = claude.messages.create(model="x", max_tokens=64, messages=HI, extra_body={"temperature": 0},
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 tools=[{"name": "get_weather", "description": "Current weather of a city",
                                         "input_schema": WEATHER_TOOL["function"]["parameters"]}])
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]


COLORS = {"type": "object", "properties": {"colors": {"type": "array", "maxItems": 3, "items": {
    "enum": ["red", "yellow", "blue", "green"]}}}, "required": ["colors"], "additionalProperties": False}


def test_response_format_json_schema_on_the_model(oai):
    jsonschema = pytest.importorskip("jsonschema")
    out = oai.chat.completions.create(model="x", messages=HI, temperature=0, max_tokens=48, response_format={
        "type": "json_schema", "json_schema": {"name": "colors", "schema": COLORS}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), COLORS)


def test_command_line_server_starts_prints_banner_and_serves(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from server_support import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "--port", str(port), "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "listening on" in line:
                break
        banner = "".join(lines)
        assert f"listening on http://127.0.0.1:{port}" in banner
        assert "memory" in banner and "MiB" in banner and "model" in banner
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    assert json.load(r)["status"] == "ok"
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("server did not answer /health")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
