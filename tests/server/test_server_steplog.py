"""ds4-server --step-log: the flag's rules, the lines a batched worker writes on a tiny random
model, a write that fails (a full disk) and a bad path through the CLI."""
from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner

from server.cli import main
from server.config import ServerConfig
from server.steplog import LoopState, StepLogError, StepLogWriter, check_step_log_path
from server.worker import InferenceWorker
from test_server_batching import chat, collect, req

KEYS = {"t", "ms", "decoding", "prefill_tokens", "adopted", "capture_ms", "jobs", "waiting", "admitted", "parked"}


def test_the_flag_needs_batched_sessions(tmp_path):
    with pytest.raises(ValueError, match="--batched-session N, N >= 2"):
        ServerConfig(step_log=str(tmp_path / "steps.jsonl"))
    ServerConfig(step_log=str(tmp_path / "steps.jsonl"), batched_session=2)
    result = CliRunner().invoke(main, ["--step-log", str(tmp_path / "steps.jsonl")])
    assert result.exit_code == 2 and "--batched-session N" in result.output and "Traceback" not in result.output


def test_paths_that_cannot_be_written_are_refused(tmp_path):
    with pytest.raises(StepLogError, match="is a directory"):
        check_step_log_path(str(tmp_path))
    with pytest.raises(StepLogError, match="no directory"):
        check_step_log_path(str(tmp_path / "missing" / "steps.jsonl"))
    check_step_log_path(str(tmp_path / "steps.jsonl"))
    assert not (tmp_path / "steps.jsonl").exists()  # checking creates nothing


def test_a_bad_path_fails_before_the_model_loads(tmp_path):
    missing = tmp_path / "missing" / "steps.jsonl"
    result = CliRunner().invoke(main, ["--port", "0", "--batched-session", "2", "--model", str(tmp_path / "no.gguf"),
                                       "--step-log", str(missing)])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [f"Error: --step-log {missing}: no directory {missing.parent}"]


def test_a_batched_worker_writes_a_line_per_step(tiny_model, tmp_path):
    tiny = tiny_model
    path = tmp_path / "steps.jsonl"
    log = StepLogWriter(str(path))
    w = InferenceWorker(tiny, n_slots=3, step_log=log)
    w.start()
    try:
        done = collect(w, [req(tiny, chat(tiny, f"question {i} about topic {i * 7}"), 16) for i in range(3)])
    finally:
        w.stop()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines and all(set(line) == KEYS for line in lines)
    assert lines[0]["t"] == 0 and all(a["t"] <= b["t"] for a, b in zip(lines, lines[1:]))
    assert all(line["ms"] > 0 for line in lines)
    # Every job was admitted once, and the three decoded side by side at some step.
    assert sum(line["admitted"] for line in lines) == 3
    assert max(line["decoding"] for line in lines) == 3
    assert all(0 <= line["jobs"] <= 3 and line["waiting"] >= 0 and line["parked"] <= line["jobs"] for line in lines)
    # Every token evaluated is in one line, once: the prompts' tokens not taken from a cache, and
    # each generated token but the last (its job ends before evaluating it).
    evaluated = sum(job.stats.n_prompt - job.stats.n_cached + job.stats.n_generated - 1 for job, _ in done)
    assert sum(line["prefill_tokens"] + line["decoding"] for line in lines) == evaluated
    # Stopped, the log is closed: a later line is dropped, the file stays whole.
    before = path.read_text()
    log.write(FakeRecord(), LoopState(0, 0, 0, 0))
    assert path.read_text() == before


class FakeRecord:
    started = 5.0

    def fields(self, t0: float) -> dict:
        return {"t": self.started - t0}


def test_a_failed_write_ends_the_log_and_not_the_caller(caplog):
    log = StepLogWriter("/dev/full")  # every flush fails: no space left on the device
    with caplog.at_level(logging.ERROR, logger="ds4.server.steplog"):
        log.write(FakeRecord(), LoopState(1, 0, 1, 0))
        log.write(FakeRecord(), LoopState(1, 0, 0, 0))
    assert [r.getMessage() for r in caplog.records] == ["the step log /dev/full stopped: No space left on device"]
