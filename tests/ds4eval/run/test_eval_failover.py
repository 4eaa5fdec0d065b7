"""Several endpoints behind one run, against in-process fake servers: failover of 5xx, 429 and cut
streams to another endpoint, every case graded once, the probe of every endpoint (mixed sets
refused), and a run whose only server dies stopping cleanly for `retry`."""

import dataclasses
import json
import time

import pytest
from click.testing import CliRunner
from flaky_fakes import FlakyOpenAI
from capability_fakes import FakeCapabilities
from openai_fakes import FakeOpenAI

from ds4eval import cli
from ds4eval.cases.case import parse_case
from ds4eval.config import EvalConfig
from ds4eval.run import trace as tr
from ds4eval.run.backends import BackendUnavailable, create_backend
from ds4eval.run.backends.openai_backend import OpenAIBackend, completions_url
from ds4eval.run.endpoints import Backoff, PoolPolicy
from ds4eval.run.runner import Runner, Status

FAST = PoolPolicy(retry=Backoff(0.01, 0.05), probe=Backoff(0.05, 0.2), wait_s=5.0, retry_after_cap_s=0.3)


def case(name, answer="4"):
    return parse_case({"source": "toy", "id": name, "question": f"[{name}] what?", "answer": answer,
                       "answer_kind": "integer"})


def run(tmp_path, urls, n_cases=6, policy=FAST, **cfg_kw):
    """Run n toy cases; (states by id, the trace's records, the notes, the endpoint stats)."""
    cfg = EvalConfig(backend="openai", urls=tuple(urls), served_model="m", trace=str(tmp_path / "run.trace"),
                     **cfg_kw)
    notes: list[str] = []
    backend = OpenAIBackend(cfg, note=notes.append, policy=policy)
    try:
        states = Runner(cfg, [case(f"c{i}") for i in range(n_cases)], backend).run()
    finally:
        backend.close()
    records = tr.read_trace(tmp_path / "run.trace").records
    return {s.case.id: s for s in states}, records, notes, {s.url: s for s in backend.endpoint_stats()}


def graded_once(records, n_cases):
    ids = [r.id for r in records]
    return sorted(ids) == sorted(f"c{i}" for i in range(n_cases)) and all(
        r.status in ("PASSED", "FAILED") for r in records)


# ---------------------------------------------------------------- failover

def test_a_5xx_endpoint_hands_its_cases_over_and_leaves_rotation(tmp_path):
    # Its model list answers, so a re-probe would put it back; a probe due only after the run keeps
    # the state at the end from depending on how fast the host runs the 8 cases.
    no_reprobe = dataclasses.replace(FAST, probe=Backoff(60.0, 60.0))
    with FlakyOpenAI(plan=lambda i: 500) as bad, FlakyOpenAI() as good:
        states, records, notes, stats = run(tmp_path, [bad.url, good.url], n_cases=8, concurrency=2,
                                            policy=no_reprobe)
    assert all(s.status is Status.PASSED for s in states.values())
    assert graded_once(records, 8)
    assert {r.endpoint for r in records} == {completions_url(good.url)}
    assert stats[bad.url].out_of_rotation and stats[bad.url].failures >= 3
    assert stats[bad.url].requests == stats[bad.url].failures  # every one of its requests failed
    assert any(n.startswith(f"endpoint {bad.url} is out of rotation after 3 consecutive failures "
                            f"(last: HTTP 500: planned failure 500)") for n in notes)


def test_a_stream_cut_mid_answer_starts_again_elsewhere_and_only_the_new_text_is_graded(tmp_path):
    # The cut endpoint says "Answer: 9" (wrong) before its stream breaks; were its text kept, the
    # case would read "Answer: 9Answer: 4" or fail.
    with FlakyOpenAI(reply=lambda q: "Answer: 9 because", plan=lambda i: "cut") as cut, \
            FlakyOpenAI(reply=lambda q: "Answer: 4") as good:
        states, records, notes, stats = run(tmp_path, [cut.url, good.url], n_cases=4)
    assert graded_once(records, 4)
    for st in states.values():
        assert st.status is Status.PASSED and st.output == "Answer: 4"
    assert all(r.model_output == "Answer: 4" and r.endpoint == completions_url(good.url) for r in records)
    assert stats[cut.url].failures >= 1


@pytest.mark.slow  # the default run keeps the handover, a cut stream and a dead server
def test_a_connection_refused_endpoint_among_live_ones_costs_no_case(tmp_path):
    with FlakyOpenAI() as a, FlakyOpenAI() as b:
        dead = FlakyOpenAI().__enter__()
        dead.kill()
        states, records, notes, stats = run(tmp_path, [a.url, dead.url, b.url], n_cases=9, concurrency=3)
    assert graded_once(records, 9)
    assert {r.endpoint for r in records} == {completions_url(a.url), completions_url(b.url)}
    assert stats[dead.url].out_of_rotation and "ConnectError" in " ".join(notes)


@pytest.mark.slow  # the default run keeps the handover, a cut stream and a dead server
def test_429_waits_for_retry_after_bounded_then_succeeds(tmp_path):
    with FlakyOpenAI(plan=lambda i: 429 if i == 0 else None, retry_after=60) as srv:
        t0 = time.monotonic()
        states, records, _, stats = run(tmp_path, [srv.url], n_cases=1)
        took = time.monotonic() - t0
    assert states["c0"].status is Status.PASSED and graded_once(records, 1)
    assert 0.3 <= took < 10  # Retry-After 60 honoured up to the policy's bound of 0.3 s
    assert (stats[srv.url].requests, stats[srv.url].failures) == (2, 1)


def test_a_4xx_is_the_case_s_own_error_and_is_not_sent_again(tmp_path):
    with FlakyOpenAI(plan=lambda i: 400) as a, FlakyOpenAI(plan=lambda i: 400) as b:
        states, records, _, stats = run(tmp_path, [a.url, b.url], n_cases=1)
    assert states["c0"].status is Status.ERROR and "HTTP 400" in states["c0"].error
    assert a.requests + b.requests == 1 and not any(s.failures for s in stats.values())


@pytest.mark.slow  # the default run keeps the handover, a cut stream and a dead server
def test_an_endpoint_out_of_rotation_comes_back_when_its_probe_answers(tmp_path):
    # Its first three requests fail, its model list answers all along: out, re-probed, back.
    with FlakyOpenAI(plan=lambda i: 502 if i < 3 else None, delay_s=0.01) as flaky, \
            FlakyOpenAI(delay_s=0.01) as steady:
        states, records, notes, stats = run(tmp_path, [flaky.url, steady.url], n_cases=30)
    assert graded_once(records, 30)
    assert f"endpoint {flaky.url} answers again: back in rotation (2 of 2)" in notes
    assert not stats[flaky.url].out_of_rotation and stats[flaky.url].removals == 1
    assert flaky.requests > 3  # it served cases again once back


# ---------------------------------------------------------------- the probe of every endpoint

def backend_for(urls, **kw):
    notes = []
    backend = create_backend(EvalConfig(backend="openai", urls=tuple(urls), **kw), note=notes.append)
    backend.close()
    return backend, notes


def test_endpoints_serving_different_models_are_refused_one_line_per_difference():
    with FlakyOpenAI(model="qwen-8b", template="{{ a }}") as a, FlakyOpenAI(model="qwen-4b", template="{{ b }}") as b:
        with pytest.raises(BackendUnavailable) as e:
            backend_for([a.url, b.url])
        lines = str(e.value).splitlines()
        assert lines[0] == "the endpoints differ (--allow-mixed-endpoints runs them anyway):"
        assert lines[1] == f"served model differs: {a.url} qwen-8b; {b.url} qwen-4b"
        assert lines[2].startswith(f"chat template differs: {a.url} sha256 ") and len(lines) == 3
        backend, notes = backend_for([a.url, b.url], allow_mixed_endpoints=True)
        assert backend.urls == [a.url, b.url] and backend.model_name == "qwen-8b"
        assert notes[0].startswith("mixed endpoints: served model differs")


@pytest.mark.slow  # the default run keeps the handover, a cut stream and a dead server
def test_each_endpoint_of_a_mixed_set_is_sent_its_own_model_name(tmp_path):
    with FlakyOpenAI(model="left") as a, FlakyOpenAI(model="right") as b:
        cfg = EvalConfig(backend="openai", urls=(a.url, b.url), allow_mixed_endpoints=True, no_probe=True)
        backend = create_backend(cfg)
        try:
            Runner(cfg, [case(f"c{i}") for i in range(4)], backend).run()
        finally:
            backend.close()
    assert {body["model"] for body in a.bodies} == {"left"} and {body["model"] for body in b.bodies} == {"right"}


@pytest.mark.slow  # the default run keeps the handover, a cut stream and a dead server
def test_capability_findings_that_differ_are_refused():
    with FakeCapabilities() as a, FakeCapabilities(modes={"seed": "ignore"}) as b:
        kw = {"temperature": 0.7, "seed": 1}
        with pytest.raises(BackendUnavailable, match=r"capability 'seed' differs: .* supported; .* ignored"):
            backend_for([a.url, b.url], **kw)
        backend, notes = backend_for([a.url, b.url], allow_mixed_endpoints=True, **kw)
        assert backend.urls == [a.url]  # the one that lacks a required feature sits out
        assert any(n.startswith(f"the server at {b.url} lacks what this run needs") and
                   n.endswith(": left out of the run") for n in notes)


def test_an_endpoint_that_does_not_answer_the_probe_is_left_out():
    with FakeOpenAI() as live:
        backend, notes = backend_for([live.url, "http://127.0.0.1:9"])
    assert backend.urls == [live.url]
    assert notes == ["cannot reach the server at http://127.0.0.1:9: connection refused: left out of the run"]


def test_a_run_refuses_only_when_no_endpoint_answers():
    with pytest.raises(BackendUnavailable) as e:
        backend_for(["http://127.0.0.1:9", "http://127.0.0.1:7"])
    assert str(e.value).splitlines() == [
        "none of the 2 endpoints answers",
        "cannot reach the server at http://127.0.0.1:9: connection refused",
        "cannot reach the server at http://127.0.0.1:7: connection refused"]


# ---------------------------------------------------------------- the command line

def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], env={})


@pytest.mark.slow  # the default run keeps the handover, a cut stream and a dead server
def test_run_over_two_endpoints_and_a_url_file_reports_each_endpoint(tmp_path):
    with FlakyOpenAI(reply=lambda q: "Answer: 5") as a, FlakyOpenAI(reply=lambda q: "Answer: 5") as b, \
            FlakyOpenAI(reply=lambda q: "Answer: 5") as c:
        url_file = tmp_path / "endpoints.txt"
        url_file.write_text(f"# the rest of the cluster\n\n{b.url}\n   {c.url}  \n")
        trace, summary = tmp_path / "run.trace", tmp_path / "summary.json"
        r = invoke("run", "--plain", "--backend", "openai", "--url", a.url, "--url-file", url_file,
                   "--concurrency", "3", "--domain", "arithmetic", "--trace", trace, "--summary", summary)
        assert r.exit_code == 0, r.output
    records = tr.read_trace(trace).records
    assert len(records) == len({(rec.source, rec.id) for rec in records}) == 6
    assert {rec.endpoint for rec in records} <= {completions_url(u) for u in (a.url, b.url, c.url)}
    rows = json.loads(summary.read_text())["endpoints"]
    assert [row["url"] for row in rows] == [a.url, b.url, c.url]
    assert sum(row["requests"] for row in rows) == 6 and not any(row["out_of_rotation"] for row in rows)
    # Each fake also answered its capability probe's one request.
    assert [row["requests"] + 1 for row in rows] == [a.requests, b.requests, c.requests]
    assert min(row["requests"] for row in rows) >= 1
    assert f"endpoint {a.url}: {rows[0]['requests']} request(s), 0 failed; out of rotation: no" in r.output


def test_a_url_file_that_cannot_be_read_is_a_usage_error(tmp_path):
    r = invoke("run", "--plain", "--backend", "openai", "--url-file", tmp_path / "none.txt")
    assert r.exit_code == 2 and f"cannot read {tmp_path / 'none.txt'}" in r.output
    (tmp_path / "bad.txt").write_text("# nothing here\n")
    r = invoke("run", "--plain", "--backend", "openai", "--url-file", tmp_path / "bad.txt")
    assert r.exit_code == 2 and "lists no URL" in r.output


def test_a_single_server_that_dies_mid_run_stops_the_run_and_retry_completes_it(tmp_path):
    trace = tmp_path / "run.trace"
    with FlakyOpenAI(reply=lambda q: "Answer: 5", delay_s=0.01) as srv:
        srv.kill_after(3)  # the third case's stream is cut, the rest find the port closed
        r = invoke("run", "--plain", "--backend", "openai", "--url", srv.url, "--no-probe", "--endpoint-wait", "1",
                   "--domain", "arithmetic", "--trace", trace)
    assert r.exit_code == 3, r.output
    records = tr.read_trace(trace).records
    statuses = [rec.status for rec in records]
    assert set(statuses[:2]) <= {"PASSED", "FAILED"}
    assert statuses[2:] == ["STOPPED"] * 4  # not four connection-refused ERRORs
    assert all("no endpoint has answered for 1 s" in rec.error for rec in records[2:])
    assert f"ds4-eval: note: endpoint {srv.url} is out of rotation after 3 consecutive failures" in r.stderr
    assert "ds4-eval: note: no endpoint has answered for 1 s: stopping the run" in r.stderr
    assert "4 of 6 cases were not graded (4 stopped): exit status 3" in r.stderr
    assert f"endpoint {srv.url}: " in r.stdout and "out of rotation: yes" in r.stdout
    with FlakyOpenAI(reply=lambda q: "Answer: 5") as back:
        r = invoke("retry", trace, "--plain", "--backend", "openai", "--url", back.url, "--no-probe")
        assert r.exit_code == 0 and "retrying 4 incomplete case(s)" in r.output, r.output
        assert back.requests == 4
    latest = {(rec.source, rec.id): rec.status for rec in tr.read_trace(trace).records}
    assert len(latest) == 6 and set(latest.values()) <= {"PASSED", "FAILED"}
