"""What a chat request asks of the shape of its output: `tool_choice`, `parallel_tool_calls`,
`response_format` (and Responses' `text.format`), read from each API's dialect into two
API-neutral records, checked, and turned into the generation's decoding constraint.

- `ToolChoice(mode, name, parallel)`: mode "auto" (the model decides), "none" (no tools are
  rendered, so the model is not offered any), "required" (a call of one of the tools) or
  "function" (a call of `name`); `parallel=False` ends the generation after the first
  complete call. Read by `openai_tool_choice` (Chat Completions and Responses shapes) and
  `anthropic_tool_choice` ("auto" / "any" / "tool" / "none", `disable_parallel_tool_use`).
- `JsonFormat(schema)`: the output is one JSON document (schema None: any JSON object).
  Read by `openai_response_format` (Chat Completions) and `responses_text_format`.
- `tools_to_render(choice, tools)`: the tools the prompt shows.
- `constraint_factory(choice, fmt, syntax, tools)`: the `GenerationRequest.new_constraint`
  of a request, or None when nothing is asked (the generation is then decoded as before).
  A required call is decoded, from the first step outside thinking, under the grammar of
  whole calls of the allowed tools (`forced_calls`: their names, arguments fitting their
  parameter schemas, in the model's tool syntax; `server.tools.grammar`), so that it always
  parses; inside the call, structure is greedy as always and argument values are sampled
  among what the grammar allows.

Every check raises `server.errors.ApiError` (400) naming the parameter; a JSON schema is
checked for size and for recursion that no finite document ends (`constraints.schema_problem`)
before its grammar is built, so that the work a schema causes is bounded before it is queued. It does no I/O and
knows no engine beyond handing the model to `server.constraints`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import llguidance

from server.constraints import (GrammarConstraint, ToolCallPolicy, brief, grammar_error, json_grammar,
                                literal_choice, outside_thinking, schema_problem)
from server.errors import ApiError
from server.tools import Syntax, ToolSpec
from server.tools.grammar import call_grammar_error, calls_grammar

log = logging.getLogger("ds4.server")

AUTO, NONE, REQUIRED, FUNCTION = "auto", "none", "required", "function"


@dataclass(frozen=True)
class ToolChoice:
    mode: str = AUTO
    name: str | None = None
    parallel: bool = True

    @property
    def forces_call(self) -> bool:
        return self.mode in (REQUIRED, FUNCTION)


@dataclass(frozen=True)
class JsonFormat:
    schema: dict[str, Any] | None = None
    grammar: str = ""


# --- dialects ------------------------------------------------------------------------------

def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def openai_tool_choice(value: Any, parallel: bool | None, param: str = "tool_choice") -> ToolChoice:
    """Chat Completions (`{"type": "function", "function": {"name"}}`) or Responses
    (`{"type": "function", "name"}`) tool_choice, plus `parallel_tool_calls`."""
    par = parallel is not False
    if value is None or value == AUTO:
        return ToolChoice(AUTO, parallel=par)
    if value in (NONE, REQUIRED):
        return ToolChoice(value, parallel=par)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else value.get("name")
        if isinstance(name, str) and name:
            return ToolChoice(FUNCTION, name, par)
        raise _bad(param, "a function choice needs the function's name")
    if isinstance(value, dict) and value.get("type") in (AUTO, NONE, REQUIRED):
        return ToolChoice(value["type"], parallel=par)
    raise _bad(param, f"{value!r} is not one of 'none', 'auto', 'required' or a function choice")


def anthropic_tool_choice(value: dict[str, Any] | None, param: str = "tool_choice") -> ToolChoice:
    if value is None:
        return ToolChoice()
    par = not value.get("disable_parallel_tool_use", False)
    kind = value.get("type")
    if kind == "auto":
        return ToolChoice(AUTO, parallel=par)
    if kind == "none":
        return ToolChoice(NONE, parallel=par)
    if kind == "any":
        return ToolChoice(REQUIRED, parallel=par)
    if kind == "tool":
        name = value.get("name")
        if isinstance(name, str) and name:
            return ToolChoice(FUNCTION, name, par)
        raise _bad(param, "a tool choice of type 'tool' needs the tool's name")
    raise _bad(param, f"type {kind!r} is not one of 'auto', 'any', 'tool' or 'none'")


def _json_format(schema: Any, param: str) -> JsonFormat:
    if schema is not None and not isinstance(schema, dict):
        raise _bad(param, "the schema must be a JSON object")
    problem = schema_problem(schema)  # before any grammar work: its size and shape bound that work
    if problem:
        raise _bad(param, problem)
    try:
        grammar = json_grammar(schema)
    except ValueError as e:
        raise _bad(param, f"unusable JSON schema: {brief(str(e))}") from None
    error = grammar_error(grammar)
    if error:
        raise _bad(param, f"unsupported JSON schema: {error}")
    return JsonFormat(schema, grammar)


def openai_response_format(value: dict[str, Any] | None, param: str = "response_format") -> JsonFormat | None:
    """Chat Completions: `{"type": "text"}`, `{"type": "json_object"}` or
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`."""
    kind = (value or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_format(None, param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad(param, "type 'json_schema' needs a json_schema object with a schema")
        return _json_format(spec.get("schema", {}), f"{param}.json_schema.schema")
    raise _bad(param, f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


def responses_text_format(value: Any, param: str = "text.format") -> JsonFormat | None:
    """Responses: `{"type": "text"}`, `{"type": "json_object"}` or
    `{"type": "json_schema", "name", "schema", "strict"}`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(param, "must be an object")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_format(None, param)
    if kind == "json_schema":
        return _json_format(value.get("schema", {}), f"{param}.schema")
    raise _bad(param, f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


# --- checks and the constraint -------------------------------------------------------------

def check(choice: ToolChoice, fmt: JsonFormat | None, tools: Sequence[ToolSpec], *, ignore_eos: bool,
          param: str = "tool_choice") -> None:
    names = {t.name for t in tools}
    if choice.forces_call and not tools:
        raise _bad(param, f"{choice.mode!r} needs at least one tool")
    if choice.mode == FUNCTION and choice.name not in names:
        raise _bad(param, f"function {choice.name!r} is not among the tools ({', '.join(sorted(names))})")
    if fmt is not None and choice.forces_call:
        raise _bad(param, "a required tool call and a JSON response format exclude each other")
    if ignore_eos and (fmt is not None or choice.forces_call):
        raise _bad("ignore_eos", "cannot be combined with a JSON response format or a required tool call")


def tools_to_render(choice: ToolChoice, tools: Sequence[ToolSpec]) -> list[ToolSpec]:
    return [] if choice.mode == NONE else list(tools)


# At most this many calls are held to the grammar of a forced call when parallel calls are allowed.
MAX_FORCED_CALLS = 8


def forced_calls(choice: ToolChoice, syntax: Syntax, tools: Sequence[ToolSpec], single: bool) -> str:
    """The grammar a forced call is decoded under: whole calls of the allowed tools, arguments
    fitting their schemas (`server.tools.grammar`; one call, or up to MAX_FORCED_CALLS); where
    no such grammar can be built (a schema that is not an object's, one llguidance refuses),
    the syntax's call opening with one of the allowed names, the rest left to the model."""
    allowed = [t for t in tools if choice.mode != FUNCTION or t.name == choice.name]
    why = call_grammar_error(allowed)
    if why is None:
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(
                calls_grammar(syntax, allowed, 1 if single else MAX_FORCED_CALLS))
            why = grammar_error(grammar)
        except ValueError as e:
            why = str(e)
        if why is None:
            return grammar
    log.warning("forced tool call: only the call opening is enforced (%s)", why)
    return literal_choice([syntax.call_prefix(t.name) for t in allowed])


def constraint_factory(choice: ToolChoice, fmt: JsonFormat | None, syntax: Syntax,
                       tools: Sequence[ToolSpec]) -> Callable[[Any, Any], Any] | None:
    """The request's `new_constraint` (model, splitter) -> constraint, or None."""
    if fmt is not None:
        grammar = fmt.grammar
        return lambda model, splitter: GrammarConstraint(model, grammar, armed=outside_thinking(splitter))
    if not choice.forces_call and choice.parallel:
        return None
    single = not choice.parallel
    opening = forced_calls(choice, syntax, tools, single) if choice.forces_call else None

    def build(model: Any, splitter: Any) -> ToolCallPolicy:
        grammar = (GrammarConstraint(model, opening, release=True, armed=outside_thinking(splitter))
                   if opening is not None else None)
        return ToolCallPolicy(grammar, splitter, single)
    return build
