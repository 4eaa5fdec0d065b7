"""/tokenize, /detokenize and /tokenizer_info (vLLM's forms) over the fake engine."""

from __future__ import annotations

import pytest

USER = [{"role": "user", "content": "hi"}]


def test_tokenize_a_prompt_and_back(client):
    body = client.post("/tokenize", json={"model": "m", "prompt": "hi<|im_end|>"}).json()
    assert body == {"count": 3, "max_model_len": 1024, "tokens": [104, 105, 257], "token_strs": None}
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "hi<|im_end|>"}


def test_tokenize_a_chat_as_the_chat_endpoint_renders_it(client):
    body = client.post("/tokenize", json={"messages": USER, "return_token_strs": True}).json()
    usage = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).json()["usage"]
    assert body["count"] == usage["prompt_tokens"]
    assert body["token_strs"][0] == "<|im_start|>"


def test_add_special_tokens_false_gives_the_bare_text_tokens():
    from fastapi.testclient import TestClient

    from server_fake_engine import FakeModel
    from server_support import fake_app

    with TestClient(fake_app(FakeModel(add_bos=True))) as c:
        assert c.post("/tokenize", json={"prompt": "a"}).json()["tokens"] == [258, 97]
        assert c.post("/tokenize", json={"prompt": "a", "add_special_tokens": False}).json()["tokens"] == [97]


def test_tokenizer_info_names_the_special_tokens(client):
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 1024


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenizer_requests_are_400(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
