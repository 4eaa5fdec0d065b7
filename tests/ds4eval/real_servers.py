"""Real OpenAI-compatible servers for cross-stack tests: ds4-server and llama-cpp-python's server on
the same GGUF, each a subprocess on a free 127.0.0.1 port.

`served(kind, model_path)` is a context manager yielding the server's base URL once its
`GET /v1/models` answers, and stopping the process (SIGINT, then SIGKILL) on the way out.
`LLAMA_CPP` is None when llama-cpp-python or its server's other modules (the `llamacpp` extra) are
not installed (tests skip on it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parents[2]
# llama-cpp-python's server needs more than the package itself: the `llamacpp` extra's modules.
_SERVER_NEEDS = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
LLAMA_CPP = importlib.util.find_spec("llama_cpp") if all(importlib.util.find_spec(m) for m in _SERVER_NEEDS) else None
STARTUP_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(kind: str, model_path: str, port: int, ctx: int) -> list[str]:
    if kind == "ds4-server":
        return [sys.executable, "-m", "server.cli", "--model", model_path, "--host", "127.0.0.1",
                "--port", str(port), "--ctx", str(ctx)]
    if kind == "llama.cpp":
        return [sys.executable, "-m", "llama_cpp.server", "--model", model_path, "--host", "127.0.0.1",
                "--port", str(port), "--n_ctx", str(ctx)]
    raise ValueError(f"unknown server kind {kind!r}")


@contextlib.contextmanager
def served(kind: str, model_path: str, ctx: int = 4096) -> Iterator[str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(_command(kind, model_path, port, ctx), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=str(REPO), env=env)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"{kind} exited at startup"
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{kind} did not start within {STARTUP_S:.0f} s"
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
