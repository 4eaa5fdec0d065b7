"""Batched sessions in ds4-server: routing rules (pure), and the batched worker on tiny random
GGUF models (concurrency, prefix routing, eviction saves, cancellation, greedy equality, prompt
scoring one chunk per step beside the other slots' decoding)."""
from __future__ import annotations

import queue
import threading
import time

import pytest

from server import kvstore as kv
from server.batching import (EMPTY, IDLE, PREFIX, SHORTEST, Route, SlotView, common_text, decoding_rows, route,
                             step_charges)
from server.kvstore_policy import EVICT, SHUTDOWN, SavePolicy
from server.prompting import prompt_ids
from server.jobs import Failed, Finished, GenerationRequest, PromptReady, SamplingSpec, TextDelta
from server.scoring import PromptScored, score_prompt
from server.worker import InferenceWorker

HOUR = 3600.0
SMALL = SavePolicy(trim=4, align=16, interval=64, min_tokens=16, min_gain=8)
GREEDY = SamplingSpec(temperature=0.0)


# --- routing (pure) ----------------------------------------------------------------------------

def view(text: str, active: bool = False, last_used: float = 0.0) -> SlotView:
    return SlotView(text, [ord(c) for c in text], active, last_used)


def ids_of(text: str) -> list[int]:
    return [ord(c) for c in text]


CONV = "S" * 40 + "conversation one, turn one"


def test_common_text():
    assert common_text("abcdef", "abcxyz") == 3 and common_text("", "a") == 0 and common_text("ab", "abc") == 2


def test_the_slot_with_the_longest_shared_prefix_wins():
    slots = [view("S" * 40 + "other"), view(CONV), view("")]
    prompt = CONV + " and the reply, turn two"
    assert route(slots, prompt, ids_of(prompt), now=10.0) == Route(1, len(CONV), 0, PREFIX)
    # A slot whose text diverges late still reuses more than one sharing the header only.
    slots = [view("S" * 40 + "other"), view(CONV + "X" * 10), view("")]
    assert route(slots, prompt, ids_of(prompt), 10.0) == Route(1, len(CONV), 10, PREFIX)


def test_a_short_shared_header_goes_to_an_empty_slot():
    slots = [view("S" * 10 + "one"), view("")]
    prompt = "S" * 10 + "two"
    assert route(slots, prompt, ids_of(prompt), 10.0, min_reuse=32) == Route(1, 0, 0, EMPTY)


def test_active_slots_are_never_chosen():
    slots = [view(CONV, active=True), view("zzz" * 20)]
    r = route(slots, CONV + "more", ids_of(CONV + "more"), 10.0)
    assert r.slot == 1 and r.reason == SHORTEST and r.evicted == 60
    assert route([view(CONV, active=True)], CONV, ids_of(CONV), 10.0) is None


def test_least_recently_used_slot_idle_over_an_hour_before_the_shortest():
    now = 10 * HOUR
    slots = [view("a" * 100, last_used=now - 2 * HOUR), view("b" * 50, last_used=now - 3 * HOUR),
             view("c" * 10, last_used=now - 60)]
    r = route(slots, "new prompt", ids_of("new prompt"), now)
    assert (r.slot, r.reason, r.evicted) == (1, IDLE, 50)
    # Within the hour nobody is idle: the shortest cache goes.
    r = route(slots, "new prompt", ids_of("new prompt"), now - 2.5 * HOUR + 1)
    assert (r.slot, r.reason) == (2, SHORTEST)


# --- the batched worker on a tiny model ---------------------------------------------------------

def test_decoding_rows_are_those_within_a_quantum_of_the_least_served():
    assert decoding_rows([]) == []
    assert decoding_rows([3.0, 0.0, 0.04], quantum=0.05) == [False, True, True]
    assert decoding_rows([1.0, 1.0], quantum=0.0) == [True, True]



def test_a_step_is_charged_by_what_each_row_evaluated():
    # Decoding rows only: shared equally; rows that evaluated nothing pay nothing.
    assert step_charges(0.3, [1, 1, 0], None) == [0.15, 0.15, 0.0]
    # A prefill chunk beside decoding rows: they pay what a decoding step lately took, the chunk the rest.
    assert step_charges(0.5, [1, 128, 1], 0.1) == pytest.approx([0.05, 0.4, 0.05])
    assert step_charges(0.05, [1, 128], 0.1) == pytest.approx([0.05, 0.0])  # never more than the step
    assert step_charges(0.5, [1, 128], None) == pytest.approx([0.0, 0.5])  # no estimate yet: the chunk pays
    assert step_charges(0.5, [0, 128], 0.1) == pytest.approx([0.0, 0.5])
    # Nothing evaluated (a step that only ended requests): shared by all.
    assert step_charges(0.2, [0, 0], 0.1) == [0.1, 0.1]
    assert step_charges(0.2, [], 0.1) == []

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine import load_model
    from engine.synthetic import RandomModelSpec, write_random_gguf
    return load_model(write_random_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                                        RandomModelSpec(n_ctx=256, seed=21)))


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def chat(model, user: str, system: str = "A system prompt shared by every request of this test. ") -> str:
    return model.render_chat([{"role": "system", "content": system}, {"role": "user", "content": user}])


def req(model, text: str, max_tokens: int = 12, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_text=text, prompt_ids=tuple(prompt_ids(model, text)), max_tokens=max_tokens,
                             sampling=kw.pop("sampling", SamplingSpec(temperature=0.0, ignore_eos=True)), **kw)


def collect(worker: InferenceWorker, requests: list[GenerationRequest], timeout: float = 30.0):
    """Submit all at once; (job, events) per request once all have finished."""
    queues = [queue.Queue() for _ in requests]
    jobs = [worker.submit(r, q.put) for r, q in zip(requests, queues)]
    out = []
    for job, q in zip(jobs, queues):
        events = []
        while True:
            ev = q.get(timeout=timeout)
            events.append(ev)
            if isinstance(ev, (Finished, Failed)):
                break
        out.append((job, events))
    return out


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def started(model, n_slots: int, **kw) -> InferenceWorker:
    w = InferenceWorker(model, n_slots=n_slots, **kw)
    w.start()
    return w


def test_requests_in_flight_decode_together_and_match_one_at_a_time(tiny):
    prompts = [chat(tiny, f"question number {i}, about topic {i * 7}") for i in range(3)]
    w = started(tiny, 3)
    try:
        batched = collect(w, [req(tiny, p, 24) for p in prompts])
    finally:
        w.stop()
    stats = [job.stats for job, _ in batched]
    assert all(s.status == "done" and s.n_generated == 24 for s in stats)
    assert sorted(s.slot for s in stats) == [0, 1, 2]
    # They overlap in time: each started decoding before any other finished.
    assert max(s.first_token_at for s in stats) < min(s.finished_at for s in stats)
    w1 = started(tiny, 1)
    try:
        serial = collect(w1, [req(tiny, p, 24) for p in prompts])
    finally:
        w1.stop()
    assert [text_of(ev) for _, ev in batched] == [text_of(ev) for _, ev in serial]
    # One session reuses the shared system prompt of the previous request; separate slots cannot.
    assert [(ev[-1].usage.prompt_tokens, ev[-1].usage.completion_tokens) for _, ev in batched] == \
        [(ev[-1].usage.prompt_tokens, ev[-1].usage.completion_tokens) for _, ev in serial]


def test_a_newcomer_decodes_alone_while_the_long_request_waits_parked_and_outputs_do_not_change(tiny):
    long_prompt, short_prompt = chat(tiny, "a long story, please"), chat(tiny, "one short answer")
    w = started(tiny, 2)
    try:
        alone = [text_of(collect(w, [req(tiny, p, n)])[0][1]) for p, n in ((long_prompt, 200), (short_prompt, 12))]
        w.batched.quantum = 0.0  # strict: the least served request decodes alone
        q_long: queue.Queue = queue.Queue()
        long_job = w.submit(req(tiny, long_prompt, 200), q_long.put)
        while long_job.stats.n_generated < 20:
            time.sleep(0.001)
        short = collect(w, [req(tiny, short_prompt, 12)])[0]
        assert long_job.stats.finished_at is None  # the newcomer ended first
        long_events = []
        while not isinstance(ev := q_long.get(timeout=30), (Finished, Failed)):
            long_events.append(ev)
        parks = w.batched.parks
    finally:
        w.stop()
    assert parks >= 1
    assert [text_of(long_events), text_of(short[1])] == alone
    assert ev.usage.completion_tokens == 256 - ev.usage.prompt_tokens  # to the end of the context


def test_a_newcomer_takes_a_slot_from_a_many_choice_request_whose_choice_resumes_unchanged(tiny):
    long_prompt, short_prompt = chat(tiny, "two long stories, please"), chat(tiny, "one short answer")
    w = started(tiny, 2)
    try:
        alone = [text_of(collect(w, [req(tiny, p, n)])[0][1]) for p, n in ((long_prompt, 120), (short_prompt, 12))]
        w.batched.quantum = 0.0
        queues = [queue.Queue(), queue.Queue()]
        choices = w.submit_request([req(tiny, long_prompt, 120)] * 2, [q.put for q in queues])
        while min(job.stats.n_generated for job in choices) < 20:  # both slots decoding
            time.sleep(0.001)
        short = collect(w, [req(tiny, short_prompt, 12)])[0]
        assert all(job.stats.finished_at is None for job in choices)  # the newcomer did not wait for them
        texts = []
        for q in queues:
            events = []
            while not isinstance(ev := q.get(timeout=30), (Finished, Failed)):
                events.append(ev)
            assert isinstance(ev, Finished) and ev.usage.completion_tokens == 120
            texts.append(text_of(events))
        evictions = w.batched.evictions
        assert not w.batched.evicted
    finally:
        w.stop()
    assert evictions >= 1
    assert texts == [alone[0], alone[0]] and text_of(short[1]) == alone[1]


def test_a_cancelled_evicted_job_ends_cancelled(tiny):
    long_prompt, short_prompt = chat(tiny, "two long stories, please"), chat(tiny, "another short answer")
    w = started(tiny, 2)
    try:
        w.batched.quantum = 0.0
        got: dict[int, queue.Queue] = {0: queue.Queue(), 1: queue.Queue()}
        choices = w.submit_request([req(tiny, long_prompt, 150)] * 2, [got[0].put, got[1].put])
        while min(c.stats.n_generated for c in choices) < 20:
            time.sleep(0.001)
        newcomer = w.submit(req(tiny, short_prompt, 150), lambda _e: None)
        while not w.batched.evicted:
            time.sleep(0.001)
        job = w.batched.evicted[0][0].job
        job.cancel()
        assert w.wait_finished(job.id, 30).status == "cancelled"
        assert w.wait_finished(newcomer.id, 30).status == "done"
    finally:
        w.stop()
    events = []
    q = got[choices.index(job)]
    while not q.empty():
        events.append(q.get())
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "cancelled"


def test_requests_beyond_the_slots_wait_and_reuse_routes_to_the_right_slot(tiny):
    w = started(tiny, 2)
    # Routing alone: no request is ever far enough ahead to be parked or evicted (tested above).
    # With evictions, the job evicted for "gamma" comes back into the one slot that frees, the
    # one where "beta" ended, and replaces its conversation: the follow-up below then finds only
    # the system prompt to reuse.  (Reproduced: letting a request give way after one decoding
    # step's time fails this test every run; the documented cost of `_return_evicted`.)
    w.batched.quantum = float("inf")
    try:
        first = collect(w, [req(tiny, chat(tiny, "alpha alpha alpha")), req(tiny, chat(tiny, "beta beta beta")),
                            req(tiny, chat(tiny, "gamma gamma"))])
        assert all(isinstance(ev[-1], Finished) for _, ev in first)
        # The third request waited for a slot; with both slots holding a conversation, the one
        # whose text the new prompt extends is chosen and its cache reused.
        job_a, ev_a = first[0]
        routes = dict(w.batched.routes)
        assert routes[job_a.id].reason == EMPTY and routes[first[2][0].id].reason in (PREFIX, SHORTEST)
        slot_of_b = first[1][0].stats.slot
        follow = tiny.render_chat([{"role": "system", "content": "A system prompt shared by every request of "
                                    "this test. "}, {"role": "user", "content": "beta beta beta"},
                                   {"role": "assistant", "content": text_of(first[1][1])},
                                   {"role": "user", "content": "and more"}])
        (job, events), = collect(w, [req(tiny, follow)])
        decision = dict(w.batched.routes)[job.id]
        assert decision.reason == PREFIX and decision.slot == slot_of_b == job.stats.slot
        assert events[-1].usage.cached_tokens == decision.reused > len(prompt_ids(tiny, chat(tiny, "beta beta beta"))) - 8
    finally:
        w.stop()


def test_cancelling_one_request_leaves_the_others_running(tiny):
    w = started(tiny, 2)
    try:
        qa, qb = queue.Queue(), queue.Queue()
        ja = w.submit(req(tiny, chat(tiny, "cancel me"), 200), qa.put)
        jb = w.submit(req(tiny, chat(tiny, "keep me"), 60), qb.put)
        while not any(isinstance(qa.get(timeout=10), TextDelta) for _ in range(1)):
            pass
        ja.cancel()
        events_b = []
        while not events_b or not isinstance(events_b[-1], (Finished, Failed)):
            events_b.append(qb.get(timeout=30))
        assert events_b[-1].finish_reason == "length" and events_b[-1].usage.completion_tokens == 60
        sa = w.wait_finished(ja.id, 10)
        assert sa.status == "cancelled" and sa.n_generated < 200
    finally:
        w.stop()


def test_an_evicted_slot_is_saved_to_disk_and_restored_later(tiny, tmp_path):
    store = kv.KVStore(tmp_path / "kv", kv.identity_of(tiny), 10**8, save_policy=SMALL)
    clock = Clock()
    w = started(tiny, 2, kv=store, clock=clock)
    conv = [chat(tiny, f"conversation {name} " * 4, system=f"System prompt {name}. " * 4) for name in "ABC"]
    try:
        collect(w, [req(tiny, conv[0], 6)])
        clock.t += 10
        collect(w, [req(tiny, conv[1], 6)])
        clock.t += 10
        # Both slots hold a conversation; a third one evicts the shorter (here: equal length,
        # the least recently used of them) and its session goes to disk first.
        (job, _), = collect(w, [req(tiny, conv[2], 6)])
        decision = dict(w.batched.routes)[job.id]
        assert decision.reason == SHORTEST and decision.evicted > 0
        evicted = [e for e in store.entries() if e.reason == EVICT]
        assert len(evicted) == 1 and evicted[0].n_tokens >= decision.evicted - 1
        # Conversation A comes back: restored from the disk, not recomputed.
        gone = 0 if decision.slot == 0 else 1
        (job, events), = collect(w, [req(tiny, conv[gone], 6)])
        assert events[-1].usage.cached_tokens >= len(prompt_ids(tiny, conv[gone])) - SMALL.trim - 16
        assert store.stats().hits >= 1
    finally:
        w.stop()
    assert any(e.reason == SHUTDOWN for e in store.entries())


def test_capacity_is_checked_with_the_figures(tiny, monkeypatch):
    from engine import batch
    from engine.batch import CapacityError
    monkeypatch.setattr(batch, "available_bytes", lambda device: 1000)
    with pytest.raises(CapacityError, match="MiB"):
        InferenceWorker(tiny, n_slots=4)


class AlwaysInStructure:
    """A splitter that claims to be inside tool-call syntax throughout: every token is greedy."""

    in_structure = True

    def feed(self, text: str) -> list:
        return []

    def finish(self, reason: str, generated: str | None = None) -> str:
        return f"parsed ({reason})"


def test_greedy_in_structure_and_per_request_splitters_in_a_batch(tiny):
    prompt = chat(tiny, "tool time")
    hot = SamplingSpec(temperature=5.0, seed=3)
    w = started(tiny, 2)
    try:
        (j1, greedy), (j2, forced), (j3, free) = collect(w, [
            req(tiny, prompt, 16, sampling=GREEDY),
            req(tiny, prompt, 16, sampling=hot, new_splitter=AlwaysInStructure),
            req(tiny, prompt, 16, sampling=hot)])
    finally:
        w.stop()
    tokens = lambda job: job.stats.n_generated  # noqa: E731
    assert text_of(forced) == text_of(greedy) and j2.stats.n_greedy == tokens(j2) > 0
    assert forced[-1].output == f"parsed ({forced[-1].finish_reason})"
    assert j3.stats.n_greedy == 0 and free[-1].output is None
    assert any(isinstance(e, PromptReady) for e in forced)


def test_the_http_server_serves_concurrent_requests_from_its_slots(tiny):
    import httpx

    from server.app import create_app
    from server.config import ServerConfig
    from server_support import live_server

    app = create_app(tiny, ServerConfig(batched_session=2))
    body = lambda q: {"messages": [{"role": "user", "content": q}], "max_tokens": 200,  # noqa: E731
                      "temperature": 0, "ignore_eos": True}
    results: list = [None, None]
    with live_server(app) as srv:
        assert httpx.get(srv.base + "/health").json()["batched_sessions"] == 2

        def send(k: int) -> None:
            results[k] = httpx.post(srv.base + "/v1/chat/completions", json=body(f"question {k}"), timeout=60)

        first = threading.Thread(target=send, args=(0,))
        first.start()
        # The second request goes out only once the first is running, so the two overlap and a
        # fast first request cannot leave its slot free for the second.
        deadline = time.monotonic() + 30
        while not srv.worker.busy and time.monotonic() < deadline:
            time.sleep(0.005)
        second = threading.Thread(target=send, args=(1,))
        second.start()
        for t in (first, second):
            t.join(60)
        stats = list(srv.worker.finished)
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in results)
    assert sorted(s.slot for s in stats) == [0, 1]


def test_a_slot_idle_for_over_an_hour_goes_before_the_shortest(tiny):
    clock = Clock()
    w = started(tiny, 2, clock=clock)
    long_conv = chat(tiny, "a long conversation " * 6, system="First system prompt. " * 3)
    short_conv = chat(tiny, "short", system="Second. ")
    try:
        (ja, _), = collect(w, [req(tiny, long_conv, 4)])
        clock.t += 60
        (jb, _), = collect(w, [req(tiny, short_conv, 4)])
        clock.t += 30 * 60
        (j1, _), = collect(w, [req(tiny, chat(tiny, "new", system="Third. "), 4)])
        assert dict(w.batched.routes)[j1.id].reason == SHORTEST and j1.stats.slot == jb.stats.slot
        clock.t += 2 * HOUR
        (j2, _), = collect(w, [req(tiny, chat(tiny, "newer", system="Fourth. "), 4)])
        decision = dict(w.batched.routes)[j2.id]
        assert decision.reason == IDLE and j2.stats.slot == ja.stats.slot
        assert decision.evicted > len(prompt_ids(tiny, short_conv))  # the long conversation went
    finally:
        w.stop()


@pytest.mark.model
def test_embedded_model_batched_greedy_equals_one_at_a_time():
    from engine import load_model
    model = load_model(ctx=1024)
    prompts = [model.render_chat([{"role": "user", "content": q}])
               for q in ("Name three colors.", "What is two plus two?", "Say hello in French.")]
    outputs = []
    for n_slots in (3, 1):
        w = started(model, n_slots)
        try:
            outputs.append([text_of(ev) for _, ev in collect(w, [req(model, p, 24) for p in prompts], 120)])
        finally:
            w.stop()
    assert outputs[0] == outputs[1] and all(outputs[0])


@pytest.mark.parametrize("n_slots", [1, 3])
def test_every_forward_pass_runs_on_the_engine_thread_it_was_given(tiny, monkeypatch, n_slots):

    from engine import threads
    from engine.threads import EngineThread

    seen = []
    real = threads.before_forward
    monkeypatch.setattr(threads, "before_forward", lambda: (seen.append(threading.current_thread().name), real()))
    with EngineThread("the-engine") as engine_thread:
        w = InferenceWorker(tiny, n_slots=n_slots, engine_thread=engine_thread)
        w.start()
        try:
            out = collect(w, [req(tiny, chat(tiny, f"question {i}"), 6) for i in range(3)])
        finally:
            w.stop()
        assert all(isinstance(events[-1], Finished) for _, events in out)
        assert seen and set(seen) == {"the-engine"}
        assert not engine_thread.closed  # a thread the worker was given stays the caller's
    # Without one the worker starts its own and ends it when it stops.
    w = InferenceWorker(tiny, n_slots=n_slots)
    own = w.engine_thread
    w.start()
    collect(w, [req(tiny, chat(tiny, "one more"), 4)])
    w.stop()
    assert own.closed


def test_a_newcomer_decodes_while_a_long_prefill_waits_between_its_chunks_and_outputs_do_not_change(tiny, monkeypatch):
    monkeypatch.setattr(tiny, "prefill_chunk", 16)
    forward = tiny.net.forward

    def slow_chunks(ids, *args, **kw):  # a chunk of this tiny model takes a real model's time
        if len(ids) > 1:
            time.sleep(0.03)
        return forward(ids, *args, **kw)

    long_prompt = chat(tiny, "a long question: " + "tell me about the sea and the sky and the land " * 3)
    short_prompt = chat(tiny, "one short answer")
    w = started(tiny, 2)
    try:
        alone = [text_of(collect(w, [req(tiny, p, 8)])[0][1]) for p in (long_prompt, short_prompt)]
    finally:
        w.stop()
    monkeypatch.setattr(tiny.net, "forward", slow_chunks)
    w = started(tiny, 2)  # fresh slots: the long prompt is prefilled in full, 13 chunks
    try:
        w.batched.quantum = 0.0
        long_events: list = []
        long_job = w.submit(req(tiny, long_prompt, 8), lambda e: long_events.append((time.monotonic(), e)))
        while long_job.stats.started_at is None:
            time.sleep(0.001)
        time.sleep(0.1)  # a few of its chunks in
        short = collect(w, [req(tiny, short_prompt, 8)])[0]
        short_done = time.monotonic()
        assert w.wait_finished(long_job.id, 30) is not None
        parks = w.batched.parks
    finally:
        w.stop()
    ready_at = next(t for t, e in long_events if isinstance(e, PromptReady))
    assert short_done < ready_at, "the newcomer waited for the whole prefill"
    assert parks >= 1
    assert [text_of(e for _, e in long_events), text_of(short[1])] == alone


def test_newcomers_that_arrive_together_each_take_a_slot_and_the_evicted_choices_resume_unchanged(tiny):
    long_prompt = chat(tiny, "three long stories, please")
    shorts = [chat(tiny, "one short answer"), chat(tiny, "another short answer")]
    w = started(tiny, 3)
    try:
        alone = [text_of(collect(w, [req(tiny, p, n)])[0][1]) for p, n in ((long_prompt, 100), (shorts[0], 12),
                                                                               (shorts[1], 12))]
        w.batched.quantum = 0.0
        queues = [queue.Queue() for _ in range(3)]
        choices = w.submit_request([req(tiny, long_prompt, 100)] * 3, [q.put for q in queues])
        while min(job.stats.n_generated for job in choices) < 10:  # every slot decoding
            time.sleep(0.001)
        newcomers = collect(w, [req(tiny, p, 12) for p in shorts])
        assert all(job.stats.finished_at is None for job in choices)
        texts = []
        for q in queues:
            events = []
            while not isinstance(ev := q.get(timeout=30), (Finished, Failed)):
                events.append(ev)
            texts.append(text_of(events))
        evictions = w.batched.evictions
    finally:
        w.stop()
    assert evictions >= 2
    assert texts == [alone[0]] * 3
    assert [text_of(events) for _, events in newcomers] == alone[1:]


# --- prompt scoring one chunk per step ----------------------------------------------------------

SCORE_CHUNK = 16
LONG_QUESTION = "a long question: " + "tell me about the sea and the sky and the land " * 3


def scoring_chunks(model, monkeypatch, on_chunk=lambda: None, delay: float = 0.0, other_delay: float = 0.0) -> list:
    """Prefill chunks of `SCORE_CHUNK` tokens; every chunk that computes all its rows' logits (a
    scoring chunk) calls `on_chunk()` first, whose values are returned in order, and then takes
    `delay` more seconds, every other forward pass (decoding steps too) `other_delay` more: a
    real model's time, so that a step of the tiny model is not a blink."""
    monkeypatch.setattr(model, "prefill_chunk", SCORE_CHUNK)
    forward, decode = model.net.forward, model.net.decode
    seen: list = []

    def watched(ids, *args, **kw):
        if kw.get("logits") == "all":
            seen.append(on_chunk())
            time.sleep(delay)
        else:
            time.sleep(other_delay)
        return forward(ids, *args, **kw)

    def slow_decode(*args, **kw):
        time.sleep(other_delay)
        return decode(*args, **kw)

    monkeypatch.setattr(model.net, "forward", watched)
    monkeypatch.setattr(model.net, "decode", slow_decode)
    return seen


def scored_of(events) -> PromptScored:
    scored = [e for e in events if isinstance(e, PromptScored)]
    assert len(scored) == 1, events
    return scored[0]


def test_a_scored_long_prompt_gives_the_log_probs_of_one_piece_scoring_and_of_the_serial_loop(tiny, monkeypatch):
    scoring_chunks(tiny, monkeypatch)
    long_prompt, other = chat(tiny, LONG_QUESTION), chat(tiny, "one short answer")
    scored = req(tiny, long_prompt, 8, prompt_logprobs=3)
    ids = list(scored.prompt_ids)
    assert len(ids) > 8 * SCORE_CHUNK  # many chunks, each a step of its own
    one_piece = score_prompt(tiny, tiny.new_session(), ids, 3)
    w1 = started(tiny, 1)
    try:
        (_, serial), = collect(w1, [scored])
    finally:
        w1.stop()
    w = started(tiny, 2)
    try:
        # Another slot decodes all along, so the chunks are interleaved with its steps.
        (_, decoding), (job, batched) = collect(w, [req(tiny, other, 60), scored])
    finally:
        w.stop()
    assert scored_of(batched) == one_piece == scored_of(serial)
    assert text_of(batched) == text_of(serial) and isinstance(batched[-1], Finished)
    assert batched[-1].usage.cached_tokens == 0  # computed in full for its scores
    assert isinstance(decoding[-1], Finished) and decoding[-1].usage.completion_tokens == 60
    assert job.stats.status == "done"


class StepMarks:
    """A `JobObserver` that marks the end of each batched step in `order`."""

    def __init__(self, order: list) -> None:
        self.order = order

    def job_started(self, stats) -> None:
        pass

    def token(self, stats, now: float) -> None:
        pass

    def job_finished(self, stats) -> None:
        pass

    def batch_step(self, busy_slots: int, seconds: float) -> None:
        self.order.append("step")


def test_a_scoring_chunk_and_a_prefill_chunk_take_turns_one_chunk_per_step(tiny, monkeypatch):
    scored_prompt = chat(tiny, LONG_QUESTION)
    prefilled_prompt = chat(tiny, "another long one: " + "rivers run down to the sea under a grey sky " * 3)
    w = started(tiny, 2)
    try:
        alone = [collect(w, [r])[0][1] for r in (req(tiny, scored_prompt, 8, prompt_logprobs=1),
                                                  req(tiny, prefilled_prompt, 8))]
    finally:
        w.stop()
    order: list = []
    monkeypatch.setattr(tiny, "prefill_chunk", SCORE_CHUNK)
    forward = tiny.net.forward

    def marked(ids, *args, **kw):
        if len(ids) > 1:
            order.append("score" if kw.get("logits") == "all" else "prefill")
        return forward(ids, *args, **kw)

    monkeypatch.setattr(tiny.net, "forward", marked)
    w = started(tiny, 2, observer=StepMarks(order))  # fresh slots: both prompts computed in full
    try:
        w.batched.quantum = float("inf")  # both served in every step: only the chunk rule decides
        together = [events for _, events in collect(w, [req(tiny, scored_prompt, 8, prompt_logprobs=1),
                                                        req(tiny, prefilled_prompt, 8)])]
    finally:
        w.stop()
    steps, chunks = [[]], [c for c in order if c != "step"]
    for mark in order:
        steps.append([]) if mark == "step" else steps[-1].append(mark)
    assert all(len(step) <= 1 for step in steps), steps
    first, last = chunks.index("score"), len(chunks) - 1 - chunks[::-1].index("score")
    assert "prefill" in chunks[first:last]  # the prefill's chunks went between the scoring's
    assert chunks.count("score") == -(-(len(prompt_ids(tiny, scored_prompt)) - 1) // SCORE_CHUNK)
    assert scored_of(together[0]) == scored_of(alone[0])
    assert [text_of(e) for e in together] == [text_of(e) for e in alone]


def test_a_newcomer_decodes_between_the_chunks_of_a_long_scored_prompt_and_outputs_do_not_change(tiny, monkeypatch):
    long_prompt, short_prompt = chat(tiny, LONG_QUESTION), chat(tiny, "one short answer")
    w = started(tiny, 2)
    try:
        alone = [collect(w, [r])[0][1] for r in (req(tiny, long_prompt, 8, prompt_logprobs=2),
                                                  req(tiny, short_prompt, 8))]
    finally:
        w.stop()
    newcomer: dict = {}
    # At each scoring chunk: the tokens the newcomer (once submitted) has generated so far.
    chunks = scoring_chunks(tiny, monkeypatch, lambda: newcomer["job"].stats.n_generated if newcomer else None,
                            delay=0.02)
    order: list = []  # both jobs' events, in the order the loop emitted them
    w = started(tiny, 2)  # fresh slots: the long prompt is scored in full
    try:
        w.batched.quantum = 0.0  # strict: the least served request goes alone
        long_job = w.submit(req(tiny, long_prompt, 8, prompt_logprobs=2), lambda e: order.append(("long", e)))
        while not chunks:  # its scoring has begun
            time.sleep(0.001)
        newcomer["job"] = w.submit(req(tiny, short_prompt, 8), lambda e: order.append(("short", e)))
        assert w.wait_finished(long_job.id, 30) is not None and w.wait_finished(newcomer["job"].id, 30) is not None
        parks = w.batched.parks
    finally:
        w.stop()
    progress = [n for n in chunks if n is not None]
    # The newcomer's decoding went on between two chunks of the scoring, which it did not wait for.
    assert any(a < b for a, b in zip(progress, progress[1:])), chunks
    kinds = [(who, type(e)) for who, e in order]
    assert kinds.index(("short", Finished)) < kinds.index(("long", PromptScored))
    assert parks >= 1
    long_events = [e for who, e in order if who == "long"]
    assert scored_of(long_events) == scored_of(alone[0])
    assert [text_of(long_events), text_of(e for who, e in order if who == "short")] == [text_of(ev) for ev in alone]


def test_cancelling_a_scored_prompt_between_its_chunks_frees_its_slot_and_changes_no_other_output(tiny, monkeypatch):
    long_prompt = chat(tiny, LONG_QUESTION)
    keep, later = chat(tiny, "keep me going"), chat(tiny, "one more, after the cancel")
    w = started(tiny, 2)
    try:
        alone = [text_of(collect(w, [req(tiny, p, n)])[0][1]) for p, n in ((keep, 150), (later, 8))]
    finally:
        w.stop()
    # The other request's 150 steps (over 0.75 s) outlast the cancel and the request after it.
    chunks = scoring_chunks(tiny, monkeypatch, lambda: None, delay=0.02, other_delay=0.005)
    w = started(tiny, 2)
    try:
        q_keep: queue.Queue = queue.Queue()
        kept = w.submit(req(tiny, keep, 150), q_keep.put)
        cancelled_events: list = []
        scored = w.submit(req(tiny, long_prompt, 8, prompt_logprobs=1), cancelled_events.append)
        while len(chunks) < 2:  # two chunks into its scoring
            time.sleep(0.001)
        scored.cancel()
        stats = w.wait_finished(scored.id, 30)
        n_chunks = len(chunks)
        # Its slot is free: a request that comes now starts there, without waiting for the other slot.
        (after_job, after), = collect(w, [req(tiny, later, 8)])
        kept_events = []
        while not isinstance(ev := q_keep.get(timeout=30), (Finished, Failed)):
            kept_events.append(ev)
        kept_stats = w.wait_finished(kept.id, 30)
    finally:
        w.stop()
    n_scored = -(-(len(prompt_ids(tiny, long_prompt)) - 1) // SCORE_CHUNK)
    assert stats.status == "cancelled" and n_chunks < n_scored
    assert isinstance(cancelled_events[-1], Finished) and cancelled_events[-1].finish_reason == "cancelled"
    assert not any(isinstance(e, (PromptScored, PromptReady, TextDelta)) for e in cancelled_events)
    assert after_job.stats.slot == scored.stats.slot and after_job.stats.finished_at < kept_stats.finished_at
    assert isinstance(ev, Finished) and ev.usage.completion_tokens == 150
    assert [text_of(kept_events), text_of(after)] == alone


def test_a_scoring_chunk_that_fails_fails_only_its_job(tiny, monkeypatch):
    long_prompt, other = chat(tiny, LONG_QUESTION), chat(tiny, "keep me going")
    w = started(tiny, 2)
    try:
        alone = text_of(collect(w, [req(tiny, other, 40)])[0][1])
    finally:
        w.stop()
    chunks = scoring_chunks(tiny, monkeypatch, lambda: None)
    forward = tiny.net.forward

    def third_scoring_chunk_fails(ids, *args, **kw):
        if kw.get("logits") == "all" and len(chunks) == 2:
            chunks.append(None)
            raise RuntimeError("a broken chunk")
        return forward(ids, *args, **kw)

    monkeypatch.setattr(tiny.net, "forward", third_scoring_chunk_fails)
    w = started(tiny, 2)
    try:
        (ok, decoding), (job, failed) = collect(w, [req(tiny, other, 40), req(tiny, long_prompt, 8, prompt_logprobs=1)])
        assert w.wait_finished(ok.id, 30) is not None and w.wait_finished(job.id, 30) is not None
        assert w.batched.n_active == 0 and w.batched.resident_tokens()[job.stats.slot] == 0  # its slot emptied
    finally:
        w.stop()
    assert isinstance(failed[-1], Failed) and job.stats.status == "failed"
    assert not any(isinstance(e, PromptScored) for e in failed)
    assert isinstance(decoding[-1], Finished) and text_of(decoding) == alone


# --- running ahead on the device ----------------------------------------------------------------

def test_a_batched_job_names_its_samplers_greedy_column_while_its_decoder_follows_the_sampler():
    """What a batched job tells the scheduler's run-ahead (`_Chooser.greedy_column`): its
    sampler's column while the decoder draws with the sampler alone; nothing once the job has
    failed, has no budget, or its decoder decides by other means (a constraint, a tool call)."""
    import types

    import torch

    from engine.device_sampling import DeviceLogits
    from engine.sampling import Sampler, SamplingParams
    from server.batching import _Chooser

    row = DeviceLogits(torch.tensor([0.0, 3.0, 1.0]), greedy=1, greedy_no_eos=2, eos_ids=frozenset({1}))
    run = types.SimpleNamespace(error=None, budget=8, decoder=types.SimpleNamespace(follows_sampler=True))
    argmax = Sampler(SamplingParams(temperature=0.0), frozenset({1}))
    greedy = _Chooser(lambda logits: 7, run, argmax)
    no_eos = _Chooser(lambda logits: 7, run, Sampler(SamplingParams(argmax_ignoring_eos=True), frozenset({1})))
    sampled = _Chooser(lambda logits: 7, run, Sampler(SamplingParams(temperature=0.8), frozenset({1})))
    assert greedy(row) == 7 and greedy.greedy_column(row) == 0 and no_eos.greedy_column(row) == 1
    assert sampled.greedy_column(row) is None
    for change in ({"error": RuntimeError("x")}, {"budget": 0},
                   {"decoder": types.SimpleNamespace(follows_sampler=False)}):
        stopped = _Chooser(lambda logits: 7, types.SimpleNamespace(**{**vars(run), **change}), argmax)
        assert stopped.greedy_column(row) is None


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_batched_greedy_jobs_run_ahead_on_cuda_and_stream_what_stepping_streams(tmp_path):
    """On CUDA the batched server's greedy jobs launch each next step before the host has its
    tokens (the scheduler adopts them), and stream the text they stream without it."""
    from engine import load_model
    from engine.synthetic import RandomModelSpec, write_random_gguf

    model = load_model(write_random_gguf(tmp_path / "t.gguf", RandomModelSpec(n_ctx=256, seed=21)), device="cuda")
    prompts = [chat(model, f"question number {i}, about topic {i * 7}") for i in range(3)]

    def serve(run_ahead: bool) -> tuple[list[str], int]:
        w = started(model, 3)
        w.serving.scheduler.run_ahead = run_ahead
        try:
            out = collect(w, [req(model, p, 24 + 8 * i) for i, p in enumerate(prompts)])
        finally:
            w.stop()
        return [text_of(events) for _, events in out], w.serving.scheduler.adopted

    ahead, adopted = serve(True)
    stepped, none = serve(False)
    assert ahead == stepped and none == 0 and adopted >= 10
