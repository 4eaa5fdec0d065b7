"""Reading a JSON request body off the wire: its headers, its size and its time.

- `body_headers_error(content_type, content_encoding)`: a 415 unless the body is declared as
  uncompressed JSON. Accepted: `application/json` and `application/<name>+json`, with no
  charset or a UTF-8 one. A missing Content-Type is refused too: a web page can send a
  cross-site POST without a preflight only as text/plain, form data, or a Blob without a type
  (no Content-Type at all), so refusing all of those keeps other sites' pages from driving a
  server on localhost. The official OpenAI and Anthropic SDKs send `application/json`.
  Any Content-Encoding other than `identity` (gzip, br, deflate, ...) is refused by name
  instead of failing later as "not valid UTF-8".
- `read_body(request, limit, timeout)`: the whole body, or an `ApiError`: 413 beyond `limit`
  bytes (declared or received), 408 when it has not all arrived `timeout` seconds after the
  handler started reading (with `Connection: close`, since the rest of the body is never
  read), 499 when the client closed the connection first (logged by the app as one line,
  never answered).

It does not parse JSON (`server.jsonparse`) or log.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from server.errors import ApiError

# HTTP status for a request whose client went away before the answer (never seen by it).
CLIENT_CLOSED = 499
_CLOSE = {"Connection": "close"}


def _media_type(content_type: str) -> tuple[str, dict[str, str]]:
    kind, *params = content_type.split(";")
    parsed = {}
    for p in params:
        name, _, value = p.partition("=")
        parsed[name.strip().lower()] = value.strip().strip('"').lower()
    return kind.strip().lower(), parsed


def _is_json(kind: str) -> bool:
    top, _, sub = kind.partition("/")
    return top == "application" and (sub == "json" or sub.endswith("+json"))


def body_headers_error(content_type: str | None, content_encoding: str | None) -> ApiError | None:
    if content_encoding is not None and content_encoding.strip().lower() not in ("", "identity"):
        return ApiError(415, f"Content-Encoding {content_encoding.strip()!r} is not supported: send the "
                             "JSON body uncompressed", code="unsupported_content_encoding")
    if content_type is None:
        return ApiError(415, "the request has no Content-Type: send 'Content-Type: application/json'",
                        code="unsupported_media_type")
    kind, params = _media_type(content_type)
    if not _is_json(kind):
        return ApiError(415, f"Content-Type {kind!r} is not supported: send 'Content-Type: application/json'",
                        code="unsupported_media_type")
    charset = params.get("charset")
    if charset is not None and charset.replace("-", "") != "utf8":
        return ApiError(415, f"charset {charset!r} is not supported: JSON bodies are UTF-8",
                        code="unsupported_media_type")
    return None


def _declared_size(request: Request, limit: int) -> int | None:
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    try:
        size = int(declared)
    except ValueError:
        raise ApiError(400, "invalid Content-Length header") from None
    if size > limit:
        raise ApiError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes "
                            "(--max-body-mb)", type="request_too_large", headers=dict(_CLOSE))
    return size


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    declared = _declared_size(request, limit)
    chunks: list[bytes] = []
    size = 0
    of = f" of {declared}" if declared is not None else ""
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body exceeds the limit of {limit} bytes (--max-body-mb)",
                                   type="request_too_large", headers=dict(_CLOSE))
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (--body-timeout-sec): "
                            f"{size}{of} bytes received", type="timeout_error", code="request_timeout",
                       headers=dict(_CLOSE)) from None
    except ClientDisconnect:
        raise ApiError(CLIENT_CLOSED, f"the client closed the connection during the request body: "
                                      f"{size}{of} bytes received", code="client_closed") from None
    return b"".join(chunks)
