"""Key/value caches: one per session, or a pool of slots for batched decoding.

A cache holds what attention keeps of every layer at every position in one tensor `kv` of
shape [n_layer, parts, heads, capacity, width].  The family declares that row layout
(`CacheLayout`, from its network's `cache_layout()`): the usual one is keys and values,
parts=2 (index 0 is K, 1 is V), heads=n_head_kv, width=head_dim, so a decoding step writes
one token's K and V of a layer with a single copy; multi-head latent attention
(engine.models.deepseek2) keeps one part of one row per position, the compressed latent and
the rotated key part side by side.  `k` and `v` name the parts of a key/value layout; code
that does not care what a row holds (growth, prefix copies, save and restore) handles every
part alike.  `n` is how many positions are valid; the forward pass writes positions
[start, start + T) and reads [0, start + T).

Capacity grows by doubling up to the context size, so short sessions do not pay for the
whole context.  A standalone cache owns its tensor.  A `KVPool` owns one tensor of shape
[n_layer, 2, n_slots, n_head_kv, capacity, head_dim] and hands out one cache per slot whose
`kv` is a view into it; the pool grows all slots together.  Batched decoding over slots of
one pool writes every row's new K and V of a layer with one indexed copy (`row_index`)
instead of one copy per row; on CUDA the rows also attend in one batch, reading keys past a
shorter row's end (masked), which is why pool memory is zero-filled.

Cache memory is always an ordinary tensor, never an inference tensor, and so are the views
kept of it, whichever mode the allocation runs in (`_ordinary`).  The forward passes run in
`torch.inference_mode` and grow caches there; restoring a disk checkpoint or copying a prefix
writes outside it.  PyTorch refuses an in-place write to an inference tensor outside inference
mode, so a cache allocated by a forward pass used to refuse the next restore; an ordinary
tensor takes writes in either mode.

It does not know which tokens the positions hold (the session does).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(frozen=True)
class CacheLayout:
    """What one layer caches at one position: `parts` tensors of `heads` rows of `width` values."""

    parts: int  # 2: keys and values; 1: one row holding everything (a latent)
    heads: int
    width: int

    @classmethod
    def keys_values(cls, n_head_kv: int, head_dim: int) -> "CacheLayout":
        return cls(2, n_head_kv, head_dim)

    def bytes_per_token(self, n_layer: int, dtype: torch.dtype) -> int:
        """Bytes one cached position takes in every layer."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return n_layer * self.parts * self.heads * self.width * elem


@contextmanager
def _ordinary() -> Iterator[None]:
    """Allocate (and make views) as ordinary tensors even inside inference mode: see the
    module docstring."""
    with torch.inference_mode(False):
        yield


class KVCache:
    """`n_head_kv` and `head_dim` are a layout's `heads` and `width`; `parts` its part count."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 dtype: torch.dtype, device: torch.device, initial: int = 256,
                 pool: "KVPool | None" = None, slot: int = 0, parts: int = 2):
        self.n_ctx = n_ctx
        self.n = 0
        self.pool = pool
        self.slot = slot
        self.layout = CacheLayout(parts, n_head_kv, head_dim)
        with _ordinary():
            if pool is None:
                self._attach(torch.zeros((n_layer, parts, n_head_kv, min(initial, n_ctx), head_dim),
                                         dtype=dtype, device=device))
            else:
                self.attach_slot(pool.kv)

    def attach_slot(self, pool_kv: torch.Tensor) -> None:
        """Hold this cache's slot of a pool's (new) tensor; the pool calls it when it grows."""
        with _ordinary():
            self._attach(pool_kv[:, :, self.slot])

    def _attach(self, kv: torch.Tensor) -> None:
        self.kv = kv
        with _ordinary():
            # Per-layer views, made once per allocation: indexing a layer on every step is
            # measurable dispatch overhead when a token costs ~10 ms.
            self.layer_kv = list(kv.unbind(0))
            self.layer_k = [t[0] for t in self.layer_kv]
            # A one-part layout has no values apart from its rows.
            self.layer_v = [t[1] for t in self.layer_kv] if kv.shape[1] > 1 else self.layer_k

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        if self.kv.shape[1] < 2:
            raise AttributeError("a one-part cache layout holds no separate values")
        return self.kv[:, 1]

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def reserve(self, n: int, written: int | None = None) -> None:
        """Room for n positions.  A reallocation keeps the first `written` positions: by default
        the valid ones (`self.n`); more where steps launched ahead of the frontier already
        stored keys past it (engine.session's run-ahead)."""
        if not _must_grow(n, self.capacity, self.n_ctx):
            return
        if self.pool is not None:
            self.pool.reserve(n)
            return
        old = self.kv
        keep = min(self.n if written is None else max(self.n, written), old.shape[3])
        with _ordinary():
            # Positions past `keep` are written before they are read, so the new tail needs no zeroing.
            new = old.new_empty(*old.shape[:3], _grown(old.shape[3], n, self.n_ctx), old.shape[4])
            new[:, :, :, :keep] = old[:, :, :, :keep]
            self._attach(new)

    @property
    def nbytes(self) -> int:
        """Bytes of this cache's own memory (a pooled slot's share of its pool)."""
        return self.kv.numel() * self.kv.element_size()

    def state(self) -> tuple[torch.Tensor, ...]:
        """The valid positions of each part, [n_layer, heads, n, width] each (copies, on CPU):
        keys and values, or a one-part layout's rows."""
        return tuple(self.kv[:, i, :, : self.n].cpu().clone() for i in range(self.kv.shape[1]))

    def copy_prefix(self, other: "KVCache", n: int) -> None:
        """Hold the first n positions of `other`, a cache of the same shape and dtype (copied on
        its device, no host round trip)."""
        mine, theirs = self.kv.shape, other.kv.shape
        if theirs[0:3] != mine[0:3] or theirs[4] != mine[4] or other.kv.dtype != self.kv.dtype:
            raise ValueError("the caches differ in shape or dtype")
        if not 0 <= n <= other.n:
            raise ValueError(f"cannot copy {n} positions of a cache that holds {other.n}")
        self.n = 0
        self.reserve(n)
        self.kv[:, :, :, :n] = other.kv[:, :, :, :n]
        self.n = n

    def restore(self, *parts: torch.Tensor) -> None:
        """Hold the positions `parts` give (what `state` returns: one tensor per part)."""
        shape = self.k.shape
        if len(parts) != self.kv.shape[1] or any(p.shape != parts[0].shape for p in parts) \
                or parts[0].shape[0:2] != shape[0:2] or parts[0].shape[3] != shape[3]:
            got = tuple(parts[0].shape) if parts else ()
            raise ValueError(f"KV shape {got} does not fit this model's cache {tuple(shape)}")
        n = parts[0].shape[2]
        self.n = 0
        self.reserve(n)
        for i, p in enumerate(parts):
            self.kv[:, i, :, :n] = p.to(self.kv)
        self.n = n


def _must_grow(n: int, capacity: int, n_ctx: int) -> bool:
    if n > n_ctx:
        raise ValueError(f"context overflow: {n} positions > context size {n_ctx}")
    return n > capacity


def _grown(cap: int, n: int, n_ctx: int) -> int:
    while cap < n:
        cap = min(cap * 2, n_ctx)
    return cap


class KVPool:
    """`n_slots` caches in one tensor; `caches[i]` is slot i's cache (same layout arguments)."""

    def __init__(self, n_layer: int, n_slots: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 dtype: torch.dtype, device: torch.device, initial: int = 256, parts: int = 2):
        self.n_ctx = n_ctx
        with _ordinary():
            self.kv = torch.zeros((n_layer, parts, n_slots, n_head_kv, min(initial, n_ctx), head_dim),
                                  dtype=dtype, device=device)
            self._split()
        self.caches = [KVCache(n_layer, n_head_kv, head_dim, n_ctx, dtype, device, pool=self, slot=i, parts=parts)
                       for i in range(n_slots)]

    def _split(self) -> None:
        self.layer_kv = list(self.kv.unbind(0))  # [parts, n_slots, heads, capacity, width] each
        self.layer_rows = [t.view(-1, t.shape[-1]) for t in self.layer_kv]  # one row per (part, slot, head, pos)

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def reserve(self, n: int) -> None:
        if not _must_grow(n, self.capacity, self.n_ctx):
            return
        old = self.kv
        with _ordinary():
            # Zero-filled: batched attention on CUDA reads (and masks out) positions past a shorter
            # row's end, and masked values must still be finite.
            new = old.new_zeros(*old.shape[:4], _grown(old.shape[4], n, self.n_ctx), old.shape[5])
            new[..., : old.shape[4], :] = old
            self.kv = new
            self._split()
            for c in self.caches:
                c.attach_slot(new)

    def row_index(self, slots: list[int], positions: list[int]) -> torch.Tensor:
        """Indices into `layer_rows[l]` of (each part: K then V) x (each slot's heads) at each
        slot's position, in the order of a [rows, parts, heads] block of new keys and values."""
        _, parts, n_slots, n_head_kv, cap, _ = self.kv.shape
        s = torch.tensor(slots).view(-1, 1, 1)
        p = torch.tensor(positions).view(-1, 1, 1)
        c = torch.arange(parts).view(1, parts, 1)
        h = torch.arange(n_head_kv).view(1, 1, -1)
        return (((c * n_slots + s) * n_head_kv + h) * cap + p).reshape(-1).to(self.kv.device)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
