"""Streaming parser of generated text: visible content, reasoning and tool calls, for any syntax.

`ToolCallParser.feed(chunk)` returns the events that the text so far makes certain; `finish(finish_reason)` decides
whatever is still open and returns the `ParseResult`. The final result depends only on the concatenated text, never
on how it was chunked, and concatenating the events' deltas gives exactly the result's content and reasoning.
`parse_tool_output(syntax, text)` is the one-shot form.

Rules (in the order they bite):
- Partial markers are held back: a chunk ending in `<tool_ca` or `</thi` emits nothing of that tail until the next
  chunk shows whether it is a marker.
- Thinking: text between the thinking markers is reasoning (`starts_in_thinking=True` when the prompt already opened
  the block). A call marker inside thinking is not executable: its text stays reasoning if the block is later
  closed. If the output ends with thinking still open, the first call marker inside it that starts a complete,
  valid block is recovered: thinking is closed right before it and the rest is parsed as ordinary output. A
  `</think>` inside an argument value of such a block does not close thinking. A stray closing marker outside
  thinking is dropped.
- Calls: a start marker opens a block that the syntax's scanner follows. A complete valid block yields its calls;
  a block that cannot be valid is malformed and its marker becomes plain text (the text after it is parsed again as
  ordinary output). A block still open at `finish()` is repaired by dropping a half-written opening tag and closing
  the open tags in reverse nesting order; if that does not give a valid block it becomes plain text.
- Whitespace that only separates structure (around call blocks and thinking markers) is dropped; leading and
  trailing whitespace of the reasoning text is dropped too.
- Calls are reported whole when their block is decided: `ToolCallStart`, one `ToolCallArgumentsDelta` with the
  complete canonical arguments, `ToolCallEnd`. None of the three APIs can take back a streamed call, so a call is
  never announced before it is known to be valid.
- finish_reason: "tool_calls" when there is at least one call, else the engine's reason ("stop" stays "stop",
  "length" stays "length"), also when a malformed block was turned into text.

Sampling rule (`in_structure`): True while the text so far ends inside a call block and outside any argument value
(tags, names, JSON keys and punctuation); the server samples those tokens at temperature 0 and everything else, the
argument values included, at the request's temperature. For hermes JSON only string values count as payload.

This module does not assign meaning to API fields, render prompts or sample tokens.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Optional, Union

from server.tools.canonical import new_call_id
from server.tools.records import (
    ContentDelta, Event, ParseResult, ReasoningDelta, ToolCall, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart,
    ToolSpec)
from server.tools.registry import get_syntax
from server.tools.syntax_base import COMPLETE, INCOMPLETE, MALFORMED, BlockScanner, Syntax

CONTENT, THINK, HELD, CALL = "content", "think", "held", "call"


def _alternation(markers: Iterable[str]) -> re.Pattern:
    return re.compile("|".join(re.escape(m) for m in sorted(set(markers), key=len, reverse=True)))


def _partial_tail(buf: str, markers: tuple[str, ...], longest: int) -> int:
    """Length of the tail of `buf` that may still grow into a marker. Every marker has its only "<" first, so only
    the last "<" in reach can start one."""
    i = buf.rfind("<", max(0, len(buf) - longest + 1))
    if i < 0:
        return 0
    tail = buf[i:]
    return len(tail) if any(m.startswith(tail) for m in markers) else 0


class ToolCallParser:
    """Incremental parser for one generation. See the module docstring for the rules."""

    def __init__(self, syntax: Union[str, Syntax], *, tools: Optional[Iterable[ToolSpec]] = None,
                 starts_in_thinking: bool = False, id_prefix: str = "call_",
                 id_factory: Optional[Callable[[], str]] = None):
        self.syntax = get_syntax(syntax)
        self._tools = {t.name: t for t in (tools or [])}
        self._new_id = id_factory or (lambda: new_call_id(id_prefix))
        s = self.syntax
        self._content_markers = (s.think_open, s.think_close) + tuple(s.call_starts)
        self._think_markers = (s.think_close,) + tuple(s.call_starts)
        self._content_re = _alternation(self._content_markers)
        self._think_re = _alternation(self._think_markers)
        self._call_re = _alternation(s.call_starts)
        self._longest = max(len(m) for m in self._content_markers)
        self._mode = THINK if starts_in_thinking else CONTENT
        self._buf = ""
        self._raw: list[str] = []
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        self._ws = ""             # content whitespace held until we know it is not just before a marker
        self._skip_ws = False     # drop content whitespace right after structure
        self._rws = ""            # the same two for reasoning
        self._rskip = starts_in_thinking
        self._block_ws = ""       # whitespace dropped before the current block, restored if it is malformed
        self._marker = ""
        self._scanner: Optional[BlockScanner] = None
        self._held = ""           # thinking text from the first call marker on, undecided until </think> or the end
        self._held_from = 0
        self._repaired = False
        self._malformed = 0
        self._finished: Optional[ParseResult] = None

    # ---- public ------------------------------------------------------------------------------------------------
    @property
    def in_structure(self) -> bool:
        """True while generation is inside tool-call syntax and outside an argument value (sample greedily)."""
        return self._mode == CALL and self._scanner is not None and not self._scanner.in_payload

    @property
    def in_thinking(self) -> bool:
        return self._mode in (THINK, HELD)

    @property
    def calls_written(self) -> int:
        """Calls written out so far, including those complete inside a block still open (a DSML block
        holds several)."""
        pending = len(self._scanner.calls) if self._mode == CALL and self._scanner is not None else 0
        return len(self._calls) + pending

    def feed(self, chunk: str) -> list[Event]:
        if self._finished is not None:
            raise RuntimeError("feed() after finish()")
        out: list[Event] = []
        if chunk:
            self._raw.append(chunk)
            self._buf += chunk
            self._process(False, out)
        return out

    def finish(self, finish_reason: str = "stop") -> ParseResult:
        """Decide everything still open. `finish_reason` is the engine's: "stop" or "length"."""
        if self._finished is not None:
            return self._finished
        out: list[Event] = []
        self._process(True, out)
        if self._ws:
            self._push_content_raw(self._ws, out)
            self._ws = ""
        self._finished = ParseResult(
            content="".join(self._content), reasoning="".join(self._reasoning), tool_calls=list(self._calls),
            finish_reason="tool_calls" if self._calls else finish_reason, repaired=self._repaired,
            malformed=self._malformed, raw="".join(self._raw), events=out)
        return self._finished

    # ---- emission ----------------------------------------------------------------------------------------------
    def _push_content_raw(self, text: str, out: list) -> None:
        self._content.append(text)
        out.append(ContentDelta(text))

    def _emit_content(self, text: str, out: list) -> None:
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        full = self._ws + text
        body = full.rstrip()
        self._ws = full[len(body):]
        if body:
            self._push_content_raw(body, out)

    def _emit_reasoning(self, text: str, out: list) -> None:
        if self._rskip:
            text = text.lstrip()
            if not text:
                return
            self._rskip = False
        full = self._rws + text
        body = full.rstrip()
        self._rws = full[len(body):]
        if body:
            self._reasoning.append(body)
            out.append(ReasoningDelta(body))

    def _accept(self, scanner: BlockScanner, raw: str, repaired: bool, out: list) -> None:
        for name, args in scanner.calls:
            call = ToolCall(id=self._new_id(), name=name, arguments=args, raw=raw, repaired=repaired)
            index = len(self._calls)
            self._calls.append(call)
            out.append(ToolCallStart(index, call.id, name))
            out.append(ToolCallArgumentsDelta(index, call.id, call.arguments_json))
            out.append(ToolCallEnd(index, call))
        self._repaired = self._repaired or repaired

    def _reject(self, out: list) -> None:
        """The current block is not a call: its marker becomes text and what followed is parsed again."""
        self._malformed += 1
        self._ws = self._block_ws + self._ws
        self._emit_content(self._marker, out)
        self._buf = self._scanner.buf + self._buf
        self._scanner, self._mode = None, CONTENT

    # ---- the state machine -------------------------------------------------------------------------------------
    def _process(self, final: bool, out: list) -> None:
        while True:
            mode = self._mode
            if mode == CONTENT:
                if not self._step_content(final, out):
                    return
            elif mode == THINK:
                if not self._step_think(final, out):
                    return
            elif mode == HELD:
                if not self._step_held(final, out):
                    return
            elif not self._step_call(final, out):
                return

    def _step_content(self, final: bool, out: list) -> bool:
        buf, s = self._buf, self.syntax
        if "<" not in buf:  # no marker and no start of one (`_partial_tail`): the usual token of text
            self._emit_content(buf, out)
            self._buf = ""
            return False
        m = self._content_re.search(buf)
        if not m:
            cut = len(buf) if final else len(buf) - _partial_tail(buf, self._content_markers, self._longest)
            self._emit_content(buf[:cut], out)
            self._buf = buf[cut:]
            return False
        self._emit_content(buf[:m.start()], out)
        self._buf = buf[m.end():]
        tok = m.group()
        if tok == s.think_open:
            self._ws, self._mode, self._rskip, self._rws = "", THINK, True, ""
        elif tok == s.think_close:
            self._ws, self._skip_ws = "", True
        else:
            self._block_ws, self._ws = self._ws, ""
            self._marker, self._mode = tok, CALL
            self._scanner = s.new_scanner(tok, self._tools)
        return True

    def _step_think(self, final: bool, out: list) -> bool:
        buf = self._buf
        m = self._think_re.search(buf)
        if not m:
            cut = len(buf) if final else len(buf) - _partial_tail(buf, self._think_markers, self._longest)
            self._emit_reasoning(buf[:cut], out)
            self._buf = buf[cut:]
            if final:
                self._rws = ""
            return False
        self._emit_reasoning(buf[:m.start()], out)
        if m.group() == self.syntax.think_close:
            self._buf, self._mode, self._skip_ws, self._rws = buf[m.end():], CONTENT, True, ""
        else:
            self._held, self._held_from, self._buf, self._mode = buf[m.start():], len(m.group()), "", HELD
        return True

    def _step_held(self, final: bool, out: list) -> bool:
        self._held += self._buf
        self._buf = ""
        held, close = self._held, self.syntax.think_close
        while True:
            i = held.find(close, self._held_from)
            if i < 0:
                self._held_from = max(self._held_from, len(held) - len(close) + 1)
                break
            if self._close_is_literal(held, i):
                self._held_from = i + 1
                continue
            self._emit_reasoning(held[:i], out)
            self._held, self._buf = "", held[i + len(close):]
            self._mode, self._skip_ws, self._rws = CONTENT, True, ""
            return True
        if not final:
            return False
        # Output ended inside thinking: recover the first complete call, if any.
        for m in self._call_re.finditer(held):
            sc = self.syntax.new_scanner(m.group(), self._tools)
            sc.push(held[m.end():])
            if sc.status == COMPLETE:
                self._emit_reasoning(held[:m.start()], out)
                self._held, self._buf, self._mode, self._rws = "", held[m.start():], CONTENT, ""
                return True
        self._emit_reasoning(held, out)
        self._held, self._rws = "", ""
        return False

    def _close_is_literal(self, held: str, i: int) -> bool:
        """Whether the thinking close marker at held[i] sits inside an argument value of a call being written."""
        last = None
        for last in self._call_re.finditer(held, 0, i):
            pass
        if last is None:
            return False
        sc = self.syntax.new_scanner(last.group(), self._tools)
        sc.push(held[last.end():i])
        return sc.status == INCOMPLETE and sc.in_payload

    def _step_call(self, final: bool, out: list) -> bool:
        sc = self._scanner
        if self._buf:
            sc.push(self._buf)
            self._buf = ""
        if sc.status == COMPLETE:
            self._accept(sc, self._marker + sc.buf[:sc.end], False, out)
            self._buf = sc.leftover + self._buf
            self._scanner, self._mode, self._skip_ws = None, CONTENT, True
            return True
        if sc.status == MALFORMED:
            self._reject(out)
            return True
        if not final:
            return False
        fix = sc.repair()
        if fix is not None:
            drop, append = fix
            text = sc.buf[:len(sc.buf) - drop] + append
            probe = self.syntax.new_scanner(self._marker, self._tools)
            probe.push(text)
            if probe.status == COMPLETE and probe.end == len(text):
                self._accept(probe, self._marker + sc.buf, True, out)
                self._scanner, self._mode, self._skip_ws = None, CONTENT, True
                return True
        self._reject(out)
        return True


def parse_tool_output(syntax: Union[str, Syntax], text: str, *, tools: Optional[Iterable[ToolSpec]] = None,
                      starts_in_thinking: bool = False, finish_reason: str = "stop",
                      id_prefix: str = "call_") -> ParseResult:
    """Parse a complete generation: visible content, reasoning, and tool calls after thinking isolation and repair."""
    parser = ToolCallParser(syntax, tools=tools, starts_in_thinking=starts_in_thinking, id_prefix=id_prefix)
    parser.feed(text)
    return parser.finish(finish_reason)
