"""Exact replay memory: the text the model sampled, remembered under the ids of the calls it made.

When a client sends the conversation back, its assistant turn carries only structured calls; re-rendering them
canonically may differ from what the model wrote (key order, spacing, thinking), and every differing byte misses
the KV cache. The server remembers the exact generated text of each turn under each of its call ids and the
renderer (`server.tools.render`) uses it when every call of a turn is found and still means the same calls.

Bounded by a number of ids and a total size (UTF-8 bytes of the distinct texts); the oldest ids go first. A turn's
text is stored once however many calls share it. Counters say how often calls were replayed from memory,
re-rendered canonically (memory disabled, or the client changed the calls), or missing (id unknown or evicted).
Thread safety: none; the server calls it from its request path under its own lock or from one thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

DEFAULT_MAX_IDS = 100_000
DEFAULT_MAX_BYTES = 512 * 1024 * 1024


@dataclass
class _Turn:
    text: str
    nbytes: int
    refs: int = 0


class ReplayMemory:
    def __init__(self, max_ids: int = DEFAULT_MAX_IDS, max_bytes: int = DEFAULT_MAX_BYTES, enabled: bool = True):
        if max_ids < 0 or max_bytes < 0:
            raise ValueError("replay memory bounds must be >= 0")
        self.max_ids, self.max_bytes, self.enabled = max_ids, max_bytes, enabled
        self._ids: "OrderedDict[str, _Turn]" = OrderedDict()
        self._bytes = 0
        self.replayed = 0
        self.rerendered = 0
        self.missing = 0

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def remember(self, call_ids: Iterable[str], text: str) -> None:
        """Remember `text` (a whole generated turn) under each of `call_ids`. A text larger than the byte bound is
        not stored."""
        ids = list(dict.fromkeys(call_ids))
        if not self.enabled or not ids:
            return
        turn = _Turn(text, len(text.encode("utf-8", "surrogatepass")))
        if turn.nbytes > self.max_bytes:
            return
        for cid in ids:
            self._drop(cid)
            self._ids[cid] = turn
            turn.refs += 1
        self._bytes += turn.nbytes
        while self._ids and (len(self._ids) > self.max_ids or self._bytes > self.max_bytes):
            self._drop(next(iter(self._ids)))

    def lookup(self, call_id: str) -> Optional[str]:
        turn = self._ids.get(call_id) if self.enabled else None
        return turn.text if turn else None

    def stats(self) -> dict:
        return {"ids": len(self._ids), "bytes": self._bytes, "replayed": self.replayed,
                "rerendered": self.rerendered, "missing": self.missing}

    def _drop(self, call_id: str) -> None:
        turn = self._ids.pop(call_id, None)
        if turn is not None:
            turn.refs -= 1
            if turn.refs == 0:
                self._bytes -= turn.nbytes
