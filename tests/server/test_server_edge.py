"""The HTTP edge against hostile clients, with real sockets against real `ds4-server` processes
(the fake engine): header and body timeouts, oversized headers, unsupported bodies, aborted
uploads, the one-line 4xx log, the connection limit and a port in use.

One server process is shared by the module's tests (starting one costs seconds); its timeouts
and connection limit are set small by flag so that a slow client is answered within a second
or two and four connections reach the limit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import re
import sys
import time

import httpx
import pytest

from server_support import REPO_ROOT, read_until_closed, server_process

TIMEOUT = 1.0  # --header-timeout-sec and --body-timeout-sec of the shared server
LIMIT = 4  # its --max-connections; every other test holds one connection at a time
HEAD = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    log = tmp_path_factory.mktemp("edge") / "server.log"
    with server_process(log, "--header-timeout-sec", str(TIMEOUT), "--body-timeout-sec", str(TIMEOUT),
                        "--max-connections", str(LIMIT)) as s:
        yield s


def connect(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def json_body(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def test_headers_sent_too_slowly_get_408_and_one_log_line(srv):
    with connect(srv) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the blank line
        t0 = time.monotonic()
        s.sendall(b"X-Slow: 1\r\n")
        response = read_until_closed(s)
        waited = time.monotonic() - t0
    assert status_of(response) == 408 and json_body(response)["error"]["code"] == "request_timeout"
    assert TIMEOUT * 0.8 < waited < TIMEOUT + 3
    line = [ln for ln in srv.wait_log("408 to 127.0.0.1").splitlines() if "408 to 127.0.0.1" in ln]
    assert len(line) == 1 and "request headers incomplete after 1 s" in line[0]


def test_a_connection_that_sends_nothing_is_closed(srv):
    with connect(srv) as s:
        t0 = time.monotonic()
        assert read_until_closed(s) == b""
        assert time.monotonic() - t0 < TIMEOUT + 3
    srv.wait_log("no request within 1 s")


def test_a_body_sent_too_slowly_gets_408(srv):
    with connect(srv) as s:
        s.sendall((HEAD + "Content-Length: 100\r\n\r\n").encode() + b'{"messages": ')
        response = read_until_closed(s)
    assert status_of(response) == 408 and b"connection: close" in response.lower()
    assert "1 s (--body-timeout-sec): 13 of 100 bytes received" in json_body(response)["error"]["message"]
    srv.wait_log("408 POST /v1/chat/completions: the request body did not arrive within 1 s")


def test_headers_of_a_megabyte_get_431(srv):
    with connect(srv) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n")
        response = read_until_closed(s)
    assert status_of(response) == 431
    assert "exceed 16384 bytes" in json_body(response)["error"]["message"]
    srv.wait_log("431 to 127.0.0.1")
    # Headers up to the limit are served.
    assert httpx.get(srv.base + "/health", headers={"X-Big": "a" * 15_000}).status_code == 200


@pytest.mark.parametrize("headers,fragment", [
    ({"Content-Type": "application/json", "Content-Encoding": "gzip"}, "Content-Encoding 'gzip' is not supported"),
    ({"Content-Type": "text/plain"}, "Content-Type 'text/plain' is not supported"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, "is not supported"),
    ({}, "the request has no Content-Type"),
])
def test_bodies_that_are_not_plain_json_get_415(srv, headers, fragment):
    import gzip

    body = json.dumps(CHAT).encode()
    if headers.get("Content-Encoding") == "gzip":
        body = gzip.compress(body)
    r = httpx.post(srv.base + "/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 415 and fragment in r.json()["error"]["message"], r.text
    anthropic = httpx.post(srv.base + "/v1/messages", content=body, headers=headers)
    assert anthropic.status_code == 415 and anthropic.json()["type"] == "error"
    srv.wait_log(f"415 POST /v1/messages: {anthropic.json()['error']['message']}")


def test_json_with_a_utf8_charset_is_served(srv):
    r = httpx.post(srv.base + "/v1/chat/completions", content=json.dumps(CHAT).encode(),
                   headers={"Content-Type": "application/json; charset=UTF-8"})
    assert r.status_code == 200, r.text


def logged_times(log: str, fragment: str) -> int:
    """How many times a line with `fragment` was logged: lines written, plus the repeats their
    summary lines count ("... (N more like this in the last 1.0 s)")."""
    total = 0
    for line in log.splitlines():
        if fragment in line:
            summary = re.search(r"\((\d+) more like this in the last", line)
            total += int(summary.group(1)) if summary else 1
    return total


def test_aborted_uploads_are_logged_without_traceback_and_repeats_summarised(srv):
    fragment = "499 POST /v1/chat/completions: the client closed the connection during the request body: " \
               "14 of 1000 bytes received"
    before = logged_times(srv.log(), fragment)
    for _ in range(5):
        with connect(srv) as s:
            s.sendall((HEAD + "Content-Length: 1000\r\n\r\n").encode() + b'{"messages": [')
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while logged_times(srv.log(), fragment) < before + 5:
        assert time.monotonic() < deadline, srv.log()[-2000:]
        time.sleep(0.05)
    log = srv.log()
    assert logged_times(log, fragment) == before + 5
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_every_4xx_is_logged_with_status_endpoint_and_message(srv):
    r = httpx.post(srv.base + "/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    srv.wait_log(f"400 POST /v1/chat/completions: {r.json()['error']['message']}")
    assert httpx.get(srv.base + "/v1/nope").status_code == 404
    srv.wait_log("404 GET /v1/nope: no such endpoint: GET /v1/nope")
    # A decoded newline in the path is escaped, so that it cannot start a forged log line.
    assert httpx.get(srv.base + "/v1/x%0Aforged", headers={"Host": "evil.example"}).status_code == 403
    srv.wait_log("403 GET /v1/x\\nforged: Host 'evil.example' is not allowed")
    r = httpx.post(srv.base + "/v1/messages", json={"messages": []})
    assert r.status_code == 400
    srv.wait_log(f"400 POST /v1/messages: {r.json()['error']['message']}")


def test_a_foreign_host_header_gets_403(srv):
    r = httpx.get(srv.base + "/v1/models", headers={"Host": "evil.example"})
    assert r.status_code == 403 and "Host 'evil.example' is not allowed" in r.json()["error"]["message"]
    for host in ("localhost:8000", "127.0.0.1", "[::1]:1234", "LOCALHOST"):
        assert httpx.get(srv.base + "/v1/models", headers={"Host": host}).status_code == 200, host
    srv.wait_log("403 GET /v1/models: Host 'evil.example' is not allowed")


def test_models_and_health_show_file_names_only(srv):
    meta = httpx.get(srv.base + "/v1/models").json()["data"][0]["meta"]
    assert meta["path"] == "fake-model.gguf"
    assert "/models" not in httpx.get(srv.base + "/health").text


# --- request framing (RFC 9112 section 6.1 and 6.3) -------------------------------------------

SMUGGLED = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def status_lines(response: bytes) -> list[bytes]:
    return re.findall(rb"HTTP/1\.1 \d{3}", response)


@pytest.mark.parametrize("framing", [
    "Content-Length: {n}\r\nTransfer-Encoding: chunked\r\n",
    "transfer-encoding: CHUNKED\r\ncontent-length: {n}\r\n",
], ids=["cl-then-te", "te-then-cl"])
def test_a_request_with_content_length_and_transfer_encoding_gets_400_and_its_hidden_request_is_never_served(
        srv, framing):
    # Framed by Transfer-Encoding the body is empty and a second request follows it; framed by
    # Content-Length that request is the body. Either reading is a smuggling vector: refused.
    body = b"0\r\n\r\n" + SMUGGLED
    with connect(srv) as s:
        s.sendall((HEAD + framing.format(n=len(body)) + "\r\n").encode() + body)
        t0 = time.monotonic()
        response = read_until_closed(s)
        assert time.monotonic() - t0 < 3  # closed by the server, not by a keep-alive timeout
    assert status_lines(response) == [b"HTTP/1.1 400"], response
    assert b"connection: close" in response.lower()
    error = json_body(response)["error"]
    assert error["code"] == "bad_request_framing"
    assert "both Content-Length and Transfer-Encoding" in error["message"]
    srv.wait_log("400 to 127.0.0.1")


@pytest.mark.parametrize("lengths", [
    "Content-Length: 2\r\nContent-Length: 2\r\n",
    "Content-Length: 2, 2\r\n",
    "Content-Length: 2\r\nContent-Length: 40\r\n",
], ids=["repeated", "listed", "conflicting"])
def test_more_than_one_content_length_gets_400_and_a_close(srv, lengths):
    with connect(srv) as s:
        s.sendall((HEAD + lengths + "\r\n").encode() + b"{}" + SMUGGLED)
        response = read_until_closed(s)
    assert status_lines(response) == [b"HTTP/1.1 400"], response
    assert json_body(response)["error"]["code"] == "bad_request_framing"
    assert "Content-Length" in json_body(response)["error"]["message"]


def test_a_badly_framed_request_after_a_good_one_on_the_same_connection_is_refused(srv):
    """The check sees every request head, the pipelined ones too, not only a connection's first."""
    body = b"0\r\n\r\n" + SMUGGLED
    bad = (HEAD + f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n").encode() + body
    with connect(srv) as s:
        s.sendall(SMUGGLED + bad)
        response = read_until_closed(s)
    assert status_lines(response) == [b"HTTP/1.1 200", b"HTTP/1.1 400"], response


def test_the_server_still_serves_after_the_hostile_clients(srv):
    assert httpx.post(srv.base + "/v1/chat/completions", json=CHAT).status_code == 200
    assert "Traceback" not in srv.log()


# --- the connection limit -------------------------------------------------------------------

def health_on(s: socket.socket) -> int:
    """The status of GET /health on an open connection, which stays open (keep-alive)."""
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(ln.split(b":")[1] for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return status_of(head)


def kept_alive(srv) -> socket.socket:
    """A connection that was served once and now idles in keep-alive (uvicorn keeps it 5 s)."""
    s = connect(srv)
    assert health_on(s) == 200
    return s


def health_on_a_new_connection(srv, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(srv.base + "/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_connections_beyond_the_limit_get_503_while_open_ones_are_served(srv):
    health_on_a_new_connection(srv)  # the connections of earlier tests are gone
    kept = [kept_alive(srv) for _ in range(LIMIT)]
    try:
        t0 = time.monotonic()
        with connect(srv) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            response = read_until_closed(extra)
        refused_in = time.monotonic() - t0
        assert status_of(response) == 503 and b"Retry-After: 1" in response
        assert json_body(response)["error"]["code"] == "too_many_connections"
        assert refused_in < 2
        # The connections that were open before keep being served.
        assert all(health_on(s) == 200 for s in kept)
    finally:
        for s in kept:
            s.close()
    # Below the limit again, new connections are served.
    health_on_a_new_connection(srv)
    srv.wait_log("503 to 127.0.0.1")
    assert f"{LIMIT} connections are open (--max-connections {LIMIT})" in srv.log()


# --- binding --------------------------------------------------------------------------------

def test_a_port_in_use_is_a_one_line_error_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "server.cli", "--port", str(port), "--model", "/nonexistent.gguf"],
                           capture_output=True, text=True, env=env, timeout=60, cwd=REPO_ROOT)
    assert r.returncode == 1
    # The model (a missing file here) is never reached: the bind fails first.
    assert r.stderr == f"Error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert "listening" not in r.stdout + r.stderr
    assert time.monotonic() - t0 < 30


def test_the_draining_server_calls_on_exit_once_on_a_thread_of_its_own():
    import signal
    import threading

    from uvicorn import Config

    from server.edge import DrainingServer

    called: list[str] = []
    done = threading.Event()

    def on_exit() -> None:
        called.append(threading.current_thread().name)
        done.set()

    srv = DrainingServer(Config(app=lambda *_: None), on_exit=on_exit)
    srv.handle_exit(signal.SIGTERM, None)
    srv.handle_exit(signal.SIGINT, None)  # a second signal forces the exit; the work is already cancelled
    assert done.wait(5) and srv.should_exit
    time.sleep(0.05)
    assert called == ["ds4-exit"]


@pytest.mark.model
def test_work_in_flight_is_answered_503_when_the_server_is_told_to_exit():
    """uvicorn cancels handlers still running after its graceful period, which answers 500;
    the work is cancelled as the exit begins instead."""
    import threading

    from server_support import ModelServerProcess

    srv = ModelServerProcess("--log-level", "warning", startup_s=60)
    try:
        answers: list[tuple[int, str]] = []

        def fire() -> None:
            r = httpx.post(srv.base + "/v1/completions", timeout=60,
                           json={"prompt": "Once upon a time", "max_tokens": 64, "n": 64, "temperature": 0})
            answers.append((r.status_code, r.text))

        t = threading.Thread(target=fire)
        t.start()
        while not httpx.get(srv.base + "/health", timeout=10).json()["busy"]:
            time.sleep(0.01)
    finally:
        srv.stop()
    t.join(30)
    assert answers and answers[0][0] == 503 and "shutting down" in answers[0][1], answers
