"""Hardened JSON parsing for request bodies.

`parse_json_body(raw)` turns the raw bytes of an HTTP body into Python values, or raises
`JsonBodyError` with a one-line message fit for a 400 response. It is stricter than
`json.loads` where leniency would let a hostile or broken client hurt the server or be
silently misread:

- the body must be valid UTF-8 (a leading UTF-8 BOM is tolerated);
- `NaN`, `Infinity`, `-Infinity` and numbers that overflow a float (`1e400`) are rejected:
  they are not JSON and would reach the sampler as non-finite values;
- integers longer than `MAX_INT_DIGITS` digits are rejected before Python converts them
  (conversion of huge digit strings is quadratic);
- nesting deeper than `MAX_DEPTH` (256) levels is rejected, including nesting deep enough
  to exhaust the interpreter's recursion limit inside the C scanner;
- an object with the same key twice is rejected, because two `content` members would
  otherwise be resolved by "last one wins" without the client knowing;
- lone UTF-16 surrogates written as `\\ud800` escapes become U+FFFD, so every string the
  server handles can be encoded as UTF-8 (a valid surrogate pair is already combined by
  the decoder).

It does not validate the shape of the document (that is each API's schema) and performs
no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 256
MAX_INT_DIGITS = 4000

_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_BOM = b"\xef\xbb\xbf"


class JsonBodyError(ValueError):
    """The body is not acceptable JSON; the message is safe to return to the client."""


def _reject_constant(name: str) -> Any:
    raise JsonBodyError(f"invalid JSON number {name}: NaN and Infinity are not allowed")


def _parse_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise JsonBodyError(f"JSON number {text[:40]} is out of range")
    return value


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JsonBodyError(f"JSON integer with more than {MAX_INT_DIGITS} digits")
    return int(text)


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)  # in C: a hostile body can hold tens of thousands of objects
    if len(obj) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonBodyError(f"duplicate key {_clean_str(key)!r} in a JSON object")
            seen.add(key)
    return obj


def _clean_str(s: str) -> str:
    return _SURROGATE.sub("\ufffd", s) if _SURROGATE.search(s) else s


def _sanitize(value: Any) -> Any:
    """Check depth and replace lone surrogates, iteratively (no recursion on deep input)."""
    if isinstance(value, str):
        return _clean_str(value)
    if not isinstance(value, (dict, list)):
        return value
    root: list[Any] = [value]
    # Each stack entry: (container, depth). Containers are mutated in place.
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        container, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise JsonBodyError(f"JSON nested deeper than {MAX_DEPTH} levels")
        if isinstance(container, list):
            for i, item in enumerate(container):
                if isinstance(item, str):
                    container[i] = _clean_str(item)
                elif isinstance(item, (dict, list)):
                    stack.append((item, depth + 1))
        else:
            dirty_keys = [k for k in container if _SURROGATE.search(k)]
            for k in dirty_keys:
                cleaned = _clean_str(k)
                if cleaned in container:
                    raise JsonBodyError(f"duplicate key {cleaned!r} in a JSON object")
                container[cleaned] = container.pop(k)
            for k, item in container.items():
                if isinstance(item, str):
                    container[k] = _clean_str(item)
                elif isinstance(item, (dict, list)):
                    stack.append((item, depth + 1))
    return root[0]


def _deepest_beyond_limit(value: Any) -> bool:
    """Whether containers nest deeper than MAX_DEPTH, walking containers only, iteratively."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        items = container.values() if isinstance(container, dict) else container
        stack.extend((item, depth + 1) for item in items if isinstance(item, (dict, list)))
    return False


def parse_json_body(raw: bytes) -> Any:
    """Parse a request body; raise `JsonBodyError` for anything the server should refuse."""
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JsonBodyError(f"request body is not valid UTF-8 (byte offset {e.start})") from None
    if not text.strip():
        raise JsonBodyError("request body is empty; expected a JSON object")
    try:
        value = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
            parse_int=_parse_int,
            object_pairs_hook=_object_without_duplicates,
        )
    except JsonBodyError:
        raise
    except RecursionError:
        raise JsonBodyError(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as e:
        raise JsonBodyError(f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # int conversion limits and similar
        raise JsonBodyError(f"invalid JSON: {e}") from None
    # Each check below walks the parsed value in Python, holding the interpreter lock (a hostile
    # body of 10,000 objects took tens of milliseconds of it), so it runs only where it can find
    # something: text decoded from UTF-8 holds no surrogates unless a \uD800-\uDFFF escape made
    # one, and text of at most MAX_DEPTH brackets nests no deeper.
    if _SURROGATE_ESCAPE.search(text):
        return _sanitize(value)
    if isinstance(value, (dict, list)) and text.count("{") + text.count("[") > MAX_DEPTH \
            and _deepest_beyond_limit(value):
        raise JsonBodyError(f"JSON nested deeper than {MAX_DEPTH} levels")
    return value
