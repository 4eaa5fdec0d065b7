"""The light SSE client of ds4-bench product: the pure response reader, and real sockets
against a small HTTP server that this file starts on 127.0.0.1."""
from __future__ import annotations

import json
import socket
import threading

import pytest

from ds4bench.rawstream import RawStreamError, SSEResponseReader, post_streams

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def feed_in_pieces(data: bytes, size: int) -> tuple[SSEResponseReader, list[str]]:
    reader, events = SSEResponseReader(), []
    for i in range(0, len(data), size):
        events += reader.feed(data[i:i + size])
    return reader, events


BODY = HEAD + chunked(b'data: {"a":1}\n\n', b": prefill\n\n", b'data: {"b":', b'2}\n\ndata: [DONE]\n\n')


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
def test_events_come_out_whole_however_the_bytes_are_split(size):
    reader, events = feed_in_pieces(BODY, size)
    assert events == ['{"a":1}', '{"b":2}', "[DONE]"]
    assert reader.done and reader.status == 200 and reader.headers["content-type"] == "text/event-stream"


def test_multi_line_data_crlf_events_and_chunk_extensions():
    body = HEAD + b"5;ext=1\r\nevent\r\n" + chunked(b": x\r\n\r\ndata: one\r\ndata:two\r\n\r\n")
    reader, events = feed_in_pieces(body, 4)
    assert events == ["one\ntwo"]
    assert reader.done


def test_a_close_delimited_body_flushes_its_last_event_on_close():
    reader = SSEResponseReader()
    assert reader.feed(b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\ndata: 2") == ["1"]
    assert reader.close() == ["2"]


@pytest.mark.parametrize("data, message", [
    (b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n{}", "the server answered 429"),
    (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed response header"),
    (HEAD + b"zz\r\n", "malformed chunk size"),
    (HEAD + b"2\r\nabXY", "not followed by CRLF"),
    (HEAD + b"f" * 2000, "chunk-size line longer"),
])
def test_malformed_responses_are_one_line_errors(data, message):
    with pytest.raises(RawStreamError, match=message):
        SSEResponseReader().feed(data)


def test_a_connection_closed_inside_the_body_or_the_head_is_an_error():
    reader = SSEResponseReader()
    reader.feed(HEAD + b"10\r\ndata: 1")
    with pytest.raises(RawStreamError, match="inside a chunked body"):
        reader.close()
    with pytest.raises(RawStreamError, match="before the response headers"):
        SSEResponseReader().close()


class OneShotServer:
    """Answers each connection with `reply(request body)` in pieces, then closes."""

    def __init__(self, reply) -> None:
        self.reply, self.bodies = reply, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            while len(body) < length:
                body += conn.recv(4096)
            self.bodies.append(json.loads(body))
            for piece in self.reply(json.loads(body)):
                conn.sendall(piece)

    def close(self) -> None:
        self.sock.close()


def test_concurrent_streams_are_read_to_done_with_a_stamp_per_event():
    def reply(body):
        n = body["n"]
        yield HEAD
        for i in range(n):
            yield chunked(f'data: {{"i":{i}}}\n\n'.encode())[:-5]  # every chunk but the last marker
        yield chunked(b"data: [DONE]\n\n")

    server = OneShotServer(reply)
    try:
        streams = post_streams("127.0.0.1", server.port, "/v1/x", [{"n": 3}, {"n": 5}])
    finally:
        server.close()
    assert [len(s.events) for s in streams] == [4, 6]
    assert streams[1].events[:2] == ('{"i":0}', '{"i":1}') and streams[1].events[-1] == "[DONE]"
    assert all(len(s.stamps) == len(s.events) and list(s.stamps) == sorted(s.stamps) for s in streams)
    assert sorted(b["n"] for b in server.bodies) == [3, 5]


def test_a_stream_that_closes_before_done_fails():
    server = OneShotServer(lambda _body: iter([HEAD, chunked(b'data: {"i":0}\n\n')]))
    try:
        with pytest.raises(RawStreamError, match=r"stream 0 ended without data: \[DONE\] after 1 events"):
            post_streams("127.0.0.1", server.port, "/v1/x", [{}])
    finally:
        server.close()
