"""A measuring client for SSE streams over plain sockets: one thread, no event loop, no HTTP library.

`ds4-bench product` times ds4-server in the same process, on the same cores as the engine.
Every millisecond the client spends per token is taken from the engine and shows up as a
slower server. An httpx async client used about 0.9 ms of CPU per token on this project's
2-core reference machine; reading the sockets directly costs about 0.1 ms. A real client runs
elsewhere, so the lighter the measuring client, the closer the figure is to what one sees.

- `SSEResponseReader` (pure): bytes of one HTTP/1.1 response in, SSE event payloads out, as
  they complete. It reads the status line and headers, then a chunked or a close-delimited
  body, and splits the body into events at blank lines; what it returns per event is the
  text of its `data:` lines. A status other than 200 or malformed framing raises
  `RawStreamError`.
- `post_streams(host, port, path, bodies)`: sends each JSON body as a POST on its own
  connection, all at once, and reads the responses side by side with a selector. Each event
  is stamped with the time the bytes that completed it arrived. A stream must end with
  `data: [DONE]`; one that closes early raises `RawStreamError`.

It does not parse the events' JSON (callers look at the few they need), follow redirects,
speak TLS or reuse connections.
"""
from __future__ import annotations

import json
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

DONE = "[DONE]"
MAX_HEAD_BYTES = 64 * 1024


class RawStreamError(RuntimeError):
    """A response that is not a well-formed 200 event stream; the message says how."""


@dataclass
class SSEResponseReader:
    """Incremental reader of one event-stream response (module docstring)."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    done: bool = False  # the body has ended (last chunk, or the connection closed)
    _buf: bytearray = field(default_factory=bytearray)
    _chunked: bool = False
    _chunk_left: int = 0  # bytes of the current chunk still to read; -1: its CRLF is next
    _text: bytearray = field(default_factory=bytearray)  # body bytes not yet split into events

    def feed(self, data: bytes) -> list[str]:
        """The events completed by `data` (each one's `data:` lines joined by newlines)."""
        self._buf += data
        if self.status is None and not self._read_head():
            return []
        if self._chunked:
            self._read_chunks()
        else:
            self._text += self._buf
            self._buf.clear()
        return self._split_events()

    def close(self) -> list[str]:
        """The connection closed: the events still pending, or an error if the body was cut."""
        if self.status is None:
            raise RawStreamError("the connection closed before the response headers")
        if self._chunked and not self.done:
            raise RawStreamError("the connection closed inside a chunked body")
        self.done = True
        events = self._split_events()
        if self._text.strip():
            events.append(_event_data(bytes(self._text)))
            self._text.clear()
        return events

    def _read_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD_BYTES:
                raise RawStreamError(f"no end of the response headers in {MAX_HEAD_BYTES} bytes")
            return False
        lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[:end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise RawStreamError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise RawStreamError(f"a malformed response header: {line[:80]!r}")
            self.headers[name.strip().lower()] = value.strip()
        if self.status != 200:
            raise RawStreamError(f"the server answered {self.status}: {bytes(self._buf[:200])!r}")
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        return True

    def _read_chunks(self) -> None:
        while not self.done:
            if self._chunk_left > 0:
                take = min(self._chunk_left, len(self._buf))
                if take == 0:
                    return
                self._text += self._buf[:take]
                del self._buf[:take]
                self._chunk_left -= take
                if self._chunk_left == 0:
                    self._chunk_left = -1
                continue
            if self._chunk_left < 0:
                if len(self._buf) < 2:
                    return
                if self._buf[:2] != b"\r\n":
                    raise RawStreamError("a chunk is not followed by CRLF")
                del self._buf[:2]
                self._chunk_left = 0
                continue
            end = self._buf.find(b"\r\n")
            if end < 0:
                if len(self._buf) > 1024:
                    raise RawStreamError("a chunk-size line longer than 1024 bytes")
                return
            size_text = bytes(self._buf[:end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise RawStreamError(f"a malformed chunk size: {size_text[:40]!r}") from None
            del self._buf[:end + 2]
            if size == 0:
                self.done = True  # trailers, if any, are not read
                return
            self._chunk_left = size

    def _split_events(self) -> list[str]:
        events = []
        while True:
            end, sep = _event_end(self._text)
            if end < 0:
                return events
            raw = bytes(self._text[:end])
            del self._text[:end + sep]
            data = _event_data(raw)
            if data is not None:
                events.append(data)


def _event_end(text: bytearray) -> tuple[int, int]:
    """Where the first event of `text` ends and the length of the blank line that ends it."""
    ends = [(i, len(s)) for s in (b"\n\n", b"\r\n\r\n") if (i := text.find(s)) >= 0]
    return min(ends) if ends else (-1, 0)


def _event_data(raw: bytes) -> str | None:
    """The joined `data:` lines of one event; None for an event with none (a comment)."""
    data = [line[5:].lstrip(" ") for line in raw.decode("utf-8").splitlines() if line.startswith("data:")]
    return "\n".join(data) if data else None


@dataclass(frozen=True)
class StampedStream:
    """One response's events with the `time.perf_counter()` at which each was complete."""

    events: tuple[str, ...]
    stamps: tuple[float, ...]


def _request(host: str, port: int, path: str, body: Any) -> bytes:
    payload = json.dumps(body).encode("utf-8")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + payload


def post_streams(host: str, port: int, path: str, bodies: Sequence[Any], timeout_s: float = 600.0) -> list[StampedStream]:
    """Each body POSTed on its own connection at once; every stream read to its `[DONE]`."""
    sel = selectors.DefaultSelector()
    readers: list[SSEResponseReader] = []
    events: list[list[str]] = []
    stamps: list[list[float]] = []
    socks: list[socket.socket] = []
    try:
        for i, body in enumerate(bodies):
            sock = socket.create_connection((host, port), timeout=timeout_s)
            socks.append(sock)
            sock.sendall(_request(host, port, path, body))
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, i)
            readers.append(SSEResponseReader())
            events.append([])
            stamps.append([])
        deadline = time.monotonic() + timeout_s
        open_streams = len(socks)
        while open_streams:
            ready = sel.select(max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RawStreamError(f"no end of the streams within {timeout_s:g} s")
            for key, _ in ready:
                i = key.data
                data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                now = time.perf_counter()
                new = readers[i].feed(data) if data else readers[i].close()
                events[i].extend(new)
                stamps[i].extend([now] * len(new))
                if not data or (events[i] and events[i][-1] == DONE):
                    sel.unregister(key.fileobj)
                    open_streams -= 1
    finally:
        sel.close()
        for sock in socks:
            sock.close()
    for i, evs in enumerate(events):
        if not evs or evs[-1] != DONE:
            raise RawStreamError(f"stream {i} ended without data: [DONE] after {len(evs)} events")
    return [StampedStream(tuple(e), tuple(s)) for e, s in zip(events, stamps)]
