"""Fair scheduling (issue 42): a request's choices and prompts take turns with other requests.

- The order alone: `next_turn` and the `JobLedger` on hand-made jobs, and the serial worker
  over the fake engine (which jobs start in which order).
- The per-request ceiling on work: `over_limit`, and the 400 a server answers before queueing.
- Queue time: the per-request histogram in /metrics and the request log's lines.
- Latency under load, as a ratio to the idle latency measured in the same test: the fake
  engine's serial loop (fast), and the embedded model in both loops (`slow`), whose outputs must
  not change under the competing load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.config import ServerConfig
from server.jobs import (Finished, GenerationRequest, JobLedger, RequestTurn, SamplingSpec, StepTurn, TextDelta,
                         WorkLimits, next_step, next_turn, over_limit)
from server.worker import InferenceWorker
from server_fake_engine import FAKE_ENGINE, FakeModel
from server_support import fake_app, live_server
from test_server_metrics import samples, value

GREEDY = SamplingSpec(temperature=0.0)
CHAT = "/v1/chat/completions"


def gen(prompt: str, max_tokens: int = 8, n_prompt: int = 4, **kw) -> GenerationRequest:
    return GenerationRequest(prompt, tuple(range(1, n_prompt + 1)), max_tokens, sampling=GREEDY, **kw)


def ignore(_event) -> None:
    pass


# --- the order ----------------------------------------------------------------------------------

def test_next_turn_prefers_fewer_running_jobs_then_the_longest_wait():
    assert next_turn([]) is None
    assert next_turn([RequestTurn(1, running=2, since=0), RequestTurn(2, running=0, since=9)]) == 2
    assert next_turn([RequestTurn(1, running=0, since=5), RequestTurn(2, running=0, since=3)]) == 2


def test_next_step_prefers_the_least_served_request_then_the_longest_wait():
    assert next_step([]) is None
    assert next_step([StepTurn(served_s=5.0, last_step=1), StepTurn(served_s=0.0, last_step=9)]) == 1
    assert next_step([StepTurn(served_s=1.0, last_step=7), StepTurn(served_s=1.0, last_step=3)]) == 1


def test_the_ledger_charges_loop_time_to_the_request_of_all_its_jobs():
    ledger = JobLedger()
    jobs = ledger.submit_request([gen("a"), gen("b")], [ignore] * 2)
    other = ledger.submit(gen("c"), ignore)
    ledger.charge(jobs[0], 0.5)
    ledger.charge(jobs[1], 0.25)
    assert ledger.served(jobs[1]) == 0.75 and ledger.served(other) == 0.0


def test_a_request_that_arrives_during_a_choice_goes_before_the_next_choice():
    ledger = JobLedger()
    big = ledger.submit_request([gen(f"big{i}") for i in range(4)], [ignore] * 4)
    first = ledger.take_next()
    assert first is big[0]
    small = ledger.submit(gen("small"), ignore)
    ledger.record(first)  # the serial loop takes its next job once the last one is recorded
    assert ledger.take_next() is small
    ledger.record(small)
    assert [ledger.take_next(), ledger.take_next()] == big[1:3]
    assert ledger.depth == 1


def test_a_request_with_jobs_in_slots_yields_the_next_slot():
    ledger = JobLedger()
    big = ledger.submit_request([gen(f"big{i}") for i in range(4)], [ignore] * 4)
    assert [ledger.take_next(), ledger.take_next()] == big[:2]  # two slots, both free
    small = ledger.submit(gen("small"), ignore)
    ledger.record(big[0])  # one slot frees: the big request still holds one, the small one none
    assert ledger.take_next() is small


def test_a_request_whose_next_job_cannot_start_holds_up_no_one_else():
    ledger = JobLedger()
    blocked = ledger.submit_request([gen("a"), gen("a")], [ignore] * 2)
    other = ledger.submit(gen("b"), ignore)
    assert ledger.take_next(lambda job: job is not blocked[0]) is other


def test_the_serial_worker_interleaves_a_newcomer_with_a_many_choice_request():
    model = FakeModel(reply="abcd")
    w = InferenceWorker(model, FAKE_ENGINE)

    def request(prompt: str) -> GenerationRequest:
        return GenerationRequest(prompt, tuple(model.tokenize(prompt)), 8, sampling=GREEDY)

    big = w.submit_request([request("big")] * 3, [ignore] * 3)
    small = w.submit(request("small"), ignore)
    w.start()
    try:
        assert w.wait_finished(big[-1].id, 5) is not None
    finally:
        w.stop()
    order = [s.job_id for s in sorted(w.finished, key=lambda s: s.started_at)]
    assert order == [big[0].id, small.id, big[1].id, big[2].id]
    assert {s.request_id for s in w.finished if s.job_id != small.id} == {big[0].stats.request_id}


# --- the ceiling ----------------------------------------------------------------------------------

def test_over_limit_counts_choices_times_tokens_within_the_context():
    limits = WorkLimits(generated_tokens=20, scored_tokens=10)
    assert over_limit([gen("p", 5)] * 4, 1024, limits) is None
    refused = over_limit([gen("p", 6)] * 4, 1024, limits)
    assert refused is not None and not refused.scored
    assert "24 tokens (4 choices x up to 6 tokens each)" in refused.message
    assert "at most 20 per request (--max-request-tokens)" in refused.message
    # max_tokens beyond the room its prompt leaves in the context does not count
    assert over_limit([gen("p", 1000, n_prompt=1019)] * 4, 1024, limits) is None


def test_over_limit_counts_scored_prompts_times_their_length():
    limits = WorkLimits(generated_tokens=100, scored_tokens=10)
    assert over_limit([gen("p", 0, n_prompt=5)] * 4, 1024, limits) is None  # not scored
    refused = over_limit([gen("p", 0, n_prompt=5, prompt_logprobs=0)] * 3, 1024, limits)
    assert refused is not None and refused.scored
    assert "scores 15 prompt tokens (3 prompts of up to 5 tokens)" in refused.message
    assert "(--max-request-scored-tokens)" in refused.message


def test_the_limits_are_checked_with_the_config():
    with pytest.raises(ValueError, match="at least 1"):
        ServerConfig(max_request_tokens=0)


def test_a_request_over_the_ceiling_is_answered_400_before_it_is_queued():
    app = fake_app(max_request_tokens=10, max_request_scored_tokens=6)
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 4})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "n" and err["code"] == "request_too_large"
        assert "12 tokens (3 choices x up to 4 tokens each)" in err["message"]
        r = c.post("/v1/completions", json={"prompt": ["abcd", "efgh"], "echo": True, "logprobs": 0,
                                            "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "scores 8 prompt tokens" in r.json()["error"]["message"]
        assert not app.state.worker.finished  # nothing was queued
        ok = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_messages_and_responses_are_checked_against_the_ceiling_too():
    app = fake_app(max_request_tokens=10)
    with TestClient(app, raise_server_exceptions=False) as c:
        over = {"/v1/messages": ({"model": "m", "max_tokens": 11}, "max_tokens"),
                "/v1/responses": ({"max_output_tokens": 11}, "max_output_tokens")}
        for path, (limit, param) in over.items():
            body = {"messages" if path == "/v1/messages" else "input": [{"role": "user", "content": "hi"}], **limit}
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err.get("param", param) == param and "(--max-request-tokens)" in err["message"], (path, err)
            assert "may generate 11 tokens; the server allows at most 10" in err["message"]
            ok_limit = {k: 10 for k in limit if k != "model"}
            assert c.post(path, json={**body, **ok_limit}).status_code == 200, path
        # Only the requests within the ceiling ran (a job is recorded just after its answer).
        assert app.state.worker.wait_finished(2, 10) is not None
        assert [s.job_id for s in app.state.worker.finished] == [1, 2]


# --- queue time -----------------------------------------------------------------------------------

def test_queue_time_is_one_observation_per_request_in_metrics_and_in_the_log(caplog):
    with TestClient(fake_app(), raise_server_exceptions=False) as c, \
            caplog.at_level(logging.INFO, logger="ds4.server.worker"):
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "n": 3})
        assert r.status_code == 200
        found = samples(c.get("/metrics").text)
    assert value(found, "ds4:request_queue_time_seconds_count") == 1
    assert value(found, "vllm:request_queue_time_seconds_count") == 3
    lines = [rec.getMessage() for rec in caplog.records]
    jobs = [line for line in lines if line.startswith("job ")]
    assert len(jobs) == 3 and all(" queued=" in line and " request=" in line for line in jobs)
    ended = [line for line in lines if line.startswith("request ")]
    assert len(ended) == 1 and "jobs=3 queued=" in ended[0]


# --- latency under load ---------------------------------------------------------------------------

def timed_post(base: str, path: str, body: dict) -> tuple[float, dict]:
    t0 = time.monotonic()
    r = httpx.post(base + path, json=body, timeout=600)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0, r.json()


class Background:
    """One request posted from a thread; `join()` returns its answer."""

    def __init__(self, base: str, path: str, body: dict) -> None:
        self.result: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=lambda: self.result.put(timed_post(base, path, body)), daemon=True)
        self.thread.start()

    def join(self) -> dict:
        return self.result.get(timeout=600)[1]


def wait_started(worker, at_least: int = 1) -> None:
    """Until the loop has started `at_least` jobs (so the load is running, not queued)."""
    deadline = time.monotonic() + 60
    while sum(1 for s in worker.jobs.finished) + worker.load().running < at_least:
        assert time.monotonic() < deadline, "the load never started"
        time.sleep(0.005)


def loaded_ratio(base: str, worker, normal: dict, other: dict, load: dict,
                 path: str = CHAT) -> tuple[float, dict, dict, dict]:
    """(latency of `normal` while `load` runs / its idle latency, its idle answer, its loaded
    answer, the answer to `load`).
    The idle latency is the better of two runs, so a cold first run does not flatter the ratio;
    each follows `other` (another prompt), so that it prefills its own as it must under load."""
    runs = []
    for _ in range(2):
        timed_post(base, path, other)
        runs.append(timed_post(base, path, normal))
    idle_s, idle = min(runs, key=lambda t: t[0])
    bg = Background(base, path, load)
    wait_started(worker, len(worker.jobs.finished) + 1)
    loaded_s, loaded = timed_post(base, path, normal)
    return loaded_s / idle_s, idle, loaded, bg.join()


def test_a_normal_request_waits_about_one_choice_of_a_many_choice_request_serial():
    # Each choice takes about 40 tokens x 5 ms; 16 of them in first-in-first-out order made the
    # normal request wait about 16 times its own time.
    model = FakeModel(decode_delay=0.005)
    with live_server(fake_app(model)) as srv:
        normal = {"messages": [{"role": "user", "content": "hello"}], "temperature": 0}
        load = {"messages": [{"role": "user", "content": "load"}], "n": 16, "temperature": 0}
        other = {"messages": [{"role": "user", "content": "another"}], "max_tokens": 1}
        ratio, idle, loaded, _ = loaded_ratio(srv.base, srv.worker, normal, other, load)
    assert ratio < 4.0, f"a normal request took {ratio:.1f}x its idle latency under an n=16 request"
    assert loaded["choices"][0]["message"] == idle["choices"][0]["message"]


def test_a_newcomer_starts_at_the_next_token_of_a_long_single_choice_serial():
    # One choice of 200 tokens x 5 ms: whole choices as the unit of work made a 40-token request
    # wait about a second; steps are tokens now, and the newcomer, least served, goes first.
    model = FakeModel(decode_delay=0.005, reply="word " * 400)
    with live_server(fake_app(model)) as srv:
        normal = {"messages": [{"role": "user", "content": "hello"}], "temperature": 0, "max_tokens": 40}
        load = {"messages": [{"role": "user", "content": "load"}], "temperature": 0, "max_tokens": 200}
        other = {"messages": [{"role": "user", "content": "another"}], "max_tokens": 1}
        ratio, idle, loaded, long = loaded_ratio(srv.base, srv.worker, normal, other, load)
    assert ratio < 2.0, f"a normal request took {ratio:.1f}x its idle latency under one long choice"
    assert loaded["choices"][0]["message"] == idle["choices"][0]["message"]
    assert long["usage"]["completion_tokens"] == 200


def test_interleaved_jobs_emit_their_own_events_in_order():
    # Three requests in progress at once in the serial loop: every job's text and its end come
    # out whole and in order, whatever the interleaving.
    model = FakeModel(decode_delay=0.002, reply="alpha beta gamma delta epsilon zeta eta theta")
    w = InferenceWorker(model, FAKE_ENGINE)
    got: dict[int, list] = {0: [], 1: [], 2: []}
    w.start()
    try:
        alone = []
        for i in range(3):
            q: queue.Queue = queue.Queue()
            w.submit(GenerationRequest(f"p{i}", tuple(model.tokenize(f"p{i}")), 40, sampling=GREEDY), q.put)
            text = ""
            while not isinstance(event := q.get(timeout=10), Finished):
                text += event.text if isinstance(event, TextDelta) else ""
            alone.append(text)
        jobs = [w.submit(GenerationRequest(f"p{i}", tuple(model.tokenize(f"p{i}")), 40, sampling=GREEDY),
                         got[i].append) for i in range(3)]
        for job in jobs:
            assert w.wait_finished(job.id, 10) is not None
    finally:
        w.stop()
    for i in range(3):
        assert isinstance(got[i][-1], Finished) and got[i][-1].usage.completion_tokens == 40
        assert "".join(e.text for e in got[i] if isinstance(e, TextDelta)) == alone[i]
    starts = sorted(s.started_at for s in w.finished if s.job_id in {j.id for j in jobs})
    ends = sorted(s.finished_at for s in w.finished if s.job_id in {j.id for j in jobs})
    assert starts[-1] < ends[0]  # all three were in progress at once


@pytest.mark.model
def test_greedy_outputs_do_not_change_when_the_serial_loop_interleaves_requests(embedded):
    prompts = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):"]
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "logprobs": 1} for p in prompts]
    with live_server(create_app(embedded, ServerConfig())) as srv:
        alone = [answers(timed_post(srv.base, "/v1/completions", b)[1]) for b in bodies]
        together = [Background(srv.base, "/v1/completions", b) for b in bodies]
        shared = [answers(bg.join()) for bg in together]
        for job_id in (4, 5, 6):
            assert srv.worker.wait_finished(job_id, 10) is not None
        stats = [s for s in srv.worker.finished if s.job_id > 3]
    assert shared == alone
    # At least two of them were in progress at once (the requests reach the loop one by one).
    assert min(s.finished_at for s in stats) > sorted(s.started_at for s in stats)[1]


@pytest.fixture(scope="module")
def embedded():
    from engine import load_model
    return load_model()


N32 = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 12, "temperature": 0, "n": 32}
# 16 prompts of about 130 tokens, each scored in full (echo with logprobs), nothing generated.
SCORING16 = {"prompt": [f"Passage {i}: " + "the quick brown fox jumps over the lazy dog and " * 12 for i in range(16)],
             "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}


def answers(body: dict) -> list:
    return [(c["text"], (c.get("logprobs") or {}).get("token_logprobs")) for c in body["choices"]]


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("slots,load,bound", [(1, N32, 5.0), (2, N32, 8.0), (1, SCORING16, 5.0)],
                         ids=["serial-n32", "batched2-n32", "serial-scoring16"])
def test_embedded_model_latency_under_a_many_job_request_stays_near_idle(embedded, slots, load, bound):
    # Serial: the normal request waits for the job in progress (one choice or one scored prompt,
    # about its own length), then runs alone: about 2x. Batched: it waits for the first slot to
    # free, then decodes in a batch of two, each step slower than one row's: about 2.5x. First
    # in, first out it waited for every job of the other request (about 30x under n=32). The
    # bounds leave room for the noise of a shared machine and still tell the two apart.
    normal = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    with live_server(create_app(embedded, ServerConfig(batched_session=slots))) as srv:
        alone = timed_post(srv.base, "/v1/completions", load)[1]
        other = {"prompt": "Another prompt entirely", "max_tokens": 1}
        ratio, idle, loaded, shared = loaded_ratio(srv.base, srv.worker, normal, other, load, "/v1/completions")
    print(f"\n{slots} slot(s): a 12-token request under {len(alone['choices'])} jobs: {ratio:.2f}x its idle latency")
    assert ratio < bound, f"{ratio:.1f}x"
    # Outputs do not depend on the competing load, nor on which choices reused the prompt
    # (under load, choices that follow the normal request prefill their prompt again).
    assert loaded["choices"][0]["text"] == idle["choices"][0]["text"]
    assert answers(shared) == answers(alone)


def test_a_stopped_worker_starts_again_and_serves():
    # The stop request is taken by the loop that ends, as the queue's sentinel was: the app's
    # lifespan may stop and start the same worker.
    model = FakeModel(reply="ok")
    w = InferenceWorker(model, FAKE_ENGINE)
    w.start()
    w.stop()
    w.start()
    try:
        got: queue.Queue = queue.Queue()
        w.submit(GenerationRequest("p", tuple(model.tokenize("p")), 8, sampling=GREEDY), got.put)
        while not isinstance(event := got.get(timeout=5), Finished):
            pass
        assert event.finish_reason == "stop"
    finally:
        w.stop()


def test_the_ceilings_are_flags_of_ds4_server():
    from click.testing import CliRunner

    from server.cli import config_from_flags, main

    help_text = CliRunner().invoke(main, ["--help"]).output
    assert "--max-request-tokens" in help_text and "--max-request-scored-tokens" in help_text
    config = config_from_flags(max_request_tokens=10, max_request_scored_tokens=20)
    assert config.work_limits == WorkLimits(generated_tokens=10, scored_tokens=20)
