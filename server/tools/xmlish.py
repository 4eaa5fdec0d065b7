"""The `qwen-xml` and `glm` syntaxes: XML-style blocks whose argument values are raw text.

qwen-xml (Qwen3-Coder):
    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
glm (GLM-4.5 family):
    <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>

A value ends only at its own closing tag, so a literal `</tool_call>` or `</think>` inside it is text. String values
are written as themselves and everything else as canonical JSON; on parsing, the tool's schema (when given) decides,
else `syntax_base.decode_value`'s rule applies. Values escape only their own closing tag. Tool results use
`<tool_response>` like hermes. This module does not decide where blocks may start (see `server.tools.parser`).
"""

from __future__ import annotations

import re
from typing import Optional

from server.tools.canonical import DelimiterEscaper
from server.tools.records import ToolCall, ToolResult, ToolSpec
from server.tools.syntax_base import (
    INCOMPLETE, MALFORMED, NAME_LIMIT, BlockScanner, Syntax, decode_value, encode_value, tool_json, tools_block)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
_RESULT_ESC = DelimiterEscaper([RESULT_CLOSE])
_GT = re.compile(">")
_BAD_NAME = re.compile(r"[\s<>\"]")
_BAD_NAME_CHARS = re.compile(r"[<>\"]")


def _valid_name(name: str) -> bool:
    return bool(name) and not _BAD_NAME.search(name)


def _result_block(results: list[ToolResult]) -> str:
    return "\n".join(f"{RESULT_OPEN}\n{_RESULT_ESC.escape(r.content)}\n{RESULT_CLOSE}" for r in results)


class _CallScanner(BlockScanner):
    """One call block read as a state machine: its name, then key/value arguments."""

    first_state = ""

    def __init__(self, tools):
        super().__init__(tools)
        self.state = self.first_state
        self.name = ""
        self.key = ""
        self.args: dict = {}
        self.tag_start = 0  # where the tag being read began, for repair()


# ---- qwen-xml ---------------------------------------------------------------------------------------------------

Q_FUNC, Q_FUNC_END = "<function=", "</function>"
Q_PARAM, Q_PARAM_END = "<parameter=", "</parameter>"
_Q_ESC = DelimiterEscaper([Q_PARAM_END])
_Q_VALUE_END = re.compile(re.escape(Q_PARAM_END))


class QwenXmlScanner(_CallScanner):
    first_state = "func"

    def _run(self) -> None:
        while self.status == INCOMPLETE:
            st = self.state
            if st in ("func", "params", "post"):
                opts = {"func": [Q_FUNC], "params": [Q_PARAM, Q_FUNC_END], "post": [CLOSE]}[st]
                self.tag_start = _skip(self)
                r = self._expect(opts)
                if r is None:
                    return
                if r == MALFORMED:
                    return self._malformed()
                if r == CLOSE:
                    self.calls = [(self.name, self.args)]
                    return self._complete()
                self.state = {Q_FUNC: "fname", Q_PARAM: "pname", Q_FUNC_END: "post"}[r]
            elif st in ("fname", "pname"):
                r = self._until(_GT, 1, NAME_LIMIT)
                if r is None:
                    return
                if r == MALFORMED or not _valid_name(r[0].strip()):
                    return self._malformed()
                if st == "fname":
                    self.name, self.state = r[0].strip(), "params"
                else:
                    self.key, self.state = r[0].strip(), "value"
            else:  # value
                self.in_payload = True
                r = self._until(_Q_VALUE_END, len(Q_PARAM_END))
                if r is None:
                    return
                self.in_payload = False
                raw = r[0]
                # The renderer puts the value on its own lines; one newline on each side is layout, not data.
                if raw.startswith("\n"):
                    raw = raw[1:]
                if raw.endswith("\n"):
                    raw = raw[:-1]
                spec = self.tools.get(self.name)
                self.args[self.key] = decode_value(_Q_ESC.unescape(raw), spec.param_type(self.key) if spec else None)
                self.state = "params"

    def repair(self) -> Optional[tuple[int, str]]:
        st, n = self.state, len(self.buf)
        tail = "\n" + Q_FUNC_END + "\n" + CLOSE
        if st in ("func", "fname"):
            return None
        if st == "pname":
            return n - self.tag_start, tail
        if st == "value":
            k = self._tail_is_prefix_of(Q_PARAM_END)
            return 0, (Q_PARAM_END[k:] if k else "\n" + Q_PARAM_END) + tail
        if st == "post":
            k = self._tail_is_prefix_of(CLOSE)
            return 0, CLOSE[k:] if k else "\n" + CLOSE
        pending = self._pending_prefix([Q_PARAM, Q_FUNC_END])
        if pending == Q_FUNC_END:
            return 0, Q_FUNC_END[self._tail_is_prefix_of(Q_FUNC_END):] + "\n" + CLOSE
        return (n - self.tag_start if pending else 0), tail


def _skip(scanner: BlockScanner) -> int:
    """Position of the next non-space character: where the tag about to be expected starts."""
    return len(scanner.buf) - len(scanner.buf[scanner.pos:].lstrip())


class QwenXml(Syntax):
    name = "qwen-xml"
    call_starts = (OPEN,)

    def new_scanner(self, marker: str, tools: dict[str, ToolSpec]) -> BlockScanner:
        return QwenXmlScanner(tools)

    def render_tools(self, tools: list[ToolSpec]) -> str:
        lines = "\n".join(tool_json(t) for t in tools)
        return (
            "# Tools\n\n"
            "You can call the following functions:\n\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "To call a function, reply with a block in exactly this format:\n\n"
            "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
            "</parameter>\n<parameter=example_parameter_2>\nThis value\nspans several lines\n</parameter>\n"
            "</function>\n</tool_call>\n\n"
            "Write every required parameter. Put nothing after the closing </tool_call> tag."
        )

    call_suffix = f"{Q_FUNC_END}\n{CLOSE}"
    value_ends = (Q_PARAM_END,)

    def call_prefix(self, name: str) -> str:
        return f"{OPEN}\n{Q_FUNC}{name}>\n"

    def param_literals(self, key: str, is_string: bool) -> tuple[str, str]:
        return f"{Q_PARAM}{key}>\n", f"\n{Q_PARAM_END}\n"

    def render_calls(self, calls: list[ToolCall]) -> str:
        blocks = []
        for c in calls:
            params = "".join(
                f"{Q_PARAM}{k}>\n{_Q_ESC.escape(encode_value(v))}\n{Q_PARAM_END}\n" for k, v in c.arguments.items())
            blocks.append(f"{OPEN}\n{Q_FUNC}{c.name}>\n{params}{Q_FUNC_END}\n{CLOSE}")
        return "\n".join(blocks)

    def render_results(self, results: list[ToolResult]) -> str:
        return _result_block(results)


# ---- glm --------------------------------------------------------------------------------------------------------

G_KEY, G_KEY_END = "<arg_key>", "</arg_key>"
G_VAL, G_VAL_END = "<arg_value>", "</arg_value>"
_G_KEY_ESC = DelimiterEscaper([G_KEY_END])
_G_VAL_ESC = DelimiterEscaper([G_VAL_END])
_G_NAME_END = re.compile(re.escape(G_KEY) + "|" + re.escape(CLOSE))
_G_KEY_TERM = re.compile(re.escape(G_KEY_END))
_G_VAL_TERM = re.compile(re.escape(G_VAL_END))


class GlmScanner(_CallScanner):
    first_state = "name"

    def _run(self) -> None:
        while self.status == INCOMPLETE:
            st = self.state
            if st == "name":
                r = self._until(_G_NAME_END, len(CLOSE), NAME_LIMIT)
                if r is None:
                    if not self._name_may_continue():
                        return self._malformed()
                    return
                if r == MALFORMED or not _valid_name(r[0].strip()):
                    return self._malformed()
                self.name = r[0].strip()
                if r[1] == CLOSE:
                    self.calls = [(self.name, self.args)]
                    return self._complete()
                self.state = "key"
            elif st in ("args", "preval"):
                self.tag_start = _skip(self)
                r = self._expect([G_KEY, CLOSE] if st == "args" else [G_VAL])
                if r is None:
                    return
                if r == MALFORMED:
                    return self._malformed()
                if r == CLOSE:
                    self.calls = [(self.name, self.args)]
                    return self._complete()
                self.state = "key" if r == G_KEY else "value"
            elif st == "key":
                r = self._until(_G_KEY_TERM, len(G_KEY_END), NAME_LIMIT)
                if r is None:
                    return
                if r == MALFORMED:
                    return self._malformed()
                self.key, self.state = _G_KEY_ESC.unescape(r[0]), "preval"
            else:  # value
                self.in_payload = True
                r = self._until(_G_VAL_TERM, len(G_VAL_END))
                if r is None:
                    return
                self.in_payload = False
                spec = self.tools.get(self.name)
                raw = _G_VAL_ESC.unescape(r[0])
                self.args[self.key] = decode_value(raw, spec.param_type(self.key) if spec else None)
                self.state = "args"

    def _name_may_continue(self) -> bool:
        """Fail fast on prose after a stray marker: a name is one run of non-space characters, optionally followed
        by whitespace and the start of `<arg_key>` or `</tool_call>`."""
        region = self.buf[self.pos:]
        lt = region.find("<")
        head, tag = (region, "") if lt < 0 else (region[:lt], region[lt:])
        if len(head.split()) > 1 or _BAD_NAME_CHARS.search(head):
            return False
        return not tag or any(t.startswith(tag) for t in (G_KEY, CLOSE))

    def repair(self) -> Optional[tuple[int, str]]:
        st, n = self.state, len(self.buf)
        if st == "name":
            return None
        if st in ("key", "preval"):
            return n - self.tag_start, "\n" + CLOSE
        if st == "value":
            k = self._tail_is_prefix_of(G_VAL_END)
            return 0, (G_VAL_END[k:] if k else G_VAL_END) + "\n" + CLOSE
        pending = self._pending_prefix([G_KEY, CLOSE])
        if pending == CLOSE:
            return 0, CLOSE[self._tail_is_prefix_of(CLOSE):]
        return (n - self.tag_start if pending else 0), "\n" + CLOSE


class Glm(Syntax):
    name = "glm"
    call_starts = (OPEN,)

    def new_scanner(self, marker: str, tools: dict[str, ToolSpec]) -> BlockScanner:
        return GlmScanner(tools)

    def render_tools(self, tools: list[ToolSpec]) -> str:
        return tools_block(tools) + (
            "To call a function, write its name and arguments in this XML format:\n"
            "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
            "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
        )

    call_suffix = CLOSE
    value_ends = (G_VAL_END,)

    def call_prefix(self, name: str) -> str:
        return f"{OPEN}{name}\n"

    def param_literals(self, key: str, is_string: bool) -> tuple[str, str]:
        return f"{G_KEY}{_G_KEY_ESC.escape(key)}{G_KEY_END}\n{G_VAL}", f"{G_VAL_END}\n"

    def render_calls(self, calls: list[ToolCall]) -> str:
        blocks = []
        for c in calls:
            args = "".join(
                f"{G_KEY}{_G_KEY_ESC.escape(k)}{G_KEY_END}\n{G_VAL}{_G_VAL_ESC.escape(encode_value(v))}{G_VAL_END}\n"
                for k, v in c.arguments.items())
            blocks.append(f"{OPEN}{c.name}\n{args}{CLOSE}")
        return "\n".join(blocks)

    def render_results(self, results: list[ToolResult]) -> str:
        return _result_block(results)
