"""Helpers for the determinism tests that talk to a real ds4-server: the app over a model, served
by uvicorn on a free loopback port in a thread (the pattern of tests/server's `LiveServer`), and
the CLI invoked in-process.

A plain module (not conftest) so tests import it by a name no other test folder uses."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import uvicorn
from click.testing import CliRunner, Result

from ds4eval import cli
from server.app import create_app
from server.config import ServerConfig

START_TIMEOUT_S = 60.0


def free_port() -> int:
    """A port nothing listens on once this returns (the socket that held it is closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(model: Any, **config: Any) -> Iterator[str]:
    """ds4-server's app over `model` (ServerConfig(**config)) on 127.0.0.1; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(model, ServerConfig(**config)), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError("ds4-server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def ds4_eval(*args: object) -> Result:
    """`ds4-eval ARGS` in-process, without $DS4EVAL_API_KEY (a key set for other work stays out)."""
    return CliRunner().invoke(cli.main, [str(a) for a in args], env={"DS4EVAL_API_KEY": None})
