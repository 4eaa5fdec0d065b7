"""What every family's network computes the same way: its caches and its memory accounting.

`CachedNetwork` gives a family module (engine/models/<family>.py) the parts of the
engine.protocols.Network contract that follow from the shape alone: `cache_layout` (what one
layer caches per position: keys and values of every kv head by default; a family that caches
something else, like engine.models.deepseek2's latent, overrides it), `new_cache`, `new_pool`,
`kv_bytes_per_token` (the layout's bytes in every layer at one position, but for the layers a
ring bounds to a window), `kv_bytes` (one cache's bytes at a context size), `weight_bytes`
(blocks, embedding, final norm and a separate output head), `kernel_path` and `decode_started`
(the family's `decode`, finished before it returns). A family sets
`cfg`, `device`, `cpu_kernels`, `blocks` (each with `nbytes`), `embed`, `out_norm`, `output`
and `head_is_table` in its constructor. It holds no forward pass and no family's tensor names.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from engine.kvcache import CacheLayout, KVCache, KVPool


class CachedNetwork:
    def decode_started(self, tokens: list[int], caches: list[KVCache],
                       eos_ids: frozenset[int] = frozenset()) -> Callable[[], Any]:
        """`decode`, already done when this returns (a family whose steps the device runs on its
        own overrides it to return at once)."""
        step = self.decode(tokens, caches, eos_ids)
        return lambda: step

    @property
    def kernel_path(self) -> str:
        """Which CPU kernels run and why (engine.kernels), or the device, for banners."""
        return self.cpu_kernels.describe() if self.cpu_kernels is not None else self.device.type

    @property
    def weight_bytes(self) -> int:
        out = 0 if self.head_is_table else self.output.nbytes
        return sum(b.nbytes for b in self.blocks) + self.embed.nbytes + self.out_norm.nbytes + out

    def cache_layout(self) -> CacheLayout:
        """What one layer caches at one position: here K and V of every kv head."""
        return CacheLayout.keys_values(self.cfg.n_head_kv, self.cfg.head_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes that one cached position holds in every layer (for K and V:
        2 * n_layer * n_head_kv * head_dim * element size)."""
        return self.cache_layout().bytes_per_token(self.cfg.n_layer, dtype)

    def kv_bytes(self, ctx: int, dtype: torch.dtype) -> int:
        """Bytes one cache of `ctx` positions holds: `ctx * kv_bytes_per_token`, plus a ring's
        bounded layers at most its size each (engine.kvcache.CacheLayout.bytes_at)."""
        return self.cache_layout().bytes_at(self.cfg.n_layer, ctx, dtype)

    def new_cache(self, n_ctx: int, dtype: torch.dtype) -> KVCache:
        lay = self.cache_layout()
        return KVCache(self.cfg.n_layer, lay.heads, lay.width, n_ctx, dtype, self.device, parts=lay.parts,
                       ring=lay.ring)

    def new_pool(self, n_slots: int, n_ctx: int, dtype: torch.dtype) -> KVPool:
        lay = self.cache_layout()
        return KVPool(self.cfg.n_layer, n_slots, lay.heads, lay.width, n_ctx, dtype, self.device, parts=lay.parts,
                      ring=lay.ring)
