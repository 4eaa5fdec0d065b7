"""The `dsml` syntax: DeepSeek's markup for tool calls.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Accepted spellings when parsing: the block named `tool_calls`, `function_calls` or `calls`; a space after the
`｜DSML｜` prefix (the spaced variant of newer checkpoints, e.g. `<｜DSML｜ calls>`); ASCII bars `|DSML|`. A parameter
without a `string` attribute whose body starts with another parameter tag is a nested object built from its child
parameters; without `string` and without children, its body is decoded like an XML-style value (schema type, else
JSON when it parses to a non-string). Rendering always writes the canonical spelling with explicit `string`
attributes and one block holding every call. Values escape only the parameter closing tag; tool results are
`<tool_result>`...`</tool_result>` escaping only that tag. Reasoning uses `<think>`/`</think>`.
Names and keys are written unescaped inside double quotes: a name holding `"` cannot be expressed.
"""

from __future__ import annotations

import re
from typing import Optional

from server.tools.canonical import DelimiterEscaper
from server.tools.records import ToolCall, ToolResult, ToolSpec
from server.tools.syntax_base import (
    INCOMPLETE, MALFORMED, NAME_LIMIT, BlockScanner, Syntax, decode_value, encode_value, loads_or, tool_json)

_PREFIXES = ("｜DSML｜", "｜DSML｜ ", "|DSML|", "|DSML| ")
_BLOCK_NAMES = ("tool_calls", "function_calls", "calls")
BLOCK_OPENS = tuple(f"<{p}{n}>" for p in _PREFIXES for n in _BLOCK_NAMES)
BLOCK_CLOSES = tuple(f"</{p}{n}>" for p in _PREFIXES for n in _BLOCK_NAMES)
INVOKE_OPENS = tuple(f'<{p}invoke name="' for p in _PREFIXES)
INVOKE_CLOSES = tuple(f"</{p}invoke>" for p in _PREFIXES)
PARAM_OPENS = tuple(f'<{p}parameter name="' for p in _PREFIXES)
PARAM_CLOSES = tuple(f"</{p}parameter>" for p in _PREFIXES)

OPEN, CLOSE = BLOCK_OPENS[0], BLOCK_CLOSES[0]
INVOKE_OPEN, INVOKE_CLOSE = INVOKE_OPENS[0], INVOKE_CLOSES[0]
PARAM_OPEN, PARAM_CLOSE = PARAM_OPENS[0], PARAM_CLOSES[0]
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"

_VALUE_ESC = DelimiterEscaper(PARAM_CLOSES)
_RESULT_ESC = DelimiterEscaper([RESULT_CLOSE])
_PARAM_END = re.compile("|".join(re.escape(t) for t in PARAM_CLOSES))
_PARAM_END_MAX = max(len(t) for t in PARAM_CLOSES)
_NAME_END = re.compile('">')
_ATTR_END = re.compile(">")
_ATTRS = re.compile(r'([^"<>]+)"(?:\s+string="(true|false)")?\s*\Z')
_WS = re.compile(r"\s*")


class DsmlScanner(BlockScanner):
    """States: block (between invokes), iname, body (between parameters; nested when frames > 1), pattrs,
    peek (a parameter without `string`: nested or text?), value."""

    def __init__(self, tools):
        super().__init__(tools)
        self.state = "block"
        self.name = ""
        self.frames: list[tuple[str, dict]] = []  # (key in parent, object being built); frames[0] is the call
        self.key = ""
        self.string_attr: Optional[str] = None
        self.tag_start = 0

    def _closers(self) -> list[str]:
        """Canonical closing tags, innermost first, for the current nesting (used by repair)."""
        if self.state in ("block", "iname"):
            return [CLOSE]
        return [PARAM_CLOSE] * (len(self.frames) - 1) + [INVOKE_CLOSE, CLOSE]

    def _run(self) -> None:
        while self.status == INCOMPLETE:
            st = self.state
            if st in ("block", "body"):
                self.tag_start = _WS.match(self.buf, self.pos).end()
                if st == "block":
                    opts = INVOKE_OPENS + BLOCK_CLOSES
                else:
                    opts = PARAM_OPENS + (PARAM_CLOSES if len(self.frames) > 1 else INVOKE_CLOSES)
                r = self._expect(opts)
                if r is None:
                    return
                if r == MALFORMED:
                    return self._malformed()
                if r in BLOCK_CLOSES:
                    if not self.calls:
                        return self._malformed()
                    return self._complete()
                if r in INVOKE_OPENS:
                    self.state = "iname"
                elif r in PARAM_OPENS:
                    self.state = "pattrs"
                elif r in INVOKE_CLOSES:
                    self.calls.append((self.name, self.frames[0][1]))
                    self.frames, self.state = [], "block"
                else:  # a nested parameter object closes
                    key, obj = self.frames.pop()
                    self.frames[-1][1][key] = obj
            elif st == "iname":
                r = self._until(_NAME_END, 2, NAME_LIMIT)
                if r is None:
                    return
                if r == MALFORMED or not r[0].strip() or '"' in r[0] or "<" in r[0]:
                    return self._malformed()
                self.name, self.frames, self.state = r[0].strip(), [("", {})], "body"
            elif st == "pattrs":
                r = self._until(_ATTR_END, 1, NAME_LIMIT)
                if r is None:
                    return
                m = _ATTRS.match(r[0]) if r != MALFORMED else None
                if not m:
                    return self._malformed()
                self.key, self.string_attr = m.group(1), m.group(2)
                self.state = "value" if self.string_attr else "peek"
            elif st == "peek":
                p = _WS.match(self.buf, self.pos).end()
                head = self.buf[p:p + len(PARAM_OPENS[-1])]
                if any(self.buf.startswith(o, p) for o in PARAM_OPENS):
                    self.frames.append((self.key, {}))
                    self.state = "body"
                elif p == len(self.buf) or any(o.startswith(head) for o in PARAM_OPENS):
                    return  # cannot tell a nested object from a text value yet
                else:
                    self.state = "value"
            else:  # value
                self.in_payload = True
                r = self._until(_PARAM_END, _PARAM_END_MAX)
                if r is None:
                    return
                self.in_payload = False
                raw = _VALUE_ESC.unescape(r[0])
                if self.string_attr == "true":
                    value = raw
                elif self.string_attr == "false":
                    value = loads_or(raw.strip(), raw)
                else:
                    spec = self.tools.get(self.name) if len(self.frames) == 1 else None
                    value = decode_value(raw, spec.param_type(self.key) if spec else None)
                self.frames[-1][1][self.key] = value
                self.state = "body"

    def repair(self) -> Optional[tuple[int, str]]:
        st, n = self.state, len(self.buf)
        closers = self._closers()
        if st in ("iname", "pattrs"):
            return n - self.tag_start, "\n".join(closers)
        if st == "value":
            k = self._tail_is_prefix_of(PARAM_CLOSE)
            return 0, PARAM_CLOSE[k:] + "\n" + "\n".join(closers)
        if st == "peek":
            p = _WS.match(self.buf, self.pos).end()
            return n - p, PARAM_CLOSE + "\n" + "\n".join(closers)
        # Between tags: a half-written tag (opening or closing) is dropped, then every open tag is closed.
        p = _WS.match(self.buf, self.pos).end()
        return n - p, "\n".join(closers)


class Dsml(Syntax):
    name = "dsml"
    call_starts = BLOCK_OPENS

    def new_scanner(self, marker: str, tools: dict[str, ToolSpec]) -> BlockScanner:
        return DsmlScanner(tools)

    def render_tools(self, tools: list[ToolSpec]) -> str:
        lines = "\n".join(tool_json(t) for t in tools)
        return (
            "## Tools\n\n"
            "You have access to the following functions, described as JSON schemas:\n"
            f"<functions>\n{lines}\n</functions>\n\n"
            "To call functions, write one block in this exact format (several invokes may share the block):\n\n"
            f"{OPEN}\n{INVOKE_OPEN}$FUNCTION_NAME\">\n"
            f"{PARAM_OPEN}$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE{PARAM_CLOSE}\n"
            f"...\n{INVOKE_CLOSE}\n{CLOSE}\n\n"
            'Use string="true" for string values, written as plain text; use string="false" for numbers, booleans, '
            "arrays and objects, written as JSON."
        )

    call_suffix = f"{INVOKE_CLOSE}\n{CLOSE}"
    value_ends = PARAM_CLOSES

    def call_prefix(self, name: str) -> str:
        return f'{OPEN}\n{INVOKE_OPEN}{name}">\n'

    def param_literals(self, key: str, is_string: bool) -> tuple[str, str]:
        return f'{PARAM_OPEN}{key}" string="{"true" if is_string else "false"}">', f"{PARAM_CLOSE}\n"

    def render_calls(self, calls: list[ToolCall]) -> str:
        if not calls:
            return ""
        invokes = []
        for c in calls:
            params = "".join(
                f'{PARAM_OPEN}{k}" string="{"true" if isinstance(v, str) else "false"}">'
                f"{_VALUE_ESC.escape(encode_value(v))}{PARAM_CLOSE}\n" for k, v in c.arguments.items())
            invokes.append(f'{INVOKE_OPEN}{c.name}">\n{params}{INVOKE_CLOSE}\n')
        return f"{OPEN}\n{''.join(invokes)}{CLOSE}"

    def render_results(self, results: list[ToolResult]) -> str:
        return "\n".join(f"{RESULT_OPEN}{_RESULT_ESC.escape(r.content)}{RESULT_CLOSE}" for r in results)
