"""How a request's body is delimited, checked on the raw request head before h11 reads it.

- `head_end(buffer)`: where the request head in `buffer` ends (the index just past its blank
  line), or None while it is incomplete. h11 accepts LF as well as CRLF line ends, so this does.
- `framing_error(head)`: None when the head frames its body in one unambiguous way, else the
  one-line reason for a 400. Refused, after RFC 9112:
    * Content-Length together with Transfer-Encoding (section 6.1: such a message "ought to be
      handled as an error", and a server that frames it either way can be made to serve a
      request hidden in the body of another: request smuggling);
    * Content-Length more than once, or as a list ("5, 5"), even with equal values
      (section 6.3: a message whose length is ambiguous is an unrecoverable error; RFC 9110
      section 8.6 lets a recipient reject duplicates, and we do, so that no proxy in front of
      us can read another length than we do).
  A refused head is answered 400 and its connection closed (`server.edge`): nothing after it
  on the connection is read as a request.

h11 alone would frame a request that carries both headers by Transfer-Encoding and keep the
connection, and would fold equal duplicate Content-Lengths into one; conflicting ones it does
refuse, but with uvicorn's plain-text 400. This check gives all of them one answer.

It does not check anything else in the head (h11 validates the syntax) nor read bodies
(`server.httpbody`).
"""

from __future__ import annotations

import re

# A header line's name: the characters before the colon (h11 refuses whitespace there).
_NAME = re.compile(rb"^([^:\s]+):")


def head_end(buffer: bytes | bytearray) -> int | None:
    """Index just past the blank line that ends the request head in `buffer`, or None."""
    start = 0
    while buffer.startswith(b"\r\n", start) or buffer.startswith(b"\n", start):
        start += 2 if buffer.startswith(b"\r\n", start) else 1  # empty lines before a request are skipped
    ends = [(i, len(mark)) for mark in (b"\n\r\n", b"\n\n") if (i := buffer.find(mark, start)) >= 0]
    if not ends:
        return None
    i, n = min(ends)
    return i + n


def framing_error(head: bytes | bytearray) -> str | None:
    """The reason `head` (a complete request head) frames its body ambiguously, or None."""
    lengths: list[bytes] = []
    chunked = False
    for line in bytes(head).lstrip(b"\r\n").split(b"\n")[1:]:  # after the request line
        m = _NAME.match(line)
        if m is None:  # a folded continuation line, the blank line at the end
            continue
        name = m.group(1).lower()
        value = line[m.end():].strip()
        if name == b"content-length":
            lengths.extend(v.strip() for v in value.split(b","))
        elif name == b"transfer-encoding":
            chunked = True
    if chunked and lengths:
        return ("the request has both Content-Length and Transfer-Encoding, which frame its body "
                "differently (RFC 9112 section 6.1); send one of them")
    if len(lengths) > 1:
        return (f"the request has {len(lengths)} Content-Length values; send exactly one "
                "(RFC 9112 section 6.3)")
    return None
