"""The files `ds4-eval` commands are given and the reports they write.

Every failure to read an input or write a report is a `UsageFailure`: a one-line message that
the command line prints with exit status 2. Inputs are regular files of at most
`trace.MAX_INPUT_BYTES` (4 GiB): a FIFO, a device such as /dev/zero or a directory is refused
without being read or waited on (`trace.read_input`). Reports are written atomically. This
module knows nothing of flags or of what the commands do with the files.
"""

from __future__ import annotations

import os
from datetime import datetime

from ds4eval.atomicfile import write_text_atomic
from ds4eval.run import trace


class UsageFailure(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


def read_text(path: str) -> str:
    """The whole file as UTF-8 text, line ends kept as they are."""
    try:
        return read_bytes(path).decode("utf-8")
    except UnicodeDecodeError:
        raise UsageFailure(f"{path} is not UTF-8 text") from None


def read_bytes(path: str) -> bytes:
    try:
        return trace.read_input(path)
    except trace.InputFileError as e:
        raise UsageFailure(f"cannot read {e}") from None
    except OSError as e:
        raise UsageFailure(f"cannot read {path}: {e.strerror or e}") from None


def read_trace(path: str) -> trace.ParsedTrace:
    """A trace's records and run headers; UsageFailure when the file holds neither."""
    # Bytes, not text: a write torn inside a UTF-8 character spoils only its own block.
    parsed = trace.parse_trace_bytes(read_bytes(path))
    if not parsed.records and not parsed.runs and parsed.problems:
        raise UsageFailure(f"{path}: not a ds4-eval trace ({parsed.problems[0]})")
    return parsed


def file_size(path: str | None) -> int:
    """Bytes in the file; 0 when there is none (yet)."""
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def modified(path: str) -> str:
    """When a file was last written, local time; empty when unknown."""
    try:
        return datetime.fromtimestamp(os.stat(path).st_mtime).astimezone().strftime("%Y-%m-%d %H:%M:%S %z")
    except OSError:
        return ""


def write_report(path: str, text: str) -> None:
    try:
        write_text_atomic(path, text)
    except OSError as e:
        raise UsageFailure(f"cannot write the report {path}: {e.strerror or e}") from None


def check_destination(path: str | None, what: str) -> None:
    """UsageFailure now, before any work, when `path` could not be written later: its folder is
    missing or not writable, or it names a folder."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageFailure(f"cannot write the {what} {path}: it is a directory")
    if not os.path.isdir(folder):
        raise UsageFailure(f"cannot write the {what} {path}: no directory {folder}")
    if not os.access(folder, os.W_OK):
        raise UsageFailure(f"cannot write the {what} {path}: {folder} is not writable")
