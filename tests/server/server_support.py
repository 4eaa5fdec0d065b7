"""Helpers shared by the server tests: fake-engine apps, a live uvicorn and raw HTTP requests.

A plain module (not conftest) so tests import it by a name no other test folder uses."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import uvicorn

from server.app import create_app
from server.config import ServerConfig
from server_fake_engine import FAKE_ENGINE, FakeModel


# The Host that Starlette's TestClient sends; the servers of these tests accept it besides the
# loopback names.
TEST_CLIENT_HOST = "testserver"


def fake_app(model: FakeModel | None = None, **config: Any):
    config.setdefault("allowed_hosts", (TEST_CLIENT_HOST,))
    return create_app(model or FakeModel(), ServerConfig(**config), engine=FAKE_ENGINE)


def system_user_chat(model: Any, system: str, user: str) -> str:
    """The model's chat prompt for one system and one user message."""
    return model.render_chat([{"role": "system", "content": system}, {"role": "user", "content": user}])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def worker(self):
        return self.app.state.worker

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextmanager
def live_server(app: Any) -> Iterator[LiveServer]:
    srv = LiveServer(app)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def raw_request(port: int, method: str, path: str, body: bytes,
                headers: dict[str, str] | None = None) -> socket.socket:
    """Send a raw HTTP/1.1 request and return the open socket (response not read)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
            "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    return sock
