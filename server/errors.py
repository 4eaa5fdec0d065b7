"""Client-facing errors and their JSON shape in each API.

`ApiError` is raised anywhere between the HTTP body and the job queue when a request
cannot be served; the route catches it and renders it in the dialect of its endpoint:

- OpenAI (Chat, Completions, Responses, everything that is not Anthropic):
  `{"error": {"message", "type", "param", "code", ...extra}}`
- Anthropic (`/v1/messages`): `{"type": "error", "error": {"type", "message", ...extra}}`

The dialect of a path comes from the endpoint table (`dialect_for_path(path, endpoints)`).

It also holds the translation of pydantic validation errors into one readable line, and
`client_error_line`, the one log line of a 4xx (status, method, path, message) with control
characters escaped so that a hostile path or header cannot forge log lines.
It does not log, and it never includes a traceback or internal state in a message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Protocol

from pydantic import ValidationError

Dialect = Literal["openai", "anthropic"]

# Anthropic names error kinds by HTTP status rather than by cause.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    431: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    """Response headers that go with the error (`WWW-Authenticate`, `Connection: close`)."""

    def __str__(self) -> str:
        return self.message


def error_body(err: ApiError, dialect: Dialect) -> dict[str, Any]:
    if dialect == "anthropic":
        inner = {"type": _ANTHROPIC_TYPES.get(err.status, "invalid_request_error"), "message": err.message}
        inner.update(err.extra)
        return {"type": "error", "error": inner}
    inner = {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    inner.update(err.extra)
    return {"error": inner}


_LOG_MESSAGE_MAX = 300


def _escaped(text: str) -> str:
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def client_error_line(status: int, method: str, path: str, message: str) -> str:
    """`415 POST /v1/chat/completions: Content-Type text/plain is not supported ...`"""
    if len(message) > _LOG_MESSAGE_MAX:
        message = message[:_LOG_MESSAGE_MAX] + "..."
    return f"{status} {_escaped(method)} {_escaped(path)}: {_escaped(message)}"


class Routed(Protocol):
    """An endpoint as far as errors care (`server.endpoints.Endpoint`)."""
    path: str
    dialect: Dialect


def dialect_for_path(path: str, endpoints: Iterable[Routed]) -> Dialect:
    """The dialect of the endpoint whose path, up to its first parameter, is the longest
    prefix of `path` (so unknown paths below `/v1/messages` answer like Anthropic); OpenAI
    when none is."""
    best, dialect = -1, "openai"
    for e in endpoints:
        head = e.path.split("{", 1)[0]
        if path.startswith(head) and len(head) > best:
            best, dialect = len(head), e.dialect
    return dialect


def _loc_to_str(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_error(exc: ValidationError) -> ApiError:
    """First pydantic error as a 400 naming the offending field (never echoing its value)."""
    errors = exc.errors(include_url=False, include_input=False)
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    # Union members add the tried type names to the location; they only confuse clients.
    loc = tuple(p for p in first.get("loc", ()) if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS)))
    where = _loc_to_str(loc)
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    text = f"{where}: {msg}{more}" if where else f"{msg}{more}"
    return ApiError(400, text, param=where or None)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-before",
               "function-plain", "function-wrap", "literal", "tagged-union", "nullable"}
