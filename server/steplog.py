"""ds4-server's `--step-log FILE`: a JSON line for every step of the batched loop, as it runs.

Contract
- `check_step_log_path(path)` raises `StepLogError` (one line, naming the path) where the file
  could not be written: its directory missing or not writable, or the path a directory. The
  CLI calls it before the model loads, so that a bad path fails in a second.
- `StepLogWriter(path)` opens the file (truncating it) and `write(record, loop)` appends one
  line: the scheduler's `engine.batch.StepRecord` as `StepRecord.fields` writes it (`t` from the
  log's first step, `ms`, `decoding`, `prefill_tokens`, `adopted`, `capture_ms`), then the
  batched loop's `LoopState` at that step (`jobs`, `waiting`, `admitted`, `parked`). Each line is
  written whole and flushed, so a reader (`tail -f`, a crash) sees only whole lines. It is
  written on the worker thread, between the GPU's steps; a failed write (a full disk) is logged
  once and ends the log, never the serving. `close()` ends it (the worker's `stop()`); lines
  after it are dropped.
A server runs for as long as it runs, so the log is written as it goes, not gathered and
renamed into place at the end as `ds4-eval --step-log` does. It does not summarize the steps
(`ds4eval.run.steplog.summarize_steps` reads the same first fields).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any, TextIO

log = logging.getLogger("ds4.server.steplog")


class StepLogError(Exception):
    """The step log's file cannot be written (the message names it)."""


@dataclass(frozen=True)
class LoopState:
    """What the batched loop held when a step ran (`server.batching.BatchedLoop`)."""

    jobs: int
    """Jobs taken from the queue and not ended: in slots, or parked out of one."""
    waiting: int
    """Jobs queued for a slot."""
    admitted: int
    """Jobs that took a slot since the step before this one."""
    parked: int
    """Jobs in slots left out of this step (`server.batching.decoding_rows`)."""


def check_step_log_path(path: str) -> None:
    if os.path.isdir(path):
        raise StepLogError(f"--step-log {path}: is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise StepLogError(f"--step-log {path}: no directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise StepLogError(f"--step-log {path}: not writable")


class StepLogWriter:
    """The step log of one server (see the module docstring)."""

    def __init__(self, path: str) -> None:
        check_step_log_path(path)
        try:
            self._file: TextIO | None = open(path, "w", encoding="utf-8")
        except OSError as e:
            raise StepLogError(f"--step-log {path}: {e.strerror or e}") from None
        self.path = path
        self._t0: float | None = None

    def write(self, record: Any, loop: LoopState) -> None:
        if self._file is None:
            return
        if self._t0 is None:
            self._t0 = record.started
        line = json.dumps(record.fields(self._t0) | asdict(loop), separators=(",", ":")) + "\n"
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as e:
            log.error("the step log %s stopped: %s", self.path, e.strerror or e)
            f, self._file = self._file, None
            try:
                if f is not None:
                    f.close()
            except OSError:  # its buffer holds the line that failed: said once above
                pass
        except ValueError:  # closed meanwhile by a stop that did not wait for the loop's end
            pass

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError as e:  # the last lines could not be flushed: they are lost, the server is not
                log.error("the step log %s: %s", self.path, e.strerror or e)
