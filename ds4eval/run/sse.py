"""Decode the `data:` lines of an OpenAI-style server-sent-event stream (pure, no I/O).

`decode_data_line(line)` returns None for lines that carry no data (blank lines, `:`
comments, `event:` names), `DONE` for the `[DONE]` terminator, or the event's JSON object;
broken JSON, a payload that is not an object, or an object with an `error` member raise
`StreamFault` with a one-line reason.  Clients that also care about `event:` names (an
`event: error` line) look at those lines themselves before calling this.
It does not judge whether a stream is complete; each client has its own rules for that.
"""
from __future__ import annotations

import json
from typing import Any


class StreamFault(ValueError):
    """A data line that a well-formed stream never contains."""


DONE = "[DONE]"


def decode_data_line(line: str) -> dict[str, Any] | str | None:
    line = line.rstrip("\r")
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        raise StreamFault(f"broken JSON in the stream: {data[:80]!r}") from None
    if not isinstance(obj, dict):
        raise StreamFault(f"a stream chunk is not a JSON object: {data[:80]!r}")
    if obj.get("error") is not None:
        err = obj["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        raise StreamFault(f"error in the stream: {str(msg)[:120]}")
    return obj
