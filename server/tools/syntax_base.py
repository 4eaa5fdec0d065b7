"""The contract every tool-call syntax implements, and the incremental-scanning helpers they share.

A syntax knows: its thinking markers, the literal markers that open a tool-call block, how to render tool
definitions / assistant calls / tool results into prompt text, and how to scan one block incrementally
(`BlockScanner`). It does not decide where blocks may occur (thinking isolation, malformed-text fallback and repair
policy live in `server.tools.parser`) and it never touches an engine or an HTTP API.

Scanner contract: a scanner is created right after a start marker and is pushed the text that follows, in chunks of
any size. Its `status` becomes "complete" exactly when the block's closing marker has been read (then `end` is the
length of pushed text the block used and `calls` holds (name, arguments) pairs), or "malformed" at the first
character that cannot belong to a block. The decision depends only on the text, never on how it was chunked.
`in_payload` is True while the pushed text ends inside an argument value. `repair()` says how to close an unfinished
block: how many trailing characters to drop (a half-written opening tag) and what closing text to append.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Optional

from server.tools.canonical import canonical_json
from server.tools.records import ToolCall, ToolResult, ToolSpec

INCOMPLETE, COMPLETE, MALFORMED = "incomplete", "complete", "malformed"
_WS = re.compile(r"\s*")
# Names of functions and parameters: bounded so that prose after a stray marker is rejected quickly.
NAME_LIMIT = 256


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def loads_strict(text: str) -> Any:
    """json.loads that refuses NaN/Infinity (they cannot be re-rendered canonically)."""
    return json.loads(text, parse_constant=_reject_constant)


def loads_or(text: str, default: Any) -> Any:
    """loads_strict(text), or `default` when the text is not JSON."""
    try:
        return loads_strict(text)
    except ValueError:
        return default


def decode_value(raw: str, declared: Any) -> Any:
    """Turn the text of an XML-style argument value into a Python value.

    Declared "string" (per the tool's schema): the text as is. Declared another type: JSON if it parses, else text.
    Undeclared: JSON if it parses to a non-string (number, bool, null, object, array), else the text unchanged, so
    a string value "\\"hi\\"" round-trips through render and parse."""
    types = declared if isinstance(declared, list) else [declared]
    if declared is not None and all(t == "string" for t in types):
        return raw
    try:
        value = loads_strict(raw.strip())
    except ValueError:
        return raw
    if isinstance(value, str) and declared is None:
        return raw
    if isinstance(value, str) and "string" not in types:
        return raw
    return value


def encode_value(value: Any) -> str:
    """The text of an XML-style argument value: strings as themselves, everything else canonical JSON."""
    return value if isinstance(value, str) else canonical_json(value)


def tools_block(tools: Iterable[ToolSpec]) -> str:
    """The '# Tools' preamble with every definition inside <tools></tools>, as the hermes and
    glm families of chat templates write it; each syntax appends its own calling instructions."""
    lines = "\n".join(tool_json(t) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request.\n\n"
        "The available function signatures are listed inside <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
    )


def tool_json(tool: ToolSpec) -> str:
    """One tool definition as a canonical JSON line (the same bytes whichever API the tool arrived through)."""
    fn: dict = {"name": tool.name}
    if tool.description:
        fn["description"] = tool.description
    fn["parameters"] = tool.parameters
    return canonical_json({"type": "function", "function": fn})


class BlockScanner:
    """Incremental scanner base: holds the pushed text and a cursor, offers expect/read-until helpers."""

    def __init__(self, tools: dict[str, ToolSpec]):
        self.tools = tools
        self.buf = ""
        self.pos = 0
        self.status = INCOMPLETE
        self.end = 0
        self.calls: list[tuple[str, dict]] = []
        self.in_payload = False
        self._from = 0  # where the next terminator search may start (avoids rescanning long values)

    @property
    def leftover(self) -> str:
        return self.buf[self.end:]

    def push(self, text: str) -> None:
        if self.status != INCOMPLETE:
            raise RuntimeError("push after the block was decided")
        self.buf += text
        self._run()

    def repair(self) -> Optional[tuple[int, str]]:
        """(number of trailing characters to drop, text to append) that closes the block, or None."""
        raise NotImplementedError

    def _run(self) -> None:
        raise NotImplementedError

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _complete(self) -> None:
        self.status, self.end, self.in_payload = COMPLETE, self.pos, False

    def _malformed(self) -> None:
        self.status, self.in_payload = MALFORMED, False

    def _expect(self, options: Iterable[str], skip_ws: bool = True):
        """After optional whitespace, consume one of `options`. Returns the option, None (need more text) or
        MALFORMED."""
        if skip_ws:
            self.pos = _WS.match(self.buf, self.pos).end()
        for o in options:
            if self.buf.startswith(o, self.pos):
                self.pos += len(o)
                return o
        tail = self.buf[self.pos:self.pos + max(len(o) for o in options)]
        if any(o.startswith(tail) for o in options):
            return None
        return MALFORMED

    def _pending_prefix(self, options: Iterable[str]) -> Optional[str]:
        """The option that the unread tail (after whitespace) is a proper prefix of, if any."""
        p = _WS.match(self.buf, self.pos).end()
        tail = self.buf[p:]
        for o in options:
            if tail and o.startswith(tail):
                return o
        return None

    def _until(self, term: re.Pattern, term_max: int, limit: Optional[int] = None):
        """Read up to the next match of `term`. Returns (text, matched terminator), None (need more text) or
        MALFORMED when more than `limit` characters pass without a terminator."""
        m = term.search(self.buf, max(self.pos, self._from))
        if m:
            text = self.buf[self.pos:m.start()]
            self.pos, self._from = m.end(), 0
            return text, m.group()
        if limit is not None and len(self.buf) - self.pos > limit:
            return MALFORMED
        self._from = max(self.pos, len(self.buf) - term_max + 1)
        return None

    def _tail_is_prefix_of(self, term: str) -> int:
        """Length of the longest suffix of buf (after pos) that is a proper prefix of `term`."""
        for k in range(min(len(term) - 1, len(self.buf) - self.pos), 0, -1):
            if term.startswith(self.buf[len(self.buf) - k:]):
                return k
        return 0


class Syntax:
    """Base of all syntaxes. Subclasses set the markers and implement rendering and `new_scanner`."""

    name = ""
    think_open = "<think>"
    think_close = "</think>"
    call_starts: tuple[str, ...] = ()
    # Role under which tool results are handed to the chat template (they are rendered into its content).
    result_role = "user"

    def new_scanner(self, marker: str, tools: dict[str, ToolSpec]) -> BlockScanner:
        raise NotImplementedError

    def render_tools(self, tools: list[ToolSpec]) -> str:
        raise NotImplementedError

    def render_calls(self, calls: list[ToolCall]) -> str:
        raise NotImplementedError

    def call_prefix(self, name: str) -> str:
        """The text a call of function `name` starts with, up to where its arguments begin: a prefix of
        `render_calls` for that call (forced when `tool_choice` requires a call)."""
        raise NotImplementedError

    # What follows a call's arguments in `render_calls` (for the whole-call grammar, `server.tools.grammar`).
    call_suffix = ""
    # True: a call's arguments are one JSON object; False: one parameter block per argument (`param_literals`).
    json_arguments = False

    # The texts that end an argument value (XML-style syntaxes): a value holds none of them except
    # escaped (`canonical.DelimiterEscaper`, which the scanner undoes).
    value_ends: tuple[str, ...] = ()

    def param_literals(self, key: str, is_string: bool) -> tuple[str, str]:
        """The text around the value of argument `key` as `render_calls` writes it (XML-style syntaxes),
        `is_string` saying whether the value is written as text or as JSON."""
        raise NotImplementedError

    def render_results(self, results: list[ToolResult]) -> str:
        raise NotImplementedError

    def render_assistant(self, content: str, calls: list[ToolCall]) -> str:
        """An assistant turn's text: its visible content followed by its calls."""
        if not calls:
            return content
        rendered = self.render_calls(calls)
        return f"{content}\n{rendered}" if content else rendered

    def prompt_opens_thinking(self, prompt: str) -> bool:
        """Whether a rendered prompt leaves the model inside a thinking block (the template wrote the opening
        marker), so generation must be parsed with `starts_in_thinking=True`."""
        tail = prompt.rstrip()
        return tail.endswith(self.think_open)
