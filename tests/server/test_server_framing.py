"""Request framing rules (server.framing), pure: where a head ends and which heads are refused."""
from __future__ import annotations

import pytest

from server.framing import framing_error, head_end

POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\n"


@pytest.mark.parametrize("buffer,end", [
    (b"GET / HTTP/1.1\r\nHost: h\r\n\r\nrest", 27),
    (b"GET / HTTP/1.1\nHost: h\n\nrest", 24),
    (b"\r\n\r\nGET / HTTP/1.1\r\n\r\n", 22),  # empty lines before a request are not its end
    (b"GET / HTTP/1.1\r\nHost: h\r\n", None),
    (b"", None),
])
def test_head_end(buffer, end):
    assert head_end(buffer) == end


@pytest.mark.parametrize("headers", [
    b"Content-Length: 12\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"X-Content-Length: 3\r\nContent-Length: 3\r\n",
    b"X-Note: Content-Length: 4\r\nContent-Length: 4\r\n",  # only a header's own name counts
    b"",
])
def test_one_way_of_framing_is_accepted(headers):
    assert framing_error(POST + headers + b"\r\n") is None


@pytest.mark.parametrize("headers,fragment", [
    (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", "both Content-Length and Transfer-Encoding"),
    (b"TRANSFER-ENCODING: chunked\r\ncontent-length: 0\r\n", "both Content-Length and Transfer-Encoding"),
    (b"Transfer-Encoding: gzip, chunked\r\nContent-Length: 5\r\n", "both"),
    (b"Content-Length: 5\r\nContent-Length: 5\r\n", "2 Content-Length values"),
    (b"Content-Length: 5, 5\r\n", "2 Content-Length values"),
    (b"Content-Length: 5\r\nContent-Length: 7\r\n", "2 Content-Length values"),
])
def test_ambiguous_framing_is_refused_with_its_reason(headers, fragment):
    problem = framing_error(POST + headers + b"\r\n")
    assert problem is not None and fragment in problem and "RFC 9112" in problem


def test_lf_line_ends_are_read_like_crlf():
    assert framing_error(b"POST / HTTP/1.1\nContent-Length: 1\nTransfer-Encoding: chunked\n\n") is not None
