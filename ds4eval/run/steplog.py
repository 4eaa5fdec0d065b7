"""The engine's batched steps in a `--parallel` run: `ds4-eval run --step-log FILE`.

Contract
- `StepLog` collects the engine's step records (engine.batch.StepRecord, one per
  `BatchScheduler.step()`, handed over on the engine's thread, where appending to a list is all
  it does) and `write(path)` writes them as JSON lines, one a step (`step_line`), to a temporary
  file renamed over `path`.
- `step_line(record, t0)`: one step as written (`StepRecord.fields`, the line ds4-server's
  `--step-log` begins with too): `t` (seconds from the log's first step), `ms` (its wall time on
  the engine's thread), `decoding` (rows its decoding step evaluated), `prefill_tokens` (tokens
  of the prefill chunk it ran), `adopted` (its decoding step was the one launched ahead of it)
  and `capture_ms` (CUDA graphs captured during it).
- `summarize_steps(records) -> StepSummary | None`, pure: per number of decoding rows, the steps
  that ran no prefill chunk (the steady cost of a batch of that size: count, median and mean
  ms, seconds), then the steps with a chunk (count, tokens, seconds), the graph captures'
  seconds, the time between steps (the scheduler's loop outside `step()`: taking cases in,
  handing results out) and the span from the first step's start to the last one's end.
- `render_steps(summary) -> str`: that summary as a few lines of text.
It does not run cases, print, or import the engine: records are read by attribute and `fields`.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from ds4eval.atomicfile import atomic_open


@dataclass(frozen=True)
class RowSteps:
    """The steps that decoded `rows` rows and ran no prefill chunk."""

    rows: int
    steps: int
    median_ms: float
    mean_ms: float
    seconds: float


@dataclass(frozen=True)
class StepSummary:
    steps: int
    span_s: float
    between_s: float  # the scheduler's loop outside its steps
    decoding: tuple[RowSteps, ...]  # by rows, fewest first
    prefill_steps: int
    prefill_tokens: int
    prefill_s: float
    capture_s: float  # CUDA graph captures, in any step
    adopted: int  # decoding steps launched ahead of the step that took them


def step_line(record: Any, t0: float) -> dict:
    return record.fields(t0)


def summarize_steps(records: Sequence[Any]) -> StepSummary | None:
    """The summary of a run's steps in the order they ran; None without any."""
    if not records:
        return None
    by_rows: dict[int, list[float]] = {}
    prefill = [r for r in records if r.prefill_tokens]
    for r in records:
        if not r.prefill_tokens and r.decoding:
            by_rows.setdefault(r.decoding, []).append(r.seconds)
    decoding = tuple(RowSteps(n, len(s), statistics.median(s) * 1e3, statistics.fmean(s) * 1e3, sum(s))
                     for n, s in sorted(by_rows.items()))
    span = records[-1].started + records[-1].seconds - records[0].started
    return StepSummary(steps=len(records), span_s=span, between_s=span - sum(r.seconds for r in records),
                       decoding=decoding, prefill_steps=len(prefill),
                       prefill_tokens=sum(r.prefill_tokens for r in prefill),
                       prefill_s=sum(r.seconds for r in prefill),
                       capture_s=sum(r.capture_seconds for r in records),
                       adopted=sum(1 for r in records if r.adopted))


def render_steps(summary: StepSummary) -> str:
    lines = [f"engine steps: {summary.steps:,} in {summary.span_s:.2f} s ({summary.between_s:.2f} s between "
             f"steps); {summary.adopted:,} took a step launched ahead; graph captures {summary.capture_s:.2f} s"]
    lines.append(f"  with a prefill chunk: {summary.prefill_steps:,} steps, {summary.prefill_tokens:,} tokens, "
                 f"{summary.prefill_s:.2f} s")
    for d in summary.decoding:
        lines.append(f"  decoding {d.rows} row{'s' if d.rows != 1 else ''}: {d.steps:,} steps, median "
                     f"{d.median_ms:.3f} ms (mean {d.mean_ms:.3f}), {d.seconds:.2f} s")
    return "\n".join(lines)


class StepLog:
    """The engine's step records of one run (see the module docstring)."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def add(self, record: Any) -> None:
        self.records.append(record)

    def write(self, path: str) -> None:
        t0 = self.records[0].started if self.records else 0.0
        with atomic_open(path, "w") as f:
            for r in self.records:
                f.write(json.dumps(step_line(r, t0)) + "\n")
