"""Trace files: one text block per finished case, written during a run and read back to regrade.

Contract (the format is documented field by field in `traces/README.md`)
- `format_record(record) -> str` and `parse_trace(text) -> ParsedTrace` are pure and exact
  inverses: any prompt or output text (markers, `\\r`, missing final newline, Unicode line
  separators) round-trips unchanged.
- Marker lines start with `%%`. A text line that itself starts with `%%` is written with one
  extra `%` in front, and the reader removes it again (byte stuffing), so no text can end
  a block early.
- `TraceWriter` appends whole blocks under a lock and flushes each, so concurrent cases never
  interleave and a crash loses at most the block being written; the reader reports (and skips)
  a truncated final block instead of failing.
It does not grade (see `regrade`) and does not decide which cases to write.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass, field, fields

FORMAT_VERSION = 1
CASE_MARKER = "%%case"
BLOCK_MARKER = "%%block"
END_MARKER = "%%end"
BLOCKS = ("SYSTEM_PROMPT", "QUESTION_PROMPT", "MODEL_OUTPUT")


@dataclass
class TraceRecord:
    """Everything needed to regrade a case and to compare runs, without the model or the data."""

    index: int
    source: str
    id: str
    status: str | None = None
    picked: str | None = None
    expected: str = ""
    answer_kind: str = ""
    aliases: list[str] = field(default_factory=list)
    nchoices: int = 0
    domain: str = ""
    suite: str = ""
    model: str = ""
    backend: str = ""
    prompt_tokens: int = 0
    gen_tokens: int = 0
    elapsed_s: float = 0.0
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    thinking: bool = False
    think_close: str = "none"
    error: str = ""
    # Provenance (traces/README.md): empty, or 0, in traces written before it was recorded.
    case_hash: str = ""
    max_tokens: int = 0
    prompt_sha256: str = ""
    model_sha256: str = ""
    chat_template_sha256: str = ""
    bos_eos: str = ""
    device: str = ""
    kv_type: str = ""
    endpoint: str = ""
    served_model: str = ""
    extractor_version: str = ""
    ds4eval_version: str = ""
    git_commit: str = ""
    rendered_prompt: str = ""
    rendered_token_ends: str = ""
    system_prompt: str = ""
    question_prompt: str = ""
    model_output: str = ""


_BLOCK_FIELD = {"SYSTEM_PROMPT": "system_prompt", "QUESTION_PROMPT": "question_prompt",
                "MODEL_OUTPUT": "model_output"}
_HEADER_FIELDS = [f for f in fields(TraceRecord) if f.name not in _BLOCK_FIELD.values()]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


_ESCAPED = re.compile(r"\\(.)", re.DOTALL)
_UNESCAPED = {"n": "\n", "r": "\r", "\\": "\\"}


def _unescape(value: str) -> str:
    # A backslash takes the next character with it: \n, \r and \\ are decoded, any other pair
    # is kept as written, and a backslash at the very end stays.
    if "\\" not in value:
        return value
    return _ESCAPED.sub(lambda m: _UNESCAPED.get(m[1], m[0]), value)


def _header_value(rec: TraceRecord, name: str) -> str:
    v = getattr(rec, name)
    if v is None:
        return ""
    if name == "aliases":
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return repr(round(v, 6))
    return _escape(str(v))


def _stuff(text: str) -> str:
    # Lines are split on "\n" only, so "\r" and other separators stay inside a line untouched.
    return "\n".join("%" + line if line.startswith("%%") else line for line in text.split("\n"))


def format_record(rec: TraceRecord) -> str:
    """One complete block, ending with a newline."""
    out = [f"{CASE_MARKER} {rec.index} v{FORMAT_VERSION}"]
    for f in _HEADER_FIELDS:
        out.append(f"{f.name}: {_header_value(rec, f.name)}")
    for block in BLOCKS:
        text = getattr(rec, _BLOCK_FIELD[block])
        out.append(f"{BLOCK_MARKER} {block} chars={len(text)}")
        # The text is followed by one newline that is not part of it; `chars` lets the reader
        # check that it got back exactly what was written.
        out.append(_stuff(text))
    out.append(END_MARKER)
    return "\n".join(out) + "\n"


@dataclass
class ParsedTrace:
    records: list[TraceRecord]
    problems: list[str]


class TraceFormatError(ValueError):
    pass


def _json_list(raw: str) -> list:
    return json.loads(raw) if raw else []


def _int_or_zero(raw: str) -> int:
    return int(raw) if raw else 0


def _float_or_zero(raw: str) -> float:
    return float(raw) if raw else 0.0


# How each known header value is read back (escaped text unless listed); unknown keys are not here.
_READERS = {f.name: _unescape for f in _HEADER_FIELDS}
_READERS.update({
    "aliases": _json_list,
    "status": lambda raw: raw or None,
    "picked": lambda raw: _unescape(raw) if raw else None,
    "seed": lambda raw: int(raw) if raw else None,
    "thinking": lambda raw: raw == "yes",
    **dict.fromkeys(("index", "nchoices", "prompt_tokens", "gen_tokens", "max_tokens"), _int_or_zero),
    **dict.fromkeys(("elapsed_s", "temperature", "top_p", "min_p"), _float_or_zero),
})


def parse_trace(text: str) -> ParsedTrace:
    """All complete blocks of a trace; malformed or truncated blocks are reported and skipped."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    records, problems = [], []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith(CASE_MARKER + " "):
            if line.strip():
                problems.append(f"line {i + 1}: text outside a case block")
            i += 1
            continue
        start = i
        try:
            rec, i = _parse_block(lines, i)
            records.append(rec)
        except TraceFormatError as e:
            problems.append(f"line {start + 1}: {e}")
            i = start + 1
            while i < len(lines) and not lines[i].startswith(CASE_MARKER + " "):
                i += 1
    return ParsedTrace(records, problems)


def _parse_block(lines: list[str], i: int) -> tuple[TraceRecord, int]:
    head = lines[i].split()
    try:
        index = int(head[1])
    except (IndexError, ValueError):
        raise TraceFormatError("case marker without an index") from None
    rec_fields: dict = {"index": index, "source": "", "id": ""}
    i += 1
    n = len(lines)
    end = i
    while end < n and not lines[end].startswith("%%"):
        end += 1
    for line in lines[i:end]:
        key, sep, raw = line.partition(": ")
        if not sep:
            if not line.endswith(":"):
                raise TraceFormatError(f"bad header line {line!r}")
            key, raw = line[:-1], ""
        read = _READERS.get(key)
        if read is None:
            continue  # unknown keys come from newer writers; ignoring them keeps old readers useful
        try:
            rec_fields[key] = read(raw)
        except ValueError as e:
            raise TraceFormatError(f"bad value for {key}: {e}") from None
    i = end
    while i < len(lines) and lines[i].startswith(BLOCK_MARKER + " "):
        parts = lines[i].split()
        if len(parts) != 3 or parts[1] not in _BLOCK_FIELD or not parts[2].startswith("chars="):
            raise TraceFormatError(f"bad block marker {lines[i]!r}")
        want = int(parts[2][len("chars="):])
        i += 1
        # Fast path: the next `want` characters span whole lines, none of them stuffed, and a
        # marker follows. Otherwise read line by line up to the next marker.
        end, size = i, -1
        while size < want and end < n:
            size += len(lines[end]) + 1
            end += 1
        text = "\n".join(lines[i:end])
        if size == want and (end == n or (lines[end].startswith("%%") and not lines[end].startswith("%%%"))) \
                and not text.startswith("%%") and "\n%%" not in text:
            i = end
        else:
            end = i
            while end < n and not (lines[end].startswith("%%") and not lines[end].startswith("%%%")):
                end += 1
            text = "\n".join(line[1:] if line.startswith("%%%") else line for line in lines[i:end])
            i = end
        if len(text) != want:
            raise TraceFormatError(f"block {parts[1]} has {len(text)} chars, header says {want}")
        rec_fields[_BLOCK_FIELD[parts[1]]] = text
    if i >= len(lines) or lines[i] != END_MARKER:
        raise TraceFormatError("block not terminated (truncated trace?)")
    return TraceRecord(**rec_fields), i + 1


def read_trace(path: str | os.PathLike) -> ParsedTrace:
    with open(path, encoding="utf-8", newline="") as f:
        return parse_trace(f.read())


class TraceWriter:
    """Appends records to a trace file; safe to call from several threads."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        # newline="" keeps "\r" in model output from being rewritten by the platform.
        self._file = open(self.path, "a", encoding="utf-8", newline="")

    def write(self, rec: TraceRecord) -> None:
        block = format_record(rec)
        with self._lock:
            self._file.write(block)
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
