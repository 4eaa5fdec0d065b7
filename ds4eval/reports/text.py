"""A `reports.document.Document` as plain text for a terminal. Pure.

Contract
- `render(doc) -> str`: the title on the first line, then each section after a blank line: its
  title (when it has one) on a line of its own, its blocks separated by blank lines. Tables are
  tabulate's "simple" tables (numbers are not re-parsed: a cell shows its text as it is),
  bullets are "- " lines, preformatted lines are printed as they are.
- Cells show their text only: styles, links and sort keys are for richer media.
It reads only the Document; a block a terminal cannot show (a plot, the list of cases) raises
TypeError, since no document meant for it holds one.
"""

from __future__ import annotations

from typing import Callable

from tabulate import tabulate

from ds4eval.reports.document import Block, Bullets, Document, Heading, Preformatted, Section, Table, Text, plain


def table_text(table: Table) -> str:
    return tabulate([[c.text for c in r.cells] for r in table.rows], headers=list(table.columns), tablefmt="simple",
                    disable_numparse=True)


BLOCKS: dict[type, Callable[..., list[str]]] = {
    Table: lambda b: [table_text(b)],
    Text: lambda b: list(b.lines),
    Bullets: lambda b: [f"- {item}" for item in b.items],
    Preformatted: lambda b: list(b.lines),
    Heading: lambda b: [b.text],
}


def block_lines(block: Block) -> list[str]:
    try:
        write = BLOCKS[type(block)]
    except KeyError:
        raise TypeError(f"a text report cannot show a {type(block).__name__}") from None
    return write(block)


def section_lines(section: Section) -> list[str]:
    lines = [""]
    if section.title:
        lines.append(section.title)
    for i, block in enumerate(section.blocks):
        if i:
            lines.append("")
        lines += block_lines(block)
    return lines


def render(doc: Document) -> str:
    lines = [plain(doc.title)]
    if doc.lead is not None:
        lines += ["", doc.lead.text]
    for section in doc.sections:
        lines += section_lines(section)
    return "\n".join(lines) + "\n"
