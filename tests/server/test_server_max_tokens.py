"""`--max-tokens-default`: the limit of requests that set none, its rule at the room left in the
context, and how each API says that it stopped there (through the official SDKs, against a
scripted engine whose reply never ends before the limit)."""

from __future__ import annotations

import openai
import pytest
from click.testing import CliRunner

from server.apibase import DEFAULT_MAX_TOKENS, RequestDefaults, resolve_max_tokens
from server.cli import main
from server.config import ServerConfig
from server_fake_engine import FakeModel
from server_support import fake_app, live_server

ENDLESS = "x" * 5000  # longer than any limit below: only the limit stops it


# --- the rule (pure) ----------------------------------------------------------------------------

def test_the_default_is_the_smaller_of_the_server_and_the_api_default():
    assert DEFAULT_MAX_TOKENS == 4096 and ServerConfig().max_tokens_default == 4096
    assert RequestDefaults().max_tokens_for() == 4096
    assert RequestDefaults(8).max_tokens_for() == 8
    assert RequestDefaults(8).max_tokens_for(16) == 8 and RequestDefaults(100).max_tokens_for(16) == 16
    assert RequestDefaults(0).max_tokens_for() is None and RequestDefaults(0).max_tokens_for(16) == 16


def test_the_default_never_passes_the_room_left_in_the_context():
    assert resolve_max_tokens(None, 4096, 1000, 1024, False, "max_tokens") == 24
    assert resolve_max_tokens(None, 4096, 10, 8192, False, "max_tokens") == 4096
    assert resolve_max_tokens(None, None, 1000, 1024, False, "max_tokens") == 24
    # A limit the client gives is its own: the server's default does not cap it.
    assert resolve_max_tokens(5000, 8, 10, 8192, False, "max_tokens") == 5000


def test_a_negative_default_is_a_usage_error():
    with pytest.raises(ValueError, match="max_tokens_default must be 0 or more"):
        ServerConfig(max_tokens_default=-1)
    result = CliRunner().invoke(main, ["--max-tokens-default", "-1"])
    assert result.exit_code == 2 and "max_tokens_default must be 0 or more" in result.output
    assert "Traceback" not in result.output


# --- through the SDKs -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def capped():
    """A server whose default is 8 tokens, over a reply that never ends by itself."""
    with live_server(fake_app(FakeModel(ENDLESS), max_tokens_default=8)) as srv:
        yield openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)


def test_chat_without_a_limit_stops_at_the_default(capped):
    out = capped.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.choices[0].message.content == "x" * 8
    stream = capped.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                            stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "x" * 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_limit_of_the_request_wins_over_the_default(capped):
    out = capped.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                         max_completion_tokens=20)
    assert out.usage.completion_tokens == 20 and out.choices[0].finish_reason == "length"


def test_completions_take_the_smaller_of_16_and_the_default(capped):
    out = capped.completions.create(model="m", prompt="go")
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"


def test_responses_without_a_limit_end_incomplete_at_the_default(capped):
    resp = capped.responses.create(model="m", input="go")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 8 and resp.output_text == "x" * 8
    kinds = [e.type for e in capped.responses.create(model="m", input="go", stream=True)]
    assert kinds[-1] == "response.incomplete"


def test_the_default_stops_at_the_room_left_in_a_short_context():
    model = FakeModel(ENDLESS, n_ctx=64)
    with live_server(fake_app(model)) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 64
