"""The neutral report model every renderer reads: a Document of Sections, each a sequence of
blocks (tables of cells, lines of text, sub-headings, plots, the list of cases). Plain data.

Contract
- Builders (`reports.run`, `reports.comparison`) make a Document from a RunReport or a
  Comparison, one per medium: what a terminal, a CI log or a page shows. Renderers
  (`reports.text`, `reports.markdown`, `reports.html`) make text from a Document and read
  nothing else.
- Every shown value is already a string (`Cell.text`): renderers format no number. A cell's
  `style` says what its value is (a status, a verbatim text, a token run...) for a renderer
  that can show it (HTML: a badge, <code>); `link` names the part of the same document it
  points at (a row `anchor`, or a filtered view such as "source=x"); renderers that cannot
  show either print `text` as it is.
- Headings and notes are blocks of their section, not parts of a table: the same table is a
  section of its own in a terminal report and sits under a sub-heading on a page.
- `Table.key`, `Section.key` and the plots' keys are ids unique in their document (the page's
  element ids); media without ids ignore them.
It imports nothing from ds4eval, and escapes and formats nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

# Cell styles (renderers that do not know one show the text plainly):
#   ""        plain text
#   strong    emphasised (the TOTAL row of a rate table)
#   status    a case status; `tag` is its class: the status, or "other" for one not in STATUSES
#   change    how a matched case moved; `tag` is its filter token (pass-fail, fail-pass, same, excluded)
#   movement  how a case's pass share over repeats moved; `tag`: bad, good, flaky, moved or same
#   code      verbatim text
#   same      a value equal to the one beside it (dimmed)
#   tokens    token texts (`pieces`), the one at index `marked` highlighted
STYLES = ("", "strong", "status", "change", "movement", "code", "same", "tokens")


@dataclass(frozen=True)
class Code:
    """A verbatim span of a title (a run's label)."""

    text: str


Title = tuple[Union[str, Code], ...]


def plain(title: Title) -> str:
    """The title as one plain string."""
    return "".join(p if isinstance(p, str) else p.text for p in title)


@dataclass(frozen=True)
class Cell:
    text: str
    style: str = ""
    tag: str = ""        # the class token of a status or a change (see STYLES)
    link: str = ""       # what the cell points at in the same document: a row anchor or a view
    sort: str = ""       # the key a sortable table orders the cell's column by
    pieces: tuple[str, ...] = ()  # style "tokens": the token texts
    marked: int | None = None     # style "tokens": index of the highlighted piece


@dataclass(frozen=True)
class Row:
    cells: tuple[Cell, ...]
    data: tuple[tuple[str, str], ...] = ()  # (name, value) marks of the row (HTML: data-NAME attributes)


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[Row, ...]
    key: str = ""
    style: str = ""  # "" , "kv" (field and value pairs) or "sortable" (rows re-sorted by a clicked column)


@dataclass(frozen=True)
class Text:
    """Lines of prose, each its own line; a note is a side remark (dimmed on a page)."""

    lines: tuple[str, ...]
    note: bool = False


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Preformatted:
    """Lines whose spacing matters (a fenced block in markdown)."""

    lines: tuple[str, ...]


@dataclass(frozen=True)
class Heading:
    """A heading inside a section."""

    text: str


@dataclass(frozen=True)
class Folded:
    """Blocks a reader opens on demand, behind a one-line summary."""

    summary: str
    blocks: tuple["Block", ...]


@dataclass(frozen=True)
class IntervalPlot:
    """A dot per row at its value and a bar across its interval, on one axis from lo to hi."""

    key: str
    title: str
    rows: tuple[tuple[str, float, float, float], ...]  # (name, value, low, high)
    lo: float
    hi: float
    zero: float | None = None  # where a reference line goes
    signed: bool = False       # values are differences (shown as signed points), not rates


@dataclass(frozen=True)
class Series:
    label: str
    values: tuple[int, ...]
    tone: str  # "run", "base" or "new"


@dataclass(frozen=True)
class Histogram:
    """Histograms of whole-token counts on shared bins, overlaid."""

    key: str
    title: str
    series: tuple[Series, ...]


@dataclass(frozen=True)
class Output:
    """One model output of a case, under its heading; `text` None when the input recorded none
    (a summary), and then `missing` says so."""

    heading: str
    text: str | None
    error: str = ""
    missing: str = ""


@dataclass(frozen=True)
class CaseDetail:
    question: str
    outputs: tuple[Output, ...]
    paired: bool = False  # the outputs are two sides of one case, shown side by side


@dataclass(frozen=True)
class CaseRow:
    anchor: str          # the row's id, what `Cell.link` points at
    source: str
    filters: str         # space-separated tokens the status filter matches
    cells: tuple[Cell, ...]
    detail: CaseDetail


@dataclass(frozen=True)
class CaseList:
    """Every case with its detail (question and outputs) folded, filtered by status and source."""

    columns: tuple[str, ...]
    rows: tuple[CaseRow, ...]
    sources: tuple[str, ...]  # the source filter's choices
    status_groups: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # (group label, ((token, label), ...))


Block = Union[Table, Text, Bullets, Preformatted, Heading, Folded, IntervalPlot, Histogram, CaseList]


@dataclass(frozen=True)
class Section:
    title: str  # "" for blocks that continue the previous section's subject
    blocks: tuple[Block, ...]
    key: str = ""


@dataclass(frozen=True)
class Document:
    title: Title
    sections: tuple[Section, ...]
    lead: Cell | None = None  # the line under the title: style "headline", or "verdict" tagged good or bad


def row(*values: object, data: tuple[tuple[str, str], ...] = ()) -> Row:
    """A row of cells: a Cell stays as it is, any other value becomes a plain cell of str(value)."""
    return Row(tuple(v if isinstance(v, Cell) else Cell(str(v)) for v in values), data)
