"""Grammars of whole tool calls (Lark text for llguidance): what a forced call may be.

`calls_grammar(syntax, tools, max_calls) -> str` is Lark text whose `start` matches one to
`max_calls` consecutive calls of any of `tools` (each call a block of its own, blocks separated
by "\n" as `render_calls` separates them), each written exactly as the syntax writes a call:
its opening (`Syntax.call_prefix`), its arguments fitting the tool's parameter schema, its
closing (`Syntax.call_suffix`). The arguments:
- a syntax with JSON arguments (`Syntax.json_arguments`, hermes): one JSON document under the
  tool's schema (llguidance's `%json`, with the separators `canonical_json` writes and no free
  whitespace);
- an XML-style syntax (`Syntax.param_literals`): one parameter per property of the schema, in
  the schema's order, the required ones always and the others optionally; a string value is
  plain text without "<" (so no closing tag ever needs escaping) and without the first
  character of the parameter's closing text (a value never runs into it), within its
  `minLength`/`maxLength`; an enum (or const) of strings is one of its literals; any other
  value is JSON under its sub-schema.
What it does not enforce: string patterns and formats in the XML-style syntaxes, and
properties beyond the schema's (never written).
`call_grammar_error(...)` is None when a grammar can be built, else why not (a schema that is
not an object schema). Pure text: it compiles nothing (`server.structured` does) and imports no
engine.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from server.tools.records import ToolSpec
from server.tools.syntax_base import Syntax

# The JSON layout `canonical_json` writes, for llguidance's JSON grammars.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_SEPARATOR = "\n"


def literal(text: str) -> str:
    """A Lark string literal of `text` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def json_rule(schema: Any) -> str:
    """A rule body matching one JSON value under `schema` (any JSON value when it is not an object)."""
    body = dict(schema) if isinstance(schema, dict) else {}
    return "%json " + json.dumps(body | {"x-guidance": JSON_LAYOUT}, ensure_ascii=False)


def _string_rule(schema: dict[str, Any], stop: str) -> str:
    """A string parameter's value as the XML-style syntaxes write it: itself, as text."""
    choices = schema.get("enum") if "enum" in schema else [schema["const"]] if "const" in schema else None
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return " | ".join(literal(c) for c in choices)
    banned = "".join(re.escape(ch) if ch != "\n" else "\\n" for ch in sorted(set("<" + stop[:1])))
    low = schema.get("minLength") if isinstance(schema.get("minLength"), int) else 0
    high = schema.get("maxLength") if isinstance(schema.get("maxLength"), int) else None
    count = "*" if (low, high) == (0, None) else f"{{{low},{'' if high is None else high}}}"
    return f"/[^{banned}]{count}/"


def _is_string(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def _object_schema(tool: ToolSpec) -> dict[str, Any]:
    return tool.parameters if isinstance(tool.parameters, dict) and tool.parameters else {"type": "object"}


def call_grammar_error(tools: Sequence[ToolSpec]) -> str | None:
    """Why no whole-call grammar can be built for `tools` (None: it can)."""
    for tool in tools:
        schema = _object_schema(tool)
        if schema.get("type", "object") != "object":
            return f"the parameters of {tool.name!r} are not an object schema"
        props = schema.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            return f"the properties of {tool.name!r} are not schemas"
    return None


def _call_rules(syntax: Syntax, tool: ToolSpec, rule: str) -> list[str]:
    """The rules of one call of `tool`, the first one named `rule`."""
    schema = _object_schema(tool)
    opening, closing = literal(syntax.call_prefix(tool.name)), literal(syntax.call_suffix)
    if syntax.json_arguments:
        return [f"{rule}: {opening} {rule}_args {closing}", f"{rule}_args: {json_rule(schema)}"]
    props: dict[str, Any] = schema.get("properties", {})
    required = set(schema.get("required", ()))
    parts, rules = [], []
    for j, (key, sub) in enumerate(props.items()):
        is_string = _is_string(sub)
        open_text, close_text = syntax.param_literals(key, is_string)
        value = _string_rule(sub, close_text) if is_string else json_rule(sub)
        rules += [f"{rule}_p{j}: {literal(open_text)} {rule}_v{j} {literal(close_text)}", f"{rule}_v{j}: {value}"]
        parts.append(f"{rule}_p{j}" + ("" if key in required else "?"))
    return [f"{rule}: {opening} {' '.join(parts)} {closing}".replace("  ", " ")] + rules


def calls_grammar(syntax: Syntax, tools: Sequence[ToolSpec], max_calls: int = 1) -> str:
    """Lark text: one to `max_calls` calls of `tools` (see the module docstring)."""
    if not tools or max_calls < 1:
        raise ValueError("calls_grammar needs at least one tool and one call")
    rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        rules += _call_rules(syntax, tool, f"call_{i}")
    # Nested optionals rather than a repetition count: plain Lark, at most `max_calls` calls.
    more = ""
    for _ in range(max_calls - 1):
        more = f"({literal(CALL_SEPARATOR)} call{(' ' + more) if more else ''})?"
    return "\n".join([f"start: call {more}".rstrip()] + rules) + "\n"
