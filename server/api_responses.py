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
`message` with `output_text`, `function_call`); `responses_stream` runs a
`ResponsesStreamWriter`, which emits the typed event sequence — `response.created`,
`response.in_progress`, per item `output_item.added`, the part/delta/done events,
`output_item.done`, and finally `response.completed` (or `response.incomplete` when the
token limit was hit) — each with a `sequence_number`, `: prefill` comments while waiting,
and `error` plus `response.failed` (nothing after them) if inference fails after the stream
started. A response without any output still streams one empty message.

The server keeps no conversation state: `previous_response_id` is rejected (send the
earlier output items back in `input` instead), `store` is accepted and answered `false`. Reasoning
items passed back belong to the assistant turn that follows them; they reach the prompt
only through exact replay (chat templates drop earlier reasoning). A response whose output
holds calls is `completed`, also when a call was repaired at the token limit.
`tool_choice`, `parallel_tool_calls` and `text.format` (json_object, json_schema) become the
generation's decoding constraint (`server.structured`).
`include: ["message.output_text.logprobs"]` (or `top_logprobs`, 0..20) puts the log-probs of
the message's tokens (`MessageLogprobs`: not those of reasoning or calls) on its `output_text`
and on each `output_text.delta`; `include` values of items this server never produces are
accepted, others are a 400. Accepted without effect on the output, as the API defines them:
`user`, `metadata`, `store`, `service_tier`, `safety_identifier`, `prompt_cache_key`,
`stream_options`. Refused with a 400 naming the field (`RESPONSES_REFUSED`, `text.verbosity`):
what the server would not honour, such as `reasoning`, `background`, `truncation: "auto"`.
Extensions: `top_k`, `min_p`, `seed`, `ignore_eos`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from pydantic import Field

from server.apibase import (MIN_P, SEED, TOKEN_COUNT, TOP_K, TOP_P, Frames, OpenModel, Refused, RequestDefaults,
                            StreamWriter, StrictModel, new_id, refused_sampler_fields, writes)
from server.errors import ApiError
from server.genrequest import ChatRequest, GenerationSettings, OutputRules, Sampling, TokenLimit, prepare_chat
from server.jobs import Event, Failed, Finished, GenerationRequest, TextDelta, TokenLogprob, Usage
from server.prompting import ContentDelta, ParsedOutput, ReasoningDelta, ToolCall, ToolCallEnd, ToolCalling
from server.sse import sse_event
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


# `include` values: the one that asks for something this server produces (the message's
# log-probs), and those of items it never produces (file search, web search, images, code
# interpreter, encrypted reasoning), for which there is nothing to include.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDE_NOTHING_HERE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content"})

RESPONSES_REFUSED = refused_sampler_fields() + (
    Refused("background", "responses are answered on the request's own connection", (None, False)),
    Refused("conversation", "this server stores no conversations; send the earlier items in 'input'"),
    Refused("prompt", "stored prompt templates are not supported; send 'instructions' and 'input'"),
    Refused("max_tool_calls", "limit calls with parallel_tool_calls: false"),
    Refused("truncation", "a prompt that does not fit is refused, never truncated", (None, "disabled")),
    Refused("reasoning", "whether the model reasons is up to its chat template", (None, {})),
)


class ResponsesRequest(StrictModel):
    refused = RESPONSES_REFUSED
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
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


# --- translation ----------------------------------------------------------------------

@dataclass
class ResponsesContext:
    model_name: str
    id: str
    created_at: int
    request_echo: dict[str, Any]
    logprobs: bool = False
    """The message's `output_text` carries the log-probs of its tokens."""


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether the response lists log-probs: `include` names them, or `top_logprobs` is set (it
    asks for nothing else); a 400 naming `include` for a value the API does not define."""
    for value in req.include or ():
        if value != INCLUDE_LOGPROBS and value not in INCLUDE_NOTHING_HERE:
            raise ApiError(400, f"include: {value!r} is not supported by this server (supported: "
                                f"{', '.join(sorted(INCLUDE_NOTHING_HERE | {INCLUDE_LOGPROBS}))})", param="include")
    return INCLUDE_LOGPROBS in (req.include or ()) or req.top_logprobs is not None


def text_verbosity_check(text: dict[str, Any] | None) -> None:
    if text and text.get("verbosity") not in (None, "medium"):
        raise ApiError(400, "text.verbosity is not supported by this server (the output's length is up to "
                            "the model)", param="text.verbosity")


def responses_job(model: Any, req: ResponsesRequest, calling: ToolCalling,
                  defaults: RequestDefaults = RequestDefaults()) -> tuple[GenerationRequest, ResponsesContext]:
    if req.previous_response_id:
        raise ApiError(400, "previous_response_id is not supported: this server stores no responses; "
                            "send the earlier output items back in 'input'", param="previous_response_id")
    text_verbosity_check(req.text)
    logprobs = wants_logprobs(req)
    sampling = Sampling.of(req)
    tool_dump = [t.model_dump(exclude_none=True) for t in req.tools or []]
    rules = OutputRules.checked(json_format=responses_text_format((req.text or {}).get("format")),
                                choice=openai_tool_choice(req.tool_choice, req.parallel_tool_calls),
                                tools=tools_from_responses(tool_dump), ignore_eos=sampling.ignore_eos)
    items = req.input if isinstance(req.input, str) else [it.model_dump(exclude_none=True) for it in req.input]
    settings = GenerationSettings(sampling, TokenLimit(req.max_output_tokens, defaults.max_tokens_for(),
                                                       "max_output_tokens"),
                                  top_logprobs=(req.top_logprobs or 0) if logprobs else None)
    gen = prepare_chat(model, calling, ChatRequest("responses", messages_from_responses(req.instructions, items),
                                                   rules, settings, "input"))
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": gen.sampling.temperature, "top_p": gen.sampling.top_p,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": tool_dump}
    return gen, ResponsesContext(model_name=model.name, id=new_id("resp_"), created_at=int(time.time()),
                                 request_echo=echo, logprobs=logprobs)


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


def logprobs_json(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Responses' `logprobs` of an output text: one object per token, with its top alternatives."""
    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}
    return [token(e.text, e.logprob) | {"top_logprobs": [token(t, lp) for _, t, lp in e.top]} for e in entries]


class MessageLogprobs:
    """Sorts generated tokens' log-prob entries between the message and the rest (reasoning,
    calls): a token belongs to the message when the text it released produced message text.
    Entries whose text is still held back (a possible stop sequence or tag) wait for the next
    text that is released."""

    def __init__(self) -> None:
        self.pending: list[TokenLogprob] = []

    def feed(self, entries: Sequence[TokenLogprob], events: Sequence[Any]) -> list[TokenLogprob]:
        """The message's entries among `entries` (and those waiting), given the splitter events
        their text produced."""
        self.pending.extend(entries)
        if not events:
            return []
        taken, self.pending = self.pending, []
        return taken if any(isinstance(e, ContentDelta) for e in events) else []


def message_entries(deltas: Sequence[TextDelta], final_events: Sequence[Any]) -> list[TokenLogprob]:
    """The message's log-prob entries of a whole generation (`MessageLogprobs` over its deltas,
    then the events the splitter released at the end)."""
    sorter = MessageLogprobs()
    out = [e for d in deltas for e in sorter.feed(d.logprobs, d.events)]
    return out + sorter.feed((), final_events)


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments_json, "status": status}


def response_object(ctx: ResponsesContext, parsed: ParsedOutput, finished: Finished,
                    deltas: Sequence[TextDelta] = ()) -> dict[str, Any]:
    """The response of a whole generation; `deltas` are its text deltas (for log-probs)."""
    output: list[dict[str, Any]] = []
    status = _status(parsed)
    if parsed.reasoning:
        output.append(reasoning_item(new_id("rs_"), parsed.reasoning))
    if parsed.content or not parsed.tool_calls:
        logprobs = logprobs_json(message_entries(deltas, parsed.events)) if ctx.logprobs else None
        output.append(message_item(new_id("msg_"), parsed.content,
                                   "incomplete" if status == "incomplete" else "completed", logprobs))
    for call in parsed.tool_calls:
        output.append(function_call_item(new_id("fc_"), call))
    return _envelope(ctx, status, output, finished.usage)


def stream_error(message: str) -> bytes:
    """A stand-alone error event, for failures outside the event sequence's own bookkeeping."""
    return sse_event("error", {"type": "error", "sequence_number": 0, "code": "server_error",
                               "message": message, "param": None})


CANCELLED = "the request was cancelled because the server is shutting down"


class ResponsesStreamWriter(StreamWriter):
    """The typed event sequence of one streamed response (see the module docstring).

    Text and reasoning deltas go to the open item, opening one of their type first (which
    closes the other); a call is an item of its own, added and done at once. `output` holds the
    items done so far, as the final response lists them."""

    def __init__(self, ctx: ResponsesContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open_type: str | None = None
        """"message" or "reasoning" while an item is open, else None."""
        self.open_id = ""
        self.open_text = ""
        self.sorter = MessageLogprobs()
        self.open_logprobs: list[dict[str, Any]] = []
        """The open message's log-probs so far (with `ctx.logprobs`)."""
        self.delta_logprobs: list[dict[str, Any]] = []
        """The log-probs that go out with the next message text delta."""

    def frame(self, kind: str, **payload: Any) -> bytes:
        """One event of the sequence, with the next sequence number."""
        frame = sse_event(kind, {"type": kind, "sequence_number": self.seq, **payload})
        self.seq += 1
        return frame

    def opening(self) -> Frames:
        return [self.frame("response.created", response=_envelope(self.ctx, "in_progress", [], None)),
                self.frame("response.in_progress", response=_envelope(self.ctx, "in_progress", [], None))]

    # --- worker events ---

    @writes(TextDelta)
    def text(self, event: TextDelta) -> Frames:
        self.take_logprobs(event.logprobs, event.events)
        return self.write_all(event.events)

    def take_logprobs(self, entries: Sequence[TokenLogprob], events: Sequence[Any]) -> None:
        if self.ctx.logprobs:
            self.delta_logprobs += logprobs_json(self.sorter.feed(entries, events))

    @writes(Finished)
    def finished(self, event: Finished) -> Frames:
        if event.finish_reason == "cancelled":
            return self.fail("server_shutting_down", CANCELLED)
        parsed: ParsedOutput = event.output
        status = _status(parsed)
        self.take_logprobs((), parsed.events)
        frames = self.write_all(parsed.events)
        if not self.output and self.open_type is None:
            frames += self.open_message()
        frames += self.close_item(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return frames + [self.frame(kind, response=_envelope(self.ctx, status, self.output, event.usage))]

    @writes(Failed)
    def failed(self, event: Failed) -> Frames:
        return self.fail("server_error", event.message)

    def fail(self, code: str, message: str) -> Frames:
        return self.end(self.frame("error", code=code, message=message, param=None),
                        self.frame("response.failed", response=_envelope(
                            self.ctx, "failed", self.output, None, {"code": "server_error", "message": message})))

    # --- output items ---

    def close_item(self, status: str = "completed") -> Frames:
        if self.open_type is None:
            return []
        idx, item_id, text = len(self.output), self.open_id, self.open_text
        if self.open_type == "message":
            logprobs = self.open_logprobs
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            frames = [self.frame("response.output_text.done", item_id=item_id, output_index=idx,
                                 content_index=0, text=text, logprobs=logprobs),
                      self.frame("response.content_part.done", item_id=item_id, output_index=idx,
                                 content_index=0, part=part)]
            item = message_item(item_id, text, status, logprobs)
            self.open_logprobs = []
        else:
            frames = [self.frame("response.reasoning_text.done", item_id=item_id, output_index=idx,
                                 content_index=0, text=text)]
            item = reasoning_item(item_id, text)
        frames.append(self.frame("response.output_item.done", output_index=idx, item=item))
        self.output.append(item)
        self.open_type, self.open_id, self.open_text = None, "", ""
        return frames

    def open_item(self, item_type: str, prefix: str) -> Frames:
        frames = self.close_item()
        self.open_type, self.open_id = item_type, new_id(prefix)
        return frames

    def open_message(self) -> Frames:
        frames = self.open_item("message", "msg_")
        idx = len(self.output)
        frames.append(self.frame("response.output_item.added", output_index=idx,
                                 item={"type": "message", "id": self.open_id, "status": "in_progress",
                                       "role": "assistant", "content": []}))
        frames.append(self.frame("response.content_part.added", item_id=self.open_id, output_index=idx,
                                 content_index=0,
                                 part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return frames

    def open_reasoning(self) -> Frames:
        frames = self.open_item("reasoning", "rs_")
        frames.append(self.frame("response.output_item.added", output_index=len(self.output),
                                 item={"type": "reasoning", "id": self.open_id, "summary": [], "content": []}))
        return frames

    @writes(ContentDelta)
    def content(self, event: ContentDelta) -> Frames:
        frames = [] if self.open_type == "message" else self.open_message()
        self.open_text += event.text
        logprobs, self.delta_logprobs = self.delta_logprobs, []
        self.open_logprobs += logprobs
        return frames + [self.frame("response.output_text.delta", item_id=self.open_id,
                                    output_index=len(self.output), content_index=0, delta=event.text,
                                    logprobs=logprobs)]

    @writes(ReasoningDelta)
    def reasoning(self, event: ReasoningDelta) -> Frames:
        frames = [] if self.open_type == "reasoning" else self.open_reasoning()
        self.open_text += event.text
        return frames + [self.frame("response.reasoning_text.delta", item_id=self.open_id,
                                    output_index=len(self.output), content_index=0, delta=event.text)]

    @writes(ToolCallEnd)
    def tool_call(self, event: ToolCallEnd) -> Frames:
        frames = self.close_item()
        idx, item_id, call = len(self.output), new_id("fc_"), event.call
        frames += [
            self.frame("response.output_item.added", output_index=idx,
                       item=function_call_item(item_id, call, "in_progress") | {"arguments": ""}),
            self.frame("response.function_call_arguments.delta", item_id=item_id, output_index=idx,
                       delta=call.arguments_json),
            self.frame("response.function_call_arguments.done", item_id=item_id, output_index=idx,
                       name=call.name, arguments=call.arguments_json)]
        item = function_call_item(item_id, call)
        frames.append(self.frame("response.output_item.done", output_index=idx, item=item))
        self.output.append(item)
        return frames


def responses_stream(ctx: ResponsesContext, events: AsyncIterator[Event | None]) -> AsyncIterator[bytes]:
    return ResponsesStreamWriter(ctx).stream(events)
