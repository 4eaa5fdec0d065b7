"""ds4-eval --step-log: the summary of the engine's batched steps, the lines written, the flag's
rules and a run through the CLI on a tiny random model."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ds4eval.config import ConfigError, EvalConfig
from ds4eval.run.steplog import StepLog, render_steps, step_line, summarize_steps
from engine.batch import StepRecord
from engine.synthetic import RandomModelSpec, write_random_gguf


def step(started, ms, decoding=0, prefill=0, adopted=False, capture_ms=0.0):
    return StepRecord(started=started, seconds=ms / 1e3, decoding=decoding, prefill_tokens=prefill,
                      adopted=adopted, capture_seconds=capture_ms / 1e3)


RUN = [step(10.000, 20.0, decoding=0, prefill=100, capture_ms=15.0),  # the first case's prompt
       step(10.021, 8.0, decoding=1, prefill=60),  # the second's, beside the first's token
       step(10.030, 1.0, decoding=2),
       step(10.031, 3.0, decoding=2, adopted=True),
       step(10.035, 2.0, decoding=2, adopted=True),
       step(10.038, 1.5, decoding=1)]


def test_steps_are_summed_by_rows_apart_from_the_prefill_steps():
    s = summarize_steps(RUN)
    assert (s.steps, s.prefill_steps, s.prefill_tokens, s.adopted) == (6, 2, 160, 2)
    assert s.prefill_s == pytest.approx(0.028) and s.capture_s == pytest.approx(0.015)
    assert s.span_s == pytest.approx(0.0395)
    assert s.between_s == pytest.approx(0.0395 - 0.0355)
    assert [(d.rows, d.steps) for d in s.decoding] == [(1, 1), (2, 3)]
    two = s.decoding[1]
    assert (two.median_ms, two.mean_ms, two.seconds) == (pytest.approx(2.0), pytest.approx(2.0), pytest.approx(0.006))
    text = render_steps(s)
    assert text.splitlines()[0].startswith("engine steps: 6 in 0.04 s")
    assert "with a prefill chunk: 2 steps, 160 tokens, 0.03 s" in text
    assert "decoding 1 row: 1 steps, median 1.500 ms" in text and "decoding 2 rows: 3 steps, median 2.000 ms" in text
    assert summarize_steps([]) is None


def test_the_log_is_written_a_json_line_a_step(tmp_path):
    log = StepLog()
    for r in RUN:
        log.add(r)
    path = tmp_path / "steps.jsonl"
    log.write(str(path))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"t": 0.0, "ms": 20.0, "decoding": 0, "prefill_tokens": 100, "adopted": False,
                        "capture_ms": 15.0}
    assert [x["t"] for x in lines] == [pytest.approx(r.started - 10.0) for r in RUN]
    assert step_line(RUN[3], 10.0)["adopted"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["steps.jsonl"]  # no temporary file left


def test_the_flag_needs_the_batched_engine_in_this_process():
    EvalConfig(parallel=2, step_log="s.jsonl").validate()
    with pytest.raises(ConfigError, match="--step-log .* needs --parallel"):
        EvalConfig(step_log="s.jsonl").validate()
    with pytest.raises(ConfigError, match="without --ray"):
        EvalConfig(parallel=2, step_log="s.jsonl", ray="local", trace="t.trace").validate()


def test_a_parallel_run_writes_its_steps_and_their_summary(tmp_path):
    from ds4eval.cli import main

    model = write_random_gguf(tmp_path / "tiny.gguf", RandomModelSpec(n_ctx=1024, seed=4, n_layer=2))
    path = tmp_path / "steps.jsonl"
    r = CliRunner().invoke(main, ["run", "-m", str(model), "--suite", "sanity", "--domain", "arithmetic", "--plain",
                                  "--parallel", "3", "--tokens", "8", "--nothink", "--allow-errors",
                                  "--step-log", str(path)])
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert max(x["decoding"] for x in lines) == 3 and sum(x["prefill_tokens"] > 0 for x in lines) >= 6
    assert "engine steps: " in r.output and "with a prefill chunk: " in r.output


def test_an_unwritable_step_log_is_refused_before_any_case_runs(tmp_path):
    from ds4eval.cli import main

    r = CliRunner().invoke(main, ["run", "--suite", "sanity", "--plain", "--parallel", "2",
                                  "--step-log", str(tmp_path / "missing" / "steps.jsonl")])
    assert r.exit_code != 0 and "step log" in r.output and "Traceback" not in r.output
    assert "TOTAL" not in r.output and "passed" not in r.output  # no case ran, no report came
