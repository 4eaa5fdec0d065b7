"""Interruptible prefill (issue 42): a long prompt's prefill and a scored prompt's scoring run
one chunk per step, with other requests' steps between them.

- The steps themselves (`server.kvplan.iter_sync`, `iter_prefill`, `server.scoring.iter_score_prompt`)
  on a tiny random model: another session's decoding between the chunks changes no bit of the
  cache, the frontier logits or the prompt's log-probs.
- The serial loop over the fake engine: a short request that arrives during a long prompt's
  prefill is answered before that prefill ends.
- The embedded model in both loops (`model`): greedy outputs and prompt log-probs of requests
  served together, long prompts among them, equal those served alone; a long prompt scored in
  the batched loop (one chunk per step) beside a decoding request gets the serial loop's numbers.
"""

from __future__ import annotations

import math
import queue
import time

import pytest
import torch

from server import kvplan
from server.app import create_app
from server.config import ServerConfig
from server.jobs import Finished, GenerationRequest, PromptReady, SamplingSpec, run_to_end
from server.prompting import prompt_ids
from server.scoring import iter_score_prompt, score_prompt
from server.worker import InferenceWorker
from server_fake_engine import FAKE_ENGINE, FakeModel
from server_support import live_server
from server_support import system_user_chat as chat
from test_server_fair import Background, answers, timed_post

GREEDY = SamplingSpec(temperature=0.0)
CHUNK = 16


@pytest.fixture()
def small_chunks(tiny_model, monkeypatch):
    """The tiny model with prefill chunks of `CHUNK` tokens, so that a prompt spans several."""
    monkeypatch.setattr(tiny_model, "prefill_chunk", CHUNK)
    return tiny_model


def long_chat(m) -> tuple[str, list[int]]:
    text = chat(m, "a system prompt long enough to span several prefill chunks " * 3, "and the question")
    return text, prompt_ids(m, text)


def steps_with_work_between(steps, between) -> tuple[int, object]:
    """Run a generator of steps, calling `between()` at every pause: (pauses, its return value)."""
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return pauses, done.value
        pauses += 1
        between()


def test_a_stepped_prefill_gives_the_bits_of_an_uninterrupted_one(small_chunks):
    m = small_chunks
    text, ids = long_chat(m)
    whole = m.new_session()
    whole.sync(ids)
    stepped, other = m.new_session(), m.new_session()
    other.sync(ids[:3])
    pauses, out = steps_with_work_between(kvplan.iter_prefill(None, m, stepped, text, ids),
                                          lambda: other.eval(int(other.logits.argmax())))
    assert pauses == math.ceil(len(ids) / CHUNK) - 1  # one pause between each two chunks
    assert out.ids == ids and out.n_reused == 0
    assert stepped.tokens == whole.tokens
    assert torch.equal(stepped.logits, whole.logits)
    for _ in range(6):  # the keys and values too: the continuations agree step by step
        token = int(whole.logits.argmax())
        whole.eval(token)
        stepped.eval(token)
        assert torch.equal(stepped.logits, whole.logits)


def test_a_stepped_prefill_reuses_the_common_prefix_as_sync_does(small_chunks):
    m = small_chunks
    text, ids = long_chat(m)
    session = m.new_session()
    session.sync(ids[:40])
    pauses, out = steps_with_work_between(kvplan.iter_prefill(None, m, session, text, ids), lambda: None)
    assert out.n_reused == 40
    assert pauses == math.ceil((len(ids) - 40) / CHUNK) - 1


def test_stepped_scoring_gives_the_bits_of_an_uninterrupted_one(small_chunks):
    m = small_chunks
    _, ids = long_chat(m)
    alone = score_prompt(m, m.new_session(), ids, 3)
    other = m.new_session()
    other.sync(ids[:3])
    pauses, stepped = steps_with_work_between(iter_score_prompt(m, m.new_session(), ids, 3),
                                              lambda: other.eval(int(other.logits.argmax())))
    assert pauses == math.ceil((len(ids) - 1) / CHUNK) - 1
    assert stepped == alone


def test_run_to_end_returns_the_value_of_the_steps():
    def steps():
        yield
        yield
        return 7
    assert run_to_end(steps()) == 7


def test_the_serial_loop_answers_a_newcomer_between_the_chunks_of_a_long_prefill():
    # 100 chunks of 20 ms: prefilled in one step, the long prompt held the loop for 2 s.
    model = FakeModel(prefill_chunk=8, prefill_delay=0.02, reply="ok")
    w = InferenceWorker(model, FAKE_ENGINE)
    long_events: queue.Queue = queue.Queue()
    long_prompt = "x" * 800
    w.start()
    try:
        long_job = w.submit(GenerationRequest(long_prompt, tuple(model.tokenize(long_prompt)), 4, sampling=GREEDY),
                            lambda e: long_events.put((time.monotonic(), e)))
        while w.load().running == 0:
            time.sleep(0.005)
        time.sleep(0.1)  # a few chunks into the prefill
        t0 = time.monotonic()
        short = w.submit(GenerationRequest("hi", tuple(model.tokenize("hi")), 4, sampling=GREEDY), lambda e: None)
        short_stats = w.wait_finished(short.id, 10)
        latency = time.monotonic() - t0
        assert w.wait_finished(long_job.id, 10) is not None
    finally:
        w.stop()
    ready_at = next(t for t, e in iter(long_events.get_nowait, None) if isinstance(e, PromptReady))
    assert short_stats is not None and short_stats.finish_reason is not None
    assert short_stats.finished_at < ready_at, "the newcomer waited for the whole prefill"
    assert latency < 1.0, f"{latency:.2f} s"


def test_a_cancelled_job_stops_between_the_chunks_of_its_prefill():
    model = FakeModel(prefill_chunk=8, prefill_delay=0.02, reply="ok")
    w = InferenceWorker(model, FAKE_ENGINE)
    events: list = []
    prompt = "y" * 800
    w.start()
    try:
        job = w.submit(GenerationRequest(prompt, tuple(model.tokenize(prompt)), 4, sampling=GREEDY), events.append)
        while w.load().running == 0:
            time.sleep(0.005)
        time.sleep(0.1)
        job.cancel()
        stats = w.wait_finished(job.id, 5)
    finally:
        w.stop()
    assert stats is not None and stats.status == "cancelled"
    assert stats.cancel_latency_s is not None and stats.cancel_latency_s < 0.5
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "cancelled"
    assert not any(isinstance(e, PromptReady) for e in events)


@pytest.fixture(scope="module")
def embedded():
    from engine import load_model
    return load_model()


# Prompts of about 300 and 500 tokens: three and four prefill chunks of the CPU engine.
LONG_A = "Passage one. " + "the quick brown fox jumps over the lazy dog while the cat sleeps " * 22
LONG_B = "Passage two. " + "a river runs through the valley and the mountains rise above it all " * 33


@pytest.mark.model
@pytest.mark.parametrize("slots", [1, 2], ids=["serial", "batched2"])
def test_long_prompts_served_together_give_the_outputs_and_log_probs_of_each_alone(embedded, slots):
    bodies = [{"prompt": LONG_A, "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 1},
              {"prompt": LONG_B, "max_tokens": 16, "temperature": 0, "logprobs": 1},
              {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "logprobs": 1}]
    with live_server(create_app(embedded, ServerConfig(batched_session=slots))) as srv:
        alone = [answers(timed_post(srv.base, "/v1/completions", b)[1]) for b in bodies]
        together = [Background(srv.base, "/v1/completions", b) for b in bodies]
        shared = [answers(bg.join()) for bg in together]
        stats = [srv.worker.wait_finished(job_id, 10) for job_id in (4, 5, 6)]
    assert shared == alone
    assert None not in stats
    # The short request ended before a long one that started before it (it did not wait for
    # the whole prefill), or at least two were in progress at once.
    assert min(s.finished_at for s in stats) > sorted(s.started_at for s in stats)[1]




@pytest.mark.model
def test_a_long_prompt_scored_beside_a_decoding_request_gets_the_same_log_probs_in_both_loops(embedded):
    scored = {"prompt": LONG_B, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    other = {"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0}
    got = []
    for slots in (1, 2):
        with live_server(create_app(embedded, ServerConfig(batched_session=slots))) as srv:
            decoding = Background(srv.base, "/v1/completions", other)
            choice = timed_post(srv.base, "/v1/completions", scored)[1]["choices"][0]
            got.append((choice["text"], choice["logprobs"], answers(decoding.join())))
    serial, batched = got
    assert batched == serial
    assert len(serial[1]["token_logprobs"]) > 3 * embedded.prefill_chunk  # scored over several chunks
