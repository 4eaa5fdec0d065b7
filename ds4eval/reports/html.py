"""HTML reports of one run and of a comparison: one self-contained file to open from disk or
attach to a CI job. Pure.

Contract
- `render_run_html(records, label="", written="") -> str`: one run from its trace records
  (`reports.run.build` gives every figure): provenance, pass rates per source with 95%
  intervals (table and SVG plot), an SVG histogram of generated lengths, the repeat summary
  with flaky and non-deterministic cases when cases were recorded more than once, and every
  case (a row per case and repeat).
- `render_compare_html(cmp, base_records=(), new_records=(), written=("", "")) -> str`: a
  `compare.Comparison` with the same sections on both sides: the runs and what differs, pass
  rates BASE against NEW with the paired interval of the delta, both length histograms
  overlaid, the flip table, tokens and time, warnings, the verdict, and every matched case
  with BASE and NEW side by side; when both runs have repeats, a per-case table of k/K on each
  side, Fisher p and the class change, smallest p first, sortable by any column. The records (the traces' own) supply questions and outputs;
  without them (summaries) the case rows carry verdicts and answers only.
- Per case: question, model output with its thinking (`<think>...</think>`, split as the
  extractors split it) dimmed and folded in a <details>, picked and expected, all inside a
  collapsed <details>, so a page of thousands of cases opens fast.
- Filters by status and source run in the page (no reload) and follow the URL hash:
  `#status=FAILED&source=x` opens that view, and changing a filter rewrites the hash. In a
  comparison `status` matches NEW's status by name (FAILED), BASE's as `base-FAILED`, and
  the change as `pass-fail`, `fail-pass`, `same` or `excluded`.
- Self-contained: inline CSS, inline SVG and one inline script; no network, no external
  resource. Every text from a trace passes `html.escape`; the script reads only DOM
  attributes, so no trace text is ever part of it.
- Linear: the page is built as a list of pieces joined once.
It reads no files and computes no statistics of its own beyond histogram bins.
"""

from __future__ import annotations

import html
import math
from typing import Iterable, Sequence
from urllib.parse import quote

from ds4eval.cases.extract import THINK_CLOSE, THINK_OPEN
from ds4eval.reports import comparison as compare_report
from ds4eval.reports import run as run_report
from ds4eval.run.trace import TraceRecord
from ds4eval.verdict.compare import Comparison, SourceStats
from ds4eval.verdict.repeats import RepeatSummary

HIST_BINS = 30
STATUSES = run_report.STATUSES


class Html(str):
    """Markup that is already safe (built here); plain `str` cells are escaped."""


def esc(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _cell(value: object) -> str:
    return value if isinstance(value, Html) else esc(value)


def split_thinking(output: str) -> tuple[str | None, str, bool]:
    """(thinking or None, visible text, closed): thinking is everything up to the last
    `</think>` (its opening tag dropped), as `extract.visible_answer` reads it; an opened block
    that never closed is all thinking."""
    end = output.rfind(THINK_CLOSE)
    if end >= 0:
        think = output[:end]
        start = think.find(THINK_OPEN)
        if start >= 0 and not think[:start].strip():
            think = think[start + len(THINK_OPEN):]
        return think, output[end + len(THINK_CLOSE):], True
    start = output.find(THINK_OPEN)
    if start >= 0:
        return output[:start] + output[start + len(THINK_OPEN):], "", False
    return None, output, True


# ---------------------------------------------------------------- building blocks

def table(rows: Sequence[dict], table_id: str = "", cls: str = "", columns: Sequence[str] | None = None,
          row_attrs: Sequence[str] | None = None) -> str:
    """An HTML table of dict rows; `row_attrs[i]` is extra (already escaped) markup for row i."""
    if not rows and columns is None:
        return ""
    heads = list(columns if columns is not None else rows[0])
    id_attr = f' id="{table_id}"' if table_id else ""
    cls_attr = f' class="{cls}"' if cls else ""
    out = [f"<table{id_attr}{cls_attr}><thead><tr>"]
    out += [f"<th>{esc(h)}</th>" for h in heads]
    out.append("</tr></thead><tbody>")
    for i, row in enumerate(rows):
        attrs = row_attrs[i] if row_attrs else ""
        out.append(f"<tr{attrs}>" + "".join(f"<td>{_cell(row.get(h, ''))}</td>" for h in heads) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _frame_rows(df) -> list[dict]:
    return df.to_dict("records")


def status_badge(status: str) -> Html:
    s = status or "?"
    return Html(f'<span class="st st-{esc(s if s in STATUSES else "other")}">{esc(s)}</span>')


def source_link(source: str) -> Html:
    if source == "TOTAL":
        return Html("<b>TOTAL</b>")
    return Html(f'<a href="#source={esc(quote(source, safe=""))}">{esc(source)}</a>')


def interval_svg(rows: Sequence[tuple[str, float, float, float]], lo: float, hi: float, svg_id: str,
                 title: str, zero: float | None = None, signed: bool = False) -> str:
    """A dot per row at its value, a bar across its interval, on one axis from lo to hi."""
    left, right, width, row_h, top = 170, 150, 720, 24, 30
    plot_w = width - left - right
    height = top + row_h * len(rows) + 30

    def x(v: float) -> float:
        return left + (v - lo) / (hi - lo) * plot_w if hi > lo else left

    def label(v: float) -> str:
        return f"{100 * v:+.1f}" if signed else f"{100 * v:.1f}%"

    out = [f'<svg id="{svg_id}" class="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="{esc(title)}">',
           f'<text x="{left}" y="16" class="ptitle">{esc(title)}</text>']
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        out.append(f'<line x1="{x(v):.1f}" x2="{x(v):.1f}" y1="{top - 6}" y2="{height - 24}" class="grid"/>'
                   f'<text x="{x(v):.1f}" y="{height - 8}" class="tick" text-anchor="middle">{label(v)}</text>')
    if zero is not None:
        out.append(f'<line x1="{x(zero):.1f}" x2="{x(zero):.1f}" y1="{top - 6}" y2="{height - 24}" class="zero"/>')
    for i, (name, value, low, high) in enumerate(rows):
        y = top + row_h * i + row_h / 2
        shown = name if len(name) <= 24 else name[:23] + "…"
        out.append(f'<text x="{left - 8}" y="{y + 4:.1f}" text-anchor="end" class="lbl">{esc(shown)}</text>'
                   f'<line x1="{x(low):.1f}" x2="{x(high):.1f}" y1="{y:.1f}" y2="{y:.1f}" class="ci"/>'
                   f'<circle cx="{x(value):.1f}" cy="{y:.1f}" r="4.5" class="pt"><title>{esc(name)}: '
                   f'{label(value)} [{label(low)}, {label(high)}]</title></circle>'
                   f'<text x="{width - right + 10}" y="{y + 4:.1f}" class="val">{label(value)} '
                   f'[{label(low)}, {label(high)}]</text>')
    out.append("</svg>")
    return "".join(out)


def histogram_svg(series: Sequence[tuple[str, Sequence[int], str]], svg_id: str = "length-histogram",
                  title: str = "generated tokens per case") -> str:
    """Overlaid histograms on shared bins of whole tokens; series = (label, values, css class)."""
    values = [v for _, vs, _ in series for v in vs]
    if not values:
        return '<p class="note">no generated lengths recorded</p>'
    top_value = max(values)
    step = max(1, math.ceil((top_value + 1) / HIST_BINS))
    nbins = (top_value // step) + 1
    counts = []
    for _, vs, _ in series:
        c = [0] * nbins
        for v in vs:
            c[max(0, v) // step] += 1
        counts.append(c)
    peak = max(max(c) for c in counts) or 1
    left, bottom, top, width, height = 52, 40, 46, 720, 256
    plot_w, plot_h = width - left - 16, height - top - bottom
    bw = plot_w / nbins
    out = [f'<svg id="{svg_id}" class="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="{esc(title)}">',
           f'<text x="{left}" y="16" class="ptitle">{esc(title)}</text>']
    lx = left
    for name, vs, cls in series if len(series) > 1 else ():
        text = f"{name} ({len(vs)})"
        out.append(f'<rect x="{lx}" y="24" width="12" height="12" class="{cls}"/>'
                   f'<text x="{lx + 16}" y="34" class="lbl">{esc(text)}</text>')
        lx += 16 + 7 * len(text) + 24
    for i in range(nbins):
        tip = f"{i * step}–{(i + 1) * step - 1} tokens: " + ", ".join(
            f"{name} {counts[j][i]}" for j, (name, _, _) in enumerate(series))
        for j, (_, _, cls) in enumerate(series):
            n = counts[j][i]
            if not n:
                continue
            h = n / peak * plot_h
            out.append(f'<rect x="{left + i * bw + 0.5:.1f}" y="{top + plot_h - h:.1f}" width="{max(bw - 1, 0.5):.1f}" '
                       f'height="{h:.1f}" class="{cls}"><title>{esc(tip)}</title></rect>')
    base_y = top + plot_h
    out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{base_y}" y2="{base_y}" class="axis"/>'
               f'<line x1="{left}" x2="{left}" y1="{top}" y2="{base_y}" class="axis"/>'
               f'<text x="{left - 6}" y="{top + 4}" text-anchor="end" class="tick">{peak}</text>'
               f'<text x="{left - 6}" y="{base_y}" text-anchor="end" class="tick">0</text>'
               f'<text x="{left + plot_w / 2:.0f}" y="{height - 4}" text-anchor="middle" class="tick">'
               f'generated tokens (bins of {step})</text>')
    span = nbins * step
    for v in range(0, span + 1, _nice_step(span / 5)):
        out.append(f'<text x="{left + v / span * plot_w:.1f}" y="{base_y + 16}" text-anchor="middle" '
                   f'class="tick">{v}</text>')
    out.append("</svg>")
    return "".join(out)


def _nice_step(raw: float) -> int:
    """The smallest of 1, 2, 5 x 10^k (whole tokens) at least `raw`."""
    magnitude = 10 ** max(0, math.floor(math.log10(max(raw, 1))))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def picked_text(value: object) -> str:
    """A picked answer for display: "(none)" when none was found (None, empty, or a missing
    value of the comparison's table)."""
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "(none)"
    return str(value)


def output_html(output: str) -> str:
    """A model output: the thinking folded and dimmed, the visible text after it."""
    think, visible, closed = split_thinking(output)
    parts = []
    if think is not None:
        state = "" if closed else ", never closed"
        parts.append(f'<details class="think"><summary>thinking ({len(think):,} chars{state})</summary>'
                     f'<pre>{esc(think)}</pre></details>')
    parts.append(f'<pre class="answer">{esc(visible)}</pre>' if visible or think is None
                 else '<p class="note">no text after the thinking</p>')
    return "".join(parts)


def _record_body(r: TraceRecord) -> str:
    parts = [f'<h4>Question</h4><pre class="q">{esc(r.question_prompt)}</pre>' if r.question_prompt else "",
             f'<h4>Output</h4>{output_html(r.model_output)}']
    if r.error:
        parts.append(f'<p class="err">{esc(r.error)}</p>')
    return "".join(parts)


def _filters(sources: Iterable[str], status_groups: Sequence[tuple[str, Sequence[tuple[str, str]]]]) -> str:
    opts = ['<option value="">all</option>']
    for group, items in status_groups:
        inner = "".join(f'<option value="{esc(v)}">{esc(text)}</option>' for v, text in items)
        opts.append(f'<optgroup label="{esc(group)}">{inner}</optgroup>' if group else inner)
    src = "".join(f'<option value="{esc(s)}">{esc(s)}</option>' for s in sources)
    return ('<div class="filters"><label>status <select id="filter-status">' + "".join(opts) + "</select></label> "
            '<label>source <select id="filter-source"><option value="">all</option>' + src + "</select></label> "
            '<span id="filter-count"></span></div>')


def _case_rows(heads: Sequence[str], rows: Sequence[tuple[str, str, str, dict, str]]) -> str:
    """rows: (row id, status tokens, source, cells, details html)."""
    out = ['<table id="case-table" class="cases"><thead><tr>', *(f"<th>{esc(h)}</th>" for h in heads),
           "<th>question and output</th></tr></thead><tbody>"]
    for row_id, tokens, source, cells, body in rows:
        out.append(f'<tr class="case" id="{row_id}" data-status="{esc(tokens)}" data-source="{esc(source)}">')
        out += [f"<td>{_cell(cells.get(h, ''))}</td>" for h in heads]
        out.append(f"<td><details><summary>show</summary>{body}</details></td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _page(title: str, sections: Sequence[str]) -> str:
    return "".join(["<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
                    "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
                    f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
                    *sections, f"<script>{SCRIPT}</script></body></html>\n"])


def _section(sec_id: str, title: str, *body: str) -> str:
    return f'<section id="{sec_id}"><h2>{esc(title)}</h2>{"".join(body)}</section>'


def _note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def _repeats_html(s: RepeatSummary, side: str = "") -> str:
    prefix = f"{side}-" if side else ""
    parts = [f"<p>{esc(run_report.repeat_line(s))}</p>"]
    flaky = run_report.flaky_rows(s)
    if flaky:
        parts.append(f"<h3>{esc(side + ' ' if side else '')}flaky cases</h3>"
                     + _note("statuses by repeat: P passed, F failed, - not graded")
                     + table(flaky, f"{prefix}flaky-table"))
    else:
        parts.append(_note("no flaky case: every case passed all its graded repeats or none"))
    nondet = run_report.nondeterministic_rows(s)
    if nondet:
        parts.append(f"<h3>greedy cases whose repeats differ</h3>"
                     + table([{**r, **{k: Html(f"<code>{esc(v)}</code>") for k, v in r.items()
                                       if k.endswith("from there")}} for r in nondet],
                             f"{prefix}nondeterministic-table"))
    return "".join(parts)


# ---------------------------------------------------------------- one run

def render_run_html(records: Iterable[TraceRecord], label: str = "", written: str = "") -> str:
    rep = run_report.build(records, label, written)
    title = f"ds4-eval report: {label}" if label else "ds4-eval report"
    sections = [f'<header><h1>{esc(title)}</h1><p class="headline">{esc(rep.headline())}</p></header>',
                _section("provenance", "Run", table([{"field": k, "value": v} for k, v in rep.provenance],
                                                    "provenance-table", "kv"))]
    rates = run_report.rate_rows(rep)
    for row in rates:
        row["source"] = source_link(row["source"])
    shown = (list(rep.sources) if len(rep.sources) > 1 else []) + [rep.total]
    plot = [(s.source, s.rate, s.low, s.high) for s in shown if s.rate is not None]
    statuses = ", ".join(f"{s} {n}" for s, n in rep.statuses.items())
    if rep.superseded:
        statuses += f"; {rep.superseded} earlier record(s) superseded by retries"
    sections.append(_section(
        "rates", "Pass rates", table(rates, "rate-table"), _note(rep.method()), _note("statuses: " + statuses),
        interval_svg(plot, 0.0, 1.0, "rate-plot", "pass rate with its 95% interval") if plot else ""))
    think = ("thinking closed: " + ", ".join(f"{k} {v}" for k, v in sorted(rep.think_close.items()))
             if rep.think_close else "")
    sections.append(_section("lengths", "Generated tokens", table([run_report.length_row(rep)], "length-table"),
                             _note(think) if think else "",
                             histogram_svg([("cases", [r.gen_tokens for r in rep.records], "s-run")])))
    if rep.repeats is not None:
        sections.append(_section("repeats", f"Repeats (K = {rep.repeats.repeats})", _repeats_html(rep.repeats)))
    repeated = rep.repeated
    heads = ["#", "case", *(["repeat"] if repeated else []), "status", "picked", "expected", "tokens", "think"]
    rows = []
    for k, r in enumerate(rep.records, 1):
        cells = {"#": r.index, "case": f"{r.source}/{r.id}", "repeat": r.repeat, "status": status_badge(r.status),
                 "picked": picked_text(r.picked), "expected": r.expected,
                 "tokens": r.gen_tokens, "think": "" if r.think_close == "none" else r.think_close}
        rows.append((f"case-{k}", r.status or "?", r.source, cells, _record_body(r)))
    present = [s for s in STATUSES if s in rep.statuses] + [s for s in rep.statuses if s not in STATUSES]
    groups = [("", [(s, s) for s in dict.fromkeys([*STATUSES[:2], *present])])]
    sections.append(_section("cases", "Cases", _filters(dict.fromkeys(r.source for r in rep.records), groups),
                             _case_rows(heads, rows)))
    return _page(title, sections)


# ---------------------------------------------------------------- a comparison

def _last_by_case(records: Iterable[TraceRecord]) -> dict[tuple[str, str], TraceRecord]:
    # The comparison counts a case by its last record (retries append); so does this page.
    out: dict[tuple[str, str], TraceRecord] = {}
    for r in records:
        out[(r.source, r.id)] = r
    return out


def _delta_plot(cmp: Comparison) -> str:
    shown: list[SourceStats] = (cmp.sources if len(cmp.sources) > 1 else []) + [cmp.total]
    rows = [(s.source, s.interval.delta, s.interval.low, s.interval.high) for s in shown]
    reach = max([0.05] + [max(abs(r[2]), abs(r[3])) for r in rows])
    reach = min(1.0, math.ceil(reach * 20) / 20)
    return interval_svg(rows, -reach, reach, "delta-plot", "NEW − BASE pass rate, points, with the paired 95% "
                        "interval", zero=0.0, signed=True)


def _change(row) -> tuple[str, str]:
    """(filter token, shown text) of one matched case."""
    if row.excluded:
        return "excluded", f"excluded ({row.excluded})"
    if row.base_status == "PASSED" and row.new_status != "PASSED":
        return "pass-fail", "pass→fail"
    if row.new_status == "PASSED" and row.base_status != "PASSED":
        return "fail-pass", "fail→pass"
    return "same", "same"


def _side_body(side: str, r: TraceRecord | None) -> str:
    if r is None:
        return f'<div class="side"><h4>{side}</h4>{_note("no output recorded (a summary, not a trace)")}</div>'
    return (f'<div class="side"><h4>{side} · {esc(r.status or "?")} · picked {esc(picked_text(r.picked))} · '
            f'{r.gen_tokens} tokens</h4>{output_html(r.model_output)}'
            + (f'<p class="err">{esc(r.error)}</p>' if r.error else "") + "</div>")


def _provenance_pair(base: run_report.RunReport, new: run_report.RunReport) -> str:
    b, n = dict(base.provenance), dict(new.provenance)
    rows = []
    for key in dict.fromkeys([*b, *n]):
        bv, nv = b.get(key, "-"), n.get(key, "-")
        rows.append({"field": key, "BASE": bv, "NEW": nv if nv != bv else Html(f'<span class="same">{esc(nv)}</span>')})
    return table(rows, "provenance-table", "kv")


def render_compare_html(cmp: Comparison, base_records: Iterable[TraceRecord] = (),
                        new_records: Iterable[TraceRecord] = (), written: tuple[str, str] = ("", "")) -> str:
    base_records, new_records = list(base_records), list(new_records)
    tb = compare_report.tables(cmp)
    title = f"ds4-eval --compare: {cmp.base.label} → {cmp.new.label}"
    verdict_cls = "bad" if cmp.exit_status else "good"
    sections = [f'<header><h1>{esc(title)}</h1><p class="verdict {verdict_cls}">{esc(cmp.verdict)}</p></header>']

    base_rep = run_report.build(base_records, cmp.base.label, written[0]) if base_records else None
    new_rep = run_report.build(new_records, cmp.new.label, written[1]) if new_records else None
    runs = [table(_frame_rows(tb["runs"]), "runs-table")]
    if base_rep and new_rep:
        b, n = dict(base_rep.provenance), dict(new_rep.provenance)
        line = "; ".join(f"{k}: BASE {b.get(k, '-')}, NEW {n.get(k, '-')}" for k in ("sampling", "trace written")
                         if k in b or k in n)
        differ = sum(b.get(k) != n.get(k) for k in dict.fromkeys([*b, *n]))
        runs += [_note(line) if line else "",
                 f"<details><summary>provenance of both runs ({differ} field(s) differ; NEW values equal to BASE "
                 f"dimmed)</summary>{_provenance_pair(base_rep, new_rep)}</details>"]
    if len(tb["differences"]):
        runs += ["<h3>what differs between the runs</h3>", table(_frame_rows(tb["differences"]), "differences-table")]
    sections.append(_section("provenance", "Runs", *runs))

    rates = _frame_rows(tb["rates"])
    for row in rates:
        row["source"] = source_link(row["source"])
    sections.append(_section("rates", "Pass rates", table(rates, "rate-table"),
                             _note(compare_report.method_note(cmp)), _delta_plot(cmp)))

    c = cmp.cases
    sections.append(_section("lengths", "Generated tokens", table(_frame_rows(tb["time"]), "time-table"),
                             histogram_svg([("BASE", c["base_gen_tokens"].astype(int).tolist(), "s-base"),
                                            ("NEW", c["new_gen_tokens"].astype(int).tolist(), "s-new")],
                                           title="generated tokens per matched case, BASE and NEW overlaid"),
                             ("<h3>largest changes in generated length</h3>" + table(_frame_rows(tb["lengths"]),
                                                                                    "lengths-table"))
                             if len(tb["lengths"]) else ""))

    row_of = {(s, i): f"case-{k}" for k, (s, i) in enumerate(zip(c["source"], c["id"]), 1)}
    flips = _frame_rows(tb["flips"])
    for row, f in zip(flips, cmp.flips):  # the table lists cmp.flips in order
        row["case"] = Html(f'<a href="#{row_of[(f.source, f.id)]}">{esc(f.name)}</a>')
    lost = _note("lost passes (passed in BASE, no verdict in NEW): " + ", ".join(cmp.lost_passes)) \
        if cmp.lost_passes else ""
    sections.append(_section("flips", "Flips", _note(compare_report.flip_summary(cmp)),
                             table(flips, "flip-table", columns=list(tb["flips"].columns)), lost))

    if compare_report.both_repeated(cmp.repeats):
        sections.append(_section("repeat-cases", "Per case over the repeats, by Fisher p",
                                 _repeat_case_table(cmp, row_of)))
    for side, rep in (("BASE", base_rep), ("NEW", new_rep)):
        if rep is not None and rep.repeats is not None:
            sections.append(_section(f"repeats-{side.lower()}", f"{side} repeats (K = {rep.repeats.repeats})",
                                     _repeats_html(rep.repeats, side.lower())))
    if cmp.render_diffs:
        rows = [{"cases": ", ".join(d.cases[:4]) + (f" and {len(d.cases) - 4} more" if len(d.cases) > 4 else ""),
                 "first difference": d.note if d.position is None else f"token {d.position}",
                 "BASE": Html(_tokens_html(d.base_context, d.context_start, d.position)),
                 "NEW": Html(_tokens_html(d.new_context, d.context_start, d.position))} for d in cmp.render_diffs]
        sections.append(_section("render-diff", "Render diff", table(rows, "render-diff-table")))
    if cmp.issues:
        sections.append(_section("warnings", "Warnings",
                                 "<ul>" + "".join(f"<li>{esc(i.message)}</li>" for i in cmp.issues) + "</ul>"))

    base_by, new_by = _last_by_case(base_records), _last_by_case(new_records)
    heads = ["#", "case", "BASE", "NEW", "change", "BASE picked", "NEW picked", "expected", "tokens"]
    rows = []
    for k, row in enumerate(c.itertuples(index=False), 1):
        token, shown = _change(row)
        b, n = base_by.get((row.source, row.id)), new_by.get((row.source, row.id))
        expected = row.base_expected if row.base_expected == row.new_expected \
            else f"{row.base_expected} | {row.new_expected}"
        cells = {"#": (b or n).index if (b or n) else k, "case": f"{row.source}/{row.id}",
                 "BASE": status_badge(row.base_status), "NEW": status_badge(row.new_status),
                 "change": Html(f'<span class="ch ch-{token}">{esc(shown)}</span>'),
                 "BASE picked": picked_text(row.base_picked), "NEW picked": picked_text(row.new_picked),
                 "expected": expected, "tokens": f"{row.base_gen_tokens} → {row.new_gen_tokens}"}
        question = (b or n).question_prompt if (b or n) else ""
        body = ((f'<h4>Question</h4><pre class="q">{esc(question)}</pre>' if question else "")
                + f'<div class="pair">{_side_body("BASE", b)}{_side_body("NEW", n)}</div>')
        rows.append((f"case-{k}", f"{row.new_status or '?'} base-{row.base_status or '?'} {token}", row.source,
                     cells, body))
    groups = [("NEW status", [(s, f"NEW {s}") for s in STATUSES]),
              ("BASE status", [(f"base-{s}", f"BASE {s}") for s in STATUSES]),
              ("change", [("pass-fail", "pass→fail"), ("fail-pass", "fail→pass"), ("same", "same verdict"),
                          ("excluded", "excluded")])]
    sections.append(_section("cases", "Cases", _filters(dict.fromkeys(c["source"]), groups), _case_rows(heads, rows)))
    return _page(title, sections)


def _repeat_case_table(cmp: Comparison, row_of: dict[tuple[str, str], str]) -> str:
    """Every case's k/K on both sides, smallest Fisher p first; a click on a heading re-sorts."""
    rc = cmp.repeats
    heads = compare_report.CASE_TABLE_COLUMNS
    out = ['<table id="repeat-case-table" class="sortable"><thead><tr>',
           *(f'<th title="click to sort">{esc(h)}</th>' for h in heads), "</tr></thead><tbody>"]
    ranked = rc.ranked()
    for r, row in zip(ranked, compare_report.repeat_case_rows(rc)):
        change = row["change"]
        token = ("bad" if change.startswith("regressed") else "good" if change.startswith("improved")
                 else "flaky" if "flaky" in change else "same" if not change else "moved")
        keys = [r.name, f"{r.base_rate:.6f}", f"{r.new_rate:.6f}", f"{r.p:.6e}", row["class BASE → NEW"], change]
        target = row_of.get((r.source, r.id))
        name = Html(f'<a href="#{target}">{esc(r.name)}</a>') if target else r.name
        cells = [name, row["BASE k/K"], row["NEW k/K"], row["Fisher p"], row["class BASE → NEW"],
                 Html(f'<span class="rc rc-{token}">{esc(change or "same")}</span>')]
        out.append(f'<tr data-change="{token}">' + "".join(f'<td data-sort="{esc(k)}">{_cell(c)}</td>'
                                                          for k, c in zip(keys, cells)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out) + _note(compare_report.repeat_case_note(rc, len(ranked), cmp.alpha)
                                + "; click a heading to sort by it")


def _tokens_html(context: Sequence[str], start: int, position: int | None) -> str:
    if position is None:
        return f"<code>{esc(context[0])}</code>" if context else ""
    pieces = [f'<mark>{esc(p)}</mark>' if i == position else esc(p) for i, p in enumerate(context, start)]
    return "<code>" + "|".join(pieces) + "</code>"


# ---------------------------------------------------------------- page furniture

CSS = """
:root { --base: #3b6fb6; --new: #e07b28; --run: #3b6fb6; --pass: #1e7d32; --fail: #c62828; --other: #8d6e00;
        --dim: #777; --line: #ddd; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em; color: #222;
       max-width: 1500px; }
h1 { font-size: 1.4em; margin: 0 0 .3em; }
h2 { font-size: 1.15em; margin: 1.6em 0 .5em; border-bottom: 1px solid var(--line); }
h3 { font-size: 1em; margin: 1.2em 0 .4em; } h4 { margin: .6em 0 .2em; font-size: .95em; }
table { border-collapse: collapse; margin: .3em 0; }
th, td { border: 1px solid var(--line); padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; font-weight: 600; }
td { overflow-wrap: break-word; max-width: 32em; }
.st, .ch { white-space: nowrap; }
.cases td:nth-child(2) { min-width: 10em; }
table.kv td:first-child { color: var(--dim); }
.note { color: var(--dim); margin: .3em 0; }
.headline, .verdict { font-weight: 600; font-size: 1.05em; padding: .4em .7em; background: #f4f4f4;
                      display: inline-block; }
.verdict.bad { background: #fde8e8; color: var(--fail); } .verdict.good { background: #e8f5e9; color: var(--pass); }
.st { font-weight: 600; } .st-PASSED { color: var(--pass); } .st-FAILED { color: var(--fail); }
.st-SKIPPED, .st-STOPPED, .st-ERROR, .st-other { color: var(--other); }
.ch-pass-fail { color: var(--fail); font-weight: 600; } .ch-fail-pass { color: var(--pass); font-weight: 600; }
.ch-excluded, .same { color: var(--dim); }
pre { white-space: pre-wrap; overflow-wrap: anywhere; margin: .2em 0; padding: .4em; background: #fafafa;
      border: 1px solid #eee; max-height: 40em; overflow: auto; }
details.think > pre, details.think > summary { color: var(--dim); }
details.think > pre { background: #f6f6f6; font-style: italic; }
pre.answer { border-left: 3px solid var(--base); }
.err { color: var(--fail); }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: .8em; }
.pair .side { min-width: 0; }
.cases td:last-child { max-width: 60em; min-width: 6em; }
.filters { margin: .5em 0; padding: .4em .6em; background: #f4f4f4; display: inline-block; }
.filters select { margin-right: 1em; }
#filter-count { color: var(--dim); }
svg.plot { display: block; margin: .6em 0; font: 12px system-ui, sans-serif; }
svg .ptitle { font-weight: 600; } svg .tick { fill: #555; } svg .lbl, svg .val { fill: #222; }
svg .grid { stroke: #eee; } svg .zero { stroke: #999; stroke-dasharray: 4 3; } svg .axis { stroke: #888; }
svg .ci { stroke: var(--base); stroke-width: 3; } svg .pt { fill: var(--base); }
svg .s-run { fill: var(--run); fill-opacity: .75; } svg .s-base { fill: var(--base); fill-opacity: .55; }
svg .s-new { fill: var(--new); fill-opacity: .55; }
mark { background: #ffe08a; }
table.sortable th { cursor: pointer; } table.sortable th.sorted-asc::after { content: " ▲"; }
table.sortable th.sorted-desc::after { content: " ▼"; }
.rc { white-space: nowrap; } .rc-bad { color: var(--fail); font-weight: 600; }
.rc-good { color: var(--pass); font-weight: 600; } .rc-flaky { color: var(--other); } .rc-same { color: var(--dim); }
"""

# Reads only DOM attributes and the URL hash; no trace text is ever part of the script.
SCRIPT = """
(function () {
  // Sortable tables: a click on a heading sorts by the cells' data-sort (numbers as numbers).
  function sortBy(tbl, col, th) {
    var desc = th.classList.contains("sorted-asc");
    var heads = tbl.tHead.rows[0].cells;
    for (var h = 0; h < heads.length; h++) { heads[h].classList.remove("sorted-asc", "sorted-desc"); }
    th.classList.add(desc ? "sorted-desc" : "sorted-asc");
    var body = tbl.tBodies[0], list = Array.prototype.slice.call(body.rows);
    function key(r) { return r.cells[col].getAttribute("data-sort") || ""; }
    list.sort(function (a, b) {
      var x = key(a), y = key(b), nx = Number(x), ny = Number(y);
      var c = (x !== "" && y !== "" && !isNaN(nx) && !isNaN(ny)) ? nx - ny : (x < y ? -1 : x > y ? 1 : 0);
      return desc ? -c : c;
    });
    list.forEach(function (r) { body.appendChild(r); });
  }
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (tbl) {
    Array.prototype.forEach.call(tbl.tHead.rows[0].cells, function (th, col) {
      th.addEventListener("click", function () { sortBy(tbl, col, th); });
    });
  });
})();
(function () {
  var tableEl = document.getElementById("case-table");
  if (!tableEl) { return; }
  var rows = tableEl.tBodies[0].rows;
  var status = document.getElementById("filter-status");
  var source = document.getElementById("filter-source");
  var count = document.getElementById("filter-count");
  function decode(s) {
    try { return decodeURIComponent(s.replace(/\\+/g, " ")); } catch (e) { return s; }
  }
  function fromHashText() {
    var f = {status: "", source: ""};
    window.location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
      var i = kv.indexOf("=");
      if (i < 0) { return; }
      var k = decode(kv.slice(0, i));
      if (k === "status" || k === "source") { f[k] = decode(kv.slice(i + 1)); }
    });
    return f;
  }
  function choose(select, value) {
    select.value = value;
    if (select.value !== value) {
      var o = document.createElement("option");
      o.value = value; o.textContent = value;
      select.appendChild(o);
      select.value = value;
    }
  }
  function apply() {
    var s = status.value, src = source.value, shown = 0;
    for (var i = 0; i < rows.length; i++) {
      var r = rows[i];
      var ok = (!s || (" " + r.getAttribute("data-status") + " ").indexOf(" " + s + " ") >= 0) &&
               (!src || r.getAttribute("data-source") === src);
      r.hidden = !ok;
      if (ok) { shown++; }
    }
    count.textContent = shown + " of " + rows.length + " shown";
  }
  function fromHash() {
    var f = fromHashText();
    choose(status, f.status);
    choose(source, f.source);
    apply();
    // A link to one case (#case-12) shows every row, then the case itself.
    var target = window.location.hash.slice(1);
    if (target && target.indexOf("=") < 0) {
      var el = document.getElementById(decode(target));
      if (el) { el.scrollIntoView(); }
    }
  }
  function toHash() {
    var parts = [];
    if (status.value) { parts.push("status=" + encodeURIComponent(status.value)); }
    if (source.value) { parts.push("source=" + encodeURIComponent(source.value)); }
    var h = parts.length ? "#" + parts.join("&") : window.location.pathname + window.location.search;
    try { history.replaceState(null, "", h); } catch (e) { window.location.hash = parts.join("&"); }
    apply();
  }
  status.addEventListener("change", toHash);
  source.addEventListener("change", toHash);
  window.addEventListener("hashchange", fromHash);
  fromHash();
})();
"""
