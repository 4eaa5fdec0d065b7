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
  the schema's order, the required ones always and the others optionally; an enum (or const)
  of strings is one of its literals; any other non-string value is JSON under its sub-schema;
  a string value is text, as the syntax's scanner reads it back (`string_value`):
  - without constraints, any text (several lines, "<", anything) that holds none of the texts
    that end a value (`Syntax.value_ends`); their escaped forms (`canonical.DelimiterEscaper`)
    are allowed, and the scanner turns them back into the delimiter;
  - with `pattern`, `format`, `minLength` or `maxLength`, the text satisfies each of them as
    the JSON-schema constraint has llguidance enforce them on a JSON string: the pattern with
    JSON Schema's semantics (it matches anywhere unless it says "^"/"$"; `\\d` and `\\w` are
    ASCII, through llguidance's own `regex_to_lark`), the format as one of `FORMATS` (the
    formats llguidance's JSON schemas take), the lengths in characters. Such a value holds no
    escaped delimiter either, so that the text checked is the very value the tool receives.
  The value and the text that closes it are one lexeme: llguidance's lexer ends a lexeme at
  its longest match, so free text followed by a closing tag of its own could never end.
What it does not enforce: properties beyond the schema's (never written).
`call_grammar_error(...)` is None when a grammar can be built, else why not (a schema that is
not an object schema, a string format not in `FORMATS`). Pure text: it compiles nothing
(`server.structured` does; llguidance is used only to translate patterns) and imports no engine.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import llguidance

from server.tools.records import ToolSpec
from server.tools.syntax_base import Syntax

# The JSON layout `canonical_json` writes, for llguidance's JSON grammars.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_SEPARATOR = "\n"
# One character, newlines included: the regex of any text is ANY*.
ANY = r"[\s\S]"

_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_H16 = r"[0-9A-Fa-f]{1,4}"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
# An RFC 3339 full-date: four-digit years (0000 included, as RFC 3339 and llguidance's JSON
# formats take it), each month's own number of days, 29 February in leap years only.
_YEAR = r"[0-9]{4}"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
_DATE = (rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         rf"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
# Eight groups, or fewer around one "::" (k groups before it, at most 6 - k after).
_IPV6 = "|".join([f"(?:{_H16}:){{7}}{_H16}", "::"]
                 + [f"(?:{_H16}:){{{k}}}{_H16}::(?:{_H16}:){{0,{5 - k}}}{_H16}" for k in range(6)]
                 + [f"(?:{_H16}:){{{k}}}{_H16}::" for k in range(7)]
                 + [f"::(?:{_H16}:){{0,5}}{_H16}"])
_ATEXT = r"[A-Za-z0-9!#$%&'*+=?^_`{|}~-]"
# The string formats the grammar enforces, each a regex over the whole value: RFC 3339 dates and
# times, ISO 8601 durations, RFC 4122 UUIDs, dotted IPv4, IPv6 without a zone or an embedded
# IPv4 tail, RFC 1123 host names, e-mail addresses of dot-atoms, URIs as a scheme and a rest.
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[Tt]{_TIME}",
    "duration": r"P(?:[0-9]+W|(?:[0-9]+Y)?(?:[0-9]+M)?(?:[0-9]+D)?(?:T(?:[0-9]+H)?(?:[0-9]+M)?(?:[0-9]+S)?)?)",
    "uuid": r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    "ipv6": _IPV6,
    "hostname": rf"{_LABEL}(?:\.{_LABEL})*",
    "email": rf"{_ATEXT}+(?:\.{_ATEXT}+)*@{_LABEL}(?:\.{_LABEL})+",
    "uri": r"[A-Za-z][A-Za-z0-9+.-]*:[^\s<>\"]+",
}
# What a format's regex lets through and the format does not ("P" or "PT" is no duration).
_FORMAT_EXCLUSIONS = {"duration": r"PT?|P[\s\S]*T"}
_LENGTH_KEYS = ("minLength", "maxLength")


def literal(text: str) -> str:
    """A Lark string literal of `text` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def json_rule(schema: Any) -> str:
    """A rule body matching one JSON value under `schema` (any JSON value when it is not an object)."""
    body = dict(schema) if isinstance(schema, dict) else {}
    return "%json " + json.dumps(body | {"x-guidance": JSON_LAYOUT}, ensure_ascii=False)


def lark_regex(regex: str) -> str:
    """`regex` as a Lark regex token: between slashes, a "/" inside it escaped."""
    return "/" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", regex) + "/"


def _top_level_alternatives(regex: str) -> list[str]:
    """`regex` split at its top-level "|" (outside groups, character classes and escapes)."""
    parts, depth, in_class, start, i = [], 0, False, 0, 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch in "()":
            depth += 1 if ch == "(" else -1
        elif ch == "|" and depth == 0:
            parts.append(regex[start:i])
            start = i + 1
        i += 1
    return parts + [regex[start:]]


def _ends_with_anchor(regex: str) -> bool:
    """Whether `regex` ends in an unescaped "$" (an even number of backslashes before it)."""
    if not regex.endswith("$"):
        return False
    return (len(regex) - 1 - len(regex[:-1].rstrip("\\"))) % 2 == 0


def search_regex(pattern: str) -> str:
    """A regex matching the whole of every text in which JSON Schema's `pattern` finds a match:
    each top-level alternative gets ANY* on each side it does not anchor with "^" or "$"."""
    alternatives = []
    for alt in _top_level_alternatives(llguidance.regex_to_lark(pattern, "dw")):
        head, tail = alt.startswith("^"), _ends_with_anchor(alt)
        body = alt[1 if head else 0:len(alt) - 1 if tail else len(alt)]
        alternatives.append(("" if head else ANY + "*") + f"(?:{body})" + ("" if tail else ANY + "*"))
    return "|".join(f"(?:{a})" for a in alternatives)


def string_value(syntax: Syntax, schema: dict[str, Any]) -> str:
    """A Lark terminal expression: the text of a string parameter's value (see the module docstring)."""
    ends = syntax.value_ends
    if not ends:
        raise ValueError(f"the {syntax.name} syntax names no text that ends a value")
    constrained = [k for k in ("pattern", "format", *_LENGTH_KEYS) if k in schema]
    if not constrained:
        delimiters = "|".join(re.escape(e) for e in ends)
        return f"/{ANY}*/ & ~" + lark_regex(f"{ANY}*(?:{delimiters}){ANY}*")
    # Every delimiter "</rest" and its escaped forms "<\/rest", "<\\/rest"...
    rests = "|".join(re.escape(e[2:]) for e in ends)
    parts = [f"/{ANY}*/", "~" + lark_regex(f"{ANY}*<\\\\*/(?:{rests}){ANY}*")]
    if "pattern" in schema:
        parts.append(lark_regex(search_regex(schema["pattern"])))
    if "format" in schema:
        parts.append(lark_regex(FORMATS[schema["format"]]))
        if schema["format"] in _FORMAT_EXCLUSIONS:
            parts.append("~" + lark_regex(_FORMAT_EXCLUSIONS[schema["format"]]))
    low = schema.get("minLength") if isinstance(schema.get("minLength"), int) else 0
    high = schema.get("maxLength") if isinstance(schema.get("maxLength"), int) else None
    if (low, high) != (0, None):
        parts.append(f"/{ANY}{{{low},{'' if high is None else high}}}/")
    return " & ".join(parts)


def _string_choices(schema: dict[str, Any]) -> list[str] | None:
    """The literals of an enum (or const) of strings, else None."""
    choices = schema.get("enum") if "enum" in schema else [schema["const"]] if "const" in schema else None
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return choices
    return None


def _is_string(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def _object_schema(tool: ToolSpec) -> dict[str, Any]:
    return tool.parameters if isinstance(tool.parameters, dict) and tool.parameters else {"type": "object"}


def _string_problem(tool: ToolSpec, key: str, schema: dict[str, Any]) -> str | None:
    where = f"{tool.name!r}.{key}"
    if "format" in schema and schema["format"] not in FORMATS:
        return f"the format {schema['format']!r} of {where} is not one the grammar knows"
    if "pattern" in schema and not isinstance(schema["pattern"], str):
        return f"the pattern of {where} is not a string"
    if any(k in schema and not isinstance(schema[k], int) for k in _LENGTH_KEYS):
        return f"the length bounds of {where} are not integers"
    return None


def call_grammar_error(tools: Sequence[ToolSpec]) -> str | None:
    """Why no whole-call grammar can be built for `tools` (None: it can)."""
    for tool in tools:
        schema = _object_schema(tool)
        if schema.get("type", "object") != "object":
            return f"the parameters of {tool.name!r} are not an object schema"
        props = schema.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            return f"the properties of {tool.name!r} are not schemas"
        for key, sub in props.items():
            problem = _string_problem(tool, key, sub) if _is_string(sub) else None
            if problem:
                return problem
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
        choices = _string_choices(sub) if is_string else None
        if is_string and choices is None:
            # The value and its closing text as one lexeme (see the module docstring).
            terminal = f"{rule.upper()}_V{j}"
            rules += [f"{rule}_p{j}: {literal(open_text)} {terminal}",
                      f"{terminal}: ({string_value(syntax, sub)}) {literal(close_text)}"]
        else:
            value = " | ".join(literal(c) for c in choices) if choices else json_rule(sub)
            rules += [f"{rule}_p{j}: {literal(open_text)} {rule}_v{j} {literal(close_text)}",
                      f"{rule}_v{j}: {value}"]
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
