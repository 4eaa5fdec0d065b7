"""Several real ds4-server processes (the embedded model, on 127.0.0.1) behind one run, one of them
killed with SIGKILL mid-run; and a run whose only server is killed, stopped cleanly and then
completed by `ds4-eval retry` against a new server. Marked `model` and `slow`: each server loads
the model, and the cases generate real tokens."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from ds4eval import cli
from ds4eval.run import trace as tr
from ds4eval.run.backends.openai_backend import completions_url

pytestmark = [pytest.mark.model, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
CASES = ("int-add-small", "int-add-tens", "int-subtract", "int-multiply", "int-divide", "int-dog-legs",
         "int-months", "int-triangle-sides", "int-hands-fingers", "int-next-number", "choice-sky-colour",
         "choice-week-days")
RUN = ("run", "--plain", "--backend", "openai", "--nothink", "-n", "24", "--suite", "sanity",
       *(a for c in CASES for a in ("--case-id", c)))


class Server:
    """`python -m server.cli` on a free loopback port; `kill()` is SIGKILL, `stop()` SIGINT."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--ctx", "1024"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                     cwd=str(REPO), env=env)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ds4-server on port {self.port} exited at startup"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"ds4-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def servers(n: int) -> list[Server]:
    started = [Server() for _ in range(n)]
    try:
        for s in started:
            s.wait_ready()
    except BaseException:
        for s in started:
            s.kill()
        raise
    return started


def kill_when_graded(victim: Server, trace: Path, n_records: int) -> threading.Thread:
    """SIGKILL `victim` once the trace holds `n_records` case blocks."""
    def watch():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if trace.exists() and len(tr.parse_trace_bytes(trace.read_bytes()).records) >= n_records:
                break
            time.sleep(0.05)
        victim.kill()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], env={"DS4EVAL_DATA": os.environ.get("DS4EVAL_DATA", "")})


def test_three_servers_one_killed_mid_run_every_case_graded_once(tmp_path):
    trace, summary = tmp_path / "run.trace", tmp_path / "summary.json"
    fleet = servers(3)
    try:
        victim = fleet[1]
        watcher = kill_when_graded(victim, trace, 2)
        r = invoke(*RUN, *(a for s in fleet for a in ("--url", s.url)), "--concurrency", "3",
                   "--trace", trace, "--summary", summary)
        watcher.join(10)
    finally:
        for s in fleet:
            s.stop()
    assert victim.proc.returncode == -signal.SIGKILL
    assert r.exit_code == 0, r.output  # every case graded: the dead server cost none
    records = tr.read_trace(trace).records
    assert sorted(rec.id for rec in records) == sorted(CASES)  # each exactly once
    assert all(rec.status in ("PASSED", "FAILED") for rec in records)
    assert {rec.endpoint for rec in records} <= {completions_url(s.url) for s in fleet}
    rows = {row["url"]: row for row in json.loads(summary.read_text())["endpoints"]}
    assert rows[victim.url]["failures"] >= 1
    assert sum(row["requests"] - row["failures"] for row in rows.values()) == len(CASES)
    if rows[victim.url]["out_of_rotation"]:
        assert f"ds4-eval: note: endpoint {victim.url} is out of rotation" in r.stderr
    assert f"endpoint {victim.url}: " in r.stdout


def test_a_lone_server_killed_mid_run_stops_the_run_and_retry_completes_it(tmp_path):
    trace = tmp_path / "run.trace"
    [lone] = servers(1)
    try:
        watcher = kill_when_graded(lone, trace, 2)
        r = invoke(*RUN, "--url", lone.url, "--endpoint-wait", "3", "--trace", trace)
        watcher.join(10)
    finally:
        lone.stop()
    assert r.exit_code == 3, r.output
    records = tr.read_trace(trace).records
    statuses = [rec.status for rec in records]
    assert "ERROR" not in statuses and statuses.count("STOPPED") == len(CASES) - statuses.count("PASSED") \
        - statuses.count("FAILED") >= len(CASES) - 3
    assert "ds4-eval: note: no endpoint has answered for 3 s: stopping the run" in r.stderr
    [back] = servers(1)
    try:
        r = invoke("retry", trace, "--plain", "--backend", "openai", "--nothink", "-n", "24", "--url", back.url)
    finally:
        back.stop()
    assert r.exit_code == 0, r.output
    latest = {rec.id: rec.status for rec in tr.read_trace(trace).records}
    assert sorted(latest) == sorted(CASES) and set(latest.values()) <= {"PASSED", "FAILED"}
