"""The HTTP edge of ds4-server: the listening socket and each connection until its request
headers are in, where uvicorn's own HTTP/1.1 protocol (h11) sets no limits.

- `bind_listener(host, port)`: the server socket, bound before the model loads (a port in use
  fails at once) and listening only once `listen(sock)` is called after the app is built, so
  that "listening on" is printed when it is true and connections before it are refused.
- `edge_protocol(limits)`: uvicorn's h11 protocol class with four rules added, each answered
  with a small JSON error in the OpenAI shape (the endpoint is not known yet) and one log line
  (at most one per rule and second; the repeats are counted in a summary line,
  `server.loglimit`):
    * request headers must be complete `header_timeout_s` after the connection opened, or after
      the first byte of a later request on it: otherwise 408 (some bytes came) or a plain close
      (none came). A slow-loris client cannot hold a connection by trickling header bytes.
    * request headers larger than `max_header_bytes` get 431.
    * a connection beyond `max_connections` open ones gets 503 with `Retry-After: 1` as soon as
      it is accepted, and is not counted: the connections already open, and new ones once some
      close, keep being served (`/health` included). When as many refused connections are still
      lingering, further ones are closed without an answer.
    * a request head whose body framing is ambiguous (Content-Length with Transfer-Encoding,
      more than one Content-Length: `server.framing`) gets 400. The head is checked before h11
      parses it, each time h11 is about to read a new request (the first on a connection and
      every pipelined or keep-alive one after it), so the body of a refused request is never
      read as another request.
  After such an answer the connection discards what the client still sends, sends its FIN and
  closes once the client has closed its side (uvicorn closes on EOF) or `linger_s` has passed: closing a
  socket with unread input would reset it, and the client would lose the answer.
- `uvicorn_config(app, limits, ...)`: the uvicorn `Config` that uses that protocol, on uvloop.
- `DrainingServer(config, on_exit)`: uvicorn's server that, when told to exit (SIGINT,
  SIGTERM), also calls `on_exit` once on a thread of its own (ds4-server cancels the inference
  work there): requests in flight then end with their shutdown answer (503, or a stream's
  end) within uvicorn's graceful period, instead of being cancelled when it runs out, which
  answers 500.
- `ensure_fd_budget(max_connections)`: raises the soft open-files limit when it is lower than
  the connection limit needs, or says why it cannot.

uvicorn's own options do not cover this: `timeout_keep_alive` only starts after a response,
`limit_concurrency` answers 503 per request but still accepts (and keeps) every connection,
and `h11_max_incomplete_event_size` answers 400, not 431 (here it is only a backstop above our
own limit). Body read timeouts are not here: the handler reads the body (`server.httpbody`).
It does not build the app or print banners (`server.cli` does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable

import h11
from uvicorn import Config, Server
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.framing import framing_error, head_end
from server.loglimit import RepeatLimiter

log = logging.getLogger("ds4.server")

MAX_HEADER_BYTES = 16 * 1024
# Files the process needs beyond its connections: model, cache files, pipes, the listener.
FD_RESERVE = 64


@dataclass(frozen=True)
class EdgeLimits:
    header_timeout_s: float = 10.0
    max_connections: int = 512
    max_header_bytes: int = MAX_HEADER_BYTES
    linger_s: float = 1.0


_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}
_CODES = {400: "bad_request_framing", 408: "request_timeout", 431: "request_header_fields_too_large",
          503: "too_many_connections"}


def edge_response(status: int, message: str, extra_headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": _CODES[status]}}).encode()
    head = [f"HTTP/1.1 {status} {_REASONS[status]}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in extra_headers)]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return "unknown peer"


def edge_protocol(limits: EdgeLimits) -> type[H11Protocol]:
    lingering: set[EdgeProtocol] = set()  # refused connections of this server, not yet closed
    # One line per refusal reason and second: a flood of connections is a flood of refusals.
    repeats = RepeatLimiter()

    class EdgeProtocol(H11Protocol):
        """h11 with header deadline, header size limit and connection limit (module docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            self._refused = False

        # --- connection life ---

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                # Not counted: the limit is about connections that are being served.
                self.connections.discard(self)
                if len(lingering) >= limits.max_connections:
                    transport.abort()
                    return
                repeats.log(log, logging.WARNING, "503 max-connections",
                            "503 to %s: %d connections are open (--max-connections %d)",
                            _peer(transport), limits.max_connections, limits.max_connections)
                self._refuse(edge_response(503, f"the server has {limits.max_connections} open connections, "
                                                "its limit (--max-connections); retry shortly",
                                           (("Retry-After", "1"),)))
                return
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            lingering.discard(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # the answer is sent; what the client still sends is dropped
            idle = self.conn.their_state is h11.IDLE
            if idle:
                if self._head_timer is None:
                    self._arm_head_timer()  # the first byte of a later request on this connection
                head = self.conn.trailing_data[0]
                if len(head) + len(data) > limits.max_header_bytes and not _head_ends_within(
                        head + data, limits.max_header_bytes):
                    repeats.log(log, logging.WARNING, "431", "431 to %s: request headers larger than %d bytes",
                                _peer(self.transport), limits.max_header_bytes)
                    self._refuse(edge_response(431, f"the request headers exceed {limits.max_header_bytes} bytes"))
                    return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._cancel_head_timer()

        def handle_events(self) -> None:
            # uvicorn calls this after new data and after each response, before h11 reads the
            # next request from its buffer: the one place that sees every request head.
            if self._refused:
                return
            if self.conn.their_state is h11.IDLE and self._framing_refused():
                return
            super().handle_events()

        # --- the rules ---

        def _framing_refused(self) -> bool:
            head = self.conn.trailing_data[0]
            end = head_end(head)
            problem = framing_error(head[:end]) if end is not None else None
            if problem is None:
                return False
            repeats.log(log, logging.WARNING, "400 framing", "400 to %s: %s", _peer(self.transport), problem)
            self._refuse(edge_response(400, problem))
            return True

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            received = len(self.conn.trailing_data[0])
            if received == 0:
                log.info("closed connection from %s: no request within %g s (--header-timeout-sec)",
                         _peer(self.transport), limits.header_timeout_s)
                self.transport.close()
                return
            repeats.log(log, logging.WARNING, "408 headers",
                        "408 to %s: request headers incomplete after %g s (--header-timeout-sec), %d bytes received",
                        _peer(self.transport), limits.header_timeout_s, received)
            self._refuse(edge_response(408, f"the request headers did not arrive within {limits.header_timeout_s:g} s "
                                            "(--header-timeout-sec)"))

        def _refuse(self, response: bytes) -> None:
            self._refused = True
            self._cancel_head_timer()
            lingering.add(self)
            self.transport.write(response)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(limits.linger_s, self.transport.close)

    return EdgeProtocol


def _head_ends_within(buffer: bytes, limit: int) -> bool:
    """Whether the blank line that ends a request head (h11 accepts LF and CRLF) is in the
    first `limit` bytes (plus the blank line itself)."""
    window = buffer[:limit + 4]
    return b"\n\r\n" in window or b"\n\n" in window


def uvicorn_config(app: Any, limits: EdgeLimits, *, log_level: str, timeout_graceful_shutdown: int = 5,
                   host: str = "127.0.0.1", port: int = 8000) -> Config:
    """`host` and `port` matter only to `Server.run()` without sockets (ds4-server passes its own)."""
    return Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=timeout_graceful_shutdown,
                  http=edge_protocol(limits), lifespan="on",
                  # uvloop's C event loop: a streamed token costs the server's thread about a
                  # fifth less CPU than with asyncio's own loop, and that thread shares the
                  # cores with the engine.
                  loop="uvloop",
                  # Our own check answers 431 first; h11's (a 400) is only a backstop.
                  h11_max_incomplete_event_size=limits.max_header_bytes + 1024)


class DrainingServer(Server):
    """A uvicorn `Server` that calls `on_exit` once, on its own thread, when told to exit."""

    def __init__(self, config: Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._exiting = threading.Event()

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if not self._exiting.is_set():
            self._exiting.set()
            # Not in the signal handler itself: it may have interrupted a holder of a lock
            # that `on_exit` takes.
            threading.Thread(target=self._on_exit, name="ds4-exit", daemon=True).start()


def bind_listener(host: str, port: int) -> socket.socket:
    """A bound, not yet listening TCP socket (OSError when the address is taken or invalid)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except BaseException:
        sock.close()
        raise
    return sock


def listen(sock: socket.socket, backlog: int = 2048) -> None:
    sock.listen(backlog)


def ensure_fd_budget(max_connections: int) -> None:
    """Raise the soft RLIMIT_NOFILE to what `max_connections` (twice: open and lingering
    refusals) needs; ValueError when the hard limit is lower."""
    need = 2 * max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(f"--max-connections {max_connections} needs {need} open files, but the limit is "
                         f"{hard} (ulimit -n); lower --max-connections or raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
