"""The `hermes` syntax: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (SmolLM2, Qwen2.5 family).

One JSON object per block; parallel calls are consecutive blocks. The scanner follows JSON strings and nesting, so
a `</tool_call>` (or `</think>`) inside an argument string does not end the block. Arguments may also arrive as a
JSON string holding an object, or under the key "parameters"; both are accepted. Tool results are wrapped in
`<tool_response>`...`</tool_response>`, escaping only that closing delimiter. This module does not decide where a
block may start (see `server.tools.parser`).
"""

from __future__ import annotations

import re
from typing import Optional

from server.tools.canonical import DelimiterEscaper, canonical_json
from server.tools.records import ToolCall, ToolResult, ToolSpec
from server.tools.syntax_base import INCOMPLETE, MALFORMED, BlockScanner, Syntax, loads_strict, tools_block

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
_RESULT_ESC = DelimiterEscaper([RESULT_CLOSE])

# Outside strings only these may appear in JSON; anything else (prose after a stray marker) is malformed at once.
_OUTSIDE = re.compile(r"[^\s0-9A-Za-z+\-.]")
_IN_STRING = re.compile(r'["\\]')


def call_from_json(obj) -> Optional[tuple[str, dict]]:
    """(name, arguments) from a decoded hermes object, or None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = loads_strict(args) if args.strip() else {}
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return obj["name"], args


class HermesScanner(BlockScanner):
    """States: "pre" (whitespace, then "{"), "json" (inside the object), "post" (whitespace, then the close tag)."""

    def __init__(self, tools):
        super().__init__(tools)
        self.state = "pre"
        self.json_start = 0
        self.stack: list[str] = []
        self.in_str = False
        self.esc = False
        self.expect_key = False
        self.str_is_payload = False

    def _run(self) -> None:
        while self.status == INCOMPLETE:
            if self.state == "pre":
                r = self._expect(["{"])
                if r is None:
                    return
                if r == MALFORMED:
                    return self._malformed()
                self.json_start = self.pos - 1
                self.stack, self.expect_key, self.state = ["{"], True, "json"
            elif self.state == "json":
                if not self._scan_json():
                    return
            else:
                r = self._expect([CLOSE])
                if r is None:
                    return
                if r == MALFORMED:
                    return self._malformed()
                self._finish_block()

    def _scan_json(self) -> bool:
        """Advance through JSON; True when the object closed (state moved on) or the block was decided."""
        buf = self.buf
        while True:
            if self.in_str:
                if self.esc:
                    if self.pos >= len(buf):
                        return False
                    self.pos += 1
                    self.esc = False
                    continue
                m = _IN_STRING.search(buf, self.pos)
                if not m:
                    self.pos = len(buf)
                    return False
                self.pos = m.end()
                if m.group() == "\\":
                    self.esc = True
                else:
                    self.in_str = False
                    self.in_payload = False
                continue
            m = _OUTSIDE.search(buf, self.pos)
            if not m:
                self.pos = len(buf)
                return False
            c = m.group()
            self.pos = m.end()
            top = self.stack[-1]
            if c == '"':
                is_key = top == "{" and self.expect_key
                self.in_str = True
                # Keys and the call's own name are structure; string values inside "arguments" are payload.
                self.in_payload = (not is_key) and len(self.stack) >= 2
            elif c in "{[":
                self.stack.append(c)
                self.expect_key = c == "{"
            elif c in "}]":
                if (c == "}") != (top == "{"):
                    self._malformed()
                    return True
                self.stack.pop()
                if not self.stack:
                    self.state = "post"
                    return True
                self.expect_key = False
            elif c == ",":
                self.expect_key = top == "{"
            elif c == ":":
                self.expect_key = False
            else:
                self._malformed()
                return True

    def _finish_block(self) -> None:
        text = self.buf[self.json_start:self.pos - len(CLOSE)].rstrip()
        try:
            call = call_from_json(loads_strict(text))
        except ValueError:
            call = None
        if call is None:
            return self._malformed()
        self.calls = [call]
        self._complete()

    def repair(self) -> Optional[tuple[int, str]]:
        if self.state == "pre":
            return None
        if self.state == "post":
            k = self._tail_is_prefix_of(CLOSE)
            if self.buf[self.pos:].strip() and not k:
                return None
            return 0, CLOSE[k:] if k else "\n" + CLOSE
        if self.in_str and len(self.stack) == 1:
            return None  # cut inside the name or a top-level key: closing it would invent a different call
        if self.in_str and self.esc:
            return 1, '"' + "".join("}" if s == "{" else "]" for s in reversed(self.stack)) + "\n" + CLOSE
        closers = "".join("}" if s == "{" else "]" for s in reversed(self.stack))
        return 0, ('"' if self.in_str else "") + closers + "\n" + CLOSE


class Hermes(Syntax):
    name = "hermes"
    call_starts = (OPEN,)

    def new_scanner(self, marker: str, tools: dict[str, ToolSpec]) -> BlockScanner:
        return HermesScanner(tools)

    def render_tools(self, tools: list[ToolSpec]) -> str:
        return tools_block(tools) + (
            "To call a function, write a JSON object with the function name and its arguments inside "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    call_suffix = f"}}\n{CLOSE}"
    json_arguments = True

    def call_prefix(self, name: str) -> str:
        return f"{OPEN}\n{canonical_json({'name': name})[:-1]}, \"arguments\": "

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(
            f"{OPEN}\n{canonical_json({'name': c.name, 'arguments': c.arguments})}\n{CLOSE}" for c in calls)

    def render_results(self, results: list[ToolResult]) -> str:
        return "\n".join(f"{RESULT_OPEN}\n{_RESULT_ESC.escape(r.content)}\n{RESULT_CLOSE}" for r in results)
