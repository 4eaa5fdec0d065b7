"""Terminal cell arithmetic for the terminal UI: sanitise text, measure it, clip it, wrap it.

Contract
- `sanitize(text)` makes arbitrary model output safe to place on a terminal grid: NFC-normalised,
  tabs expanded to spaces, control characters shown as `?`, zero-width characters (combining
  marks that did not compose, joiners, variation selectors) dropped. Every character left
  occupies exactly one or two cells (`char_width`), so the layout code can count cells exactly.
- `width`, `clip(text, n)` (truncate with an ellipsis and pad to exactly n cells; a wide
  character never straddles the edge) and `wrap_spans(spans, n)` (word-wrap styled runs into
  lines of at most n cells) work on sanitised text.
- `ascii_only(text)` replaces everything outside ASCII, for terminals whose locale is not UTF-8.
It does not draw anything or know about curses; widths come from `wcwidth`, the same tables the
common terminal emulators use.
"""

from __future__ import annotations

import unicodedata
from typing import Iterable, Sequence

from wcwidth import wcwidth

TAB = "    "
ELLIPSIS = "…"


def char_width(ch: str) -> int:
    """Cells of one sanitised character: 1 or 2."""
    if " " <= ch < "\x7f":
        return 1
    return 2 if wcwidth(ch) == 2 else 1


def sanitize(text: str) -> str:
    if text.isascii() and text.isprintable():
        return text
    out: list[str] = []
    for ch in unicodedata.normalize("NFC", text):
        if ch == "\t":
            out.append(TAB)
        elif ch == "\n":
            out.append(ch)
        elif " " <= ch < "\x7f":
            out.append(ch)
        else:
            w = wcwidth(ch)
            if w > 0:
                out.append(ch)
            elif w < 0 or unicodedata.category(ch) in ("Cc", "Cs", "Co", "Cn"):
                out.append("?")
            # w == 0: combining marks, joiners and selectors have no cell of their own.
    return "".join(out)


def ascii_only(text: str) -> str:
    return text if text.isascii() else "".join(ch if ch.isascii() else "?" * char_width(ch) for ch in text)


def width(text: str) -> int:
    if text.isascii():
        return len(text)
    return sum(char_width(ch) for ch in text)


def clip(text: str, n: int, *, ellipsis: bool = True, pad: bool = True) -> str:
    """`text` cut to at most `n` cells (ending in an ellipsis when cut), padded to `n`."""
    if n <= 0:
        return ""
    w = width(text)
    if w <= n:
        return text + " " * (n - w) if pad else text
    room = n - 1 if ellipsis else n
    out, used = [], 0
    for ch in text:
        cw = char_width(ch)
        if used + cw > room:
            break
        out.append(ch)
        used += cw
    if ellipsis:
        out.append(ELLIPSIS)
        used += 1
    if pad and used < n:
        out.append(" " * (n - used))
    return "".join(out)


Span = tuple[str, str]  # (text, style name)


def wrap_spans(spans: Iterable[Span], n: int) -> list[list[Span]]:
    """Word-wrap styled runs into lines of at most `n` cells; newlines end lines.

    A word longer than the line is broken at the cell boundary. Trailing spaces at a break are
    dropped, so a wrapped line never starts with the space that caused the break.
    """
    n = max(1, n)
    lines: list[list[Span]] = [[]]
    used = 0
    for text, style in spans:
        for part_no, part in enumerate(text.split("\n")):
            if part_no:
                lines.append([])
                used = 0
            for word in _words(part):
                ww = width(word)
                if word == " " * len(word):
                    if used + ww > n:
                        lines.append([])
                        used = 0
                        continue
                    _append(lines[-1], word, style)
                    used += ww
                    continue
                if used + ww > n and used > 0:
                    _rstrip_line(lines[-1])
                    lines.append([])
                    used = 0
                while ww > n - used:
                    head, rest = _split_cells(word, n - used)
                    if not head and used == 0:
                        # A wide character on a one-cell line: show a placeholder, never overflow.
                        head, rest = "?", word[1:]
                    elif not head:  # a wide character does not fit the last cell
                        lines.append([])
                        used = 0
                        continue
                    _append(lines[-1], head, style)
                    used += width(head)
                    word, ww = rest, width(rest)
                    if word:
                        lines.append([])
                        used = 0
                if word:
                    _append(lines[-1], word, style)
                    used += ww
    return lines


def _words(text: str) -> list[str]:
    """Alternating runs of spaces and non-spaces."""
    out: list[str] = []
    start = 0
    for i in range(1, len(text) + 1):
        if i == len(text) or (text[i] == " ") != (text[i - 1] == " "):
            out.append(text[start:i])
            start = i
    return out


def _split_cells(word: str, n: int) -> tuple[str, str]:
    used = 0
    for i, ch in enumerate(word):
        cw = char_width(ch)
        if used + cw > n:
            return word[:i], word[i:]
        used += cw
    return word, ""


def _append(line: list[Span], text: str, style: str) -> None:
    if line and line[-1][1] == style:
        line[-1] = (line[-1][0] + text, style)
    else:
        line.append((text, style))


def _rstrip_line(line: list[Span]) -> None:
    while line:
        text, style = line[-1]
        stripped = text.rstrip(" ")
        if stripped:
            line[-1] = (stripped, style)
            return
        line.pop()


def spans_width(spans: Sequence[Span]) -> int:
    return sum(width(t) for t, _ in spans)
