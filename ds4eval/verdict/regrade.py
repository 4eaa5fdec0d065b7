"""Regrading a trace without the model: re-extract and re-grade every recorded output.

Contract
- One counting rule for records a retry superseded, the one `--compare`, the run report and
  the repeat summaries follow: `latest(records) -> (records, superseded)` keeps the latest
  record of each (source, id, repeat), in the order the cases first appear, and counts the
  earlier ones it dropped.
- `regrade(records, lookup=None) -> RegradeReport` is pure and grades `latest(records)`: a
  41-case trace with retries counts 41 cases, and `superseded` says how many records were
  left out. Only cases whose recorded status
  is PASSED or FAILED, or that have no status (traces from before statuses were recorded), are
  graded; all others count as `not_graded`. A case whose new verdict differs from its
  recorded status is listed in `changed`.
- The key comes from the trace itself (expected, aliases, answer_kind, nchoices); `lookup`
  ((source, id) -> Case or None) fills in what an old trace lacks.
It does not read files or print; `cli` does that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from ds4eval.cases import grade
from ds4eval.cases.case import Case
from ds4eval.run.trace import RunHeader, TraceRecord

GRADED_STATUSES = ("PASSED", "FAILED")


@dataclass(frozen=True)
class RegradedCase:
    index: int
    source: str
    id: str
    old_status: str | None
    new_status: str
    old_picked: str | None
    new_picked: str | None
    expected: str


@dataclass
class RegradeReport:
    passed: int = 0
    failed: int = 0
    not_graded: int = 0
    cases: list[RegradedCase] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    superseded: int = 0  # records left out: a later record of the same case and repeat replaced them

    @property
    def changed(self) -> list[RegradedCase]:
        return [c for c in self.cases if c.old_status is not None and c.old_status != c.new_status]

    def summary_line(self) -> str:
        line = (f"passed={self.passed} failed={self.failed} not_graded={self.not_graded} "
                f"changed={len(self.changed)}")
        return line + (f" superseded={self.superseded}" if self.superseded else "")


def latest(records: Iterable[TraceRecord]) -> tuple[list[TraceRecord], int]:
    """The latest record of each (source, id, repeat), in first-appearance order, and how many
    earlier records of the same keys were dropped (retries append; the last record counts)."""
    kept: dict[tuple[str, str, int], TraceRecord] = {}
    seen = 0
    for rec in records:
        seen += 1
        kept[(rec.source, rec.id, rec.repeat)] = rec  # a dict keeps the first position, takes the last value
    return list(kept.values()), seen - len(kept)


def regrade(records: Iterable[TraceRecord],
            lookup: Callable[[str, str], Case | None] | None = None) -> RegradeReport:
    records, superseded = latest(records)
    report = RegradeReport(superseded=superseded)
    for rec in records:
        if rec.status is not None and rec.status not in GRADED_STATUSES:
            report.not_graded += 1
            continue
        kind, expected, aliases, nchoices = rec.answer_kind, rec.expected, rec.aliases, rec.nchoices
        if not kind or not expected:
            case = lookup(rec.source, rec.id) if lookup else None
            if case is None:
                report.problems.append(f"{rec.source}/{rec.id}: no answer key in the trace or the data")
                report.not_graded += 1
                continue
            kind, expected, aliases, nchoices = case.answer_kind, case.answer, list(case.aliases), case.nchoices
        try:
            verdict = grade.grade_output(kind, expected, rec.model_output, aliases, nchoices)
        except ValueError as e:
            report.problems.append(f"{rec.source}/{rec.id}: {e}")
            report.not_graded += 1
            continue
        new_status = "PASSED" if verdict.passed else "FAILED"
        if verdict.passed:
            report.passed += 1
        else:
            report.failed += 1
        report.cases.append(RegradedCase(rec.index, rec.source, rec.id, rec.status, new_status,
                                         rec.picked, verdict.picked, expected))
    return report


def incomplete(records: Iterable[TraceRecord], runs: Iterable[RunHeader] = ()) -> list[tuple[str, str, int]]:
    """(source, id, repeat) of every repeat whose latest record did not finish PASSED or FAILED,
    and of the repeats that a run header lists (each case K times with `repeats: K`) but no block
    records (they never started), in run order (header order first, then what only the blocks
    name). A later block for the same repeat supersedes an earlier one (retries append), so
    retrying a retried trace asks only for what is still unfinished."""
    order: dict[tuple[str, str, int], None] = {}
    for run in runs:
        for _, source, case_id in run.cases:
            for r in range(run.repeats):
                order.setdefault((source, case_id, r), None)
    last = {(rec.source, rec.id, rec.repeat): rec for rec in latest(records)[0]}
    for key in last:
        order.setdefault(key, None)
    return [k for k in order if k not in last or last[k].status not in GRADED_STATUSES]


def case_numbers(records: Iterable[TraceRecord], runs: Iterable[RunHeader] = ()) -> dict[tuple[str, str], int]:
    """The number each case had in its run (a block's index, else the run header's number)."""
    numbers: dict[tuple[str, str], int] = {}
    for run in runs:
        for n, source, case_id in run.cases:
            numbers.setdefault((source, case_id), n)
    for rec in records:
        numbers[(rec.source, rec.id)] = rec.index
    return numbers
