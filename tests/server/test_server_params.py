"""Every numeric request field of every inference endpoint, swept with boundary values: never a 5xx.

The app runs the fake model with the engine's real `SamplingParams` and `Sampler`, so a value
that passes the schema but that the sampler refuses (the old `top_p: 0`) shows up as the 500
it would be in production. Values the schema rejects must be 400s that name the field.
"""

from __future__ import annotations

import types

import pytest
from fastapi.testclient import TestClient

import engine
from server.app import create_app
from server.config import ServerConfig
from server_fake_engine import FAKE_ENGINE, FakeModel
from server_support import TEST_CLIENT_HOST

REAL_SAMPLING = types.SimpleNamespace(**(vars(FAKE_ENGINE) | {"SamplingParams": engine.SamplingParams,
                                                              "Sampler": engine.Sampler}))

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BASES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": "hi"},
    "/v1/messages": CHAT | {"max_tokens": 4},
    "/v1/responses": {"input": "hi"},
}
# The numeric fields of each endpoint's schema (checked against the schemas below).
NUMERIC = {
    "/v1/chat/completions": ["temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                             "max_completion_tokens", "n", "presence_penalty", "frequency_penalty",
                             "top_logprobs", "logit_bias"],
    "/v1/completions": ["temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "n",
                        "presence_penalty", "frequency_penalty", "logprobs", "best_of", "prompt", "logit_bias"],
    "/v1/messages": ["temperature", "top_p", "top_k", "min_p", "seed", "max_tokens"],
    "/v1/responses": ["temperature", "top_p", "top_k", "min_p", "seed", "max_output_tokens", "top_logprobs"],
}
BOUNDARY = [0, -1, 1, 0.5, 1e-300, 5e-324, 2, 20, 21, 2**31 - 1, 2**31, 2**63, 2**64, -2**63 - 1, 1e308,
            -1e308, "1", "NaN", "Infinity", "-inf", "", True, None, [], {}]


@pytest.fixture(scope="module")
def client():
    app = create_app(FakeModel(n_ctx=256), ServerConfig(allowed_hosts=(TEST_CLIENT_HOST,)), engine=REAL_SAMPLING)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_numeric_field_lists_cover_the_schemas():
    from server.endpoints import ENDPOINTS
    for e in ENDPOINTS:
        if e.path not in NUMERIC:
            continue
        found = set()
        for name, f in e.body.model_fields.items():
            text = str(f.annotation)
            if "int" in text or "float" in text:
                found.add(name)
        assert found == set(NUMERIC[e.path]), e.path


@pytest.mark.parametrize("path", list(BASES))
def test_boundary_values_of_every_numeric_field_never_5xx(client, path):
    failures = []
    for field in NUMERIC[path]:
        for value in BOUNDARY:
            # `prompt` may be a list of token ids: each boundary value as the one id.
            body = BASES[path] | {field: [value] if field == "prompt" else value}
            r = client.post(path, json=body)
            if r.status_code >= 500:
                failures.append((field, value, r.status_code, r.text[:200]))
            elif r.status_code >= 400:
                err = r.json()["error"]
                if field not in err["message"] and err.get("param") != field:
                    failures.append((field, value, r.status_code, "400 does not name the field: " + err["message"]))
    assert not failures, failures


@pytest.mark.parametrize("path", list(BASES))
def test_top_p_zero_is_a_400_naming_it(client, path):
    r = client.post(path, json=BASES[path] | {"top_p": 0, "temperature": 0.7})
    assert r.status_code == 400, r.text
    assert "top_p" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", list(BASES))
def test_tiny_temperature_samples_like_greedy(client, path):
    r = client.post(path, json=BASES[path] | {"temperature": 1e-300, "seed": 3})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "stop"), ("/v1/completions", "stop"),
                                        ("/v1/messages", "stop_sequences")])
def test_stop_lists_are_bounded(client, path, field):
    many = client.post(path, json=BASES[path] | {field: ["x"] * 17})
    long = client.post(path, json=BASES[path] | {field: ["x" * 5000]})
    for r in (many, long):
        assert r.status_code == 400, r.text
        assert field in r.json()["error"]["message"]
    assert client.post(path, json=BASES[path] | {field: ["x"] * 16}).status_code == 200
