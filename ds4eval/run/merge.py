"""Merging the shard traces of one run (`ds4-eval run --shard I/N`) into the trace of the whole run.

Contract
- `merge(traces, name_missing=None) -> Merged` is pure: parsed shard traces in, the whole run out,
  or `MergeRefused` listing every problem (one line each) when the set does not make one run:
  - a trace without a shard's run header, or whose headers disagree with each other;
  - shards of different runs: another shard count, suite, repeat count, selection flags or
    selection digest (the cases' identities and content hashes);
  - a shard index given twice (overlapping shards), or a case recorded in two traces;
  - a case recorded in a trace whose shard it does not belong to;
  - missing shards, each with the cases it holds when `name_missing(header, indices)` can name
    them (the CLI rebuilds the selection from the case data), else with their count;
  - shards whose records differ in the model (file hash, else name), the chat template's hash or
    the sampling settings (temperature, top-p, min-p, seed).
- Within one trace a later block of a case and repeat supersedes an earlier one (a retry appends),
  as everywhere else; the merged trace holds only the latest block of each, in case-number and
  repeat order, under one run header that lists every selected case (no shard fields: it is the
  whole run, and `ds4-eval retry` completes it like any other).
- Cases that are listed but did not finish PASSED or FAILED are not a reason to refuse: they are
  reported in `Merged.unfinished`, and a retry of the merged trace runs them.
It reads and writes no files (see `ds4eval.cli.trace_commands`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from ds4eval.run.shards import Shard, ShardError, assign, parse_shard
from ds4eval.run.trace import ParsedTrace, RunHeader, TraceRecord, format_record, format_run_header

GRADED = frozenset({"PASSED", "FAILED"})


class MergeRefused(ValueError):
    """The traces do not make one run; `problems` has one line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__(f"{len(problems)} problem(s): " + "; ".join(problems[:3]))
        self.problems = problems


@dataclass(frozen=True)
class ShardTrace:
    """One input: its name (a path, for messages) and its parsed text."""

    name: str
    parsed: ParsedTrace


@dataclass
class Merged:
    header: RunHeader
    records: list[TraceRecord]
    shards: int
    unfinished: list[str] = field(default_factory=list)  # "#n source/id[ repeat r]: STATUS|not run"
    problems: list[str] = field(default_factory=list)    # blocks the inputs' readers skipped

    def text(self) -> str:
        """The merged trace, as one process would have written it."""
        return format_run_header(self.header) + "".join(format_record(r) for r in self.records)


# What a run's records must agree on, each as (name, value of a record). The seed is compared as
# the run's base seed: repeat r samples with seed + r.
RUN_SETTINGS: tuple[tuple[str, Callable[[TraceRecord], object]], ...] = (
    ("model", lambda r: r.model_sha256 or r.model),
    ("chat template", lambda r: r.chat_template_sha256),
    ("temperature", lambda r: r.temperature),
    ("top-p", lambda r: r.top_p),
    ("min-p", lambda r: r.min_p),
    ("seed", lambda r: None if r.seed is None else r.seed - r.repeat),
)


@dataclass
class _Shard:
    name: str
    shard: Shard
    header: RunHeader
    cases: dict[tuple[str, str], int]          # (source, id) -> number, from its headers
    latest: dict[tuple[str, str, int], TraceRecord]


def _read_shard(t: ShardTrace, problems: list[str]) -> _Shard | None:
    headers = [h for h in t.parsed.runs if h.shard]
    if not headers:
        why = "it has no run header" if not t.parsed.runs else "its run header names no shard"
        problems.append(f"{t.name}: not a shard's trace ({why}; write shards with ds4-eval run --shard I/N)")
        return None
    first = headers[0]
    for h in headers[1:]:
        if (h.shard, h.selection, h.suite, h.repeats) != (first.shard, first.selection, first.suite, first.repeats):
            problems.append(f"{t.name}: its run headers disagree (shard {first.shard} and {h.shard}, or "
                            f"another selection): two runs were written to one file")
            return None
    try:
        shard = parse_shard(first.shard)
    except ShardError:
        problems.append(f"{t.name}: bad shard {first.shard!r} in its run header")
        return None
    cases: dict[tuple[str, str], int] = {}
    for h in headers:
        for number, source, case_id in h.cases:
            cases.setdefault((source, case_id), number)
    latest: dict[tuple[str, str, int], TraceRecord] = {}
    for rec in t.parsed.records:
        latest[(rec.source, rec.id, rec.repeat)] = rec
        cases.setdefault((rec.source, rec.id), rec.index)
    return _Shard(t.name, shard, first, cases, latest)


def _same_run(shards: list[_Shard], problems: list[str]) -> None:
    checks = (("shard count", lambda s: s.shard.count), ("suite", lambda s: s.header.suite),
              ("repeats", lambda s: s.header.repeats), ("selection flags", lambda s: s.header.filters),
              ("selection (the cases' identities and content hashes)", lambda s: s.header.selection))
    for what, get in checks:
        groups = _group(shards, get)
        if len(groups) > 1:
            problems.append(f"the shards differ in {what}: " + "; ".join(
                f"{value!r} in {', '.join(names)}" for value, names in groups.items()))
            return  # a different run: the finer checks below would only repeat it


def _group(items: Iterable, get: Callable) -> dict:
    groups: dict = defaultdict(list)
    for item in items:
        groups[get(item)].append(item.name)
    return groups


def merge(traces: Sequence[ShardTrace],
          name_missing: Callable[[RunHeader, list[int]], list[str] | None] | None = None) -> Merged:
    """The whole run from its shard traces (see the module docstring); MergeRefused otherwise."""
    if not traces:
        raise MergeRefused(["no shard traces given"])
    problems: list[str] = []
    shards = [s for s in (_read_shard(t, problems) for t in traces) if s is not None]
    if problems or not shards:
        raise MergeRefused(problems)
    _same_run(shards, problems)
    if problems:
        raise MergeRefused(problems)

    count, head = shards[0].shard.count, shards[0].header
    by_index: dict[int, _Shard] = {}
    for s in shards:
        if s.shard.index in by_index:
            problems.append(f"{by_index[s.shard.index].name} and {s.name} are both shard {s.shard} "
                            f"(overlapping shards)")
        else:
            by_index[s.shard.index] = s
    shards = list(by_index.values())  # a shard given twice is reported once, not once per case
    missing = [i for i in range(count) if i not in by_index]
    if missing:
        named = name_missing(head, missing) if name_missing is not None else None
        what = ", ".join(f"{i}/{count}" for i in missing)
        if named is None:
            problems.append(f"missing shard(s) {what}: their cases cannot be named without the case data")
        else:
            problems.append(f"missing shard(s) {what}: {len(named)} case(s) not run: {', '.join(named)}")

    owner: dict[tuple[str, str, int], str] = {}
    latest: dict[tuple[str, str, int], TraceRecord] = {}
    for s in shards:
        for (source, case_id) in s.cases:
            if assign(source, case_id, count) != s.shard.index:
                problems.append(f"{s.name}: case {source}/{case_id} belongs to shard "
                                f"{assign(source, case_id, count)}/{count}, not {s.shard}")
        for key in s.latest:
            if key in owner:
                problems.append(f"case {key[0]}/{key[1]}{_repeat(key[2], head.repeats)} is recorded in both "
                                f"{owner[key]} and {s.name}")
            else:
                owner[key] = s.name
                latest[key] = s.latest[key]

    for what, get in RUN_SETTINGS:
        values: dict = defaultdict(set)
        for s in shards:
            for rec in s.latest.values():
                values[get(rec)].add(s.name)
        if len(values) > 1:
            problems.append(f"the shards' records differ in {what}: " + "; ".join(
                f"{value!r} in {', '.join(sorted(names))}" for value, names in values.items()))

    listed = sum(len(s.cases) for s in shards)
    if not missing and head.selected and listed != head.selected:
        problems.append(f"the shards list {listed} cases, the selection has {head.selected}")
    if problems:
        raise MergeRefused(problems)

    numbers: dict[tuple[str, str], int] = {}
    for s in shards:
        numbers.update(s.cases)
    cases = tuple(sorted(((n, src, cid) for (src, cid), n in numbers.items())))
    records = sorted(latest.values(), key=lambda r: (r.index, r.repeat))
    unfinished = []
    for n, src, cid in cases:
        for r in range(head.repeats):
            rec = latest.get((src, cid, r))
            if rec is None or rec.status not in GRADED:
                unfinished.append(f"#{n} {src}/{cid}{_repeat(r, head.repeats)}: "
                                  f"{'not run' if rec is None else rec.status or 'no status'}")
    return Merged(RunHeader(head.suite, cases, head.repeats), records, count, unfinished,
                  [f"{t.name}: {p}" for t in traces for p in t.parsed.problems])


def _repeat(r: int, repeats: int) -> str:
    return f" repeat {r}" if repeats > 1 else ""


def as_parsed(merged: Merged) -> ParsedTrace:
    """The merged run as the reader would return its trace (for commands that take one trace)."""
    return ParsedTrace(list(merged.records), list(merged.problems), [merged.header])
