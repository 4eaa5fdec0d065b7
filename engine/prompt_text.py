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

Limits: a template that re-encodes message strings (say `tojson` with `ensure_ascii=True`,
which writes MARK as `\\ue000`) loses the escape for those strings. Pure functions; no I/O,
no vocabulary of its own (the caller passes the control-token spellings).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator

MARK = "\ue000"


class PromptText:
    """The prompt-text rules for one vocabulary's control-token spellings."""

    def __init__(self, controls: Iterable[str]) -> None:
        texts = sorted({t for t in controls if t}, key=lambda s: (-len(s), s))
        self.controls: frozenset[str] = frozenset(texts)
        spelled = "|".join(map(re.escape, texts))
        # What escaping marks: MARK itself and every control spelling.
        self._to_escape = re.compile("|".join(filter(None, [re.escape(MARK), spelled])))
        # What splitting recognises: an escape (MARK and what it protects, or a lone MARK)
        # or an unescaped control token.
        protected = "|".join(filter(None, [re.escape(MARK), spelled]))
        self._token = re.compile(re.escape(MARK) + f"(?:{protected})?" + (f"|{spelled}" if spelled else ""))

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
