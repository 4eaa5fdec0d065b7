"""Which document and which renderer make each report: the registry behind `--report FILE`,
`ds4-eval report TRACE` and `ds4-eval compare --format`. Pure.

Contract
- `report_format(path) -> "markdown" | "html"`: a report file ending in `.md` is markdown,
  anything else is the HTML page.
- `render_run(records, fmt, label="", written="") -> str`: one run from its trace records
  (`reports.run.build`, once), fmt "markdown" (the summary, cells escaped) or "html" (the page).
- `render_comparison(cmp, fmt, written=("", ""), noise=None) -> str`: fmt "text", "markdown",
  "json" or "html"; the page's questions and outputs are the records the Comparison's runs were
  read from (`compare.Run.records`), so no trace is read or parsed again here. `noise`, a
  determinism result with its explanation of the flips (`compare --noise`), adds the "Stack
  noise" section (before the verdict of a text report) or the JSON's `noise` member.
A new format is one entry in RUN_FORMATS or COMPARISON_FORMATS. It reads and writes no files.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable

from dataclasses import asdict, replace

from ds4eval.determinism.analysis import NoiseExplanation, Result
from ds4eval.reports import comparison, determinism, html, markdown, run, text
from ds4eval.reports.document import Document
from ds4eval.run.trace import TraceRecord
from ds4eval.verdict.compare import Comparison

Noise = tuple[NoiseExplanation, Result]
"""What `compare --noise` adds: how the stack's own variation explains the flips, and the result
that measured it."""


def _run_markdown(report: run.RunReport) -> str:
    return markdown.render(run.summary_document(report), markdown.escaped_table)


def _run_html(report: run.RunReport) -> str:
    return html.render(run.page(report))


RUN_FORMATS: dict[str, Callable[[run.RunReport], str]] = {
    "markdown": _run_markdown,
    "html": _run_html,
}


def _with_noise(doc: Document, noise: Noise | None, before_last: bool = False) -> Document:
    if noise is None:
        return doc
    section = determinism.noise_section(*noise)
    sections = (*doc.sections[:-1], section, doc.sections[-1]) if before_last else (*doc.sections, section)
    return replace(doc, sections=sections)


def _comparison_text(cmp: Comparison, written: tuple[str, str], noise: Noise | None) -> str:
    return text.render(_with_noise(comparison.text_document(cmp), noise, before_last=True))


def _comparison_markdown(cmp: Comparison, written: tuple[str, str], noise: Noise | None) -> str:
    return markdown.render(_with_noise(comparison.markdown_document(cmp), noise), markdown.aligned_table)


def _comparison_json(cmp: Comparison, written: tuple[str, str], noise: Noise | None) -> str:
    data = comparison.as_json(cmp)
    if noise is not None:
        explanation, result = noise
        data["noise"] = {**asdict(explanation), "unexplained": explanation.unexplained, "stack": result.stack,
                         "invariant": result.invariant,
                         "conditions": {v.condition: v.verdict for v in result.verdicts}}
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def _comparison_html(cmp: Comparison, written: tuple[str, str], noise: Noise | None) -> str:
    return html.render(_with_noise(comparison.page(cmp, written), noise))


COMPARISON_FORMATS: dict[str, Callable[[Comparison, tuple[str, str], Noise | None], str]] = {
    "text": _comparison_text,
    "markdown": _comparison_markdown,
    "json": _comparison_json,
    "html": _comparison_html,
}


def report_format(path: str) -> str:
    return "markdown" if path.lower().endswith(".md") else "html"


def render_run(records: Iterable[TraceRecord], fmt: str, label: str = "", written: str = "") -> str:
    return RUN_FORMATS[fmt](run.build(records, label, written))


def render_comparison(cmp: Comparison, fmt: str, written: tuple[str, str] = ("", ""),
                      noise: Noise | None = None) -> str:
    return COMPARISON_FORMATS[fmt](cmp, written, noise)
