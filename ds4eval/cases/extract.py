"""Answer extraction: model output text in, the answer the model committed to out.

Contract
- Pure functions, no I/O. Every extractor takes the raw model output, looks only at the
  visible answer (the text after the last `</think>`; nothing if a `<think>` block never
  closed) and returns the picked answer as a normalised string, or None.
- The answer line wins: the text after the last `Answer:` / `Final answer:` marker (rest of
  that line, or the next non-blank line when the marker ends its line). Only when there is
  no usable answer line do extractors fall back to the rest of the visible text.
- Each regression these rules guard is a row in `ds4eval.cases.selftest`.

It does not decide pass/fail (see `grade`), does not choose an extractor by answer kind (each
kind's record in `answerkinds` names its extractor) and knows nothing of cases or prompts.

Edge cases worth knowing:
- Choice letters collide with English: "I" and "A" are words, so "Answer: I think it is C"
  must pick C while "Answer: I." picks I. A letter followed by an apostrophe ("I'll") or
  "I"/"A" followed by a lower-case word that is not a copula ("A careful reading") is prose.
- A negated letter ("not B", "rules out C", "except D") is a distractor only when the
  negation sits right before it on the answer line; "Answer: D, not B" is D.
- Integers: "m+n = 256+37 = 293" shows working, so the integer after the last "=" is the
  answer; otherwise the first integer on the line ("Final answer: 082" is 82).
- Surface variants of real outputs are folded before extraction: full-width forms
  ("Answer：Ｃ", "４２", "（Ｃ）", "。") become their ASCII counterparts; markdown emphasis and
  code spans around an answer ("**C**", "*C*", "_C_", "__C__", "`C`", "_42_") are dropped,
  but an underscore inside a word ("snake_case") and a star between operands ("3*4") stay;
  markers match in any letter case; a lower-case option letter counts only when it is the
  whole answer ("Answer: (c)."), so "a" and "i" in a sentence stay prose; exact text drops
  trailing ".;:!?," (and their full-width forms).
"""

from __future__ import annotations

import re
from fractions import Fraction

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


# Full-width ASCII forms (U+FF01..U+FF5E), the ideographic space and full stop, as ASCII.
_FULL_WIDTH = {0xFF01 + i: 0x21 + i for i in range(0x5E)} | {0x3000: 0x20, 0x3002: 0x2E}


def fold_full_width(text: str) -> str:
    return text.translate(_FULL_WIDTH)


def visible_answer(output: str) -> str:
    """Text after the last `</think>` (full-width forms folded to ASCII); empty if thinking was
    opened and never closed."""
    i = output.rfind(THINK_CLOSE)
    if i >= 0:
        return fold_full_width(output[i + len(THINK_CLOSE):])
    if THINK_OPEN in output:
        return ""
    return fold_full_width(output)


_MARKER = re.compile(
    r"(?i)(?:\*\*|__)?\b(?:final\s+answer|answer)\b(?:\*\*|__)?\s*(?:is\s*)?[:：](?:\*\*|__)?[ \t]*")
# Weaker marker, used only when no "Answer:" line exists: small models often write
# "The answer is 12." instead of the requested format.
_PHRASE_MARKER = re.compile(r"(?i)\b(?:final\s+)?answer\s+(?:is|would\s+be|will\s+be)\b[ \t]*")


def answer_line(output: str) -> str | None:
    """Text after the last `Answer:` marker of the visible answer (else after the last
    "the answer is"), or None if there is neither."""
    text = visible_answer(output)
    for marker in (_MARKER, _PHRASE_MARKER):
        last = None
        for m in marker.finditer(text):
            last = m
        if last is None:
            continue
        rest = text[last.end():]
        first, _, after = rest.partition("\n")
        if first.strip(" \t*_"):
            return first.strip()
        for line in after.split("\n"):
            if line.strip(" \t*_"):
                return line.strip()
    return None


# ---------------------------------------------------------------- shared normalisation

_LATEX_WRAPPERS = re.compile(r"\\(?:boxed|fbox|text|textbf|mathrm|mathbf|operatorname)\s*\{")


def _unwrap_braced(s: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at s[start] == '{', and the index after it."""
    depth = 0
    for j in range(start, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return s[start + 1:j], j + 1
    return None


def strip_latex(s: str) -> str:
    """Remove wrappers (\\boxed{}, \\text{}, $...$, \\( \\), markdown emphasis) keeping content."""
    out = s
    while True:
        m = _LATEX_WRAPPERS.search(out)
        if not m:
            break
        got = _unwrap_braced(out, m.end() - 1)
        if got is None:
            out = out[:m.start()] + out[m.end():]
            continue
        inner, end = got
        out = out[:m.start()] + inner + out[end:]
    out = out.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    out = re.sub(r"\\[()\[\]]", "", out)
    out = out.replace("$", "").replace("**", "").replace("__", "").replace("`", "")
    return strip_emphasis(out)


# A single * or _ that opens or closes emphasis: next to a non-word character or an end on one
# side. Between two word characters ("snake_case", "3*4") it is part of the text.
_EMPHASIS = re.compile(r"(?<![\w*])[*_]+(?=[^\s*_])|(?<=[^\s*_])[*_]+(?![\w*])")


def strip_emphasis(s: str) -> str:
    """Drop markdown emphasis and code-span marks around words, keeping the words."""
    return _EMPHASIS.sub("", s.replace("**", "").replace("__", "").replace("`", ""))


def boxed_content(text: str) -> str | None:
    """Content of the last \\boxed{...} in text, or None."""
    last = None
    for m in re.finditer(r"\\boxed\s*\{", text):
        got = _unwrap_braced(text, m.end() - 1)
        if got is not None:
            last = got[0]
    return last


_QUOTES = "\"'“”‘’«»"


def normalize_text(s: str) -> str:
    """Case-folded text with wrappers, quotes around it, all whitespace and trailing
    punctuation removed."""
    s = strip_latex(s)
    s = re.sub(r"\s+", "", s).lower()
    prev = None
    while prev != s:
        prev = s
        s = s.rstrip(".;:!?,").strip(_QUOTES)
    return s


# ---------------------------------------------------------------- choice

_PROSE_AFTER = {"is", "was", "seems", "appears", "looks", "and", "or", "because", "since"}
_NEGATION = re.compile(
    r"(?i)(?:\bnot|n't|\bno|\brules?\s+out|\bruled\s+out|\bruling\s+out|\beliminat\w*|\breject\w*"
    r"|\bexcept(?:\s+for)?|\bexcluding|\bexclude[sd]?)"
    r"\s+(?:(?:option|choice|answer|letter|the)\s+)*[(\[*]*$")


def _choice_candidates(line: str, nchoices: int) -> list[str]:
    """Letters on `line` that stand for an option, skipping prose words and negated letters."""
    last = chr(64 + max(1, min(nchoices, 26)))
    picked = []
    for m in re.finditer(r"(?<![A-Za-z0-9_\\'’])([A-Z])(?![A-Za-z0-9_])", line):
        letter = m.group(1)
        if letter > last:
            continue
        after = line[m.end():]
        if after[:1] in ("'", "’"):
            continue  # I'll, I'm, A's: a contraction, not an option
        if letter in ("A", "I"):
            w = re.match(r"[ \t]+([a-z][a-z'’]*)", after)
            if w and w.group(1) not in _PROSE_AFTER:
                continue  # "I think ...", "A careful reading ..."
        if _NEGATION.search(line[:m.start()]):
            continue
        picked.append(letter)
    return picked


_CHOICE_FALLBACK = re.compile(
    r"(?i)\b(?:answer|option|choice)\s+(?:is\s+|would\s+be\s+|must\s+be\s+)?[(\[*]*([A-Z])(?![A-Za-z0-9_])")


# The whole answer is one lower-case letter, wrapped or punctuated at most: "c", "(c).", "c)".
_LONE_LOWER = re.compile(r"[\s(\[]*([a-z])[\s)\].:;!,]*")


def extract_choice(output: str, nchoices: int) -> str | None:
    """Option letter the answer commits to (see module docstring for the prose/negation rules)."""
    line = answer_line(output)
    if line is not None:
        line = strip_emphasis(line)
        got = _choice_candidates(line, nchoices)
        if got:
            return got[0]
        lone = _LONE_LOWER.fullmatch(line)
        if lone and lone.group(1).upper() <= chr(64 + max(1, min(nchoices, 26))):
            return lone.group(1).upper()
    text = visible_answer(output)
    boxed = boxed_content(text)
    if boxed is not None:
        got = _choice_candidates(strip_latex(boxed), nchoices)
        if got:
            return got[0]
    last_letter = chr(64 + max(1, min(nchoices, 26)))
    found = [m.group(1).upper() for m in _CHOICE_FALLBACK.finditer(text)]
    found = [f for f in found if f <= last_letter]
    if found:
        return found[-1]
    # A bare reply such as "C", "(C)." or one option echoed as "C. text" is an answer even
    # without a marker; a reply listing several options is not.
    bare = re.fullmatch(r"[\s(\[*]*([A-Z])[\s)\].*]*", text) or \
        re.fullmatch(r"\s*[(\[*]*([A-Z])[).:\]]\s[^\n]*\s*", text)
    if bare and bare.group(1) <= last_letter:
        return bare.group(1)
    return None


# ---------------------------------------------------------------- numbers

_INT = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?!\.\d)(?![\w])")
_NUMBER_TOKEN = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")


def _int_value(tok: str) -> str:
    return str(int(tok.replace(",", "")))


def _after_last_equals(line: str) -> str:
    return line.rsplit("=", 1)[1] if "=" in line else line


def extract_integer(output: str) -> str | None:
    """Integer answer: answer line (after the last '=' if it shows working), else last integer."""
    line = answer_line(output)
    if line is not None:
        seg = strip_latex(_after_last_equals(strip_latex(line)))
        m = _INT.search(seg)
        if m:
            return _int_value(m.group(0))
    text = strip_latex(visible_answer(output))
    found = _INT.findall(text)
    return _int_value(found[-1]) if found else None


_FRAC = re.compile(r"\\d?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(-?\d+)\s*\}")
_RATIONAL = re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)(?:\s*/\s*(-?\d+(?:\.\d+)?))?(?![\w])")


def parse_rational(s: str) -> Fraction | None:
    """Fraction from '25/2', '12.5', '\\frac{25}{2}', '-3' (first one found), else None."""
    s = s.replace(",", "") if re.fullmatch(r"\s*-?\d{1,3}(,\d{3})+\s*", s) else s
    m = _FRAC.search(s)
    if m:
        num, den = int(m.group(1)), int(m.group(2))
        return Fraction(num, den) if den else None
    m = _RATIONAL.search(strip_latex(s))
    if not m:
        return None
    num = Fraction(m.group(1))
    if m.group(2) is None:
        return num
    den = Fraction(m.group(2))
    return num / den if den else None


def format_rational(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


def extract_rational(output: str) -> str | None:
    """Rational answer as 'p/q' (or an integer), from the answer line then the visible text."""
    line = answer_line(output)
    if line is not None:
        q = parse_rational(_after_last_equals(line))
        if q is not None:
            return format_rational(q)
    text = visible_answer(output)
    boxed = boxed_content(text)
    if boxed is not None:
        q = parse_rational(boxed)
        if q is not None:
            return format_rational(q)
    last = None
    for m in list(_FRAC.finditer(text)) + list(_RATIONAL.finditer(text)):
        if last is None or m.start() > last.start():
            last = m
    if last is None:
        return None
    q = parse_rational(last.group(0))
    return format_rational(q) if q is not None else None


# ---------------------------------------------------------------- text and sequences

_COPULA = re.compile(r"(?i)\s(?:is|are|was|were)\s+")


def _answer_span(output: str) -> str | None:
    """The answer line; failing that the last \\boxed{} of the visible text; failing that the
    last line of the visible text, cut after its last "is"/"are" when it has one (replies such
    as 'The plural of "cat" is "cats".')."""
    line = answer_line(output)
    if line is not None:
        boxed = boxed_content(line)
        return boxed if boxed is not None else line
    text = visible_answer(output)
    boxed = boxed_content(text)
    if boxed is not None:
        return boxed
    lines = [ln for ln in text.split("\n") if ln.strip()]
    if not lines:
        return None
    last = lines[-1]
    cut = None
    for m in _COPULA.finditer(last):
        cut = m
    return last[cut.end():] if cut else last


def extract_exact_text(output: str) -> str | None:
    """Normalised answer text (see `normalize_text`)."""
    span = _answer_span(output)
    if span is None:
        return None
    norm = normalize_text(span)
    return norm or None


def split_sequence(s: str) -> list[str]:
    """Top-level elements of a sequence: commas, semicolons and 'and' outside brackets separate;
    each element is normalised like exact text, so '(1, 8, 19)' becomes '(1,8,19)'."""
    s = strip_latex(s).strip().rstrip(".")
    if len(s) >= 2 and s[0] in "[{" and s[-1] in "]}":
        s = s[1:-1]
    parts, depth, cur = [], 0, []
    i = 0
    while i < len(s):
        ch = s[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if depth == 0 and ch in ",;":
            parts.append("".join(cur))
            cur = []
        elif depth == 0 and re.match(r"\s+and\s+", s[i:]) and not cur == []:
            m = re.match(r"\s+and\s+", s[i:])
            parts.append("".join(cur))
            cur = []
            i += m.end()
            continue
        else:
            cur.append(ch)
        i += 1
    parts.append("".join(cur))
    # "2, 4, and 6": the serial comma leaves "and" at the start of the last element.
    out = [normalize_text(re.sub(r"(?i)^\s*(?:and|or)\s+", "", p)) for p in parts]
    return [p for p in out if p]


def extract_ordered_sequence(output: str) -> str | None:
    """Sequence elements joined by ', ' (order kept)."""
    span = _answer_span(output)
    if span is None:
        return None
    items = split_sequence(span)
    return ", ".join(items) if items else None


_LINE_SPEC = re.compile(
    r"(?<![\w.])\d+(?:\s*[-–]\s*\d+)?(?:\s*(?:,|&|\band\b|\bor\b)\s*(?:lines?\s+)?\d+(?:\s*[-–]\s*\d+)?)*(?!\w|\.\d)")


def parse_line_spec(spec: str) -> frozenset[int]:
    """'3,13-15' -> {3, 13, 14, 15}; raise ValueError on a malformed or reversed range."""
    out: set[int] = set()
    for part in re.split(r"\s*(?:,|&|\band\b|\bor\b)\s*(?:lines?\s+)?", spec.strip()):
        if not part:
            raise ValueError("empty element")
        m = re.fullmatch(r"(\d+)(?:\s*[-–]\s*(\d+))?", part)
        if not m:
            raise ValueError(f"bad element {part!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo:
            raise ValueError(f"reversed range {part!r}")
        if hi - lo > 10000:
            raise ValueError(f"range too large {part!r}")
        out.update(range(lo, hi + 1))
    return frozenset(out)


def format_line_set(lines: frozenset[int]) -> str:
    return ",".join(str(n) for n in sorted(lines))


def extract_line_set(output: str) -> str | None:
    """Line numbers named by the answer: the first line spec on the answer line, else the last
    'line N' mention, else the last line spec in the visible text. '0' means 'safe'."""
    line = answer_line(output)
    candidates = []
    if line is not None:
        m = _LINE_SPEC.search(strip_latex(line))
        if m:
            candidates.append(m.group(0))
    if not candidates:
        text = strip_latex(visible_answer(output))
        named = list(re.finditer(r"(?i)\blines?\s+(" + _LINE_SPEC.pattern + ")", text))
        if named:
            candidates.append(named[-1].group(1))
        else:
            specs = _LINE_SPEC.findall(text)
            if specs:
                candidates.append(specs[-1])
    for spec in candidates:
        try:
            return format_line_set(parse_line_spec(spec))
        except ValueError:
            continue
    return None

