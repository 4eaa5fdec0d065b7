"""The FastAPI application: routes, body limits, error rendering, job submission.

`create_app(model, config)` builds the app around any engine-like model object (the real
`engine` model, or a fake in tests) and an `InferenceWorker` that it starts and stops with
the app's lifespan. Every inference route follows the same path:

    read body (size limit, 413) -> hardened JSON parse -> schema validation -> render and
    tokenize off the event loop -> context-length check -> submit job -> stream SSE or
    collect and answer JSON

Chat endpoints render through the app's `ToolCalling` (the model's tool syntax, detected
or set by `--tool-syntax`, and the exact replay memory; `app.state.tools`), and the
worker splits their output into content, reasoning and tool calls. Tool objects that
cannot be mapped (`ToolInputError`) are 400s like any other bad input.

Errors become 4xx responses in the dialect of the endpoint (`server.errors`); unknown
paths and methods too. Disconnects cancel the job, streaming or not. The OpenAPI document
(`/openapi.json`) describes each request body with its pydantic schema, even though the
routes parse bodies themselves (FastAPI's own body parsing would bypass the hardened
parser).

With `--kv-disk-dir` the app opens the disk KV cache (`server.kvstore.open_store`) for the
worker; `/health` reports its statistics. With `--batched-session N` (N > 1) the worker keeps
N resident sessions; the memory they need is checked when the app is created
(`engine.batch.CapacityError`, with the figures).

It does not load models, bind sockets or print startup banners (`server.cli` does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from engine.threads import EngineThread
from server import api_anthropic, api_openai, api_responses
from server.apibase import StrictModel, validate_body
from server.config import ServerConfig
from server.errors import ApiError, Dialect, dialect_for_path, error_body
from server.jsonparse import JsonBodyError, parse_json_body
from server.kvstore import open_store
from server.kvstore_policy import SavePolicy
from server.prompting import ToolCalling, prompt_ids
from server.tools.apis import ToolInputError
from server.sse import SSEResponse, job_events, wait_or_disconnect
from server.jobs import Event, Failed, Finished, GenerationRequest, TextDelta, TokenLogprob
from server.worker import InferenceWorker

log = logging.getLogger("ds4.server")

# HTTP status for a request whose client went away before the answer (never seen by it).
CLIENT_CLOSED = 499


@dataclass
class Collected:
    text: str
    logprobs: list[TokenLogprob]
    finished: Finished


async def _collect(queue: asyncio.Queue[Event]) -> Collected | Failed:
    text, logprobs = [], []
    while True:
        event = await queue.get()
        if isinstance(event, TextDelta):
            text.append(event.text)
            logprobs.extend(event.logprobs)
        elif isinstance(event, Finished):
            return Collected("".join(text), logprobs, event)
        elif isinstance(event, Failed):
            return event


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, "invalid Content-Length header") from None
        if size > limit:
            raise ApiError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes "
                                "(--max-body-mb)", type="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes (--max-body-mb)",
                           type="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _error_response(err: ApiError, dialect: Dialect) -> JSONResponse:
    return JSONResponse(error_body(err, dialect), status_code=err.status)


@dataclass(frozen=True)
class _Endpoint:
    """How one inference API plugs into the shared request path."""
    schema: type[StrictModel]
    dialect: Dialect
    make_job: Callable[[Any, Any, ToolCalling], tuple[GenerationRequest, Any]]
    respond: Callable[[Any, Collected], dict[str, Any]]
    stream: Callable[[Any, AsyncIterator[Event | None]], AsyncIterator[bytes]]
    stream_error: Callable[[str], bytes]


ENDPOINTS: dict[str, _Endpoint] = {
    "/v1/chat/completions": _Endpoint(
        api_openai.ChatCompletionRequest, "openai", api_openai.chat_job,
        lambda ctx, c: api_openai.chat_response(ctx, c.finished.output, c.finished, c.logprobs),
        api_openai.chat_stream, api_openai.stream_error),
    "/v1/completions": _Endpoint(
        api_openai.CompletionRequest, "openai", api_openai.completion_job,
        lambda ctx, c: api_openai.completion_response(ctx, c.text, c.finished, c.logprobs),
        api_openai.completion_stream, api_openai.stream_error),
    "/v1/messages": _Endpoint(
        api_anthropic.MessagesRequest, "anthropic", api_anthropic.messages_job,
        lambda ctx, c: api_anthropic.messages_response(ctx, c.finished.output, c.finished),
        api_anthropic.messages_stream, api_anthropic.stream_error),
    "/v1/responses": _Endpoint(
        api_responses.ResponsesRequest, "openai", api_responses.responses_job,
        lambda ctx, c: api_responses.response_object(ctx, c.finished.output, c.finished),
        api_responses.responses_stream, api_responses.stream_error),
}


class CountTokensRequest(StrictModel):
    """Body of `/v1/messages/count_tokens`: a Messages request without `max_tokens`."""
    model: str | None = None
    messages: list[api_anthropic.AnthropicMessage]
    system: str | list[api_anthropic.TextBlock] | None = None
    tools: list[api_anthropic.AnthropicTool] | None = None


def _openapi_components() -> tuple[dict[str, Any], dict[str, str]]:
    models: list[type[BaseModel]] = [e.schema for e in ENDPOINTS.values()] + [CountTokensRequest]
    keys, top = models_json_schema([(m, "validation") for m in models],
                                   ref_template="#/components/schemas/{model}")
    refs = {m.__name__: keys[(m, "validation")]["$ref"] for m in models}
    return top.get("$defs", {}), refs


async def _guarded(body: AsyncIterator[bytes], on_error: Callable[[str], bytes],
                   job_cancel: Callable[[], None]) -> AsyncIterator[bytes]:
    """Turn a failure inside a stream generator into a final error event, not a cut stream."""
    try:
        async for chunk in body:
            yield chunk
    except Exception:
        log.exception("stream generation failed")
        job_cancel()
        yield on_error("internal error while streaming the response")


def _tool_input_errors(make: Callable[..., Any]) -> Callable[..., Any]:
    """Client tool objects that cannot be mapped become a 400 in the endpoint's dialect."""
    def call(*args: Any) -> Any:
        try:
            return make(*args)
        except ToolInputError as e:
            raise ApiError(400, f"{e.param}: {e}" if e.param else str(e), param=e.param or None) from None
    return call


def create_app(model: Any, config: ServerConfig | None = None, *,
               engine: Any = None, kv_save_policy: SavePolicy | None = None,
               clock: Callable[[], float] = time.monotonic, engine_thread: EngineThread | None = None) -> FastAPI:
    """The app around `model`. `engine` provides the engine's types (`SamplingParams`,
    `Cancelled`, ...; default: the `engine` package, tests pass a fake). `engine_thread` is the thread the model was loaded on, where
    all inference runs (None: the worker starts its own). `kv_save_policy` overrides the disk
    cache's save thresholds and `clock` the batched slots' idle clock (tests with small models
    and no waiting)."""
    config = config or ServerConfig()
    kv = open_store(config.kv, model)
    if kv is not None and kv_save_policy is not None:
        kv.save_policy = kv_save_policy
    worker = InferenceWorker(model, engine, kv=kv, n_slots=config.batched_session, clock=clock,
                             engine_thread=engine_thread)
    calling = ToolCalling.for_model(model, config.tools)
    started_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(worker.stop)

    app = FastAPI(title="ds4-server", version="0.1.0", lifespan=lifespan,
                  description="OpenAI Chat/Completions, Anthropic Messages and OpenAI Responses "
                              "APIs over the ds4eval engine.")
    app.state.worker = worker
    app.state.kv = kv
    app.state.model = model
    app.state.config = config
    app.state.tools = calling
    if config.cors:
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["*"], max_age=600)

    # --- errors ---

    @app.exception_handler(ApiError)
    async def api_error_handler(request: Request, exc: ApiError) -> Response:
        return _error_response(exc, dialect_for_path(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            err = ApiError(404, f"no such endpoint: {request.method} {request.url.path}",
                           type="not_found_error", code="not_found")
        elif exc.status_code == 405:
            err = ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed")
        else:
            err = ApiError(exc.status_code, str(exc.detail))
        response = _error_response(err, dialect_for_path(request.url.path))
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(Exception)
    async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        err = ApiError(500, "internal server error", type="server_error", code="internal_error")
        return _error_response(err, dialect_for_path(request.url.path))

    # --- info routes ---

    def model_card() -> dict[str, Any]:
        return {"id": model.name, "object": "model", "created": started_at, "owned_by": "ds4eval",
                "context_length": model.n_ctx, "max_model_len": model.n_ctx,
                "meta": {"n_ctx": model.n_ctx, "n_vocab": model.n_vocab,
                         "path": str(getattr(model, "path", "") or "")}}

    @app.get("/health", summary="Liveness and queue state")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model.name, "n_ctx": model.n_ctx,
                "busy": worker.busy, "queued": worker.queue_depth, "batched_sessions": config.batched_session,
                "kv_cache": (vars(kv.stats()) | {"directory": kv.directory}) if kv is not None else None}

    @app.get("/v1/models", summary="The loaded model")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", summary="One model by id")
    async def get_model(model_id: str) -> Response:
        if model_id != model.name:
            raise ApiError(404, f"model {model_id!r} is not served here (serving {model.name!r})",
                           type="not_found_error", param="model", code="model_not_found")
        return JSONResponse(model_card())

    # --- inference routes ---

    components, refs = _openapi_components()

    def body_doc(schema: type[BaseModel]) -> dict[str, Any]:
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": refs[schema.__name__]}}}}}

    async def parse(request: Request, schema: type[StrictModel]) -> Any:
        raw = await read_body(request, config.max_body_bytes)
        try:
            obj = parse_json_body(raw)
        except JsonBodyError as e:
            raise ApiError(400, str(e), code="invalid_json") from None
        return validate_body(schema, obj)

    def add_inference_route(path: str, endpoint: _Endpoint, summary: str) -> None:
        async def route(request: Request) -> Response:
            body = await parse(request, endpoint.schema)
            gen, ctx = await run_in_threadpool(_tool_input_errors(endpoint.make_job), model, body, calling)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Event] = asyncio.Queue()
            job = worker.submit(gen, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
            if body.stream:
                events = job_events(queue, config.keepalive_sec)
                return SSEResponse(_guarded(endpoint.stream(ctx, events), endpoint.stream_error, job.cancel),
                                   on_disconnect=job.cancel)
            result = await wait_or_disconnect(request, _collect(queue), job.cancel)
            if result is None:
                return Response(status_code=CLIENT_CLOSED)
            if isinstance(result, Failed):
                raise ApiError(500, result.message, type="server_error", code="inference_failed")
            if result.finished.finish_reason == "cancelled":
                raise ApiError(503, "the request was cancelled because the server is shutting down",
                               type="server_error", code="cancelled")
            return JSONResponse(endpoint.respond(ctx, result))

        route.__name__ = "post_" + path.strip("/").replace("/", "_")
        app.add_api_route(path, route, methods=["POST"], summary=summary,
                          openapi_extra=body_doc(endpoint.schema), response_model=None)

    add_inference_route("/v1/chat/completions", ENDPOINTS["/v1/chat/completions"], "OpenAI Chat Completions")
    add_inference_route("/v1/completions", ENDPOINTS["/v1/completions"], "OpenAI Completions (raw prompt)")
    add_inference_route("/v1/messages", ENDPOINTS["/v1/messages"], "Anthropic Messages")
    add_inference_route("/v1/responses", ENDPOINTS["/v1/responses"], "OpenAI Responses")

    @app.post("/v1/messages/count_tokens", summary="Anthropic token counting",
              openapi_extra=body_doc(CountTokensRequest), response_model=None)
    async def count_tokens(request: Request) -> Response:
        body = await parse(request, CountTokensRequest)

        def count() -> int:
            prompt = api_anthropic.render_request(model, body, calling)
            return len(prompt_ids(model, prompt.text))

        return JSONResponse({"input_tokens": await run_in_threadpool(_tool_input_errors(count))})

    def custom_openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description,
                              routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
    return app
