"""Anthropic Messages API (`POST /v1/messages`): schema, translation, responses.

Request side: `MessagesRequest` validates the body (`max_tokens` is required, as in the
original API); `messages_job` reads the top-level `system`, user/assistant content blocks,
`thinking`, `tool_use` and `tool_result` blocks into the neutral records
(`server.tools.apis.messages_from_anthropic`), its tools and `tool_choice` into
`OutputRules`, its sampling fields, `max_tokens` and `stop_sequences` into
`GenerationSettings`, and hands them to the shared preparation path
(`server.genrequest.prepare_chat`: render with the model's tool syntax, tokenize, the
context-length rule on param `messages`); the route reports its errors in Anthropic's shape.
`render_request` is the prompt alone, for `count_tokens`.

Response side: `messages_response` builds the `message` object; `messages_stream` runs a
`MessagesStreamWriter`, which emits the Anthropic event sequence — `message_start`, `ping`,
then per content block `content_block_start` / `content_block_delta` /
`content_block_stop`, then `message_delta` (stop reason and usage) and `message_stop` — with
`: prefill` comments while waiting and an `error` event (nothing after it) if inference fails
after the stream started. `message_start` goes out at `PromptReady`, or with the end if the
prompt's readiness was never reported.

Usage follows Anthropic's convention: `input_tokens` counts only prompt tokens that were
computed, `cache_read_input_tokens` those reused from the KV cache (their sum is the
prompt length); `cache_creation_input_tokens` is always 0 (no explicit cache writes).

Extensions beyond the Anthropic API: `min_p`, `seed`, `ignore_eos`.
Generated thinking becomes `thinking` blocks (empty signature), generated calls `tool_use`
blocks with `stop_reason: "tool_use"`; a streamed call is one `content_block_start` plus one
`input_json_delta` with its complete input, sent once the call is known to be valid.
`tool_choice` ("auto", "any", "tool" with a name, "none"; `disable_parallel_tool_use`) and
`output_config.format` (a JSON schema, mapped as Responses' `text.format` is) become the
generation's decoding constraint (`server.structured`). `thinking: {"type": "disabled"}` is
the chat-template variable `enable_thinking: false`; "enabled" is refused (a thinking budget is
not enforced, and whether the model thinks is up to its template).
Accepted without effect on the output, as the API defines them: `metadata`, `service_tier`,
`cache_control` markers. Refused with a 400 naming the field: `MESSAGES_REFUSED`, other members
of `output_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from pydantic import Field

from server.apibase import (MAX_TOKENS_LIMIT, MIN_P, SEED, TOP_K, TOP_P, Frames, OpenModel, Refused,
                            RequestDefaults, StreamWriter, StrictModel, new_id, refused_sampler_fields, writes)
from server.errors import ApiError, error_body
from server.genrequest import ChatRequest, GenerationSettings, OutputRules, Sampling, TokenLimit, prepare_chat
from server.jobs import Event, Failed, Finished, GenerationRequest, PromptReady, TextDelta, Usage
from server.prompting import ChatPrompt, ContentDelta, ParsedOutput, ReasoningDelta, ToolCallEnd, ToolCalling
from server.sse import sse_event
from server.structured import JsonFormat, ToolChoice, anthropic_tool_choice, responses_text_format, tools_to_render
from server.tools import Message, ToolSpec
from server.tools.apis import messages_from_anthropic, tools_from_anthropic

# --- schemas --------------------------------------------------------------------------


class TextBlock(OpenModel):
    type: str
    text: str | None = None


class ContentBlock(OpenModel):
    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(OpenModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


MESSAGES_REFUSED = refused_sampler_fields() + (
    Refused("container", "there is no code execution container"),
    Refused("context_management", "the conversation is sent whole and never edited"),
    Refused("mcp_servers", "there is no MCP client; pass tools"),
    Refused("output_format", "use output_config.format"),
)


class MessagesRequest(StrictModel):
    refused = MESSAGES_REFUSED
    model: str | None = None
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = TOP_P
    top_k: int | None = TOP_K
    min_p: float | None = MIN_P
    seed: int | None = SEED
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    ignore_eos: bool | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


# --- translation ----------------------------------------------------------------------

@dataclass
class AnthropicContext:
    model_name: str
    id: str
    n_prompt: int


def request_tools(req: Any) -> list[ToolSpec]:
    return tools_from_anthropic([t.model_dump(exclude_none=True) for t in req.tools or []])


def request_messages(req: Any) -> list[Message]:
    system = req.system
    if isinstance(system, list):
        system = [b.model_dump(exclude_none=True) for b in system]
    return messages_from_anthropic(system, [m.model_dump(exclude_none=True) for m in req.messages])


def render_request(model: Any, req: Any, calling: ToolCalling, choice: ToolChoice = ToolChoice()) -> ChatPrompt:
    """Prompt of a Messages (or count_tokens) request: system, messages and the tools `choice` shows."""
    tools = request_tools(req)
    return calling.render(model, request_messages(req), tools_to_render(choice, tools))


def output_format(config: dict[str, Any] | None) -> JsonFormat | None:
    """`output_config.format` (`{"type": "json_schema", "schema": {...}}`) as the JSON-schema
    constraint that Responses' `text.format` of the same shape gives; any other member of
    `output_config` is a 400 naming it."""
    config = config or {}
    for key in config:
        if key != "format":
            raise ApiError(400, f"output_config.{key} is not supported by this server", param=f"output_config.{key}")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise ApiError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       param="output_config.format")
    return responses_text_format(fmt, "output_config.format")


def thinking_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """The chat-template variables of `thinking`: "disabled" turns a thinking template's
    thinking off (`enable_thinking: false`); "enabled" is refused, since a thinking budget
    cannot be held to (whether the model thinks is up to its template)."""
    kind = (thinking or {}).get("type")
    if thinking is None:
        return {}
    if kind == "disabled":
        return {"enable_thinking": False}
    raise ApiError(400, f"thinking type {kind!r} is not supported by this server (a thinking budget is not "
                        "enforced; whether the model thinks is up to its chat template; \"disabled\" turns a "
                        "thinking template's thinking off)", param="thinking")


def messages_job(model: Any, req: MessagesRequest, calling: ToolCalling,
                 defaults: RequestDefaults = RequestDefaults()) -> tuple[GenerationRequest, AnthropicContext]:
    """`defaults` does not apply: Messages requires `max_tokens`, as Anthropic's API does."""
    kwargs = thinking_kwargs(req.thinking)
    sampling = Sampling.of(req)
    rules = OutputRules.checked(json_format=output_format(req.output_config),
                                choice=anthropic_tool_choice(req.tool_choice),
                                tools=request_tools(req), ignore_eos=sampling.ignore_eos)
    settings = GenerationSettings(sampling, TokenLimit(req.max_tokens, None, "max_tokens"),
                                  stop=req.stop_sequences, stop_param="stop_sequences")
    messages = request_messages(req)
    gen = prepare_chat(model, calling, ChatRequest("anthropic", messages, rules, settings, "messages", kwargs))
    return gen, AnthropicContext(model_name=model.name, id=new_id("msg_"), n_prompt=len(gen.prompt_ids))


# --- responses ------------------------------------------------------------------------

def usage_json(usage: Usage) -> dict[str, Any]:
    # Anthropic splits the prompt three ways: read from the cache, written to it, the rest.
    return {"input_tokens": max(0, usage.prompt_tokens - usage.cached_tokens - usage.cache_written_tokens),
            "cache_creation_input_tokens": usage.cache_written_tokens,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


def stop_reason(finished: Finished, parsed: ParsedOutput) -> str:
    if parsed.finish_reason == "tool_calls":
        return "tool_use"
    if parsed.finish_reason == "length":
        return "max_tokens"
    if finished.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def messages_response(ctx: AnthropicContext, parsed: ParsedOutput, finished: Finished) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
    return {"id": ctx.id, "type": "message", "role": "assistant", "model": ctx.model_name,
            "content": content, "stop_reason": stop_reason(finished, parsed),
            "stop_sequence": None if parsed.tool_calls else finished.stop_sequence,
            "usage": usage_json(finished.usage)}


def stream_error(message: str, kind: str = "api_error") -> bytes:
    body = error_body(ApiError(500, message), "anthropic")
    body["error"]["type"] = kind
    return sse_event("error", body)


CANCELLED = "the request was cancelled because the server is shutting down"


class MessagesStreamWriter(StreamWriter):
    """The event sequence of one streamed message (see the module docstring).

    Content blocks are numbered from 0 in the order they open; at most one is open, and a delta
    of another kind (or a call, which is a block of its own) closes it first."""

    def __init__(self, ctx: AnthropicContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.started = False
        self.index = -1
        """The number of the block opened last."""
        self.open_kind: str | None = None
        """The type of the open block ("text", "thinking", "tool_use"), None when none is open."""

    # --- the message ---

    def start(self, n_cached: int, n_written: int) -> Frames:
        if self.started:
            return []
        self.started = True
        message = {"id": self.ctx.id, "type": "message", "role": "assistant", "model": self.ctx.model_name,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage_json(Usage(self.ctx.n_prompt, 0, n_cached, n_written))}
        return [sse_event("message_start", {"type": "message_start", "message": message}),
                sse_event("ping", {"type": "ping"})]

    @writes(PromptReady)
    def prompt_ready(self, event: PromptReady) -> Frames:
        return self.start(event.n_cached, event.n_written)

    @writes(TextDelta)
    def text(self, event: TextDelta) -> Frames:
        return self.write_all(event.events)

    @writes(Finished)
    def finished(self, event: Finished) -> Frames:
        if event.finish_reason == "cancelled":
            return self.end(stream_error(CANCELLED, "overloaded_error"))
        parsed: ParsedOutput = event.output
        frames = self.start(event.usage.cached_tokens, event.usage.cache_written_tokens)
        frames += self.write_all(parsed.events) + self.close_block()
        frames.append(sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(event, parsed),
                      "stop_sequence": None if parsed.tool_calls else event.stop_sequence},
            "usage": usage_json(event.usage)}))
        frames.append(sse_event("message_stop", {"type": "message_stop"}))
        return frames

    @writes(Failed)
    def failed(self, event: Failed) -> Frames:
        return self.end(stream_error(event.message))

    # --- content blocks ---

    def delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta",
                         {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close_block(self) -> Frames:
        frames = []
        if self.open_kind == "thinking":
            frames.append(self.delta({"type": "signature_delta", "signature": ""}))
        if self.open_kind is not None:
            frames.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open_kind = None
        return frames

    def open_block(self, block: dict[str, Any]) -> Frames:
        frames = self.close_block()
        self.index += 1
        self.open_kind = block["type"]
        frames.append(sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                        "content_block": block}))
        return frames

    @writes(ContentDelta)
    def content(self, event: ContentDelta) -> Frames:
        frames = [] if self.open_kind == "text" else self.open_block({"type": "text", "text": ""})
        return frames + [self.delta({"type": "text_delta", "text": event.text})]

    @writes(ReasoningDelta)
    def reasoning(self, event: ReasoningDelta) -> Frames:
        frames = ([] if self.open_kind == "thinking"
                  else self.open_block({"type": "thinking", "thinking": "", "signature": ""}))
        return frames + [self.delta({"type": "thinking_delta", "thinking": event.text})]

    @writes(ToolCallEnd)
    def tool_call(self, event: ToolCallEnd) -> Frames:
        call = event.call
        frames = self.open_block({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        frames.append(self.delta({"type": "input_json_delta", "partial_json": call.arguments_json}))
        return frames + self.close_block()


def messages_stream(ctx: AnthropicContext, events: AsyncIterator[Event | None]) -> AsyncIterator[bytes]:
    return MessagesStreamWriter(ctx).stream(events)
