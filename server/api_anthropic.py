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

Response side: `messages_response` builds the `message` object; `messages_stream` emits
the Anthropic event sequence — `message_start`, `ping`, then per content block
`content_block_start` / `content_block_delta` / `content_block_stop`, then
`message_delta` (stop reason and usage) and `message_stop` — with `: prefill` comments
while waiting and an `error` event if inference fails after the stream started.

Usage follows Anthropic's convention: `input_tokens` counts only prompt tokens that were
computed, `cache_read_input_tokens` those reused from the KV cache (their sum is the
prompt length); `cache_creation_input_tokens` is always 0 (no explicit cache writes).

Extensions beyond the Anthropic API: `min_p`, `seed`, `ignore_eos`.
Generated thinking becomes `thinking` blocks (empty signature), generated calls `tool_use`
blocks with `stop_reason: "tool_use"`; a streamed call is one `content_block_start` plus one
`input_json_delta` with its complete input, sent once the call is known to be valid.
`tool_choice` ("auto", "any", "tool" with a name, "none"; `disable_parallel_tool_use`) becomes
the generation's decoding constraint (`server.structured`); Anthropic has no response format.
Accepted without effect: `metadata`, `thinking` (whether the model thinks is up to its
template), `cache_control` markers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from pydantic import Field

from server.apibase import (MAX_TOKENS_LIMIT, MIN_P, SEED, TOP_K, TOP_P, OpenModel, RequestDefaults, StrictModel,
                            new_id)
from server.errors import ApiError, error_body
from server.genrequest import ChatRequest, GenerationSettings, OutputRules, Sampling, TokenLimit, prepare_chat
from server.jobs import Event, Failed, Finished, GenerationRequest, PromptReady, TextDelta, Usage
from server.prompting import (ChatPrompt, ContentDelta, OutputEvent, ParsedOutput, ReasoningDelta, ToolCallEnd,
                              ToolCalling)
from server.sse import KEEPALIVE, sse_event
from server.structured import ToolChoice, anthropic_tool_choice, tools_to_render
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


class MessagesRequest(StrictModel):
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


def messages_job(model: Any, req: MessagesRequest, calling: ToolCalling,
                 defaults: RequestDefaults = RequestDefaults()) -> tuple[GenerationRequest, AnthropicContext]:
    """`defaults` does not apply: Messages requires `max_tokens`, as Anthropic's API does."""
    sampling = Sampling.of(req)
    rules = OutputRules.checked(json_format=None, choice=anthropic_tool_choice(req.tool_choice),
                                tools=request_tools(req), ignore_eos=sampling.ignore_eos)
    settings = GenerationSettings(sampling, TokenLimit(req.max_tokens, None, "max_tokens"),
                                  stop=req.stop_sequences, stop_param="stop_sequences")
    messages = request_messages(req)
    gen = prepare_chat(model, calling, ChatRequest("anthropic", messages, rules, settings, "messages"))
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


async def messages_stream(ctx: AnthropicContext, events: AsyncIterator[Event | None]) -> AsyncIterator[bytes]:
    index = -1
    open_kind: str | None = None
    started = False

    def start_message(n_cached: int, n_written: int) -> list[bytes]:
        message = {"id": ctx.id, "type": "message", "role": "assistant", "model": ctx.model_name,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage_json(Usage(ctx.n_prompt, 0, n_cached, n_written))}
        return [sse_event("message_start", {"type": "message_start", "message": message}),
                sse_event("ping", {"type": "ping"})]

    def close_block() -> list[bytes]:
        nonlocal open_kind
        frames = []
        if open_kind == "thinking":
            frames.append(sse_event("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "signature_delta", "signature": ""}}))
        if open_kind is not None:
            frames.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        open_kind = None
        return frames

    def open_block(kind: str, block: dict[str, Any]) -> list[bytes]:
        nonlocal index, open_kind
        frames = close_block()
        index += 1
        open_kind = kind
        frames.append(sse_event("content_block_start", {"type": "content_block_start", "index": index,
                                                        "content_block": block}))
        return frames

    def frames_for(out_events: list[OutputEvent] | tuple[OutputEvent, ...]) -> list[bytes]:
        frames: list[bytes] = []
        for ev in out_events:
            if isinstance(ev, ContentDelta):
                if open_kind != "text":
                    frames += open_block("text", {"type": "text", "text": ""})
                frames.append(sse_event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "text_delta", "text": ev.text}}))
            elif isinstance(ev, ReasoningDelta):
                if open_kind != "thinking":
                    frames += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                frames.append(sse_event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "thinking_delta", "thinking": ev.text}}))
            elif isinstance(ev, ToolCallEnd):
                frames += open_block("tool_use", {"type": "tool_use", "id": ev.call.id,
                                                  "name": ev.call.name, "input": {}})
                frames.append(sse_event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": ev.call.arguments_json}}))
                frames += close_block()
        return frames

    async for event in events:
        if event is None:
            yield KEEPALIVE
        elif isinstance(event, PromptReady):
            if not started:
                started = True
                for frame in start_message(event.n_cached, event.n_written):
                    yield frame
        elif isinstance(event, TextDelta):
            for frame in frames_for(event.events):
                yield frame
        elif isinstance(event, Finished):
            if event.finish_reason == "cancelled":
                yield stream_error("the request was cancelled because the server is shutting down",
                                    "overloaded_error")
                return
            if not started:
                for frame in start_message(event.usage.cached_tokens, event.usage.cache_written_tokens):
                    yield frame
            parsed: ParsedOutput = event.output
            for frame in frames_for(parsed.events) + close_block():
                yield frame
            yield sse_event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(event, parsed),
                          "stop_sequence": None if parsed.tool_calls else event.stop_sequence},
                "usage": usage_json(event.usage)})
            yield sse_event("message_stop", {"type": "message_stop"})
        elif isinstance(event, Failed):
            yield stream_error(event.message)
            return
