"""SIGINT / SIGTERM end a run cleanly: the running cases are written STOPPED with their partial
output, the report has the true wall time and the stopped count, and the exit status is 130
with no abort. ds4-eval runs as a child process, with signals and in a pseudo-terminal (Ctrl+C
typed at the terminal), against a fake OpenAI server on 127.0.0.1 and (marked `model`) the
embedded engine, serial and batched."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from ds4eval.run import trace as tr
from ds4eval.run.stopsignals import StopSignals

from openai_fakes import FakeOpenAI

REPO = Path(__file__).resolve().parents[3]
ABORT_SIGNS = ("Traceback", "terminate called", "Aborted", "core dumped")


def _child_setup(tty: bool):
    def setup():
        # The test runner may have inherited SIGINT as ignored; a user's shell gives the default.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if tty:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    return setup


def _wait_for(cond, what, timeout=60.0, child=None):
    end = time.monotonic() + timeout
    while not cond():
        if child is not None and child.proc.poll() is not None:
            pytest.fail(f"ds4-eval exited ({child.proc.returncode}) before {what}")
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


class Child:
    """ds4-eval in a child process, on pipes or on a pseudo-terminal."""

    def __init__(self, args, tty=False, env=None):
        self.tty = tty
        env = {**os.environ, "TERM": "xterm", "LINES": "30", "COLUMNS": "100", **(env or {})}
        cmd = [sys.executable, "-m", "ds4eval.cli", *args]
        if tty:
            self.master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x1e\x00\x64\x00\x00\x00\x00\x00")
            self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env,
                                         preexec_fn=_child_setup(True))
            os.close(slave)
        else:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                         preexec_fn=_child_setup(False))
        self.out = b""

    def ctrl_c(self):
        os.write(self.master, b"\x03")

    def finish(self, timeout=120.0) -> tuple[int, str]:
        if not self.tty:
            out, _ = self.proc.communicate(timeout=timeout)
            return self.proc.returncode, out.decode(errors="replace")
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            r, _, _ = select.select([self.master], [], [], 0.1)
            if r:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # the child closed the terminal
                    data = b""
                if not data:
                    break
                self.out += data
            elif self.proc.poll() is not None:
                break
        self.proc.wait(timeout=10)
        os.close(self.master)
        return self.proc.returncode, self.out.decode(errors="replace")


def _check_stopped_run(code, out, trace_path, max_stopped=1, running_min=1, output_kept=True):
    assert code == 130, out
    for sign in ABORT_SIGNS:
        assert sign not in out, out
    report = out[out.rindex("wall time"):].split()
    assert float(report[2]) > 0.0, out  # "wall time N s": the true wall time, not 0.0
    parsed = tr.read_trace(trace_path)
    assert parsed.problems == [] and len(parsed.runs) == 1
    stopped = [r for r in parsed.records if r.status == "STOPPED"]
    assert running_min <= len(stopped) <= max_stopped, [r.status for r in parsed.records]
    if output_kept:
        assert all(r.model_output for r in stopped)  # the partial output is kept
    assert f"stopped {len(stopped)}," in out
    return parsed


def _slow_server():
    return FakeOpenAI(reply=lambda q: "Let me think about this. " * 40 + "Answer: 4", delay_s=0.03)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_openai_run_stops_on_a_signal(tmp_path, sig):
    trace_path = tmp_path / "run.trace"
    with _slow_server() as srv:
        child = Child(["--plain", "--backend", "openai", "--no-probe", "--url", srv.url, "--trace", str(trace_path)])
        _wait_for(srv.started.is_set, "the first request", child=child)
        time.sleep(0.3)
        child.proc.send_signal(sig)
        code, out = child.finish()
    parsed = _check_stopped_run(code, out, trace_path)
    assert "not run 40" in out and len(parsed.runs[0].cases) == 41


def test_openai_run_with_concurrency_stops_every_running_case(tmp_path):
    trace_path = tmp_path / "run.trace"
    with _slow_server() as srv:
        child = Child(["--plain", "--backend", "openai", "--no-probe", "--url", srv.url, "--concurrency", "3",
                       "--trace", str(trace_path)])
        _wait_for(lambda: len(srv.bodies) >= 3, "three requests", child=child)
        time.sleep(0.3)
        child.proc.send_signal(signal.SIGINT)
        code, out = child.finish()
    _check_stopped_run(code, out, trace_path, max_stopped=3, running_min=3)


def test_a_stop_does_not_wait_for_a_silent_server(tmp_path):
    """A server in a long prefill sends nothing; the stop must not wait for its next line."""
    trace_path = tmp_path / "run.trace"
    with FakeOpenAI(stall_s=600) as srv:
        child = Child(["--plain", "--backend", "openai", "--no-probe", "--url", srv.url, "--trace", str(trace_path)])
        _wait_for(srv.started.is_set, "the first request", child=child)
        time.sleep(0.3)
        child.proc.send_signal(signal.SIGINT)
        code, out = child.finish(timeout=60)  # far below the stall and the request timeout
    _check_stopped_run(code, out, trace_path, output_kept=False)


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "terminal-ui"])
def test_ctrl_c_in_a_terminal(tmp_path, plain):
    trace_path = tmp_path / "run.trace"
    with _slow_server() as srv:
        args = ["--backend", "openai", "--no-probe", "--url", srv.url, "--trace", str(trace_path)]
        child = Child((["--plain"] if plain else []) + args, tty=True)
        _wait_for(srv.started.is_set, "the first request", child=child)
        time.sleep(0.3)
        child.ctrl_c()
        code, out = child.finish()
    _check_stopped_run(code, out, trace_path)


@pytest.mark.model
@pytest.mark.parametrize("parallel", [None, 2], ids=["serial", "parallel-2"])
def test_engine_run_ctrl_c_in_a_terminal(tmp_path, parallel):
    trace_path = tmp_path / "run.trace"
    args = ["--plain", "-n", "64", "--trace", str(trace_path)]
    if parallel:
        args += ["--parallel", str(parallel)]
    child = Child(args, tty=True)
    # Interrupt once a case has finished, so the model is loaded and decoding.
    _wait_for(lambda: trace_path.exists() and b"%%case" in trace_path.read_bytes(), "the first finished case",
              timeout=300, child=child)
    time.sleep(0.5)
    child.ctrl_c()
    code, out = child.finish()
    # A Ctrl+C that lands in a prefill stops the case before it produced any text.
    _check_stopped_run(code, out, trace_path, max_stopped=parallel or 1, running_min=0, output_kept=False)


def test_stop_signals_record_instead_of_raising():
    with StopSignals() as s:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for(lambda: s.fired is not None, "the signal", timeout=5)
    assert s.fired == signal.SIGTERM and s.count == 1
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
