"""A `reports.document.Document` as one self-contained HTML page, to open from disk or attach
to a CI job. Pure.

Contract
- `render(doc) -> str`: the title as the page's title and heading, the lead under it (a
  headline, or a verdict coloured good or bad), each section as a <section> with its key as
  id. Tables are <table>s with their key as id (a sortable table re-sorts by a clicked
  heading, on its cells' sort keys); cells are styled by `Cell.style` (status badges, change
  marks, <code>, highlighted tokens) and become links where they have one; notes are dimmed;
  folded blocks are <details>; plots are inline SVG (interval plots and overlaid histograms,
  whose bins are the only figures computed here).
- The list of cases: one row per case with filters by status and source that run in the page
  (no reload) and follow the URL hash: `#status=FAILED&source=x` opens that view, and changing
  a filter rewrites the hash; each row's question and outputs sit in a collapsed <details>, an
  output's thinking (`<think>...</think>`, split as the extractors split it, `split_thinking`)
  dimmed and folded inside it, so a page of thousands of cases opens fast.
- Self-contained: inline CSS, inline SVG and one inline script; no network, no external
  resource. Every text of the Document passes `html.escape`; the script reads only DOM
  attributes, so no trace text is ever part of it.
- Linear: the page is built as a list of pieces joined once.
It reads only the Document (no Comparison, no trace, no other renderer).
"""

from __future__ import annotations

import html
import math
from typing import Callable, Sequence

from ds4eval.cases.extract import THINK_CLOSE, THINK_OPEN
from ds4eval.reports.document import (Block, Bullets, CaseDetail, CaseList, Cell, Document, Folded, Heading,
                                      Histogram, IntervalPlot, Output, Preformatted, Section, Table, Text, plain)

HIST_BINS = 30


def esc(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


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


# ---------------------------------------------------------------- cells and tables

def _tokens(c: Cell) -> str:
    return "<code>" + "|".join(f"<mark>{esc(p)}</mark>" if i == c.marked else esc(p)
                               for i, p in enumerate(c.pieces)) + "</code>"


# Cell style -> its markup (see reports.document.STYLES).
CELL_STYLES: dict[str, Callable[[Cell], str]] = {
    "": lambda c: esc(c.text),
    "strong": lambda c: f"<b>{esc(c.text)}</b>",
    "status": lambda c: f'<span class="st st-{esc(c.tag)}">{esc(c.text)}</span>',
    "change": lambda c: f'<span class="ch ch-{esc(c.tag)}">{esc(c.text)}</span>',
    "movement": lambda c: f'<span class="rc rc-{esc(c.tag)}">{esc(c.text)}</span>',
    "code": lambda c: f"<code>{esc(c.text)}</code>",
    "same": lambda c: f'<span class="same">{esc(c.text)}</span>',
    "tokens": _tokens,
}


def cell_html(c: Cell) -> str:
    inner = CELL_STYLES[c.style](c)
    return f'<a href="#{esc(c.link)}">{inner}</a>' if c.link else inner


def table(t: Table) -> str:
    """A table; a sortable one carries each cell's sort key for the page's script."""
    sortable = t.style == "sortable"
    id_attr = f' id="{esc(t.key)}"' if t.key else ""
    cls_attr = f' class="{esc(t.style)}"' if t.style else ""
    th = '<th title="click to sort">' if sortable else "<th>"
    out = [f"<table{id_attr}{cls_attr}><thead><tr>", *(f"{th}{esc(h)}</th>" for h in t.columns),
           "</tr></thead><tbody>"]
    for r in t.rows:
        attrs = "".join(f' data-{esc(k)}="{esc(v)}"' for k, v in r.data)
        out.append(f"<tr{attrs}>" + "".join((f'<td data-sort="{esc(c.sort)}">' if sortable else "<td>")
                                            + cell_html(c) + "</td>" for c in r.cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def _output(o: Output) -> str:
    if o.text is None:
        return f"<h4>{esc(o.heading)}</h4>{_note(o.missing)}"
    return (f"<h4>{esc(o.heading)}</h4>{output_html(o.text)}"
            + (f'<p class="err">{esc(o.error)}</p>' if o.error else ""))


def _detail(d: CaseDetail) -> str:
    question = f'<h4>Question</h4><pre class="q">{esc(d.question)}</pre>' if d.question else ""
    if d.paired:
        return question + '<div class="pair">' + "".join(f'<div class="side">{_output(o)}</div>'
                                                         for o in d.outputs) + "</div>"
    return question + "".join(_output(o) for o in d.outputs)


# ---------------------------------------------------------------- the list of cases

def _filters(cases: CaseList) -> str:
    opts = ['<option value="">all</option>']
    for group, items in cases.status_groups:
        inner = "".join(f'<option value="{esc(v)}">{esc(text)}</option>' for v, text in items)
        opts.append(f'<optgroup label="{esc(group)}">{inner}</optgroup>' if group else inner)
    src = "".join(f'<option value="{esc(s)}">{esc(s)}</option>' for s in cases.sources)
    return ('<div class="filters"><label>status <select id="filter-status">' + "".join(opts) + "</select></label> "
            '<label>source <select id="filter-source"><option value="">all</option>' + src + "</select></label> "
            '<span id="filter-count"></span></div>')


def case_list(cases: CaseList) -> str:
    out = [_filters(cases), '<table id="case-table" class="cases"><thead><tr>',
           *(f"<th>{esc(h)}</th>" for h in cases.columns), "<th>question and output</th></tr></thead><tbody>"]
    for r in cases.rows:
        out.append(f'<tr class="case" id="{esc(r.anchor)}" data-status="{esc(r.filters)}" '
                   f'data-source="{esc(r.source)}">')
        out += [f"<td>{cell_html(c)}</td>" for c in r.cells]
        out.append(f"<td><details><summary>show</summary>{_detail(r.detail)}</details></td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


# ---------------------------------------------------------------- blocks, sections, the page

def _preformatted(p: Preformatted) -> str:
    return "<pre>" + esc("\n".join(p.lines)) + "</pre>"


def _folded(f: Folded) -> str:
    return f"<details><summary>{esc(f.summary)}</summary>{''.join(block(b) for b in f.blocks)}</details>"


BLOCKS: dict[type, Callable] = {
    Table: table,
    Text: lambda b: "".join(_note(line) if b.note else f"<p>{esc(line)}</p>" for line in b.lines),
    Bullets: lambda b: "<ul>" + "".join(f"<li>{esc(item)}</li>" for item in b.items) + "</ul>",
    Preformatted: _preformatted,
    Heading: lambda b: f"<h3>{esc(b.text)}</h3>",
    Folded: _folded,
    IntervalPlot: lambda b: interval_svg(b.rows, b.lo, b.hi, b.key, b.title, b.zero, b.signed),
    Histogram: lambda b: histogram_svg([(s.label, s.values, f"s-{s.tone}") for s in b.series], b.key, b.title),
    CaseList: case_list,
}


def block(b: Block) -> str:
    return BLOCKS[type(b)](b)


def section(s: Section) -> str:
    return f'<section id="{esc(s.key)}"><h2>{esc(s.title)}</h2>{"".join(block(b) for b in s.blocks)}</section>'


def render(doc: Document) -> str:
    title = plain(doc.title)
    lead = ""
    if doc.lead is not None:
        cls = doc.lead.style + (f" {doc.lead.tag}" if doc.lead.tag else "")
        lead = f'<p class="{esc(cls)}">{esc(doc.lead.text)}</p>'
    return "".join(["<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
                    "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
                    f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
                    f"<header><h1>{esc(title)}</h1>{lead}</header>",
                    *(section(s) for s in doc.sections), f"<script>{SCRIPT}</script></body></html>\n"])


# ---------------------------------------------------------------- outputs and plots

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
