"""One-line texts for HTTP failures of the clients that talk to servers (backends, the probe). Pure.

`reason(e)`: an httpx error in a few words ("connection refused" for a refused connection);
`error_message(body)`: an error reply's `error.message` (OpenAI's shape), else its text, on one
line and cut short. They do not decide what a failure means; their callers do.
"""

from __future__ import annotations

import json

import httpx


def reason(e: httpx.HTTPError) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, httpx.ConnectError) and "refused" in text.lower():
        return "connection refused"
    return " ".join(text.split())[:200]


def error_message(text: str) -> str:
    text = " ".join(text.split())
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            if isinstance(err, dict) and "message" in err:
                return str(err["message"])[:300]
    except json.JSONDecodeError:
        pass
    return text[:300]
