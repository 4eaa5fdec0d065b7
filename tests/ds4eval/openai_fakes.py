"""A small OpenAI-compatible fake server for ds4eval tests (http.server on 127.0.0.1, no model).

`FakeOpenAI(reply=..., delay_s=..., usage=..., models=...)` is a context manager that serves
`GET /v1/models` (the ids in `models`, or 404 when None, or `models_status`) and streaming
`POST /v1/chat/completions`: the reply text from `reply(question)` goes out a few characters
per chunk, `delay_s` apart (after `stall_s` of silence), ending with a finish reason, a usage chunk when `usage` is true
and `[DONE]`. Request bodies are kept in `bodies`; `started` is set at the first POST.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# How often serve_forever looks for shutdown(): its default of 0.5 s made stopping a server
# take up to half a second, once per fake server, in hundreds of tests.
POLL_S = 0.02


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet request handler that answers JSON: the shared base of the test servers."""

    def log_message(self, *a):
        pass

    def _json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class QuietServer(ThreadingHTTPServer):
    """A threaded server that drops a reply whose client has gone: tests that time a client out
    leave the handler writing to a closed socket, sometimes after the test has ended, and the
    default report (a traceback on stderr) would land in whatever test runs then."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipeError, ConnectionResetError
            super().handle_error(request, client_address)


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, threading.Thread, str]:
    """A threaded HTTP server on a free loopback port: (server, its thread, its base URL)."""
    server = QuietServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL_S}, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{server.server_address[1]}"


def stop(server: ThreadingHTTPServer, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join()


class FakeOpenAI:
    def __init__(self, reply=lambda q: "Answer: 4", delay_s=0.0, usage=True, models=("fake-model-1",),
                 models_status=200, chunk_chars=3, stall_s=0.0, takes_n=True):
        self.reply, self.delay_s, self.usage, self.models = reply, delay_s, usage, models
        self.takes_n = takes_n
        self.models_status, self.chunk_chars, self.stall_s = models_status, chunk_chars, stall_s
        self.bodies: list[dict] = []
        self.started = threading.Event()
        self.closing = threading.Event()

    def __enter__(self) -> "FakeOpenAI":
        fake = self

        class Handler(JsonHandler):
            def do_GET(self):
                if not self.path.endswith("/models") or fake.models is None:
                    return self._json(404, {"error": {"message": "not found"}})
                if fake.models_status != 200:
                    return self._json(fake.models_status, {"error": {"message": "invalid api key"}})
                self._json(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in fake.models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                fake.started.set()
                n = int(body.get("n", 1))
                if n > 1 and not fake.takes_n:
                    return self._json(400, {"error": {"message": "only n=1 is supported"}})
                question = body["messages"][1]["content"]
                texts = [fake.reply(question) if fake.reply.__code__.co_argcount == 1 else fake.reply(question, i)
                         for i in range(n)]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.flush()
                fake.closing.wait(fake.stall_s)  # a long prefill that sends nothing
                try:
                    for i in range(0, max(map(len, texts)), fake.chunk_chars):
                        if fake.closing.is_set():
                            return
                        if fake.delay_s:
                            time.sleep(fake.delay_s)
                        for c, text in enumerate(texts):  # the choices' chunks interleaved
                            if i < len(text):
                                delta = {"content": text[i:i + fake.chunk_chars]}
                                self._event({"choices": [{"index": c, "delta": delta, "finish_reason": None}]})
                    for c in range(n):
                        self._event({"choices": [{"index": c, "delta": {}, "finish_reason": "stop"}]})
                    if fake.usage:
                        self._event({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens":
                                                              sum(len(t.split()) for t in texts)}})
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away (a stopped case)

            def _event(self, obj):
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                self.wfile.flush()

        self.server, self.thread, self.url = serve(Handler)
        return self

    def __exit__(self, *exc) -> None:
        self.closing.set()
        stop(self.server, self.thread)
