"""The tables and documents of a `compare.Comparison`: what the terminal, a CI log, the HTML page
and a program (JSON) are shown. Pure.

Contract
- Tables (`reports.document`), each a pure function of the Comparison: `runs_table`,
  `rates_table`, `flips_table`, `time_table`, `lengths_table`, `differences_table`, and, when
  both runs have repeats, `repeat_case_table` (k/K on each side, Fisher p, class change,
  smallest p first). Cases point at their row of the page's case list (`case_anchors`).
- Documents: `text_document(cmp)` for a terminal (no per-case repeat table: it lists only the
  cases that moved), `markdown_document(cmp)` for CI logs and pull requests (the per-case
  table cut at MARKDOWN_CASE_ROWS rows), and `page(cmp, written)` for the HTML page, which
  adds both runs' provenance, plots, each side's repeats and every matched case with the
  question and both outputs from the records the Comparison's runs were read from (none for
  a summary).
- `as_json(cmp) -> dict`: the Comparison as plain data, numbers unformatted (the JSON format),
  with each side's token counting rule (`token_counting`).
- `time_table` says when its token figures are of the rule both runs were brought to (one
  side counted the end-of-sequence token and the other did not: `compare.TokenCounting`).
- `flip_summary(cmp)` and `method_note(cmp)`: the one-line texts under Flips and Pass rates;
  `assurance_lines(cmp)` (the smallest detectable drop, the equivalence test when asked) and
  `holm_table(cmp)` (each source's test, Holm-adjusted, when there are several sources): the
  section "Power and equivalence" of every medium; the text report repeats the power line
  under its verdict.
- `time_table`: when both runs are traces that carry latency, it adds each side's TTFT, ITL
  and end-to-end p50/p90 per source (`ds4eval.run.latency.summarize` over the latest record
  of every repeat of the comparable cases that were graded), so a serial run compared with
  one under load shows what the load cost beside what it changed.
It computes no statistic of its own: every figure comes from the Comparison, the run figures
from `reports.run` and the latency percentiles from `run.latency`; it renders nothing
(`reports.text`, `reports.markdown`, `reports.html`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Iterable, Sequence

from ds4eval.reports import run as run_report
from ds4eval.reports.document import (Block, Bullets, CaseDetail, CaseList, CaseRow, Cell, Code, Document, Folded,
                                      Heading, Histogram, IntervalPlot, Output, Preformatted, Section, Series, Table,
                                      Text, Title, row)
from ds4eval.reports.run import picked_text, source_cell, status_cell
from ds4eval.run import latency as lt
from ds4eval.run.trace import TraceRecord
from ds4eval.verdict.compare import Comparison, Flip, RenderDiff, RepeatCase, RepeatComparison, Run, SourceStats

ARROW = {"pass->fail": "pass→fail", "fail->pass": "fail→pass"}
REPEAT_COLUMNS = ("case", "BASE k/K", "NEW k/K", "BASE class", "NEW class", "Fisher p (drop)", "Fisher p (rise)")
CASE_TABLE_COLUMNS = ("case", "BASE k/K", "NEW k/K", "Fisher p", "class BASE → NEW", "change")
MARKDOWN_CASE_ROWS = 50  # the per-case table of a markdown report stops here (the HTML page has all)
STATUSES = run_report.STATUSES


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _pp(x: float) -> str:
    return f"{100 * x:+.1f}"


def _p(x: float) -> str:
    return f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


def _picked(p: str | None) -> str:
    p = "" if p is None else p
    return "(none)" if not p else (p if len(p) <= 40 else p[:37] + "...")


def _moved(base: float, new: float, fmt: str) -> str:
    return f"{base:{fmt}} → {new:{fmt}} ({new - base:+{fmt}})"


def _common(values: list[str]) -> str:
    """The value most cases of a run share, with a note when they do not all share it."""
    counts = Counter(values)
    value, n = counts.most_common(1)[0]
    value = value or "-"
    return value if n == len(values) else f"{value} (+{len(counts) - 1} other value(s))"


def _shown_sources(cmp: Comparison) -> list[SourceStats]:
    return (cmp.sources if len(cmp.sources) > 1 else []) + [cmp.total]


def case_anchors(cmp: Comparison) -> dict[tuple[str, str], str]:
    """(source, id) of every matched case -> the anchor of its row in the page's case list."""
    c = cmp.cases
    return {(s, i): f"case-{k}" for k, (s, i) in enumerate(zip(c["source"], c["id"]), 1)}


# ---------------------------------------------------------------- tables (every medium)

def _run_row(run: Run) -> tuple[object, ...]:
    cols = list(zip(*((c.model, c.model_sha256[:12], c.setting("backend"), c.setting("kv_type"),
                       c.setting("ds4eval_version"), c.setting("git_commit")) for c in run.cases.values())))
    model, sha, backend, kv, version, commit = map(_common, cols)
    dirty = "+dirty" if commit.endswith("+dirty") else ""
    return (run.label, run.kind, run.suite or "-", len(run.cases), model, sha, backend, kv,
            version + (f" @ {commit[:12]}{dirty}" if commit != "-" else ""))


def runs_table(cmp: Comparison) -> Table:
    return Table(("run", "kind", "suite", "cases", "model", "model sha256", "backend", "kv cache", "ds4eval"),
                 (row(*_run_row(cmp.base)), row(*_run_row(cmp.new))), "runs-table")


def rates_table(cmp: Comparison) -> Table:
    """Paired pass rates per source (when there are several) and in total, with the delta's
    interval and McNemar's test."""
    rows = []
    for s in _shown_sources(cmp):
        iv = s.interval
        rows.append(row(source_cell(s.source), s.cases, f"{s.base_passed}/{s.cases} ({_pct(s.base_rate)})",
                        f"{s.new_passed}/{s.cases} ({_pct(s.new_rate)})", _pp(iv.delta),
                        f"[{_pp(iv.low)}, {_pp(iv.high)}]", s.pass_fail, s.fail_pass, _p(s.test.p_exact),
                        _p(s.test.mid_p)))
    return Table(("source", "cases", "BASE passed", "NEW passed", "delta pp", "95% CI pp", "pass→fail", "fail→pass",
                  "McNemar p", "mid-p"), tuple(rows), "rate-table")


# The latency columns of the time table: (heading, LatencySummary attribute, scale, decimals).
_LATENCY_COLUMNS = (("TTFT p50/p90 s", "ttft", 1.0, 3), ("ITL p50/p90 ms", "itl", 1000.0, 1),
                    ("e2e p50/p90 s", "e2e", 1.0, 3))


def _latency_by_source(cmp: Comparison, run: Run) -> dict[str, lt.LatencySummary]:
    """Source (and "TOTAL") -> latency of the run's graded records of the comparable cases."""
    c = cmp.cases
    keep = {(src, cid) for src, cid, out in zip(c["source"], c["id"], c["excluded"]) if not out}
    recs, _ = run_report.latest_records(r for r in run.records if (r.source, r.id) in keep)
    graded = [r for r in recs if r.status in run_report.GRADED]
    by_source: dict[str, list] = {"TOTAL": graded}
    for r in graded:
        by_source.setdefault(r.source, []).append(r)
    found = {src: lt.summarize(r.latency() for r in rs) for src, rs in by_source.items()}
    return {src: s for src, s in found.items() if s is not None}


def _p50_p90(s: lt.LatencySummary | None, figure: str, scale: float, digits: int) -> str:
    p = getattr(s, figure) if s is not None else None
    return "-" if p is None else f"{p.p50 * scale:.{digits}f}/{p.p90 * scale:.{digits}f}"


def time_table(cmp: Comparison) -> Table:
    """Tokens and time per source, BASE → NEW; with latency on both sides, its p50/p90 too."""
    base, new = _latency_by_source(cmp, cmp.base), _latency_by_source(cmp, cmp.new)
    timed = "TOTAL" in base and "TOTAL" in new
    rows = []
    for s in _shown_sources(cmp):
        cells = [s.source, _moved(s.base_gen_tokens, s.new_gen_tokens, "d"), _moved(s.base_gen_s, s.new_gen_s, ".1f"),
                 _moved(s.base_tok_s, s.new_tok_s, ".1f"), _moved(s.base_prompt_tokens, s.new_prompt_tokens, "d")]
        if timed:
            cells += [f"{_p50_p90(base.get(s.source), f, k, d)} → {_p50_p90(new.get(s.source), f, k, d)}"
                      for _, f, k, d in _LATENCY_COLUMNS]
        rows.append(row(*cells))
    latency = tuple(h for h, *_ in _LATENCY_COLUMNS) if timed else ()
    # When the runs count the end-of-sequence token differently, the figures are of the shared rule.
    generated = "generated tokens (without end-of-sequence)" if cmp.counting.aligned else "generated tokens"
    return Table(("source", generated, "generation s", "tokens/s", "prompt tokens", *latency), tuple(rows),
                 "time-table")


def _flip_row(f: Flip, anchor: str) -> tuple[object, ...]:
    expected = f.base_expected if f.base_expected == f.new_expected else f"{f.base_expected} | {f.new_expected}"
    if f.direction == "pass->fail":
        kind = "no answer found" if f.no_answer else "wrong answer"
    else:
        kind = "was no answer" if f.no_answer else "was a wrong answer"
    return (ARROW[f.direction], Cell(f.name, link=anchor), _picked(f.base_picked), _picked(f.new_picked), expected,
            kind)


def flips_table(cmp: Comparison) -> Table:
    anchors = case_anchors(cmp)
    return Table(("flip", "case", "BASE picked", "NEW picked", "expected", "kind"),
                 tuple(row(*_flip_row(f, anchors[(f.source, f.id)])) for f in cmp.flips), "flip-table")


def lengths_table(cmp: Comparison) -> Table:
    rows = tuple(row(f"{c.source}/{c.id}", _moved(c.base_gen_tokens, c.new_gen_tokens, "d"), c.base_status,
                     c.new_status) for c in cmp.length_changes)
    return Table(("case", "generated tokens", "BASE", "NEW"), rows, "lengths-table")


def differences_table(cmp: Comparison) -> Table:
    rows = tuple(row(d.field, d.base, d.new, d.cases) for d in cmp.differences)
    return Table(("field", "BASE", "NEW", "cases"), rows, "differences-table")


def _repeat_list_table(cases: Sequence[RepeatCase]) -> Table:
    return Table(REPEAT_COLUMNS, tuple(row(r.name, f"{r.base_passed}/{r.base_graded}", f"{r.new_passed}/{r.new_graded}",
                                           r.base_class, r.new_class, _p(r.p_drop), _p(r.p_rise)) for r in cases))


def both_repeated(rc: RepeatComparison | None) -> bool:
    """Whether both runs have repeats, so that every case has a k/K on each side to compare."""
    return rc is not None and rc.base_repeats > 1 and rc.new_repeats > 1


def _movement_tag(change: str) -> str:
    if change.startswith("regressed"):
        return "bad"
    if change.startswith("improved"):
        return "good"
    return "flaky" if "flaky" in change else "same" if not change else "moved"


def repeat_case_table(cmp: Comparison, limit: int | None = None, unmoved: str = "") -> Table:
    """Every comparable case's k/K on both sides, the smallest Fisher p first (`limit` rows at
    most), sortable by any column; `unmoved` is what a case whose pass share did not move shows
    under "change"."""
    rc = cmp.repeats
    anchors = case_anchors(cmp)
    rows = []
    for r in rc.ranked()[:limit]:
        change = rc.change(r)
        classes = r.base_class if r.base_class == r.new_class else f"{r.base_class} → {r.new_class}"
        tag = _movement_tag(change)
        rows.append(row(Cell(r.name, link=anchors.get((r.source, r.id), ""), sort=r.name),
                        Cell(f"{r.base_passed}/{r.base_graded}", sort=f"{r.base_rate:.6f}"),
                        Cell(f"{r.new_passed}/{r.new_graded}", sort=f"{r.new_rate:.6f}"),
                        Cell(_p(r.p), sort=f"{r.p:.6e}"), Cell(classes, sort=classes),
                        Cell(change or unmoved, style="movement", tag=tag, sort=change), data=(("change", tag),)))
    return Table(CASE_TABLE_COLUMNS, tuple(rows), "repeat-case-table", "sortable")


def repeat_case_note(rc: RepeatComparison, shown: int, alpha: float) -> str:
    """One line under the per-case table: what p is and how many rows are shown."""
    cut = f"; the {shown} smallest p of {len(rc.cases)} cases" if shown < len(rc.cases) else ""
    return ("Fisher p: Fisher's exact test of the k/K counts, one-sided in the direction the pass share "
            f"moved; regressed / improved: p < {alpha:g}{cut}")


# ---------------------------------------------------------------- lines

def flip_summary(cmp: Comparison) -> str:
    """One line: the flips by kind and the unparsed answers on each side."""
    t = cmp.total
    return (f"pass→fail {t.pass_fail} ({t.pass_fail - t.pass_fail_no_answer} wrong answer, "
            f"{t.pass_fail_no_answer} no answer found); fail→pass {t.fail_pass} "
            f"({t.fail_pass_no_answer} of them had found no answer in BASE); no answer found among failures: "
            f"BASE {t.base_no_answer}, NEW {t.new_no_answer}")


def method_note(cmp: Comparison) -> str:
    """One line: what the delta, its interval and the p-values are."""
    iv = cmp.total.interval
    return (f"delta = NEW rate - BASE rate on the {cmp.total.cases} comparable cases; 95% CI: paired bootstrap "
            f"over cases, {iv.resamples:,} resamples, seed {iv.seed}; p: exact McNemar (two-sided binomial test "
            f"of the {cmp.total.test.discordant} discordant cases), mid-p beside it")


def power_line(cmp: Comparison) -> str:
    """What the verdict could see: the smallest drop it would have caught with the stated power."""
    a = cmp.assurance
    noise = f"{a.cases} comparable cases and {'estimated noise' if cmp.repeats else 'observed discordance'} " \
            f"{a.discordance:.3f}"
    if a.detectable_drop is None:
        return (f"power: at {noise}, no drop is caught with probability {a.power:g} (alpha {cmp.alpha:g}); "
                f"\"no significant regression\" says nothing about regressions here")
    return (f"power: at {noise}, a drop of {100 * a.detectable_drop:.1f} points or more is caught with "
            f"probability {a.power:g} (alpha {cmp.alpha:g}); smaller drops can pass unseen")


def equivalence_line(cmp: Comparison) -> str:
    e = cmp.assurance.equivalence
    head = f"equivalence within ±{100 * e.margin:g} points"
    test = f"TOST p = {_p(e.p)}, change {_pp(e.delta)} points"
    if e.equivalent:
        return f"{head}: shown ({test} < alpha {e.alpha:g})"
    return f"{head}: not shown ({test}, alpha {e.alpha:g}): the change may be {100 * e.margin:g} points or more"


def assurance_lines(cmp: Comparison) -> tuple[str, ...]:
    a = cmp.assurance
    if a is None:
        return ()
    return (power_line(cmp),) + ((equivalence_line(cmp),) if a.equivalence is not None else ())


def holm_table(cmp: Comparison) -> Table:
    rows = tuple(row(source_cell(t.source), t.worse, t.better, _p(t.p), _p(t.adjusted),
                     Cell("yes" if t.regression else "no", tag="bad" if t.regression else "good"))
                 for t in cmp.assurance.sources)
    worse = "cases lower" if cmp.repeats else "pass→fail"
    better = "cases higher" if cmp.repeats else "fail→pass"
    return Table(("source", worse, better, "p", "Holm p", "significant regression"), rows, "holm-table")


def holm_note(cmp: Comparison) -> str:
    hit = [t.source for t in cmp.assurance.sources if t.regression]
    return (f"per-source tests ({'sign test' if cmp.repeats else 'exact McNemar'}) with Holm's step-down over "
            f"{len(cmp.assurance.sources)} sources, family-wise error <= alpha {cmp.alpha:g}; significant "
            f"regressions after Holm: {', '.join(hit) if hit else 'none'} (reported; the exit status follows "
            f"the total)")


def _assurance_blocks(cmp: Comparison, note: bool = False) -> tuple[Block, ...]:
    blocks: list[Block] = [Text(assurance_lines(cmp))]
    if cmp.assurance.sources:
        blocks += [holm_table(cmp), Text((holm_note(cmp),), note=note)]
    return tuple(blocks)


def _lost_line(cmp: Comparison) -> str:
    return f"lost passes (passed in BASE, no verdict in NEW): {', '.join(cmp.lost_passes)}"


def _repeat_lines(rc: RepeatComparison, alpha: float) -> tuple[str, str]:
    iv, t = rc.interval, rc.test
    return (f"repeats: BASE {rc.base_repeats}, NEW {rc.new_repeats}; pass@1 (mean share of passing repeats) "
            f"BASE {_pct(rc.base_pass_at_1)}, NEW {_pct(rc.new_pass_at_1)}, delta {_pp(iv.mean)} pp "
            f"(95% CI [{_pp(iv.low)}, {_pp(iv.high)}], bootstrap over cases, {iv.resamples:,} resamples, "
            f"seed {iv.seed})",
            f"cases passing less often {t.b}, more often {t.c} (sign test, exact p {_p(t.p_exact)}, mid-p "
            f"{_p(t.mid_p)}); per case: Fisher's exact test of k/K on both sides, alpha {alpha:g}")


def _piece(p: str) -> str:
    return p.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _context(d: RenderDiff, side: tuple[str, ...]) -> str:
    if d.position is None:
        return _piece(side[0]) if side else ""
    shown = []
    for i, p in enumerate(side, d.context_start):
        shown.append(f"⟦{_piece(p)}⟧" if i == d.position else _piece(p))
    if not side or d.context_start + len(side) <= d.position:
        shown.append("⟦(end)⟧")
    lead = "…" if d.context_start > 0 else ""
    return lead + "|".join(shown) + "|…"


def _diff_cases(d: RenderDiff) -> str:
    return ", ".join(d.cases[:4]) + (f" and {len(d.cases) - 4} more" if len(d.cases) > 4 else "")


def _render_diff_lines(d: RenderDiff) -> list[str]:
    where = f"first difference at token {d.position}" if d.position is not None else d.note
    lines = [f"{len(d.cases)} case(s) ({_diff_cases(d)}): {where} (BASE {d.base_tokens} tokens, NEW {d.new_tokens})"]
    if d.base_context or d.new_context:
        lines += [f"  BASE {_context(d, d.base_context)}", f"  NEW  {_context(d, d.new_context)}"]
    return lines


# ---------------------------------------------------------------- text and markdown

def _report_sections(cmp: Comparison, case_table: bool) -> list[Section]:
    """The sections of the text and markdown reports, in display order. The per-case table of a
    repeat comparison (`case_table`) is for reports read as pages, not for terminals."""
    first = " (repeat 0 of each case)" if cmp.repeats is not None else ""
    out = [Section("Runs", (runs_table(cmp),))]
    rc = cmp.repeats
    if rc is not None:
        out.append(Section("Repeats", (Text(_repeat_lines(rc, cmp.alpha)),)))
        for title, cases in (("Significant drops", rc.drops), ("Significant rises", rc.rises),
                             ("Flaky in BASE, lower in NEW, not significant (not a regression)", rc.flaky_drops),
                             ("Became flaky", rc.became_flaky), ("Stopped being flaky", rc.stopped_flaky)):
            if cases:
                out.append(Section(title, (_repeat_list_table(cases),)))
    if case_table and both_repeated(rc):
        table = repeat_case_table(cmp, MARKDOWN_CASE_ROWS)
        out.append(Section("Per case, by Fisher p", (table, Text((repeat_case_note(rc, len(table.rows), cmp.alpha),)))))
    out.append(Section("Pass rates" + first, (rates_table(cmp), Text((method_note(cmp),)))))
    if cmp.assurance is not None:
        out.append(Section("Power and equivalence", _assurance_blocks(cmp)))
    flips: list[Block] = [Text((flip_summary(cmp),))]
    if cmp.flips:
        flips.append(flips_table(cmp))
    if cmp.lost_passes:
        flips.append(Text((_lost_line(cmp),)))
    out.append(Section("Flips" + first, tuple(flips)))
    out.append(Section("Tokens and time", (time_table(cmp),)))
    if cmp.length_changes:
        out.append(Section("Largest changes in generated length", (lengths_table(cmp),)))
    if cmp.differences:
        out.append(Section("What differs between the runs", (differences_table(cmp),)))
    if cmp.render_diffs:
        out.append(Section("Render diff", (Preformatted(tuple(line for d in cmp.render_diffs
                                                             for line in _render_diff_lines(d))),)))
    if cmp.issues:
        out.append(Section("Warnings", (Bullets(tuple(i.message for i in cmp.issues)),)))
    return out


def text_document(cmp: Comparison) -> Document:
    title: Title = ("ds4-eval --compare  BASE ", Code(cmp.base.label), "  NEW ", Code(cmp.new.label))
    verdict = (cmp.verdict,) + ((power_line(cmp),) if cmp.assurance is not None else ())
    return Document(title, (*_report_sections(cmp, case_table=False), Section("Verdict", (Text(verdict),))))


def _title(cmp: Comparison) -> Title:
    return ("ds4-eval --compare: ", Code(cmp.base.label), " → ", Code(cmp.new.label))


def _verdict(cmp: Comparison) -> Cell:
    return Cell(cmp.verdict, style="verdict", tag="bad" if cmp.exit_status else "good")


def markdown_document(cmp: Comparison) -> Document:
    return Document(_title(cmp), tuple(_report_sections(cmp, case_table=True)), _verdict(cmp))


# ---------------------------------------------------------------- the page

def _last_by_case(records: Iterable[TraceRecord]) -> dict[tuple[str, str], TraceRecord]:
    # The comparison counts a case by its last record (retries append); so does this page.
    out: dict[tuple[str, str], TraceRecord] = {}
    for r in records:
        out[(r.source, r.id)] = r
    return out


def _provenance_pair(base: run_report.RunReport, new: run_report.RunReport) -> Table:
    b, n = dict(base.provenance), dict(new.provenance)
    rows = []
    for key in dict.fromkeys([*b, *n]):
        bv, nv = b.get(key, "-"), n.get(key, "-")
        rows.append(row(key, bv, nv if nv != bv else Cell(nv, style="same")))
    return Table(("field", "BASE", "NEW"), tuple(rows), "provenance-table", "kv")


def _runs_blocks(cmp: Comparison, base: run_report.RunReport | None,
                 new: run_report.RunReport | None) -> tuple[Block, ...]:
    blocks: list[Block] = [runs_table(cmp)]
    if base and new:
        b, n = dict(base.provenance), dict(new.provenance)
        line = "; ".join(f"{k}: BASE {b.get(k, '-')}, NEW {n.get(k, '-')}" for k in ("sampling", "trace written")
                         if k in b or k in n)
        differ = sum(b.get(k) != n.get(k) for k in dict.fromkeys([*b, *n]))
        if line:
            blocks.append(Text((line,), note=True))
        blocks.append(Folded(f"provenance of both runs ({differ} field(s) differ; NEW values equal to BASE dimmed)",
                             (_provenance_pair(base, new),)))
    if cmp.differences:
        blocks += [Heading("what differs between the runs"), differences_table(cmp)]
    return tuple(blocks)


def _delta_plot(cmp: Comparison) -> IntervalPlot:
    rows = tuple((s.source, s.interval.delta, s.interval.low, s.interval.high) for s in _shown_sources(cmp))
    reach = max([0.05] + [max(abs(r[2]), abs(r[3])) for r in rows])
    reach = min(1.0, math.ceil(reach * 20) / 20)
    return IntervalPlot("delta-plot", "NEW − BASE pass rate, points, with the paired 95% interval", rows, -reach,
                        reach, zero=0.0, signed=True)


def _change(case) -> tuple[str, str]:
    """(filter token, shown text) of one matched case (a row of `Comparison.cases`)."""
    if case.excluded:
        return "excluded", f"excluded ({case.excluded})"
    if case.base_status == "PASSED" and case.new_status != "PASSED":
        return "pass-fail", "pass→fail"
    if case.new_status == "PASSED" and case.base_status != "PASSED":
        return "fail-pass", "fail→pass"
    return "same", "same"


def _side(side: str, r: TraceRecord | None) -> Output:
    if r is None:
        return Output(side, None, missing="no output recorded (a summary, not a trace)")
    return Output(f"{side} · {r.status or '?'} · picked {picked_text(r.picked)} · {r.gen_tokens} tokens",
                  r.model_output, r.error)


def _case_list(cmp: Comparison) -> CaseList:
    """Every matched case, BASE and NEW side by side; outputs from the runs' own records."""
    base_by, new_by = _last_by_case(cmp.base.records), _last_by_case(cmp.new.records)
    rows = []
    for k, c in enumerate(cmp.cases.itertuples(index=False), 1):
        token, shown = _change(c)
        b, n = base_by.get((c.source, c.id)), new_by.get((c.source, c.id))
        either = b or n
        expected = c.base_expected if c.base_expected == c.new_expected else f"{c.base_expected} | {c.new_expected}"
        cells = row(either.index if either else k, f"{c.source}/{c.id}", status_cell(c.base_status),
                    status_cell(c.new_status), Cell(shown, style="change", tag=token), picked_text(c.base_picked),
                    picked_text(c.new_picked), expected, f"{c.base_gen_tokens} → {c.new_gen_tokens}").cells
        detail = CaseDetail(either.question_prompt if either else "", (_side("BASE", b), _side("NEW", n)), paired=True)
        rows.append(CaseRow(f"case-{k}", c.source, f"{c.new_status or '?'} base-{c.base_status or '?'} {token}", cells,
                            detail))
    groups = (("NEW status", tuple((s, f"NEW {s}") for s in STATUSES)),
              ("BASE status", tuple((f"base-{s}", f"BASE {s}") for s in STATUSES)),
              ("change", (("pass-fail", "pass→fail"), ("fail-pass", "fail→pass"), ("same", "same verdict"),
                          ("excluded", "excluded"))))
    return CaseList(("#", "case", "BASE", "NEW", "change", "BASE picked", "NEW picked", "expected", "tokens"),
                    tuple(rows), tuple(dict.fromkeys(cmp.cases["source"])), groups)


def _tokens_cell(context: Sequence[str], start: int, position: int | None) -> Cell:
    if position is None:
        return Cell(context[0], style="code") if context else Cell("")
    return Cell("|".join(context), style="tokens", pieces=tuple(context), marked=position - start)


def _render_diff_table(cmp: Comparison) -> Table:
    rows = tuple(row(_diff_cases(d), d.note if d.position is None else f"token {d.position}",
                     _tokens_cell(d.base_context, d.context_start, d.position),
                     _tokens_cell(d.new_context, d.context_start, d.position)) for d in cmp.render_diffs)
    return Table(("cases", "first difference", "BASE", "NEW"), rows, "render-diff-table")


def page(cmp: Comparison, written: tuple[str, str] = ("", "")) -> Document:
    """The comparison on one page, each run's figures from its own records (`reports.run`)."""
    base = run_report.build(cmp.base.records, cmp.base.label, written[0]) if cmp.base.records else None
    new = run_report.build(cmp.new.records, cmp.new.label, written[1]) if cmp.new.records else None
    c = cmp.cases
    lengths: list[Block] = [time_table(cmp), Histogram(
        "length-histogram", "generated tokens per matched case, BASE and NEW overlaid",
        (Series("BASE", tuple(c["base_gen_tokens"].astype(int).tolist()), "base"),
         Series("NEW", tuple(c["new_gen_tokens"].astype(int).tolist()), "new")))]
    if cmp.length_changes:
        lengths += [Heading("largest changes in generated length"), lengths_table(cmp)]
    flips: list[Block] = [Text((flip_summary(cmp),), note=True), flips_table(cmp)]
    if cmp.lost_passes:
        flips.append(Text((_lost_line(cmp),), note=True))
    sections = [
        Section("Runs", _runs_blocks(cmp, base, new), "provenance"),
        Section("Pass rates", (rates_table(cmp), Text((method_note(cmp),), note=True), _delta_plot(cmp)), "rates"),
        *((Section("Power and equivalence", _assurance_blocks(cmp, note=True), "assurance"),)
          if cmp.assurance is not None else ()),
        Section("Generated tokens", tuple(lengths), "lengths"),
        Section("Flips", tuple(flips), "flips"),
    ]
    if both_repeated(cmp.repeats):
        table = repeat_case_table(cmp, unmoved="same")
        note = repeat_case_note(cmp.repeats, len(table.rows), cmp.alpha) + "; click a heading to sort by it"
        sections.append(Section("Per case over the repeats, by Fisher p", (table, Text((note,), note=True)),
                                "repeat-cases"))
    for side, rep in (("BASE", base), ("NEW", new)):
        if rep is not None and rep.repeats is not None:
            sections.append(Section(f"{side} repeats (K = {rep.repeats.repeats})",
                                    run_report.repeat_blocks(rep.repeats, side.lower()), f"repeats-{side.lower()}"))
    if cmp.render_diffs:
        sections.append(Section("Render diff", (_render_diff_table(cmp),), "render-diff"))
    if cmp.issues:
        sections.append(Section("Warnings", (Bullets(tuple(i.message for i in cmp.issues)),), "warnings"))
    sections.append(Section("Cases", (_case_list(cmp),), "cases"))
    return Document(_title(cmp), tuple(sections), _verdict(cmp))


# ---------------------------------------------------------------- JSON

def _stats_json(s: SourceStats) -> dict:
    iv, t = s.interval, s.test
    return {"source": s.source, "cases": s.cases, "base_passed": s.base_passed, "new_passed": s.new_passed,
            "base_rate": s.base_rate, "new_rate": s.new_rate, "delta": iv.delta,
            "interval": {"low": iv.low, "high": iv.high, "level": iv.level, "resamples": iv.resamples,
                         "seed": iv.seed},
            "mcnemar": {"pass_fail": t.b, "fail_pass": t.c, "p_exact": t.p_exact, "mid_p": t.mid_p},
            "pass_fail_no_answer": s.pass_fail_no_answer, "fail_pass_no_answer": s.fail_pass_no_answer,
            "base_no_answer": s.base_no_answer, "new_no_answer": s.new_no_answer,
            "base_gen_tokens": s.base_gen_tokens, "new_gen_tokens": s.new_gen_tokens,
            "base_gen_s": round(s.base_gen_s, 3), "new_gen_s": round(s.new_gen_s, 3),
            "base_tokens_per_s": round(s.base_tok_s, 2), "new_tokens_per_s": round(s.new_tok_s, 2),
            "base_prompt_tokens": s.base_prompt_tokens, "new_prompt_tokens": s.new_prompt_tokens}


def _repeats_json(rc: RepeatComparison) -> dict:
    def case(r: RepeatCase) -> dict:
        return {"source": r.source, "id": r.id, "base_passed": r.base_passed, "base_graded": r.base_graded,
                "new_passed": r.new_passed, "new_graded": r.new_graded, "base_class": r.base_class,
                "new_class": r.new_class, "p_drop": r.p_drop, "p_rise": r.p_rise}

    iv, t = rc.interval, rc.test
    return {"base_repeats": rc.base_repeats, "new_repeats": rc.new_repeats,
            "base_pass_at_1": rc.base_pass_at_1, "new_pass_at_1": rc.new_pass_at_1,
            "delta": {"mean": iv.mean, "low": iv.low, "high": iv.high, "resamples": iv.resamples, "seed": iv.seed},
            "sign_test": {"fell": t.b, "rose": t.c, "p_exact": t.p_exact, "mid_p": t.mid_p},
            "cases": [case(r) for r in rc.cases],
            **{k: [r.name for r in getattr(rc, k)]
               for k in ("drops", "rises", "flaky_drops", "became_flaky", "stopped_flaky")}}


def as_json(cmp: Comparison) -> dict:
    def run(r: Run) -> dict:
        return {"label": r.label, "kind": r.kind, "suite": r.suite, "cases": len(r.cases), "repeated": r.repeated}

    return {
        "format": "ds4eval-comparison", "version": 1,
        "base": run(cmp.base), "new": run(cmp.new),
        "alpha": cmp.alpha, "strict": cmp.strict, "allowed": list(cmp.allowed),
        "verdict": cmp.verdict, "regression": cmp.regression, "exit_status": cmp.exit_status,
        "total": _stats_json(cmp.total), "sources": [_stats_json(s) for s in cmp.sources],
        "flips": [{"source": f.source, "id": f.id, "direction": f.direction, "base_picked": f.base_picked,
                   "new_picked": f.new_picked, "base_expected": f.base_expected, "new_expected": f.new_expected,
                   "no_answer": f.no_answer} for f in cmp.flips],
        "lost_passes": cmp.lost_passes,
        "length_changes": [{"source": c.source, "id": c.id, "base_gen_tokens": c.base_gen_tokens,
                            "new_gen_tokens": c.new_gen_tokens, "delta": c.delta} for c in cmp.length_changes],
        "differences": [{"field": d.field, "base": d.base, "new": d.new, "cases": d.cases} for d in cmp.differences],
        "render_diffs": [{"cases": list(d.cases), "position": d.position, "base_tokens": d.base_tokens,
                          "new_tokens": d.new_tokens, "context_start": d.context_start,
                          "base_context": list(d.base_context), "new_context": list(d.new_context), "note": d.note}
                         for d in cmp.render_diffs],
        "warnings": [{"kind": i.kind, "message": i.message, "cases": list(i.cases), "excluded": i.excluded}
                     for i in cmp.issues],
        "cases": json.loads(cmp.cases.to_json(orient="records")),
        "repeats": None if cmp.repeats is None else _repeats_json(cmp.repeats),
        "assurance": None if cmp.assurance is None else _assurance_json(cmp),
        "token_counting": {"base_counts_eos": cmp.counting.base, "new_counts_eos": cmp.counting.new,
                           "aligned": cmp.counting.aligned},
    }


def _assurance_json(cmp: Comparison) -> dict:
    a, e = cmp.assurance, cmp.assurance.equivalence
    return {"power": a.power, "cases": a.cases, "discordance": a.discordance, "detectable_drop": a.detectable_drop,
            "sources": [{"source": t.source, "worse": t.worse, "better": t.better, "p": t.p, "holm_p": t.adjusted,
                         "regression": t.regression} for t in a.sources],
            "equivalence": None if e is None else {"margin": e.margin, "alpha": e.alpha, "delta": e.delta,
                                                   "p_lower": e.p_lower, "p_upper": e.p_upper, "p": e.p,
                                                   "equivalent": e.equivalent}}
