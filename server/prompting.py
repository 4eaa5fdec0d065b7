"""The two text seams between the APIs and the model: prompt rendering and output splitting.

Every API translates its request into the same neutral chat form — a list of message
dicts in the shape chat templates expect (`role`, `content` as a string, `tool_calls` on
assistant turns, `tool_call_id` on tool turns) plus OpenAI-style tool definitions — and
calls `render_prompt`. Generated text goes the other way through an `OutputSplitter`,
which turns the raw text stream into content, reasoning and tool-call events that each
API then renders in its own objects.

Today rendering is the model's own chat template (tools included) and splitting passes
all text through as content: the embedded model has no thinking mode, and tool-call
syntaxes are parsed by a dedicated package that plugs in here (a splitter built from
`server.tools`' streaming parser, a renderer that uses its canonical tool rendering and
exact-replay memory) without changes to the API modules.

Pure text in, text or dataclasses out; the model is only asked to render its template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments as a JSON object text, exactly as the API returns it."""


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A complete tool call, emitted once its closing syntax was seen."""
    index: int
    call: ToolCall


OutputEvent = ContentDelta | ReasoningDelta | ToolCallDelta


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def apply(self, event: OutputEvent) -> None:
        if isinstance(event, ContentDelta):
            self.content += event.text
        elif isinstance(event, ReasoningDelta):
            self.reasoning += event.text
        else:
            self.tool_calls.append(event.call)


class OutputSplitter(Protocol):
    def feed(self, text: str) -> list[OutputEvent]: ...
    def finish(self) -> list[OutputEvent]: ...


class PlainTextSplitter:
    """All generated text is visible content (models without thinking or parsed tools)."""

    def feed(self, text: str) -> list[OutputEvent]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[OutputEvent]:
        return []


def new_output_splitter(model: Any, tools: list[dict[str, Any]] | None) -> OutputSplitter:
    """Splitter for one response of `model`; `tools` are the definitions the client sent."""
    return PlainTextSplitter()


def split_output(splitter: OutputSplitter, text: str) -> ParsedOutput:
    """Whole-text form of the splitter, for non-streaming responses."""
    out = ParsedOutput()
    for event in splitter.feed(text) + splitter.finish():
        out.apply(event)
    return out


def render_prompt(model: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
    """Prompt text for a chat: the model's chat template with a generation prompt."""
    return model.render_chat(messages, add_generation_prompt=True, tools=tools or None, **extra)


def prompt_ids(model: Any, text: str) -> list[int]:
    """Token ids of a rendered prompt; special-token text becomes its single id."""
    ids = list(model.tokenize(text, special=True))
    bos = getattr(model, "bos_id", None)
    if getattr(model, "add_bos", False) and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids
