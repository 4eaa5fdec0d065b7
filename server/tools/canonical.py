"""Canonical JSON and delimiter escaping: the byte-level rules every syntax shares.

canonical_json: keys in insertion order, ", " and ": " separators, characters written as themselves (not \\u escapes);
JSON still escapes control characters, so a string holding U+0000 renders as the six characters \\u0000 and parses
back to the same string. Semantically equal objects with equal key order therefore give byte-identical text.

Delimiter escaping: a payload (a parameter value, a tool result) escapes only the closing delimiter that would end
it early. "</parameter>" becomes "<\\/parameter>", and any run of backslashes already in that position gains one more,
so the mapping is reversible: every other "<", ">", "&" and backslash stays literal and code round-trips unchanged.
This module does not decide which delimiters a syntax uses.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any, Iterable

_ID_ALPHABET = string.ascii_letters + string.digits


def canonical_json(value: Any) -> str:
    """Render `value` as canonical JSON (see module docstring). Raises ValueError for NaN/Infinity."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)


def new_call_id(prefix: str = "call_", length: int = 24) -> str:
    """A fresh call id from the OS CSPRNG: `prefix` followed by `length` base-62 characters."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


class DelimiterEscaper:
    """Reversible escaping of a set of closing delimiters that all start with "</".

    Each delimiter "</rest" in the payload is written "<\\/rest"; "<" + k backslashes + "/rest" becomes "<" + (k+1)
    backslashes + "/rest". Unescaping removes one backslash from any such run of at least one."""

    def __init__(self, delimiters: Iterable[str]):
        rests = sorted({d[2:] for d in delimiters}, key=len, reverse=True)
        for d in delimiters:
            if not d.startswith("</"):
                raise ValueError(f"delimiter must start with '</': {d!r}")
        alt = "|".join(re.escape(r) for r in rests)
        self._esc = re.compile(r"<(\\*)/(" + alt + ")")
        self._unesc = re.compile(r"<\\(\\*)/(" + alt + ")")

    def escape(self, text: str) -> str:
        return self._esc.sub(lambda m: "<\\" + m.group(1) + "/" + m.group(2), text)

    def unescape(self, text: str) -> str:
        return self._unesc.sub(lambda m: "<" + m.group(1) + "/" + m.group(2), text)
