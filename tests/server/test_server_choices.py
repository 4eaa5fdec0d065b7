"""n > 1 and several prompts: one job per choice, merged by index (server.choices).

Logic over the fake engine; sampling, batching and the real SDK on the embedded model
(`-m model`, few tokens each)."""

from __future__ import annotations

import json

import openai
import pytest

from server.app import create_app
from server.choices import fan_out, total_usage
from server.config import ServerConfig
from server.jobs import GenerationRequest, SamplingSpec, Usage
from server_fake_engine import DEFAULT_REPLY
from server_support import fake_app, live_server

USER = [{"role": "user", "content": "hi"}]


def sse_objects(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_fan_out_gives_choice_i_the_seed_plus_i():
    gen = GenerationRequest("p", (1, 2), 4, sampling=SamplingSpec(seed=2**63 - 1))
    assert [g.sampling.seed for g in fan_out(gen, 3)] == [2**63 - 1, 0, 1]
    unseeded = GenerationRequest("p", (1,), 4)
    assert fan_out(unseeded, 2) == [unseeded, unseeded]


def test_total_usage_counts_each_prompt_once_and_every_completion():
    usages = [Usage(10, 3, 0), Usage(10, 4, 9), Usage(5, 1, 0), Usage(5, 2, 4)]
    assert total_usage(usages, 2) == Usage(15, 10, 0, 0)


def test_chat_with_n_answers_n_choices_and_sums_the_completions(client):
    body = client.post("/v1/chat/completions", json={"messages": USER, "n": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in body["choices"]} == {DEFAULT_REPLY}
    one = client.post("/v1/chat/completions", json={"messages": USER}).json()["usage"]
    assert body["usage"]["prompt_tokens"] == one["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 3 * one["completion_tokens"]


def test_prompts_times_n_come_back_prompt_major(client):
    body = client.post("/v1/completions", json={"prompt": ["ab", "xyz"], "n": 2, "echo": True,
                                                "max_tokens": 1, "temperature": 0}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["abH", "abH", "xyzH", "xyzH"]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER, "n": 2, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "ab", "n": 2, "stream": True, "stream_options": {"include_usage": True}}),
])
def test_a_stream_with_n_carries_every_index_and_one_usage(client, path, body):
    chunks = sse_objects(client.post(path, json=body).text)
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] > 0


def test_ds4_eval_repeats_go_to_ds4_server_as_one_request_with_n():
    from ds4eval.run.backends.openai_backend import OpenAIBackend
    from ds4eval.cases.case import parse_case
    from ds4eval.config import EvalConfig
    from ds4eval.run.runner import Runner

    cases = [parse_case({"source": "toy", "id": name, "question": f"[{name}] what?", "answer": "4",
                         "answer_kind": "integer"}) for name in ("a", "b")]
    with live_server(fake_app()) as srv:
        cfg = EvalConfig(backend="openai", urls=(srv.base,), served_model="m", repeats=2, temperature=0.7, seed=3)
        backend = OpenAIBackend(cfg)
        states = Runner(cfg, cases, backend).run()
        backend.close()
        jobs = list(srv.worker.finished)
    # n was taken: the backend never fell back to one request per repeat.
    assert backend.n_supported is True
    assert len(states) == 4 and all(s.output == DEFAULT_REPLY for s in states)
    assert len(jobs) == 4


# --- the embedded model --------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    from engine import load_model
    return load_model()


@pytest.fixture(scope="module", params=[1, 2], ids=["serial", "batched2"])
def oai(request, model):
    with live_server(create_app(model, ServerConfig(batched_session=request.param))) as srv:
        yield openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)


ASK = [{"role": "user", "content": "Write a word."}]


@pytest.mark.model
def test_seeded_samples_differ_and_reproduce(oai):
    kw = dict(model="m", messages=ASK, n=3, temperature=0.8, seed=5, max_tokens=6)
    out = oai.chat.completions.create(**kw)
    texts = [c.message.content for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert [c.message.content for c in oai.chat.completions.create(**kw).choices] == texts
    # Choice i samples from seed + i: choice 1 of seed 5 is choice 0 of seed 6.
    kw.update(n=1, seed=6)
    assert oai.chat.completions.create(**kw).choices[0].message.content == texts[1]
    assert 3 <= out.usage.completion_tokens <= 18


@pytest.mark.model
def test_greedy_choices_are_identical_and_usage_counts_them_all(oai):
    out = oai.completions.create(model="m", prompt="The sky is", n=2, temperature=0, max_tokens=5)
    assert out.choices[0].text == out.choices[1].text
    one = oai.completions.create(model="m", prompt="The sky is", temperature=0, max_tokens=5)
    assert out.choices[0].text == one.choices[0].text
    assert out.usage.prompt_tokens == one.usage.prompt_tokens
    assert out.usage.completion_tokens == 2 * one.usage.completion_tokens


@pytest.mark.model
def test_streaming_n2_gives_both_indices(oai):
    stream = oai.chat.completions.create(model="m", messages=ASK, n=2, temperature=0.8, seed=1, max_tokens=4,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
    assert all(text.values())
    assert chunks[-1].usage.completion_tokens >= 2


def test_batched_choices_prefill_the_prompt_once_and_match_the_serial_loop(tiny_model, caplog):
    """With --batched-session the n choices of a prompt share its prefill: the first choice
    computes it, the others copy its keys and values; the outputs equal the serial loop's."""
    import logging

    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import ServerConfig
    from server_support import TEST_CLIENT_HOST

    prompt = [(5 * i + 11) % 200 + 1 for i in range(80)]
    body = {"prompt": prompt, "n": 3, "max_tokens": 6, "temperature": 0}
    with TestClient(create_app(tiny_model, ServerConfig(allowed_hosts=(TEST_CLIENT_HOST,)))) as c:
        serial = c.post("/v1/completions", json=body | {"n": 1}).json()["choices"][0]["text"]
    with caplog.at_level(logging.INFO, logger="ds4.server.batching"), \
            TestClient(create_app(tiny_model, ServerConfig(batched_session=3, allowed_hosts=(TEST_CLIENT_HOST,)))) as c:
        r = c.post("/v1/completions", json=body).json()
    assert [ch["text"] for ch in r["choices"]] == [serial] * 3
    copies = [m for m in caplog.messages if "copied" in m]
    assert len(copies) == 2 and all("copied 79 prompt tokens" in m for m in copies), caplog.messages
