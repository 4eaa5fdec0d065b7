"""Gemma's bounded KV cache on random-weight GGUFs: local layers keep a ring of their last
2 * window - 1 positions (engine.kvcache.Ring), global layers every position.  Against the full
cache (`bounded_cache = False`) the logits are bitwise equal past the window on CPU; decoding far
past the window keeps the rings' size; prefix reuse, truncation and copies that need positions
a ring overwrote recompute them (the same logits as a fresh prefill, never stale keys);
batched decoding equals decoding alone, and a saved payload (only the window of the ring's
layers) restores to the same logits; payloads of the older full form still restore."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import engine
from engine.batch import decode_batch
from engine.session import PAYLOAD_VERSION, PAYLOAD_VERSION_HELD
from gemma_models import GemmaSpec, write_random_gemma

WINDOW, RING = 4, 7  # the ring holds 2 * window - 1 positions; a step stores at most `window`
N_VOCAB = 269


def ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(6, N_VOCAB, n)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma-ring")
    # gemma2: local, global; gemma3: five local layers, one global.  Caps that bite (gemma2).
    g2 = GemmaSpec(arch="gemma2", qtype="Q8_0", n_layer=2, attn_softcap=3.0, final_softcap=5.0, n_ctx=512, seed=3)
    g3 = GemmaSpec(arch="gemma3", qtype="Q8_0", n_ctx=512, seed=4)
    return {s.arch: write_random_gemma(root / f"{s.arch}.gguf", s) for s in (g2, g3)}


def load(path: str, bounded: bool = True, chunk: int = 5):
    m = engine.load_model(path)
    m.net.bounded_cache = bounded
    m.prefill_chunk = chunk  # chunks longer than a ring step: the forward pass runs them in pieces
    return m


def full_form_payload(s) -> bytes:
    """`s` saved as payloads were before the ring's layers kept only their window: format
    version 1, every layer at every position (zeros where the ring forgot them)."""
    parts = s.cache.state()
    lay = s.cache.layout
    head = struct.pack("<6sHBxIIII", b"DS4KV\0", PAYLOAD_VERSION, 1, s.cache.n_layer, lay.heads, lay.width,
                       len(s.tokens))
    return b"".join([head, np.asarray(s.tokens, dtype="<i4").tobytes(),
                     *(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)])


def decoded(m, prompt: list[int], more: list[int]) -> torch.Tensor:
    s = m.new_session()
    s.sync(prompt)
    rows = [s.logits]
    for t in more:
        s.eval(t)
        rows.append(s.logits)
    return torch.stack(rows)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_ring_gives_the_full_caches_logits_bit_for_bit(paths, arch):
    text = ids(60, 1)
    full, ring = load(paths[arch], bounded=False), load(paths[arch])
    assert full.new_session().cache.layout.ring is None
    assert ring.new_session().cache.layout.ring.size == RING
    assert torch.equal(decoded(ring, text[:9], text[9:]), decoded(full, text[:9], text[9:]))
    scored = [torch.cat([c for _, c in m.new_session().iter_extend_logits(text)]) for m in (ring, full)]
    assert torch.equal(scored[0], scored[1])
    # One long forward (more rows than a ring step takes) against the full cache's.
    whole = [m.net.forward(torch.tensor(text), 0, m.new_session().cache, logits="all") for m in (ring, full)]
    assert torch.equal(whole[0], whole[1]) and torch.equal(whole[0], scored[0])


def test_decoding_far_past_the_window_grows_only_the_global_layers(paths):
    m = load(paths["gemma3"])
    cfg = m.config
    layer = 2 * cfg.n_head_kv * cfg.head_dim * 2  # K and V of one layer at one position, float16
    s = m.new_session()
    s.sync(ids(20, 2))
    assert (s.cache.kv.shape[0], s.cache.ring_kv.shape[0]) == (1, 5)  # one global layer, five local
    ring_before = s.cache.ring_kv
    for t in ids(400, 3):
        s.eval(t)
    assert s.n_past == 420 and s.cache.capacity >= 420
    assert s.cache.ring_kv is ring_before and tuple(s.cache.ring_kv.shape) == (5, 2, cfg.n_head_kv, RING, cfg.head_dim)
    assert s.cache.nbytes == (s.cache.capacity + 5 * RING) * layer
    assert m.net.kv_bytes(420, m.kv_dtype) == (420 + 5 * RING) * layer
    pool = m.net.new_pool(3, m.n_ctx, m.kv_dtype)
    pool.reserve(420)
    assert pool.nbytes == 3 * (pool.capacity + 5 * RING) * layer


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_prefix_reuse_recomputes_what_the_ring_overwrote(paths, arch):
    m = load(paths[arch])
    a, b = ids(40, 5), ids(10, 6)

    def fresh(tokens):
        s = m.new_session()
        s.sync(tokens)
        return s.logits

    s = m.new_session()
    s.sync(a)
    # The ring holds positions 33..39: continuing at 38 needs 35..37, still there.
    assert s.sync(a[:38] + b) == 38 and torch.equal(s.logits, fresh(a[:38] + b))
    # Continuing at 20 needs 17..19, long overwritten: prefilled from the start.
    assert s.sync(a[:20] + b) == 0 and torch.equal(s.logits, fresh(a[:20] + b))
    # A truncation is honoured lazily: the next token first recomputes the kept ones.
    s.sync(a)
    s.truncate(20)
    s.eval(b[0])
    assert s.tokens == a[:20] + b[:1] and torch.equal(s.logits, fresh(a[:20] + b[:1]))
    # A copied prefix whose window the donor's ring lost is recomputed too.
    s.sync(a)
    other = m.new_session()
    other.copy_prefix_from(s, 20)
    assert other.sync(a[:20] + b) == 0 and torch.equal(other.logits, fresh(a[:20] + b))
    other.copy_prefix_from(s, 38)
    assert other.sync(a[:38] + b) == 38 and torch.equal(other.logits, fresh(a[:38] + b))


def test_the_forward_pass_refuses_a_start_whose_window_is_gone(paths):
    m = load(paths["gemma3"])
    s = m.new_session()
    s.sync(ids(40, 7))
    s.cache.n = 20  # a truncation nobody recomputed
    with pytest.raises(RuntimeError, match="no longer holds the window"):
        m.net.forward(torch.tensor([9, 10]), 20, s.cache, logits="none")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_batched_decoding_far_past_the_window_equals_alone(paths, arch):
    m = load(paths[arch])
    prompts = [ids(n, 10 + n) for n in (3, 8, 15, 30)]  # rings wrapping at different steps
    more = ids(25, 9)
    batch = m.new_sessions(len(prompts))
    for s, p in zip(batch, prompts):
        s.sync(p)
    for t in more:
        decode_batch(batch, [t] * len(batch))
    for s, p in zip(batch, prompts):
        assert torch.equal(s.logits, decoded(m, p, more)[-1])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_saved_payload_restores_to_the_same_logits(paths, arch):
    m = load(paths[arch])
    a, more = ids(30, 11), ids(12, 12)
    s = m.new_session()
    s.sync(a)
    payload = s.save_payload()
    assert struct.unpack_from("<H", payload, 6) == (PAYLOAD_VERSION_HELD,)
    restored = m.new_session()
    restored.load_payload(payload)
    assert restored.tokens == a and torch.equal(restored.logits, s.logits)
    for t in more:  # the original, the restored copy and a cold prefill decode alike
        s.eval(t)
        restored.eval(t)
        assert torch.equal(restored.logits, s.logits)
    assert torch.equal(restored.logits, decoded(m, a, more)[-1])
    # Saved after a truncation past the ring: what it saves is recomputed first.
    s.truncate(15)
    restored.load_payload(s.save_payload())
    assert restored.tokens == a[:15] and torch.equal(restored.logits, decoded(m, a[:15], [])[-1])
    # A restored session holds only the window: a shorter prefix is recomputed, not misread.
    assert restored.sync(a[:6] + more) == 0 and torch.equal(restored.logits, decoded(m, a[:6] + more, [])[-1])
    # A payload of the full cache (format version 1, as before the ring) restores into the ring.
    full = load(paths[arch], bounded=False).new_session()
    full.sync(a)
    restored.load_payload(full.save_payload())
    for t in more:
        restored.eval(t)
    assert torch.equal(restored.logits, decoded(m, a, more)[-1])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_full_form_payload_of_the_ring_still_restores(paths, arch):
    m = load(paths[arch])
    a, more = ids(30, 13), ids(6, 14)
    s = m.new_session()
    s.sync(a)
    old = full_form_payload(s)
    restored = m.new_session()
    restored.load_payload(old)
    assert restored.tokens == a and torch.equal(restored.logits, s.logits)
    for t in more:
        restored.eval(t)
    assert torch.equal(restored.logits, decoded(m, a, more)[-1])
    # Saved again, it takes the compact form: the same rows the compact save of `s` holds.
    restored.load_payload(old)
    assert restored.save_payload() == s.save_payload()


@pytest.mark.parametrize("n", [1, 3, 4, 30])
def test_the_payload_keeps_the_window_of_the_ring_layers_and_every_position_of_the_others(paths, n):
    m = load(paths["gemma3"])
    s = m.new_session()
    s.sync(ids(n, 15))
    cfg, lay = m.config, s.cache.layout
    layer = 2 * cfg.n_head_kv * cfg.head_dim * 2  # K and V of one layer at one position, float16
    n_ring = len(lay.ring.layers)
    head = 26 + 4 * n + 8 + 4 * n_ring  # header, tokens, the ring's window, count and layers
    rows = (n * (cfg.n_layer - n_ring) + min(n, WINDOW) * n_ring) * layer
    assert rows == lay.held_bytes(cfg.n_layer, n, m.kv_dtype)
    payload = s.save_payload()
    assert len(payload) == head + rows
    old = full_form_payload(s)
    assert len(old) == 26 + 4 * n + n * cfg.n_layer * layer
    assert len(old) - len(payload) == (n - min(n, WINDOW)) * n_ring * layer - 8 - 4 * n_ring


def test_a_layout_without_a_ring_saves_the_full_form_byte_for_byte(paths):
    """The full cache's payload (no ring) is version 1, the same bytes as before: header,
    tokens, then `state()`'s keys and values."""
    m = load(paths["gemma3"], bounded=False)
    s = m.new_session()
    s.sync(ids(30, 16))
    assert s.save_payload() == full_form_payload(s)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_damaged_compact_payload_is_refused_and_changes_nothing(paths, arch):
    m = load(paths[arch])
    a, b = ids(30, 17), ids(9, 18)
    donor = m.new_session()
    donor.sync(a)
    good = donor.save_payload()
    ring_at = 26 + 4 * len(a)  # u32 window, u32 ring layer count, then the layers
    window_off = bytearray(good)
    window_off[ring_at: ring_at + 4] = struct.pack("<I", WINDOW + 1)
    layers_off = bytearray(good)
    layers_off[ring_at + 8: ring_at + 12] = struct.pack("<I", 1)  # gemma2's and gemma3's first ring layer is 0
    cases = {
        "length does not match": [good[:-1], good[:-2 * 64], good[:ring_at + 6], good[:ring_at + 9], good + b"\0"],
        "ring": [bytes(window_off), bytes(layers_off)],
        "engine version": [good[:6] + struct.pack("<H", 3) + good[8:]],
    }
    s = m.new_session()
    s.sync(b)
    before = (list(s.tokens), s.logits.clone(), s.cache.n, s.cache.held_from(s.cache.n))
    for message, bad in cases.items():
        for data in bad:
            with pytest.raises(ValueError, match=message):
                s.load_payload(data)
            assert (s.tokens, s.cache.n, s.cache.held_from(s.cache.n)) == (before[0], before[2], before[3])
            assert torch.equal(s.logits, before[1])
    s.eval(a[0])  # the session still continues as if nothing had been offered
    assert torch.equal(s.logits, decoded(m, b, a[:1])[-1])
    # Into a cache that keeps every position the window is not enough: refused.
    full = load(paths[arch], bounded=False).new_session()
    with pytest.raises(ValueError, match="only the window"):
        full.load_payload(good)
    assert full.tokens == [] and full.cache.n == 0


def test_a_ring_cache_by_itself():
    """engine.kvcache's ring without a model: slots wrap at the ring's size, what a step
    overwrites is forgotten, a copy takes only what the other ring still holds, and the held
    state keeps the ring's last window."""
    from engine.kvcache import CacheLayout, HeldRows, KVCache, Ring

    with pytest.raises(ValueError, match="cannot serve"):
        Ring((0,), window=5, size=4)
    ring = Ring((0, 2), window=3, size=5)
    lay = CacheLayout.keys_values(1, 2, ring)
    # One float32 layer at one position: 2 parts x 1 head x 2 values x 4 bytes = 16.
    assert (ring.step, lay.bytes_per_token(3, torch.float32)) == (3, 16)
    assert lay.bytes_at(3, 100, torch.float32) == 100 * 16 + 2 * 5 * 16
    c = KVCache(3, 1, 2, 64, torch.float32, torch.device("cpu"), initial=4, ring=ring)
    for start in range(0, 12, 3):  # positions 0..11, three at a time, value = position
        c.will_write(start, start + 3)
        rows = torch.arange(start, start + 3, dtype=torch.float32).view(1, 1, 3, 1).expand(2, 1, 3, 2)
        for li in range(3):
            c.store(li, start, rows)
        c.n = start + 3
    assert c.ring_capacity == 5 and c.capacity == 16 and c.held_from(12) == 7
    assert c.positions(0, 7, 12)[0, 0, :, 0].tolist() == [7, 8, 9, 10, 11]  # wraps inside the range
    assert c.positions(1, 0, 12)[0, 0, :, 0].tolist() == list(range(12))
    assert (c.reusable(12), c.reusable(9), c.reusable(8), c.reusable(0)) == (12, 9, 0, 0)
    with pytest.raises(ValueError, match="overruns"):
        c.will_write(12, 16)
    other = KVCache(3, 1, 2, 64, torch.float32, torch.device("cpu"), initial=4, ring=ring)
    other.copy_prefix(c, 10)
    assert other.held_from(10) == 7 and other.positions(2, 7, 10)[1, 0, :, 1].tolist() == [7, 8, 9]
    state = c.state()[0]
    assert state[0, 0, :7].abs().sum() == 0 and state[0, 0, 7:, 0].tolist() == [7, 8, 9, 10, 11]
    other.restore(*c.state())
    assert other.n == 12 and other.held_from(12) == 9 and other.reusable(11) == 11 and other.reusable(10) == 0
    # The compact form: every position of layer 1, the last `window` of the ring's layers 0 and 2.
    held = c.held_state()
    assert [tuple(p.shape) for p in held.full + held.ring] == [(1, 1, 12, 2)] * 2 + [(2, 1, 3, 2)] * 2
    assert held.ring[1][:, 0, :, 0].tolist() == [[9, 10, 11]] * 2
    assert held.full[0][0, 0, :, 1].tolist() == list(range(12))
    assert lay.held_bytes(3, 12, torch.float32) == (12 + 2 * 3) * 16
    fresh = KVCache(3, 1, 2, 64, torch.float32, torch.device("cpu"), initial=4, ring=ring)
    fresh.restore_held(held)
    assert fresh.n == 12 and fresh.held_from(12) == 9 and fresh.reusable(11) == 11 and fresh.reusable(10) == 0
    assert all(torch.equal(fresh.positions(li, 9, 12), c.positions(li, 9, 12)) for li in range(3))
    assert torch.equal(fresh.positions(1, 0, 12), c.positions(1, 0, 12))
    # A held state of another shape is refused before anything changes.
    with pytest.raises(ValueError, match="do not fit"):
        fresh.restore_held(HeldRows(12, held.full, tuple(p[:, :, 1:] for p in held.ring)))
    assert fresh.n == 12 and torch.equal(fresh.positions(0, 9, 12), c.positions(0, 9, 12))
    # A ring that lost its last window (a truncation nobody recomputed) is not saved as zeros.
    c.n = 8
    with pytest.raises(RuntimeError, match="no longer holds"):
        c.held_state()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ring_agrees_with_the_full_cache(paths, arch):
    """On CUDA a prefill chunk attends in one masked batch and runs in ring-sized pieces."""
    text = ids(60, 13)
    runs = []
    for bounded in (True, False):
        m = engine.load_model(paths[arch], device="cuda", weights="float32", kv_type="f32")
        m.net.bounded_cache = bounded
        runs.append(decoded(m, text[:30], text[30:]).float().cpu())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-4, atol=1e-4 * float(runs[1].abs().max()))
