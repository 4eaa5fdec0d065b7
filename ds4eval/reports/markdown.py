"""A `reports.document.Document` as markdown, for CI logs and pull-request comments. Pure.

Contract
- `render(doc, table=aligned_table) -> str`: "## title" (labels in backticks), the lead in
  bold, then each section after a blank line: "### title" and a blank line (when it has a
  title), its blocks separated by blank lines. Bullets are "- " lines, preformatted lines a
  fenced block.
- Two ways to write a table, chosen by the caller (`reports.formats`):
  `escaped_table`, a compact pipe table whose every cell is escaped so that no trace text can
  break a row (`|`, backslash, backtick, newlines), and nothing at all for a table without
  rows; `aligned_table`, tabulate's aligned pipe table with cells as they are (the comparison
  report's tables, whose bytes other tools have been reading).
- Cells show their text only: styles, links and sort keys are for richer media.
It reads only the Document; a block markdown is not given (a plot, the list of cases) raises
TypeError.
"""

from __future__ import annotations

from typing import Callable

from tabulate import tabulate

from ds4eval.reports.document import (Block, Bullets, Code, Document, Heading, Preformatted, Section, Table, Text,
                                      Title)

TableWriter = Callable[[Table], list[str]]


def _escaped(text: str) -> str:
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "\\r").replace("\n", "\\n")
    return text.replace("`", "\\`")


def escaped_table(table: Table) -> list[str]:
    if not table.rows:
        return []
    lines = ["| " + " | ".join(_escaped(h) for h in table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(_escaped(c.text) for c in r.cells) + " |" for r in table.rows]
    return lines


def aligned_table(table: Table) -> list[str]:
    return [tabulate([[c.text for c in r.cells] for r in table.rows], headers=list(table.columns), tablefmt="pipe",
                     disable_numparse=True)]


def title_text(title: Title) -> str:
    return "".join(f"`{p.text}`" if isinstance(p, Code) else p for p in title)


BLOCKS: dict[type, Callable[[Block], list[str]]] = {
    Text: lambda b: list(b.lines),
    Bullets: lambda b: [f"- {item}" for item in b.items],
    Preformatted: lambda b: ["```", *b.lines, "```"],
    Heading: lambda b: [f"#### {b.text}"],
}


def block_lines(block: Block, table: TableWriter) -> list[str]:
    if isinstance(block, Table):
        return table(block)
    try:
        write = BLOCKS[type(block)]
    except KeyError:
        raise TypeError(f"a markdown report cannot show a {type(block).__name__}") from None
    return write(block)


def section_lines(section: Section, table: TableWriter) -> list[str]:
    lines = [""]
    if section.title:
        lines += [f"### {section.title}", ""]
    for i, block in enumerate(section.blocks):
        if i:
            lines.append("")
        lines += block_lines(block, table)
    return lines


def render(doc: Document, table: TableWriter = aligned_table) -> str:
    lines = [f"## {title_text(doc.title)}"]
    if doc.lead is not None:
        lines += ["", f"**{doc.lead.text}**"]
    for section in doc.sections:
        lines += section_lines(section, table)
    return "\n".join(lines) + "\n"
