"""The curses shell of the terminal UI: owns the terminal while a run is in progress.

Contract
- `terminal_ui_available()` says whether stdin and stdout are terminals curses can drive.
- `run_with_ui(config, cases, backend, numbers)` starts a `Runner(keep_alive=True)` in its own
  thread, shows the live interface until the user quits, and returns a `UIOutcome` (final
  states, wall time, whether it was interrupted by a signal, a runner error) once the terminal
  is back in the mode it had before. Finished cases are then printed one line each, as
  `--plain` prints them; the caller prints the final report. After the last case the
  interface stays open (header DONE) so cases can still be inspected and re-run; q leaves.
- Keys: p pause/resume; q stop at the next token boundary and quit (again: quit without
  waiting); Up/Down/PgUp/PgDn/Home/End select (j/k too); Enter run the selected case now;
  r re-run the selected finished case; f follow the running case; Tab switch pane when only
  one fits. Ctrl+C, SIGTERM and SIGHUP stop like q and mark the outcome interrupted.
- The terminal is restored on every way out: normal quit, a signal, an exception in the UI or
  in the runner (the saved termios mode is re-applied after curses' own restore). An exception
  in either ends the run at a token boundary and comes back as `UIOutcome.error`, one line, so
  the report of what did run is still printed.
- The UI never blocks generation: listeners only update `LiveStats`; the screen is redrawn
  from `Runner.snapshot()` at most `UISettings.max_fps` times a second, only when something
  changed. Colours follow the terminal's support and are off when NO_COLOR is set.
It does not parse flags, grade, or print the final report.
"""

from __future__ import annotations

import curses
import locale
import os
import signal
import sys
import termios
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from ds4eval.cases.case import Case
from ds4eval.config import EvalConfig
from ds4eval.run import summary as report
from ds4eval.run.runner import CaseState, Runner
from ds4eval.run.tui import text as tx
from ds4eval.run.tui.render import Frame, Nav, follow, layout, render
from ds4eval.run.tui.view import LiveStats, View, build_view

ASCII_GLYPHS = str.maketrans({"─": "-", "│": "|", "┬": "+", "·": "|", "…": "~", "↑": "^", "↓": "v"})
MESSAGE_S = 4.0     # how long a footer message stays
KEY_ENTER = (10, 13, curses.KEY_ENTER)
KEY_TAB = 9


@dataclass(frozen=True)
class UISettings:
    max_fps: float = 20.0
    """Upper bound on redraws per second; the screen is redrawn only when something changed."""
    color: bool | None = None
    """None: colours when the terminal has them and NO_COLOR is unset; False/True force it."""


@dataclass
class UIOutcome:
    states: list[CaseState]
    wall_s: float
    interrupted: bool = False
    error: str = ""


def terminal_ui_available(stdin=None, stdout=None, env=None) -> bool:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    env = os.environ if env is None else env
    try:
        if not (stdin.isatty() and stdout.isatty()):
            return False
    except (AttributeError, ValueError):
        return False
    term = env.get("TERM", "")
    if not term or term == "dumb":
        return False
    try:
        curses.setupterm(term, stdout.fileno())
    except (curses.error, OSError, ValueError):
        return False
    return True


def colours_wanted(settings: UISettings, env=None) -> bool:
    env = os.environ if env is None else env
    if settings.color is not None:
        return settings.color
    return not env.get("NO_COLOR")


# ---------------------------------------------------------------- painting

def _style_attrs(color: bool) -> dict[str, int]:
    a = {"normal": curses.A_NORMAL, "header": curses.A_BOLD, "title": curses.A_BOLD, "rule": curses.A_DIM,
         "dim": curses.A_DIM, "passed": curses.A_BOLD, "failed": curses.A_BOLD | curses.A_UNDERLINE,
         "running": curses.A_UNDERLINE, "pending": curses.A_DIM, "other": curses.A_NORMAL,
         "thinking": curses.A_DIM, "answer": curses.A_BOLD, "key": curses.A_BOLD, "badge": curses.A_REVERSE,
         "message": curses.A_BOLD}
    if not color:
        return a
    curses.start_color()
    try:
        curses.use_default_colors()
        bg = -1
    except curses.error:
        bg = curses.COLOR_BLACK
    grey = 8 if curses.COLORS >= 16 else curses.COLOR_WHITE
    colours = {"passed": (curses.COLOR_GREEN, curses.A_BOLD), "failed": (curses.COLOR_RED, curses.A_BOLD),
               "running": (curses.COLOR_YELLOW, curses.A_BOLD), "pending": (grey, curses.A_DIM),
               "other": (curses.COLOR_MAGENTA, 0), "thinking": (grey, curses.A_DIM),
               "answer": (curses.COLOR_CYAN, curses.A_BOLD), "title": (curses.COLOR_CYAN, curses.A_BOLD),
               "badge": (curses.COLOR_YELLOW, curses.A_REVERSE | curses.A_BOLD),
               "message": (curses.COLOR_YELLOW, curses.A_BOLD), "key": (curses.COLOR_CYAN, curses.A_BOLD)}
    for n, (style, (fg, extra)) in enumerate(colours.items(), 1):
        if n >= curses.COLOR_PAIRS:
            break
        curses.init_pair(n, fg, bg)
        a[style] = curses.color_pair(n) | extra
    return a


def _runs(text: str):
    """(run, cells) pieces: stretches of one-cell characters, and each wide character alone, so
    every wide character is placed at a computed column even if curses measures it differently."""
    start = 0
    for i, ch in enumerate(text):
        if tx.char_width(ch) == 2:
            if i > start:
                yield text[start:i], i - start
            yield ch, 2
            start = i + 1
    if start < len(text):
        yield text[start:], len(text) - start


def paint(win, frame: Frame, attrs: dict[str, int], utf8: bool) -> None:
    win.erase()
    for p in frame.pieces:
        text = p.text if utf8 else tx.ascii_only(p.text.translate(ASCII_GLYPHS))
        attr = attrs.get(p.style, 0) | (curses.A_REVERSE if p.reverse else 0)
        x = p.x
        for run, cells in _runs(text):
            try:
                win.addstr(p.y, x, run, attr)
            except curses.error:
                pass  # writing the bottom-right cell moves the cursor off screen; the cell is drawn
            x += cells
    win.noutrefresh()
    curses.doupdate()


def _terminal_size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
        return size.lines, size.columns
    except OSError:
        return curses.LINES, curses.COLS


# ---------------------------------------------------------------- the application

class _App:
    def __init__(self, runner: Runner, stats: LiveStats, config: EvalConfig, worker: threading.Thread,
                 settings: UISettings, win, attrs: dict[str, int], utf8: bool, fd: int):
        self.runner, self.stats, self.config, self.worker = runner, stats, config, worker
        self.settings, self.win, self.attrs, self.utf8, self.fd = settings, win, attrs, utf8, fd
        self.nav = Nav()
        self.phase = "running"
        self.message, self.message_until = "", 0.0
        self.signals: list[int] = []
        self.interrupted = False
        self.abandon = False
        self.rows, self.cols = win.getmaxyx()
        self.view: View | None = None

    # -- input
    def say(self, message: str) -> None:
        self.message, self.message_until = message, time.monotonic() + MESSAGE_S

    def request_stop(self) -> None:
        if self.phase == "stopping":
            self.abandon = True
            return
        self.phase = "stopping"
        self.runner.stop()

    def on_key(self, key: int) -> None:
        view = self.view
        n = len(view.cases) if view else 0
        sel = self.nav.selected
        body = max(1, layout(self.rows, self.cols, self.nav.pane).body)
        moves = {curses.KEY_UP: -1, ord("k"): -1, curses.KEY_DOWN: 1, ord("j"): 1, curses.KEY_PPAGE: -body,
                 curses.KEY_NPAGE: body, curses.KEY_HOME: -n, curses.KEY_END: n}
        if key in moves and n:
            self.nav = replace(self.nav, selected=max(0, min(n - 1, sel + moves[key])), follow=False)
        elif key in (ord("q"), ord("Q")):
            self.request_stop()
        elif self.phase == "stopping":
            return
        elif key in (ord("p"), ord("P")):
            if self.runner.paused:
                self.runner.resume()
                self.say("resumed")
            else:
                self.runner.pause()
                self.say("paused: the clock is stopped")
        elif key in KEY_ENTER and n:
            case = view.cases[sel]
            if self.runner.run_next(sel):
                self.nav = replace(self.nav, follow=False)
                self.say(f"running #{case.number} now")
            else:
                self.say(f"#{case.number} is already running")
        elif key in (ord("r"), ord("R")) and n:
            case = view.cases[sel]
            if self.runner.rerun(sel):
                self.say(f"#{case.number} queued to run again")
            else:
                self.say(f"#{case.number} has not finished; r re-runs finished cases")
        elif key in (ord("f"), ord("F")):
            self.nav = replace(self.nav, follow=True)
            self.say("following the running case")
        elif key == KEY_TAB:
            self.nav = replace(self.nav, pane="output" if self.nav.pane == "list" else "list")
        elif key == curses.KEY_RESIZE:
            self.resize()

    def resize(self) -> None:
        rows, cols = _terminal_size(self.fd)
        if curses.is_term_resized(rows, cols):
            curses.resizeterm(rows, cols)
        self.rows, self.cols = self.win.getmaxyx()
        self.win.clear()  # repaint every cell: the terminal may have reflowed the old contents

    # -- drawing
    def draw(self) -> None:
        now = time.monotonic()
        if self.message and now >= self.message_until:
            self.message = ""
        self.view = build_view(self.runner.snapshot(), self.stats.freeze(), self.config.suite, self.phase,
                               self.message)
        self.nav = follow(self.nav, self.view)
        frame = render(self.view, self.nav, self.rows, self.cols)
        self.nav = replace(self.nav, list_top=frame.list_top)
        paint(self.win, frame, self.attrs, self.utf8)

    def loop(self) -> None:
        interval = 1.0 / max(1.0, self.settings.max_fps)
        self.win.timeout(max(10, int(interval * 1000)))
        last_draw = 0.0
        dirty = True
        while True:
            while self.signals:
                self.signals.pop()
                self.interrupted = True
                self.request_stop()
            if self.abandon or not self.worker.is_alive():
                return
            key = self.win.getch()
            if key != -1:
                # Handle every queued key (held arrows, pasted input) before the next frame.
                self.win.nodelay(True)
                while key != -1:
                    self.on_key(key)
                    key = self.win.getch()
                self.win.timeout(max(10, int(interval * 1000)))
                dirty = True
            if self.stats.changed.is_set():
                dirty = True
            now = time.monotonic()
            running = self.view is not None and self.view.running_index is not None and not self.runner.paused
            if running and now - last_draw >= 0.5:
                dirty = True  # the clocks move
            if self.message and now >= self.message_until:
                dirty = True
            if dirty and now - last_draw >= interval:
                self.stats.changed.clear()
                self.draw()
                last_draw, dirty = now, False


def run_with_ui(config: EvalConfig, cases: Sequence[Case], backend, numbers: Sequence[int] | None = None,
                settings: UISettings = UISettings(), repeats: Sequence[int] | None = None,
                shard_header: Mapping[str, object] | None = None) -> UIOutcome:
    stats = LiveStats()
    runner = Runner(config, cases, backend, [stats], numbers=numbers, repeats=repeats, keep_alive=True,
                    shard_header=shard_header)
    box: dict = {}

    def work() -> None:
        try:
            box["states"] = runner.run()
        except BaseException as e:  # reported after the terminal is restored, never on the UI screen
            box["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=work, name="ds4eval-runner", daemon=True)
    fd = sys.stdin.fileno()
    saved_mode = termios.tcgetattr(fd)
    app: _App | None = None
    old_handlers = {}
    signals: list[int] = []  # filled by the handlers, drained by the UI loop (main thread only)

    def on_signal(signum, _frame):
        signals.append(signum)

    try:
        locale.setlocale(locale.LC_CTYPE, "")
        utf8 = locale.nl_langinfo(locale.CODESET).replace("-", "").upper() == "UTF8"
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old_handlers[sig] = signal.signal(sig, on_signal)
        win = curses.initscr()
        try:
            curses.noecho()
            curses.cbreak()
            win.keypad(True)
            try:
                curses.curs_set(0)
            except curses.error:
                pass  # the terminal cannot hide its cursor
            attrs = _style_attrs(colours_wanted(settings) and curses.has_colors())
            app = _App(runner, stats, config, worker, settings, win, attrs, utf8, fd)
            app.signals = signals
            worker.start()
            try:
                app.loop()
            except Exception as e:  # a UI fault must not lose the run: stop it and report it
                box.setdefault("error", f"terminal UI failed: {_where(e)}")
        finally:
            try:
                win.keypad(False)
                curses.nocbreak()
                curses.echo()
            except curses.error:
                pass
            curses.endwin()
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved_mode)
        if worker.is_alive():
            runner.stop()
            if not (app and app.abandon):
                _join_patiently(worker, signals)
        # Restored only after the join: a signal during Thread.join() must not raise there.
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
    states = box.get("states") or runner.snapshot()
    wall_s = runner.wall_s or stats.freeze().elapsed_s
    for st in sorted(states, key=lambda s: s.number):
        if st.status.finished:
            print(report.case_line(st, max([len(states)] + [s.number for s in states])), flush=True)
    return UIOutcome(states=states, wall_s=wall_s, interrupted=bool(app and app.interrupted) or bool(signals),
                     error=box.get("error", ""))


def _where(e: BaseException) -> str:
    """`Type: message (file:line)` of the innermost frame, as a one-line error."""
    tb = traceback.extract_tb(e.__traceback__)
    place = f" ({os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{place}"


def _join_patiently(worker: threading.Thread, signals: list[int]) -> None:
    """Wait for the runner to reach a token boundary; another signal stops waiting. The UI's
    handlers are still installed, so a signal only lands in `signals` (a KeyboardInterrupt
    inside Thread.join() would make the thread look finished while it still runs)."""
    seen = len(signals)
    while worker.is_alive() and len(signals) <= seen:
        worker.join(0.2)
