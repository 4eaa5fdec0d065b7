"""Plain records shared by the tool-calling package: tool definitions, calls, results, messages, parse results, events.

Everything here is immutable-by-convention data with no behaviour beyond small derived properties. The three HTTP
APIs are mapped onto these records by `server.tools.apis`; the syntaxes render and parse them. This module does no
I/O and knows nothing of any API's field names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from server.tools.canonical import canonical_json


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call. `parameters` is the JSON schema exactly as the client sent it (key order
    matters: it is rendered in insertion order)."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)

    def param_type(self, key: str) -> Any:
        """The schema's declared `type` of top-level parameter `key`, or None when unknown."""
        props = self.parameters.get("properties") if isinstance(self.parameters, dict) else None
        if isinstance(props, dict) and isinstance(props.get(key), dict):
            return props[key].get("type")
        return None


@dataclass
class ToolCall:
    """A call of one tool. `raw` is the exact text the model sampled for the block that holds it (empty when the
    call came from a client); `repaired` says the block was closed by truncation repair."""

    id: str
    name: str
    arguments: dict
    raw: str = ""
    repaired: bool = False

    @property
    def arguments_json(self) -> str:
        return canonical_json(self.arguments)


@dataclass
class ToolResult:
    """The output of one call, as sent back by a client."""

    call_id: str
    content: str
    is_error: bool = False
    name: str = ""


@dataclass
class Message:
    """One conversation turn in the API-neutral form the renderer consumes.

    role: "system", "user", "assistant" or "tool". Assistant turns may carry `reasoning` and `tool_calls`; tool turns
    carry `tool_call_id` (and `is_error`)."""

    role: str
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str = ""
    is_error: bool = False
    name: str = ""


# ---- streaming events -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContentDelta:
    text: str

    def merge(self, later: "ContentDelta") -> "ContentDelta":
        """One delta for two adjacent ones (what a stream merging fast tokens sends)."""
        return ContentDelta(self.text + later.text)


@dataclass(frozen=True)
class ReasoningDelta:
    text: str

    def merge(self, later: "ReasoningDelta") -> "ReasoningDelta":
        return ReasoningDelta(self.text + later.text)


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    id: str
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    call: ToolCall


Event = Union[ContentDelta, ReasoningDelta, ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd]


@dataclass
class ParseResult:
    """Everything the model's output meant, after thinking isolation and repair.

    content: visible assistant text; reasoning: thinking text; tool_calls: valid calls in order;
    finish_reason: "tool_calls" when there are calls, else the engine's reason ("stop" or "length");
    repaired: a truncated call was closed; malformed: number of call blocks returned as plain text;
    raw: the complete generated text; events: the events produced by `finish()` itself (tail of the stream)."""

    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: str
    repaired: bool = False
    malformed: int = 0
    raw: str = ""
    events: list = field(default_factory=list)
