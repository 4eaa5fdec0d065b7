"""Helpers shared by the server tests: fake-engine apps, a live uvicorn, server processes and raw
HTTP requests.

`ServerProcess` runs the real `ds4-server` command line with the fake engine in a subprocess,
for what only a process shows: its sockets, its log, its exit status.

A plain module (not conftest) so tests import it by a name no other test folder uses."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
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


FAKE_SERVER_CLI = Path(__file__).with_name("fake_server_cli.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


def interrupt(proc: subprocess.Popen, wait_s: float) -> None:
    """Stop a server process as Ctrl-C would (so it shuts down cleanly); kill it after `wait_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerProcess:
    """`ds4-server` with the fake engine (`fake_server_cli.py`) as a subprocess on a port the
    system chooses (`--port 0`, read back from the banner); stdout and stderr go to `log_path`."""

    def __init__(self, log_path: Path, *flags: str) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        env.pop("DS4_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, str(FAKE_SERVER_CLI), "--port", "0", *flags],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.port = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_log(self, fragment: str, timeout: float = 10.0) -> str:
        """The log once it contains `fragment` (AssertionError after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while fragment not in (text := self.log()):
            assert time.monotonic() < deadline, f"{fragment!r} not logged; log:\n{text[-2000:]}"
            time.sleep(0.02)
        return text

    def start(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            text = self.log()
            found = _LISTENING.search(text)
            if found and "Application startup complete" in text:
                self.port = int(found.group(1))
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the fake ds4-server did not start; log:\n{text[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        interrupt(self.proc, 30)
        self._log.close()


@contextmanager
def server_process(log_path: Path, *flags: str) -> Iterator[ServerProcess]:
    srv = ServerProcess(log_path, *flags)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


class ModelServerProcess:
    """A `python -m server.cli` child on a free loopback port; `rss_peak_kib()` reads its VmHWM.
    `root` is the checkout whose server runs (default: this one)."""

    def __init__(self, *flags: str, startup_s: float = 180.0, root: Path = REPO_ROOT) -> None:
        import subprocess
        import sys
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "--port", str(self.port),
                                      "--host", "127.0.0.1", *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=str(root),
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                         [str(root), os.environ.get("PYTHONPATH", "")])})
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("server exited at startup:\n" + "".join(self.log))
            try:
                self.get("/health", timeout=2)
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise AssertionError("server did not answer /health:\n" + "".join(self.log))

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, bytes]:
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def get(self, path: str, timeout: float = 60) -> tuple[int, bytes]:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, obj: Any, timeout: float = 60) -> tuple[int, bytes]:
        import json
        return self.request("POST", path, json.dumps(obj).encode(), timeout=timeout)

    def status_kib(self, key: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise KeyError(key)

    def rss_peak_kib(self) -> int:
        return self.status_kib("VmHWM")

    def rss_kib(self) -> int:
        return self.status_kib("VmRSS")

    def stop(self) -> None:
        interrupt(self.proc, 20)


@contextmanager
def model_server_process(*flags: str, **kw: Any) -> Iterator[ModelServerProcess]:
    srv = ModelServerProcess(*flags, **kw)
    try:
        yield srv
    finally:
        srv.stop()


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out
