"""The endpoint table of ds4-server: each route's path, method, API dialect, handler and OpenAPI info.

`ENDPOINTS` is the one list of what the server answers. `server.app` adds a route per row,
the OpenAPI document takes each row's summary and request body schema, and
`server.errors.dialect_for_path(path, ENDPOINTS)` the error shape of a path (also of
unknown paths and methods below an endpoint's path). A new endpoint is one row here.

A row's `handler` is a factory: given the app's `Served` state it returns the route function
(whose name and signature FastAPI reads for the operation id and parameters). Inference
endpoints share one request path, `inference(api)`:

    check Content-Type and Content-Encoding (415) -> read body (size limit 413, time
    limit 408; `server.httpbody`) -> on the app's `PrepareExecutor` (a few threads, bounded
    waiting, 503 beyond): hardened JSON parse, schema validation, render, the size check
    that needs no tokenizing, tokenize, context-length check -> submit job -> stream SSE or
    collect and answer JSON

with each API's translation as an `InferenceApi` (schema, make_job, respond, stream,
stream_error; `server.api_openai`, `api_anthropic`, `api_responses`). Tool objects that
cannot be mapped (`ToolInputError`) are 400s like any other bad input; disconnects cancel
the job, streaming or not. Request bodies are parsed by the handlers themselves (FastAPI's
own body parsing would bypass the hardened parser); the schemas only document them.

Chat templates: a template that refuses a conversation (`raise_exception`) gives a 400, one
that fails or runs past its render limits a 500 saying so (`template_errors`). A template
that fails the probe render at startup (`probe_chat`) turns the chat endpoints off: they
answer 500 at once with the reason, and raw `/v1/completions` stays served.

`/v1/models` lists the model with its file's SHA-256 (computed once on a background thread
from the app's creation, `FileDigests`) and the usage counting rule, so that a client can tell
the same file served by another stack under another name.

It does not create the app, install middleware or render errors (`server.app` does).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.chat_template import PROBE_MESSAGES, ChatTemplateError, ChatTemplateRejected
from server import api_anthropic, api_openai, api_responses, api_tokenize
from server.apibase import RequestDefaults, StrictModel, check_prompt_size, validate_body
from server.config import ServerConfig
from server.errors import ApiError, Dialect
from server.httpbody import CLIENT_CLOSED, body_headers_error, read_body
from server.jobs import Event, Failed, Finished, GenerationRequest, TextDelta, TokenLogprob
from server.choices import check_work, choice_events, collect_choices, submit_choices
from server.jsonparse import JsonBodyError, parse_json_body
from server.kvstore import KVStore
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.prepare import PrepareExecutor
from server.prompting import ToolCalling, prompt_ids
from server.sse import SSEResponse, job_events, wait_or_disconnect
from server.tools.apis import ToolInputError
from server.worker import InferenceWorker

log = logging.getLogger("ds4.server")


@dataclass(frozen=True)
class Served:
    """What the handlers of one app serve from."""
    model: Any
    config: ServerConfig
    worker: InferenceWorker
    kv: KVStore | None
    calling: ToolCalling
    started_at: int
    metrics: ServerMetrics
    prepare: PrepareExecutor
    chat_disabled: str | None = None
    """Why the chat endpoints are off (the chat template failed its probe render), or None."""


RouteFactory = Callable[[Served], Callable[..., Awaitable[Any]]]


@dataclass(frozen=True)
class Endpoint:
    path: str
    method: str
    dialect: Dialect
    """The error shape of this path and of the unknown paths below it (`server.errors`)."""
    summary: str
    handler: RouteFactory
    body: type[BaseModel] | None = None
    """The request body schema, for the OpenAPI document (the handler parses the body)."""


# --- the shared pieces of a request ---------------------------------------------------------

def parse_raw(raw: bytes, schema: type[StrictModel]) -> Any:
    try:
        obj = parse_json_body(raw)
    except JsonBodyError as e:
        raise ApiError(400, str(e), code="invalid_json") from None
    return validate_body(schema, obj)


async def raw_body(served: Served, request: Request) -> bytes:
    """The request's body, its headers checked first (type, encoding) and its size and time limited."""
    refused = body_headers_error(request.headers.get("content-type"), request.headers.get("content-encoding"))
    if refused is not None:
        raise refused
    return await read_body(request, served.config.max_body_bytes, served.config.body_timeout_sec)


async def parse_body(served: Served, request: Request, schema: type[StrictModel]) -> Any:
    return await served.prepare.run(parse_raw, await raw_body(served, request), schema)


def tool_input_errors(make: Callable[..., Any]) -> Callable[..., Any]:
    """Client tool objects that cannot be mapped become a 400 in the endpoint's dialect."""
    def call(*args: Any) -> Any:
        try:
            return make(*args)
        except ToolInputError as e:
            raise ApiError(400, f"{e.param}: {e}" if e.param else str(e), param=e.param or None) from None
    return call


def template_errors(make: Callable[..., Any]) -> Callable[..., Any]:
    """Chat template failures as answers: a template that refuses the conversation
    (`raise_exception`) is the client's 400; one that breaks or runs past its limits is a 500
    that says so."""
    def call(*args: Any) -> Any:
        try:
            return make(*args)
        except ChatTemplateRejected as e:
            raise ApiError(400, f"the model's chat template refused this conversation: {e}",
                           code="chat_template_rejected") from None
        except ChatTemplateError as e:
            log.error("chat template failed: %s", e)
            raise ApiError(500, f"the model's chat template failed: {e}", type="server_error",
                           code="chat_template_failed") from None
    return call


def probe_chat(model: Any) -> str | None:
    """None when the model's chat template renders a small conversation, else why not."""
    try:
        model.render_chat(list(PROBE_MESSAGES), add_generation_prompt=True)
    except ChatTemplateError as e:
        return str(e)
    return None


def check_chat_enabled(served: Served) -> None:
    if served.chat_disabled is not None:
        raise ApiError(500, "chat endpoints are disabled: the model's chat template failed its probe render at "
                            f"startup ({served.chat_disabled}); /v1/completions with a raw prompt is served",
                       type="server_error", code="chat_template_failed")


@dataclass
class Collected:
    text: str
    logprobs: list[TokenLogprob]
    finished: Finished
    deltas: list[TextDelta]
    """The text deltas in order (which tokens produced which splitter events)."""


async def collect(queue: asyncio.Queue[Event]) -> Collected | Failed:
    text, logprobs, deltas = [], [], []
    while True:
        event = await queue.get()
        if isinstance(event, TextDelta):
            text.append(event.text)
            logprobs.extend(event.logprobs)
            deltas.append(event)
        elif isinstance(event, Finished):
            return Collected("".join(text), logprobs, event, deltas)
        elif isinstance(event, Failed):
            return event


async def guarded(body: AsyncIterator[bytes], on_error: Callable[[str], bytes],
                  job_cancel: Callable[[], None]) -> AsyncIterator[bytes]:
    """Turn a failure inside a stream generator into a final error event, not a cut stream."""
    try:
        async for chunk in body:
            yield chunk
    except Exception:
        log.exception("stream generation failed")
        job_cancel()
        yield on_error("internal error while streaming the response")


# --- inference ------------------------------------------------------------------------------

@dataclass(frozen=True)
class InferenceApi:
    """How one inference API plugs into the shared request path."""
    schema: type[StrictModel]
    make_job: Callable[[Any, Any, ToolCalling, RequestDefaults], tuple[GenerationRequest, Any]]
    respond: Callable[[Any, Collected], dict[str, Any]]
    stream: Callable[[Any, AsyncIterator[Event | None]], AsyncIterator[bytes]]
    stream_error: Callable[[str], bytes]
    choices: bool = False
    """`make_job` returns a list of requests, one per choice (`server.choices`); `respond`
    takes their outputs and `stream` their merged `ChoiceEvent`s."""
    chat: bool = True
    """Renders through the chat template (every API but raw completions)."""
    token_param: str = "max_tokens"
    """The field an answer over the per-request work ceiling names (one-job APIs; with
    choices it is `n`)."""


def inference(api: InferenceApi, name: str) -> RouteFactory:
    def make(served: Served) -> Callable[..., Awaitable[Any]]:
        config, worker = served.config, served.worker
        defaults = config.request_defaults
        make_job = template_errors(tool_input_errors(api.make_job))

        def prepared(raw: bytes) -> tuple[Any, Any]:
            body = parse_raw(raw, api.schema)
            return body, make_job(served.model, body, served.calling, defaults)

        async def route(request: Request) -> Response:
            if api.chat:
                check_chat_enabled(served)
            # Parsed and made into jobs in one trip to the preparation threads, not two: a trip's
            # hand-overs wait for the interpreter lock, which a busy batched loop holds most of the time.
            body, (gen, ctx) = await served.prepare.run(prepared, await raw_body(served, request))
            if api.choices:
                return await answer_choices(served, api, request, body, gen, ctx)
            check_work(worker, [gen], api.token_param)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Event] = asyncio.Queue()
            job = worker.submit(gen, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
            if body.stream:
                events = job_events(queue, config.keepalive_sec)
                return SSEResponse(guarded(api.stream(ctx, events), api.stream_error, job.cancel),
                                   on_disconnect=job.cancel)
            result = await wait_or_disconnect(request, collect(queue), job.cancel)
            if result is None:
                return Response(status_code=CLIENT_CLOSED)
            if isinstance(result, Failed):
                raise ApiError(500, result.message, type="server_error", code="inference_failed")
            if result.finished.finish_reason == "cancelled":
                raise ApiError(503, "the request was cancelled because the server is shutting down",
                               type="server_error", code="cancelled")
            return JSONResponse(api.respond(ctx, result))

        route.__name__ = name
        return route
    return make


async def answer_choices(served: Served, api: InferenceApi, request: Request, body: Any,
                         gens: list[GenerationRequest], ctx: Any) -> Response:
    """The request path of an API with several choices per request: one job per choice."""
    jobs, queue = submit_choices(served.worker, gens, asyncio.get_running_loop())

    def cancel() -> None:
        for job in jobs:
            job.cancel()

    if body.stream:
        events = choice_events(queue, len(jobs), served.config.keepalive_sec)
        return SSEResponse(guarded(api.stream(ctx, events), api.stream_error, cancel), on_disconnect=cancel)
    result = await wait_or_disconnect(request, collect_choices(queue, len(jobs)), cancel)
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    if isinstance(result, Failed):
        cancel()
        raise ApiError(500, result.message, type="server_error", code="inference_failed")
    if any(out.finished is not None and out.finished.finish_reason == "cancelled" for out in result):
        raise ApiError(503, "the request was cancelled because the server is shutting down",
                       type="server_error", code="cancelled")
    return JSONResponse(api.respond(ctx, result))


CHAT = InferenceApi(
    api_openai.ChatCompletionRequest, api_openai.chat_job, api_openai.chat_response,
    api_openai.chat_stream, api_openai.stream_error, choices=True)
COMPLETIONS = InferenceApi(
    api_openai.CompletionRequest, api_openai.completion_job, api_openai.completion_response,
    api_openai.completion_stream, api_openai.stream_error, choices=True, chat=False)
MESSAGES = InferenceApi(
    api_anthropic.MessagesRequest, api_anthropic.messages_job,
    lambda ctx, c: api_anthropic.messages_response(ctx, c.finished.output, c.finished),
    api_anthropic.messages_stream, api_anthropic.stream_error)
RESPONSES = InferenceApi(
    api_responses.ResponsesRequest, api_responses.responses_job,
    lambda ctx, c: api_responses.response_object(ctx, c.finished.output, c.finished, c.deltas),
    api_responses.responses_stream, api_responses.stream_error, token_param="max_output_tokens")


class CountTokensRequest(StrictModel):
    """Body of `/v1/messages/count_tokens`: a Messages request without `max_tokens`."""
    model: str | None = None
    messages: list[api_anthropic.AnthropicMessage]
    system: str | list[api_anthropic.TextBlock] | None = None
    tools: list[api_anthropic.AnthropicTool] | None = None


def count_tokens(served: Served) -> Callable[..., Awaitable[Any]]:
    async def count_tokens(request: Request) -> Response:
        check_chat_enabled(served)
        body = await parse_body(served, request, CountTokensRequest)

        def count() -> int:
            prompt = api_anthropic.render_request(served.model, body, served.calling)
            check_prompt_size(served.model, prompt.text, "messages")
            return len(prompt_ids(served.model, prompt.text))

        return JSONResponse({"input_tokens": await served.prepare.run(template_errors(tool_input_errors(count)))})
    return count_tokens


def body_route(schema: type[StrictModel], answer: Callable[[Served, Any], dict[str, Any]],
               name: str) -> RouteFactory:
    """A route that answers a validated body with `answer(served, body)` on the prepare pool."""
    def make(served: Served) -> Callable[..., Awaitable[Any]]:
        async def route(request: Request) -> Response:
            body = await parse_body(served, request, schema)
            return JSONResponse(await served.prepare.run(template_errors(tool_input_errors(answer)), served, body))

        route.__name__ = name
        return route
    return make


def tokenizer_info(served: Served) -> Callable[..., Awaitable[Any]]:
    async def tokenizer_info() -> dict[str, Any]:
        return api_tokenize.tokenizer_info(served.model)
    return tokenizer_info


# --- information ----------------------------------------------------------------------------

def shown_path(path: str, verbose: bool) -> str:
    """A local path as clients see it: its last component, unless `--verbose-paths`."""
    return path if verbose or not path else os.path.basename(os.path.normpath(path))


class FileDigests:
    """SHA-256 of model files, each computed once per (path, size, mtime) on a background thread:
    `get(path)` answers the hex digest once it is known, else None (and starts the computation).
    A file of several gigabytes takes seconds, which neither startup nor a request should wait for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[tuple[str, int, int], str] = {}
        self._running: set[tuple[str, int, int]] = set()

    def get(self, path: str) -> str | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):  # /dev/null and the like hold no model
            return None
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
        with self._lock:
            if key in self._known:
                return self._known[key]
            if key not in self._running:
                self._running.add(key)
                threading.Thread(target=self._hash, args=(key,), name="model-sha256", daemon=True).start()
        return None

    def _hash(self, key: tuple[str, int, int]) -> None:
        digest = hashlib.sha256()
        try:
            with open(key[0], "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
        except OSError as e:
            log.warning("cannot hash the model file: %s", e)
            return
        finally:
            with self._lock:
                self._running.discard(key)
        with self._lock:
            self._known[key] = digest.hexdigest()


MODEL_FILE_DIGESTS = FileDigests()


def model_card(served: Served) -> dict[str, Any]:
    """The served model as `/v1/models` lists it. `meta` adds what a client comparing stacks needs:
    the model file's `sha256` (null until it is computed, or when there is no file) and how usage
    counts tokens (`completion_tokens_include_eos`: the end-of-sequence token that ends a
    generation is counted in `completion_tokens`, as it is sampled like any other)."""
    model = served.model
    path = str(getattr(model, "path", "") or "")
    return {"id": model.name, "object": "model", "created": served.started_at, "owned_by": "ds4eval",
            "context_length": model.n_ctx, "max_model_len": model.n_ctx,
            "meta": {"n_ctx": model.n_ctx, "n_vocab": model.n_vocab,
                     "path": shown_path(path, served.config.verbose_paths),
                     "sha256": MODEL_FILE_DIGESTS.get(path) if path else None,
                     "completion_tokens_include_eos": True}}


def health(served: Served) -> Callable[..., Awaitable[Any]]:
    model, worker, kv = served.model, served.worker, served.kv

    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model.name, "n_ctx": model.n_ctx,
                "busy": worker.busy, "queued": worker.queue_depth,
                "batched_sessions": served.config.batched_session,
                "preparing": served.prepare.running, "preparing_waiting": served.prepare.waiting,
                "kv_cache": (vars(kv.stats()) | {"directory": shown_path(kv.directory, served.config.verbose_paths)})
                if kv is not None else None}
    return health


def metrics(served: Served) -> Callable[..., Awaitable[Any]]:
    worker, kv, recorded = served.worker, served.kv, served.metrics

    async def metrics() -> Response:
        # Off the event loop: the disk cache's counters wait while the store reads or writes a file.
        text = await run_in_threadpool(lambda: recorded.render(worker.load(), kv.stats() if kv is not None else None))
        return Response(text, media_type=CONTENT_TYPE)
    return metrics


def list_models(served: Served) -> Callable[..., Awaitable[Any]]:
    path = str(getattr(served.model, "path", "") or "")
    if path:
        MODEL_FILE_DIGESTS.get(path)  # start hashing with the app, so the first listing likely has it

    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(served)]}
    return list_models


def get_model(served: Served) -> Callable[..., Awaitable[Any]]:
    name = served.model.name

    async def get_model(model_id: str) -> Response:
        if model_id != name:
            raise ApiError(404, f"model {model_id!r} is not served here (serving {name!r})",
                           type="not_found_error", param="model", code="model_not_found")
        return JSONResponse(model_card(served))
    return get_model


# --- the table ------------------------------------------------------------------------------

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("/health", "GET", "openai", "Liveness and queue state", health),
    Endpoint("/metrics", "GET", "openai", "Prometheus metrics (text exposition format)", metrics),
    Endpoint("/v1/models", "GET", "openai", "The loaded model", list_models),
    Endpoint("/v1/models/{model_id:path}", "GET", "openai", "One model by id", get_model),
    Endpoint("/v1/chat/completions", "POST", "openai", "OpenAI Chat Completions",
             inference(CHAT, "post_v1_chat_completions"), CHAT.schema),
    Endpoint("/v1/completions", "POST", "openai", "OpenAI Completions (raw prompt)",
             inference(COMPLETIONS, "post_v1_completions"), COMPLETIONS.schema),
    Endpoint("/v1/messages", "POST", "anthropic", "Anthropic Messages",
             inference(MESSAGES, "post_v1_messages"), MESSAGES.schema),
    Endpoint("/v1/responses", "POST", "openai", "OpenAI Responses",
             inference(RESPONSES, "post_v1_responses"), RESPONSES.schema),
    Endpoint("/v1/messages/count_tokens", "POST", "anthropic", "Anthropic token counting",
             count_tokens, CountTokensRequest),
    Endpoint("/tokenize", "POST", "openai", "Tokenize a prompt or chat with the served model's tokenizer",
             body_route(api_tokenize.TokenizeRequest,
                        lambda served, body: api_tokenize.tokenize(served.model, served.calling, body),
                        "post_tokenize"), api_tokenize.TokenizeRequest),
    Endpoint("/detokenize", "POST", "openai", "Token ids back to text",
             body_route(api_tokenize.DetokenizeRequest,
                        lambda served, body: api_tokenize.detokenize(served.model, body),
                        "post_detokenize"), api_tokenize.DetokenizeRequest),
    Endpoint("/tokenizer_info", "GET", "openai", "Special tokens, chat template and limits of the tokenizer",
             tokenizer_info),
)
