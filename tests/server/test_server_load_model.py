"""ds4-server under load: 16 streaming clients on the three chat APIs against a real server
process with the embedded model, for a bounded time.

The clients are the official SDKs (OpenAI Chat Completions and Responses, Anthropic Messages),
each request streamed with a few tokens. Every request must succeed and every stream must end
with its final event; the server's resident memory (VmRSS from /proc) may grow by at most
`RSS_GROWTH_MIB` over the load. No timing is asserted beyond a generous overall timeout: the
machine may be busy with other work.
"""
from __future__ import annotations

import threading
import time

import anthropic
import openai
import pytest

from server_support import model_server_process

pytestmark = [pytest.mark.model, pytest.mark.slow]

CLIENTS = 16
LOAD_S = 15.0
# Measured with tests/server/measure_rss_rounds.py and this test (docs/server.md, "Hostile requests and
# model files"): the server's RSS settles within the first requests and grows by a few MiB
# afterwards; the bound leaves room for allocator noise on a busy machine.
RSS_GROWTH_MIB = 96


@pytest.fixture(scope="module")
def server():
    with model_server_process("--ctx", "1024", "--log-level", "warning") as srv:
        yield srv


def chat_stream(base: str, i: int) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    finish = None
    for chunk in client.chat.completions.create(model="x", stream=True, max_tokens=6, temperature=0.7, seed=i,
                                                messages=[{"role": "user", "content": f"Count to {i % 9 + 2}."}]):
        if chunk.choices and chunk.choices[0].finish_reason is not None:
            finish = chunk.choices[0].finish_reason
    assert finish in ("stop", "length"), finish


def messages_stream(base: str, i: int) -> None:
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    events = [e.type for e in client.messages.create(
        model="x", max_tokens=6, stream=True, extra_body={"temperature": 0.7},
        messages=[{"role": "user", "content": f"Name a color, {i}."}])]
    assert events[0] == "message_start" and events[-1] == "message_stop", events


def responses_stream(base: str, i: int) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    events = [e.type for e in client.responses.create(model="x", stream=True, max_output_tokens=6,
                                                      input=f"Say hello {i}.")]
    # The final event: `response.incomplete` when the token limit ended it.
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete"), events


APIS = (chat_stream, messages_stream, responses_stream)


def test_sixteen_streaming_clients_on_three_apis(server):
    for api in APIS:  # the first requests of each kind set up what later ones reuse
        api(server.base, 0)
    before = server.rss_kib()
    deadline = time.monotonic() + LOAD_S
    done: list[str] = []
    errors: list[str] = []

    def client(k: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            api = APIS[(k + n) % len(APIS)]
            try:
                api(server.base, k * 1000 + n)
                done.append(api.__name__)
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                errors.append(f"client {k}, {api.__name__}: {type(e).__name__}: {e}")
            n += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0) + 120)
    assert not any(t.is_alive() for t in threads), "clients still waiting 120 s after the load ended"
    grown_mib = (server.rss_kib() - before) / 1024
    assert errors == []
    assert {name for name in done} == {api.__name__ for api in APIS}, done
    assert len(done) >= CLIENTS  # every client finished at least one request
    assert grown_mib < RSS_GROWTH_MIB, f"RSS grew {grown_mib:.0f} MiB over {len(done)} requests"
    status, _ = server.get("/health", timeout=30)
    assert status == 200
    print(f"{len(done)} streamed requests, RSS {before / 1024:.0f} -> {server.rss_kib() / 1024:.0f} MiB")
