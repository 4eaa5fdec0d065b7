"""Sessions: prefix reuse, chunked prefill, cancellation, truncation, payload round trip."""
from __future__ import annotations

import pytest
import torch

import engine
from engine import kernels
from engine import Cancelled, SamplingParams, generate
from run_ahead_scripts import assert_same, dropping_ops, run_script


@pytest.fixture(scope="module", params=kernels.host_paths())
def model(tiny_gguf, request):
    """The tiny model on every CPU kernel path this CPU runs: prefill chunks, decoding steps and
    payloads keep the same contract on each."""
    m = engine.load_model(tiny_gguf("llama", "Q4_1"), cpu_kernels=request.param)
    m.prefill_chunk = 8
    return m


def counting(model):
    """Wrap the network so tests can see how many positions each sync evaluated."""
    seen = []
    inner = model.net.forward

    def forward(tokens, start, cache, logits="last", **kw):
        seen.append(int(tokens.shape[0]))
        return inner(tokens, start, cache, logits, **kw)

    model.net.forward = forward
    return seen


IDS = list(range(10, 50))


def test_extension_prefills_only_the_suffix(model):
    cold = model.new_session()
    assert cold.sync(IDS) == 0
    warm = model.new_session()
    warm.sync(IDS[:30])
    seen = counting(model)
    try:
        assert warm.sync(IDS) == 30
    finally:
        del model.net.forward
    assert sum(seen) == 10
    torch.testing.assert_close(warm.logits, cold.logits, rtol=1e-3, atol=1e-3)


def test_divergent_prompt_reuses_common_prefix(model):
    s = model.new_session()
    s.sync(IDS)
    other = IDS[:25] + [7, 7, 7]
    assert s.sync(other) == 25
    assert s.tokens == other
    fresh = model.new_session()
    fresh.sync(other)
    torch.testing.assert_close(s.logits, fresh.logits, rtol=1e-3, atol=1e-3)


def test_same_prompt_twice_is_free_and_truncated_prompt_recomputes_frontier(model):
    s = model.new_session()
    s.sync(IDS)
    seen = counting(model)
    try:
        assert s.sync(IDS) == len(IDS)
        assert seen == []
        assert s.sync(IDS[:20]) == 19  # the frontier token is evaluated again for its logits
        assert seen == [1]
    finally:
        del model.net.forward


def test_cancel_mid_prefill_leaves_a_valid_session(model):
    s = model.new_session()
    progress = []
    with pytest.raises(Cancelled):  # asks to stop once two chunks are done
        s.sync(IDS, progress=lambda d, t: progress.append((d, t)), cancel=lambda: len(progress) >= 2)
    assert progress == [(8, 40), (16, 40)]
    assert s.tokens == IDS[:16]
    assert s.sync(IDS) == 16
    fresh = model.new_session()
    fresh.sync(IDS)
    torch.testing.assert_close(s.logits, fresh.logits, rtol=1e-3, atol=1e-3)


def test_payload_round_trip(model):
    s = model.new_session()
    s.sync(IDS)
    data = s.save_payload()
    t = model.new_session()
    t.load_payload(data)
    assert t.tokens == IDS
    torch.testing.assert_close(t.logits, s.logits, rtol=1e-4, atol=1e-4)
    s.eval(5)
    t.eval(5)
    torch.testing.assert_close(t.logits, s.logits, rtol=1e-4, atol=1e-4)


def test_payload_rejects_garbage_and_truncation(model):
    s = model.new_session()
    s.sync(IDS[:5])
    data = s.save_payload()
    t = model.new_session()
    for bad in (b"", b"nonsense" * 10, data[:-4], data[:20]):
        with pytest.raises(ValueError):
            t.load_payload(bad)
    assert t.tokens == []


def test_context_overflow_is_an_error(tiny_gguf):
    m = engine.load_model(tiny_gguf("llama", "Q4_1"), ctx=16)
    s = m.new_session()
    with pytest.raises(ValueError, match="context"):
        s.sync(list(range(17)))
    s.sync(list(range(16)))
    with pytest.raises(ValueError, match="context"):
        s.eval(3)


def test_generate_stops_at_eos_and_fixed_length_ignores_it(model):
    s = model.new_session()
    s.sync(IDS[:10])
    eos = next(iter(model.eos_ids))
    # Make EOS the greedy choice by construction: patch the frontier logits.
    s._logits = torch.full((model.n_vocab,), -10.0)
    s._logits[eos] = 10.0
    assert list(generate(s, SamplingParams(), 5)) == [eos]
    s.sync(IDS[:10])
    s._logits = torch.full((model.n_vocab,), -10.0)
    s._logits[eos] = 10.0
    s._logits[42] = 9.0
    out = list(generate(s, SamplingParams(argmax_ignoring_eos=True), 4))
    assert len(out) == 4 and out[0] == 42 and eos not in out


def test_greedy_generation_is_deterministic_and_uses_truncate(model):
    s = model.new_session()
    s.sync(IDS[:12])
    a = list(generate(s, SamplingParams(argmax_ignoring_eos=True), 6))
    s.truncate(12)
    s.sync(IDS[:12])
    b = list(generate(s, SamplingParams(argmax_ignoring_eos=True), 6))
    assert a == b


def test_cancel_inside_a_chunk_rolls_back_to_the_last_whole_chunk(model):
    s = model.new_session()
    polls = {"n": 0}

    def cancel():
        polls["n"] += 1
        return polls["n"] > 5  # passes the first chunk, stops inside the second one's layers

    with pytest.raises(Cancelled):
        s.sync(IDS, cancel=cancel)
    assert s.tokens == IDS[:8] and s.cache.n == 8
    assert s.sync(IDS) == 8
    fresh = model.new_session()
    fresh.sync(IDS)
    torch.testing.assert_close(s.logits, fresh.logits, rtol=1e-3, atol=1e-3)



def test_extend_logits_scores_every_position(model):
    """Row i is the distribution after ids[:i+1], across chunk boundaries (chunk 8 here), and
    `logits` is left unset so that a later sync recomputes the frontier by the decode step."""
    s = model.new_session()
    rows = s.extend_logits(IDS[:5])
    rows = torch.cat([rows, s.extend_logits(IDS[5:21])])
    assert rows.shape == (21, model.n_vocab) and s.tokens == IDS[:21]
    with pytest.raises(RuntimeError):
        s.logits
    full = model.net.forward(torch.tensor(IDS[:21]), 0, model.new_session().cache, logits="all")
    torch.testing.assert_close(rows, full, rtol=1e-4, atol=1e-4)
    ref = model.new_session()
    for i in (0, 7, 8, 20):
        ref.sync(IDS[: i + 1])
        torch.testing.assert_close(rows[i], ref.logits, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError):
        s.extend_logits([])
    with pytest.raises(ValueError):
        s.extend_logits([1] * model.n_ctx)


def test_a_copied_prefix_continues_exactly_like_a_prefilled_one(model):
    from engine.batch import BatchScheduler

    ids = [(7 * i + 3) % 200 + 1 for i in range(40)]
    plain = model.new_session()
    plain.sync(ids)
    donor = model.new_session()
    donor.sync(ids[:30] + [5, 6])  # holds more than the shared part
    copy = model.new_session()
    copy.copy_prefix_from(donor, 30)
    assert copy.tokens == ids[:30]
    copy.sync(ids)
    torch.testing.assert_close(copy.logits, plain.logits, rtol=1e-4, atol=1e-4)
    # pooled sessions of the batch scheduler: the pool grows while the prefix is copied
    sched = BatchScheduler(model, 2, ctx=64)
    a, b = sched.session(0), sched.session(1)
    a.sync(ids)
    b.copy_prefix_from(a, 39)
    b.sync(ids)
    torch.testing.assert_close(b.logits, plain.logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="holds 40"):
        b.copy_prefix_from(a, 41)


def test_a_used_session_takes_a_copied_prefix_and_a_restored_state(model, tiny_gguf):
    """A session whose cache a forward pass grew (inference tensors) still accepts a copied
    prefix and a restored state: the server copies into and restores slots it used before."""
    from engine.batch import BatchScheduler

    # A context longer than the pool's first capacity, so that the pool can grow while decoding.
    model = engine.load_model(tiny_gguf("llama", "Q4_1", n_ctx=1024), cpu_kernels=model.cpu_kernel_path)
    ids = [(5 * i + 2) % 200 + 1 for i in range(40)]
    plain = model.new_session()
    plain.sync(ids)
    from engine.batch import GenRequest
    from engine.sampling import SamplingParams

    sched = BatchScheduler(model, 2)
    # Both slots serve a request first, decoding together past the pool's first capacity, so
    # the pool grows inside the batched forward pass (inference mode).
    first = sched.session(0).cache.capacity
    for prompt in ([3] * (first - 4), [6] * (first - 6)):
        sched.submit(GenRequest(ids=prompt, params=SamplingParams(argmax_ignoring_eos=True), max_tokens=12))
    sched.run()
    donor, used = sched.session(0), sched.session(1)
    assert used.cache.capacity > first  # the pool grew inside the batched forward pass
    assert not used.cache.k.is_inference()  # ...and still holds ordinary tensors
    donor.sync(ids)
    used.copy_prefix_from(donor, 39)
    used.sync(ids)
    assert torch.equal(used.logits, plain.logits)
    used.cache.restore(*plain.cache.state())
    assert used.cache.n == len(ids)


def _grown_then_restored(model, session, grow: list[int], payload: bytes) -> None:
    """Grow `session`'s cache inside a forward pass, then restore `payload` into it without a
    reallocation: the write of a restore lands in memory the forward pass allocated."""
    session.sync(grow)
    capacity = session.cache.capacity
    session.load_payload(payload)
    assert session.cache.capacity == capacity


@pytest.mark.parametrize("pooled", [False, True], ids=["own-cache", "pool-slot"])
def test_a_restore_into_a_cache_grown_by_prefill_continues_like_a_cold_prefill(model, tiny_gguf, pooled):
    """The server's failure: a checkpoint restored into a session whose cache an earlier
    request grew (inside inference mode) failed with "Inplace update to inference tensor
    outside InferenceMode". The restored state must continue bitwise like a cold prefill."""
    from engine.batch import BatchScheduler

    model = engine.load_model(tiny_gguf("llama", "Q4_1", n_ctx=1024), cpu_kernels=model.cpu_kernel_path)
    a = [(7 * i + 3) % 250 + 1 for i in range(600)]  # grows the cache 256 -> 1024 in the prefill
    b = [(11 * i + 5) % 250 + 1 for i in range(300)]
    cold = model.new_session()
    cold.sync(b)
    payload = cold.save_payload()
    want = list(generate(cold, SamplingParams(argmax_ignoring_eos=True), 6))

    if pooled:
        sched = BatchScheduler(model, 2)
        session = sched.session(1)
        sched.session(0).sync(b[:40])  # the other slot is in use too
    else:
        session = model.new_session()
    _grown_then_restored(model, session, a, payload)
    assert session.tokens == b
    fresh = model.new_session()
    fresh.sync(b)
    assert torch.equal(session.logits, fresh.logits)
    assert list(generate(session, SamplingParams(argmax_ignoring_eos=True), 6)) == want
    # A copied prefix lands in the same memory: the donor's prompt continues the same way.
    session.copy_prefix_from(fresh, 299)
    session.sync(b)
    assert torch.equal(session.logits, fresh.logits)


# --- run-ahead's bookkeeping, on the CPU ---
# The real steps ahead are CUDA graph replays (tests/engine/test_cuda_graphs.py compares them
# on a GPU). Here the network's frontier and steps ahead are the CPU model's own decode steps,
# returned the way the CUDA path returns them (device-style rows with their greedy ids), so
# the session's rules run where CI runs: which steps it launches, adopts and drops.

class _StepAhead:
    def __init__(self, rows: torch.Tensor, eos_ids: frozenset[int]):
        from engine.device_sampling import greedy_pair

        self.rows = rows
        self.ids = greedy_pair(rows, None if not eos_ids else torch.tensor(sorted(eos_ids))).tolist()
        self.eos_ids = eos_ids

    def result(self):
        from engine.device_sampling import StepLogits

        return StepLogits(self.rows, self.ids, self.eos_ids)


class _AheadNet:
    """The CPU network with `decode_ahead`: a step at cache.n + ahead, the length kept."""

    def __init__(self, net):
        self.inner = net
        self.launched = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _step(self, token: int, cache, pos: int, eos_ids) -> _StepAhead:
        n = cache.n
        cache.n = pos  # what is stored past the frontier is kept if the cache grows
        rows = self.inner.forward(torch.tensor([int(token)]), pos, cache).unsqueeze(0)
        cache.n = n
        return _StepAhead(rows, eos_ids)

    def decode_frontier(self, token, cache, eos_ids=frozenset(), cancel=None):
        step = self._step(token, cache, cache.n, eos_ids)
        cache.n += 1
        return step.result().row(0)

    def decode_ahead(self, token, cache, eos_ids, ahead, after=None, column=0):
        if cache.n + ahead >= cache.n_ctx:
            return None
        self.launched += 1
        return self._step(token if after is None else after.ids[0][column], cache, cache.n + ahead, eos_ids)


@pytest.fixture
def ahead_model(tiny_gguf):
    m = engine.load_model(tiny_gguf("llama", "Q4_1", n_ctx=512))
    m.net = _AheadNet(m.net)
    return m


GREEDY = SamplingParams(argmax_ignoring_eos=True)


def test_run_ahead_adopts_its_steps_and_changes_nothing_a_caller_sees(ahead_model, monkeypatch):
    m = ahead_model
    prompt = [(7 * i) % 200 + 3 for i in range(250)]  # the cache grows past 256 while steps run ahead

    def ops(s, record):
        s.sync(prompt)
        for _ in range(12):
            t = s.sample(GREEDY)
            assert s.n_past == len(s.tokens) == s.cache.n  # nothing visible ran ahead
            s.eval(t)
            record()
    m.net.launched = 0
    with_ahead = run_script(m, monkeypatch, 2, ops)
    assert m.net.launched == 12 + 1  # one per adopted token, plus the successor never adopted
    assert_same(with_ahead, run_script(m, monkeypatch, 0, ops))


def test_run_ahead_is_dropped_by_every_other_change(ahead_model, monkeypatch):
    ops = dropping_ops(IDS)
    assert_same(run_script(ahead_model, monkeypatch, 2, ops), run_script(ahead_model, monkeypatch, 0, ops))


def test_no_step_ahead_of_a_sampled_token_an_end_token_or_the_context_end(ahead_model, monkeypatch):
    m = ahead_model
    s = m.new_session()
    s.sync(IDS)
    m.net.launched = 0
    s.sample(SamplingParams(temperature=0.9, seed=1))
    assert m.net.launched == 0
    eos = next(iter(m.eos_ids))
    plain = SamplingParams(temperature=0.0)
    monkeypatch.setattr(engine.sampling.Sampler, "__call__", lambda self, logits: eos)
    assert s.sample(plain) == eos and m.net.launched == 0  # a plain greedy caller stops at eos
    monkeypatch.undo()
    full = m.new_session()
    full.sync([5] * (m.n_ctx - 1))
    m.net.launched = 0
    full.sample(GREEDY)
    assert m.net.launched == 1  # the last position only: nothing past the context


def test_a_different_token_for_the_same_frontier_launches_its_own_steps(ahead_model, monkeypatch):
    m = ahead_model
    s = m.new_session()
    s.sync(IDS)
    m.net.launched = 0
    greedy = s.sample(GREEDY)
    assert m.net.launched == 2
    other = (greedy + 1) % 200
    monkeypatch.setattr(engine.sampling.Sampler, "__call__", lambda self, logits: other)
    assert s.sample(GREEDY) == other
    assert m.net.launched == 4  # the steps of the greedy token were dropped, the new token's launched
    monkeypatch.undo()
    s.eval(other)
    assert m.net.launched == 4 and s.tokens[-1] == other  # adopted: no step of its own
    ref = m.new_session()
    ref.sync(IDS + [other])
    assert torch.equal(s.logits, ref.logits)
