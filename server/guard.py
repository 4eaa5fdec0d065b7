"""Who may talk to ds4-server: the Host allow-list and the API key, as pure checks and one ASGI
middleware that applies a check before the app sees the request.

- `host_error(host_header, allowed)`: a 403 unless the Host header names an allowed host
  (any port). On loopback binds the allow-list is on by default (`LOOPBACK_HOSTS` plus
  `--allowed-host` names): a web page that rebinds its own DNS name to 127.0.0.1 reaches the
  socket, but its requests carry its own name in Host and are refused. Requests without a
  Host header pass (HTTP/1.0 clients; browsers always send one).
- `key_error(path, headers, key)`: a 401 unless `Authorization: Bearer KEY` or `x-api-key: KEY`
  matches (either header on every endpoint: the OpenAI SDKs send the first, the Anthropic SDK
  the second or the first with `auth_token`). `/health` stays open, and so do CORS
  preflights, which browsers send without credentials. Keys are compared as SHA-256 digests
  with `hmac.compare_digest`, so neither their content nor their length shows in the timing.
- `RequestGuard(app, check, dialect_of)`: runs `check(method, path, headers)` and answers its
  `ApiError` in the endpoint's error dialect, with one log line (repeats rate-limited by the
  app's `server.loglimit.RepeatLimiter`); otherwise passes the request on.
- `is_loopback(host)`: whether a bind address only accepts local connections.

It does not bind sockets, parse bodies or decide CORS (`server.app` wires the middleware).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from typing import Callable, Mapping

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import ApiError, Dialect, client_error_line, error_body
from server.loglimit import RepeatLimiter

log = logging.getLogger("ds4.server")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = frozenset({"/health"})

Check = Callable[[str, str, Mapping[str, str]], "ApiError | None"]


def is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def normalize_host(name: str) -> str:
    """A host name as compared: lower case, no trailing dot, IPv6 without brackets."""
    return name.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")


def host_name(host_header: str) -> str:
    """The host part of a Host header value (`[::1]:8000` -> `::1`, `localhost:80` -> `localhost`)."""
    value = host_header.strip()
    if value.startswith("["):
        return normalize_host(value[1:value.find("]")] if "]" in value else value[1:])
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return normalize_host(value)


def host_error(host_header: str | None, allowed: frozenset[str]) -> ApiError | None:
    if host_header is None or host_name(host_header) in allowed:
        return None
    shown = host_header if len(host_header) <= 100 else host_header[:100] + "..."
    return ApiError(403, f"Host {shown!r} is not allowed here (allowed: {', '.join(sorted(allowed))}; "
                         "add names with --allowed-host)", type="permission_error", code="host_not_allowed")


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


def presented_keys(headers: Mapping[str, str]) -> list[str]:
    keys = []
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            keys.append(token.strip())
    if headers.get("x-api-key"):
        keys.append(headers["x-api-key"].strip())
    return keys


def key_error(method: str, path: str, headers: Mapping[str, str], key: str) -> ApiError | None:
    if path in OPEN_PATHS or (method == "OPTIONS" and "access-control-request-method" in headers):
        return None
    keys = presented_keys(headers)
    want = _digest(key)
    # Every presented key is compared, so which header carried the match does not show either.
    matched = [hmac.compare_digest(_digest(k), want) for k in keys]
    if any(matched):
        return None
    challenge = {"WWW-Authenticate": 'Bearer realm="ds4-server"'}
    if not keys:
        return ApiError(401, "an API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                        code="missing_api_key", headers=challenge)
    return ApiError(401, "invalid API key", code="invalid_api_key", headers=challenge)


def host_check(allowed: frozenset[str]) -> Check:
    return lambda method, path, headers: host_error(headers.get("host"), allowed)


def key_check(key: str) -> Check:
    return lambda method, path, headers: key_error(method, path, headers, key)


class RequestGuard:
    """ASGI middleware: answer `check`'s error, or pass the request on untouched."""

    def __init__(self, app: ASGIApp, check: Check, dialect_of: Callable[[str], Dialect],
                 repeats: RepeatLimiter | None = None) -> None:
        self.app, self.check, self.dialect_of = app, check, dialect_of
        self.repeats = repeats if repeats is not None else RepeatLimiter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        err = self.check(method, path, Headers(scope=scope))
        if err is None:
            await self.app(scope, receive, send)
            return
        line = client_error_line(err.status, method, path, err.message)
        self.repeats.log(log, logging.INFO, line, line)
        response = JSONResponse(error_body(err, self.dialect_of(path)), status_code=err.status,
                                headers=err.headers)
        await response(scope, receive, send)
