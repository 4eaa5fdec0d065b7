"""Trace files: one text block per finished case, written during a run and read back to regrade.

Contract (the format is documented field by field in `traces/README.md`)
- `format_record(record) -> str` and `parse_trace(text) -> ParsedTrace` are pure and exact
  inverses: any prompt or output text (markers, `\\r`, missing final newline, Unicode line
  separators) round-trips unchanged.
- Marker lines start with `%%`. A text line that itself starts with `%%` is written with one
  extra `%` in front, and the reader removes it again (byte stuffing), so no text can end
  a block early.
- `TraceWriter` appends whole blocks under a lock and flushes each, so concurrent cases never
  interleave and a crash loses at most the block being written. Every block starts on a fresh
  line: a file whose last write was torn (it does not end in a newline) gets one before the
  first new block, with a warning, so the torn block stays one skipped block and the new
  ones stay readable.
- `format_run_header(header)` writes a `%%run` block listing every case a run selected (before
  its first case block), so that cases that never started can be retried; `ParsedTrace.runs`
  holds them back.
- `parse_trace_bytes(data)` decodes line by line: a line that is not valid UTF-8 (a write torn
  inside a character) spoils only its own block. Every skipped block is reported in
  `problems` with its line, its case (index, source/id when the header got that far) and why.
It does not grade (see `regrade`) and does not decide which cases to write.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field, fields
from typing import Callable

FORMAT_VERSION = 1
CASE_MARKER = "%%case"
RUN_MARKER = "%%run"
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


@dataclass(frozen=True)
class RunHeader:
    """The cases one run selected, in run order: (number, source, id)."""

    suite: str
    cases: tuple[tuple[int, str, str], ...]


def format_run_header(header: RunHeader) -> str:
    out = [f"{RUN_MARKER} v{FORMAT_VERSION}", f"suite: {_escape(header.suite)}"]
    out += [f"case: {json.dumps([n, src, cid], ensure_ascii=False)}" for n, src, cid in header.cases]
    out.append(END_MARKER)
    return "\n".join(out) + "\n"


@dataclass
class ParsedTrace:
    records: list[TraceRecord]
    problems: list[str]
    runs: list[RunHeader] = field(default_factory=list)


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


# A case marker glued to the end of a torn line (traces appended to before writers repaired
# torn tails): recognised only while resynchronising after a broken block.
_GLUED_CASE = re.compile(r"(%%case \d+ v\d+)$")


def parse_trace(text: str) -> ParsedTrace:
    """All complete blocks of a trace; malformed or truncated blocks are reported and skipped."""
    return _parse_lines(text.split("\n"), frozenset())


def parse_trace_bytes(data: bytes) -> ParsedTrace:
    """Like `parse_trace` on the file's bytes; lines that are not UTF-8 spoil only their block."""
    lines, bad = [], set()
    for n, raw in enumerate(data.split(b"\n")):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            lines.append(raw.decode("utf-8", errors="replace"))
            bad.add(n)
    return _parse_lines(lines, frozenset(bad))


def _describe(lines: list[str], start: int, end: int) -> str:
    """'case block N (source/id)' for the block at `start`, from whatever header lines survive."""
    head = lines[start].split()
    what = f"case block {head[1]}" if len(head) > 1 else "case block"
    found = {}
    for line in lines[start + 1:end]:
        key, sep, raw = line.partition(": ")
        if sep and key in ("source", "id"):
            found[key] = _unescape(raw)
        if line.startswith("%%"):
            break
    if "source" in found and "id" in found:
        what += f" ({found['source']}/{found['id']})"
    return what


def _parse_lines(lines: list[str], bad: frozenset[int]) -> ParsedTrace:
    if lines and lines[-1] == "":
        lines.pop()
    records, problems, runs = [], [], []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(RUN_MARKER + " "):
            start = i
            try:
                header, i = _parse_run(lines, i)
                runs.append(header)
            except TraceFormatError as e:
                problems.append(f"line {start + 1}: run header skipped: {e}")
                i = _resync(lines, start + 1)
            continue
        if not line.startswith(CASE_MARKER + " "):
            glued = _GLUED_CASE.search(line)
            if glued and glued.start() > 0:
                problems.append(f"line {i + 1}: a case marker follows torn text on the same line")
                lines[i] = glued.group(1)
                continue
            if line.strip():
                problems.append(f"line {i + 1}: text outside a case block")
            i += 1
            continue
        start = i
        try:
            rec, i = _parse_block(lines, i)
            torn = sorted(n for n in bad if start <= n < i)
            if torn:
                raise TraceFormatError(f"invalid UTF-8 on line {torn[0] + 1}")
            records.append(rec)
        except TraceFormatError as e:
            nxt = _resync(lines, start + 1)
            problems.append(f"line {start + 1}: {_describe(lines, start, nxt)} skipped: {e}")
            i = nxt
    return ParsedTrace(records, problems, runs)


def _resync(lines: list[str], i: int) -> int:
    """Index of the next line that starts a block (a glued case marker counts)."""
    while i < len(lines):
        if lines[i].startswith((CASE_MARKER + " ", RUN_MARKER + " ")):
            return i
        glued = _GLUED_CASE.search(lines[i])
        if glued and glued.start() > 0 and not lines[i].startswith("%%%"):
            return i
        i += 1
    return i


def _parse_run(lines: list[str], i: int) -> tuple[RunHeader, int]:
    suite, cases = "", []
    i += 1
    while i < len(lines) and lines[i] != END_MARKER:
        key, sep, raw = lines[i].partition(": ")
        if lines[i].startswith("%%") or not sep:
            raise TraceFormatError("run header not terminated (truncated trace?)")
        if key == "suite":
            suite = _unescape(raw)
        elif key == "case":
            try:
                n, src, cid = json.loads(raw)
                cases.append((int(n), str(src), str(cid)))
            except (ValueError, TypeError) as e:
                raise TraceFormatError(f"bad case line {lines[i]!r}: {e}") from None
        i += 1
    if i >= len(lines):
        raise TraceFormatError("run header not terminated (truncated trace?)")
    return RunHeader(suite, tuple(cases)), i + 1


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
        try:
            want = int(parts[2][len("chars="):])
        except ValueError:
            raise TraceFormatError(f"bad block marker {lines[i]!r}") from None
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
    with open(path, "rb") as f:
        return parse_trace_bytes(f.read())


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class TraceWriter:
    """Appends records to a trace file; safe to call from several threads."""

    def __init__(self, path: str | os.PathLike, warn: Callable[[str], None] = _warn_stderr):
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self.repaired = _torn_tail(self.path)
        # newline="" keeps "\r" in model output from being rewritten by the platform.
        self._file = open(self.path, "a", encoding="utf-8", newline="")
        if self.repaired:
            # The next block must start on a line of its own, or the reader would see its
            # marker as part of the torn line and lose it too.
            self._file.write("\n")
            self._file.flush()
            warn(f"{self.path}: the last write was torn ({self.repaired}); it is kept as a skipped "
                 f"block and new blocks start on a fresh line")

    def write_header(self, header: RunHeader) -> None:
        self._append(format_run_header(header))

    def write(self, rec: TraceRecord) -> None:
        self._append(format_record(rec))

    def _append(self, block: str) -> None:
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


def _torn_tail(path: str) -> str:
    """Why the file's tail needs a newline before appending ('' when it does not)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return ""
            f.seek(max(0, size - 64))
            tail = f.read()
    except FileNotFoundError:
        return ""
    if tail.endswith(b"\n"):
        return ""
    last_line = tail.rsplit(b"\n", 1)[-1]
    if size > len(tail) and b"\n" not in tail:
        last_line = last_line.lstrip(bytes(range(0x80, 0xC0)))  # the slice may start mid-character
    try:
        last_line.decode("utf-8")
    except UnicodeDecodeError:
        return f"it ends inside a UTF-8 character at byte {size}"
    return f"it ends without a newline at byte {size}"
