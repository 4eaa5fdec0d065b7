"""Live-server behaviour over real sockets: keepalives, disconnect cancellation, FIFO, SDK.

A uvicorn server runs in a thread on a free loopback port around a slow fake engine;
raw sockets let the tests read comments byte by byte and hang up at chosen moments.
"""

from __future__ import annotations

import json
import socket
import time

import openai

from server_support import fake_app, live_server, raw_request
from server_fake_engine import DEFAULT_REPLY, FakeModel

LONG_USER = [{"role": "user", "content": "x" * 200}]  # ~220 prompt tokens


def read_until(sock: socket.socket, marker: bytes, limit_s: float = 10.0) -> bytes:
    data = b""
    deadline = time.monotonic() + limit_s
    while marker not in data:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def wait_for_stats(worker, n: int, limit_s: float = 5.0):
    deadline = time.monotonic() + limit_s
    while len(worker.finished) < n and time.monotonic() < deadline:
        time.sleep(0.002)
    return list(worker.finished)


def test_keepalive_comments_during_a_long_prefill():
    model = FakeModel(prefill_chunk=4, prefill_delay=0.02)   # ~55 chunks, ~1.1 s
    with live_server(fake_app(model, keepalive_sec=0.15)) as srv:
        body = json.dumps({"messages": LONG_USER, "stream": True, "max_tokens": 3}).encode()
        sock = raw_request(srv.port, "POST", "/v1/chat/completions", body)
        data = read_until(sock, b"data: [DONE]")
        sock.close()
    head, _, stream = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    assert b"text/event-stream" in head
    before_text = stream.split(b'"content":"H"')[0]
    assert before_text.count(b": prefill\n\n") >= 4
    after_text = stream.split(b'"content":"H"')[1]
    assert b": prefill" not in after_text
    assert b"data: [DONE]\n\n" in stream


def test_keepalive_also_for_anthropic_before_message_start():
    model = FakeModel(prefill_chunk=4, prefill_delay=0.02)
    with live_server(fake_app(model, keepalive_sec=0.15)) as srv:
        body = json.dumps({"messages": LONG_USER, "stream": True, "max_tokens": 3}).encode()
        sock = raw_request(srv.port, "POST", "/v1/messages", body)
        data = read_until(sock, b"event: message_stop")
        sock.close()
    stream = data.partition(b"\r\n\r\n")[2]
    assert stream.split(b"event: message_start")[0].count(b": prefill\n\n") >= 4


def _cancel_latency(path: str, body: dict, hang_up_after: bytes | None, model: FakeModel) -> tuple[float, object]:
    with live_server(fake_app(model)) as srv:
        sock = raw_request(srv.port, "POST", path, json.dumps(body).encode())
        if hang_up_after is not None:
            read_until(sock, hang_up_after)
        else:
            time.sleep(0.3)   # non-streaming: nothing to read until the end
        # The first bytes can come before the loop takes the job (a loaded machine): hang up only
        # once it runs, since a queued job is dropped without a cancel latency to measure.
        deadline = time.monotonic() + 5
        while not srv.worker.busy and time.monotonic() < deadline:
            time.sleep(0.002)
        t0 = time.monotonic()
        sock.close()
        (stats,) = wait_for_stats(srv.worker, 1)
        latency = stats.finished_at - t0
        # The worker moves on: a following request is served at once.
        follow = raw_request(srv.port, "POST", "/v1/completions",
                             json.dumps({"prompt": "a", "max_tokens": 2}).encode())
        assert b" 200 " in read_until(follow, b"}}", 5.0).split(b"\r\n")[0]
        follow.close()
    return latency, stats


def test_disconnect_during_streamed_prefill_cancels_quickly():
    model = FakeModel(prefill_chunk=2, prefill_delay=0.02)   # ~2.2 s of prefill
    latency, stats = _cancel_latency("/v1/chat/completions",
                                     {"messages": LONG_USER, "stream": True}, b"data: ", model)
    assert stats.status == "cancelled"
    assert stats.first_token_at is None
    assert latency < 0.2, f"disconnect -> cancel took {latency * 1000:.0f} ms"
    assert stats.cancel_latency_s is not None and stats.cancel_latency_s < 0.2


def test_disconnect_during_streamed_decode_cancels_quickly():
    model = FakeModel(reply="y" * 1000, decode_delay=0.02)
    latency, stats = _cancel_latency("/v1/messages",
                                     {"messages": LONG_USER, "stream": True, "max_tokens": 1000},
                                     b"text_delta", model)
    assert stats.status == "cancelled"
    assert 0 < stats.n_generated < 200
    assert latency < 0.2, f"disconnect -> cancel took {latency * 1000:.0f} ms"


def test_disconnect_of_a_non_streaming_request_cancels_quickly():
    model = FakeModel(prefill_chunk=2, prefill_delay=0.02)
    latency, stats = _cancel_latency("/v1/responses", {"input": "x" * 200}, None, model)
    assert stats.status == "cancelled"
    assert latency < 0.2, f"disconnect -> cancel took {latency * 1000:.0f} ms"


def test_jobs_run_first_in_first_out_and_queued_cancels_are_skipped():
    model = FakeModel(prefill_chunk=8, prefill_delay=0.01)
    # One job at a time: the order of a queue (by default jobs of different requests interleave).
    with live_server(fake_app(model, interleave=1)) as srv:
        socks = []
        for i in range(3):
            body = {"prompt": f"{i}" * 200, "max_tokens": 2}
            socks.append(raw_request(srv.port, "POST", "/v1/completions", json.dumps(body).encode()))
            time.sleep(0.05)
        socks[1].close()   # still queued behind the first job
        replies = [read_until(socks[i], b"}}") for i in (0, 2)]
        socks[0].close()
        socks[2].close()
        stats = wait_for_stats(srv.worker, 3)
    assert all(b" 200 " in r.split(b"\r\n")[0] for r in replies)
    assert [s.job_id for s in stats] == sorted(s.job_id for s in stats)
    assert [s.status for s in stats] == ["done", "cancelled", "done"]
    assert stats[1].started_at is None


def test_concurrent_http_while_the_worker_is_busy():
    model = FakeModel(prefill_chunk=2, prefill_delay=0.02)
    with live_server(fake_app(model)) as srv:
        sock = raw_request(srv.port, "POST", "/v1/chat/completions",
                           json.dumps({"messages": LONG_USER, "max_tokens": 1}).encode())
        time.sleep(0.1)
        t0 = time.monotonic()
        health = raw_request(srv.port, "GET", "/health", b"")
        data = read_until(health, b"}")
        assert time.monotonic() - t0 < 0.5
        assert b'"busy":true' in data
        health.close()
        sock.close()


def test_openai_sdk_against_the_live_server():
    with live_server(fake_app()) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content == DEFAULT_REPLY
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == DEFAULT_REPLY
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        comp = client.completions.create(model="m", prompt="abc", max_tokens=5, temperature=0)
        assert comp.choices[0].text == DEFAULT_REPLY[:5]
        two = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
        assert [c.index for c in two.choices] == [0, 1]
        assert [c.message.content for c in two.choices] == [DEFAULT_REPLY] * 2
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=0)
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.param == "n"
        else:
            raise AssertionError("n=0 was accepted")
        models = client.models.list()
        assert [m.id for m in models] == ["fake-model"]


def test_sdks_parse_streams_that_carry_keepalive_comments():
    import anthropic

    model = FakeModel(prefill_chunk=4, prefill_delay=0.01)
    with live_server(fake_app(model, keepalive_sec=0.05)) as srv:
        oai = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        chunks = list(oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "a" * 150}],
                                                  stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == DEFAULT_REPLY
        claude = anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0)
        with claude.messages.stream(model="m", max_tokens=100,
                                    messages=[{"role": "user", "content": "b" * 150}]) as stream:
            assert "".join(stream.text_stream) == DEFAULT_REPLY


def test_a_failure_inside_the_stream_writer_ends_with_an_error_event(monkeypatch):
    import server.api_openai as api_openai

    def broken_deltas(events):
        raise RuntimeError("writer bug")

    monkeypatch.setattr(api_openai, "stream_deltas", broken_deltas)
    with live_server(fake_app()) as srv:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
        sock = raw_request(srv.port, "POST", "/v1/chat/completions", body)
        data = read_until(sock, b"internal error while streaming", 5)
        sock.close()
        (stats,) = wait_for_stats(srv.worker, 1)
    assert b" 200 " in data.split(b"\r\n")[0]
    assert b'"type":"server_error"' in data
    assert b"writer bug" not in data
    assert stats.status in ("cancelled", "done")


def _content_chunks(port: int) -> list[str]:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    sock = raw_request(port, "POST", "/v1/chat/completions", body)
    data = read_until(sock, b"data: [DONE]")
    sock.close()
    pieces = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:])["choices"]:
                if choice["delta"].get("content"):
                    pieces.append(choice["delta"]["content"])
    return pieces


def test_text_made_faster_than_the_stream_interval_goes_out_in_fewer_chunks():
    with live_server(fake_app(FakeModel(), stream_interval_ms=0)) as srv:
        every = _content_chunks(srv.port)
    with live_server(fake_app(FakeModel(), stream_interval_ms=500)) as srv:
        merged = _content_chunks(srv.port)
    with live_server(fake_app(FakeModel(decode_delay=0.02), stream_interval_ms=5)) as srv:
        slow = _content_chunks(srv.port)
    assert "".join(every) == "".join(merged) == "".join(slow) == DEFAULT_REPLY
    assert len(every) > 20  # a chunk per token
    assert len(merged) == 2  # the first token at once, the rest with the end of the generation
    assert slow == every  # tokens 20 ms apart: nothing held
