"""OpenAI Responses API (`POST /v1/responses`): schema, translation, responses.

Request side: `ResponsesRequest` validates the body; `responses_job` reads `instructions`
and `input` (a string, or items: messages with string or part content, `function_call`
and `function_call_output` items passed back from earlier turns, `reasoning` items) into
the neutral records (`server.tools.apis.messages_from_responses`), its tools, `tool_choice`,
`parallel_tool_calls` and `text.format` into `OutputRules`, its sampling fields and
`max_output_tokens` into `GenerationSettings`, and hands them to the shared preparation
path (`server.genrequest.prepare_chat`: render with the model's tool syntax, tokenize, the
context-length rule on param `input`).

Response side: `response_object` builds the `response` object (output items `reasoning`,
`message` with `output_text`, `function_call`); `responses_stream` emits the typed event
sequence — `response.created`, `response.in_progress`, per item `output_item.added`, the
part/delta/done events, `output_item.done`, and finally `response.completed` (or
`response.incomplete` when the token limit was hit) — each with a `sequence_number`,
`: prefill` comments while waiting, and `error` plus `response.failed` if inference fails
after the stream started.

The server keeps no conversation state: `previous_response_id` is rejected (send the
earlier output items back in `input` instead), `store` is accepted and ignored. Reasoning
items passed back belong to the assistant turn that follows them; they reach the prompt
only through exact replay (chat templates drop earlier reasoning). A response whose output
holds calls is `completed`, also when a call was repaired at the token limit.
`tool_choice`, `parallel_tool_calls` and `text.format` (json_object, json_schema) become the
generation's decoding constraint (`server.structured`).
Extensions: `top_k`, `min_p`, `seed`, `ignore_eos`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from pydantic import Field

from server.apibase import MIN_P, SEED, TOKEN_COUNT, TOP_K, TOP_P, OpenModel, RequestDefaults, StrictModel, new_id
from server.errors import ApiError
from server.genrequest import ChatRequest, GenerationSettings, OutputRules, Sampling, TokenLimit, prepare_chat
from server.jobs import Event, Failed, Finished, GenerationRequest, TextDelta, Usage
from server.prompting import (ContentDelta, OutputEvent, ParsedOutput, ReasoningDelta, ToolCall, ToolCallEnd,
                              ToolCalling)
from server.sse import KEEPALIVE, sse_event
from server.structured import openai_tool_choice, responses_text_format
from server.tools.apis import messages_from_responses, tools_from_responses

# --- schemas --------------------------------------------------------------------------


class InputPart(OpenModel):
    type: str
    text: str | None = None


class InputItem(OpenModel):
    type: str | None = None
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class FunctionTool(OpenModel):
    type: str
    name: str | None = Field(None, min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = TOKEN_COUNT
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = TOP_P
    top_k: int | None = TOP_K
    min_p: float | None = MIN_P
    seed: int | None = SEED
    stream: bool | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    ignore_eos: bool | None = None


# --- translation ----------------------------------------------------------------------

@dataclass
class ResponsesContext:
    model_name: str
    id: str
    created_at: int
    request_echo: dict[str, Any]


def responses_job(model: Any, req: ResponsesRequest, calling: ToolCalling,
                  defaults: RequestDefaults = RequestDefaults()) -> tuple[GenerationRequest, ResponsesContext]:
    if req.previous_response_id:
        raise ApiError(400, "previous_response_id is not supported: this server stores no responses; "
                            "send the earlier output items back in 'input'", param="previous_response_id")
    sampling = Sampling.of(req)
    tool_dump = [t.model_dump(exclude_none=True) for t in req.tools or []]
    rules = OutputRules.checked(json_format=responses_text_format((req.text or {}).get("format")),
                                choice=openai_tool_choice(req.tool_choice, req.parallel_tool_calls),
                                tools=tools_from_responses(tool_dump), ignore_eos=sampling.ignore_eos)
    items = req.input if isinstance(req.input, str) else [it.model_dump(exclude_none=True) for it in req.input]
    settings = GenerationSettings(sampling, TokenLimit(req.max_output_tokens, defaults.max_tokens_for(),
                                                       "max_output_tokens"))
    gen = prepare_chat(model, calling, ChatRequest("responses", messages_from_responses(req.instructions, items),
                                                   rules, settings, "input"))
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": gen.sampling.temperature, "top_p": gen.sampling.top_p,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": tool_dump}
    return gen, ResponsesContext(model_name=model.name, id=new_id("resp_"), created_at=int(time.time()),
                                 request_echo=echo)


# --- responses ------------------------------------------------------------------------

def usage_json(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def _envelope(ctx: ResponsesContext, status: str, output: list[dict[str, Any]],
              usage: Usage | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": ctx.id, "object": "response", "created_at": ctx.created_at, "status": status,
            "model": ctx.model_name, "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "metadata": {}, "store": False, "truncation": "disabled",
            "text": {"format": {"type": "text"}}, "reasoning": None,
            "usage": usage_json(usage) if usage is not None else None, **ctx.request_echo}


def _status(parsed: ParsedOutput) -> str:
    return "incomplete" if parsed.finish_reason == "length" else "completed"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments_json, "status": status}


def response_object(ctx: ResponsesContext, parsed: ParsedOutput, finished: Finished) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    status = _status(parsed)
    if parsed.reasoning:
        output.append(reasoning_item(new_id("rs_"), parsed.reasoning))
    if parsed.content or not parsed.tool_calls:
        output.append(message_item(new_id("msg_"), parsed.content,
                                   "incomplete" if status == "incomplete" else "completed"))
    for call in parsed.tool_calls:
        output.append(function_call_item(new_id("fc_"), call))
    return _envelope(ctx, status, output, finished.usage)


def stream_error(message: str) -> bytes:
    """A stand-alone error event, for failures outside the event sequence's own bookkeeping."""
    return sse_event("error", {"type": "error", "sequence_number": 0, "code": "server_error",
                               "message": message, "param": None})


async def responses_stream(ctx: ResponsesContext, events: AsyncIterator[Event | None]) -> AsyncIterator[bytes]:
    seq = 0
    output: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None
    open_text = ""

    def ev(kind: str, **payload: Any) -> bytes:
        nonlocal seq
        frame = sse_event(kind, {"type": kind, "sequence_number": seq, **payload})
        seq += 1
        return frame

    def close_item(status: str = "completed") -> list[bytes]:
        nonlocal open_item, open_text
        if open_item is None:
            return []
        idx = len(output)
        item_id = open_item["id"]
        frames = []
        if open_item["type"] == "message":
            part = {"type": "output_text", "text": open_text, "annotations": [], "logprobs": []}
            frames.append(ev("response.output_text.done", item_id=item_id, output_index=idx,
                             content_index=0, text=open_text, logprobs=[]))
            frames.append(ev("response.content_part.done", item_id=item_id, output_index=idx,
                             content_index=0, part=part))
            item = message_item(item_id, open_text, status)
        else:
            frames.append(ev("response.reasoning_text.done", item_id=item_id, output_index=idx,
                             content_index=0, text=open_text))
            item = reasoning_item(item_id, open_text)
        frames.append(ev("response.output_item.done", output_index=idx, item=item))
        output.append(item)
        open_item, open_text = None, ""
        return frames

    def open_message() -> list[bytes]:
        nonlocal open_item
        frames = close_item()
        open_item = {"type": "message", "id": new_id("msg_")}
        idx = len(output)
        frames.append(ev("response.output_item.added", output_index=idx,
                         item={"type": "message", "id": open_item["id"], "status": "in_progress",
                               "role": "assistant", "content": []}))
        frames.append(ev("response.content_part.added", item_id=open_item["id"], output_index=idx,
                         content_index=0,
                         part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return frames

    def open_reasoning() -> list[bytes]:
        nonlocal open_item
        frames = close_item()
        open_item = {"type": "reasoning", "id": new_id("rs_")}
        frames.append(ev("response.output_item.added", output_index=len(output),
                         item={"type": "reasoning", "id": open_item["id"], "summary": [], "content": []}))
        return frames

    def frames_for(out_events: list[OutputEvent] | tuple[OutputEvent, ...]) -> list[bytes]:
        nonlocal open_text
        frames: list[bytes] = []
        for oe in out_events:
            if isinstance(oe, ContentDelta):
                if open_item is None or open_item["type"] != "message":
                    frames += open_message()
                open_text += oe.text
                frames.append(ev("response.output_text.delta", item_id=open_item["id"],
                                 output_index=len(output), content_index=0, delta=oe.text, logprobs=[]))
            elif isinstance(oe, ReasoningDelta):
                if open_item is None or open_item["type"] != "reasoning":
                    frames += open_reasoning()
                open_text += oe.text
                frames.append(ev("response.reasoning_text.delta", item_id=open_item["id"],
                                 output_index=len(output), content_index=0, delta=oe.text))
            elif isinstance(oe, ToolCallEnd):
                frames += close_item()
                idx = len(output)
                item_id = new_id("fc_")
                frames.append(ev("response.output_item.added", output_index=idx,
                                 item=function_call_item(item_id, oe.call, "in_progress") | {"arguments": ""}))
                frames.append(ev("response.function_call_arguments.delta", item_id=item_id,
                                 output_index=idx, delta=oe.call.arguments_json))
                frames.append(ev("response.function_call_arguments.done", item_id=item_id,
                                 output_index=idx, name=oe.call.name, arguments=oe.call.arguments_json))
                item = function_call_item(item_id, oe.call)
                frames.append(ev("response.output_item.done", output_index=idx, item=item))
                output.append(item)
        return frames

    yield ev("response.created", response=_envelope(ctx, "in_progress", [], None))
    yield ev("response.in_progress", response=_envelope(ctx, "in_progress", [], None))
    async for event in events:
        if event is None:
            yield KEEPALIVE
        elif isinstance(event, TextDelta):
            for frame in frames_for(event.events):
                yield frame
        elif isinstance(event, Finished):
            if event.finish_reason == "cancelled":
                message = "the request was cancelled because the server is shutting down"
                yield ev("error", code="server_shutting_down", message=message, param=None)
                yield ev("response.failed", response=_envelope(
                    ctx, "failed", output, None, {"code": "server_error", "message": message}))
                return
            parsed: ParsedOutput = event.output
            status = _status(parsed)
            frames = frames_for(parsed.events)
            if not output and open_item is None:
                frames += open_message()
            frames += close_item("incomplete" if status == "incomplete" else "completed")
            for frame in frames:
                yield frame
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield ev(kind, response=_envelope(ctx, status, output, event.usage))
        elif isinstance(event, Failed):
            yield ev("error", code="server_error", message=event.message, param=None)
            yield ev("response.failed", response=_envelope(
                ctx, "failed", output, None, {"code": "server_error", "message": event.message}))
            return
