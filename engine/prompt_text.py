"""Prompt text: rendered chat text in which the text that came from messages cannot forge control tokens.

A chat template writes its own markers (`<|im_start|>`, `<|im_end|>` ...) around message
contents. Both end up in one string, and tokenizing that string with special-token parsing
would turn a `<|im_start|>` that a user typed into the control token: a forged turn. Prompt
text keeps the difference in the string itself, with one escape character, `MARK` (U+E000,
private use):

    MARK MARK        the character MARK itself, as text
    MARK <control>   the control token's spelling, as text (e.g. MARK "<|im_start|>")
    <control>        the control token itself (only the template writes these unescaped)
    anything else    text

`PromptText(controls)` holds the rules for one vocabulary's control spellings:
`escape(text)` turns plain text (a message's content, a tool description) into prompt text
that tokenizes as exactly that text; a template renders escaped messages into prompt text,
since it only copies, slices and joins their strings. `split(text)` cuts prompt text into
literal text and control tokens, which is what a tokenizer needs; `escape_tokens(pieces)`
is the other direction (decoded pieces in order -> prompt text), and `unescape(text)` the
characters the model reads. `escape_strings(obj, escape)` escapes every string inside
nested lists and dicts (messages, tool schemas); `from_rendered(text)` is the prompt text of
a caller's own rendering, whose control spellings are all meant as control tokens.

The same string always tokenizes the same way, so a cache keyed by prompt text cannot hand
out the KV state of a prompt that spells the same characters but tokenizes differently.

Text that contains no MARK and no control-token spelling is its own prompt text: ordinary
prompts, and every rendered prompt before this escaping existed, are unchanged.

`ascii_json(text)` is what `json.dumps(..., ensure_ascii=True)` writes, applied to the
prompt text that `ensure_ascii=False` wrote: every character beyond ASCII as `\\uXXXX`, except
that an escape of an ASCII control spelling keeps its MARK (the spelling stays text). A
literal MARK (MARK MARK) and a lone MARK come out as `\\ue000`, as json writes the character;
an escaped control spelling that is not ASCII needs no MARK once its characters are
`\\u`-escaped, since it no longer spells the token. The chat template's `tojson` filter uses it
for `ensure_ascii=True`, so re-encoding message strings keeps them text.

Limits: a template that re-encodes message strings in any other way (its own `\\u`
escaping, `urlencode`, slicing between MARK and what it protects) loses the escape for those
strings. Pure functions; no I/O, no vocabulary of its own (the caller passes the
control-token spellings).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator

MARK = "\ue000"


def spellings_pattern(texts: Iterable[str]) -> str:
    """Regular-expression source matching any of `texts` (empty ones ignored), at a position
    the longest that starts there: what the alternation of all of them, longest first, matches.

    Written as a trie (`<unused(?:1(?:2)?|3)>`-like): a vocabulary of thousands of control
    spellings (Gemma's 6,414) then costs a few steps per character where the flat alternation
    tries every spelling at every position (about 170x slower on a chat prompt).  Where the
    trie nests too deeply for the regex compiler (long spellings prefixing each other), the
    flat alternation is returned instead."""
    spellings = sorted({t for t in texts if t}, key=lambda s: (-len(s), s))
    root: dict = {}
    for text in spellings:
        node = root
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = None  # a spelling ends here ("" is no character, so no child's key)
    done: dict[int, str] = {}
    stack: list[tuple[dict, bool]] = [(root, False)]
    while stack:  # post-order without recursion: spellings may be long
        node, ready = stack.pop()
        kids = sorted((ch, child) for ch, child in node.items() if ch)
        if not ready:
            stack.append((node, True))
            stack.extend((child, False) for _, child in kids)
            continue
        branches = [re.escape(ch) + done.pop(id(child)) for ch, child in kids]
        body = "" if not branches else branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        done[id(node)] = f"(?:{body})?" if body and "" in node else body
    pattern = done[id(root)]
    try:
        re.compile(pattern)
    except (RecursionError, re.error, OverflowError):
        return "|".join(map(re.escape, spellings))
    return pattern


class PromptText:
    """The prompt-text rules for one vocabulary's control-token spellings."""

    def __init__(self, controls: Iterable[str]) -> None:
        self.controls: frozenset[str] = frozenset(t for t in controls if t)
        spelled = spellings_pattern(self.controls)
        # What escaping marks: MARK itself and every control spelling.
        self._to_escape = re.compile("|".join(filter(None, [re.escape(MARK), spelled and f"(?:{spelled})"])))
        # What splitting recognises: an escape (MARK and what it protects, or a lone MARK)
        # or an unescaped control token.
        protected = "|".join(filter(None, [re.escape(MARK), spelled]))
        self._token = re.compile(re.escape(MARK) + f"(?:{protected})?" + (f"|(?:{spelled})" if spelled else ""))

    def escape(self, text: str) -> str:
        """Prompt text that stands for `text` as text: MARK before every MARK and control spelling."""
        return self._to_escape.sub(lambda m: MARK + m.group(), text) if text else text

    def split(self, text: str) -> Iterator[tuple[str, bool]]:
        """(piece, is_control) pairs: literal text runs (escapes resolved, adjacent text joined)
        and control tokens, in order. A MARK followed by neither MARK nor a control spelling
        is kept as text."""
        literal: list[str] = []
        pos = 0
        for m in self._token.finditer(text):
            if m.start() > pos:
                literal.append(text[pos:m.start()])
            token = m.group()
            if token.startswith(MARK):
                literal.append(token[1:] if len(token) > 1 else MARK)
            else:
                if literal:
                    yield "".join(literal), False
                    literal = []
                yield token, True
            pos = m.end()
        if pos < len(text):
            literal.append(text[pos:])
        if literal:
            yield "".join(literal), False

    def ascii_json(self, text: str) -> str:
        """`text` (prompt text, e.g. JSON written with ensure_ascii=False) with every character beyond
        ASCII written as json's ensure_ascii writes it, keeping the escapes that still matter
        (see the module docstring)."""
        out: list[str] = []
        pos = 0
        for m in self._token.finditer(text):
            out.append(_ascii(text[pos:m.start()]))
            token = m.group()
            if token in (MARK, MARK + MARK):
                out.append("\\ue000")  # the character MARK, as text: what json writes for it
            elif token.startswith(MARK) and not _NOT_ASCII.search(token[1:]):
                out.append(token)  # an escaped ASCII control spelling: the MARK keeps it text
            else:
                # A control token, or an escaped spelling that \\u-escaping already keeps from
                # spelling its token.
                out.append(_ascii(token.removeprefix(MARK)))
            pos = m.end()
        out.append(_ascii(text[pos:]))
        return "".join(out)

    def unescape(self, text: str) -> str:
        """The characters the model reads for a prompt text (escapes removed)."""
        return "".join(piece for piece, _ in self.split(text))

    def escape_tokens(self, pieces: Iterable[tuple[str, bool]]) -> str:
        """Prompt text for decoded pieces (text, is_control): control tokens as themselves, text
        escaped. Adjacent text pieces are joined before escaping, so that a control spelling
        that several text tokens spell out is escaped too."""
        out: list[str] = []
        run: list[str] = []
        for piece, is_control in pieces:
            if is_control:
                if run:
                    out.append(self.escape("".join(run)))
                    run = []
                out.append(piece)
            else:
                run.append(piece)
        if run:
            out.append(self.escape("".join(run)))
        return "".join(out)


_NOT_ASCII = re.compile("[^\x00-\x7e]")


def _json_u(m: re.Match[str]) -> str:
    n = ord(m.group())
    if n < 0x10000:
        return f"\\u{n:04x}"
    n -= 0x10000  # a UTF-16 surrogate pair, as json writes characters beyond the BMP
    return f"\\u{0xd800 | (n >> 10):04x}\\u{0xdc00 | (n & 0x3ff):04x}"


def _ascii(text: str) -> str:
    """What json's ensure_ascii does to the characters of an already encoded JSON text: DEL and
    everything beyond ASCII as `\\uXXXX`."""
    return _NOT_ASCII.sub(_json_u, text)


def from_rendered(text: str) -> str:
    """Prompt text for text the caller rendered itself (a raw completion prompt): every control
    spelling in it is meant as the control token, so only MARK needs escaping."""
    return text.replace(MARK, MARK + MARK)


def escape_strings(obj: Any, esc: Callable[[str], str]) -> Any:
    """A copy of `obj` with `esc` applied to every string inside lists, tuples and dict values
    (keys too: templates print them, e.g. the property names of a tool schema)."""
    if isinstance(obj, str):
        return esc(obj)
    if isinstance(obj, dict):
        return {esc(k) if isinstance(k, str) else k: escape_strings(v, esc) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(escape_strings(v, esc) for v in obj)
    return obj
