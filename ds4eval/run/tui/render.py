"""Pure rendering of the terminal UI: a `View`, the navigation state and a size in, a `Frame` out.

Contract
- `render(view, nav, rows, cols) -> Frame`. A frame is a list of `Piece(y, x, text, style,
  reverse)` that together cover every cell of the screen exactly once, never past its edges,
  for any size down to 1x1 (cells are counted with `ds4eval.run.tui.text`, so wide characters are
  placed exactly). Styles are names (`STYLES`); the curses shell maps them to colours or, without
  colour, to bold/dim/underline.
- Layout: header (two lines, or one on short screens), a title rule, the case list on the left
  and the selected case's output on the right, and a footer with the keys. Narrow or short
  screens get one pane at a time (Tab switches between list and output).
- `Nav` is the navigation state (selection, follow mode, list scroll, single-pane choice);
  `Frame.list_top` is the list scroll the frame used, to be kept for the next frame.
It does no I/O and knows nothing of curses or the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ds4eval.run.tui import text as tx
from ds4eval.run.tui.view import CaseRow, View, split_thinking

STYLES = ("normal", "header", "title", "rule", "dim", "passed", "failed", "running", "pending",
          "other", "thinking", "answer", "key", "badge", "message")

STATUS_STYLE = {"PASSED": "passed", "FAILED": "failed", "ERROR": "failed", "PREFILL": "running",
                "THINKING": "running", "PENDING": "pending", "SKIPPED": "other", "STOPPED": "other",
                "SWITCHED": "other"}
STATUS_SHORT = {"PASSED": "PASS", "FAILED": "FAIL", "ERROR": "ERR", "PREFILL": "PREF", "THINKING": "RUN",
                "PENDING": "wait", "SKIPPED": "SKIP", "STOPPED": "STOP", "SWITCHED": "SWCH"}

TWO_PANE_MIN_COLS = 60
RULE, BAR, TEE, DOT = "─", "│", "┬", "·"


@dataclass(frozen=True)
class Nav:
    selected: int = 0
    follow: bool = True      # selection jumps to the running case until the user moves it
    list_top: int = 0
    pane: str = "list"       # which pane a one-pane screen shows: "list" or "output"


@dataclass(frozen=True)
class Piece:
    y: int
    x: int
    text: str
    style: str = "normal"
    reverse: bool = False


@dataclass(frozen=True)
class Frame:
    rows: int
    cols: int
    pieces: tuple[Piece, ...]
    list_top: int
    two_panes: bool

    def text_lines(self) -> list[str]:
        """The frame as plain text (one string per row), for tests and debugging."""
        grid = [[" "] * self.cols for _ in range(self.rows)]
        for p in self.pieces:
            x = p.x
            for ch in p.text:
                grid[p.y][x] = ch
                if tx.char_width(ch) == 2:
                    grid[p.y][x + 1] = ""
                x += tx.char_width(ch)
        return ["".join(r) for r in grid]


@dataclass(frozen=True)
class Layout:
    header: int     # header lines (0-2)
    rule: int       # title rule line (0-1)
    footer: int     # footer line (0-1)
    body: int       # lines for the panes
    left: int       # columns of the list pane; 0 when only the output pane is shown
    two_panes: bool


def layout(rows: int, cols: int, pane: str = "list") -> Layout:
    header = 2 if rows >= 10 else (1 if rows >= 1 else 0)
    footer = 1 if rows >= 5 else 0
    rule = 1 if rows >= 8 else 0
    body = max(0, rows - header - footer - rule)
    two = cols >= TWO_PANE_MIN_COLS and body >= 3
    if two:
        left = max(28, min(cols * 9 // 20, 64))
    else:
        left = cols if pane == "list" else 0
    return Layout(header, rule, footer, body, left, two)


def clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# ---------------------------------------------------------------- line builder

class _Line:
    """Styled runs for one screen row, clipped and padded to an exact width."""

    def __init__(self, y: int, x: int, width: int):
        self.y, self.x0, self.width = y, x, width
        self.runs: list[tuple[str, str]] = []
        self.used = 0

    def add(self, text: str, style: str = "normal") -> "_Line":
        text = tx.sanitize(text).replace("\n", " ")
        room = self.width - self.used
        if room <= 0 or not text:
            return self
        w = tx.width(text)
        if w > room:
            text = tx.clip(text, room, pad=False)
            w = tx.width(text)
        self.runs.append((text, style))
        self.used += w
        return self

    def fill(self, char: str, style: str) -> "_Line":
        """Repeat a one-cell character to the end of the line."""
        return self.add(char * max(0, self.width - self.used), style)

    def pieces(self, fill_style: str = "normal", reverse: bool = False) -> list[Piece]:
        out, x = [], self.x0
        for text, style in self.runs:
            out.append(Piece(self.y, x, text, style, reverse))
            x += tx.width(text)
        if self.used < self.width:
            out.append(Piece(self.y, x, " " * (self.width - self.used), fill_style, reverse))
        return out


def _fit(groups: list[list[tuple[str, str]]], width: int) -> list[tuple[str, str]]:
    """Whole groups of runs, in order, up to the first that does not fit (groups come in
    priority order, so a narrow screen keeps the most useful ones)."""
    out, used = [], 0
    for group in groups:
        w = sum(tx.width(t) for t, _ in group)
        if used + w > width:
            break
        out += group
        used += w
    return out


# ---------------------------------------------------------------- render

def render(view: View, nav: Nav, rows: int, cols: int) -> Frame:
    if rows <= 0 or cols <= 0:
        return Frame(max(rows, 0), max(cols, 0), (), nav.list_top, False)
    lay = layout(rows, cols, nav.pane)
    pieces: list[Piece] = []
    y = 0
    for line in _header(view, lay.header, cols):
        ln = _Line(y, 0, cols)
        for text, style in line:
            ln.add(text, style)
        pieces += ln.pieces("header")
        y += 1
    n = len(view.cases)
    sel = min(max(nav.selected, 0), n - 1) if n else 0
    top = _scroll(nav.list_top, sel, lay.body, n)
    case = view.cases[sel] if n else None
    list_w = lay.left
    out_x = lay.left + 1 if lay.two_panes else 0
    out_w = cols - out_x if (lay.two_panes or lay.left == 0) else 0
    if lay.rule:
        pieces += _rule(y, view, case, list_w, out_x, out_w, lay.two_panes, cols, top, lay.body)
        y += 1
    body_top = y
    if list_w:
        pieces += _list(view, sel, top, body_top, list_w, lay.body)
    if lay.two_panes:
        for i in range(lay.body):
            pieces.append(Piece(body_top + i, list_w, BAR, "rule"))
    if out_w:
        pieces += _output(case, body_top, out_x, out_w, lay.body)
    y = body_top + lay.body
    if lay.footer:
        pieces += _footer(view, nav, y, cols, lay.two_panes)
    return Frame(rows, cols, tuple(pieces), top, lay.two_panes)


def _scroll(top: int, sel: int, height: int, n: int) -> int:
    if height <= 0 or n == 0:
        return 0
    if sel < top:
        top = sel
    elif sel >= top + height:
        top = sel - height + 1
    return max(0, min(top, max(0, n - height)))


def _header(view: View, lines: int, cols: int) -> list[list[tuple[str, str]]]:
    if lines == 0:
        return []
    total = len(view.cases)
    badge = {"stopping": "STOPPING", "done": "DONE"}.get(view.phase, "PAUSED" if view.paused else "RUNNING")
    progress = [[(f" {view.done_count}/{total}", "header")],
                [("  ", "header"), (f"passed {view.count('PASSED')}", "passed")],
                [("  ", "header"), (f"failed {view.count('FAILED')}", "failed")]]
    ctx = f"ctx {view.ctx_used if view.ctx_used is not None else '-'}"
    ctx += f"/{view.n_ctx}" if view.n_ctx else ""
    speed = f"{view.tokens_per_s:.1f} tok/s" if view.ctx_used is not None else "- tok/s"
    stats = [[("  ", "header"), (f"elapsed {clock(view.elapsed_s)}", "header")]]
    if view.phase == "running" and view.done_count < total and view.eta_s is not None:
        stats.append([("  ", "header"), (f"eta {clock(view.eta_s)}", "header")])
    stats += [[("  ", "header"), (speed, "header")], [("  ", "header"), (ctx, "header")]]
    stats += [[("  ", "header"), (text, "header")] for text in _latency_texts(view)]
    ident = [[(f"model {view.model}", "header")], [(f" {DOT} suite {view.suite}", "header")],
             [(f" {DOT} backend {view.backend}", "header")]]
    badge_part = (f" {badge} ", "badge")
    if lines == 1:
        groups = [[badge_part, (" ", "header")]] if badge != "RUNNING" else []
        groups += progress + stats + [[("  ", "header")] + ident[0]] + ident[1:]
        return [_fit(groups, cols)]
    first = _fit([[(" ds4-eval  ", "title")]] + ident, max(0, cols - tx.width(badge_part[0]) - 1))
    pad = cols - sum(tx.width(t) for t, _ in first) - tx.width(badge_part[0])
    if pad >= 1:
        first = first + [(" " * pad, "header"), badge_part]
    return [first, _fit(progress + stats, cols)]


def _latency_texts(view: View) -> list[str]:
    """The done run's TTFT and ITL p50/p90, one header group each (none while running)."""
    s = view.latency
    if s is None:
        return []
    out = []
    if s.ttft is not None:
        out.append(f"TTFT p50/p90 {s.ttft.p50:.2f}/{s.ttft.p90:.2f} s")
    if s.itl is not None:
        out.append(f"ITL p50/p90 {1000 * s.itl.p50:.1f}/{1000 * s.itl.p90:.1f} ms")
    return out


def _case_title(case: CaseRow | None) -> list[tuple[str, str]]:
    if case is None:
        return [(" no cases ", "title")]
    parts = [(f" #{case.number} {case.label} ", "title"), (case.status, STATUS_STYLE.get(case.status, "normal"))]
    if case.running or case.finished or case.gen_tokens:
        parts.append((f" {DOT} {case.gen_tokens} tok {DOT} {case.elapsed_s:.1f} s ", "title"))
    else:
        parts.append((" ", "title"))
    return parts


def _rule(y, view, case, list_w, out_x, out_w, two, cols, top, body) -> list[Piece]:
    pieces = []
    if list_w:
        n = len(view.cases)
        shown = f" cases {top + 1}-{min(n, top + body)} of {n} " if n > body else f" cases ({n}) "
        if _one_source(view):
            shown += f"{DOT} {view.cases[0].source} "
        ln = _Line(y, 0, list_w)
        ln.add(RULE, "rule").add(shown, "title")
        if list_w - ln.used >= 18:
            ln.add(" picked|expected ", "dim")
        ln.fill(RULE, "rule")
        pieces += ln.pieces("rule")
    if two:
        pieces.append(Piece(y, list_w, TEE, "rule"))
    if out_w:
        ln = _Line(y, out_x, out_w)
        ln.add(RULE, "rule")
        for text, style in _case_title(case):
            ln.add(text, style)
        ln.fill(RULE, "rule")
        pieces += ln.pieces("rule")
    return pieces


def _one_source(view: View) -> bool:
    return len({c.source for c in view.cases}) == 1


def _list(view: View, sel: int, top: int, y0: int, width: int, height: int) -> list[Piece]:
    pieces: list[Piece] = []
    cases = view.cases
    nw = len(str(max((c.number for c in cases), default=1)))
    sw = 8 if width >= 40 else 4
    # "|" and not "/": rational answers contain slashes.
    pe = [f"{'-' if c.picked is None else c.picked}|{c.expected}" for c in cases]
    one_source = _one_source(view)  # then the rule names it and rows show only the id
    flex = width - (nw + sw + 3)  # cells left for the case label and picked/expected
    # picked/expected gets at most a third of them: the label is what identifies the case.
    pw = 0
    if width >= 30:
        pw = min(max((tx.width(tx.sanitize(p)) for p in pe), default=0), 13, max(5, flex // 3))
    for row in range(height):
        i = top + row
        ln = _Line(y0 + row, 0, width)
        if i >= len(cases):
            pieces += ln.pieces()
            continue
        c = cases[i]
        style = STATUS_STYLE.get(c.status, "normal")
        status = c.status if sw == 8 else STATUS_SHORT.get(c.status, c.status[:4])
        label_w = width - nw - 1 - sw - 1 - (pw + 1 if pw else 0) - 1
        ln.add(f" {c.number:>{nw}}", "dim")
        ln.add(" ").add(tx.clip(status, sw), style).add(" ")
        label = c.id if one_source else c.label
        ln.add(tx.clip(tx.sanitize(label), max(label_w, 0)), "pending" if c.status == "PENDING" else "normal")
        if pw:
            pe_style = {"PASSED": "passed", "FAILED": "failed"}.get(c.status, "dim")
            ln.add(" ").add(tx.clip(tx.sanitize(pe[i]), pw), pe_style)
        pieces += ln.pieces(reverse=i == sel)
    return pieces


def _tail_lines(output: str, width: int, lines: int) -> list[list[tuple[str, str]]]:
    """The last `lines` wrapped lines of `output`, styled thinking/answer.

    Only the end of a long output is wrapped (a frame must stay cheap while a case streams
    thousands of tokens): every wrapped line holds at most `width` characters, so the last
    (lines + 1) * (width + 1) characters give enough lines; the first of them may be a partial
    line and is dropped.
    """
    runs = split_thinking(output)
    keep = (lines + 1) * (width + 1)
    cut = len(output) > keep
    if cut:
        tail, left = [], keep
        for text, thinking in reversed(runs):
            if left <= 0:
                break
            tail.append((text[-left:], thinking))
            left -= len(text)
        runs = tail[::-1]
    wrapped = tx.wrap_spans([(tx.sanitize(t), "thinking" if thinking else "answer") for t, thinking in runs], width)
    return wrapped[1:] if cut else wrapped


Lines = list[list[tuple[str, str]]]


def _output_lines(case: CaseRow | None, width: int, tail: int) -> tuple[Lines, Lines]:
    """(fixed head lines, output lines) of the output pane; `tail` bounds the output lines needed."""
    if case is None:
        return [[("no cases selected", "dim")]], []
    head: Lines = []
    title = tx.wrap_spans([(tx.sanitize(case.title), "title")], width)
    if len(title) > 2:  # at most two lines; the second ends with an ellipsis
        last = "".join(t for t, _ in title[1]) + " " + "".join(t for line in title[2:] for t, _ in line)
        title = [title[0], [(tx.clip(last, width, pad=False), "title")]]
    head += title
    style = STATUS_STYLE.get(case.status, "normal")
    info: list[tuple[str, str]] = [(case.status, style)]
    if case.status == "PREFILL":
        info.append((f" {DOT} prefill {case.prefill_done}/{case.prompt_tokens}", "dim"))
    if case.running or case.finished:
        info.append((f" {DOT} picked {'-' if case.picked is None else case.picked} {DOT} expected {case.expected}",
                     "normal"))
        info.append((f" {DOT} {case.gen_tokens} tok {DOT} {case.tokens_per_s:.1f} tok/s", "dim"))
    else:
        info.append((f" {DOT} expected {case.expected}", "normal"))
    if case.think_close not in ("none", "natural"):
        info.append((f" {DOT} think-close {case.think_close}", "dim"))
    head += tx.wrap_spans([(tx.sanitize(t), s) for t, s in info], width)
    if case.error:
        head += tx.wrap_spans([(tx.sanitize(case.error), "failed")], width)[:2]
    if case.output:
        body = _tail_lines(case.output, width, tail)
    elif case.status == "PENDING":
        body = [[("not run yet; Enter runs it now", "dim")]]
    elif case.status == "SWITCHED":
        body = [[("switched out; queued to run again", "dim")]]
    elif case.running:
        body = [[("waiting for output…", "dim")]]
    else:
        body = [[("no output", "dim")]]
    return head, body


def _output(case: CaseRow | None, y0: int, x0: int, width: int, height: int) -> list[Piece]:
    head, body = _output_lines(case, width, height)
    if height <= 2:
        head = []  # a sliver of screen shows the newest output, not the title
    head = head[:max(0, height - 2)]
    if head and height - len(head) >= 3:
        head = head + [[]]  # a blank line between the case's summary and its output
    room = height - len(head)
    lines = head + (body[-room:] if room > 0 else [])
    pieces: list[Piece] = []
    for row in range(height):
        ln = _Line(y0 + row, x0, width)
        if row < len(lines):
            for text, style in lines[row]:
                ln.add(text, style)
        pieces += ln.pieces()
    return pieces


def _footer(view: View, nav: Nav, y: int, cols: int, two: bool) -> list[Piece]:
    ln = _Line(y, 0, cols)
    if view.phase == "stopping":
        pairs = [(" stopping at the next token boundary ", ""), ("q", "quit now")]
        keys = [[(pairs[0][0], "badge")], [("  q", "key"), (" quit now", "normal")]]
    else:
        pairs = [("p", "resume" if view.paused else "pause"), ("q", "quit"), ("↑↓ PgUp PgDn", "select"),
                 ("Enter", "run now"), ("r", "re-run")]
        pairs += [] if two else [("Tab", "list/output")]
        pairs += [("f", "follow")]
        keys = [[(" " if i == 0 else "  ", "normal"), (k, "key"), (" " + label, "normal")]
                for i, (k, label) in enumerate(pairs)]
    msg = f" {view.message} " if view.message else ""
    keys_w = max(0, cols - tx.width(msg))
    for text, style in _fit(keys, keys_w):
        ln.add(text, style)
    if msg:
        ln.add(" " * max(0, cols - ln.used - tx.width(msg)), "normal").add(msg, "message")
    return ln.pieces()


def follow(nav: Nav, view: View) -> Nav:
    """The selection a frame should use: the running case while in follow mode."""
    if nav.follow and view.running_index is not None and nav.selected != view.running_index:
        return replace(nav, selected=view.running_index)
    return nav
