"""Stop-sequence matching over streamed text.

`StopMatcher` receives generated text piece by piece and returns the part that is safe to
show: text that cannot be the start of a stop sequence is released at once, a suffix that
could still grow into one is held back until the next piece decides. When a stop
sequence is found, everything before it is released and the sequence itself is dropped
(as the OpenAI and Anthropic APIs do).

Pure: no I/O, no tokens, no knowledge of the engine.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Add generated text; return what can be released now. After a match, returns ''."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        return self._settle(self._held + text, final=False)

    def flush(self) -> str:
        """End of generation: a pending match is decided, other held text is released."""
        if self.matched is not None or not self._held:
            self._held = ""
            return ""
        return self._settle(self._held, final=True)

    def _settle(self, buf: str, final: bool) -> str:
        at, stop = self._first_match(buf)
        # Text from `pending` on could still become a stop that starts earlier than the
        # match found so far; deciding now would make the result depend on chunking.
        pending = None if final else self._pending_start(buf, at if stop is not None else len(buf))
        if stop is not None and pending is None:
            self.matched, self._held = stop, ""
            return buf[:at]
        cut = len(buf) if pending is None else pending
        self._held = buf[cut:]
        return buf[:cut]

    def _first_match(self, buf: str) -> tuple[int, str | None]:
        """Earliest complete stop in `buf`; at equal starts the shortest (it completes first)."""
        best_at, best = len(buf), None
        for stop in self.stops:
            at = buf.find(stop)
            if at != -1 and (at < best_at or (at == best_at and best is not None and len(stop) < len(best))):
                best_at, best = at, stop
        return best_at, best

    def _pending_start(self, buf: str, before: int) -> int | None:
        """First position < `before` where the rest of `buf` is a proper prefix of a stop."""
        for q in range(max(0, len(buf) - self._longest + 1), before):
            tail = buf[q:]
            if any(len(tail) < len(stop) and stop.startswith(tail) for stop in self.stops):
                return q
        return None
