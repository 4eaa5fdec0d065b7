"""An OpenAI-compatible fake server that fails on cue, for the failover tests (http.server on
127.0.0.1, no model).

`FlakyOpenAI(reply=, plan=, model=, template=, delay_s=)` serves `GET /v1/models` (one id,
`model`), `GET /tokenizer_info` (its `template`, when given) and streaming
`POST /v1/chat/completions`. `plan(i)` decides request i (0-based): None answers normally, an int
answers with that HTTP status (`retry_after` sent with 429 and 503 when set), "cut" sends half of
the answer and then drops the connection, as a server killed mid-stream does. `kill()` stops it
the hard way: it stops listening (new connections are refused) and every stream in flight is
cut. The answer declares its full length, so a cut stream is a transport error on the client's
side, never an answer that merely ended early. Request bodies are kept in `bodies`.
"""

from __future__ import annotations

import json
import threading
import time

from openai_fakes import JsonHandler, serve, stop


def events(text: str, chunk_chars: int = 3) -> list[bytes]:
    out = []
    for i in range(0, len(text), chunk_chars):
        delta = {"content": text[i:i + chunk_chars]}
        out.append({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    out.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    out.append({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": len(text.split())}})
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in out] + [b"data: [DONE]\n\n"]


class FlakyOpenAI:
    def __init__(self, reply=lambda q: "Answer: 4", plan=lambda i: None, model="fake-model-1", template=None,
                 delay_s=0.0, retry_after=None):
        self.reply, self.plan, self.model, self.template = reply, plan, model, template
        self.delay_s, self.retry_after = delay_s, retry_after
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.dead = threading.Event()
        self.server = None

    @property
    def requests(self) -> int:
        with self.lock:
            return len(self.bodies)

    def __enter__(self) -> "FlakyOpenAI":
        fake = self

        class Handler(JsonHandler):
            def do_GET(self):
                if self.path.endswith("/models"):
                    return self._json(200, {"object": "list", "data": [{"id": fake.model, "object": "model"}]})
                if self.path == "/tokenizer_info" and fake.template is not None:
                    return self._json(200, {"chat_template": fake.template})
                self._json(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    i = len(fake.bodies)
                    fake.bodies.append(body)
                what = fake.plan(i)
                if isinstance(what, int):
                    data = json.dumps({"error": {"message": f"planned failure {what}"}}).encode()
                    self.send_response(what)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    if fake.retry_after is not None and what in (429, 503):
                        self.send_header("Retry-After", str(fake.retry_after))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                chunks = events(fake.reply(body["messages"][1]["content"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(sum(map(len, chunks))))
                self.end_headers()
                if what == "cut":
                    chunks = chunks[: len(chunks) // 2]
                try:
                    for c in chunks:
                        if fake.dead.is_set():
                            break
                        if fake.delay_s:
                            time.sleep(fake.delay_s)
                        self.wfile.write(c)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True  # short of its Content-Length: the client sees a cut

        self.server, self.thread, self.url = serve(Handler)
        return self

    def kill(self) -> None:
        """Stop listening and cut every stream in flight (idempotent)."""
        if not self.dead.is_set():
            self.dead.set()
            stop(self.server, self.thread)

    def kill_after(self, n_requests: int) -> None:
        """Kill the server from another thread once it has received `n_requests` POSTs."""
        def watch():
            while self.requests < n_requests and not self.dead.is_set():
                time.sleep(0.005)
            self.kill()
        threading.Thread(target=watch, daemon=True).start()

    def __exit__(self, *exc) -> None:
        self.kill()
