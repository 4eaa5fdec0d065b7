"""KVCache and KVPool (engine.kvcache): what a reallocation keeps, and in which mode memory is made."""
from __future__ import annotations

import torch

from engine.kvcache import KVCache, KVPool


def _cache(n_ctx: int = 1024) -> KVCache:
    c = KVCache(n_layer=2, n_head_kv=2, head_dim=4, n_ctx=n_ctx, dtype=torch.float32,
                device=torch.device("cpu"), initial=16)
    c.kv.copy_(torch.arange(c.kv.numel(), dtype=torch.float32).view_as(c.kv))
    return c


def test_growth_keeps_the_valid_positions():
    c = _cache()
    c.n = 10
    before = c.kv[:, :, :, :10].clone()
    c.reserve(17)
    assert c.capacity >= 17
    assert torch.equal(c.kv[:, :, :, :10], before)
    assert c.layer_k[1].data_ptr() == c.kv[1, 0].data_ptr()  # the per-layer views follow the new tensor


def test_growth_keeps_positions_written_past_the_frontier():
    c = _cache()
    c.n = 10
    ahead = c.kv[:, :, :, :12].clone()  # positions 10 and 11 hold keys of steps launched ahead
    c.reserve(40, written=12)
    assert torch.equal(c.kv[:, :, :, :12], ahead)
    assert c.n == 10  # the valid length is the caller's to change


def test_written_below_the_valid_length_still_keeps_every_valid_position():
    c = _cache()
    c.n = 14
    before = c.kv[:, :, :, :14].clone()
    c.reserve(20, written=3)
    assert torch.equal(c.kv[:, :, :, :14], before)


def test_no_growth_within_capacity_leaves_the_tensor_alone():
    c = _cache()
    ptr = c.kv.data_ptr()
    c.reserve(16, written=16)
    assert c.kv.data_ptr() == ptr


def test_memory_grown_inside_inference_mode_is_ordinary_and_takes_writes_outside_it():
    """Forward passes grow caches inside inference mode; restores write outside it. Inference
    tensors refuse such writes, so cache memory must never be one (see engine.kvcache)."""
    c = _cache()
    with torch.inference_mode():
        c.reserve(100)
    assert not c.kv.is_inference() and not c.layer_k[0].is_inference()
    c.restore(torch.ones(2, 2, 50, 4), torch.ones(2, 2, 50, 4))
    c.layer_kv[1][:, :, 60] = 2.0  # the per-layer views too
    assert c.n == 50 and torch.equal(c.k[:, :, :50], torch.ones(2, 2, 50, 4))


def test_a_pool_grown_inside_inference_mode_is_ordinary_and_its_slots_follow_it():
    pool = KVPool(n_layer=2, n_slots=2, n_head_kv=2, head_dim=4, n_ctx=256, dtype=torch.float32,
                  device=torch.device("cpu"), initial=16)
    pool.caches[1].restore(torch.ones(2, 2, 10, 4), torch.ones(2, 2, 10, 4))
    with torch.inference_mode():
        pool.caches[0].reserve(40)
    assert not pool.kv.is_inference() and not pool.caches[1].kv.is_inference()
    assert pool.caches[1].kv.data_ptr() == pool.kv[:, :, 1].data_ptr()
    assert torch.equal(pool.caches[1].k[:, :, :10], torch.ones(2, 2, 10, 4))  # kept across the growth
    pool.caches[0].copy_prefix(pool.caches[1], 10)
    assert torch.equal(pool.caches[0].v[:, :, :10], torch.ones(2, 2, 10, 4))
