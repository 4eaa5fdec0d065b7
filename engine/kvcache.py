"""Per-session key/value cache.

Keys and values of every layer live in two tensors of shape
[n_layer, n_head_kv, capacity, head_dim].  Capacity grows by doubling (up to the context
size) so that short sessions do not pay for the whole context; `n` is how many positions
are valid.  The forward pass writes positions [start, start + T) and reads [0, start + T).
It does not know which tokens the positions hold (the session does).
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 dtype: torch.dtype, device: torch.device, initial: int = 256):
        self.n_ctx = n_ctx
        self.n = 0
        shape = (n_layer, n_head_kv, min(initial, n_ctx), head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._split()

    def _split(self) -> None:
        # Per-layer views, made once per allocation: indexing a layer on every step is
        # measurable dispatch overhead when a token costs ~10 ms.
        self.layer_k = list(self.k.unbind(0))
        self.layer_v = list(self.v.unbind(0))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        if n > self.n_ctx:
            raise ValueError(f"context overflow: {n} positions > context size {self.n_ctx}")
        if n <= self.capacity:
            return
        cap = self.capacity
        while cap < n:
            cap = min(cap * 2, self.n_ctx)
        for name in ("k", "v"):
            old = getattr(self, name)
            # Positions past `n` are written before they are read, so the new tail needs no zeroing.
            new = old.new_empty(old.shape[0], old.shape[1], cap, old.shape[3])
            new[:, :, : self.n] = old[:, :, : self.n]
            setattr(self, name, new)
        self._split()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Valid keys and values, [n_layer, n_head_kv, n, head_dim] each (copies, on CPU)."""
        return self.k[:, :, : self.n].cpu().clone(), self.v[:, :, : self.n].cpu().clone()

    def restore(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape != v.shape or k.shape[0:2] != self.k.shape[0:2] or k.shape[3] != self.k.shape[3]:
            raise ValueError(f"KV shape {tuple(k.shape)} does not fit this model's cache {tuple(self.k.shape)}")
        n = k.shape[2]
        self.n = 0
        self.reserve(n)
        self.k[:, :, :n] = k.to(self.k)
        self.v[:, :, :n] = v.to(self.v)
        self.n = n
