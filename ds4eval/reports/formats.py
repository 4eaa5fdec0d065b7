"""Which renderer writes which report: the registry behind `--report FILE`, `--report-from TRACE`
and `--compare --format`. Pure.

Contract
- `report_format(path) -> "markdown" | "html"`: a report file ending in `.md` is markdown,
  anything else is the HTML page.
- `render_run(records, fmt, label="", written="") -> str`: one run from its trace records,
  fmt "html" (`reports.html.render_run_html`) or "markdown" (`reports.run.render_markdown`).
- `render_comparison(cmp, fmt, base_records=(), new_records=(), written=("", "")) -> str`: fmt
  "text", "markdown" or "json" (`reports.comparison`, which needs the Comparison only) or "html"
  (`reports.html.render_compare_html`, which also shows the traces' questions and outputs).
- `trace_records(text) -> list[TraceRecord]`: the records of a trace's text, none for a JSON
  summary (a summary holds verdicts, not outputs).
A new format is one entry in RUN_RENDERERS or COMPARE_RENDERERS. It reads and writes no files.
"""

from __future__ import annotations

from typing import Callable, Iterable

from ds4eval.reports import comparison as compare_report
from ds4eval.reports import html as html_report
from ds4eval.reports import run as run_report
from ds4eval.run.trace import TraceRecord, parse_trace
from ds4eval.verdict.compare import Comparison


def _run_markdown(records: Iterable[TraceRecord], label: str, written: str) -> str:
    return run_report.render_markdown(run_report.build(records, label, written))


RUN_RENDERERS: dict[str, Callable[[Iterable[TraceRecord], str, str], str]] = {
    "html": html_report.render_run_html,
    "markdown": _run_markdown,
}


def _from_comparison(fmt: str):
    def render(cmp: Comparison, base_records, new_records, written) -> str:
        return compare_report.render(cmp, fmt)
    return render


COMPARE_RENDERERS: dict[str, Callable[..., str]] = {
    **{fmt: _from_comparison(fmt) for fmt in compare_report.RENDERERS},
    "html": html_report.render_compare_html,
}


def report_format(path: str) -> str:
    return "markdown" if path.lower().endswith(".md") else "html"


def render_run(records: Iterable[TraceRecord], fmt: str, label: str = "", written: str = "") -> str:
    return RUN_RENDERERS[fmt](records, label, written)


def render_comparison(cmp: Comparison, fmt: str, base_records: Iterable[TraceRecord] = (),
                      new_records: Iterable[TraceRecord] = (), written: tuple[str, str] = ("", "")) -> str:
    return COMPARE_RENDERERS[fmt](cmp, base_records, new_records, written)


def trace_records(text: str) -> list[TraceRecord]:
    if text.lstrip().startswith("{"):
        return []
    return parse_trace(text).records
