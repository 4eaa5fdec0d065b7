"""tool_choice, parallel_tool_calls and response_format end to end: the openai and anthropic SDKs
against a live server over a scripted fake engine, once per tool syntax.

The fake here knows several texts and continues whichever one the output so far begins (the
first, prose, while nothing is written): asked freely it answers in prose; once the server
forces a call opening, only the texts of calls still match, so it completes the call whose
name the opening chose. No weights.
"""
from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from engine_fakes import FakeSession
from server.tools import ToolsConfig
from server.tools.records import ToolCall
from server.tools.registry import SYNTAXES
from server_support import fake_app, live_server
from server_fake_engine import FakeModel

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": SCHEMA}}
                for n, d in (("get_weather", "Weather"), ("get_time", "Local time"))]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": SCHEMA} for t in OPENAI_TOOLS]
PARIS = {"city": "Paris"}
PROSE = "Paris is lovely this time of year."


class BranchingSession(FakeSession):
    def _start(self, prompt_len: int) -> None:
        super()._start(prompt_len)
        prompt = self.model.detokenize(self.tokens[:prompt_len])
        self._branches = [self.model.tokenize(t, special=True) for t in self.model.branches(prompt)]

    def _next_scripted(self) -> int | None:
        out = self.tokens[self._prompt_len:]
        for ids in self._branches:
            if ids[:len(out)] == out:
                return ids[len(out)] if len(out) < len(ids) else None
        return None


class BranchingModel(FakeModel):
    def __init__(self, syntax_name: str) -> None:
        super().__init__(PROSE, n_ctx=4096)
        self.syntax = SYNTAXES[syntax_name]

    def branches(self, prompt: str) -> list[str]:
        calls = [ToolCall("a", "get_weather", PARIS), ToolCall("b", "get_time", PARIS)]
        if "[two calls]" in prompt:
            return [self.syntax.render_calls(calls)]
        return [PROSE] + [self.syntax.render_calls([c]) for c in calls]

    def new_session(self) -> BranchingSession:
        s = BranchingSession(self)
        self.sessions.append(s)
        return s


@pytest.fixture(scope="module", params=sorted(SYNTAXES))
def server(request):
    model = BranchingModel(request.param)
    with live_server(fake_app(model, tools=ToolsConfig(tool_syntax=request.param))) as srv:
        srv.model = model
        yield srv


def oai(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)


def ant(srv):
    return anthropic.Anthropic(base_url=srv.base, api_key="none", max_retries=0)


def chat(srv, user="weather in Paris?", **kw):
    return oai(srv).chat.completions.create(model="m", messages=[{"role": "user", "content": user}],
                                            tools=OPENAI_TOOLS, max_tokens=400, temperature=0, **kw)


def test_auto_lets_the_model_write_prose(server):
    choice = chat(server).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_openai_required_or_named_forces_a_parseable_call(server, tool_choice):
    choice = chat(server, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name in {"get_weather", "get_time"}
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == PARIS


def test_openai_named_call_streams(server):
    stream = oai(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "time?"}], tools=OPENAI_TOOLS, max_tokens=400,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True)
    chunks = list(stream)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])] if chunks else []
    assert [c.function.name for c in calls] == ["get_time"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_none_renders_no_tools(server):
    chat(server, tool_choice="none")
    prompt = server.model.rendered[-1]
    assert "get_weather" not in prompt
    chat(server)
    assert "get_weather" in server.model.rendered[-1]


def test_parallel_tool_calls_false_stops_after_the_first_call(server):
    both = chat(server, "[two calls]").choices[0].message.tool_calls
    assert [c.function.name for c in both] == ["get_weather", "get_time"]
    first = chat(server, "[two calls]", parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in first.message.tool_calls] == ["get_weather"]
    assert first.finish_reason == "tool_calls"


def test_anthropic_any_tool_and_disable_parallel(server):
    def ask(user, **kw):
        return ant(server).messages.create(model="m", max_tokens=400, tools=ANTHROPIC_TOOLS,
                                           messages=[{"role": "user", "content": user}], **kw)
    assert [b.type for b in ask("weather?").content] == ["text"]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        msg = ask("weather?", tool_choice=choice)
        assert msg.stop_reason == "tool_use"
        (block,) = msg.content
        assert block.type == "tool_use" and block.input == PARIS
    msg = ask("[two calls]", tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.name for b in msg.content if b.type == "tool_use"] == ["get_weather"]
    with pytest.raises(anthropic.BadRequestError):
        ask("weather?", tool_choice={"type": "tool", "name": "nope"})


def test_responses_required_call(server):
    r = oai(server).responses.create(model="m", input="weather?", tool_choice="required", max_output_tokens=400,
                                     tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}])
    (item,) = [o for o in r.output if o.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments) == PARIS


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                                           "kind": {"enum": ["a", "b"]}},
          "required": ["ok", "n", "kind"], "additionalProperties": False}


def test_response_format_json_schema_is_followed(server):
    c = oai(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "json please"}], max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
    assert c.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(c.choices[0].message.content), ANSWER)


def test_responses_text_format_json_schema(server):
    r = oai(server).responses.create(model="m", input="json please", max_output_tokens=200, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}})
    jsonschema.validate(json.loads(r.output_text), ANSWER)


def test_bad_choices_are_400(server):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        chat(server, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="exclude each other"):
        chat(server, tool_choice="required", response_format={"type": "json_object"})


RECURSIVE = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                  "required": ["c"]}}}
WIDE = {"type": "object", "properties": {f"property_number_{i}": {"type": "string"} for i in range(10_000)}}


@pytest.mark.parametrize("schema,fragment", [
    (RECURSIVE, "no finite JSON document matches the schema: it requires #/$defs/n -> properties/c -> #/$defs/n"),
    (WIDE, "than the limit of 256 (MAX_SCHEMA_MEMBERS)"),  # counted before its 0.3 MB is measured
], ids=["required-recursion", "10000-properties"])
def test_schemas_no_grammar_can_serve_are_400_before_they_are_queued(server, schema, fragment):
    """Both used to reach the inference worker (the wide one for 12-22 s) and end in a 500, or in
    an error event after a 200 when streamed."""
    for api in ("chat", "responses"):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                if api == "chat":
                    out = oai(server).chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "json"}], max_tokens=20, stream=stream,
                        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
                else:
                    out = oai(server).responses.create(model="m", input="json", max_output_tokens=20, stream=stream,
                                                       text={"format": {"type": "json_schema", "name": "x",
                                                                        "schema": schema}})
                list(out) if stream else None
            assert fragment in str(e.value), (api, stream)
    assert server.model is not None  # still serving
    assert chat(server).choices[0].finish_reason == "stop"


def test_anthropic_output_config_format_json_schema(server):
    msg = ant(server).messages.create(model="m", max_tokens=200, messages=[{"role": "user", "content": "json please"}],
                                      extra_body={"temperature": 0, "output_config": {"format": {
                                          "type": "json_schema", "schema": ANSWER}}})
    (block,) = msg.content
    jsonschema.validate(json.loads(block.text), ANSWER)
    assert msg.stop_reason == "end_turn"
