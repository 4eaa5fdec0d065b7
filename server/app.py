"""The FastAPI application: the routes of the endpoint table, body limits, error rendering.

`create_app(model, config)` builds the app around any engine-like model object (the real
`engine` model, or a fake in tests) and an `InferenceWorker` that it starts and stops with
the app's lifespan. Its routes are the rows of `server.endpoints.ENDPOINTS` (path, method,
handler, summary, request body schema), which also say how each inference request travels
from body to job to answer.

Chat endpoints render through the app's `ToolCalling` (the model's tool syntax, detected
or set by `--tool-syntax`, and the exact replay memory; `app.state.tools`), and the
worker splits their output into content, reasoning and tool calls.

Errors become 4xx responses in the dialect of the endpoint (`server.errors.dialect_for_path`
over the same table); unknown paths and methods too. Every error answer is logged as one line
with its status, method, path and message (`server.errors.client_error_line`; 4xx at info, 5xx
at warning), through a `server.loglimit.RepeatLimiter`: under a flood of identical errors the
first line of each second is logged and the rest are counted in a summary line.

In front of the routes, outermost first: the Host allow-list (`server.guard`, when
`config.host_allow_list` is not None), CORS for the `--cors` origins, and the API key check
(when `--api-key` is set; CORS outside it, so that a browser can read the 401). The OpenAPI document
(`/openapi.json`) describes each request body with its pydantic schema from the table, even
though the routes parse bodies themselves (FastAPI's own body parsing would bypass the
hardened parser).

With `--kv-disk-dir` the app opens the disk KV cache (`server.kvstore.open_store`) for the
worker; `/health` reports its statistics. With `--batched-session N` (N > 1) the worker keeps
N resident sessions; the memory they need is checked when the app is created
(`engine.batch.CapacityError`, with the figures). With `--step-log FILE` the app opens the
batched loop's step log there (`server.steplog`; `StepLogError` where it cannot), which the
worker closes when it stops.

After a request with a body of 4 MiB or more, free heap memory is given back to the system
(`server.heap.HeapTrim`).

`/metrics` is the Prometheus view of the same app: a `server.metrics.ServerMetrics` (its own
registry) is the worker's job observer, and its `HttpMetrics` middleware counts responses.

It does not load models, bind sockets or print startup banners (`server.cli` does).
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
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
from server.config import ServerConfig
from server.endpoints import ENDPOINTS, Served, probe_chat
from server.errors import ApiError, Dialect, client_error_line, dialect_for_path, error_body
from server.guard import RequestGuard, host_check, key_check
from server.heap import HeapTrim
from server.kvstore import open_store
from server.kvstore_policy import SavePolicy
from server.loglimit import RepeatLimiter
from server.metrics import HttpMetrics, ServerMetrics
from server.prepare import PrepareExecutor
from server.prompting import ToolCalling
from server.steplog import StepLogWriter
from server.worker import InferenceWorker

log = logging.getLogger("ds4.server")


def _error_response(err: ApiError, request: Request, repeats: RepeatLimiter) -> JSONResponse:
    line = client_error_line(err.status, request.method, request.url.path, err.message)
    repeats.log(log, logging.INFO if err.status < 500 else logging.WARNING, line, line)
    return JSONResponse(error_body(err, _dialect(request)), status_code=err.status, headers=err.headers)


def _dialect(request: Request) -> Dialect:
    return _path_dialect(request.url.path)


def _path_dialect(path: str) -> Dialect:
    return dialect_for_path(path, ENDPOINTS)


def _openapi_components() -> tuple[dict[str, Any], dict[str, str]]:
    models: list[type[BaseModel]] = [e.body for e in ENDPOINTS if e.body is not None]
    keys, top = models_json_schema([(m, "validation") for m in models],
                                   ref_template="#/components/schemas/{model}")
    refs = {m.__name__: keys[(m, "validation")]["$ref"] for m in models}
    return top.get("$defs", {}), refs


def create_app(model: Any, config: ServerConfig | None = None, *,
               engine: Any = None, kv_save_policy: SavePolicy | None = None,
               clock: Callable[[], float] = time.monotonic,
               engine_thread: EngineThread | None = None) -> FastAPI:
    """The app around `model`. `engine` provides the engine's types (`SamplingParams`,
    `Cancelled`, ...; default: the `engine` package, tests pass a fake). `engine_thread` is the
    thread the model was loaded on, where all inference runs (None: the worker starts its own). `kv_save_policy` overrides the disk
    cache's save thresholds and `clock` the batched slots' idle clock (tests with small models
    and no waiting)."""
    config = config or ServerConfig()
    kv = open_store(config.kv, model)
    if kv is not None and kv_save_policy is not None:
        kv.save_policy = kv_save_policy
    metrics = ServerMetrics(model.name, config.batched_session)
    step_log = StepLogWriter(config.step_log) if config.step_log is not None else None
    worker = InferenceWorker(model, engine, kv=kv, n_slots=config.batched_session, interleave=config.interleave,
                             clock=clock,
                             engine_thread=engine_thread, observer=metrics,
                             stream_interval=config.stream_interval_ms / 1000, limits=config.work_limits,
                             step_log=step_log)
    calling = ToolCalling.for_model(model, config.tools)
    prepare = PrepareExecutor()
    repeats = RepeatLimiter()
    chat_disabled = probe_chat(model)
    if chat_disabled is not None:
        log.warning("the chat template fails a probe render (%s): chat endpoints are disabled, only raw "
                    "/v1/completions is served", chat_disabled)
    served = Served(model, config, worker, kv, calling, started_at=int(time.time()), metrics=metrics,
                    prepare=prepare, chat_disabled=chat_disabled)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(worker.stop)
            await run_in_threadpool(prepare.close)
            repeats.flush()

    app = FastAPI(title="ds4-server", version="0.1.0", lifespan=lifespan,
                  description="OpenAI Chat/Completions, Anthropic Messages and OpenAI Responses "
                              "APIs over the ds4eval engine.")
    app.state.worker = worker
    app.state.kv = kv
    app.state.model = model
    app.state.config = config
    app.state.tools = calling
    app.state.metrics = metrics
    app.add_middleware(HeapTrim)
    app.add_middleware(HttpMetrics, metrics=metrics)
    # Starlette runs the middleware added last first.
    if config.api_key is not None:
        app.add_middleware(RequestGuard, check=key_check(config.api_key), dialect_of=_path_dialect, repeats=repeats)
    if config.cors:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["*"], max_age=600)
    allowed_hosts = config.host_allow_list
    if allowed_hosts is not None:
        app.add_middleware(RequestGuard, check=host_check(allowed_hosts), dialect_of=_path_dialect, repeats=repeats)

    # --- errors ---

    @app.exception_handler(ApiError)
    async def api_error_handler(request: Request, exc: ApiError) -> Response:
        return _error_response(exc, request, repeats)

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
        err.headers.update(exc.headers or {})
        return _error_response(err, request, repeats)

    @app.exception_handler(Exception)
    async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        err = ApiError(500, "internal server error", type="server_error", code="internal_error")
        return _error_response(err, request, repeats)

    # --- routes: one per row of the endpoint table ---

    components, refs = _openapi_components()

    def body_doc(schema: type[BaseModel]) -> dict[str, Any]:
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": refs[schema.__name__]}}}}}

    for endpoint in ENDPOINTS:
        # A body is parsed by the handler, so the route declares no response model of its own.
        documented = {} if endpoint.body is None else {"openapi_extra": body_doc(endpoint.body),
                                                        "response_model": None}
        app.add_api_route(endpoint.path, endpoint.handler(served), methods=[endpoint.method],
                          summary=endpoint.summary, **documented)

    def custom_openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description,
                              routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
    return app
