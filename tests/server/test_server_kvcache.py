"""The disk KV cache wired into ds4-server: restart restores, evict/shutdown saves, usage fields.

Fast tests run tiny random GGUF models (`engine.synthetic`) with a small save policy, so a
prompt of a couple hundred tokens is worth a checkpoint; one test runs the embedded model
with the server's own thresholds.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server import kvstore as kv
from server.app import create_app
from server.config import ServerConfig
from server.kvstore import KVStoreConfig
from server.kvstore_policy import COLD, EVICT, SHUTDOWN, SavePolicy
from server.prompting import ToolCalling, last_user_head
from server.tools import Message
from server_fake_engine import FakeModel
from server_support import TEST_CLIENT_HOST

SMALL = SavePolicy(trim=4, align=16, interval=64, min_tokens=16, min_gain=8)
SYSTEM = "You answer questions about the weather, briefly and politely. " * 2


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    from engine.synthetic import RandomModelSpec, write_random_gguf
    return str(write_random_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", RandomModelSpec(n_ctx=320, seed=11)))


def load(path: str):
    from engine import load_model
    return load_model(path)


def app_on(model, directory: Path, policy: SavePolicy | None = SMALL, **config):
    config.setdefault("allowed_hosts", (TEST_CLIENT_HOST,))
    return create_app(model, ServerConfig(kv=KVStoreConfig(directory=str(directory)), **config),
                      kv_save_policy=policy)


def chat_body(user: str, max_tokens: int = 6, **extra) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, **extra}


def messages_body(user: str, max_tokens: int = 6) -> dict:
    return {"system": SYSTEM, "messages": [{"role": "user", "content": user}], "max_tokens": max_tokens,
            "temperature": 0}


def reasons(directory: Path, model) -> list[tuple[str, int]]:
    store = kv.KVStore(directory, kv.identity_of(model), 10**9)
    return sorted((e.reason, e.n_tokens) for e in store.entries())


def test_restart_with_the_same_directory_restores_the_prompt(tiny_path, tmp_path):
    d = tmp_path / "kv"
    m1 = load(tiny_path)
    with TestClient(app_on(m1, d)) as c:
        first = c.post("/v1/messages", json=messages_body("Will it rain tomorrow?"))
        assert first.status_code == 200, first.text
        u1 = first.json()["usage"]
        # A cold prefill: nothing read, the checkpoint at the user turn (and the frontier
        # before it) newly written.
        assert u1["cache_read_input_tokens"] == 0 and u1["cache_creation_input_tokens"] > 0
        n_prompt = u1["input_tokens"] + u1["cache_creation_input_tokens"]
        health = c.get("/health").json()["kv_cache"]
        assert health["writes"] >= 1 and health["directory"] == d.name
    # The clean shutdown stored the live session, prompt plus reply.
    saved = reasons(d, m1)
    assert any(r == SHUTDOWN and n > n_prompt for r, n in saved), saved
    assert any(r == COLD for r, _ in saved)

    # A new server process: another model object, another app, the same directory.
    m2 = load(tiny_path)
    with TestClient(app_on(m2, d)) as c:
        again = c.post("/v1/chat/completions", json=chat_body("Will it rain tomorrow?"))
        assert again.status_code == 200, again.text
        body = again.json()
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert body["usage"]["prompt_tokens"] == n_prompt
        # The shutdown checkpoint ends past the prompt; the longest checkpoint that prefixes
        # this prompt is the user-turn one, at least.
        assert 16 <= cached < n_prompt
        assert c.get("/health").json()["kv_cache"]["hits"] == 1
        # Restored KV decodes exactly like a cold prefill: the same greedy reply.
        assert body["choices"][0]["message"]["content"] == first.json()["content"][0]["text"]
        resp = c.post("/v1/responses", json={"instructions": SYSTEM, "input": "Is it sunny?",
                                             "max_output_tokens": 4, "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_a_different_prompt_saves_the_replaced_session(tiny_path, tmp_path):
    d = tmp_path / "kv"
    m = load(tiny_path)
    with TestClient(app_on(m, d)) as c:
        assert c.post("/v1/chat/completions", json=chat_body("Will it rain tomorrow?")).status_code == 200
        other = {"messages": [{"role": "user", "content": "Something else entirely, about trains " * 3}],
                 "max_tokens": 3, "temperature": 0}
        r = c.post("/v1/chat/completions", json=other)
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < 10
        assert [r for r, _ in reasons(d, m)].count(EVICT) == 1
        # Back to the first conversation: restored from the evict checkpoint, not recomputed.
        back = c.post("/v1/chat/completions", json=chat_body("Will it rain tomorrow?"))
        assert back.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 16


@pytest.fixture(scope="module")
def tiny_1k_path(tmp_path_factory) -> str:
    """A context four times the cache's first capacity, so that prefills grow it."""
    from engine.synthetic import RandomModelSpec, write_random_gguf
    return str(write_random_gguf(tmp_path_factory.mktemp("gguf") / "tiny1k.gguf",
                                 RandomModelSpec(n_ctx=1024, seed=12)))


@pytest.mark.parametrize("slots", [1, 2], ids=["serial", "batched"])
def test_a_restore_after_a_prefill_grew_the_cache_decodes_like_a_cold_prefill(tiny_1k_path, tmp_path, slots):
    """The reported 500: after a restart, request A restores a short checkpoint and its prefill
    grows the cache (inside inference mode); request B then restores its own checkpoint into
    that memory. B must answer 200 with exactly the reply of its cold prefill, on the serial
    loop and on the batched one (a pool slot)."""
    d = tmp_path / "kv"
    policy = SavePolicy(trim=4, align=16, interval=4096, min_tokens=16, min_gain=8)
    system_a = " ".join(f"Rule {i} is brief." for i in range(20))  # a checkpoint of ~300 tokens
    system_b = " ".join(f"Fact {i} holds here." for i in range(36))  # ~700 tokens
    question = " ".join(f"part {i} of a long question;" for i in range(16))  # ~400 tokens

    def body(system: str, user: str) -> dict:
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}

    with TestClient(app_on(load(tiny_1k_path), d, policy, batched_session=slots)) as c:
        assert c.post("/v1/chat/completions", json=body(system_a, "Hi.")).status_code == 200
        cold = c.post("/v1/chat/completions", json=body(system_b, "Go on."))
        assert cold.status_code == 200, cold.text
        assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < 16  # the template's head
    with TestClient(app_on(load(tiny_1k_path), d, policy, batched_session=slots)) as c:
        grown = c.post("/v1/chat/completions", json=body(system_a, question))
        assert grown.status_code == 200, grown.text
        usage = grown.json()["usage"]
        assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= 512 < usage["prompt_tokens"]
        restored = c.post("/v1/chat/completions", json=body(system_b, "Go on."))
        assert restored.status_code == 200, restored.text
        assert restored.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 512
    assert restored.json()["choices"] == cold.json()["choices"]


def test_without_a_directory_the_server_has_no_disk_cache(tiny_path):
    with TestClient(create_app(load(tiny_path), ServerConfig(allowed_hosts=(TEST_CLIENT_HOST,)))) as c:
        assert c.get("/health").json()["kv_cache"] is None
        r = c.post("/v1/messages", json=messages_body("hi"))
        assert r.json()["usage"]["cache_creation_input_tokens"] == 0


def test_user_boundary_is_where_the_last_user_turn_starts():
    model = FakeModel()
    calling = ToolCalling("hermes")
    msgs = [Message(role="system", content="sys"), Message(role="user", content="one"),
            Message(role="assistant", content="two"), Message(role="user", content="three")]
    prompt = calling.render(model, msgs)
    assert prompt.user_boundary == prompt.text.rindex("<|im_start|>user")
    assert model.rendered[-1] == prompt.text
    only = calling.render(model, [Message(role="user", content="alone")])
    assert only.user_boundary is None
    assert last_user_head(model, [{"role": "user", "content": "x"}]) is None


@pytest.mark.model
@pytest.mark.slow  # the fast restore tests above keep the default run's coverage
def test_embedded_model_restart_restores_a_long_prompt(tmp_path):
    from engine import load_model
    d = tmp_path / "kv"
    system = " ".join(f"Rule {i}: keep the answer short and mention the number {i}." for i in range(160))
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0}
    with TestClient(app_on(load_model(ctx=4096), d, policy=None)) as c:
        first = c.post("/v1/chat/completions", json=body).json()
        assert first["usage"]["prompt_tokens"] > 2048
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    with TestClient(app_on(load_model(ctx=4096), d, policy=None)) as c:
        again = c.post("/v1/chat/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2048
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_a_real_ds4_server_saves_its_session_on_sigint(tmp_path):
    """uvicorn runs the app's lifespan shutdown on SIGINT: the worker's shutdown save is reached."""
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from engine.synthetic import RandomModelSpec, write_random_gguf
    from server_support import free_port

    model = write_random_gguf(tmp_path / "tiny.gguf", RandomModelSpec(n_ctx=4096, seed=3))
    d, port = tmp_path / "kv", free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "--model", str(model), "--port", str(port),
                             "--kv-disk-dir", str(d), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "ds4-server did not start"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        # Long enough for the server's own policy (2048 tokens), with a reply that adds more
        # than its minimum gain, so the shutdown checkpoint is worth writing.
        system = " ".join(f"rule {i} is short." for i in range(120))
        r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "go"}],
            "max_tokens": 600, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        n_prompt = r.json()["usage"]["prompt_tokens"]
        assert n_prompt >= 2048
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    saved = reasons(d, load(str(model)))
    assert (SHUTDOWN, n_prompt + 599) in saved, saved
