"""One run's report, built from its trace records alone: the figures (`RunReport`) and the
tables and documents that `ds4-eval run --report` and `ds4-eval report` show. Pure.

Contract
- `latest_records(records) -> (records, superseded)`: the latest record of each (source, id,
  repeat), in the order the cases first appear (retries append, and the last record counts,
  as in `compare` and `repeats`). A record from a trace that predates statuses is graded
  from its own output and key (`regrade`), so old traces report like new ones.
- `build(records, label="", written="") -> RunReport`: provenance (the value most records
  share, with a note when they differ), pass rates per source and in total with their 95%
  interval, status counts, generated lengths, and, when any case was recorded more than once
  (`--repeats K`), the repeat summary of `ds4eval.verdict.repeats` (classes, pass@1 with its interval,
  pass@K, pass^K, flaky and non-deterministic cases), and the latency percentiles of the graded
  records (`ds4eval.run.latency`; None for traces written before latency was measured).
- Pass rate: passed / graded (PASSED or FAILED), the same footing as `--compare`; cases that
  ended SKIPPED, STOPPED or ERROR are counted apart. Without repeats the interval is the
  Wilson score interval; with repeats a case's repeats are not independent draws, so the
  figure is pass@1 (each case's share of passing repeats, averaged over cases) with the
  bootstrap interval over cases.
- Tables (`reports.document`), shared by every medium and by the comparison's page:
  `provenance_table`, `rates_table`, `latency_table`, `length_table`, `flaky_table`, `nondeterministic_table`,
  `case_list`, `repeat_blocks`; cells `status_cell`, `source_cell`, `picked_text`.
- Documents: both show the latency table (with the run's concurrency) after the pass rates
  when the trace carries latency. `summary_document(report)` without per-case outputs, sized for a CI log or a
  pull-request comment (lists of cases cut at MARKDOWN_ROWS rows, saying how many more);
  `page(report)` with plots and every case's question and output.
It reads no files (the CLI passes the trace's records and modification time) and renders
nothing: `reports.markdown` and `reports.html` write the documents.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence
from urllib.parse import quote

from ds4eval.reports.document import (Block, CaseDetail, CaseList, CaseRow, Cell, Code, Document, Heading, Histogram,
                                      IntervalPlot, Output, Section, Series, Table, Text, Title, row)
from ds4eval.run import latency as lt
from ds4eval.run.trace import TraceRecord
from ds4eval.verdict import regrade as rg
from ds4eval.verdict import repeats as rp
from ds4eval.verdict import stats

GRADED = ("PASSED", "FAILED")
STATUSES = ("PASSED", "FAILED", "SKIPPED", "STOPPED", "ERROR")
MARKDOWN_ROWS = 50  # rows of a case list in the markdown report before "and N more"


def latest_records(records: Iterable[TraceRecord]) -> tuple[list[TraceRecord], int]:
    kept, superseded = rg.latest(records)
    return [_with_status(r) for r in kept], superseded


def _with_status(r: TraceRecord) -> TraceRecord:
    if r.status is not None:
        return r
    rep = rg.regrade([r])
    if not rep.cases:
        return dataclasses.replace(r, status="")
    return dataclasses.replace(r, status=rep.cases[0].new_status, picked=rep.cases[0].new_picked)


@dataclass(frozen=True)
class SourceRate:
    """Pass rate of one source (or of all: source "TOTAL")."""

    source: str
    cases: int        # distinct cases
    records: int      # records: cases x repeats
    passed: int       # passing records
    graded: int       # graded records (PASSED or FAILED)
    no_answer: int    # failed records that found no answer at all
    rate: float | None  # passed / graded, or pass@1 with repeats; None when nothing was graded
    low: float | None
    high: float | None

    @property
    def ungraded(self) -> int:
        return self.records - self.graded


@dataclass(frozen=True)
class LengthStats:
    count: int
    total: int
    mean: float
    median: float
    p90: float
    max: int
    at_budget: int  # records that generated their whole budget (max_tokens)


@dataclass(frozen=True)
class RunReport:
    label: str
    written: str                   # when the trace was last written, if known
    records: tuple[TraceRecord, ...]  # the latest record of each case and repeat
    superseded: int                # earlier records of the same case and repeat (retries)
    provenance: tuple[tuple[str, str], ...]
    sources: tuple[SourceRate, ...]
    total: SourceRate
    statuses: dict[str, int]       # status -> records
    think_close: dict[str, int]    # think_close -> records, for records that thought
    lengths: LengthStats
    repeats: rp.RepeatSummary | None  # None unless some case was recorded more than once
    latency: lt.LatencySummary | None = None  # over the graded records; None when none measured it

    @property
    def repeated(self) -> bool:
        return self.repeats is not None

    def method(self) -> str:
        if self.repeated:
            return (f"pass@1: each case's share of passing repeats, averaged over cases; 95% CI: bootstrap "
                    f"over cases, {stats.BOOTSTRAP_RESAMPLES:,} resamples, seed {stats.BOOTSTRAP_SEED}; "
                    f"passed and graded count repeats")
        return "pass rate = passed / graded; 95% CI: Wilson score interval"

    def headline(self) -> str:
        t = self.total
        if t.rate is None:
            return f"no case was graded ({t.records} recorded)"
        what = "pass@1" if self.repeated else f"passed {t.passed} of {t.graded} graded"
        line = f"{what}: {pct(t.rate)} (95% CI {pct(t.low)}–{pct(t.high)})"
        if t.ungraded:
            line += f"; {t.ungraded} not graded"
        return line


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


# ---------------------------------------------------------------- building

def common(values: Sequence[str]) -> str:
    """The value most records share ("-" for empty), noting how many others there are."""
    if not values:
        return "-"
    counts = Counter(values)
    value, n = counts.most_common(1)[0]
    shown = value or "-"
    return shown if n == len(values) else f"{shown} (+{len(counts) - 1} other value(s))"


def _sampling(r: TraceRecord) -> str:
    if not r.temperature:
        return "greedy"
    return f"temperature {r.temperature:g}, top-p {r.top_p:g}, min-p {r.min_p:g}"


def _seeds(records: Sequence[TraceRecord]) -> str:
    seeds = sorted({r.seed for r in records if r.seed is not None})
    if not seeds:
        return ""
    return str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}..{seeds[-1]} ({len(seeds)} values)"


def _version(r: TraceRecord) -> str:
    if not r.git_commit:
        return r.ds4eval_version
    dirty = "+dirty" if r.git_commit.endswith("+dirty") else ""
    return f"{r.ds4eval_version} @ {r.git_commit[:12]}{dirty}"


# (row name, value of one record); rows whose value is empty in every record are left out.
_PROVENANCE = (
    ("suite", lambda r: r.suite),
    ("model", lambda r: r.model),
    ("model sha256", lambda r: r.model_sha256),
    ("backend", lambda r: r.backend),
    ("endpoint", lambda r: r.endpoint),
    ("served model", lambda r: r.served_model),
    ("device", lambda r: r.device),
    ("kv cache", lambda r: r.kv_type),
    ("concurrency", lambda r: str(r.concurrency or "")),
    ("sampling", _sampling),
    ("thinking", lambda r: "yes" if r.thinking else "no"),
    ("budget (max tokens)", lambda r: str(r.max_tokens or "")),
    ("ds4eval", _version),
    ("extractor", lambda r: r.extractor_version),
    ("chat template sha256", lambda r: r.chat_template_sha256),
    ("BOS/EOS", lambda r: r.bos_eos),
)


def _provenance(records: Sequence[TraceRecord], written: str, k: int) -> tuple[tuple[str, str], ...]:
    rows = []
    for name, value in _PROVENANCE:
        values = [value(r) for r in records]
        if any(values):
            rows.append((name, common(values)))
    seeds = _seeds(records)
    if seeds:
        rows.append(("seed", seeds))
    if k > 1:
        rows.append(("repeats", str(k)))
    if written:
        rows.append(("trace written", written))
    return tuple(rows)


def _rate(source: str, records: Sequence[TraceRecord], cases: Sequence[rp.CaseRepeats] | None) -> SourceRate:
    graded = [r for r in records if r.status in GRADED]
    passed = sum(r.status == "PASSED" for r in graded)
    no_answer = sum(r.status == "FAILED" and not r.picked for r in graded)
    ncases = len({(r.source, r.id) for r in records})
    rate = low = high = None
    if cases is not None:
        rates = [c.rate for c in cases if c.graded]
        if rates:
            iv = stats.bootstrap_mean(rates)
            rate, low, high = iv.mean, iv.low, iv.high
    elif graded:
        iv = stats.wilson(passed, len(graded))
        rate, low, high = iv.rate, iv.low, iv.high
    return SourceRate(source, ncases, len(records), passed, len(graded), no_answer, rate, low, high)


def _lengths(records: Sequence[TraceRecord]) -> LengthStats:
    values = [r.gen_tokens for r in records]
    if not values:
        return LengthStats(0, 0, 0.0, 0.0, 0.0, 0, 0)
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return LengthStats(len(values), sum(values), statistics.fmean(values), statistics.median(values), float(p90),
                       ordered[-1], sum(1 for r in records if r.max_tokens and r.gen_tokens >= r.max_tokens))


def build(records: Iterable[TraceRecord], label: str = "", written: str = "") -> RunReport:
    recs, superseded = latest_records(records)
    by_case = rp.group(recs)
    k = max((c.repeats for c in by_case), default=0)
    summary = rp.summarize(by_case) if k > 1 else None
    by_source: dict[str, list[TraceRecord]] = {}
    for r in recs:
        by_source.setdefault(r.source, []).append(r)
    cases_of: dict[str, list[rp.CaseRepeats]] = {}
    for c in by_case:
        cases_of.setdefault(c.source, []).append(c)
    sources = tuple(_rate(s, rs, cases_of[s] if summary else None) for s, rs in by_source.items())
    total = _rate("TOTAL", recs, by_case if summary else None)
    statuses = Counter(r.status or "?" for r in recs)
    think = Counter(r.think_close for r in recs if r.think_close != "none")
    return RunReport(label=label, written=written, records=tuple(recs), superseded=superseded,
                     provenance=_provenance(recs, written, k), sources=sources, total=total,
                     statuses={s: statuses[s] for s in (*STATUSES, *sorted(set(statuses) - set(STATUSES)))
                               if statuses[s]},
                     think_close=dict(think), lengths=_lengths(recs), repeats=summary,
                     latency=lt.summarize(r.latency() for r in recs if r.status in GRADED))


# ---------------------------------------------------------------- cells and tables (every medium)

def status_cell(status: str | None) -> Cell:
    shown = status or "?"
    return Cell(shown, style="status", tag=shown if shown in STATUSES else "other")


def source_cell(source: str) -> Cell:
    """A source's name, pointing at the view of its cases; the TOTAL row's name emphasised."""
    if source == "TOTAL":
        return Cell(source, style="strong")
    return Cell(source, link="source=" + quote(source, safe=""))


def picked_text(value: object) -> str:
    """A picked answer for display: "(none)" when none was found (None, empty, or a missing
    value of the comparison's table)."""
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "(none)"
    return str(value)


def provenance_table(report: RunReport) -> Table:
    return Table(("field", "value"), tuple(row(k, v) for k, v in report.provenance), "provenance-table", "kv")


def rates_table(report: RunReport) -> Table:
    """Pass rates per source (when there are several) and in total, with their intervals."""
    repeated = report.repeated
    columns = ("source", "cases", *(("records",) if repeated else ()), "passed", "graded", "not graded",
               "no answer", "pass@1" if repeated else "pass rate", "95% CI")
    shown = list(report.sources) if len(report.sources) > 1 else []
    rows = tuple(row(source_cell(s.source), s.cases, *((s.records,) if repeated else ()), s.passed, s.graded,
                     s.ungraded, s.no_answer, pct(s.rate),
                     "-" if s.rate is None else f"[{pct(s.low)}, {pct(s.high)}]")
                 for s in shown + [report.total])
    return Table(columns, rows, "rate-table")


def concurrency(report: RunReport) -> str:
    """The concurrency the records were run at ("?" when no record says)."""
    known = [str(r.concurrency) for r in report.records if r.concurrency]
    return common(known) if known else "?"


LATENCY_METHOD = ("nearest-rank percentiles over the graded cases, each case weighing one; ITL: each case's mean "
                  "gap between tokens, max: the longest single gap of any case")


def _seconds(p: lt.Percentiles | None, scale: float, digits: int) -> tuple[str, ...]:
    if p is None:
        return ("-",) * 5
    return (*(f"{v * scale:.{digits}f}" for v in (p.p50, p.p90, p.p99, p.max)), str(p.count))


def latency_table(s: lt.LatencySummary) -> Table:
    """TTFT and end to end in seconds, ITL in milliseconds (per token or per chunk, as measured)."""
    per = f" per {s.itl_per}" if s.itl_per in ("token", "chunk") else " (mixed units)" if s.itl_per else ""
    rows = (row("TTFT s", *_seconds(s.ttft, 1.0, 3)), row(f"ITL ms{per}", *_seconds(s.itl, 1000.0, 1)),
            row("e2e s", *_seconds(s.e2e, 1.0, 3)))
    return Table(("latency", "p50", "p90", "p99", "max", "cases"), rows, "latency-table")


def _latency_section(report: RunReport, key: str | None = None) -> list[Section]:
    if report.latency is None:
        return []
    note = Text((LATENCY_METHOD,), note=key is not None)
    blocks = (latency_table(report.latency), note)
    return [Section(f"Latency (concurrency {concurrency(report)})", blocks, key or "")]


def length_table(report: RunReport) -> Table:
    n = report.lengths
    return Table(("records", "total", "mean", "median", "90th percentile", "max", "used the whole budget"),
                 (row(n.count, n.total, f"{n.mean:.1f}", f"{n.median:g}", f"{n.p90:g}", n.max, n.at_budget),),
                 "length-table")


def repeat_line(s: rp.RepeatSummary) -> str:
    counts = ", ".join(f"{name} {s.counts[name]}" for name in rp.CLASSES)
    parts = [counts]
    if s.pass_at_1 is not None:
        p = s.pass_at_1
        parts.append(f"pass@1 {pct(p.mean)} (95% CI {pct(p.low)}–{pct(p.high)})")
    if s.pass_at_k is not None:
        parts.append(f"pass@{s.repeats} {pct(s.pass_at_k)}, pass^{s.repeats} {pct(s.pass_hat_k)} "
                     f"over the {s.full_cases} case(s) graded {s.repeats} times")
    return "; ".join(parts)


_LETTER = {"PASSED": "P", "FAILED": "F"}


def flaky_table(s: rp.RepeatSummary, key: str = "flaky-table") -> Table:
    """The flaky cases, with each repeat's status as a letter (P passed, F failed, - not graded)."""
    rows = tuple(row(c.name, f"{c.passed}/{c.graded}", c.repeats, pct(c.rate),
                     " ".join(_LETTER.get(r.status or "", "-") for r in c.records))
                 for c in s.flaky())
    return Table(("case", "passed", "repeats", "pass rate", "statuses"), rows, key)


def nondeterministic_table(s: rp.RepeatSummary, key: str = "nondeterministic-table") -> Table:
    """Greedy cases whose repeats differ: where the first differing repeat departs from repeat 0."""
    found = [c.difference.repeat for c in s.nondeterministic]
    # One heading serves every row, so it names the differing repeat only when all cases share it.
    other = f"repeat {found[0]} from there" if len(set(found)) == 1 else "differing repeat from there"
    rows = tuple(row(c.name, c.difference.repeat, c.difference.token, c.difference.char,
                     Cell(c.difference.base_text, style="code"), Cell(c.difference.other_text, style="code"))
                 for c in s.nondeterministic)
    return Table(("case", "repeat", "token", "char", "repeat 0 from there", other), rows, key)


def capped(table: Table, limit: int) -> tuple[Table | Text, ...]:
    """The table cut at `limit` rows, followed by a line saying how many more there are."""
    if len(table.rows) <= limit:
        return (table,)
    return (dataclasses.replace(table, rows=table.rows[:limit]), Text((f"... and {len(table.rows) - limit} more",)))


def case_list(report: RunReport) -> CaseList:
    """A row per case and repeat, each with its question and output."""
    columns = ("#", "case", *(("repeat",) if report.repeated else ()), "status", "picked", "expected", "tokens",
               "think")
    rows = []
    for k, r in enumerate(report.records, 1):
        cells = row(r.index, f"{r.source}/{r.id}", *((r.repeat,) if report.repeated else ()), status_cell(r.status),
                    picked_text(r.picked), r.expected, r.gen_tokens,
                    "" if r.think_close == "none" else r.think_close).cells
        detail = CaseDetail(r.question_prompt, (Output("Output", r.model_output, r.error),))
        rows.append(CaseRow(f"case-{k}", r.source, r.status or "?", cells, detail))
    present = [s for s in STATUSES if s in report.statuses] + [s for s in report.statuses if s not in STATUSES]
    statuses = tuple((s, s) for s in dict.fromkeys([*STATUSES[:2], *present]))
    return CaseList(columns, tuple(rows), tuple(dict.fromkeys(r.source for r in report.records)), (("", statuses),))


def repeat_blocks(s: rp.RepeatSummary, side: str = "") -> tuple[Block, ...]:
    """A page's account of one run's repeats; `side` ("base", "new") names the run in a comparison."""
    prefix = f"{side}-" if side else ""
    blocks: list[Block] = [Text((repeat_line(s),))]
    flaky = flaky_table(s, f"{prefix}flaky-table")
    if flaky.rows:
        blocks += [Heading(f"{side + ' ' if side else ''}flaky cases"),
                   Text(("statuses by repeat: P passed, F failed, - not graded",), note=True), flaky]
    else:
        blocks.append(Text(("no flaky case: every case passed all its graded repeats or none",), note=True))
    nondet = nondeterministic_table(s, f"{prefix}nondeterministic-table")
    if nondet.rows:
        blocks += [Heading("greedy cases whose repeats differ"), nondet]
    return tuple(blocks)


# ---------------------------------------------------------------- documents

def _title(report: RunReport) -> Title:
    return ("ds4-eval report: ", Code(report.label)) if report.label else ("ds4-eval report",)


def _statuses_line(report: RunReport) -> str:
    line = "statuses: " + ", ".join(f"{s} {n}" for s, n in report.statuses.items())
    if report.superseded:
        line += f"; {report.superseded} earlier record(s) superseded by retries"
    return line


def _thinking_line(report: RunReport) -> str:
    return ("thinking closed: " + ", ".join(f"{k} {v}" for k, v in sorted(report.think_close.items()))
            if report.think_close else "")


def _provenance_blocks(report: RunReport) -> tuple[Block, ...]:
    table = provenance_table(report)
    return (table,) if table.rows else ()


def summary_document(report: RunReport) -> Document:
    """The report without per-case outputs, sized for a CI log or a pull-request comment: lists
    of cases are cut at MARKDOWN_ROWS rows."""
    think = _thinking_line(report)
    sections = [
        Section("Run", _provenance_blocks(report)),
        Section("Pass rates", (rates_table(report), Text((report.method(),)), Text((_statuses_line(report),)))),
        *_latency_section(report),
        Section("Generated tokens", (length_table(report), *((Text((think,)),) if think else ()))),
    ]
    s = report.repeats
    if s is not None:
        blocks: list[Block] = [Text((repeat_line(s),))]
        flaky = flaky_table(s)
        if flaky.rows:
            blocks += [Text(("Flaky cases (statuses by repeat: P passed, F failed, - not graded):",)),
                       *capped(flaky, MARKDOWN_ROWS)]
        nondet = nondeterministic_table(s)
        if nondet.rows:
            blocks += [Text(("Greedy cases whose repeats differ (first differing token):",)),
                       *capped(nondet, MARKDOWN_ROWS)]
        sections.append(Section(f"Repeats (K = {s.repeats})", tuple(blocks)))
    return Document(_title(report), tuple(sections), Cell(report.headline(), style="headline"))


def page(report: RunReport) -> Document:
    """The whole run on one page: the figures, their plots and every case with its output."""
    shown = (list(report.sources) if len(report.sources) > 1 else []) + [report.total]
    plotted = tuple((s.source, s.rate, s.low, s.high) for s in shown if s.rate is not None)
    think = _thinking_line(report)
    sections = [
        Section("Run", _provenance_blocks(report), "provenance"),
        Section("Pass rates", (rates_table(report), Text((report.method(),), note=True),
                               Text((_statuses_line(report),), note=True),
                               *((IntervalPlot("rate-plot", "pass rate with its 95% interval", plotted, 0.0, 1.0),)
                                 if plotted else ())), "rates"),
        *_latency_section(report, "latency"),
        Section("Generated tokens", (length_table(report), *((Text((think,), note=True),) if think else ()),
                                     Histogram("length-histogram", "generated tokens per case",
                                               (Series("cases", tuple(r.gen_tokens for r in report.records),
                                                       "run"),))), "lengths"),
    ]
    if report.repeats is not None:
        sections.append(Section(f"Repeats (K = {report.repeats.repeats})", repeat_blocks(report.repeats), "repeats"))
    sections.append(Section("Cases", (case_list(report),), "cases"))
    return Document(_title(report), tuple(sections), Cell(report.headline(), style="headline"))
