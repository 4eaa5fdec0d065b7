"""The options sweep: every request field each inference API accepts is honoured or refused.

`OPTIONS` is the one table. For each API (chat, completions, responses, messages) it lists the
fields its documentation defines and the ones this server adds, each with what it does here:

- `Effect(value, seen)`: sent against the fake engine, the answer differs from the same
  request without it the way `seen(with, without)` checks;
- `Reaches(value, attribute, expected)`: the value reaches the generation request the worker
  runs (`GenerationRequest.<attribute>`), whose effect the engine's own sampler tests show;
- `Shown(test)`: another test (`file::function`) shows the effect end to end;
- `Refuse(value)`: a 400 that names the field;
- `Inert(value)`: a field that by its API's own definition does not change the output (an end
  user's id, metadata, storage hints): the answer is the one without it.

`test_every_schema_field_is_in_the_table` keeps the table complete: a field a schema declares,
or refuses, that the table does not classify fails it.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from fastapi.testclient import TestClient

from server.endpoints import ENDPOINTS
from server_fake_engine import DEFAULT_REPLY, FakeModel
from server_support import fake_app

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"
USER = [{"role": "user", "content": "hi"}]
BASES = {CHAT: {"messages": USER, "max_tokens": 12, "temperature": 0},
         COMPLETIONS: {"prompt": "hi", "max_tokens": 12, "temperature": 0},
         RESPONSES: {"input": "hi", "max_output_tokens": 12, "temperature": 0},
         MESSAGES: {"messages": USER, "max_tokens": 12, "temperature": 0}}
H = str(ord("H"))  # the fake's first scripted token
X = str(ord("x"))
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@dataclass(frozen=True)
class Effect:
    value: Any
    seen: Callable[[Any, Any], bool]
    """(answer with the field, answer without it) -> whether the effect shows."""


@dataclass(frozen=True)
class Reaches:
    value: Any
    attribute: str
    expected: Any


@dataclass(frozen=True)
class Shown:
    test: str


@dataclass(frozen=True)
class Refuse:
    value: Any


@dataclass(frozen=True)
class Inert:
    value: Any


# --- what an answer shows --------------------------------------------------------------------

def text(r: Any) -> str:
    """The generated text of an answer of any of the four APIs (streamed ones joined)."""
    if r.headers["content-type"].startswith("text/event-stream"):
        return "".join(_stream_text(json.loads(line[6:])) for line in r.text.splitlines()
                       if line.startswith("data: ") and line != "data: [DONE]")
    body = r.json()
    if "choices" in body:
        c = body["choices"][0]
        return c["message"]["content"] or "" if "message" in c else c["text"]
    if "output" in body:
        return "".join(p["text"] for o in body["output"] if o["type"] == "message" for p in o["content"])
    return "".join(b.get("text", "") for b in body["content"])


def _stream_text(chunk: dict) -> str:
    if chunk.get("choices"):
        c = chunk["choices"][0]
        return (c.get("delta") or {}).get("content") or c.get("text") or ""
    if chunk.get("type") == "response.output_text.delta":
        return chunk["delta"]
    if chunk.get("type") == "content_block_delta":
        return chunk["delta"].get("text", "")
    return ""


def differs(a: Any, b: Any) -> bool:
    return text(a) != text(b)


def streamed(a: Any, b: Any) -> bool:
    return a.headers["content-type"].startswith("text/event-stream") and text(a) == text(b)


def shorter(a: Any, b: Any) -> bool:
    return len(text(a)) < len(text(b))


def prompt_grew(a: Any, b: Any) -> bool:
    usage, base = a.json()["usage"], b.json()["usage"]
    key = "prompt_tokens" if "prompt_tokens" in usage else "input_tokens"
    return usage[key] > base[key]


def n_choices(k: int) -> Callable[[Any, Any], bool]:
    return lambda a, b: len(a.json()["choices"]) == k and len(b.json()["choices"]) == 1


def banned_first(a: Any, b: Any) -> bool:
    return text(b).startswith("H") and not text(a).startswith("H")


def forced_x(a: Any, b: Any) -> bool:
    return set(text(a)) == {"x"}


def chat_logprobs(k: int) -> Callable[[Any, Any], bool]:
    def seen(a: Any, b: Any) -> bool:
        lp = a.json()["choices"][0]["logprobs"]["content"]
        before = b.json()["choices"][0]["logprobs"]
        return ("".join(e["token"] for e in lp) == text(a) and all(len(e["top_logprobs"]) == k for e in lp)
                and (before is None or any(len(e["top_logprobs"]) != k for e in before["content"])))
    return seen


def completion_logprobs(a: Any, b: Any) -> bool:
    lp = a.json()["choices"][0]["logprobs"]
    return b.json()["choices"][0]["logprobs"] is None and "".join(lp["tokens"]) == text(a)


def echoed(a: Any, b: Any) -> bool:
    return text(a) == "hi" + text(b)


def token_ids(a: Any, b: Any) -> bool:
    return a.json()["choices"][0]["logprobs"]["tokens"][0] == f"token_id:{ord(DEFAULT_REPLY[0])}"


def usage_chunk(a: Any, b: Any) -> bool:
    chunks = [json.loads(line[6:]) for line in a.text.splitlines() if line.startswith("data: {")]
    return chunks[-1].get("usage") is not None and not chunks[-1]["choices"]


def responses_logprobs(k: int) -> Callable[[Any, Any], bool]:
    def seen(a: Any, b: Any) -> bool:
        (part,) = [p for o in a.json()["output"] if o["type"] == "message" for p in o["content"]]
        (plain,) = [p for o in b.json()["output"] if o["type"] == "message" for p in o["content"]]
        return (not plain["logprobs"] and "".join(e["token"] for e in part["logprobs"]) == part["text"]
                and all(len(e["top_logprobs"]) == k for e in part["logprobs"]))
    return seen


def exact_length(a: Any, b: Any) -> bool:
    usage = a.json()["usage"]
    return usage.get("completion_tokens", usage.get("output_tokens")) == 12 and text(b) == DEFAULT_REPLY[:12]


# The sampling fields reach the engine's sampler as they are (its filters are tested in
# tests/engine); temperature 1 so that top_k, top_p and min_p are not moot.
def sampling(name: str, value: Any, expected: Any = None) -> Reaches:
    return Reaches(value, f"sampling.{name}", value if expected is None else expected)


TOOL_CHOICE = "test_server_tool_choice.py::"
SCORING = "test_server_scoring.py::"
THIS = "test_server_options.py::"

SAMPLING = {
    "temperature": sampling("temperature", 0.7),
    "top_p": sampling("top_p", 0.5),
    "top_k": sampling("top_k", 3),
    "min_p": sampling("min_p", 0.2),
    "seed": sampling("seed", 123),
    "ignore_eos": Effect(True, exact_length),
}
OPENAI_COMMON = SAMPLING | {
    "model": Inert("any-name"),  # one model is served, whatever name a request gives
    "user": Inert("u-1"),
    "stop": Effect("world", shorter),
    "stream": Effect(True, streamed),
    "stream_options": Effect({"include_usage": True}, usage_chunk),
    "n": Effect(2, n_choices(2)),
    "presence_penalty": Refuse(0.5),
    "frequency_penalty": Refuse(0.5),
    "logit_bias": Effect({H: -100}, banned_first),
    "repeat_penalty": Refuse(1.1),
    "repetition_penalty": Refuse(1.1),
    "typical_p": Refuse(0.9),
    "mirostat": Refuse(2),
    "grammar": Refuse("root ::= \"a\""),
    "guided_json": Refuse({"type": "object"}),
    "min_tokens": Refuse(4),
    "stop_token_ids": Refuse([1]),
}
REFUSED_EXTENSIONS = {name: Refuse(value) for name, value in {
    "penalty_last_n": 64, "length_penalty": 0.5, "tfs_z": 0.9, "top_a": 0.1, "mirostat_tau": 5.0,
    "mirostat_eta": 0.1, "dry_multiplier": 0.8, "xtc_probability": 0.5, "dynatemp_range": 0.5,
    "samplers": ["top_k"], "use_beam_search": True, "bad_words": ["x"], "allowed_token_ids": [1],
    "json_schema": {"type": "object"}, "guided_regex": "a+", "guided_grammar": "root ::= \"a\"",
    "guided_choice": ["a"], "structured_outputs": {"json": {}}, "n_probs": 3, "prompt_logprobs": 1}.items()}

OPTIONS: dict[str, dict[str, Any]] = {
    CHAT: OPENAI_COMMON | REFUSED_EXTENSIONS | {
        "messages": Shown("test_server_openai.py::test_developer_role_and_content_parts"),
        "max_tokens": Effect(3, shorter),
        "max_completion_tokens": Effect(3, shorter),
        "logprobs": Effect(True, chat_logprobs(0)),
        "top_logprobs": Effect(2, chat_logprobs(2)),  # with logprobs: EFFECT_BASES
        "tools": Shown(TOOL_CHOICE + "test_none_renders_no_tools"),
        "tool_choice": Shown(TOOL_CHOICE + "test_openai_required_or_named_forces_a_parseable_call"),
        "parallel_tool_calls": Shown(TOOL_CHOICE + "test_parallel_tool_calls_false_stops_after_the_first_call"),
        "response_format": Shown(TOOL_CHOICE + "test_response_format_json_schema_is_followed"),
        "chat_template_kwargs": Shown(THIS + "test_chat_template_kwargs_reach_the_template"),
        "metadata": Inert({"k": "v"}),
        "store": Inert(False),
        "service_tier": Inert("auto"),
        "safety_identifier": Inert("s-1"),
        "prompt_cache_key": Inert("p-1"),
        "reasoning_effort": Refuse("low"),
        "verbosity": Refuse("low"),
        "audio": Refuse({"voice": "alloy", "format": "wav"}),
        "modalities": Refuse(["text", "audio"]),
        "prediction": Refuse({"type": "content", "content": "x"}),
        "web_search_options": Refuse({}),
        "functions": Refuse([{"name": "f"}]),
        "function_call": Refuse("auto"),
    },
    COMPLETIONS: OPENAI_COMMON | REFUSED_EXTENSIONS | {
        "prompt": Shown(SCORING + "test_each_prompt_of_a_list_is_its_own_choice"),
        "max_tokens": Effect(3, shorter),
        "logprobs": Effect(0, completion_logprobs),
        "echo": Effect(True, echoed),
        "return_tokens_as_token_ids": Effect(True, token_ids),  # with logprobs: EFFECT_BASES
        "suffix": Refuse("the end"),
        "best_of": Refuse(2),
    },
    RESPONSES: SAMPLING | REFUSED_EXTENSIONS | {
        "model": Inert("any-name"),
        "input": Shown("test_server_responses.py::test_previous_output_items_are_passed_back"),
        "instructions": Effect("Be brief.", prompt_grew),
        "max_output_tokens": Effect(3, shorter),
        "stream": Effect(True, streamed),
        "tools": Shown(TOOL_CHOICE + "test_responses_required_call"),
        "tool_choice": Shown(TOOL_CHOICE + "test_responses_required_call"),
        "parallel_tool_calls": Shown(THIS + "test_responses_parallel_tool_calls_reach_the_constraint"),
        "text": Shown(TOOL_CHOICE + "test_responses_text_format_json_schema"),
        "include": Effect(["message.output_text.logprobs"], responses_logprobs(0)),
        "top_logprobs": Effect(2, responses_logprobs(2)),
        "previous_response_id": Refuse("resp_1"),
        "store": Inert(True),
        "metadata": Inert({"k": "v"}),
        "user": Inert("u-1"),
        "service_tier": Inert("auto"),
        "safety_identifier": Inert("s-1"),
        "prompt_cache_key": Inert("p-1"),
        "stream_options": Inert({"include_obfuscation": False}),
        "reasoning": Refuse({"effort": "high"}),
        "background": Refuse(True),
        "conversation": Refuse("conv_1"),
        "prompt": Refuse({"id": "pmpt_1"}),
        "max_tool_calls": Refuse(1),
        "truncation": Refuse("auto"),
        "repeat_penalty": Refuse(1.1),
        "repetition_penalty": Refuse(1.1),
        "typical_p": Refuse(0.9),
        "mirostat": Refuse(2),
        "grammar": Refuse("root ::= \"a\""),
        "guided_json": Refuse({"type": "object"}),
        "min_tokens": Refuse(4),
        "stop_token_ids": Refuse([1]),
    },
    MESSAGES: SAMPLING | REFUSED_EXTENSIONS | {
        "model": Inert("any-name"),
        "messages": Shown("test_server_anthropic.py::test_tool_use_and_tool_result_blocks_reach_the_prompt"),
        "max_tokens": Effect(3, shorter),
        "system": Effect("Be brief.", prompt_grew),
        "stop_sequences": Effect(["world"], shorter),
        "stream": Effect(True, streamed),
        "tools": Shown(TOOL_CHOICE + "test_anthropic_any_tool_and_disable_parallel"),
        "tool_choice": Shown(TOOL_CHOICE + "test_anthropic_any_tool_and_disable_parallel"),
        "output_config": Shown(TOOL_CHOICE + "test_anthropic_output_config_format_json_schema"),
        "thinking": Shown(THIS + "test_anthropic_thinking_disabled_turns_the_templates_thinking_off"),
        "metadata": Inert({"user_id": "u-1"}),
        "service_tier": Inert("auto"),
        "container": Refuse("c-1"),
        "context_management": Refuse({"edits": []}),
        "mcp_servers": Refuse([{"type": "url", "url": "http://x", "name": "x"}]),
        "output_format": Refuse({"type": "json_schema", "schema": {}}),
        "repeat_penalty": Refuse(1.1),
        "repetition_penalty": Refuse(1.1),
        "typical_p": Refuse(0.9),
        "mirostat": Refuse(2),
        "grammar": Refuse("root ::= \"a\""),
        "guided_json": Refuse({"type": "object"}),
        "min_tokens": Refuse(4),
        "stop_token_ids": Refuse([1]),
    },
}
# Fields that show only together with another one.
EFFECT_BASES = {(COMPLETIONS, "return_tokens_as_token_ids"): {"logprobs": 0},
                (CHAT, "top_logprobs"): {"logprobs": True},
                (CHAT, "stream_options"): {"stream": True}, (COMPLETIONS, "stream_options"): {"stream": True}}


def entries(kind: type) -> list[tuple[str, str, Any]]:
    return [(path, field, spec) for path, table in OPTIONS.items() for field, spec in table.items()
            if isinstance(spec, kind)]


@pytest.fixture(scope="module")
def served():
    model = FakeModel()
    with TestClient(fake_app(model), raise_server_exceptions=False) as c:
        worker = c.app.state.worker
        submitted: list[Any] = []
        submit_request = worker.submit_request  # every request's way in (`submit` goes through it)

        def recording(requests: Any, sinks: Any, *args: Any, **kwargs: Any) -> Any:
            submitted.extend(requests)
            return submit_request(requests, sinks, *args, **kwargs)

        worker.submit_request = recording
        yield c, submitted


def test_every_schema_field_is_in_the_table():
    for endpoint in ENDPOINTS:
        if endpoint.path not in OPTIONS:
            continue
        table = OPTIONS[endpoint.path]
        assert set(endpoint.body.model_fields) - set(table) == set(), endpoint.path
        refused = {r.field for r in endpoint.body.refused}
        assert {f for f in refused if not isinstance(table.get(f), Refuse)} == set(), endpoint.path


@pytest.mark.parametrize("path,field,spec", entries(Effect), ids=lambda v: v if isinstance(v, str) else "")
def test_field_has_its_effect(served, path, field, spec):
    client, _ = served
    base = BASES[path] | EFFECT_BASES.get((path, field), {})
    without = client.post(path, json=base)
    with_it = client.post(path, json=base | {field: spec.value})
    assert without.status_code == with_it.status_code == 200, with_it.text
    assert spec.seen(with_it, without), (text(with_it), text(without))


@pytest.mark.parametrize("path,field,spec", entries(Reaches), ids=lambda v: v if isinstance(v, str) else "")
def test_field_reaches_the_generation(served, path, field, spec):
    client, submitted = served
    r = client.post(path, json=BASES[path] | {"temperature": 1.0} | {field: spec.value})
    assert r.status_code == 200, r.text
    value: Any = submitted[-1]
    for part in spec.attribute.split("."):
        value = getattr(value, part)
    assert value == spec.expected


@pytest.mark.parametrize("path,field,spec", entries(Refuse), ids=lambda v: v if isinstance(v, str) else "")
def test_field_is_refused_naming_it(served, path, field, spec):
    client, _ = served
    r = client.post(path, json=BASES[path] | {field: spec.value})
    assert r.status_code == 400, (field, r.text)
    error = r.json()["error"]
    assert error.get("param") == field or field in error["message"], error


@pytest.mark.parametrize("path,field,spec", entries(Inert), ids=lambda v: v if isinstance(v, str) else "")
def test_inert_field_leaves_the_answer_as_it_is(served, path, field, spec):
    client, _ = served
    without = client.post(path, json=BASES[path])
    with_it = client.post(path, json=BASES[path] | {field: spec.value})
    assert with_it.status_code == 200, with_it.text
    assert text(with_it) == text(without)


@pytest.mark.parametrize("path,field,spec", entries(Shown), ids=lambda v: v if isinstance(v, str) else "")
def test_the_test_that_shows_the_effect_exists(path, field, spec):
    module, function = spec.test.split("::")
    assert callable(getattr(importlib.import_module(module.removesuffix(".py")), function))


@pytest.mark.parametrize("neutral", [{"repeat_penalty": 1.0}, {"repeat_penalty": 1}, {"reasoning_effort": None},
                                     {"modalities": ["text"]}, {"mirostat": 0}])
def test_a_refused_field_with_its_neutral_value_is_accepted(served, neutral):
    client, _ = served
    assert client.post(CHAT, json=BASES[CHAT] | neutral).status_code == 200


# --- logit_bias ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_logit_bias_plus_100_forces_a_token(served, path):
    client, _ = served
    r = client.post(path, json=BASES[path] | {"logit_bias": {X: 100}})
    assert text(r) == "x" * 12


@pytest.mark.parametrize("bias,fragment", [({"-1": 5}, "not a token id"), ({"abc": 5}, "not a token id"),
                                           ({"99999": 5}, "not a token id"), ({H: 101}, "[-100, 100]"),
                                           ({H: -100.5}, "[-100, 100]")])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_logit_bias_out_of_bounds_is_a_400(served, path, bias, fragment):
    client, _ = served
    r = client.post(path, json=BASES[path] | {"logit_bias": bias})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "logit_bias" and fragment in r.json()["error"]["message"]


def test_logit_bias_holds_when_sampling_and_in_a_stream(served):
    client, _ = served
    r = client.post(CHAT, json=BASES[CHAT] | {"temperature": 1.0, "seed": 3, "stream": True,
                                              "logit_bias": {str(ord(c)): -100 for c in set(DEFAULT_REPLY)}})
    assert not set(text(r)) & set(DEFAULT_REPLY)


# --- the rest that the table points at --------------------------------------------------------

def test_chat_template_kwargs_reach_the_template():
    model = FakeModel(thinking=True)
    with TestClient(fake_app(model)) as c:
        c.post(CHAT, json=BASES[CHAT])
        assert model.rendered[-1].endswith("<think>\n")
        c.post(CHAT, json=BASES[CHAT] | {"chat_template_kwargs": {"enable_thinking": False}})
        assert not model.rendered[-1].endswith("<think>\n")
        r = c.post(CHAT, json=BASES[CHAT] | {"chat_template_kwargs": {"messages": []}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_anthropic_thinking_disabled_turns_the_templates_thinking_off():
    model = FakeModel(thinking=True)
    with TestClient(fake_app(model)) as c:
        assert c.post(MESSAGES, json=BASES[MESSAGES] | {"thinking": {"type": "disabled"}}).status_code == 200
        assert not model.rendered[-1].endswith("<think>\n")
        r = c.post(MESSAGES, json=BASES[MESSAGES] | {"thinking": {"type": "enabled", "budget_tokens": 1024}})
        assert r.status_code == 400 and "thinking" in r.json()["error"]["message"]


def test_responses_parallel_tool_calls_reach_the_constraint(served):
    client, submitted = served
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    for parallel in (True, False):
        r = client.post(RESPONSES, json=BASES[RESPONSES] | {"tools": tools, "parallel_tool_calls": parallel})
        assert r.status_code == 200 and r.json()["parallel_tool_calls"] is parallel
    assert submitted[-1].new_constraint is not None


def test_responses_streamed_logprobs_ride_on_the_text_deltas(served):
    client, _ = served
    r = client.post(RESPONSES, json=BASES[RESPONSES] | {"stream": True, "top_logprobs": 1,
                                                        "include": ["message.output_text.logprobs"]})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(lp["token"] for d in deltas for lp in d["logprobs"]) == "".join(d["delta"] for d in deltas)
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert [lp["token"] for lp in done["logprobs"]] == [lp["token"] for d in deltas for lp in d["logprobs"]]
    assert all(len(lp["top_logprobs"]) == 1 for lp in done["logprobs"])


def test_responses_include_of_an_unknown_value_is_a_400(served):
    client, _ = served
    r = client.post(RESPONSES, json=BASES[RESPONSES] | {"include": ["nonsense"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include"
    ok = client.post(RESPONSES, json=BASES[RESPONSES] | {"include": ["reasoning.encrypted_content"]})
    assert ok.status_code == 200


def test_anthropic_output_config_other_than_a_json_schema_format_is_a_400(served):
    client, _ = served
    for config, param in (({"effort": "high"}, "output_config.effort"),
                          ({"format": {"type": "text"}}, "output_config.format")):
        r = client.post(MESSAGES, json=BASES[MESSAGES] | {"output_config": config})
        assert r.status_code == 400 and param in r.text


@pytest.mark.parametrize("batched", [1, 2])
def test_logit_bias_on_the_engine_in_both_loops(tiny_model, batched):
    from server.app import create_app
    from server.config import ServerConfig
    from server_support import TEST_CLIENT_HOST

    def tokens(c: TestClient, bias: dict[str, float]) -> list[int]:
        r = c.post(COMPLETIONS, json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "logprobs": 0,
                                      "return_tokens_as_token_ids": True, "ignore_eos": True, "logit_bias": bias})
        assert r.status_code == 200, r.text
        return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    with TestClient(create_app(tiny_model, ServerConfig(batched_session=batched,
                                                        allowed_hosts=(TEST_CLIENT_HOST,)))) as c:
        plain = tokens(c, {})
        assert plain[0] not in tokens(c, {str(plain[0]): -100})
        assert tokens(c, {"40": 100}) == [40] * 4
