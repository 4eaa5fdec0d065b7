"""OpenAI Chat Completions and (legacy) Completions: schemas, translation, responses.

Request side: `ChatCompletionRequest` / `CompletionRequest` validate the body.
`chat_job` reads a chat into the neutral records (`server.tools.apis.messages_from_openai`,
the one check of the messages beyond the schema), its tools, `tool_choice`,
`parallel_tool_calls` and `response_format` into `OutputRules` and its sampling fields,
limit, stops and log-probs into `GenerationSettings`, and hands them to the shared
preparation path (`server.genrequest.prepare_chat`: render, tokenize, the context-length rule
on param `messages`). `completion_job` tokenizes its raw prompts itself and joins that path
at `generation_request` (param `prompt`). Both return one `GenerationRequest` per choice plus
the `OpenAIContext` needed to answer.

Response side: `chat_response` / `completion_response` build the JSON body from the
collected output; `chat_stream` / `completion_stream` run a `ChatStreamWriter` /
`CompletionStreamWriter`, which turn the choices' worker events into
`chat.completion.chunk` / `text_completion` SSE chunks ending with `data: [DONE]` (after a
usage chunk with `stream_options.include_usage`), with `: prefill` keepalive comments before
the first token and an error chunk (nothing after it) when inference fails or the server
shuts down after the headers were sent.

A raw completion prompt is tokenized with special-token parsing, so a client may send an
already rendered chat prompt (`<|im_start|>user ...`); a list of token ids is used as is.
`prompt` may be a string, a list of strings, a token-id list or a list of token-id lists;
each prompt is its own choice (times `n`), in order. With `echo` and `logprobs` every prompt
token is scored (`server.scoring`; the first has a null log-prob) before the generated ones,
and `max_tokens: 0` scores without generating. A completion's `logprobs` list every generated
token, the end-of-sequence token that ended it included (`Finished.end_logprob`; it adds no
text), so that `usage.completion_tokens` and the entries agree; chat `logprobs` list only the
tokens of the message.
`n` > 1 fans a request out into n jobs (`server.choices`), merged by `choices[i].index`;
usage counts every choice's completion tokens and each prompt once.
`logit_bias` (both APIs) is applied by the engine's sampler (`engine.sampling.apply_logit_bias`:
-100 bans a token, +100 makes it the only choice), also to the greedy choice inside tool-call
syntax; a token the decoding constraint forces wins over it. Log-probs stay those of the raw
distribution.
Extensions beyond the OpenAI API: `top_k`, `min_p`, `ignore_eos`, `return_tokens_as_token_ids`
(completions: logprob tokens named `token_id:N`, as vLLM does), `chat_template_kwargs` (chat:
extra chat-template variables such as `enable_thinking`, as vLLM and llama.cpp take them).
Chat messages are not: a control-token spelling inside a message stays text
(`server.prompting`), only the template's own markers are control tokens.

Tools: definitions and earlier calls are rendered by the model's tool syntax
(`server.prompting.ToolCalling`); generated calls come back as `tool_calls` with
`finish_reason: "tool_calls"` (streamed as one complete delta per call, once it is known to
be valid), thinking as `reasoning_content`.
`tool_choice`, `parallel_tool_calls` and `response_format` (json_object, json_schema) become
the generation's decoding constraint (`server.structured`).
Accepted without effect on the output, as the API defines them: `user`, `metadata`, `store`,
`service_tier`, `safety_identifier`, `prompt_cache_key`.
Rejected with a 400: `best_of` other than 1, nonzero penalties (the engine has none),
image or audio content, `suffix`, `n` above `MAX_CHOICES` choices in all, and every field of
`CHAT_REFUSED` / `COMPLETION_REFUSED` set to anything but its neutral value (`reasoning_effort`,
`repeat_penalty` and the like).

No HTTP objects here: routes live in `server.app`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, ClassVar, Literal

from pydantic import Field

from engine.prompt_text import from_rendered
from server.apibase import (MAX_TOKENS_LIMIT, MIN_P, SEED, TOKEN_COUNT, TOP_K, TOP_P, Frames, OpenModel, Refused,
                            RequestDefaults, StreamWriter, StrictModel, check_prompt_size, logit_bias_pairs, new_id,
                            refused_sampler_fields, writes)
from server.choices import ChoiceEvent, ChoiceOutput, fan_out, total_usage
from server.errors import ApiError, error_body
from server.genrequest import (ChatRequest, GenerationSettings, OutputRules, PromptTokens, Sampling, TokenLimit,
                               generation_request, prepare_chat, template_kwargs)
from server.jobs import Failed, Finished, GenerationRequest, TextDelta, TokenLogprob, Usage
from server.prompting import (ContentDelta, ParsedOutput, ReasoningDelta, ToolCall, ToolCallEnd, ToolCalling,
                              prompt_ids)
from server.scoring import PromptScored, legacy_logprobs
from server.sse import DONE, sse_data
from server.structured import openai_response_format, openai_tool_choice
from server.tools.apis import messages_from_openai, tools_from_openai

# The Completions API's own default for `max_tokens` (OpenAI's documented value).
COMPLETION_DEFAULT_TOKENS = 16

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
Penalty = Field(None, ge=-2.0, le=2.0)
# Choices of one request (prompts times n): each is a job, and all of them are queued at once.
MAX_CHOICES = 128


# What the OpenAI APIs document (or other servers' clients send) and this server does not
# honour; each is a 400 naming it unless its value asks for nothing (`apibase.Refused`).
CHAT_REFUSED = refused_sampler_fields() + (
    Refused("reasoning_effort", "whether the model reasons is up to its chat template: "
                                "use chat_template_kwargs, e.g. enable_thinking"),
    Refused("verbosity", "the output's length is up to the model"),
    Refused("audio", "there is no audio output", (None,)),
    Refused("modalities", "text is the only output", (None, ["text"])),
    Refused("prediction", "predicted outputs are not supported"),
    Refused("web_search_options", "there is no web search"),
    Refused("functions", "use `tools`"),
    Refused("function_call", "use `tool_choice`"),
)
COMPLETION_REFUSED = refused_sampler_fields()


class _SamplingFields(StrictModel):
    model: str | None = None
    temperature: float | None = Temperature
    top_p: float | None = TOP_P
    top_k: int | None = TOP_K
    min_p: float | None = MIN_P
    seed: int | None = SEED
    max_tokens: int | None = TOKEN_COUNT
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Penalty
    frequency_penalty: float | None = Penalty
    ignore_eos: bool | None = None
    logit_bias: dict[str, float | int] | None = None


class ChatCompletionRequest(_SamplingFields):
    refused = CHAT_REFUSED
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = TOKEN_COUNT
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    refused = COMPLETION_REFUSED
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    """0: score the prompt (with echo and logprobs) without generating."""
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    return_tokens_as_token_ids: bool | None = None
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
    n: int = 1
    """Choices per prompt; choice p * n + i is sample i of prompt p."""
    n_choices: int = 1
    echo_texts: tuple[str, ...] = ()
    """Per choice: the prompt text echoed before its completion ("" without echo)."""
    token_ids: bool = False

    def echo_text(self, index: int) -> str:
        return self.echo_texts[index] if self.echo_texts else ""


def _common_checks(req: _SamplingFields) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value:
            raise ApiError(400, f"{name} is not supported by this server (use 0 or omit it)",
                           param=name)


def chat_job(model: Any, req: ChatCompletionRequest, calling: ToolCalling,
             defaults: RequestDefaults = RequestDefaults()) -> tuple[list[GenerationRequest], OpenAIContext]:
    _common_checks(req)
    sampling = Sampling.of(req, logit_bias_pairs(req.logit_bias, model.n_vocab))
    response_format = req.response_format.model_dump() if req.response_format is not None else None
    rules = OutputRules.checked(json_format=openai_response_format(response_format),
                                choice=openai_tool_choice(req.tool_choice, req.parallel_tool_calls),
                                tools=tools_from_openai([t.model_dump(exclude_none=True) for t in req.tools or []]),
                                ignore_eos=sampling.ignore_eos)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    limit = TokenLimit(requested, defaults.max_tokens_for(),
                       "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    settings = GenerationSettings(sampling, limit, stop=req.stop,
                                  top_logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    messages = messages_from_openai([m.model_dump(exclude_none=True) for m in req.messages])
    gen = prepare_chat(model, calling, ChatRequest("openai", messages, rules, settings, "messages",
                                                   template_kwargs(req.chat_template_kwargs, "chat_template_kwargs")))
    n = req.n or 1
    ctx = OpenAIContext(kind="chat", model_name=model.name, id=new_id("chatcmpl-"),
                        created=int(time.time()),
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        logprobs=bool(req.logprobs), n=n, n_choices=n)
    return fan_out(gen, n), ctx


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts, each a text or a token-id list."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _prompt_tokens(model: Any, prompt: str | list[int], param: str) -> tuple[str, PromptTokens]:
    """(text, tokens) of one prompt; a token-id list is used as is. The tokens' text is what
    prefix reuse and the disk cache match on (`engine.prompt_text`): a raw prompt is the caller's
    own rendering, so every control-token spelling in it is meant as the token. The size check
    names the prompt's place in the list, the context check the field."""
    if isinstance(prompt, str):
        check_prompt_size(model, prompt, param)
        key_text = from_rendered(prompt)
        return prompt, PromptTokens(key_text, tuple(prompt_ids(model, key_text)), "prompt")
    bad = [t for t in prompt if not 0 <= t < model.n_vocab]
    if bad:
        raise ApiError(400, f"{param}: token id {bad[0]} is outside the vocabulary "
                            f"(0..{model.n_vocab - 1})", param="prompt")
    return model.detokenize(prompt), PromptTokens(model.detokenize_prompt(prompt), tuple(prompt), "prompt")


def completion_job(model: Any, req: CompletionRequest, calling: ToolCalling | None = None,
                   defaults: RequestDefaults = RequestDefaults()) -> tuple[list[GenerationRequest], OpenAIContext]:
    """A raw completion: no chat template, no tool syntax (`calling` is unused). One job per
    prompt and sample, prompt-major. Without `max_tokens` it generates the API's documented 16
    tokens, or the server's default if smaller."""
    _common_checks(req)
    if req.best_of is not None and req.best_of != 1:
        raise ApiError(400, "best_of must be 1 on this server", param="best_of")
    if req.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    prompts = _prompt_list(req.prompt)
    if not prompts:
        raise ApiError(400, "prompt is empty", param="prompt")
    n = req.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts times n={n} make {len(prompts) * n} choices; "
                            f"at most {MAX_CHOICES} per request", param="n")
    limit = TokenLimit(req.max_tokens, defaults.max_tokens_for(COMPLETION_DEFAULT_TOKENS), "max_tokens")
    settings = GenerationSettings(Sampling.of(req, logit_bias_pairs(req.logit_bias, model.n_vocab)), limit,
                                  stop=req.stop, top_logprobs=req.logprobs,
                                  prompt_logprobs=req.logprobs if req.echo else None)
    settings.sampling.check()  # before any prompt is read: this API has always answered in this order
    gens: list[GenerationRequest] = []
    echoes: list[str] = []
    for p, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
        text, tokens = _prompt_tokens(model, prompt, param)
        if not tokens.ids:
            raise ApiError(400, f"{param} is empty", param="prompt")
        gens.extend(fan_out(generation_request(model.n_ctx, tokens, settings), n))
        echoes.extend([text if req.echo else ""] * n)
    ctx = OpenAIContext(kind="completion", model_name=model.name, id=new_id("cmpl-"),
                        created=int(time.time()),
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        logprobs=req.logprobs is not None, n=n, n_choices=len(gens),
                        echo_texts=tuple(echoes), token_ids=bool(req.return_tokens_as_token_ids))
    return gens, ctx


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


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    return out | {"id": call.id, "type": "function",
                  "function": {"name": call.name, "arguments": call.arguments_json}}


def _finished(out: ChoiceOutput) -> Finished:
    assert out.finished is not None
    return out.finished


def _usage(ctx: OpenAIContext, outputs: list[ChoiceOutput]) -> Usage:
    return total_usage([_finished(o).usage for o in outputs], ctx.n)


def chat_choice(ctx: OpenAIContext, index: int, out: ChoiceOutput) -> dict[str, Any]:
    parsed: ParsedOutput = _finished(out).output
    message: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content if (parsed.content or not parsed.tool_calls) else None,
                               "refusal": None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in parsed.tool_calls]
    return {"index": index, "message": message,
            "logprobs": chat_logprobs_json(out.logprobs) if ctx.logprobs else None,
            "finish_reason": parsed.finish_reason}


def chat_response(ctx: OpenAIContext, outputs: list[ChoiceOutput]) -> dict[str, Any]:
    return {"id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model_name,
            "system_fingerprint": None,
            "choices": [chat_choice(ctx, i, o) for i, o in enumerate(outputs)],
            "usage": usage_json(_usage(ctx, outputs))}


def generated_entries(out: ChoiceOutput) -> list[TokenLogprob]:
    """A completion's log-prob entries: one per generated token, the end-of-sequence token that
    ended it included (it produced no text, but clients that score a prompt with `max_tokens: 1`
    take the entries before the last as the prompt's)."""
    end = _finished(out).end_logprob
    return out.logprobs + ([end] if end is not None else [])


def completion_choice(ctx: OpenAIContext, index: int, out: ChoiceOutput) -> dict[str, Any]:
    echo = ctx.echo_text(index)
    logprobs = legacy_logprobs(out.prompt, generated_entries(out), len(echo), ctx.token_ids) if ctx.logprobs else None
    return {"index": index, "text": echo + out.text, "logprobs": logprobs,
            "finish_reason": _finished(out).finish_reason}


def completion_response(ctx: OpenAIContext, outputs: list[ChoiceOutput]) -> dict[str, Any]:
    return {"id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model_name,
            "system_fingerprint": None,
            "choices": [completion_choice(ctx, i, o) for i, o in enumerate(outputs)],
            "usage": usage_json(_usage(ctx, outputs))}


def stream_error(message: str) -> bytes:
    return sse_data(error_body(ApiError(500, message, type="server_error", code="inference_failed"),
                               "openai"))


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


CANCELLED = "the request was cancelled because the server is shutting down"


class ChoicesStreamWriter(StreamWriter):
    """What the chat and completion streams share: the choices' events, each dispatched with
    its choice index; the end of each choice; the usage chunk and `[DONE]` after the last.
    A subclass adds its API's chunks: its opening, its `TextDelta` method and `finish`."""

    object_name: ClassVar[str] = ""

    def __init__(self, ctx: OpenAIContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.base = {"id": ctx.id, "object": self.object_name, "created": ctx.created,
                     "model": ctx.model_name, "system_fingerprint": None}
        self.extra = {"usage": None} if ctx.include_usage else {}
        self.usages: dict[int, Usage] = {}

    def chunk(self, choice: dict[str, Any]) -> bytes:
        return sse_data(self.base | {"choices": [choice]} | self.extra)

    @writes(ChoiceEvent)
    def choice_event(self, item: ChoiceEvent) -> Frames:
        return self.write(item.event, item.index)

    @writes(Finished)
    def finished(self, event: Finished, index: int) -> Frames:
        if event.finish_reason == "cancelled":
            return self.end(stream_error(CANCELLED))
        self.usages[index] = event.usage
        return self.finish(event, index)

    def finish(self, event: Finished, index: int) -> Frames:
        """The last chunks of one choice."""
        raise NotImplementedError

    @writes(Failed)
    def failed(self, event: Failed, index: int) -> Frames:
        return self.end(stream_error(event.message))

    def closing(self) -> Frames:
        frames = []
        if self.ctx.include_usage:
            total = total_usage([self.usages[i] for i in range(self.ctx.n_choices)], self.ctx.n)
            frames.append(sse_data(self.base | {"choices": [], "usage": usage_json(total)}))
        return frames + [DONE]


class ChatStreamWriter(ChoicesStreamWriter):
    """`chat.completion.chunk`s: a role chunk per choice first, then a delta per splitter event."""

    object_name = "chat.completion.chunk"

    def delta(self, index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return self.chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    def opening(self) -> Frames:
        return [self.delta(index, {"role": "assistant", "content": ""}) for index in range(self.ctx.n_choices)]

    @writes(TextDelta)
    def text(self, event: TextDelta, index: int) -> Frames:
        pieces = stream_deltas(event.events)
        frames = []
        if self.ctx.logprobs and event.logprobs:
            # Logprobs ride on the first chunk of the text their tokens produced.
            first = pieces.pop(0) if pieces else {"content": ""}
            frames.append(self.delta(index, first, logprobs=chat_logprobs_json(list(event.logprobs))))
        return frames + [self.delta(index, delta) for delta in pieces]

    def finish(self, event: Finished, index: int) -> Frames:
        parsed: ParsedOutput = event.output
        return [self.delta(index, delta) for delta in stream_deltas(parsed.events)] + [
            self.delta(index, {}, parsed.finish_reason)]


class CompletionStreamWriter(ChoicesStreamWriter):
    """`text_completion` chunks: the echoed prompt (at once, or with its scores when it is
    scored), then the generated text with its offsets counted after the echo."""

    object_name = "text_completion"

    def __init__(self, ctx: OpenAIContext) -> None:
        super().__init__(ctx)
        self.offsets = [len(ctx.echo_text(i)) for i in range(ctx.n_choices)]

    def text_chunk(self, index: int, text: str, finish: str | None = None, logprobs: Any = None) -> bytes:
        return self.chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})

    def opening(self) -> Frames:
        if self.ctx.logprobs and any(self.ctx.echo_texts):
            return []  # scored prompts are echoed with their log-probs, once they are known
        return [self.text_chunk(index, self.ctx.echo_text(index))
                for index in range(self.ctx.n_choices) if self.ctx.echo_text(index)]

    @writes(PromptScored)
    def prompt_scored(self, event: PromptScored, index: int) -> Frames:
        return [self.text_chunk(index, self.ctx.echo_text(index),
                                logprobs=legacy_logprobs(event, (), 0, self.ctx.token_ids))]

    @writes(TextDelta)
    def text(self, event: TextDelta, index: int) -> Frames:
        lp = None
        if self.ctx.logprobs and event.logprobs:
            lp = legacy_logprobs(None, event.logprobs, self.offsets[index], self.ctx.token_ids)
        self.offsets[index] += len(event.text)
        return [self.text_chunk(index, event.text, logprobs=lp)] if event.text or lp is not None else []

    def finish(self, event: Finished, index: int) -> Frames:
        lp = None
        if self.ctx.logprobs and event.end_logprob is not None:
            lp = legacy_logprobs(None, [event.end_logprob], self.offsets[index], self.ctx.token_ids)
        return [self.text_chunk(index, "", event.finish_reason, logprobs=lp)]


def chat_stream(ctx: OpenAIContext, events: AsyncIterator[ChoiceEvent | None]) -> AsyncIterator[bytes]:
    return ChatStreamWriter(ctx).stream(events)


def completion_stream(ctx: OpenAIContext, events: AsyncIterator[ChoiceEvent | None]) -> AsyncIterator[bytes]:
    return CompletionStreamWriter(ctx).stream(events)
