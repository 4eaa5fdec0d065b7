"""Anthropic Messages API (`POST /v1/messages`): schema, translation, responses.

Request side: `MessagesRequest` validates the body (`max_tokens` is required, as in the
original API); `messages_job` turns the top-level `system`, user/assistant content blocks,
`tool_use` and `tool_result` blocks into the neutral chat, renders and tokenizes it and
applies the context-length rule (reported in Anthropic's error shape by the route).

Response side: `messages_response` builds the `message` object; `messages_stream` emits
the Anthropic event sequence — `message_start`, `ping`, then per content block
`content_block_start` / `content_block_delta` / `content_block_stop`, then
`message_delta` (stop reason and usage) and `message_stop` — with `: prefill` comments
while waiting and an `error` event if inference fails after the stream started.

Usage follows Anthropic's convention: `input_tokens` counts only prompt tokens that were
computed, `cache_read_input_tokens` those reused from the KV cache (their sum is the
prompt length); `cache_creation_input_tokens` is always 0 (no explicit cache writes).

Extensions beyond the Anthropic API: `min_p`, `seed`, `ignore_eos`.
Accepted without effect: `metadata`, `thinking` (the served model does not think),
`tool_choice`, `cache_control` markers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

from pydantic import Field

from server.apibase import (MAX_TOKENS_LIMIT, SEED_MAX, SEED_MIN, OpenModel, StrictModel,
                            check_context, new_id, resolve_max_tokens, sampling_spec)
from server.errors import ApiError, error_body
from server.prompting import (ContentDelta, OutputEvent, ParsedOutput, ReasoningDelta,
                              ToolCallDelta, new_output_splitter, prompt_ids, render_prompt)
from server.sse import KEEPALIVE, sse_event
from server.worker import Event, Failed, Finished, GenerationRequest, PromptReady, TextDelta, Usage

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
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    ignore_eos: bool | None = None


# --- translation ----------------------------------------------------------------------

@dataclass
class AnthropicContext:
    model_name: str
    id: str
    tools: list[dict[str, Any]] | None
    n_prompt: int
    splitter_model: Any = field(default=None, repr=False)


def _block_text(block: ContentBlock | TextBlock, where: str) -> str:
    if block.text is None:
        raise ApiError(400, f"{where}: a text block needs a 'text' string", param=where)
    return block.text


def _tool_result_text(block: ContentBlock, where: str) -> str:
    content = block.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise ApiError(400, f"{where}.content[{j}]: tool results of type {part.type!r} are not "
                                "supported (text only)", param=f"{where}.content[{j}].type")
        parts.append(_block_text(part, f"{where}.content[{j}]"))
    return "".join(parts)


def neutral_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        if isinstance(req.system, str):
            system = req.system
        else:
            system = "".join(_block_text(b, f"system[{i}]") for i, b in enumerate(req.system))
        if system:
            out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": ""}
            for j, b in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                if b.type == "text":
                    msg["content"] += _block_text(b, where)
                elif b.type in ("thinking", "redacted_thinking"):
                    msg["reasoning_content"] = msg.get("reasoning_content", "") + (b.thinking or "")
                elif b.type == "tool_use":
                    if not b.id or not b.name:
                        raise ApiError(400, f"{where}: tool_use needs 'id' and 'name'", param=where)
                    msg.setdefault("tool_calls", []).append(
                        {"id": b.id, "type": "function",
                         "function": {"name": b.name,
                                      "arguments": json.dumps(b.input or {}, ensure_ascii=False)}})
                else:
                    raise ApiError(400, f"{where}: assistant content of type {b.type!r} is not supported",
                                   param=f"{where}.type")
            out.append(msg)
            continue
        text = ""
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                text += _block_text(b, where)
            elif b.type == "tool_result":
                if not b.tool_use_id:
                    raise ApiError(400, f"{where}: tool_result needs 'tool_use_id'", param=where)
                if text:
                    out.append({"role": "user", "content": text})
                    text = ""
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": _tool_result_text(b, where)})
            else:
                raise ApiError(400, f"{where}: content of type {b.type!r} is not supported by this "
                                    "server (text and tool_result only)", param=f"{where}.type")
        if text or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": text})
    return out


def messages_job(model: Any, req: MessagesRequest) -> tuple[GenerationRequest, AnthropicContext]:
    tools = None
    if req.tools:
        tools = [{"type": "function",
                  "function": {"name": t.name, "description": t.description or "",
                               "parameters": t.input_schema or {"type": "object", "properties": {}}}}
                 for t in req.tools]
    text = render_prompt(model, neutral_messages(req), tools)
    ids = prompt_ids(model, text)
    check_context(len(ids), model.n_ctx, "messages")
    ignore_eos = bool(req.ignore_eos)
    max_tokens = resolve_max_tokens(req.max_tokens, None, len(ids), model.n_ctx, ignore_eos, "max_tokens")
    gen = GenerationRequest(
        prompt_text=text, prompt_ids=tuple(ids), max_tokens=max_tokens,
        sampling=sampling_spec(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                               min_p=req.min_p, seed=req.seed, ignore_eos=ignore_eos),
        stop=tuple(s for s in (req.stop_sequences or []) if s))
    return gen, AnthropicContext(model_name=model.name, id=new_id("msg_"), tools=tools,
                                 n_prompt=len(ids), splitter_model=model)


# --- responses ------------------------------------------------------------------------

def usage_json(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


def stop_reason(finished: Finished, has_tools: bool) -> str:
    if finished.finish_reason == "length":
        return "max_tokens"
    if finished.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if has_tools else "end_turn"


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def messages_response(ctx: AnthropicContext, parsed: ParsedOutput, finished: Finished) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name,
                        "input": _tool_input(call.arguments)})
    return {"id": ctx.id, "type": "message", "role": "assistant", "model": ctx.model_name,
            "content": content, "stop_reason": stop_reason(finished, bool(parsed.tool_calls)),
            "stop_sequence": finished.stop_sequence, "usage": usage_json(finished.usage)}


def stream_error(message: str, kind: str = "api_error") -> bytes:
    body = error_body(ApiError(500, message), "anthropic")
    body["error"]["type"] = kind
    return sse_event("error", body)


async def messages_stream(ctx: AnthropicContext, events: AsyncIterator[Event | None]) -> AsyncIterator[bytes]:
    splitter = new_output_splitter(ctx.splitter_model, ctx.tools)
    index = -1
    open_kind: str | None = None
    has_tools = False
    started = False

    def start_message(n_cached: int) -> list[bytes]:
        message = {"id": ctx.id, "type": "message", "role": "assistant", "model": ctx.model_name,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage_json(Usage(ctx.n_prompt, 0, n_cached))}
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

    def frames_for(out_events: list[OutputEvent]) -> list[bytes]:
        nonlocal has_tools
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
            elif isinstance(ev, ToolCallDelta):
                has_tools = True
                frames += open_block("tool_use", {"type": "tool_use", "id": ev.call.id,
                                                  "name": ev.call.name, "input": {}})
                frames.append(sse_event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": ev.call.arguments}}))
                frames += close_block()
        return frames

    async for event in events:
        if event is None:
            yield KEEPALIVE
        elif isinstance(event, PromptReady):
            if not started:
                started = True
                for frame in start_message(event.n_cached):
                    yield frame
        elif isinstance(event, TextDelta):
            for frame in frames_for(splitter.feed(event.text)):
                yield frame
        elif isinstance(event, Finished):
            if event.finish_reason == "cancelled":
                yield stream_error("the request was cancelled because the server is shutting down",
                                    "overloaded_error")
                return
            if not started:
                for frame in start_message(event.usage.cached_tokens):
                    yield frame
            for frame in frames_for(splitter.finish()) + close_block():
                yield frame
            yield sse_event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(event, has_tools),
                          "stop_sequence": event.stop_sequence},
                "usage": usage_json(event.usage)})
            yield sse_event("message_stop", {"type": "message_stop"})
        elif isinstance(event, Failed):
            yield stream_error(event.message)
            return
