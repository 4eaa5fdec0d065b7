"""OpenAI Chat Completions and (legacy) Completions: schemas, translation, responses.

Request side: `ChatCompletionRequest` / `CompletionRequest` validate the body;
`chat_job` / `completion_job` turn a validated request into the neutral records
(`server.tools.apis.messages_from_openai`, the one check of the messages beyond the
schema), render it, tokenize, apply the context-length rule (param `messages` / `prompt`)
and produce a `GenerationRequest` plus the `OpenAIContext` needed to answer.

Response side: `chat_response` / `completion_response` build the JSON body from the
collected output; `chat_stream` / `completion_stream` turn worker events into
`chat.completion.chunk` / `text_completion` SSE chunks ending with `data: [DONE]`, with
`: prefill` keepalive comments before the first token and an error chunk (not a broken
stream) when inference fails after the headers were sent.

A raw completion prompt is tokenized with special-token parsing, so a client may send an
already rendered chat prompt (`<|im_start|>user ...`); a list of token ids is used as is.
Extensions beyond the OpenAI API: `top_k`, `min_p`, `ignore_eos`.

Tools: definitions and earlier calls are rendered by the model's tool syntax
(`server.prompting.ToolCalling`); generated calls come back as `tool_calls` with
`finish_reason: "tool_calls"` (streamed as one complete delta per call, once it is known to
be valid), thinking as `reasoning_content`.
`tool_choice`, `parallel_tool_calls` and `response_format` (json_object, json_schema) become
the generation's decoding constraint (`server.structured`).
Accepted but without effect: `reasoning_effort`.
Rejected with a 400: `n`/`best_of` other than 1, nonzero penalties (the engine has none),
image or audio content, `suffix`, several prompts.

No HTTP objects here: routes live in `server.app`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from pydantic import Field

from server.apibase import (MAX_TOKENS_LIMIT, SEED_MAX, SEED_MIN, OpenModel, StrictModel,
                            check_context, new_id, resolve_max_tokens, sampling_spec)
from server.errors import ApiError, error_body
from server.jobs import Event, Failed, Finished, GenerationRequest, TextDelta, TokenLogprob, Usage
from server.prompting import (ContentDelta, ParsedOutput, ReasoningDelta, ToolCall,
                              ToolCallEnd, ToolCalling, prompt_ids)
from server.sse import DONE, KEEPALIVE, sse_data
from server.structured import check, constraint_factory, openai_response_format, openai_tool_choice, tools_to_render
from server.tools.apis import messages_from_openai, tools_from_openai

# --- schemas --------------------------------------------------------------------------


class ContentPart(OpenModel):
    type: str
    text: str | None = None


class FunctionCallIn(StrictModel):
    name: str
    arguments: str


class ToolCallIn(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(OpenModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class ResponseFormat(OpenModel):
    type: str


Temperature = Field(None, ge=0.0, le=2.0)
Probability = Field(None, ge=0.0, le=1.0)
TopK = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
Seed = Field(None, ge=SEED_MIN, le=SEED_MAX)
MaxTokens = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
Penalty = Field(None, ge=-2.0, le=2.0)


class _SamplingFields(StrictModel):
    model: str | None = None
    temperature: float | None = Temperature
    top_p: float | None = Probability
    top_k: int | None = TopK
    min_p: float | None = Probability
    seed: int | None = Seed
    max_tokens: int | None = MaxTokens
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = Penalty
    frequency_penalty: float | None = Penalty
    ignore_eos: bool | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = MaxTokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# --- translation to a generation request ----------------------------------------------

@dataclass
class OpenAIContext:
    """What the response builder needs besides the worker's events."""
    kind: Literal["chat", "completion"]
    model_name: str
    id: str
    created: int
    include_usage: bool
    logprobs: bool
    echo_text: str = ""


def _stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > 16:
        raise ApiError(400, "stop: at most 16 stop sequences are supported", param="stop")
    return tuple(s for s in stops if s)


def _common_checks(req: _SamplingFields) -> None:
    if req.n is not None and req.n != 1:
        raise ApiError(400, f"n={req.n} is not supported: this server generates exactly one "
                            "choice per request (n must be 1)", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value:
            raise ApiError(400, f"{name} is not supported by this server (use 0 or omit it)",
                           param=name)


def chat_job(model: Any, req: ChatCompletionRequest,
             calling: ToolCalling) -> tuple[GenerationRequest, OpenAIContext]:
    _common_checks(req)
    ignore_eos = bool(req.ignore_eos)
    fmt = openai_response_format(req.response_format.model_dump() if req.response_format is not None else None)
    choice = openai_tool_choice(req.tool_choice, req.parallel_tool_calls)
    specs = tools_from_openai([t.model_dump(exclude_none=True) for t in req.tools or []])
    check(choice, fmt, specs, ignore_eos=ignore_eos)
    prompt = calling.render(model, messages_from_openai([m.model_dump(exclude_none=True) for m in req.messages]),
                            tools_to_render(choice, specs))
    ids = prompt_ids(model, prompt.text)
    check_context(len(ids), model.n_ctx, "messages")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, None, len(ids), model.n_ctx, ignore_eos,
                                    "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    gen = GenerationRequest(
        prompt_text=prompt.text, prompt_ids=tuple(ids), user_boundary=prompt.user_boundary,
        max_tokens=max_tokens,
        sampling=sampling_spec(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                               min_p=req.min_p, seed=req.seed, ignore_eos=ignore_eos),
        stop=_stop_list(req.stop),
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        new_splitter=lambda: calling.new_splitter(prompt, "openai"),
        new_constraint=constraint_factory(choice, fmt, calling.syntax, prompt.tools))
    ctx = OpenAIContext(kind="chat", model_name=model.name, id=new_id("chatcmpl-"),
                        created=int(time.time()),
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        logprobs=bool(req.logprobs))
    return gen, ctx


def completion_job(model: Any, req: CompletionRequest,
                   calling: ToolCalling | None = None) -> tuple[GenerationRequest, OpenAIContext]:
    """A raw completion: no chat template, no tool syntax (`calling` is unused)."""
    _common_checks(req)
    if req.best_of is not None and req.best_of != 1:
        raise ApiError(400, "best_of must be 1 on this server", param="best_of")
    if req.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise ApiError(400, "echo together with logprobs is not supported", param="echo")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < model.n_vocab]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary "
                                f"(0..{model.n_vocab - 1})", param="prompt")
        text = model.detokenize(ids)
    else:
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: {len(prompt)} prompts given; this server takes "
                                    "exactly one per request", param="prompt")
            prompt = prompt[0]
        text = prompt
        ids = prompt_ids(model, text)
    if not ids:
        raise ApiError(400, "prompt is empty", param="prompt")
    check_context(len(ids), model.n_ctx, "prompt")
    ignore_eos = bool(req.ignore_eos)
    max_tokens = resolve_max_tokens(req.max_tokens, 16, len(ids), model.n_ctx, ignore_eos,
                                    "max_tokens")
    gen = GenerationRequest(
        prompt_text=text, prompt_ids=tuple(ids), max_tokens=max_tokens,
        sampling=sampling_spec(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                               min_p=req.min_p, seed=req.seed, ignore_eos=ignore_eos),
        stop=_stop_list(req.stop), top_logprobs=req.logprobs)
    ctx = OpenAIContext(kind="completion", model_name=model.name, id=new_id("cmpl-"),
                        created=int(time.time()),
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        logprobs=req.logprobs is not None, echo_text=text if req.echo else "")
    return gen, ctx


# --- responses ------------------------------------------------------------------------

def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "replace"))


def chat_logprobs_json(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {"token": e.text, "logprob": e.logprob, "bytes": _bytes(e.text),
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for _, t, lp in e.top]}
        for e in entries], "refusal": None}


def completion_logprobs_json(entries: list[TokenLogprob], offset0: int) -> dict[str, Any]:
    offsets, pos = [], offset0
    for e in entries:
        offsets.append(pos)
        pos += len(e.text)
    return {"tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for _, t, lp in e.top} | {e.text: e.logprob} for e in entries],
            "text_offset": offsets}


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    return out | {"id": call.id, "type": "function",
                  "function": {"name": call.name, "arguments": call.arguments_json}}


def chat_response(ctx: OpenAIContext, parsed: ParsedOutput, finished: Finished,
                  logprobs: list[TokenLogprob]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content if (parsed.content or not parsed.tool_calls) else None,
                               "refusal": None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in parsed.tool_calls]
    return {"id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model_name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message,
                         "logprobs": chat_logprobs_json(logprobs) if ctx.logprobs else None,
                         "finish_reason": parsed.finish_reason}],
            "usage": usage_json(finished.usage)}


def completion_response(ctx: OpenAIContext, text: str, finished: Finished,
                        logprobs: list[TokenLogprob]) -> dict[str, Any]:
    return {"id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model_name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": ctx.echo_text + text,
                         "logprobs": completion_logprobs_json(logprobs, len(ctx.echo_text)) if ctx.logprobs else None,
                         "finish_reason": finished.finish_reason}],
            "usage": usage_json(finished.usage)}


def stream_error(message: str) -> bytes:
    return sse_data(error_body(ApiError(500, message, type="server_error", code="inference_failed"),
                               "openai"))


async def chat_stream(ctx: OpenAIContext, events: AsyncIterator[Event | None]) -> AsyncIterator[bytes]:
    base = {"id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created,
            "model": ctx.model_name, "system_fingerprint": None}
    extra = {"usage": None} if ctx.include_usage else {}

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse_data(base | {"choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish}]} | extra)

    yield chunk({"role": "assistant", "content": ""})
    async for event in events:
        if event is None:
            yield KEEPALIVE
        elif isinstance(event, TextDelta):
            pieces = stream_deltas(event.events)
            if ctx.logprobs and event.logprobs:
                # Logprobs ride on the first chunk of the text their tokens produced.
                lp = chat_logprobs_json(list(event.logprobs))
                first = pieces.pop(0) if pieces else {"content": ""}
                yield chunk(first, logprobs=lp)
            for delta in pieces:
                yield chunk(delta)
        elif isinstance(event, Finished):
            if event.finish_reason == "cancelled":
                yield stream_error("the request was cancelled because the server is shutting down")
                return
            parsed: ParsedOutput = event.output
            for delta in stream_deltas(parsed.events):
                yield chunk(delta)
            yield chunk({}, parsed.finish_reason)
            if ctx.include_usage:
                yield sse_data(base | {"choices": [], "usage": usage_json(event.usage)})
            yield DONE
        elif isinstance(event, Failed):
            yield stream_error(event.message)
            return


def stream_deltas(out_events: Any) -> list[dict[str, Any]]:
    """Chat chunk `delta` objects for splitter events; a call arrives whole, with its index."""
    out = []
    for ev in out_events:
        if isinstance(ev, ContentDelta):
            out.append({"content": ev.text})
        elif isinstance(ev, ReasoningDelta):
            out.append({"reasoning_content": ev.text})
        elif isinstance(ev, ToolCallEnd):
            out.append({"tool_calls": [tool_call_json(ev.call, ev.index)]})
    return out


async def completion_stream(ctx: OpenAIContext, events: AsyncIterator[Event | None]) -> AsyncIterator[bytes]:
    base = {"id": ctx.id, "object": "text_completion", "created": ctx.created,
            "model": ctx.model_name, "system_fingerprint": None}
    extra = {"usage": None} if ctx.include_usage else {}
    offset = len(ctx.echo_text)

    def chunk(text: str, finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse_data(base | {"choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                             "finish_reason": finish}]} | extra)

    if ctx.echo_text:
        yield chunk(ctx.echo_text)
    async for event in events:
        if event is None:
            yield KEEPALIVE
        elif isinstance(event, TextDelta):
            lp = None
            if ctx.logprobs and event.logprobs:
                lp = completion_logprobs_json(list(event.logprobs), offset)
            offset += len(event.text)
            if event.text or lp is not None:
                yield chunk(event.text, logprobs=lp)
        elif isinstance(event, Finished):
            if event.finish_reason == "cancelled":
                yield stream_error("the request was cancelled because the server is shutting down")
                return
            yield chunk("", event.finish_reason)
            if ctx.include_usage:
                yield sse_data(base | {"choices": [], "usage": usage_json(event.usage)})
            yield DONE
        elif isinstance(event, Failed):
            yield stream_error(event.message)
            return
