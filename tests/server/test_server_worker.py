"""The inference worker alone (no HTTP): event order, stops, failures, shutdown."""

from __future__ import annotations

import queue
import time

from server_fake_engine import FAKE_ENGINE
from server.jobs import (Failed, Finished, GenerationRequest, PrefillProgress, PromptReady, SamplingSpec,
                         TextDelta)
from server.worker import InferenceWorker
from server_fake_engine import FakeModel

GREEDY = SamplingSpec(temperature=0.0)


def request(model: FakeModel, prompt: str, max_tokens: int = 100, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_text=prompt, prompt_ids=tuple(model.tokenize(prompt)),
                             max_tokens=max_tokens, sampling=kw.pop("sampling", GREEDY), **kw)


def drain(q: queue.Queue, timeout: float = 5.0) -> list:
    events = []
    while True:
        ev = q.get(timeout=timeout)
        events.append(ev)
        if isinstance(ev, (Finished, Failed)):
            return events


def run_one(worker: InferenceWorker, req: GenerationRequest) -> list:
    q: queue.Queue = queue.Queue()
    worker.submit(req, q.put)
    return drain(q)


def test_event_order_and_usage():
    model = FakeModel(reply="abc", prefill_chunk=4)
    w = InferenceWorker(model, FAKE_ENGINE)
    w.start()
    try:
        events = run_one(w, request(model, "0123456789"))
    finally:
        w.stop()
    kinds = [type(e) for e in events]
    assert kinds[:3] == [PrefillProgress] * 3
    assert [e.done for e in events[:3]] == [4, 8, 10]
    assert kinds[3] is PromptReady and events[3] == PromptReady(10, 0)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "abc"
    fin = events[-1]
    assert fin.finish_reason == "stop" and fin.usage.prompt_tokens == 10
    assert fin.usage.completion_tokens == 4     # a, b, c, EOS


def test_partial_stop_prefix_is_released_at_eos():
    model = FakeModel(reply="done <")
    w = InferenceWorker(model, FAKE_ENGINE)
    w.start()
    try:
        events = run_one(w, request(model, "p", stop=("<end>",)))
    finally:
        w.stop()
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "done <"
    assert events[-1].finish_reason == "stop" and events[-1].stop_sequence is None


def test_failure_emits_failed_and_the_next_job_gets_a_fresh_session():
    def reply(prompt: str) -> str:
        if prompt == "bad":
            raise ValueError("nope")
        return "ok"

    model = FakeModel(reply=reply)
    w = InferenceWorker(model, FAKE_ENGINE)
    w.start()
    try:
        assert isinstance(run_one(w, request(model, "bad"))[-1], Failed)
        assert run_one(w, request(model, "good"))[-1].finish_reason == "stop"
    finally:
        w.stop()
    assert len(model.sessions) == 2
    assert [s.status for s in w.finished] == ["failed", "done"]


def test_stop_cancels_the_running_job_and_drops_the_queue():
    model = FakeModel(prefill_chunk=1, prefill_delay=0.01)
    w = InferenceWorker(model, FAKE_ENGINE)
    w.start()
    q1: queue.Queue = queue.Queue()
    q2: queue.Queue = queue.Queue()
    w.submit(request(model, "x" * 500), q1.put)
    w.submit(request(model, "y" * 10), q2.put)
    time.sleep(0.1)
    t0 = time.monotonic()
    w.stop()
    assert time.monotonic() - t0 < 0.5
    assert drain(q1)[-1].finish_reason == "cancelled"
    assert drain(q2)[-1].finish_reason == "cancelled"
