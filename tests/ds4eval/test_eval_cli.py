"""The ds4-eval command line in its old single-command form (the subcommands' aliases): modes,
one-line errors, regrade and retry through the CLI."""

import json

import pytest
from click.testing import CliRunner

from ds4eval import cli
from ds4eval.run import trace as tr


def invoke(*args, env=None):
    return CliRunner().invoke(cli.main, list(args), env=env or {})


def test_self_test_extractors_exit_status(monkeypatch):
    r = invoke("--self-test-extractors")
    assert r.exit_code == 0 and "extractor self-tests passed" in r.output
    from ds4eval.cases import selftest

    bad = selftest.SelfTestCase("wrong on purpose", "integer", "5", "Answer: 6", "6", True)
    monkeypatch.setattr(selftest, "SELF_TEST_CASES", selftest.SELF_TEST_CASES + (bad,))
    r = invoke("--self-test-extractors")
    assert r.exit_code == 1 and "FAIL integer 'wrong on purpose'" in r.output


def test_grade_file(tmp_path):
    rows = [{"answer_kind": "choice", "answer": "C", "nchoices": 4, "output": "Answer: I think it is C"},
            {"answer_kind": "rational", "answer": "25/2", "aliases": ["12.5"], "output": "Answer: 12.5"},
            {"answer_kind": "line_set", "answer": "17-20", "output": "Answer: 16", "extra": "kept"}]
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = invoke("--grade-file", str(f))
    assert r.exit_code == 0, r.output
    out = [json.loads(line) for line in r.output.splitlines()]
    assert [(o["picked"], o["passed"]) for o in out] == [("C", True), ("25/2", True), ("16", False)]
    assert out[2]["extra"] == "kept"
    f.write_text(json.dumps({"answer_kind": "choice", "answer": "C", "output": "x"}) + "\n")
    r = invoke("--grade-file", str(f))
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "nchoices" in r.output


def test_regrade_example_from_the_spec(tmp_path):
    path = tmp_path / "t.trace"
    recs = [tr.TraceRecord(index=i, source="sanity", id=f"c{i}", status=s, expected="4", answer_kind="integer",
                           model_output="Answer: 4") for i, s in ((1, "PASSED"), (2, "STOPPED"), (3, "STOPPED"))]
    path.write_text("".join(map(tr.format_record, recs)))
    r = invoke("--regrade", str(path))
    assert r.exit_code == 0 and r.output.splitlines()[0] == "passed=1 failed=0 not_graded=2 changed=0"
    recs[0].model_output = "Answer: 5"
    path.write_text("".join(map(tr.format_record, recs)))
    r = invoke("--regrade", str(path))
    assert "changed=1" in r.output and "changed: #1 sanity/c1: PASSED -> FAILED" in r.output
    # Each changed verdict names the case and the picked answer before and after.
    changed = [ln for ln in r.output.splitlines() if ln.startswith("changed: ")]
    assert changed == ["changed: #1 sanity/c1: PASSED -> FAILED (picked - -> '5', expected '4')"]


@pytest.mark.parametrize("args, msg", [
    (["--regrade", "/nonexistent.trace"], "cannot read"),
    (["--suite", "core", "--data-dir", "/nonexistent"], "needs /nonexistent/core.jsonl"),
    (["--backend", "openai"], "needs --url"),
    (["--backend", "openai", "--url", "localhost:8000"], "--url must be an http:// or https:// URL"),
    (["--backend", "openai", "--url", "http://"], "--url must be an http:// or https:// URL"),
    (["--request-extra", "{repeat_penalty: 1}"], "--request-extra: invalid JSON"),
    (["--request-extra", "[1]"], "--request-extra must be a JSON object"),
    (["--chat-template-kwargs", "1"], "--chat-template-kwargs must be a JSON object"),
    (["--request-extra", "{}"], "--request-extra applies to the openai backend"),
    (["--tokenizer", "m.gguf"], "--tokenizer applies to the openai backend"),
    (["--tokens", "0"], "--tokens must be positive"),
    (["--list-cases", "--validate-cases"], "at most one"),
    (["--list-cases", "--case-id", "nope"], "no case"),
])
def test_bad_input_is_one_line(args, msg):
    r = invoke(*args)
    assert r.exit_code == 2 and msg in r.output and r.output.count("\n") == 1 and "Traceback" not in r.output


def test_list_and_validate(data_dir):
    r = invoke("--list-cases", "--suite", "hard-smoke", "--data-dir", str(data_dir))
    assert r.exit_code == 0 and "12 cases in suite hard-smoke" in r.output
    r = invoke("--list-cases", "--domain", "code")
    assert r.exit_code == 0 and "lines-safe-function" in r.output
    r = invoke("--validate-cases", env={"DS4EVAL_DATA": str(data_dir)})
    assert r.exit_code == 0 and "all cases valid" in r.output


def test_run_and_retry_incomplete_through_the_cli(tmp_path, monkeypatch):
    """A full run with a fake engine model: plain lines, report, summary, trace; then a retry."""
    from engine_fakes import FAKE_ENGINE, FakeModel

    from ds4eval.run.backends import engine_backend

    answers = {"What is 2 + 3?": "Answer: 5", "What is 10 + 20?": "Answer: 30"}

    def script(prompt):
        return next((a for q, a in answers.items() if q in prompt), "Answer: no idea")

    monkeypatch.setattr(engine_backend.EngineBackend, "load",
                        classmethod(lambda cls, cfg, note=None: cls(FakeModel(script), FAKE_ENGINE)))
    trace_path, summary = tmp_path / "run.trace", tmp_path / "s.json"
    r = invoke("--plain", "--domain", "arithmetic", "--trace", str(trace_path), "--summary", str(summary))
    assert r.exit_code == 0, r.output
    assert "PASSED  sanity/int-add-small" in r.output and "TOTAL" in r.output and "wall time" in r.output
    s = json.loads(summary.read_text())
    assert s["totals"]["passed"] == 2 and s["totals"]["cases"] == 6 and s["suite"] == "sanity"
    # Mark one case as STOPPED in the trace, then retry only that one.
    parsed = tr.read_trace(trace_path)
    parsed.records[2].status = "STOPPED"
    trace_path.write_text("".join(map(tr.format_record, parsed.records)))
    answers["What is 9 - 4?"] = "Answer: 5"
    stopped_id = parsed.records[2].id
    r = invoke("--plain", "--retry-incomplete", str(trace_path))
    assert r.exit_code == 0, r.output
    assert "retrying 1 incomplete case(s)" in r.output
    after = tr.read_trace(trace_path).records
    assert len(after) == 7 and after[-1].id == stopped_id and after[-1].index == parsed.records[2].index
    r = invoke("--retry-incomplete", str(trace_path))
    assert "nothing to retry" in r.output


# ---------------------------------------------------------------- exit statuses

from openai_fakes import FakeOpenAI  # noqa: E402


def _server_run(srv, *args):
    return invoke("--plain", "--backend", "openai", "--url", srv.url, "--domain", "arithmetic", *args)


def test_a_fully_graded_run_exits_0():
    with FakeOpenAI(reply=lambda q: "Answer: 5") as srv:
        r = _server_run(srv)
    assert r.exit_code == 0, r.output
    assert "model fake-model-1" in r.output and "not graded" not in r.output


def test_errors_exit_3_unless_allowed(monkeypatch):
    def failing(q):
        raise RuntimeError("boom")  # the handler dies before answering: every case is ERROR

    # Each case's 500s are retried and re-probed (test_eval_failover) before it ends ERROR; this
    # test is about the exit status, so the waits between attempts are kept short.
    from functools import partial

    from ds4eval.run.backends import openai_backend
    from ds4eval.run.endpoints import Backoff, PoolPolicy

    monkeypatch.setattr(openai_backend, "PoolPolicy",
                        partial(PoolPolicy, retry=Backoff(0.01, 0.05), probe=Backoff(0.05, 0.2)))
    with FakeOpenAI(reply=failing) as srv:
        # --no-probe: the capability probe would stop this run before its cases (test_eval_probe).
        # --concurrency 6: each case's retries of the 500 (test_eval_failover) wait side by side.
        r = _server_run(srv, "--no-probe", "--concurrency", "6")
        assert r.exit_code == 3, r.output
        assert "ds4-eval: 6 of 6 cases were not graded (6 error): exit status 3 (--allow-errors exits 0)" in r.output
        r = _server_run(srv, "--no-probe", "--allow-errors", "--concurrency", "6")
        assert r.exit_code == 0, r.output


def test_an_unreachable_server_stops_before_the_first_case_with_one_line(tmp_path):
    r = invoke("--plain", "--backend", "openai", "--url", "http://127.0.0.1:9", "--trace", str(tmp_path / "t"))
    assert r.exit_code == 3
    assert r.output == "ds4-eval: error: cannot reach the server at http://127.0.0.1:9: connection refused\n"
    assert not (tmp_path / "t").exists()


def test_retry_incomplete_runs_cases_that_never_started(tmp_path):
    """A killed run leaves a header listing every case but blocks for only some of them."""
    with FakeOpenAI(reply=lambda q: "Answer: 5") as srv:
        path = tmp_path / "run.trace"
        r = _server_run(srv, "--trace", str(path))
        assert r.exit_code == 0, r.output
        data = path.read_bytes()
        parsed = tr.read_trace(path)
        assert len(parsed.runs) == 1 and len(parsed.runs[0].cases) == 6 and len(parsed.records) == 6
        # Keep the header and the first two blocks; tear the third in the middle, as a kill would.
        cut = data.index(b"%%case 3 ") + 40
        path.write_bytes(data[:cut])
        r = invoke("--plain", "--backend", "openai", "--url", srv.url, "--retry-incomplete", str(path))
        assert r.exit_code == 0, r.output
        assert "retrying 4 incomplete case(s)" in r.output and "warning:" in r.output
        after = tr.read_trace(path)
        assert [rec.index for rec in after.records] == [1, 2, 3, 4, 5, 6]
        assert len(after.problems) == 1 and "case block 3" in after.problems[0]
        r = invoke("--plain", "--backend", "openai", "--url", srv.url, "--retry-incomplete", str(path))
        assert r.exit_code == 0 and "nothing to retry" in r.output


def test_repeats_record_every_repeat_class_flaky_cases_and_retry_one_repeat(tmp_path, monkeypatch):
    from engine_fakes import FAKE_ENGINE, FakeModel

    from ds4eval.run.backends import engine_backend

    calls = {"n": 0}

    def script(prompt):
        if "What is 2 + 3?" in prompt:
            return "Answer: 5"
        if "What is 10 + 20?" in prompt:  # right on every other call: a flaky case
            calls["n"] += 1
            return "Answer: 30" if calls["n"] % 2 else "Answer: 31"
        return "Answer: no idea"

    monkeypatch.setattr(engine_backend.EngineBackend, "load",
                        classmethod(lambda cls, cfg, note=None: cls(FakeModel(script), FAKE_ENGINE)))
    trace_path, summary = tmp_path / "run.trace", tmp_path / "s.json"
    r = invoke("--plain", "--domain", "arithmetic", "--repeats", "3", "--temp", "0.7", "--seed", "5",
               "--trace", str(trace_path), "--summary", str(summary))
    assert r.exit_code == 0, r.output
    parsed = tr.read_trace(trace_path)
    assert parsed.runs[0].repeats == 3 and len(parsed.runs[0].cases) == 6
    assert len(parsed.records) == 18
    by_case = {}
    for rec in parsed.records:
        by_case.setdefault(rec.id, []).append((rec.repeat, rec.seed))
    assert all(sorted(v) == [(0, 5), (1, 6), (2, 7)] for v in by_case.values())
    s = json.loads(summary.read_text())
    rep = s["repeats"]
    assert rep["k"] == 3 and rep["counts"]["flaky"] == 1 and rep["counts"]["stable pass"] == 1
    assert [(c["passed"], c["graded"]) for c in rep["flaky"]] == [(2, 3)]
    assert "repeats 3: stable pass 1, stable fail 4, flaky 1" in r.output and "pass@3" in r.output
    # One repeat stopped: the retry runs that repeat alone, with its own seed.
    parsed.records[4].status = "STOPPED"
    trace_path.write_text(tr.format_run_header(parsed.runs[0]) + "".join(map(tr.format_record, parsed.records)))
    r = invoke("--plain", "--retry-incomplete", str(trace_path), "--temp", "0.7", "--seed", "5")
    assert r.exit_code == 0, r.output
    assert "retrying 1 incomplete repeat(s) of 3" in r.output
    last = tr.read_trace(trace_path).records[-1]
    assert (last.id, last.repeat, last.seed) == (parsed.records[4].id, parsed.records[4].repeat,
                                                 5 + parsed.records[4].repeat)


def test_greedy_repeats_report_a_non_deterministic_case(tmp_path, monkeypatch):
    from engine_fakes import FAKE_ENGINE, FakeModel

    from ds4eval.run.backends import engine_backend

    calls = {"n": 0}

    def script(prompt):
        if "What is 2 + 3?" in prompt:
            calls["n"] += 1
            return "The sum is five.\nAnswer: 5" if calls["n"] != 2 else "The total is five.\nAnswer: 5"
        return "Answer: no idea"

    monkeypatch.setattr(engine_backend.EngineBackend, "load",
                        classmethod(lambda cls, cfg, note=None: cls(FakeModel(script), FAKE_ENGINE)))
    r = invoke("--plain", "--case-id", "int-add-small", "--repeats", "3")
    assert r.exit_code == 0, r.output
    assert "non-deterministic sanity/int-add-small: repeat 1 differs from repeat 0 at token 2" in r.output


def test_inputs_that_are_not_regular_files_are_one_line_errors(tmp_path):
    """/dev/zero would be read until memory runs out, a FIFO without a writer would wait forever:
    both are refused before any read, by regrade, report and compare alike."""
    import os

    fifo = tmp_path / "fifo.trace"
    os.mkfifo(fifo)
    good = tmp_path / "good.trace"
    good.write_text(tr.format_record(tr.TraceRecord(index=1, source="s", id="a", status="PASSED")))
    for args, path, kind in ((["--regrade", "/dev/zero"], "/dev/zero", "a character device"),
                             (["--regrade", str(fifo)], fifo, "a FIFO"),
                             (["--report-from", str(fifo)], fifo, "a FIFO"),
                             (["--compare", str(good), str(fifo)], fifo, "a FIFO")):
        r = invoke(*args)
        assert r.exit_code == 2 and r.output.count("\n") == 1, (args, r.output)
        assert f"cannot read {path}: it is {kind}, not a regular file" in r.output


def test_retry_of_a_trace_that_a_run_is_still_writing_is_refused_with_one_line(tmp_path):
    path = tmp_path / "live.trace"
    with tr.TraceWriter(path) as live:  # the original run, still going
        live.write(tr.TraceRecord(index=1, source="sanity", id="int-add-small", status="STOPPED"))
        r = invoke("--plain", "--retry-incomplete", str(path))
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
        assert f"{path} is being written by another ds4-eval process" in r.output
        # A second run appending to it is refused the same way.
        r = invoke("--plain", "--trace", str(path))
        assert r.exit_code == 2 and "is being written by another ds4-eval process" in r.output
    assert len(tr.read_trace(path).records) == 1  # nothing was appended beside the live run
