"""Bad input never yields a 5xx: schemathesis against the OpenAPI document, plus hand-aimed
hypothesis strategies for the hostile bodies a schema cannot express (broken UTF-8, deep
nesting, non-finite numbers, duplicate keys, surrogates, absurd numbers).

The fake engine answers instantly, so every generated request that is valid runs to
completion; after each batch the server must still serve a normal request.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_support import fake_app
from server_fake_engine import FakeModel

APP = fake_app(FakeModel(n_ctx=256), max_body_mb=1)
# The coverage phase (hundreds of boundary-value cases per operation) is left to explicit
# runs of the schemathesis CLI; here the example and fuzzing phases keep the test fast.
SCHEMA = schemathesis.openapi.from_asgi(
    "/openapi.json", APP,
    config=schemathesis.config.SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False}}}))
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
             "/v1/messages/count_tokens"]


@pytest.fixture(scope="module", autouse=True)
def running_worker():
    APP.state.worker.start()
    yield
    APP.state.worker.stop()


# One test per operation, named by it: schemathesis' own `SCHEMA.parametrize()` gives all its
# items one test id, which pytest-xdist (`make test`) runs once. The document declares no
# examples, so generated cases are all that schemathesis' runs of an operation held.
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]


def test_the_document_lists_every_endpoint_the_fuzzing_aims_at():
    assert set(ENDPOINTS) <= {op.path for op in OPERATIONS}


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
def test_schema_driven_requests_never_fail_with_5xx(operation):
    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(case=operation.as_strategy())
    def check(case):
        response = case.call()
        assert response.status_code < 500, (case.path, case.body, response.text[:500])
        if response.status_code >= 400:
            assert "error" in response.json()

    check()


@pytest.fixture(scope="module")
def client():
    # Raw bodies are declared JSON, so that they reach the parser rather than the 415 check.
    with TestClient(APP, raise_server_exceptions=False, headers={"content-type": "application/json"}) as c:
        yield c


def _assert_4xx_in_dialect(path: str, response) -> None:
    assert 400 <= response.status_code < 500, (path, response.status_code, response.text[:300])
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["message"]
    else:
        assert body["error"]["message"]


_hostile = st.one_of(
    st.binary(max_size=64),
    st.integers(257, 2000).map(lambda n: b'{"messages":' + b"[" * n + b"]" * n + b"}"),
    st.sampled_from([b'{"temperature": NaN}', b'{"max_tokens": Infinity}', b'{"top_p": -Infinity}',
                     b'{"max_tokens": 1e400}', b'{"messages": [{"role": "user", "content": "a", "content": "b"}]}',
                     b'{"prompt": "\xff\xfe"}', b'{"input": "\xed\xa0\x80"}', b"[]", b"null", b'"str"',
                     b'{"max_tokens": 99999999999999999999999999}', b'{"seed": -1e300}',
                     b'{"messages": {"role": "user"}}', b'{"stop": [1, 2]}', b'{"prompt": [-1]}']),
)

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12)

_fields = st.fixed_dictionaries({}, optional={
    "messages": _values, "prompt": _values, "input": _values, "max_tokens": _values, "temperature": _values,
    "stream": _values, "stop": _values, "n": _values, "tools": _values, "system": _values,
    "top_k": _values, "seed": _values, "logprobs": _values, "ignore_eos": _values,
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(ENDPOINTS), raw=_hostile)
def test_hostile_bodies_get_4xx(client, path, raw):
    _assert_4xx_in_dialect(path, client.post(path, content=raw))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(ENDPOINTS), body=_fields)
def test_wrongly_typed_fields_never_5xx(client, path, body):
    r = client.post(path, content=json.dumps(body).encode())
    assert r.status_code < 500, (path, body, r.text[:300])
    if r.status_code >= 400:
        _assert_4xx_in_dialect(path, r)


def test_lone_surrogate_text_is_served_with_replacement(client):
    body = b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 1}'
    assert client.post("/v1/chat/completions", content=body).status_code == 200
    assert "hi \ufffd there" in APP.state.model.rendered[-1]


@pytest.mark.parametrize("path", ["/v1/nope", "/v1/messages/nope", "/v2/chat/completions"])
def test_unknown_endpoints_are_404_in_the_dialect_of_their_prefix(client, path):
    r = client.post(path, content=b"{}")
    assert r.status_code == 404
    _assert_4xx_in_dialect(path, r)


def test_server_still_serves_after_the_fuzzing(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2})
    assert r.status_code == 200
