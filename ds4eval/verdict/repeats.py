"""Repeated runs of the same cases: per-case pass counts, flakiness and determinism. Pure.

Contract
- A run with `--repeats K` records every case K times; each trace record carries its `repeat`
  index (0 .. K-1; traces without repeats hold only repeat 0). A later record of the same
  (source, id, repeat) supersedes an earlier one (retries append).
- `group(records) -> list[CaseRepeats]`, in the order cases first appear: for each case its
  latest record per repeat, sorted by repeat; `passed` of `graded` repeats (PASSED or FAILED),
  and a class: "stable pass" (every graded repeat passed), "stable fail" (none did), "flaky"
  (some did), or "ungraded" (no repeat was graded).
- Determinism: `first_difference(outputs, split)` finds the first repeat whose output differs
  from repeat 0's and the first differing token, where `split(text) -> list[str]` cuts a text
  into token texts (the model's tokenizer when the caller has one; by default runs of letters,
  digits, spaces or single other characters, so that a position reads like a word).
- `summarize(cases) -> RepeatSummary`: the class counts; pass@1 (mean over cases of the share
  of passing repeats) with its 95% bootstrap interval over cases; the unbiased pass@k and
  pass^k at k = K (`stats`), each averaged over the cases graded K times; and, for greedy
  runs, the cases whose K outputs are not identical (non-deterministic).
It does not run cases, read files or render (see `runner`, `trace`, `report`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ds4eval.run.trace import TraceRecord
from ds4eval.verdict import stats

GRADED = ("PASSED", "FAILED")
CLASSES = ("stable pass", "stable fail", "flaky", "ungraded")
CONTEXT_CHARS = 40  # characters of each output shown after the first differing token

_WORDISH = re.compile(r"\w+|\s+|.", re.DOTALL)


def word_split(text: str) -> list[str]:
    """The default tokenizer for locating a difference: words, runs of space, single others."""
    return _WORDISH.findall(text)


@dataclass(frozen=True)
class OutputDifference:
    repeat: int          # the first repeat whose output differs from repeat 0's
    token: int           # index of the first differing token
    char: int            # character offset where that token starts
    base_text: str       # repeat 0's output from there (CONTEXT_CHARS at most)
    other_text: str      # the differing repeat's output from there


def klass(passed: int, graded: int) -> str:
    """The class of a case that passed `passed` of its `graded` repeats (see CLASSES)."""
    if not graded:
        return "ungraded"
    if passed == graded:
        return "stable pass"
    return "stable fail" if passed == 0 else "flaky"


@dataclass(frozen=True)
class CaseRepeats:
    source: str
    id: str
    records: tuple[TraceRecord, ...]  # the latest record of each repeat, by repeat index
    passed: int
    graded: int
    greedy: bool                       # every record was decoded with temperature 0
    difference: OutputDifference | None  # None when every output is identical

    @property
    def name(self) -> str:
        return f"{self.source}/{self.id}"

    @property
    def repeats(self) -> int:
        return len(self.records)

    @property
    def rate(self) -> float:
        return self.passed / self.graded if self.graded else 0.0

    @property
    def klass(self) -> str:
        return klass(self.passed, self.graded)

    @property
    def deterministic(self) -> bool:
        return self.difference is None


def first_difference(outputs: Sequence[str], split: Callable[[str], list[str]] = word_split
                     ) -> OutputDifference | None:
    """Where the first output that differs from outputs[0] departs from it (None: all equal)."""
    if not outputs:
        return None
    base = outputs[0]
    for r, other in enumerate(outputs[1:], start=1):
        if other == base:
            continue
        a, b = split(base), split(other)
        token, char = 0, 0
        for x, y in zip(a, b):
            if x != y:
                break
            token += 1
            char += len(x)
        return OutputDifference(r, token, char, base[char:char + CONTEXT_CHARS], other[char:char + CONTEXT_CHARS])
    return None


def group(records: Iterable[TraceRecord], split: Callable[[str], list[str]] = word_split) -> list[CaseRepeats]:
    latest: dict[tuple[str, str], dict[int, TraceRecord]] = {}
    for rec in records:
        latest.setdefault((rec.source, rec.id), {})[rec.repeat] = rec
    out = []
    for (source, case_id), by_repeat in latest.items():
        recs = tuple(by_repeat[r] for r in sorted(by_repeat))
        graded = [r for r in recs if r.status in GRADED]
        finished = [r.model_output for r in graded]
        out.append(CaseRepeats(
            source=source, id=case_id, records=recs, passed=sum(r.status == "PASSED" for r in graded),
            graded=len(graded), greedy=all(not r.temperature for r in recs),
            difference=first_difference(finished, split) if len(finished) > 1 else None))
    return out


@dataclass(frozen=True)
class RepeatSummary:
    cases: tuple[CaseRepeats, ...]
    repeats: int                 # K: the most repeats any case has
    counts: dict[str, int]       # CLASSES -> number of cases
    pass_at_1: stats.MeanInterval | None  # None when no case was graded
    pass_at_k: float | None      # mean unbiased pass@K over cases graded K times
    pass_hat_k: float | None     # mean unbiased pass^K (all K pass) over the same cases
    full_cases: int              # cases graded K times (those pass@K and pass^K average over)
    nondeterministic: tuple[CaseRepeats, ...]  # greedy cases whose outputs differ

    def flaky(self) -> tuple[CaseRepeats, ...]:
        return tuple(c for c in self.cases if c.klass == "flaky")


def summarize(cases: Sequence[CaseRepeats]) -> RepeatSummary:
    cases = tuple(cases)
    k = max((c.repeats for c in cases), default=0)
    counts = {name: 0 for name in CLASSES}
    for c in cases:
        counts[c.klass] += 1
    graded = [c for c in cases if c.graded]
    p1 = stats.bootstrap_mean([c.rate for c in graded]) if graded else None
    full = [c for c in graded if c.graded == k]
    at_k = sum(stats.pass_at_k(k, c.passed, k) for c in full) / len(full) if full else None
    hat_k = sum(stats.pass_hat_k(k, c.passed, k) for c in full) / len(full) if full else None
    nondet = tuple(c for c in cases if c.greedy and not c.deterministic)
    return RepeatSummary(cases, k, counts, p1, at_k, hat_k, len(full), nondet)
