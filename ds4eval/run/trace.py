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
  ones stay readable. While it is open it holds an exclusive `fcntl.flock` on the file: a
  second writer (another run, a retry) gets `TraceBusy` instead of interleaving its blocks,
  and `being_written(path)` tells a command beforehand. Readers take no lock.
- `format_run_header(header)` writes a `%%run` block listing every case a run selected (before
  its first case block), so that cases that never started can be retried; `ParsedTrace.runs`
  holds them back.
- `parse_trace_bytes(data)` reads the file in pieces of about `PIECE_BYTES`, each cut where a
  line starts a block (a `%%case` or `%%run` line cannot occur inside one: text lines that
  start with `%%` are stuffed), so that at most one piece is held decoded at a time. It decodes
  a piece at once and, only when that fails, line by line: a line that is not valid UTF-8 (a
  write torn inside a character) spoils only its own block. Every skipped block is reported in
  `problems` with its line, its case (index, source/id when the header got that far) and why.
- Reading takes time linear in the file's size whatever its `chars=` counts say: a count is
  checked against the text without copying past the text's end, so a wrong count spoils only
  its own block and costs no more than reading that block.
- `read_input(path)` is the bytes of a regular file of at most `MAX_INPUT_BYTES` (4 GiB), or
  `InputFileError` with a one-line reason: a FIFO, a device such as /dev/zero or a directory
  is refused without being read (or waited on). `read_trace(path)` parses what it returns.
It does not grade (see `regrade`) and does not decide which cases to write.
"""

from __future__ import annotations

import bisect
import fcntl
import json
import os
import re
import stat
import sys
import threading
from dataclasses import dataclass, field, fields
from typing import Callable

from ds4eval.run.latency import Latency

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
    # Latency (ds4eval.run.latency, traces/README.md): None = unknown (older traces, or not measured).
    ttft_s: float | None = None
    itl_s: float | None = None
    itl_max_s: float | None = None
    itl_per: str = ""
    e2e_s: float | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repeat: int = 0  # which of a run's --repeats this record is (0 in runs without repeats)
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
    gen_tokens_eos: str = ""  # "yes"/"no": gen_tokens counts the end-of-sequence token; "" = unknown
    concurrency: int = 0  # cases the run had in flight at once (--concurrency / --parallel); 0 = unknown
    extractor_version: str = ""
    ds4eval_version: str = ""
    git_commit: str = ""
    rendered_prompt: str = ""
    rendered_token_ends: str = ""
    system_prompt: str = ""
    question_prompt: str = ""
    model_output: str = ""

    def latency(self) -> Latency:
        """The case's latency figures (all None in traces written before they were measured)."""
        return Latency(self.ttft_s, self.itl_s, self.itl_max_s, self.e2e_s, self.itl_per)


_BLOCK_FIELD = {"SYSTEM_PROMPT": "system_prompt", "QUESTION_PROMPT": "question_prompt",
                "MODEL_OUTPUT": "model_output"}
_HEADER_FIELDS = [f for f in fields(TraceRecord) if f.name not in _BLOCK_FIELD.values()]


def _escape(value: str) -> str:
    if "\\" not in value and "\n" not in value and "\r" not in value:
        return value  # the common case, and the writer's hot path: no copy
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


_ESCAPED = re.compile(r"\\(.)", re.DOTALL)
_UNESCAPED = {"n": "\n", "r": "\r", "\\": "\\"}


def _unescape(value: str) -> str:
    # A backslash takes the next character with it: \n, \r and \\ are decoded, any other pair
    # is kept as written, and a backslash at the very end stays.
    if "\\" not in value:
        return value
    if "\\\\" not in value:  # no escaped backslash, so each \n or \r pair stands alone
        return value.replace("\\n", "\n").replace("\\r", "\r")
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


# Each header field's writer: a field whose value is a plain str or int takes the short path; the
# others (floats, bools, optional values, aliases) the general one. Both write the same text.
_PLAIN_TYPES = {"str", "int"}
_HEADER_WRITERS = tuple((f.name, f"{f.name}: ", f.type in _PLAIN_TYPES) for f in _HEADER_FIELDS)


def format_record(rec: TraceRecord) -> str:
    """One complete block, ending with a newline."""
    out = [f"{CASE_MARKER} {rec.index} v{FORMAT_VERSION}"]
    values = vars(rec)
    for name, prefix, plain in _HEADER_WRITERS:
        v = values[name]
        if plain and (type(v) is str or type(v) is int):
            out.append(prefix + (_escape(v) if type(v) is str else str(v)))
        else:
            out.append(prefix + _header_value(rec, name))
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
    repeats: int = 1  # --repeats K: every case is to be recorded K times
    # A shard's run (ds4eval.run.shards): "I/N", the whole selection's digest and size, and the
    # selection flags as JSON, so that a merge can check and name what the other shards hold.
    shard: str = ""
    selection: str = ""
    selected: int = 0
    filters: str = ""

    def shard_fields(self) -> dict:
        """The shard fields, as `RunHeader(**)` takes them (empty strings and 0 when not a shard's)."""
        return {"shard": self.shard, "selection": self.selection, "selected": self.selected,
                "filters": self.filters}


def format_run_header(header: RunHeader) -> str:
    out = [f"{RUN_MARKER} v{FORMAT_VERSION}", f"suite: {_escape(header.suite)}"]
    if header.repeats != 1:
        out.append(f"repeats: {header.repeats}")
    if header.shard:
        out += [f"shard: {header.shard}", f"selection: {header.selection}", f"selected: {header.selected}",
                f"filters: {_escape(header.filters)}"]
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
    return json.loads(raw) if raw and raw != "[]" else []


def _int_or_zero(raw: str) -> int:
    return int(raw) if raw else 0


def _float_or_zero(raw: str) -> float:
    return float(raw) if raw else 0.0


def _float_or_none(raw: str) -> float | None:
    return float(raw) if raw else None


# How each known header value is read back (escaped text unless listed); unknown keys are not here.
_READERS = {f.name: _unescape for f in _HEADER_FIELDS}
_READERS.update({
    "aliases": _json_list,
    "status": lambda raw: raw or None,
    "picked": lambda raw: _unescape(raw) if raw else None,
    "seed": lambda raw: int(raw) if raw else None,
    "thinking": lambda raw: raw == "yes",
    **dict.fromkeys(("index", "nchoices", "prompt_tokens", "gen_tokens", "max_tokens", "repeat", "concurrency"),
                    _int_or_zero),
    **dict.fromkeys(("elapsed_s", "temperature", "top_p", "min_p"), _float_or_zero),
    **dict.fromkeys(("ttft_s", "itl_s", "itl_max_s", "e2e_s"), _float_or_none),
})


# A case marker glued to the end of a torn line (traces appended to before writers repaired
# torn tails): recognised only while resynchronising after a broken block.
_GLUED_CASE = re.compile(r"(%%case \d+ v\d+)$")


def parse_trace(text: str) -> ParsedTrace:
    """All complete blocks of a trace; malformed or truncated blocks are reported and skipped."""
    return _Reader(text, ()).parse()


PIECE_BYTES = 16 << 20  # what parse_trace_bytes decodes at once (more when one block is larger)
_BLOCK_STARTS = (b"\n" + CASE_MARKER.encode() + b" ", b"\n" + RUN_MARKER.encode() + b" ")


def parse_trace_bytes(data: bytes | bytearray | memoryview) -> ParsedTrace:
    """Like `parse_trace` on the file's bytes; lines that are not UTF-8 spoil only their block."""
    view = memoryview(data)
    out = ParsedTrace([], [], [])
    start, line0 = 0, 0
    while start < len(view):
        stop = _piece_end(data, start)
        part = _parse_piece(view[start:stop], line0)
        out.records.extend(part.records)
        out.problems.extend(part.problems)
        out.runs.extend(part.runs)
        line0 += data.count(b"\n", start, stop)
        start = stop
    return out


def _piece_end(data: bytes | bytearray | memoryview, start: int) -> int:
    """Where the piece from `start` ends: just after the first newline, `PIECE_BYTES` or more
    on, that is followed by a case or run marker; the end of the data when there is none."""
    if len(data) - start <= PIECE_BYTES:
        return len(data)
    found = [i for i in (data.find(m, start + PIECE_BYTES) for m in _BLOCK_STARTS) if i >= 0]
    return min(found) + 1 if found else len(data)


def _parse_piece(piece: memoryview, line0: int) -> ParsedTrace:
    try:
        return _Reader(str(piece, "utf-8"), (), line0).parse()
    except UnicodeDecodeError:
        pass
    lines, bad, pos = [], [], 0
    for raw in bytes(piece).split(b"\n"):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            line = raw.decode("utf-8", errors="replace")
            bad.append(pos)
        lines.append(line)
        pos += len(line) + 1
    return _Reader("\n".join(lines), tuple(bad), line0).parse()


def _is_marker(text: str, pos: int) -> bool:
    """Whether the line at `pos` is a marker line (`%%`, not a stuffed `%%%` text line)."""
    return text.startswith("%%", pos) and not text.startswith("%%%", pos)


class _Reader:
    """One pass over a trace's text by position: block texts are sliced by their `chars=`
    count rather than split into lines, which keeps reading a large trace fast. Line numbers
    are worked out only for the problems reported."""

    def __init__(self, text: str, bad: tuple[int, ...], line0: int = 0):
        self.text = text
        # A final newline ends the last line; it does not start an empty one.
        self.end = len(text) - 1 if text.endswith("\n") else len(text)
        self.bad = bad  # start offsets of lines that were not valid UTF-8, ascending
        self.line0 = line0  # lines of the file before this text (a piece of it)
        self._counted = (0, 0)  # (offset, newlines before it): problems come in text order

    def line_end(self, pos: int) -> int:
        e = self.text.find("\n", pos, self.end)
        return self.end if e < 0 else e

    def line_no(self, pos: int) -> int:
        at, before = self._counted
        if pos < at:
            at, before = 0, 0
        before += self.text.count("\n", at, pos)
        self._counted = (pos, before)
        return self.line0 + before + 1

    def parse(self) -> ParsedTrace:
        text: str = self.text
        records: list[TraceRecord] = []
        problems: list[str] = []
        runs: list[RunHeader] = []
        pos = 0
        while pos < self.end:
            if text.startswith(RUN_MARKER + " ", pos):
                try:
                    header, nxt = self.run_header(pos)
                    runs.append(header)
                except TraceFormatError as e:
                    problems.append(f"line {self.line_no(pos)}: run header skipped: {e}")
                    nxt = self.resync(self.line_end(pos) + 1)
                pos = nxt
                continue
            if not text.startswith(CASE_MARKER + " ", pos):
                eol = self.line_end(pos)
                glued = _GLUED_CASE.search(text, pos, eol)
                if glued and glued.start() > pos:
                    problems.append(f"line {self.line_no(pos)}: a case marker follows torn text on the same line")
                    pos = glued.start()
                    continue
                if text[pos:eol].strip():
                    problems.append(f"line {self.line_no(pos)}: text outside a case block")
                pos = eol + 1
                continue
            try:
                rec, nxt = self.case_block(pos)
                # A glued block starts mid-line; the bad line it starts on spoils it too.
                k = bisect.bisect_left(self.bad, text.rfind("\n", 0, pos) + 1)
                if k < len(self.bad) and self.bad[k] < nxt:
                    raise TraceFormatError(f"invalid UTF-8 on line {self.line_no(self.bad[k])}")
                records.append(rec)
            except TraceFormatError as e:
                nxt = self.resync(self.line_end(pos) + 1)
                problems.append(f"line {self.line_no(pos)}: {self.describe(pos, nxt)} skipped: {e}")
            pos = nxt
        return ParsedTrace(records, problems, runs)

    def resync(self, pos: int) -> int:
        """Offset of the next line that starts a block (a glued case marker counts), from `pos`,
        a line's start. Only lines holding `%%` can, so the others are skipped by `find`."""
        text, end = self.text, self.end
        while pos < end:
            i = text.find("%%", pos, end)
            if i < 0:
                return end
            start = text.rfind("\n", pos, i) + 1 or pos  # the start of the line holding it
            if i == start and text.startswith((CASE_MARKER + " ", RUN_MARKER + " "), i):
                return i
            eol = self.line_end(i)
            glued = _GLUED_CASE.search(text, start, eol)
            if glued and glued.start() > start and not text.startswith("%%%", start):
                return start
            pos = eol + 1
        return end

    def describe(self, start: int, end: int) -> str:
        """'case block N (source/id)' for the block at `start`, from whatever header lines survive."""
        end = min(end, self.end)
        header_end = self.text.find("\n%%", start, end)  # only the header lines are read
        lines = self.text[start:end if header_end < 0 else header_end].split("\n")
        head = lines[0].split()
        what = f"case block {head[1]}" if len(head) > 1 else "case block"
        found = {}
        for line in lines[1:]:
            key, sep, raw = line.partition(": ")
            if sep and key in ("source", "id"):
                found[key] = _unescape(raw)
            if line.startswith("%%"):
                break
        if "source" in found and "id" in found:
            what += f" ({found['source']}/{found['id']})"
        return what

    def run_header(self, pos: int) -> tuple[RunHeader, int]:
        text, suite, cases, repeats = self.text, "", [], 1
        shard: dict = {}
        pos = self.line_end(pos) + 1
        while pos < self.end:
            eol = self.line_end(pos)
            line = text[pos:eol]
            if line == END_MARKER:
                return RunHeader(suite, tuple(cases), repeats, **shard), eol + 1
            key, sep, raw = line.partition(": ")
            if line.startswith("%%") or not sep:
                break
            if key == "suite":
                suite = _unescape(raw)
            elif key == "repeats":
                try:
                    repeats = int(raw)
                except ValueError:
                    raise TraceFormatError(f"bad repeats line {line!r}") from None
                if repeats < 1:
                    raise TraceFormatError(f"bad repeats line {line!r}")
            elif key in ("shard", "selection", "filters"):
                shard[key] = _unescape(raw)
            elif key == "selected":
                try:
                    shard[key] = int(raw)
                except ValueError:
                    raise TraceFormatError(f"bad selected line {line!r}") from None
            elif key == "case":
                try:
                    n, src, cid = json.loads(raw)
                    cases.append((int(n), str(src), str(cid)))
                except (ValueError, TypeError) as e:
                    raise TraceFormatError(f"bad case line {line!r}: {e}") from None
            pos = eol + 1
        raise TraceFormatError("run header not terminated (truncated trace?)")

    def case_block(self, pos: int) -> tuple[TraceRecord, int]:
        text, end = self.text, self.end
        eol = self.line_end(pos)
        head = text[pos:eol].split()
        try:
            index = int(head[1])
        except (IndexError, ValueError):
            raise TraceFormatError("case marker without an index") from None
        rec_fields: dict = {"index": index, "source": "", "id": ""}
        # The header runs up to the first marker line (or the end of the text).
        marker = text.find("\n%%", eol, end)
        if marker < 0:
            marker = end
        if marker > eol:
            _read_header(text[eol + 1:marker], rec_fields)
        pos = min(marker + 1, end)
        while text.startswith(BLOCK_MARKER + " ", pos):
            eol = self.line_end(pos)
            parts = text[pos:eol].split()
            if len(parts) != 3 or parts[1] not in _BLOCK_FIELD or not parts[2].startswith("chars="):
                raise TraceFormatError(f"bad block marker {text[pos:eol]!r}")
            try:
                want = int(parts[2][len("chars="):])
            except ValueError:
                raise TraceFormatError(f"bad block marker {text[pos:eol]!r}") from None
            start = eol + 1
            stop = start + want
            # Fast path: exactly `want` characters, then the newline that ends the text, then a
            # marker line, and nothing inside was stuffed. Otherwise read line by line. Nothing
            # is copied before the count is known to be right, and the search for a marker line
            # inside stops at the first one, the text's real end: a wrong count, however large,
            # costs what reading this block costs.
            if stop <= end and (stop == end or (text[stop] == "\n" and _is_marker(text, stop + 1))) \
                    and not text.startswith("%%", start, stop) and text.find("\n%%", start, stop) < 0:
                block, pos = text[start:stop], min(stop + 1, end)
            else:
                block, pos = self.stuffed_text(start)
            if len(block) != want:
                raise TraceFormatError(f"block {parts[1]} has {len(block)} chars, header says {want}")
            rec_fields[_BLOCK_FIELD[parts[1]]] = block
        eol = self.line_end(pos)
        if pos >= end or text[pos:eol] != END_MARKER:
            raise TraceFormatError("block not terminated (truncated trace?)")
        return TraceRecord(**rec_fields), eol + 1

    def stuffed_text(self, pos: int) -> tuple[str, int]:
        """The text lines from `pos` up to the next marker line, unstuffed, and that marker's offset."""
        text = self.text
        if pos >= len(text) or _is_marker(text, pos):
            return "", min(pos, self.end)
        scan = pos
        while True:  # the next "\n%%" that is not a stuffed "\n%%%" starts the marker line
            nl = text.find("\n%%", scan, self.end)
            if nl < 0:
                stop, nxt = self.end, self.end
                break
            if not text.startswith("%%%", nl + 1):
                stop, nxt = nl, nl + 1
                break
            scan = nl + 1
        lines = text[pos:stop]
        # Unstuffing removes one "%" from every line that starts with "%%%".
        if "\n%%%" in lines:
            lines = lines.replace("\n%%%", "\n%%")
        return (lines[1:] if lines.startswith("%%%") else lines), nxt


# The header as `format_record` writes it: known fields in field order, each at most once
# (a trace from before a field existed lacks it). Matching it in one regular expression leaves
# only the value readers to run in Python; any other layout (unknown keys from newer writers,
# another order, damage) takes the line-by-line reader, which gives the same values for this one.
_WRITTEN_HEADER = re.compile("".join(f"(?:{re.escape(f.name)}: (.*)\n)?" for f in _HEADER_FIELDS))
_WRITTEN_READERS = tuple((f.name, _READERS[f.name]) for f in _HEADER_FIELDS)


def _read_header(section: str, rec_fields: dict) -> None:
    written = _WRITTEN_HEADER.fullmatch(section + "\n")
    if written is not None:
        key = ""
        try:
            for (key, read), raw in zip(_WRITTEN_READERS, written.groups()):
                if raw is not None:
                    rec_fields[key] = read(raw)
        except ValueError as e:
            raise TraceFormatError(f"bad value for {key}: {e}") from None
        return
    for line in section.split("\n"):
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


MAX_INPUT_BYTES = 4 << 30


class InputFileError(ValueError):
    """A path that is not a readable input: not a regular file, or larger than the limit."""


def read_input(path: str | os.PathLike, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the regular file at `path`; InputFileError for anything else or anything
    larger than `limit` bytes, OSError when it cannot be opened or read."""
    # O_NONBLOCK: opening a FIFO with no writer would otherwise wait for one forever.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "a special file")
            raise InputFileError(f"{os.fspath(path)}: it is {kind}, not a regular file")
        if st.st_size > limit:
            raise InputFileError(f"{os.fspath(path)}: {st.st_size:,} bytes, more than the limit of an input "
                                 f"file ({_size(limit)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)  # a file that grows while it is read is held to the limit too
    if len(data) > limit:
        raise InputFileError(f"{os.fspath(path)}: it grew past the limit of an input file ({_size(limit)}) "
                             "while it was read")
    return data


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 and n % (1 << 30) == 0 else f"{n:,} bytes"


_FILE_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket"}


def read_trace(path: str | os.PathLike) -> ParsedTrace:
    """The trace at `path` (`read_input`, then `parse_trace_bytes`)."""
    return parse_trace_bytes(read_input(path))


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class TraceBusy(OSError):
    """Another writer holds the trace (see the module docstring); the message is one line."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        super().__init__(f"{self.path} is being written by another ds4-eval process (a run still in "
                         "progress); try again once it has finished")


def being_written(path: str | os.PathLike) -> bool:
    """Whether a `TraceWriter` (of any process) has the trace at `path` open now."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False  # no file: nobody writes it (unreadable ones fail where they are read)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the shared lock too
    return False


class TraceWriter:
    """Appends records to a trace file; safe to call from several threads. TraceBusy when
    another writer has the file open."""

    def __init__(self, path: str | os.PathLike, warn: Callable[[str], None] = _warn_stderr):
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        # newline="" keeps "\r" in model output from being rewritten by the platform.
        self._file = open(self.path, "a", encoding="utf-8", newline="")
        try:
            # Taken before the tail is inspected: a torn tail is only repaired by its one writer.
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise TraceBusy(self.path) from None
        self.repaired = _torn_tail(self.path)
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

    def append_block(self, text: str) -> None:
        """Text already formatted as whole blocks (`format_record`, `format_run_header`)."""
        self._append(text)

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
