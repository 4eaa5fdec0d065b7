"""Key/value caches: one per session, or a pool of slots for batched decoding.

A cache holds what attention keeps of every layer at every position.  The family declares that
row layout (`CacheLayout`, from its network's `cache_layout()`): the usual one is keys and
values, parts=2 (index 0 is K, 1 is V), heads=n_head_kv, width=head_dim, so a decoding step
writes one token's K and V of a layer with a single copy; multi-head latent attention
(engine.models.deepseek2) keeps one part of one row per position, the compressed latent and
the rotated key part side by side.  `k` and `v` name the parts of a key/value layout; code
that does not care what a row holds (growth, prefix copies, save and restore) handles every
part alike.  `n` is how many positions are valid; the forward pass writes positions
[start, start + T) and reads [0, start + T).

Layers that keep every position live in one tensor `kv` of shape
[layers, parts, heads, capacity, width].  A layout may also name a `Ring`: layers whose queries
see only the last `window` positions (Gemma's local layers) keep only the last `size` of them,
position p in slot p % size of a second tensor `ring_kv`, so their memory stops growing at
`size` positions.  `layer_kv[i]` is layer i's view in whichever tensor holds it; `store` and
`positions` address a layer by position for both kinds.  A ring forgets: `held_from(n)` is
the first position whose entries every ring layer still holds, and `reusable(n)` says whether
the cache can continue at n (it needs the `window - 1` positions before n): n, or 0 when the
ring has overwritten some of them, in which case the caller recomputes from the start
(engine.session does, for prefix reuse and truncation).  Forward passes announce each step
with `will_write(start, end)`, which grows the cache and forgets the ring positions the step
overwrites, even if it is cancelled half-way.  Bytes: `CacheLayout.bytes_at`.

Saving and restoring: `held_state()` copies what continuing at n, or at n - 1, reads (a
`HeldRows`): every position of the layers that keep them all, the last min(n, window) of a
ring's layers, `CacheLayout.held_bytes` in all; `restore_held` takes it back.  `state()` and
`restore()` are the older full form, n positions of every layer (a ring's forgotten ones zeros),
kept for payloads written in it.

Capacity grows by doubling up to the context size (a ring's up to its size), so short sessions
do not pay for the whole context.  A standalone cache owns its tensors.  A `KVPool` owns
tensors of shape [layers, parts, n_slots, heads, capacity, width] and hands out one cache per
slot whose tensors are views into them; the pool grows all slots together.  Batched decoding
over slots of one pool writes every row's new K and V of a layer with one indexed copy
(`row_index`, for layouts without a ring) instead of one copy per row; on CUDA the rows also
attend in one batch, reading keys past a shorter row's end (masked), which is why pool memory
is zero-filled.

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
class Ring:
    """Layers whose queries see only the last `window` positions (their own included), each
    keeping only the last `size` positions: position p in slot p % size."""

    layers: tuple[int, ...]
    window: int
    size: int

    def __post_init__(self) -> None:
        if not 1 <= self.window <= self.size:
            raise ValueError(f"a ring of {self.size} slots cannot serve a window of {self.window}")

    @property
    def step(self) -> int:
        """The most positions one forward step may store: its first query still finds the
        `window - 1` positions before it in the ring."""
        return self.size - self.window + 1


@dataclass(frozen=True)
class CacheLayout:
    """What one layer caches at one position: `parts` tensors of `heads` rows of `width` values;
    `ring`, where set, names the layers bounded to a window."""

    parts: int  # 2: keys and values; 1: one row holding everything (a latent)
    heads: int
    width: int
    ring: Ring | None = None

    @classmethod
    def keys_values(cls, n_head_kv: int, head_dim: int, ring: Ring | None = None) -> "CacheLayout":
        return cls(2, n_head_kv, head_dim, ring)

    def layer_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one layer keeps of one position."""
        return self.parts * self.heads * self.width * torch.tensor([], dtype=dtype).element_size()

    @property
    def n_ring(self) -> int:
        return 0 if self.ring is None else len(self.ring.layers)

    def bytes_per_token(self, n_layer: int, dtype: torch.dtype) -> int:
        """Bytes one more cached position adds: every layer's, except a ring's layers."""
        return (n_layer - self.n_ring) * self.layer_bytes(dtype)

    def bytes_at(self, n_layer: int, n: int, dtype: torch.dtype) -> int:
        """Bytes a cache of n positions holds: n per layer that keeps every position, plus at
        most the ring's size per ring layer."""
        ring = 0 if self.ring is None else self.n_ring * min(n, self.ring.size) * self.layer_bytes(dtype)
        return n * self.bytes_per_token(n_layer, dtype) + ring

    def held_positions(self, n: int) -> int:
        """Positions a ring layer of a cache of n positions saves: the last `window`, all that
        continuing at n, or at n - 1, reads (n for a layout without a ring)."""
        return n if self.ring is None else min(n, self.ring.window)

    def held_bytes(self, n_layer: int, n: int, dtype: torch.dtype) -> int:
        """Bytes `KVCache.held_state` copies of a cache of n positions: n per layer that keeps
        every position, plus `held_positions(n)` per ring layer."""
        return (n * (n_layer - self.n_ring) + self.held_positions(n) * self.n_ring) * self.layer_bytes(dtype)

    def homes(self, n_layer: int) -> list[tuple[bool, int]]:
        """For each layer: (whether the ring holds it, its index in that tensor)."""
        ring = set(() if self.ring is None else self.ring.layers)
        counts = [0, 0]
        out = []
        for li in range(n_layer):
            r = li in ring
            out.append((r, counts[r]))
            counts[r] += 1
        return out


@dataclass(frozen=True)
class HeldRows:
    """What a cache of `n` positions holds that continuing at n, or at n - 1, reads, per part
    (keys, values; or one latent part): `full[i]` the layers that keep every position, in layer
    order, [layers, heads, n, width]; `ring[i]` the ring's layers, in layer order, their last
    `CacheLayout.held_positions(n)` positions [ring layers, heads, m, width] (empty without a
    ring).  Copies on the CPU."""

    n: int
    full: tuple[torch.Tensor, ...]
    ring: tuple[torch.Tensor, ...] = ()


@contextmanager
def _ordinary() -> Iterator[None]:
    """Allocate (and make views) as ordinary tensors even inside inference mode: see the
    module docstring."""
    with torch.inference_mode(False):
        yield


class KVCache:
    """`n_head_kv` and `head_dim` are a layout's `heads` and `width`; `parts` its part count;
    `ring` its bounded layers."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 dtype: torch.dtype, device: torch.device, initial: int = 256,
                 pool: "KVPool | None" = None, slot: int = 0, parts: int = 2, ring: Ring | None = None):
        self.n_ctx = n_ctx
        self.n = 0
        self.pool = pool
        self.slot = slot
        self.n_layer = n_layer
        self.layout = CacheLayout(parts, n_head_kv, head_dim, ring)
        self._homes = self.layout.homes(n_layer)
        self._ring_lo = 0  # every ring layer holds the positions [_ring_lo, n) (see held_from)
        with _ordinary():
            if pool is None:
                n_ring = self.layout.n_ring
                cap = min(initial, n_ctx)
                shape = (parts, n_head_kv, cap, head_dim)
                ring_kv = None if ring is None else \
                    torch.zeros((n_ring, *shape[:2], min(cap, ring.size), head_dim), dtype=dtype, device=device)
                self._attach(torch.zeros((n_layer - n_ring, *shape), dtype=dtype, device=device), ring_kv)
            else:
                self.attach_slot(pool.kv, pool.ring_kv)

    def attach_slot(self, pool_kv: torch.Tensor, pool_ring: torch.Tensor | None = None) -> None:
        """Hold this cache's slot of a pool's (new) tensors; the pool calls it when it grows."""
        with _ordinary():
            self._attach(pool_kv[:, :, self.slot], None if pool_ring is None else pool_ring[:, :, self.slot])

    def _attach(self, kv: torch.Tensor, ring_kv: torch.Tensor | None = None) -> None:
        self.kv = kv
        self.ring_kv = ring_kv
        with _ordinary():
            # Per-layer views, made once per allocation: indexing a layer on every step is
            # measurable dispatch overhead when a token costs ~10 ms.
            stacks = (list(kv.unbind(0)), [] if ring_kv is None else list(ring_kv.unbind(0)))
            self.layer_kv = [stacks[r][i] for r, i in self._homes]
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

    @property
    def ring_capacity(self) -> int:
        """Slots each ring layer has now (0 without a ring); it wraps only once at the ring's size."""
        return 0 if self.ring_kv is None else self.ring_kv.shape[3]

    def reserve(self, n: int, written: int | None = None) -> None:
        """Room for n positions.  A reallocation keeps the first `written` positions: by default
        the valid ones (`self.n`); more where steps launched ahead of the frontier already
        stored keys past it (engine.session's run-ahead)."""
        if not _must_grow(n, self.capacity, self.n_ctx, self.ring_capacity, self.layout.ring):
            return
        if self.pool is not None:
            self.pool.reserve(n)
            return
        keep = self.n if written is None else max(self.n, written)
        with _ordinary():
            kv = _regrown(self.kv, 3, _grown(self.capacity, n, self.n_ctx), keep, zero=False)
            ring_kv = None if self.ring_kv is None else \
                _regrown(self.ring_kv, 3, _ring_grown(self.ring_capacity, n, self.n_ctx, self.layout.ring), keep,
                         zero=False)
            self._attach(kv, ring_kv)

    # --- positions, for layouts with a ring (and without) ---

    def will_write(self, start: int, end: int) -> None:
        """Positions [start, end) are about to be stored in every layer: grow, and forget the
        ring positions they overwrite.  Refuses a step larger than the ring can take and a
        start the ring no longer holds the window for (that would be silently wrong)."""
        self.reserve(end)
        ring = self.layout.ring
        if ring is None:
            return
        if end - start > ring.step:
            raise ValueError(f"a step of {end - start} positions overruns a ring of {ring.size} slots")
        if self.reusable(start) != start:
            raise RuntimeError(f"the ring no longer holds the window before position {start}")
        self._ring_lo = max(min(self._ring_lo, start), end - ring.size)

    def store(self, layer: int, start: int, rows: torch.Tensor) -> None:
        """Store rows [parts, heads, T, width] of `layer` at positions [start, start + T)."""
        t, (ringed, _) = self.layer_kv[layer], self._homes[layer]
        T = rows.shape[2]
        if not ringed:
            t[:, :, start: start + T] = rows
            return
        cap = self.ring_capacity
        a = start % cap
        first = min(T, cap - a)
        t[:, :, a: a + first] = rows[:, :, :first]
        if first < T:  # wrapped: the rest from slot 0
            t[:, :, : T - first] = rows[:, :, first:]

    def positions(self, layer: int, lo: int, end: int) -> torch.Tensor:
        """`layer`'s rows at positions [lo, end), [parts, heads, end - lo, width], in position
        order: a view, or a copy where a ring wraps inside the range."""
        t, (ringed, _) = self.layer_kv[layer], self._homes[layer]
        if not ringed:
            return t[:, :, lo:end]
        cap = self.ring_capacity
        a, b = lo % cap, lo % cap + (end - lo)
        return t[:, :, a:b] if b <= cap else torch.cat([t[:, :, a:], t[:, :, : b - cap]], dim=2)

    def held_from(self, n: int) -> int:
        """The first position p such that every layer holds all of [p, n) (0 without a ring)."""
        return 0 if self.layout.ring is None else min(self._ring_lo, n)

    def reusable(self, n: int) -> int:
        """n where the cache can continue at n (n <= self.n): every ring layer still holds the
        `window - 1` positions before it; else 0 (recompute from the start)."""
        ring = self.layout.ring
        if ring is None or n == 0 or self.held_from(n) <= max(0, n - ring.window + 1):
            return n
        return 0

    @property
    def nbytes(self) -> int:
        """Bytes of this cache's own memory (a pooled slot's share of its pool)."""
        ring = 0 if self.ring_kv is None else self.ring_kv.numel() * self.ring_kv.element_size()
        return self.kv.numel() * self.kv.element_size() + ring

    def state(self) -> tuple[torch.Tensor, ...]:
        """The valid positions of each part, [n_layer, heads, n, width] each (copies, on CPU):
        keys and values, or a one-part layout's rows.  Positions a ring no longer holds
        (before `held_from(n)`) are zeros in its layers: the older full form, which
        `held_state` replaces for saving."""
        n, lo = self.n, self.held_from(self.n)
        if self.ring_kv is None:  # one copy per part
            return tuple(self.kv[:, i, :, :n].cpu().clone() for i in range(self.kv.shape[1]))
        out = []
        for i in range(self.kv.shape[1]):
            part = torch.zeros((self.n_layer, self.layout.heads, n, self.layout.width), dtype=self.kv.dtype)
            for li in range(self.n_layer):
                start = lo if self._homes[li][0] else 0
                part[li, :, start:] = self.positions(li, start, n)[i].cpu()
            out.append(part)
        return tuple(out)

    def held_state(self) -> HeldRows:
        """The positions `restore_held` needs (see `HeldRows`), `layout.held_bytes` in all.
        Refuses a cache whose ring no longer holds its last `window` positions (after a
        truncation: recompute first) rather than save zeros in their place."""
        n, lay = self.n, self.layout
        full = tuple(self.kv[:, i, :, :n].cpu().clone() for i in range(lay.parts))
        if lay.ring is None:
            return HeldRows(n, full)
        lo = n - lay.held_positions(n)
        if self.held_from(n) > lo:
            raise RuntimeError(f"the ring no longer holds positions {lo}..{n - 1}; recompute before saving")
        slots = torch.arange(lo, n, device=self.ring_kv.device) % self.ring_capacity
        rows = self.ring_kv.index_select(3, slots).cpu()  # [ring layers, parts, heads, m, width]
        return HeldRows(n, full, tuple(rows[:, i].clone() for i in range(lay.parts)))

    def restore_held(self, held: HeldRows) -> None:
        """Hold what `held_state` returned (of a cache of this layout); checked before anything
        changes, so a refused one leaves the cache as it was."""
        lay = self.layout
        n, m = held.n, lay.held_positions(held.n)
        want_full = (self.n_layer - lay.n_ring, lay.heads, n, lay.width)
        want_ring = (lay.n_ring, lay.heads, m, lay.width)
        if len(held.full) != lay.parts or any(tuple(p.shape) != want_full for p in held.full) \
                or len(held.ring) != (0 if lay.ring is None else lay.parts) \
                or any(tuple(p.shape) != want_ring for p in held.ring):
            raise ValueError(f"held rows of {n} positions do not fit this cache: per part {want_full}"
                             + ("" if lay.ring is None else f" and {want_ring}"))
        if n > self.n_ctx:
            raise ValueError(f"context overflow: {n} positions > context size {self.n_ctx}")
        self.n = 0
        self.reserve(n)
        for i, p in enumerate(held.full):
            self.kv[:, i, :, :n] = p.to(self.kv)
        if lay.ring is not None:
            slots = torch.arange(n - m, n, device=self.ring_kv.device) % self.ring_capacity
            self.ring_kv.index_copy_(3, slots, torch.stack(held.ring, dim=1).to(self.ring_kv))
            self._ring_lo = n - m
        self.n = n

    def copy_prefix(self, other: "KVCache", n: int) -> None:
        """Hold the first n positions of `other`, a cache of the same layout and dtype (copied on
        its device, no host round trip); a ring takes what `other`'s ring still holds of them."""
        if other.layout != self.layout or other.n_layer != self.n_layer or other.kv.dtype != self.kv.dtype:
            raise ValueError("the caches differ in shape or dtype")
        if not 0 <= n <= other.n:
            raise ValueError(f"cannot copy {n} positions of a cache that holds {other.n}")
        self.n = 0
        self.reserve(n)
        self.kv[:, :, :, :n] = other.kv[:, :, :, :n]
        if self.ring_kv is not None:
            lo = other.held_from(n)
            pos = torch.arange(lo, n, device=self.kv.device)
            rows = other.ring_kv.index_select(3, pos % other.ring_capacity)
            self.ring_kv.index_copy_(3, pos % self.ring_capacity, rows)
            self._ring_lo = lo
        self.n = n

    def restore(self, *parts: torch.Tensor) -> None:
        """Hold the positions `parts` give (what `state` returns: one tensor per part).  Ring
        layers take the last `window` positions, all that continuing at n, or at n - 1, reads."""
        lay = self.layout
        want = (self.n_layer, lay.heads, lay.width)
        if len(parts) != lay.parts or any(p.shape != parts[0].shape for p in parts) \
                or (parts[0].shape[0], parts[0].shape[1], parts[0].shape[3]) != want:
            got = tuple(parts[0].shape) if parts else ()
            raise ValueError(f"KV shape {got} does not fit this model's cache {want[:2] + ('n',) + want[2:]}")
        n = parts[0].shape[2]
        self.n = 0
        self.reserve(n)
        if lay.ring is None:  # one copy per part
            for i, p in enumerate(parts):
                self.kv[:, i, :, :n] = p.to(self.kv)
            self.n = n
            return
        lo = max(0, n - lay.ring.window)
        for li, (ringed, _) in enumerate(self._homes):
            start = lo if ringed else 0
            self.store(li, start, torch.stack([p[li, :, start:] for p in parts]).to(self.kv))
        self._ring_lo = lo
        self.n = n


def _must_grow(n: int, capacity: int, n_ctx: int, ring_capacity: int = 0, ring: Ring | None = None) -> bool:
    if n > n_ctx:
        raise ValueError(f"context overflow: {n} positions > context size {n_ctx}")
    return n > capacity or (ring is not None and ring_capacity < min(n, ring.size))


def _grown(cap: int, n: int, n_ctx: int) -> int:
    while cap < n:
        cap = min(cap * 2, n_ctx)
    return cap


def _ring_grown(cap: int, n: int, n_ctx: int, ring: Ring) -> int:
    """A ring's new capacity: grown as a layer that keeps every position, up to its size.  Below
    its size it has never wrapped (slot p holds position p), so growth keeps slots as they are."""
    return min(_grown(cap, min(n, ring.size), n_ctx), ring.size)


def _regrown(old: torch.Tensor, axis: int, cap: int, keep: int, zero: bool) -> torch.Tensor:
    """`old` with `cap` slots along `axis`, its first `keep` (at most all) slots copied."""
    if cap == old.shape[axis]:
        return old
    shape = list(old.shape)
    shape[axis] = cap
    # Positions past `keep` are written before they are read, so a cache's new tail needs no
    # zeroing; a pool's does (see KVPool.reserve).
    new = old.new_zeros(shape) if zero else old.new_empty(shape)
    keep = min(keep, old.shape[axis])
    idx = (slice(None),) * axis + (slice(0, keep),)
    new[idx] = old[idx]
    return new


class KVPool:
    """`n_slots` caches in one tensor (two with a ring); `caches[i]` is slot i's cache (same
    layout arguments)."""

    def __init__(self, n_layer: int, n_slots: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 dtype: torch.dtype, device: torch.device, initial: int = 256, parts: int = 2,
                 ring: Ring | None = None):
        self.n_ctx = n_ctx
        self.ring = ring
        n_ring = 0 if ring is None else len(ring.layers)
        cap = min(initial, n_ctx)
        with _ordinary():
            self.kv = torch.zeros((n_layer - n_ring, parts, n_slots, n_head_kv, cap, head_dim),
                                  dtype=dtype, device=device)
            self.ring_kv = None if ring is None else \
                torch.zeros((n_ring, parts, n_slots, n_head_kv, min(cap, ring.size), head_dim),
                            dtype=dtype, device=device)
            self._split()
        self.caches = [KVCache(n_layer, n_head_kv, head_dim, n_ctx, dtype, device, pool=self, slot=i, parts=parts,
                               ring=ring) for i in range(n_slots)]

    def _split(self) -> None:
        self.layer_kv = list(self.kv.unbind(0))  # [parts, n_slots, heads, capacity, width] each
        self.layer_rows = [t.view(-1, t.shape[-1]) for t in self.layer_kv]  # one row per (part, slot, head, pos)

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def reserve(self, n: int) -> None:
        ring_cap = 0 if self.ring_kv is None else self.ring_kv.shape[4]
        if not _must_grow(n, self.capacity, self.n_ctx, ring_cap, self.ring):
            return
        with _ordinary():
            # Zero-filled: batched attention on CUDA reads (and masks out) positions past a shorter
            # row's end, and masked values must still be finite.
            self.kv = _regrown(self.kv, 4, _grown(self.capacity, n, self.n_ctx), self.capacity, zero=True)
            if self.ring_kv is not None:
                self.ring_kv = _regrown(self.ring_kv, 4, _ring_grown(ring_cap, n, self.n_ctx, self.ring), ring_cap,
                                        zero=True)
            self._split()
            for c in self.caches:
                c.attach_slot(self.kv, self.ring_kv)

    def row_index(self, slots: list[int], positions: list[int]) -> torch.Tensor:
        """Indices into `layer_rows[l]` of (each part: K then V) x (each slot's heads) at each
        slot's position, in the order of a [rows, parts, heads] block of new keys and values
        (layers of `kv`: for a layout without a ring, every layer)."""
        _, parts, n_slots, n_head_kv, cap, _ = self.kv.shape
        s = torch.tensor(slots).view(-1, 1, 1)
        p = torch.tensor(positions).view(-1, 1, 1)
        c = torch.arange(parts).view(1, parts, 1)
        h = torch.arange(n_head_kv).view(1, 1, -1)
        return (((c * n_slots + s) * n_head_kv + h) * cap + p).reshape(-1).to(self.kv.device)

    @property
    def nbytes(self) -> int:
        ring = 0 if self.ring_kv is None else self.ring_kv.numel() * self.ring_kv.element_size()
        return self.kv.numel() * self.kv.element_size() + ring
