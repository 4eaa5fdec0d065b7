"""OpenAI Responses API (`POST /v1/responses`): schema, translation, responses.

Request side: `ResponsesRequest` validates the body; `responses_job` turns `instructions`
and `input` (a string, or items: messages with string or part content, `function_call`
and `function_call_output` items passed back from earlier turns, `reasoning` items) into
the neutral chat, renders, tokenizes and applies the context-length rule (param `input`).

Response side: `response_object` builds the `response` object (output items `reasoning`,
`message` with `output_text`, `function_call`); `responses_stream` emits the typed event
sequence — `response.created`, `response.in_progress`, per item `output_item.added`, the
part/delta/done events, `output_item.done`, and finally `response.completed` (or
`response.incomplete` when the token limit was hit) — each with a `sequence_number`,
`: prefill` comments while waiting, and `error` plus `response.failed` if inference fails
after the stream started.

The server keeps no conversation state: `previous_response_id` is rejected (send the
earlier output items back in `input` instead), `store` is accepted and ignored. Reasoning
items passed back are dropped from the prompt (the served model has no thinking mode).
Extensions: `top_k`, `min_p`, `seed`, `ignore_eos`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pydantic import Field

from server.apibase import (MAX_TOKENS_LIMIT, SEED_MAX, SEED_MIN, OpenModel, StrictModel,
                            check_context, new_id, resolve_max_tokens, sampling_spec)
from server.errors import ApiError
from server.prompting import (ContentDelta, OutputEvent, ParsedOutput, ReasoningDelta,
                              ToolCallDelta, new_output_splitter, prompt_ids, render_prompt)
from server.sse import KEEPALIVE, sse_event
from server.worker import Event, Failed, Finished, GenerationRequest, TextDelta, Usage

TEXT_PART_TYPES = ("input_text", "output_text", "text")

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
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
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
    tools: list[dict[str, Any]] | None
    splitter_model: Any = field(default=None, repr=False)


def _parts_text(content: str | list[InputPart] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PART_TYPES:
            raise ApiError(400, f"{where}[{j}]: content of type {part.type!r} is not supported by this "
                                "server (text only)", param=f"{where}[{j}].type")
        if part.text is None:
            raise ApiError(400, f"{where}[{j}]: a {part.type!r} part needs a 'text' string",
                           param=f"{where}[{j}].text")
        out.append(part.text)
    return "".join(out)


def neutral_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.type or ("message" if item.role else None)
        if kind == "message":
            role = {"developer": "system"}.get(item.role or "", item.role)
            if role not in ("system", "user", "assistant"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer",
                               param=f"{where}.role")
            out.append({"role": role, "content": _parts_text(item.content, f"{where}.content")})
        elif kind == "function_call":
            if not item.call_id or not item.name or item.arguments is None:
                raise ApiError(400, f"{where}: function_call needs call_id, name and arguments",
                               param=where)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            # Calls that follow an assistant turn belong to that turn (parallel calls).
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.call_id:
                raise ApiError(400, f"{where}: function_call_output needs call_id", param=where)
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _parts_text(item.output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported",
                           param=f"{where}.type")
    return out


def responses_job(model: Any, req: ResponsesRequest) -> tuple[GenerationRequest, ResponsesContext]:
    if req.previous_response_id:
        raise ApiError(400, "previous_response_id is not supported: this server stores no responses; "
                            "send the earlier output items back in 'input'", param="previous_response_id")
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise ApiError(400, f"text.format {fmt.get('type')!r} is not supported (only 'text')",
                       param="text.format")
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.type != "function" or not t.name:
                raise ApiError(400, f"tools[{i}]: only function tools with a name are supported",
                               param=f"tools[{i}]")
            tools.append({"type": "function",
                          "function": {"name": t.name, "description": t.description or "",
                                       "parameters": t.parameters or {"type": "object", "properties": {}}}})
    text = render_prompt(model, neutral_messages(req), tools)
    ids = prompt_ids(model, text)
    check_context(len(ids), model.n_ctx, "input")
    ignore_eos = bool(req.ignore_eos)
    max_tokens = resolve_max_tokens(req.max_output_tokens, None, len(ids), model.n_ctx, ignore_eos,
                                    "max_output_tokens")
    spec = sampling_spec(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                         min_p=req.min_p, seed=req.seed, ignore_eos=ignore_eos)
    gen = GenerationRequest(prompt_text=text, prompt_ids=tuple(ids), max_tokens=max_tokens,
                            sampling=spec)
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": spec.temperature, "top_p": spec.top_p,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else []}
    return gen, ResponsesContext(model_name=model.name, id=new_id("resp_"), created_at=int(time.time()),
                                 request_echo=echo, tools=tools, splitter_model=model)


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


def _status(finished: Finished) -> str:
    return "incomplete" if finished.finish_reason == "length" else "completed"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(item_id: str, call: Any, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def response_object(ctx: ResponsesContext, parsed: ParsedOutput, finished: Finished) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    status = _status(finished)
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
    splitter = new_output_splitter(ctx.splitter_model, ctx.tools)
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

    def frames_for(out_events: list[OutputEvent]) -> list[bytes]:
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
            elif isinstance(oe, ToolCallDelta):
                frames += close_item()
                idx = len(output)
                item_id = new_id("fc_")
                frames.append(ev("response.output_item.added", output_index=idx,
                                 item=function_call_item(item_id, oe.call, "in_progress") | {"arguments": ""}))
                frames.append(ev("response.function_call_arguments.delta", item_id=item_id,
                                 output_index=idx, delta=oe.call.arguments))
                frames.append(ev("response.function_call_arguments.done", item_id=item_id,
                                 output_index=idx, name=oe.call.name, arguments=oe.call.arguments))
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
            for frame in frames_for(splitter.feed(event.text)):
                yield frame
        elif isinstance(event, Finished):
            if event.finish_reason == "cancelled":
                message = "the request was cancelled because the server is shutting down"
                yield ev("error", code="server_shutting_down", message=message, param=None)
                yield ev("response.failed", response=_envelope(
                    ctx, "failed", output, None, {"code": "server_error", "message": message}))
                return
            status = _status(event)
            frames = frames_for(splitter.finish())
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
