"""`ds4-eval` in a pseudo-terminal, read back through a terminal emulator (pyte).

Each test starts the real command line (`python -m ds4eval.cli`) on a pty with a set window
size, against a scripted OpenAI-compatible SSE server in this process (no model weights), then
presses keys and asserts on what the emulated screen shows. Waits poll the screen with a
timeout; nothing sleeps a fixed amount except where the test is about time passing (pause).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyte
import pytest

REPO = Path(__file__).resolve().parents[3]
WAIT_S = 15.0

# Replies by question text. `--domain arithmetic` selects six sanity cases, numbered 1-6 in the run:
# 1 "2 + 2" (passes), 2 "2 + 3" (fails, then passes when re-run), 3 "10 + 20" (streams slowly), 4 "9 - 4".
THINKING = "先想一想：十加二十等于三十。 Ten plus twenty 🙂 is thirty; let me double-check the sum. "
SLOW_CHUNKS = 4000          # #3 streams this many thinking chunks: it is "running" for the whole test
SLOW_DELAY_S = 0.02


def sse(delta=None, finish=None, usage=None):
    obj = {"choices": [] if usage else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    if usage:
        obj["usage"] = usage
    return "data: " + json.dumps(obj)


class FakeServer(BaseHTTPRequestHandler):
    """Streams a scripted reply; the reply to "2 + 3" is wrong the first time and right after."""

    asked: dict[str, int] = {}
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def replies(self, question: str) -> tuple[list[str], float]:
        with self.lock:
            n = FakeServer.asked[question[:40]] = FakeServer.asked.get(question[:40], 0) + 1
        if "What is 2 + 2?" in question:
            return [sse({"reasoning_content": "Two plus two is four."}), sse({"content": "Answer: B"})], 0.0
        if "What is 2 + 3?" in question:
            return [sse({"content": "Answer: 6" if n == 1 else "Answer: 5"})], 0.0
        if "What is 10 + 20?" in question:
            return [sse({"reasoning_content": THINKING[i % 5 * 12:(i % 5 + 1) * 12] if i % 5 < 4
                         else THINKING[48:]}) for i in range(SLOW_CHUNKS)] + \
                [sse({"content": "Answer: 30"})], SLOW_DELAY_S
        if "What is 9 - 4?" in question:  # slow enough (about 1 s) to see the case it displaced
            return [sse({"reasoning_content": "Nine minus four. "}) for _ in range(25)] + \
                [sse({"content": "Answer: 5"})], 0.04
        return [sse({"content": "Answer: 0"})], 0.0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        events, delay = self.replies(body["messages"][1]["content"])
        events += [sse(finish="stop"), sse(usage={"prompt_tokens": 57, "completion_tokens": len(events)}),
                   "data: [DONE]"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for ev in events:
                if delay:
                    time.sleep(delay)
                self.wfile.write((ev + "\n\n").encode())
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped or switched the case


@pytest.fixture(scope="module")
def server_url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def fresh_script():
    FakeServer.asked = {}


# ---------------------------------------------------------------- the terminal

class RepScreen(pyte.Screen):
    """pyte screen that also understands REP (CSI n b), which ncurses uses for xterm."""

    last = " "

    def draw(self, data: str) -> None:
        super().draw(data)
        if data:
            self.last = data[-1]

    def repeat_last(self, count=1, *args, **kwargs) -> None:
        self.draw(self.last * max(1, count or 1))


class RepStream(pyte.ByteStream):
    csi = dict(pyte.ByteStream.csi, b="repeat_last")


class Snap:
    def __init__(self, lines, cells):
        self.lines, self.grid = lines, cells

    def text(self) -> str:
        return "\n".join(self.lines)

    def row(self, pattern: str) -> int:
        for y, line in enumerate(self.lines):
            if re.search(pattern, line):
                return y
        raise AssertionError(f"no row matches {pattern!r}:\n{self.text()}")

    def cell(self, y: int, x: int):
        return self.grid[y][x]

    def cells(self, y: int, word: str):
        """Cells of the first `word` on row y (the tests pick rows that are ASCII up to `word`)."""
        x = self.lines[y].index(word)
        return self.grid[y][x:x + len(word)]


def _make_controlling_tty():
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Term:
    """A program on a pty, with the screen as a terminal emulator sees it."""

    def __init__(self, args, rows=30, cols=110, env=None, python_code=None):
        self.master, self.slave = os.openpty()
        self.screen = RepScreen(cols, rows)
        self.stream = RepStream(self.screen)
        self.set_size(rows, cols, signal_child=False)
        self.raw = bytearray()
        self.lock = threading.Lock()
        base = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "COLUMNS", "LINES")}
        base.update(TERM="xterm-256color", LANG="C.UTF-8", LC_ALL="C.UTF-8", PYTHONUNBUFFERED="1",
                    PYTHONPATH=str(REPO) + os.pathsep + base.get("PYTHONPATH", ""))
        base.update(env or {})
        argv = ["-c", python_code, *args] if python_code else ["-m", "ds4eval.cli", *args]
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=base,
                                     stdin=self.slave, stdout=self.slave, stderr=self.slave,
                                     start_new_session=True, preexec_fn=_make_controlling_tty)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                self.raw += data
                self.stream.feed(data)

    def set_size(self, rows, cols, signal_child=True):
        with getattr(self, "lock", threading.Lock()):
            self.screen.resize(rows, cols)
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        if signal_child:  # the kernel signals the foreground group too; this makes it explicit
            os.killpg(self.proc.pid, signal.SIGWINCH)

    def press(self, keys: str | bytes) -> None:
        os.write(self.master, keys.encode() if isinstance(keys, str) else keys)

    def lines(self) -> list[str]:
        with self.lock:
            return list(self.screen.display)

    def text(self) -> str:
        return "\n".join(self.lines())

    def output(self) -> str:
        with self.lock:
            return self.raw.decode("utf-8", "replace")

    def wait(self, predicate, what: str, timeout: float = WAIT_S):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = predicate(self)
            if got:
                return got
            if self.proc.poll() is not None and self.proc.returncode is not None:
                got = predicate(self)
                if got:
                    return got
                raise AssertionError(f"exited ({self.proc.returncode}) waiting for {what}:\n{self.output()[-3000:]}")
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{self.text()}")

    def wait_for(self, pattern: str, timeout: float = WAIT_S) -> re.Match:
        return self.wait(lambda t: re.search(pattern, t.text()), repr(pattern), timeout)

    def snap(self) -> "Snap":
        """The screen at one instant: text and cell attributes that agree with each other."""
        with self.lock:
            cols, rows = self.screen.columns, self.screen.lines
            return Snap(list(self.screen.display),
                        [[self.screen.buffer[y][x] for x in range(cols)] for y in range(rows)])

    def exit_code(self, timeout: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running; screen:\n{self.text()}") from None

    def mode(self) -> tuple[bool, bool]:
        lflag = termios.tcgetattr(self.slave)[3]
        return bool(lflag & termios.ECHO), bool(lflag & termios.ICANON)

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.slave)
        os.close(self.master)


@pytest.fixture
def term(server_url):
    started = []

    def start(*extra, rows=30, cols=110, env=None, domain="arithmetic", python_code=None):
        args = ["--backend", "openai", "--url", server_url, "--served-model", "fake-model", "--ctx", "4096"]
        if domain:
            args += ["--domain", domain]
        t = Term(args + list(extra), rows, cols, env, python_code)
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


def status_of(t: Term, number: int) -> str:
    m = re.search(rf"^ +{number} (\w+) ", t.text(), re.M)
    return m.group(1) if m else ""


def wait_status(t: Term, number: int, status: str, timeout: float = WAIT_S):
    t.wait(lambda t: status_of(t, number) == status, f"case {number} {status}", timeout)


UP, DOWN, ENTER = "\x1bOA", "\x1bOB", "\r"


# ---------------------------------------------------------------- tests

def test_live_screen_layout_colours_and_quit_with_report(term):
    t = term()
    wait_status(t, 3, "THINKING")
    t.wait_for("Ten plus")
    assert t.mode() == (False, False)  # curses owns the terminal: no echo, no line editing
    header = t.lines()[:2]
    assert re.search(r"ds4-eval +model fake-model · suite sanity · backend openai +RUNNING", header[0])
    assert re.search(r"2/6 +passed 1 +failed 1 +elapsed 0:\d\d +eta 0:\d\d +\d+\.\d tok/s +ctx \d+/4096", header[1])
    assert [status_of(t, n) for n in range(1, 7)] == \
        ["PASSED", "FAILED", "THINKING", "PENDING", "PENDING", "PENDING"]
    t.wait_for(r"│let me double")
    s = t.snap()
    # Picked vs expected, coloured by status.
    y1, y2, y3, y4 = (s.row(rf"^ +{n} ") for n in (1, 2, 3, 4))
    assert "B|B" in s.lines[y1] and "6|5" in s.lines[y2] and "-|30" in s.lines[y3]
    assert {c.fg for c in s.cells(y1, "PASSED")} == {"green"}
    assert {c.fg for c in s.cells(y2, "FAILED")} == {"red"}
    assert {c.fg for c in s.cells(y3, "THINKING")} == {"brown"}  # pyte's name for ANSI yellow
    assert s.cell(y3, 2).reverse and not s.cell(y4, 2).reverse  # selection follows the running case
    assert {c.fg for c in s.cells(y4, "PENDING")} == {"brightblack"}  # pending cases are greyed
    # The right pane streams #3 live; wide characters keep the divider in one column.
    assert re.search(r"#3 sanity/int-add-tens THINKING · \d+ tok", s.lines[2])
    divider = s.lines[3].index("│")
    for y in range(3, 28):
        assert s.cell(y, divider).data == "│", f"row {y} lost its divider:\n{s.text()}"
    assert "十加二十" in s.text() and "🙂" in s.text()
    # Thinking is dimmed (grey); moving the selection to #1 shows its output: the answer highlighted.
    assert {c.fg for c in s.cells(s.row(r"│let me double"), "let me")} == {"brightblack"}
    t.press(UP)
    t.press(UP)
    t.wait_for(r"#1 sanity/choice-two-plus-two PASSED")
    s = t.snap()
    ans = s.row(r"│<think>Two plus two is four.</think>Answer: B")
    assert all(c.bold and c.fg == "cyan" for c in s.cells(ans, "Answer: B"))
    assert not any(c.bold for c in s.cells(ans, "Two plus two")) and s.cells(ans, "Two")[0].fg == "brightblack"
    t.press("q")
    assert t.exit_code() == 3  # quit with cases left unrun: not every case was graded
    out = t.output()
    assert t.mode() == (True, True)  # echo and canonical mode are back
    assert not t.screen.cursor.hidden
    assert "PASSED  sanity/choice-two-plus-two" in out and "FAILED  sanity/int-add-small" in out
    assert "STOPPED sanity/int-add-tens" in out
    assert re.search(r"TOTAL +6 +1 +1 +4", out) and "passed 1/6" in out and "not run 3" in out


def test_pause_stops_the_clock_and_generation(term):
    t = term()
    wait_status(t, 3, "THINKING")

    def reading(t):
        lines = t.lines()
        m = re.search(r"elapsed (\d+:\d\d)", lines[1])
        n = re.search(r"#3 sanity/int-add-tens THINKING · (\d+) tok · ([\d.]+) s", lines[2])
        return (m.group(1), n.group(1), n.group(2)) if m and n else None

    t.wait(lambda t: (r := reading(t)) and r[0] != "0:00", "the clock to reach 0:01")
    t.press("p")
    t.wait(lambda t: "PAUSED" in t.lines()[0] and "p resume" in t.lines()[-1], "the paused header")
    # A token already past its checkpoint may still land: wait until two readings agree.
    frozen, previous = reading(t), None
    deadline = time.monotonic() + WAIT_S
    while frozen != previous and time.monotonic() < deadline:
        time.sleep(0.3)
        previous, frozen = frozen, reading(t)
    deadline = time.monotonic() + 2.2  # the test is about time passing: watch it for over a second
    while time.monotonic() < deadline:
        assert reading(t) == frozen, f"changed while paused:\n{t.text()}"
        time.sleep(0.05)
    t.press("p")
    t.wait(lambda t: "RUNNING" in t.lines()[0], "the running header")
    t.wait(lambda t: (r := reading(t)) and r[1] != frozen[1] and r[0] != frozen[0], "the clock to move again")
    t.press("q")
    assert t.exit_code() == 3 and t.mode() == (True, True)


def test_enter_switches_and_r_reruns(term):
    t = term()
    wait_status(t, 3, "THINKING")
    t.press(DOWN)  # selection leaves the running #3 for #4
    t.wait_for(r"#4 sanity/int-subtract PENDING")
    t.press(ENTER)
    wait_status(t, 3, "SWITCHED")
    wait_status(t, 4, "PASSED")
    wait_status(t, 3, "THINKING")  # back from the queue, right after #4
    assert status_of(t, 5) == "PENDING"
    t.press(UP)
    t.press("r")  # #3 is running: nothing to re-run
    t.wait_for("#3 has not finished")
    t.press(UP)
    t.wait_for(r"#2 sanity/int-add-small FAILED")
    t.press("r")
    t.wait_for("#2 queued to run again")
    wait_status(t, 2, "PENDING")  # queued first; it waits for the running case's slot
    assert status_of(t, 3) == "THINKING"
    t.press(ENTER)  # so run it now
    wait_status(t, 2, "PASSED")  # the server answers correctly the second time
    s = t.snap()
    assert "5|5" in s.lines[s.row(r"^ +2 ")]
    t.press("q")
    assert t.exit_code() == 3
    out = t.output()
    assert "PASSED  sanity/int-add-small" in out and "passed 3/6" in out


def test_resize_down_to_a_tiny_terminal_and_back(term):
    t = term()
    wait_status(t, 3, "THINKING")
    t.set_size(6, 20)
    t.wait(lambda t: re.match(r" ?2/6 +passed 1", t.lines()[0]) and "│" not in t.text(), "the tiny layout")
    assert t.proc.poll() is None
    assert re.search(r"^ +1 PASS choice-two", t.text(), re.M)  # one source: rows show only the id
    t.press("\t")  # one pane at a time: switch to the output
    t.wait(lambda t: "Ten plus" in t.text() or "十" in t.text(), "output in the single pane")
    t.set_size(3, 7)
    t.wait(lambda t: len(t.lines()) == 3 and "2/6" in t.lines()[0], "a 3x7 screen")
    t.set_size(24, 80)
    t.wait(lambda t: "│" in t.text() and "suite sanity" in t.lines()[0] and len(t.lines()[0]) == 80, "two panes")
    t.wait(lambda t: all(len(line) <= 80 for line in t.lines()) and t.lines()[-1].startswith(" p pause"),
           "the footer")
    t.press("q")
    assert t.exit_code() == 3 and t.mode() == (True, True)


def test_no_color_means_no_colours(term):
    t = term(env={"NO_COLOR": "1"})
    wait_status(t, 3, "THINKING")
    t.wait_for("Ten plus")
    with t.lock:
        colours = {(c.fg, c.bg) for row in t.screen.buffer.values() for c in row.values()}
    assert colours == {("default", "default")}
    s = t.snap()
    assert s.cell(s.row(r"^ +3 "), 2).reverse  # the selection is still visible without colour
    t.press("q")
    assert t.exit_code() == 3


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_cleanly_and_restores_the_terminal(term, how):
    t = term()
    wait_status(t, 3, "THINKING")
    if how == "ctrl-c":
        t.press("\x03")  # the terminal turns it into SIGINT for the foreground process group
    else:
        t.proc.send_signal(signal.SIGTERM)
    assert t.exit_code() == 130
    assert t.mode() == (True, True)
    out = t.output()
    assert "STOPPED sanity/int-add-tens" in out and "TOTAL" in out


def test_a_failing_runner_restores_the_terminal(term):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    t = term("--trace", "/dev/full")  # writing the first trace block fails inside the runner
    assert t.exit_code() == 1
    assert t.mode() == (True, True)
    assert re.search(r"ds4-eval: error: the run failed: OSError: .*No space", t.output())


# Runs the real command line with the renderer failing on its fifth frame.
FAULTY_UI = """
import sys
import ds4eval.run.tui.app as app
real, frames = app.render, []
def faulty(*args):
    frames.append(1)
    if len(frames) == 5:
        raise RuntimeError("layout bug")
    return real(*args)
app.render = faulty
from ds4eval.cli import main
sys.argv[0] = "ds4-eval"
main()
"""


def test_a_failing_ui_restores_the_terminal_and_still_reports(term):
    t = term(python_code=FAULTY_UI)
    assert t.exit_code() == 1
    assert t.mode() == (True, True)
    out = t.output()
    assert re.search(r"ds4-eval: error: the run failed: terminal UI failed: RuntimeError: layout bug \(", out)
    assert "TOTAL" in out and "Traceback" not in out


def test_finished_run_stays_open_until_q(term):
    t = term("--case-id", "int-add-small", "--case-id", "choice-two-plus-two", domain="")
    # One frame can reach the reader in pieces: wait for the row too, not only the header.
    t.wait(lambda t: " DONE " in t.lines()[0] and "2/2" in t.lines()[1] and status_of(t, 2) == "FAILED",
           "the finished run with case 2 FAILED")
    t.press(DOWN)
    t.press("r")  # the run stays open after the last case, so finished cases can still be re-run
    t.wait(lambda t: " DONE " in t.lines()[0] and status_of(t, 2) == "PASSED", "the re-run")
    t.press("q")
    assert t.exit_code() == 0
    assert "passed 2/2" in t.output()


def test_plain_flag_keeps_line_output_on_a_terminal(term):
    t = term("--plain", "--case-id", "int-add-small", domain="")
    assert t.exit_code() == 0
    out = t.output()
    assert "\x1b[?1049h" not in out  # never switched to the full-screen UI
    assert "[1/1 eta 0:00] FAILED  sanity/int-add-small" in out and "TOTAL" in out


def test_a_non_utf8_locale_gets_an_ascii_screen(term):
    t = term(env={"LANG": "C", "LC_ALL": "C"})
    wait_status(t, 3, "THINKING")
    t.wait_for(r"\|.*Ten plus")
    screen = t.text()
    assert screen.isascii() and "│" not in screen and "+- #3 sanity/int-add-tens" in screen
    assert "??????" in screen  # each wide character keeps its two cells
    divider = t.lines()[2].index("+- #3")  # the rule's junction sits above the divider
    assert all(line[divider] == "|" for line in t.lines()[3:-1])
    t.press("q")
    assert t.exit_code() == 3 and t.mode() == (True, True)
