"""Server-sent events: framing, the streaming response, keepalives and disconnect watching.

- `sse_data` / `sse_event` frame one JSON payload (`data: ...\\n\\n`, optionally preceded
  by an `event:` line as the Anthropic and Responses streams use); `KEEPALIVE` is the SSE
  comment sent while a request waits for its first token.
- `SSEResponse` is an ASGI response that sends the headers, streams the body iterator and,
  at the same time, listens for the client's disconnect. A disconnect calls `on_disconnect`
  at once (the job is cancelled without waiting for the next write to fail) and stops the
  body. This does not depend on the server's ASGI spec version.
- `job_events` turns the worker's event queue into an async iterator that yields `None`
  every `keepalive_sec` seconds while no text has been generated yet (queued or in
  prefill), so the API stream can write a keepalive comment; it also reads the merged queue
  of several jobs (`streams`, `event_of`: the choices of one request, `server.choices`).
- `wait_or_disconnect` is the non-streaming counterpart: await a future while watching
  for the client to go away.

It knows nothing about the APIs' event names or payloads.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.jobs import Failed, Finished, TextDelta

KEEPALIVE = b": prefill\n\n"
DONE = b"data: [DONE]\n\n"

T = TypeVar("T")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_data(obj: Any) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode("utf-8")


def sse_event(name: str, obj: Any) -> bytes:
    return f"event: {name}\ndata: {_dumps(obj)}\n\n".encode("utf-8")


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_disconnect: Callable[[], None]) -> None:
        # Not Response.__init__: it would declare Content-Length: 0 for the empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self._body_iter = body
        self._on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_gone = False

        async def watch(cancel: anyio.CancelScope) -> None:
            nonlocal client_gone
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    client_gone = True
                    self._on_disconnect()
                    cancel.cancel()
                    return

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for chunk in self._body_iter:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:
            # Writing to a closed connection: the same as a disconnect.
            client_gone = True
            self._on_disconnect()
        finally:
            if client_gone:
                aclose = getattr(self._body_iter, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()


async def job_events(queue: asyncio.Queue[Any], keepalive_sec: float, *, streams: int = 1,
                     event_of: Callable[[Any], Any] = lambda item: item) -> AsyncIterator[Any]:
    """Worker events in order, with `None` as a keepalive tick until the first text arrives.

    Ends after the `Finished` or `Failed` event; with `streams` > 1 the queue carries the
    events of that many jobs (`event_of(item)` is an item's event) and it ends after as many.
    """
    generating = False
    last_tick = time.monotonic()
    getter: asyncio.Future[Any] | None = None
    ended = 0
    try:
        while True:
            if generating:
                # No keepalives from here on: a plain wait, without a task per event.
                item = await queue.get()
            else:
                if getter is None:
                    getter = asyncio.ensure_future(queue.get())
                timeout = max(0.0, last_tick + keepalive_sec - time.monotonic())
                done, _ = await asyncio.wait({getter}, timeout=timeout)
                if not done:
                    last_tick = time.monotonic()
                    yield None
                    continue
                item = getter.result()
                getter = None
            event = event_of(item)
            if isinstance(event, TextDelta):
                generating = True
            yield item
            if isinstance(event, (Finished, Failed)):
                ended += 1
                if ended >= streams:
                    return
    finally:
        if getter is not None and not getter.done():
            getter.cancel()


async def wait_or_disconnect(request: Request, work: Awaitable[T],
                             on_disconnect: Callable[[], None]) -> T | None:
    """Await `work`; if the client disconnects first, call `on_disconnect` and return None."""
    work_task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watch_task = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        on_disconnect()
        work_task.cancel()
        return None
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
