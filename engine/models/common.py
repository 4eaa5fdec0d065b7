"""What every family's network computes the same way: its caches and its memory accounting.

`CachedNetwork` gives a family module (engine/models/<family>.py) the parts of the
engine.protocols.Network contract that follow from the shape alone: `cache_layout` (what one
layer caches per position: keys and values of every kv head by default; a family that caches
something else, like engine.models.deepseek2's latent, overrides it), `new_cache`, `new_pool`,
`kv_bytes_per_token` (the layout's bytes in every layer at one position, but for the layers a
ring bounds to a window), `kv_bytes` (one cache's bytes at a context size), `weight_bytes`
(blocks, embedding, final norm and a separate output head) and `kernel_path`.

It also dispatches the decoding steps (`decode`, `decode_started`, `decode_frontier`,
`decode_ahead`): through the family's captured CUDA graphs where `decode_graphs` is set and
takes the caches (engine.cuda_graphs, which calls the family's `graph_step`), otherwise through
the family's own eager `forward_rows` (a step of rows of distinct caches) and `forward` (a
session's one-token step).  A graph that fails to capture turns itself off, and that step and
every later one runs eagerly.

A family sets `cfg`, `device`, `cpu_kernels`, `blocks` (each with `nbytes`), `embed`,
`out_norm`, `output`, `head_is_table` and, where its steps can be captured, `decode_graphs` in
its constructor. It holds no forward pass and no family's tensor names.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine import cuda_graphs
from engine.device_sampling import DeviceLogits, StepLogits
from engine.errors import Cancelled
from engine.kvcache import CacheLayout, KVCache, KVPool


class CachedNetwork:
    # CUDA: the decoding steps' captured graphs, set by a family whose steps they can run;
    # None decodes eagerly.
    decode_graphs: cuda_graphs.DecodeGraphs | None = None

    def _graphs_taking(self, caches: list[KVCache]) -> cuda_graphs.DecodeGraphs | None:
        g = self.decode_graphs
        return g if g is not None and g.accepts(caches) else None

    @torch.inference_mode()
    def decode(self, tokens: list[int], caches: list[KVCache], eos_ids: frozenset[int] = frozenset()) -> StepLogits:
        """One token for each of N distinct caches, the step's logits as `StepLogits`: on CUDA
        through a captured graph where one applies, with only greedy ids copied to the host;
        elsewhere the family's `forward_rows`."""
        g = self._graphs_taking(caches)
        if g is not None:
            try:
                return g.run([int(t) for t in tokens], caches, eos_ids)
            except cuda_graphs.GraphsUnavailable:
                pass  # graphs turned themselves off; this and later steps run eagerly
        ids = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=self.device)
        return StepLogits.of(self.forward_rows(ids, caches), eos_ids)

    def decode_started(self, tokens: list[int], caches: list[KVCache],
                       eos_ids: frozenset[int] = frozenset()) -> Callable[[], StepLogits]:
        """`decode` in two halves: under a captured graph the step is launched and the returned
        call waits for it and advances the caches, so the host can work while the GPU computes;
        otherwise the step is computed before this returns."""
        g = self._graphs_taking(caches)
        if g is not None:
            try:
                pending = g.launch([int(t) for t in tokens], caches, eos_ids)
            except cuda_graphs.GraphsUnavailable:
                pass
            else:
                def finish() -> StepLogits:
                    out = pending.result()
                    for c in caches:
                        c.n += 1
                    return out
                return finish
        step = self.decode(tokens, caches, eos_ids)
        return lambda: step

    def decode_frontier(self, token: int, cache: KVCache, eos_ids: frozenset[int] = frozenset(),
                        cancel: Callable[[], bool] | None = None) -> "torch.Tensor | DeviceLogits":
        """One token appended to `cache`: the logits row a session keeps (see decode).  Without
        a graph it is `forward`'s one-token step."""
        g = self._graphs_taking([cache])
        if g is not None:
            if cancel is not None and cancel():
                raise Cancelled("cancelled before a one-token step")
            try:
                return g.run([int(token)], [cache], eos_ids).row(0)
            except cuda_graphs.GraphsUnavailable:
                pass
        tokens = torch.tensor([int(token)], dtype=torch.long, device=self.device)
        return StepLogits.of(self.forward(tokens, cache.n, cache, cancel=cancel).unsqueeze(0), eos_ids).row(0)

    def graph_prefill(self, tokens: torch.Tensor, start: int, cache: KVCache, logits: str,
                      cancel: Callable[[], bool] | None) -> tuple[bool, torch.Tensor | None]:
        """A short prefill (tokens at positions start.., room reserved) as graph replays, where
        graphs take this cache: (True, `forward`'s result) with cache.n advanced, or (False,
        None) where the caller prefills eagerly (nothing was written then)."""
        g = self._graphs_taking([cache])
        T = tokens.shape[0]
        if g is None or T > cuda_graphs.PREFILL_GRAPH_TOKENS:
            return False, None
        if cancel is not None and cancel():
            raise Cancelled(f"cancelled before a {T}-token step")
        try:
            out = g.prefill(tokens.tolist(), cache, start, logits)
        except cuda_graphs.GraphsUnavailable:
            return False, None  # graphs turned themselves off, nothing written
        cache.n = start + T
        return True, out

    def decode_ahead(self, token: int | None, cache: KVCache, eos_ids: frozenset[int], ahead: int,
                     after: cuda_graphs.PendingStep | None = None,
                     column: int = 0) -> cuda_graphs.PendingStep | None:
        """Launch the one-row step of `token` (or of `after`'s greedy id in `column`) at position
        cache.n + ahead without waiting for it, where a captured graph takes this cache; None
        where none does (the caller decodes as usual).  The cache's length is not changed."""
        return self.decode_launch(None if token is None else [token], [cache], eos_ids, ahead, after, column)

    def decode_launch(self, tokens: list[int] | None, caches: list[KVCache], eos_ids: frozenset[int],
                      ahead: int = 0, after: cuda_graphs.PendingStep | None = None,
                      column: int = 0) -> cuda_graphs.PendingStep | None:
        """Launch one step for each of N distinct caches at position cache.n + ahead without
        waiting for it, its greedy ids kept on the device for a later launch's `after`: row i
        evaluates tokens[i], or (tokens None) column `column` of `after`'s ids for its row i.
        None where no captured graph takes these caches or a position is past a cache's
        context (the caller decodes as usual).  The caches' lengths are not changed."""
        g = self._graphs_taking(caches)
        if g is None or any(c.n + ahead >= c.n_ctx for c in caches):
            return None
        try:
            return g.launch([0] * len(caches) if tokens is None else [int(t) for t in tokens], caches, eos_ids,
                            ahead=ahead, after=after, column=column, keep_ids=True)
        except cuda_graphs.GraphsUnavailable:
            return None

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
