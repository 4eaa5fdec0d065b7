"""What every family's network computes the same way: its caches and its memory accounting.

`CachedNetwork` gives a family module (engine/models/<family>.py) the parts of the
engine.protocols.Network contract that follow from the shape alone: `new_cache`, `new_pool`,
`kv_bytes_per_token` (keys and values of every layer at one position), `weight_bytes` (blocks,
embedding, final norm and a separate output head) and `kernel_path`. A family sets `cfg`,
`device`, `cpu_kernels`, `blocks` (each with `nbytes`), `embed`, `out_norm`, `output` and
`head_is_table` in its constructor. It holds no forward pass and no family's tensor names.
"""
from __future__ import annotations

import torch

from engine.kvcache import KVCache, KVPool


class CachedNetwork:
    @property
    def kernel_path(self) -> str:
        """Which CPU kernels run and why (engine.kernels), or the device, for banners."""
        return self.cpu_kernels.describe() if self.cpu_kernels is not None else self.device.type

    @property
    def weight_bytes(self) -> int:
        out = 0 if self.head_is_table else self.output.nbytes
        return sum(b.nbytes for b in self.blocks) + self.embed.nbytes + self.out_norm.nbytes + out

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V that one cached position holds in every layer."""
        cfg = self.cfg
        return 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()

    def new_cache(self, n_ctx: int, dtype: torch.dtype) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, n_ctx, dtype, self.device)

    def new_pool(self, n_slots: int, n_ctx: int, dtype: torch.dtype) -> KVPool:
        cfg = self.cfg
        return KVPool(cfg.n_layer, n_slots, cfg.n_head_kv, cfg.head_dim, n_ctx, dtype, self.device)
