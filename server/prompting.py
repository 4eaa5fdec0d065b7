"""The two text seams between the APIs and the model: prompt rendering and output splitting.

Rendering: every chat API maps its request onto the API-neutral records of `server.tools`
(`Message`, `ToolSpec`) and calls `ToolCalling.render`. Every client string in them is
escaped first (`engine.prompt_text`), so the rendered text is prompt text: the template's
markers become control tokens, a `<|im_start|>` typed into a message stays text
(`prompt_ids`). The conversation is rendered by the
model's tool syntax (tool definitions canonically, before the client's system prompt;
assistant calls from the exact replay memory when possible; tool results in call order)
into plain `{"role", "content"}` messages, which the model's own chat template then turns
into prompt text (without its own tool rendering: the syntax already did that).

Splitting: `OutputSplitter` wraps the syntax's streaming `ToolCallParser` for one
generation. The inference worker feeds it every piece of text as it is produced (so that
`in_structure` is current before the next token is sampled) and forwards the resulting
events — `ContentDelta`, `ReasoningDelta`, `ToolCallEnd` (a complete call) — to the API
layer; `finish(engine_reason)` returns the whole `ParsedOutput`. A turn that made calls is
remembered, byte for byte, in the replay memory under its call ids.

`ToolCalling` holds the per-server state (syntax, replay memory and the lock that guards
it); it is created once per app. Nothing here does I/O besides an info log line per
rendered chat that involves tools; the model is only asked to render its template (twice
per chat: also the turns before the last user message, whose length is the `user_boundary`
where the disk KV cache takes its checkpoint).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from server.tools import (ContentDelta, Message, ReasoningDelta, ReplayMemory, Syntax, ToolCall,
                          ToolCallEnd, ToolCallParser, ToolSpec, ToolsConfig, detect_syntax, get_syntax,
                          render_conversation)
from engine.prompt_text import escape_strings
from server.tools.apis import ID_PREFIX

log = logging.getLogger("ds4.server.tools")

OutputEvent = ContentDelta | ReasoningDelta | ToolCallEnd

__all__ = ["ChatPrompt", "ContentDelta", "OutputEvent", "OutputSplitter", "ParsedOutput", "ReasoningDelta",
           "ToolCall", "ToolCallEnd", "ToolCalling", "last_user_head", "model_syntax", "prompt_ids"]


@dataclass
class ParsedOutput:
    """A finished generation as the APIs answer it.

    `finish_reason` is the parser's: "tool_calls" when there is at least one call (also for
    a call repaired at the token limit), else the engine's "stop" or "length". `events` are
    the events produced by `finish()` itself (the tail a stream still has to send)."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    raw: str = ""
    repaired: bool = False
    malformed: int = 0
    events: list[OutputEvent] = field(default_factory=list)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat prompt and what parsing its continuation needs."""
    text: str
    tools: tuple[ToolSpec, ...] = ()
    thinking_prefix: str = ""
    """The thinking-open text the prompt ends with ("" when the prompt does not open thinking);
    it belongs to the model's turn, so it is part of the text remembered for replay."""
    user_boundary: int | None = None
    """Character offset where the last user turn starts (the conversation before it, rendered
    without a generation prompt, is a prefix of `text`); None when there is no earlier turn or
    the template does not render that way. The disk KV cache checkpoints there."""


def model_syntax(model: Any, override: str | None = None) -> Syntax:
    """The tool syntax of a loaded model: from its chat template, architecture and name."""
    template = getattr(model, "template", None)
    source = getattr(getattr(template, "spec", None), "source", "") or ""
    arch = getattr(getattr(model, "config", None), "arch", "") or ""
    return get_syntax(detect_syntax(str(getattr(model, "name", "") or ""), str(arch), str(source), override))


class OutputSplitter:
    """Content / reasoning / tool-call events of one generation (a `ToolCallParser` adapter).

    Not thread-safe: one generation, fed from one thread."""

    def __init__(self, calling: "ToolCalling", prompt: ChatPrompt, api: str) -> None:
        self._calling = calling
        self._prefix = prompt.thinking_prefix
        self._parser = ToolCallParser(calling.syntax, tools=prompt.tools, starts_in_thinking=bool(self._prefix),
                                      id_prefix=ID_PREFIX[api])

    @property
    def in_structure(self) -> bool:
        """True inside tool-call syntax outside argument values: the next token is sampled greedily."""
        return self._parser.in_structure

    @property
    def in_thinking(self) -> bool:
        """True inside the thinking block (decoding constraints wait until it closes)."""
        return self._parser.in_thinking

    def feed(self, text: str) -> list[OutputEvent]:
        # Start and argument-delta events are redundant: calls are only announced once complete.
        return [e for e in self._parser.feed(text) if isinstance(e, (ContentDelta, ReasoningDelta, ToolCallEnd))]

    @property
    def n_calls(self) -> int:
        """Calls written out so far (a single-call generation ends at the first)."""
        return self._parser.calls_written

    def finish(self, finish_reason: str, generated: str | None = None) -> ParsedOutput:
        """Decide what is still open; `finish_reason` is the engine's ("stop" or "length").

        `generated` is the prompt text of the generated tokens (the fed text, with the control
        spellings that the model wrote as text escaped): a turn with calls is remembered as that,
        so that replaying it cannot turn such a spelling into a control token. Without it the
        turn is not remembered, and is rendered canonically when it comes back."""
        r = self._parser.finish(finish_reason)
        if r.tool_calls and generated is not None:
            self._calling.remember([c.id for c in r.tool_calls], self._prefix + generated)
        events = [e for e in r.events if isinstance(e, (ContentDelta, ReasoningDelta, ToolCallEnd))]
        return ParsedOutput(r.content, r.reasoning, list(r.tool_calls), r.finish_reason, r.raw, r.repaired,
                            r.malformed, events)


class ToolCalling:
    """Per-server tool-calling state: the model's syntax and the exact replay memory.

    `render` and `remember` may be called from any thread (the memory is behind a lock)."""

    def __init__(self, syntax: Syntax | str, memory: ReplayMemory | None = None) -> None:
        self.syntax = get_syntax(syntax)
        self.memory = memory if memory is not None else ReplayMemory()
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model: Any, config: ToolsConfig) -> "ToolCalling":
        return cls(model_syntax(model, config.tool_syntax), config.new_memory())

    def render(self, model: Any, messages: list[Message], tools: list[ToolSpec] | None = None,
               **extra: Any) -> ChatPrompt:
        """Prompt text for a chat: the syntax's rendering of tools and calls, then the chat template."""
        specs = tuple(tools or ())
        with self._lock:
            rendered = render_conversation(self.syntax, escaped_messages(model, messages),
                                           escaped_tools(model, specs), self.memory)
            stats = self.memory.stats()
        n_calls = rendered.replayed + rendered.rerendered + rendered.missing
        if specs or n_calls:
            log.info("tool calls in history: %d replayed, %d re-rendered, %d missing (syntax %s; memory %d ids, "
                     "%d bytes; totals %d/%d/%d)", rendered.replayed, rendered.rerendered, rendered.missing,
                     self.syntax.name, stats["ids"], stats["bytes"], stats["replayed"], stats["rerendered"],
                     stats["missing"])
        head = last_user_head(model, rendered.messages, **extra)
        text = model.render_chat(rendered.messages, add_generation_prompt=True, tools=None, **extra)
        prefix = ""
        if self.syntax.prompt_opens_thinking(text):
            prefix = text[text.rstrip().rfind(self.syntax.think_open):]
        boundary = len(head) if head and text.startswith(head) else None
        return ChatPrompt(text, specs, prefix, boundary)

    def new_splitter(self, prompt: ChatPrompt, api: str) -> OutputSplitter:
        """A splitter for the continuation of `prompt`; `api` picks the call-id prefix."""
        return OutputSplitter(self, prompt, api)

    def remember(self, call_ids: list[str], text: str) -> None:
        with self._lock:
            self.memory.remember(call_ids, text)


def last_user_head(model: Any, messages: list[dict[str, Any]], **extra: Any) -> str | None:
    """The conversation before the last user message, rendered as a prefix (no generation prompt).

    None when there is no user message or nothing before it. Templates that rewrite earlier
    turns depending on what follows (e.g. dropping old reasoning) may render a text that does
    not prefix the full prompt; the caller checks that.
    """
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
    if last == 0:
        return None
    try:
        return model.render_chat(messages[:last], add_generation_prompt=False, tools=None, **extra)
    except Exception:  # a template may insist on a user turn; the boundary is only a hint
        return None


def prompt_ids(model: Any, text: str) -> list[int]:
    """Token ids of a prompt text (`engine.prompt_text`): the unescaped control spellings become
    their single ids, escaped ones (those typed into messages) stay text, and the model's
    `prompt_ids` adds BOS when it wants one."""
    return model.prompt_ids(model.tokenize_prompt(text))


def escaped_messages(model: Any, messages: list[Message]) -> list[Message]:
    """The messages with every client string escaped, so that no control spelling in them
    becomes a control token (a forged turn) once the template has rendered them."""
    esc = model.escape_text

    def call(c: ToolCall) -> ToolCall:
        return dataclasses.replace(c, id=esc(c.id), name=esc(c.name), arguments=escape_strings(c.arguments, esc))

    return [dataclasses.replace(m, content=esc(m.content), reasoning=esc(m.reasoning), name=esc(m.name),
                                tool_call_id=esc(m.tool_call_id), tool_calls=[call(c) for c in m.tool_calls])
            for m in messages]


def escaped_tools(model: Any, tools: tuple[ToolSpec, ...]) -> list[ToolSpec]:
    esc = model.escape_text
    return [ToolSpec(esc(t.name), esc(t.description), escape_strings(t.parameters, esc)) for t in tools]
