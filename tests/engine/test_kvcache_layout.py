"""Cache row layouts (engine.kvcache.CacheLayout): a one-part cache, as multi-head latent
attention uses, grows, copies, saves and restores its rows like a key/value cache does its
keys and values, and a pool's row indices follow the part count."""
from __future__ import annotations

import pytest
import torch

from engine.kvcache import CacheLayout, KVCache, KVPool

CPU = torch.device("cpu")


def _latent(n_ctx: int = 1024) -> KVCache:
    c = KVCache(n_layer=2, n_head_kv=1, head_dim=6, n_ctx=n_ctx, dtype=torch.float32, device=CPU, initial=8, parts=1)
    c.kv.copy_(torch.arange(c.kv.numel(), dtype=torch.float32).view_as(c.kv))
    return c


def test_bytes_per_token_follow_the_layout():
    assert CacheLayout.keys_values(4, 64).bytes_per_token(3, torch.float16) == 2 * 3 * 4 * 64 * 2
    assert CacheLayout(1, 1, 576).bytes_per_token(27, torch.float16) == 27 * 576 * 2


def test_a_one_part_cache_grows_keeping_its_rows():
    c = _latent()
    assert c.kv.shape == (2, 1, 1, 8, 6) and c.layout == CacheLayout(1, 1, 6)
    c.n = 7
    before = c.kv[:, :, :, :7].clone()
    c.reserve(20)
    assert c.capacity >= 20 and torch.equal(c.kv[:, :, :, :7], before)
    assert c.layer_k[1].data_ptr() == c.kv[1, 0].data_ptr()
    with pytest.raises(AttributeError):
        c.v


def test_state_restore_and_prefix_copies_take_one_part():
    c = _latent()
    c.n = 5
    (rows,) = c.state()
    assert rows.shape == (2, 1, 5, 6)
    other = _latent()
    other.kv.zero_()
    other.restore(rows)
    assert other.n == 5 and torch.equal(other.kv[:, :, :, :5], c.kv[:, :, :, :5])
    with pytest.raises(ValueError, match="does not fit"):
        other.restore(rows, rows)  # a key/value pair for a one-part cache
    third = _latent()
    third.copy_prefix(c, 3)
    assert third.n == 3 and torch.equal(third.kv[:, :, :, :3], c.kv[:, :, :, :3])
    kv = KVCache(n_layer=2, n_head_kv=1, head_dim=6, n_ctx=64, dtype=torch.float32, device=CPU, initial=8)
    with pytest.raises(ValueError, match="differ"):
        kv.copy_prefix(c, 3)


def test_a_one_part_pool_indexes_one_row_per_slot_and_position():
    pool = KVPool(n_layer=2, n_slots=3, n_head_kv=1, head_dim=6, n_ctx=64, dtype=torch.float32, device=CPU,
                  initial=8, parts=1)
    assert pool.kv.shape == (2, 1, 3, 1, 8, 6)
    where = pool.row_index([2, 0], [5, 1])
    new = torch.tensor([[1.0] * 6, [2.0] * 6])
    pool.layer_rows[1].index_copy_(0, where, new)
    assert torch.equal(pool.caches[2].layer_k[1][0, 5], new[0])
    assert torch.equal(pool.caches[0].layer_k[1][0, 1], new[1])
    pool.caches[1].reserve(30)  # the pool grows; its slots follow
    assert pool.caches[2].kv.data_ptr() == pool.kv[:, :, 2].data_ptr()
    assert torch.equal(pool.caches[2].layer_k[1][0, 5], new[0])
