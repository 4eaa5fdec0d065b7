"""Batch-invariant mode (engine.invariant): every token goes through the network's one-row step,
so a sequence's logits do not depend on its batch, its prefill chunks or a cached prefix. On CPU
the kernels are row-independent already, so the mode must give the very numbers of the normal
mode; on CUDA (gpu-marked) it must make batched and cached runs equal alone, bit for bit."""
from __future__ import annotations

import pytest
import torch

import engine
from engine.batch import decode_batch
from engine.invariant import BatchInvariant


class OneRowSpy:
    """A network wrapper that records the shape of every forward call it passes on."""

    def __init__(self, net):
        self.net, self.calls = net, []

    def __getattr__(self, name):
        return getattr(self.net, name)

    def forward(self, tokens, start, cache, logits="last", cancel=None):
        self.calls.append(("forward", int(tokens.shape[0])))
        return self.net.forward(tokens, start, cache, logits, cancel)

    def forward_rows(self, tokens, caches):
        self.calls.append(("forward_rows", len(caches)))
        return self.net.forward_rows(tokens, caches)

    def decode(self, tokens, caches, eos_ids=frozenset()):
        self.calls.append(("decode", len(caches)))
        return self.net.decode(tokens, caches, eos_ids)

    def decode_frontier(self, token, cache, eos_ids=frozenset(), cancel=None):
        self.calls.append(("decode_frontier", 1))
        return self.net.decode_frontier(token, cache, eos_ids, cancel)


@pytest.fixture(scope="module")
def pair(tiny_gguf):
    path = tiny_gguf("llama", "Q4_1", n_ctx=256)
    return engine.load_model(path), engine.load_model(path, batch_invariant=True)


PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(100, 160)), [4] * 20]


def test_every_token_is_one_row_step(pair):
    _, inv = pair
    spy = OneRowSpy(inv.net.net)
    inv.net.net = spy
    try:
        batch = inv.new_sessions(3)
        for s, p in zip(batch, PROMPTS):
            s.sync(p)
        decode_batch(batch, [1, 2, 3])
        scored = inv.new_session()
        scored.sync([5, 6, 7, 8])
    finally:
        inv.net.net = spy.net
    assert spy.calls and {c for c in spy.calls} == {("decode_frontier", 1)}
    assert len(spy.calls) == sum(map(len, PROMPTS[:3])) + 3 + 4


def test_on_cpu_the_mode_gives_the_numbers_of_the_normal_mode(pair):
    normal, inv = pair
    assert isinstance(inv.net, BatchInvariant) and "batch-invariant" in inv.net.attention_path
    a, b = normal.new_sessions(4), inv.new_sessions(4)
    for s, t, p in zip(a, b, PROMPTS):
        s.sync(p)
        t.sync(p)
        assert torch.equal(s.logits, t.logits)
    for step in range(6):
        tokens = [int(s.logits.argmax()) for s in a]
        decode_batch(a, tokens)
        decode_batch(b, tokens)
        for s, t in zip(a, b):
            assert torch.equal(s.logits, t.logits), step


def test_scoring_keeps_every_position(pair):
    normal, inv = pair
    ids = torch.tensor(PROMPTS[2])
    for model in (normal, inv):
        cache = model.net.new_cache(128, torch.float32)
        out = model.net.forward(ids, 0, cache, logits="all")
        assert out.shape == (len(PROMPTS[2]), model.net.cfg.n_vocab) and cache.n == len(PROMPTS[2])
    got = [m.net.forward(ids, 0, m.net.new_cache(128, torch.float32), logits="all") for m in pair]
    assert torch.equal(got[0], got[1])


@pytest.mark.gpu
def test_on_cuda_batched_chunked_and_cached_equal_alone(tiny_gguf):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = engine.load_model(tiny_gguf("llama", "Q4_1", n_ctx=256), device="cuda", batch_invariant=True)

    def alone(prompt, n):
        s = model.new_session()
        s.sync(prompt)
        rows = [s.logits if isinstance(s.logits, torch.Tensor) else s.logits.host()]
        for _ in range(n):
            s.eval(int(torch.as_tensor(rows[-1]).argmax()))
            rows.append(s.logits if isinstance(s.logits, torch.Tensor) else s.logits.host())
        return [torch.as_tensor(r).cpu() for r in rows]

    expected = [alone(p, 5) for p in PROMPTS]
    batch = model.new_sessions(len(PROMPTS))
    model.prefill_chunk = 7  # prompts prefilled in chunks
    for s, p in zip(batch, PROMPTS):
        s.sync(p)
    got = [[torch.as_tensor(s.logits if isinstance(s.logits, torch.Tensor) else s.logits.host()).cpu()]
           for s in batch]
    for _ in range(5):
        tokens = [int(g[-1].argmax()) for g in got]
        decode_batch(batch, tokens)
        for g, s in zip(got, batch):
            g.append(torch.as_tensor(s.logits if isinstance(s.logits, torch.Tensor) else s.logits.host()).cpu())
    for e, g in zip(expected, got):
        assert all(torch.equal(x, y) for x, y in zip(e, g))
