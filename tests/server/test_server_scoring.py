"""Prompt scoring on /v1/completions (echo + logprobs, max_tokens 0, prompt forms) and the
legacy logprobs form; over the fake engine, and over a tiny random model against the
engine's own log-softmax (serial and batched loops)."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from server.app import create_app
from server.config import ServerConfig
from server.jobs import TokenLogprob
from server.scoring import PromptScored, legacy_logprobs
from server_fake_engine import DEFAULT_REPLY
from server_support import TEST_CLIENT_HOST


def test_legacy_logprobs_put_a_null_first_and_offsets_across_prompt_and_reply():
    prompt = PromptScored(104, "h", (TokenLogprob(105, "i", -0.5, ((106, "j", -0.1),)),))
    out = legacy_logprobs(prompt, [TokenLogprob(33, "!", -2.0)], 2)
    assert out == {"tokens": ["h", "i", "!"], "token_logprobs": [None, -0.5, -2.0],
                   "top_logprobs": [None, {"j": -0.1, "i": -0.5}, {"!": -2.0}], "text_offset": [0, 1, 2]}
    ids = legacy_logprobs(prompt, [], 2, token_ids=True)
    assert ids["tokens"] == ["token_id:104", "token_id:105"]
    assert ids["top_logprobs"][1] == {"token_id:106": -0.1, "token_id:105": -0.5}


def test_echo_with_logprobs_scores_every_prompt_token(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"]
    assert lp["token_logprobs"][0] is None
    # The fake puts byte b + 1 first after byte b: "b" after "a" is the likeliest token.
    expected = float(torch.log_softmax(torch.tensor([30.0, 20.0] + [0.0] * 257, dtype=torch.float64), 0)[0])
    assert lp["token_logprobs"][1:] == pytest.approx([expected, expected])
    assert lp["top_logprobs"][0] is None and list(lp["top_logprobs"][1]) == ["b"]
    assert lp["text_offset"] == [0, 1, 2]
    assert r.json()["usage"]["completion_tokens"] == 0


def test_echo_with_logprobs_then_generation_appends_the_generated_tokens(client):
    body = client.post("/v1/completions", json={"prompt": [104, 105], "echo": True, "logprobs": 0,
                                                "max_tokens": 3, "temperature": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == "hi" + DEFAULT_REPLY[:3]
    assert choice["logprobs"]["tokens"] == ["h", "i", *DEFAULT_REPLY[:3]]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]
    # The prompt was computed in full for its scores: nothing counts as cached.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("prompt,texts", [
    (["ab", "cde"], ["ab", "cde"]),
    ([[104, 105], [111]], ["hi", "o"]),
])
def test_each_prompt_of_a_list_is_its_own_choice(client, prompt, texts):
    body = client.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1,
                                                "max_tokens": 0}).json()
    assert [c["index"] for c in body["choices"]] == list(range(len(texts)))
    assert [c["text"] for c in body["choices"]] == texts
    assert [len(c["logprobs"]["tokens"]) for c in body["choices"]] == [len(t) for t in texts]
    assert body["usage"]["prompt_tokens"] == sum(len(t) for t in texts)


def test_a_completion_ended_by_eos_lists_the_eos_entry_last(client, fake_model):
    body = client.post("/v1/completions", json={"prompt": "ab", "echo": True, "logprobs": 1, "max_tokens": 200,
                                                "temperature": 0}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == "ab" + DEFAULT_REPLY
    lp = choice["logprobs"]
    eos = fake_model.detokenize([fake_model.eos_id])
    # One entry per prompt token and one per generated token, the end-of-sequence one included.
    assert lp["tokens"] == ["a", "b", *DEFAULT_REPLY, eos]
    assert body["usage"]["completion_tokens"] == len(DEFAULT_REPLY) + 1
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(lp["tokens"])
    assert lp["text_offset"][-1] == len(choice["text"])
    assert lp["token_logprobs"][-1] < 0 and eos in lp["top_logprobs"][-1]


def test_a_streamed_completion_ended_by_eos_sends_the_eos_entry_with_the_finish(client, fake_model):
    r = client.post("/v1/completions", json={"prompt": "ab", "logprobs": 0, "max_tokens": 200,
                                             "temperature": 0, "stream": True})
    chunks = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    last = chunks[-1]
    assert last["finish_reason"] == "stop" and last["text"] == ""
    assert last["logprobs"]["tokens"] == [fake_model.detokenize([fake_model.eos_id])]
    assert last["logprobs"]["text_offset"] == [len(DEFAULT_REPLY)]
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks if c["logprobs"]) == len(DEFAULT_REPLY) + 1


def test_chat_logprobs_list_only_the_messages_tokens(client):
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "logprobs": True, "max_tokens": 200, "temperature": 0}).json()
    assert "".join(e["token"] for e in body["choices"][0]["logprobs"]["content"]) == DEFAULT_REPLY


def test_max_tokens_zero_without_echo_is_an_empty_completion(client):
    body = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0}).json()
    assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 0


def test_streamed_echo_carries_the_prompt_logprobs_first(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 2,
                                             "temperature": 0, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"] == "abc" and first["logprobs"]["tokens"] == ["a", "b", "c"]
    assert first["logprobs"]["token_logprobs"][0] is None
    later = [c["choices"][0] for c in chunks[1:] if c["choices"][0]["logprobs"]]
    assert later[0]["logprobs"]["text_offset"] == [3]


# --- a real forward pass (tiny random model) ------------------------------------------------

def engine_scores(model, ids: list[int]) -> list[float]:
    """The engine's own log-softmax of each prompt token after the first, in process."""
    session = model.new_session()
    logp = torch.log_softmax(session.extend_logits(ids[:-1]), dim=-1)
    return [float(logp[i, t]) for i, t in enumerate(ids[1:])]


@pytest.mark.parametrize("batched", [1, 2])
def test_prompt_logprobs_equal_the_engines_log_softmax(tiny_model, batched):
    ids = [(7 * i + 3) % tiny_model.n_vocab for i in range(1, 150)]  # longer than one prefill chunk
    with TestClient(create_app(tiny_model, ServerConfig(batched_session=batched, allowed_hosts=(TEST_CLIENT_HOST,)))) as c:
        # A first request fills the session, so the scored one cannot lean on an empty cache.
        c.post("/v1/completions", json={"prompt": ids[:20], "max_tokens": 2, "temperature": 0})
        r = c.post("/v1/completions", json={"prompt": [ids, ids[:40]], "echo": True, "logprobs": 2,
                                            "max_tokens": 1, "temperature": 0,
                                            "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        plain = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0}).json()
    long, short = r.json()["choices"]
    assert long["logprobs"]["token_logprobs"][0] is None
    assert long["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(engine_scores(tiny_model, ids), abs=1e-4)
    assert short["logprobs"]["token_logprobs"][1:40] == pytest.approx(engine_scores(tiny_model, ids[:40]), abs=1e-4)
    assert long["logprobs"]["tokens"][:2] == [f"token_id:{ids[0]}", f"token_id:{ids[1]}"]
    # Scoring first does not change what is generated after the prompt.
    assert long["text"].endswith(plain["choices"][0]["text"])


# --- lm-eval's loglikelihood request on the embedded model ----------------------------------

# Chat turns whose answers end the model's turn: after each, the model's greedy next token is
# end-of-sequence, the case where a dropped generated entry shifts the scored continuation.
TURN_QUESTION = "Name a primary colour. One word."
TURN_ANSWERS = ["Red", "Blue", "Green"]


@pytest.fixture(scope="module")
def embedded(embedded_path):
    from engine import load_model
    return load_model(embedded_path)


def lm_eval_request(prompt) -> dict:
    """What lm-eval's `local-completions` sends for loglikelihoods: context plus continuation,
    echoed and scored, one greedy token generated."""
    return {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}


@pytest.mark.model
@pytest.mark.parametrize("form,batched", [("text", 1), ("ids", 2), ("texts", 1), ("id lists", 2)])
def test_scoring_keeps_a_generated_eos_entry_on_every_prompt_form(embedded, form, batched):
    context = embedded.render_chat([{"role": "user", "content": TURN_QUESTION}])
    texts = [context + answer for answer in TURN_ANSWERS]
    ids = [embedded.tokenize(t, special=True) for t in texts]
    prompt = {"text": texts[0], "ids": ids[0], "texts": texts, "id lists": ids}[form]
    n_ctx = len(embedded.tokenize(context, special=True))
    config = ServerConfig(batched_session=batched, allowed_hosts=(TEST_CLIENT_HOST,))
    with TestClient(create_app(embedded, config)) as c:
        r = c.post("/v1/completions", json=lm_eval_request(prompt))
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert r.json()["usage"]["completion_tokens"] == len(choices)
    for choice, whole in zip(choices, ids):
        lp = choice["logprobs"]
        session = embedded.new_session()
        logp = torch.log_softmax(session.extend_logits(whole), dim=-1)
        expected = [float(logp[i, t]) for i, t in enumerate(whole[1:])]
        eos = int(logp[-1].argmax())
        assert eos in embedded.eos_ids and choice["finish_reason"] == "stop"
        # One entry per prompt token and one for the generated end-of-sequence token.
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
            == len(lp["text_offset"]) == len(whole) + 1
        assert lp["tokens"][-1] == embedded.detokenize([eos])
        assert lp["token_logprobs"][1:] == pytest.approx(expected + [float(logp[-1, eos])], abs=1e-4)
        # lm-eval's reading: the entries after the context, the generated one left off.
        assert sum(lp["token_logprobs"][n_ctx:-1]) == pytest.approx(sum(expected[n_ctx - 1:]), abs=1e-4)
