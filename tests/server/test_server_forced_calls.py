"""Forced tool calls always parse and fit their schema: a required or named call is decoded under
the grammar of whole calls (`server.tools.grammar`), in every tool syntax and API.

A random model (no sense, every token possible) is the hard case: whatever it would write, the
grammar leaves only valid calls. The embedded model's sweep over many prompts is the issue's
target measurement (`-m "model and slow"`).
"""

from __future__ import annotations

import datetime
import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.config import ServerConfig
from server.tools import SYNTAXES, ToolsConfig
from server_support import TEST_CLIENT_HOST

# Bounded values, so that a model without sense still ends each one within the token budget.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}}, "required": ["zone"],
         "additionalProperties": False}
# Strings under a pattern, a format and a length that allows several lines and "<" (the XML-style
# syntaxes write them as raw text).
BOOKING = {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                            "room": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
                                            "note": {"type": "string", "maxLength": 40}},
           "required": ["day", "room", "note"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK, "book_room": BOOKING}
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} of a place", "parameters": s}}
                for n, s in SCHEMAS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": n, "description": f"{n} of a place", "parameters": s}
                   for n, s in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": n, "description": f"{n} of a place", "input_schema": s} for n, s in SCHEMAS.items()]


def forced_calls(client: TestClient, api: str, user: str, named: str | None, single: bool = False,
                 **extra) -> list[tuple[str, dict]]:
    """The calls of one forced request through `api`, as (name, arguments) pairs; `single` asks
    for one call at most (each API's own way)."""
    if single and api != "messages":
        extra["parallel_tool_calls"] = False
    if api == "chat":
        choice = {"type": "function", "function": {"name": named}} if named else "required"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": user}],
                                                      "tools": OPENAI_TOOLS, "tool_choice": choice, **extra})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"] or []]
    if api == "responses":
        choice = {"type": "function", "name": named} if named else "required"
        extra["max_output_tokens"] = extra.pop("max_tokens")
        r = client.post("/v1/responses", json={"input": user, "tools": RESPONSES_TOOLS, "tool_choice": choice,
                                               **extra})
        assert r.status_code == 200, r.text
        return [(o["name"], json.loads(o["arguments"])) for o in r.json()["output"] if o["type"] == "function_call"]
    choice = {"type": "tool", "name": named} if named else {"type": "any"}
    if single:
        choice["disable_parallel_tool_use"] = True
    r = client.post("/v1/messages", json={"messages": [{"role": "user", "content": user}], "tools": ANTHROPIC_TOOLS,
                                          "tool_choice": choice, **extra})
    assert r.status_code == 200, r.text
    return [(b["name"], b["input"]) for b in r.json()["content"] if b["type"] == "tool_use"]


def _rfc3339_date(value: object) -> bool:
    """RFC 3339's full-date, which takes the year 0000 that Python's `date` refuses (2000 has the
    same calendar: both are leap years)."""
    if not isinstance(value, str):
        return True
    try:
        datetime.date.fromisoformat("2000" + value[4:] if value.startswith("0000") else value)
    except ValueError:
        return False
    return len(value) == 10


# jsonschema's format checks, with RFC 3339's dates (the formats the grammars enforce).
FORMAT_CHECKER = jsonschema.FormatChecker(formats=list(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers))
FORMAT_CHECKER.checks("date")(_rfc3339_date)


def check_calls(calls: list[tuple[str, dict]], named: str | None, single: bool) -> None:
    assert calls, "no call"
    assert len(calls) == 1 or not single
    for name, arguments in calls:
        assert name == named if named else name in SCHEMAS
        jsonschema.validate(arguments, SCHEMAS[name], format_checker=FORMAT_CHECKER)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    from engine import load_model
    from engine.synthetic import RandomModelSpec, write_random_gguf

    spec = RandomModelSpec(n_ctx=4096, seed=7, tied_output=False)
    return load_model(write_random_gguf(tmp_path_factory.mktemp("gguf") / "random.gguf", spec))


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
def test_a_model_without_sense_still_makes_only_valid_forced_calls(random_model, syntax):
    config = ServerConfig(allowed_hosts=(TEST_CLIENT_HOST,), tools=ToolsConfig(tool_syntax=syntax))
    with TestClient(create_app(random_model, config)) as client:
        for api, named, temperature in (("chat", None, 0.0), ("responses", "get_time", 1.0),
                                        ("messages", "get_weather", 0.7), ("chat", "book_room", 1.0)):
            calls = forced_calls(client, api, "weather in Paris?", named, single=api != "messages", max_tokens=400,
                                 temperature=temperature, seed=3)
            check_calls(calls, named, single=api != "messages")


PLACES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul", "Dakar", "Hanoi"]
PROMPTS = [f"What is the weather in {p} for the next {d} days?" for p in PLACES for d in (2, 5)] + \
          [f"What time is it in {p}?" for p in PLACES] + \
          [f"Should I take an umbrella in {p} tomorrow?" for p in PLACES] + \
          [f"Plan my week in {p}: weather and local time please." for p in PLACES] + \
          [f"Book me a meeting room in {p} for 2027-03-{d:02d}, room B12, with a short note." for d, p in
           enumerate(PLACES, 1)]


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_the_embedded_model_makes_only_valid_forced_calls_over_fifty_prompts(api, syntax):
    from engine import load_model

    assert len(PROMPTS) >= 50
    config = ServerConfig(allowed_hosts=(TEST_CLIENT_HOST,), tools=ToolsConfig(tool_syntax=syntax))
    with TestClient(create_app(load_model(), config)) as client:
        for i, prompt in enumerate(PROMPTS):
            named = ("get_weather", "get_time", None, "book_room")[i % 4]
            # One call a request: with parallel calls the model repeats its call until the budget
            # cuts the last one, and a cut call is repaired without its missing arguments.
            calls = forced_calls(client, api, prompt, named, single=True, max_tokens=200, temperature=0.7, seed=i)
            check_calls(calls, named, single=True)
