"""Batched decoding and the scheduler on small random models."""
from __future__ import annotations

import pytest
import torch

import engine
from engine import SamplingParams, generate, kernels
from engine.batch import BatchScheduler, CapacityError, GenRequest, check_capacity, decode_batch

GREEDY = SamplingParams(argmax_ignoring_eos=True)


def variants() -> list[tuple[str, str, str]]:
    """(arch, CPU kernel path, attention): both families on the best path this CPU runs and
    llama on every other one, plus the torch-ops attention (where no kernel fits the head
    size) and float32 caches on the best path."""
    best, *others = kernels.host_paths()
    out = [("llama", best, "kernel"), ("qwen3", best, "kernel")] + [("llama", p, "kernel") for p in others]
    return out + [("llama", best, "torch-ops"), ("qwen3", best, "kernel-f32"), ("qwen3", best, "torch-ops-f32")]


@pytest.fixture(scope="module", params=variants(), ids=lambda p: "-".join(p))
def model(request, tiny_gguf):
    arch, path, attention = request.param
    m = engine.load_model(tiny_gguf(arch, "Q4_1", n_ctx=512), kv_type="f32" if attention.endswith("f32") else None,
                          cpu_kernels=path)
    if attention.startswith("torch-ops"):  # the path taken where no compiled kernel fits
        m.net.attention_kernel = None
    else:
        assert (m.net.attention_kernel is not None) == (path != "torch")
    m.prefill_chunk = 16
    return m


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (5 + 9 * i,), generator=g).tolist() for i in range(n)]


def alone(model, ids, n):
    s = model.new_session()
    s.sync(ids)
    return list(generate(s, GREEDY, n))


@pytest.mark.parametrize("pooled", [False, True], ids=["own-caches", "pooled"])
def test_decode_batch_matches_single_rows_exactly(model, pooled):
    ps = prompts(5)
    batch = model.new_sessions(5) if pooled else [model.new_session() for _ in ps]
    for s, p in zip(batch, ps):
        s.sync(p)
    decode_batch(batch, [3, 1, 4, 1, 5])
    for s, p, t in zip(batch, ps, [3, 1, 4, 1, 5]):
        one = model.new_session()
        one.sync(p)
        one.eval(t)
        assert s.tokens == p + [t]
        # Row-independent matmul kernels and per-row attention: bitwise equal.
        assert torch.equal(s.logits, one.logits)


def test_pooled_sessions_decode_like_alone_through_pool_growth(model):
    # The first prompt grows the pool past its first 256 positions while decoding.
    ps = [list(range(3, 250)), [7, 8, 9], list(range(100, 140)), [4] * 60]
    n = 20
    expected = [alone(model, p, n) for p in ps]
    pool = model.new_sessions(len(ps))
    for s, p in zip(pool, ps):
        s.sync(p)
    got: list[list[int]] = [[] for _ in ps]
    step = 0
    while any(len(g) < n for g in got):
        # Every third step leaves slot 1 out, so the batch's slots are not a contiguous range.
        live = [i for i in range(len(ps)) if len(got[i]) < n and not (step % 3 == 1 and i == 1)]
        tokens = [int(pool[i].logits.argmax()) for i in live]
        for i, t in zip(live, tokens):
            got[i].append(t)
        decode_batch([pool[i] for i in live], tokens)
        step += 1
    assert pool[0].cache.capacity >= len(ps[0]) + n and pool[0].cache.pool is pool[3].cache.pool
    assert got == expected


def test_pooled_session_reset_reuses_its_slot(model):
    a, b = model.new_sessions(2)
    a.sync([1, 2, 3, 4])
    b.sync([9, 9])
    kv = a.cache.kv
    a.reset()
    assert a.n_past == 0 and a.cache.n == 0 and a.cache.kv is kv
    with pytest.raises(RuntimeError):
        a.logits
    a.sync([5, 6])
    one = model.new_session()
    one.sync([5, 6])
    assert torch.equal(a.logits, one.logits)


def test_decode_batch_rejects_duplicates(model):
    s = model.new_session()
    s.sync([1, 2, 3])
    with pytest.raises(ValueError):
        decode_batch([s, s], [1, 2])


def test_scheduler_greedy_tokens_equal_serial_runs(model):
    ps = prompts(6)
    expected = [alone(model, p, 12) for p in ps]
    sched = BatchScheduler(model, 4, check_memory=False)
    reqs = [GenRequest(p, GREEDY, 12) for p in ps]
    for r in reqs:
        sched.submit(r)
    sched.run()
    assert [r.output for r in reqs] == expected
    assert all(r.finish == "length" for r in reqs)


def test_run_ahead_on_cpu_launches_nothing_and_changes_nothing(model, monkeypatch):
    """`run_ahead` needs rows on the device: on CPU the scheduler does not even try to launch
    a step (so no step is prepared twice), every step is decoded as without it, with the same
    tokens."""
    ps = prompts(5)
    expected = [alone(model, p, 9) for p in ps]
    tried = []
    monkeypatch.setattr(model.net, "decode_launch", lambda *a, **kw: tried.append(a))
    sched = BatchScheduler(model, 3, check_memory=False, run_ahead=True)
    reqs = [GenRequest(p, GREEDY, 9) for p in ps]
    for r in reqs:
        sched.submit(r)
    sched.run()
    assert [r.output for r in reqs] == expected and sched.adopted == 0 and not tried


def test_each_step_is_handed_to_the_observer(model):
    """One StepRecord a step(), the last (idle) one too: the prefill chunks' tokens add up to the
    prompts, the decoding rows to the tokens evaluated after them (all but each request's last),
    three rows at most, and on CPU nothing launched ahead and no graph captured."""
    ps = prompts(3)  # 5, 14 and 23 tokens, in chunks of 16
    records = []
    sched = BatchScheduler(model, 3, check_memory=False, observer=records.append)
    reqs = [GenRequest(p, GREEDY, 6) for p in ps]
    for r in reqs:
        sched.submit(r)
    steps = 1
    while sched.step():
        steps += 1
    assert len(records) == steps
    assert [r.prefill_tokens for r in records if r.prefill_tokens] == [5, 14, 16, 7]
    assert sum(r.decoding for r in records) == sum(len(r.output) - 1 for r in reqs) == 15
    assert max(r.decoding for r in records) == 3 and records[-1].decoding == 0
    assert all(r.seconds >= 0 and r.capture_seconds == 0 and not r.adopted for r in records)
    assert all(a.started + a.seconds <= b.started for a, b in zip(records, records[1:]))


def test_slots_holding_all_but_the_last_token_start_in_one_step(model):
    """As the server's copy of a shared prompt leaves them: the slots' last prompt tokens are
    evaluated as the rows of one decoding step (no chunk of their own), every request's first
    token is chosen in the step after, all finish in the same step, and the tokens are those of
    decoding alone."""
    ps = prompts(3)
    expected = [alone(model, p, 6) for p in ps]
    records = []
    sched = BatchScheduler(model, 3, check_memory=False, observer=records.append)
    for i, p in enumerate(ps):
        sched.session(i).sync(p[:-1])
    reqs = [GenRequest(p, GREEDY, 6, slot=i) for i, p in enumerate(ps)]
    for r in reqs:
        sched.submit(r)
    sched.step()
    assert (records[0].prefill_tokens, records[0].decoding) == (0, 3)
    assert not sched.prefilling and all(r.output == [] for r in reqs)
    assert all(len(sched.session(i).tokens) == len(p) for i, p in enumerate(ps))
    sched.run()
    assert [r.output for r in reqs] == expected
    # Three rows in every step until the 7th chooses all the 6th tokens: no ramp at either end.
    assert [r.decoding for r in records] == [3] * 6 + [0]


def test_a_chunk_that_stops_one_short_leaves_the_last_token_to_the_step(model):
    """A prompt one token longer than a chunk: its chunk runs, and its last token is a row of the
    same step's decoding, beside a request already decoding; a cancelled one is never evaluated."""
    g = torch.Generator().manual_seed(3)
    long = torch.randint(0, 256, (model.prefill_chunk + 1,), generator=g).tolist()
    short = prompts(1)[0]
    expected = [alone(model, short, 5), alone(model, long, 4)]
    records = []
    sched = BatchScheduler(model, 3, check_memory=False, observer=records.append)
    first = GenRequest(short, GREEDY, 5, slot=0)
    sched.submit(first)
    sched.step()  # its whole prompt as one chunk, then its first token
    second = GenRequest(long, GREEDY, 4, slot=1)
    sched.session(2).sync(short[:-1])
    cancelled = GenRequest(short, GREEDY, 4, slot=2, cancel=lambda: True)
    sched.submit(second)
    sched.submit(cancelled)
    sched.step()
    assert (records[-1].prefill_tokens, records[-1].decoding) == (model.prefill_chunk, 2)
    assert cancelled.finish == "cancelled" and len(sched.session(2).tokens) == len(short) - 1
    sched.run()
    assert [first.output, second.output] == expected


def test_long_prefill_is_interleaved_with_decoding(model):
    sched = BatchScheduler(model, 2, check_memory=False)
    short = GenRequest([5, 6, 7], GREEDY, 40)
    sched.submit(short)
    sched.step()
    sched.step()
    decoded_before = len(short.output)
    long = GenRequest(list(range(200)) * 2, GREEDY, 2)  # 400 tokens: 25 chunks of 16
    sched.submit(long)
    while long.first_token_at is None:
        sched.step()
    # The short request kept decoding one token per step while the long prompt prefilled.
    assert len(short.output) - decoded_before >= 24


def test_cancel_and_stop(model):
    sched = BatchScheduler(model, 2, check_memory=False)
    stop_now = {"flag": False}
    r = GenRequest([1, 2, 3], SamplingParams(temperature=1.0, seed=1), 100, cancel=lambda: stop_now["flag"])
    seen = []
    r.on_token = lambda t: (seen.append(t), stop_now.update(flag=len(seen) >= 3))
    sched.submit(r)
    sched.run()
    assert r.finish == "cancelled" and len(r.output) == 3
    assert not sched.busy


def test_a_failing_token_callback_leaves_the_started_step_whole(model):
    """The batched step starts before the tokens go to their requests: where a request's
    `on_token` raises, the step still completes, so every session holds the tokens it evaluated
    and continues as if nothing had happened."""
    ps = prompts(3)
    expected = [alone(model, p, 8) for p in ps]
    sched = BatchScheduler(model, 3, check_memory=False)
    calls = {"n": 0}

    def flaky(_token: int) -> None:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("a client went away")
    reqs = [GenRequest(p, GREEDY, 8, on_token=flaky if i == 1 else None) for i, p in enumerate(ps)]
    for r in reqs:
        sched.submit(r)
    with pytest.raises(RuntimeError, match="went away"):
        sched.run()
    for slot in range(3):
        s = sched.session(slot)
        assert s.cache.n == len(s.tokens)
    sched.run()
    assert [r.output for r in reqs] == expected


def test_too_long_prompt_is_an_error_not_a_crash(model):
    sched = BatchScheduler(model, 1, check_memory=False)
    r = GenRequest(list(range(100)) * 6, GREEDY, 4)
    sched.submit(r)
    sched.run()
    assert r.finish == "error" and "context" in r.error


def test_capacity_check_reports_figures(model):
    check_capacity(model, 2, 512)
    with pytest.raises(CapacityError, match=r"MiB"):
        check_capacity(model, 10**7, 512)
