"""Who may talk to ds4-server: the API key and the Host allow-list through the real OpenAI and
Anthropic SDKs against a server process, the pure checks behind them, and the flag rules
(non-loopback binds, `--cors '*'`)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from server.cli import main
from server.config import ServerConfig
from server.errors import client_error_line
from server.guard import host_error, host_name, is_loopback, key_error, presented_keys
from server_support import fake_app, server_process

KEY = "sk-test-0123456789"
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    log = tmp_path_factory.mktemp("guard") / "server.log"
    with server_process(log, "--api-key", KEY, "--allowed-host", "ds4.test") as s:
        yield s


def openai_client(srv, key: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key=key, max_retries=0, **kw)


def anthropic_client(srv, key: str, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base, api_key=key, max_retries=0, **kw)


# --- through the SDKs -----------------------------------------------------------------------

def test_openai_sdk_with_the_right_key_is_served(srv):
    with openai_client(srv, KEY) as c:
        r = c.chat.completions.create(model="fake-model", messages=USER, max_tokens=2)
        assert r.choices[0].message.content
        assert [m.id for m in c.models.list()] == ["fake-model"]


def test_openai_sdk_with_a_wrong_key_gets_401(srv):
    with openai_client(srv, "sk-wrong") as c, pytest.raises(openai.AuthenticationError) as e:
        c.chat.completions.create(model="fake-model", messages=USER, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert e.value.response.headers["www-authenticate"].startswith("Bearer")
    srv.wait_log("401 POST /v1/chat/completions: invalid API key")
    assert "sk-wrong" not in srv.log() and KEY not in srv.log()


def test_anthropic_sdk_with_the_right_key_is_served(srv):
    with anthropic_client(srv, KEY) as c:
        r = c.messages.create(model="fake-model", messages=USER, max_tokens=2)
        assert r.content[0].text
        assert c.messages.count_tokens(model="fake-model", messages=USER).input_tokens > 0


def test_anthropic_sdk_with_a_wrong_key_gets_401_in_its_dialect(srv):
    with anthropic_client(srv, "sk-wrong") as c, pytest.raises(anthropic.AuthenticationError) as e:
        c.messages.create(model="fake-model", messages=USER, max_tokens=2)
    assert e.value.status_code == 401
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}


def test_either_header_works_on_either_endpoint(srv):
    # The Anthropic SDK sends a bearer token when given auth_token instead of api_key.
    with anthropic.Anthropic(base_url=srv.base, auth_token=KEY, max_retries=0) as c:
        assert c.messages.create(model="fake-model", messages=USER, max_tokens=2).content
    r = httpx.post(srv.base + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2},
                   headers={"x-api-key": KEY})
    assert r.status_code == 200


def test_a_foreign_host_gets_403_even_with_the_right_key(srv):
    with openai_client(srv, KEY, default_headers={"Host": "evil.example"}) as c, \
            pytest.raises(openai.PermissionDeniedError) as e:
        c.chat.completions.create(model="fake-model", messages=USER, max_tokens=2)
    assert "Host 'evil.example' is not allowed" in e.value.body["message"]
    with anthropic_client(srv, KEY, default_headers={"Host": "evil.example:8000"}) as c, \
            pytest.raises(anthropic.PermissionDeniedError) as e:
        c.messages.create(model="fake-model", messages=USER, max_tokens=2)
    assert e.value.body["error"]["type"] == "permission_error"
    # A name given with --allowed-host is accepted, with any port.
    with openai_client(srv, KEY, default_headers={"Host": "ds4.test:1234"}) as c:
        assert c.chat.completions.create(model="fake-model", messages=USER, max_tokens=2).choices


def test_health_needs_no_key_and_the_rest_does(srv):
    assert httpx.get(srv.base + "/health").status_code == 200
    for path in ("/v1/models", "/openapi.json", "/docs"):
        r = httpx.get(srv.base + path)
        assert r.status_code == 401 and "API key is required" in r.json()["error"]["message"], path


# --- the pure checks ------------------------------------------------------------------------

@pytest.mark.parametrize("header,name", [
    ("localhost:8000", "localhost"), ("127.0.0.1", "127.0.0.1"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
    ("LocalHost.", "localhost"), ("evil.example:80", "evil.example"), ("::1", "::1"),
])
def test_host_names(header, name):
    assert host_name(header) == name


def test_host_check():
    assert host_error("localhost:1", LOOPBACK) is None and host_error(None, LOOPBACK) is None
    err = host_error("127.0.0.1.evil.example", LOOPBACK)
    assert err.status == 403 and err.code == "host_not_allowed"


def test_key_check():
    bearer = {"authorization": f"Bearer {KEY}"}
    assert key_error("POST", "/v1/messages", bearer, KEY) is None
    assert key_error("POST", "/v1/chat/completions", {"x-api-key": KEY}, KEY) is None
    assert key_error("POST", "/v1/chat/completions", {"authorization": f"bearer  {KEY} "}, KEY) is None
    assert key_error("GET", "/health", {}, KEY) is None
    preflight = {"access-control-request-method": "POST", "origin": "http://a"}
    assert key_error("OPTIONS", "/v1/chat/completions", preflight, KEY) is None
    assert key_error("POST", "/v1/chat/completions", {}, KEY).code == "missing_api_key"
    for wrong in ({"authorization": KEY}, {"authorization": f"Basic {KEY}"}, {"x-api-key": KEY[:-1]},
                  {"authorization": f"Bearer {KEY}x"}):
        assert key_error("POST", "/v1/chat/completions", wrong, KEY).status == 401, wrong
    assert presented_keys({"authorization": "Bearer a", "x-api-key": "b"}) == ["a", "b"]


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.2", "example.com"))


def test_log_lines_escape_control_characters():
    assert client_error_line(400, "POST", "/v1/a\nb", "bad\r\nINFO forged") == \
        "400 POST /v1/a\\nb: bad\\r\\nINFO forged"
    assert client_error_line(400, "GET", "/", "x" * 1000).endswith("x...")


# --- flags and config -----------------------------------------------------------------------

def test_a_non_loopback_host_needs_a_key_or_insecure_no_auth(monkeypatch):
    monkeypatch.delenv("DS4_API_KEY", raising=False)
    result = CliRunner().invoke(main, ["--host", "0.0.0.0"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--host 0.0.0.0 accepts connections from other machines: give --api-key" in result.output
    assert ServerConfig(host="0.0.0.0", insecure_no_auth=True).host_allow_list is None
    assert ServerConfig(host="0.0.0.0", api_key="k", allowed_hosts=("box.lan",)).host_allow_list == LOOPBACK | {"box.lan"}
    monkeypatch.setenv("DS4_API_KEY", "from-env")
    ctx = main.make_context("ds4-server", ["--host", "0.0.0.0"])
    assert ctx.params["api_key"] == "from-env"


def test_the_key_stays_out_of_the_config_repr():
    assert KEY not in repr(ServerConfig(api_key=KEY))


@pytest.mark.parametrize("args,fragment", [
    (["--cors"], "--cors '*' lets every web page call the server: it needs --api-key"),
    (["--cors", "*"], "it needs --api-key"),
    (["--cors", "localhost:3000"], "give an origin such as http://localhost:3000"),
    (["--api-key", ""], "the API key must not be empty"),
    (["--max-connections", "0"], "max_connections must be at least 1"),
    (["--header-timeout-sec", "0"], "must be positive"),
])
def test_bad_security_flags_are_usage_errors(monkeypatch, args, fragment):
    monkeypatch.delenv("DS4_API_KEY", raising=False)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and fragment in result.output, result.output


def test_paths_are_file_names_unless_verbose(tmp_path):
    from server_fake_engine import FakeModel

    model = FakeModel(path="/srv/models/weights.gguf")
    with TestClient(fake_app(model)) as c:
        assert c.get("/v1/models").json()["data"][0]["meta"]["path"] == "weights.gguf"
    with TestClient(fake_app(model, verbose_paths=True)) as c:
        assert c.get("/v1/models").json()["data"][0]["meta"]["path"] == "/srv/models/weights.gguf"
