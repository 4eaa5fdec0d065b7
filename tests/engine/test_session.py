"""Sessions: prefix reuse, chunked prefill, cancellation, truncation, payload round trip."""
from __future__ import annotations

import pytest
import torch

import engine
from engine import Cancelled, SamplingParams, generate


@pytest.fixture(scope="module")
def model(tiny_gguf):
    m = engine.load_model(tiny_gguf("llama", "Q4_1"))
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
