"""Decoding steps on CUDA as captured graphs, one per batch-size bucket, replayed each token.

On CUDA a decoding step of a small model is bound by launching its ~900 kernels from
Python, not by the GPU.  `DecodeGraphs(net)` captures the whole step (embedding, every
layer, the output head and the greedy argmaxes) once per bucket of rows (1, 2, 4, ... 64)
and replays it: per token the host writes one small table to the device, replays the graph
and reads back two ids per row.

Everything that varies between steps is data in static device buffers, one row of
`engine.cuda_attention`'s table per batch row: the token, its position, and where that row's
cache lies (offset from a base tensor, layer / V / head strides).  Attention reads those
addresses and lengths from the table (`engine.cuda_attention.decode_attention`), so one graph
serves any mix of sessions, standalone caches or pool slots, at any lengths, and caches may
still grow: a cache that grows is reallocated between steps (`KVCache.reserve`, outside the
graph) and the next step's table points at its new memory.  A batch of N rows replays the
smallest bucket >= N; the unused rows decode token 0 at position 0 into a one-position scratch
cache, and their outputs are dropped.

The step itself is the family's (`GraphNetwork.graph_step`, given the table, the base and the
attention's workspace), so the graph runs the same kernels as eager decoding except attention.
The llama family (`LlamaModel.graph_step`, its `decode_layers`) attends with the Triton kernels
(writing bfloat16, which the output projection rounds its input to anyway; they also turn q and
k by rope as they load them, `cuda_attention.ROPE_IN_ATTENTION`, one kernel a layer fewer) and
takes RMSNorm and SwiGLU as one Triton kernel each instead of six and three
(`engine.cuda_elementwise`; `fused = False` keeps torch's, for graphs captured after the change).  With the residual adds
inside the int4 products and the one-row products unsplit, a SmolLM2-shape step is about 310
kernels (520 before those changes).  The deepseek2 family (`DeepSeek2Model.graph_step`) attends
with the latent kernel (`engine.cuda_attention.latent_attention`) on its one-row-per-position
cache; the scratch cache's shape follows the family's `cache_layout`.  Tests compare logits and
greedy tokens with the eager CUDA path and the CPU float32 path.  Graphs share one memory pool;
each step's outputs are copied out before the next replay.  A bucket's first step captures it
(tens of milliseconds after a one-off Triton compile); `capture_seconds` sums that time.

`run` waits for its step; `launch` only enqueues it and returns a `PendingStep` that settles
later, and a launched step may take its token from an earlier step's greedy ids on the device,
so a session can keep steps going ahead of the host (engine.session's run-ahead).  The pinned
buffers the host fills and reads form a ring of RING launches per graph; a launch waits only
for the one that last used its buffers.

`prefill` runs a short prompt the same way: its T tokens are the rows of one step (in pieces
of the largest bucket), all in one cache at consecutive positions, and the attention stores
every row's key and value before any row attends (`store_first`), so row i sees the cache's
past and rows 0..i: a causal prefill in one replay, where the eager prefill launches a kernel
per operation from Python (40 tokens of the 135M shape: about 1,340 launches, 17-19 ms of
host time around 3 ms of GPU work).  Its graphs are captured per bucket like the decoding
ones, apart from them.

Not used on CPU, for more rows than the largest bucket, or where Triton is missing
(`usable`); the network's `decode` (engine.models.common) then runs the eager step, as it does
from then on when a capture fails (`disabled_reason` says why).  It does not sample or know
about sessions.
"""
from __future__ import annotations

import os
import time
from typing import Protocol

import torch

from engine import cuda_attention, cuda_elementwise
from engine.config import ModelConfig
from engine.device_sampling import StepLogits, eos_tensor, greedy_pair
from engine.kvcache import CacheLayout, KVCache

# Batch sizes with graphs of their own; a step of n rows replays the smallest bucket >= n, its
# padding rows computed like the others.  The sizes between powers of two pay for their extra
# captures: whole decoding steps on an H100 against (1, 2, 4, 8, 16, 32, 64) (docs/measurements.md
# round 18): SmolLM2-135M shape 1.03x at 3 rows, 1.07x at 5 and 6, 1.11x at 12; Llama-3.2-1B
# shape 1.02x at 3, 1.05x at 6, level at 12.
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Prefills of up to this many tokens replay the prefill steps (`DecodeGraphs.prefill`), 64 rows
# a replay; longer ones run eagerly.
PREFILL_GRAPH_TOKENS = 256
ENV_SWITCH = "DS4_CUDA_GRAPHS"  # "0" turns graph decoding off


def usable(device: torch.device) -> bool:
    return (device.type == "cuda" and cuda_attention.AVAILABLE
            and os.environ.get(ENV_SWITCH, "1") != "0")


class GraphNetwork(Protocol):
    """What a family's network gives the graphs: its shape and caches, the scratch its attention
    needs, and the step itself."""

    cfg: ModelConfig
    device: torch.device
    fmt: str

    def cache_layout(self) -> CacheLayout: ...

    def graph_workspace(self, n_rows: int, n_ctx: int, out_dtype: torch.dtype) -> cuda_attention.Workspace:
        """The attention's scratch for steps of n_rows rows against caches of n_ctx positions."""

    def graph_step(self, table: torch.Tensor, base: torch.Tensor, work: cuda_attention.Workspace,
                   kernels: cuda_elementwise.FusedStepKernels | None, shared: bool) -> torch.Tensor:
        """One decoding step of the table's rows [B, ROW_FIELDS] (token, position, cache
        address from `base`): stores their cache rows, returns logits [B, n_vocab] float32.
        `kernels` (where set) are the fused norms and SwiGLU; `shared`: the rows are one
        cache's consecutive positions (a prefill).  No host synchronisation."""


class GraphsUnavailable(RuntimeError):
    """Capturing failed (e.g. a kernel that cannot be built here); graphs are now off."""


def bucket_for(n: int) -> int | None:
    for b in BUCKETS:
        if n <= b:
            return b
    return None


RING = 4  # launches of one graph whose pinned host buffers may still be in use


class PendingStep:
    """A replayed step whose greedy ids may still be on their way to the host.  `rows` (its
    logits) and `ids` (its greedy ids on the device, kept where a later step takes its token
    from them) are its own copies; `result()` waits for the step."""

    __slots__ = ("rows", "ids", "eos_ids", "_event", "_host", "_ids")

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor | None, event: torch.cuda.Event,
                 host_ids: torch.Tensor, eos_ids: frozenset[int]):
        self.rows = rows  # float32 [N, n_vocab] on the device
        self.ids = ids  # int64 [N, 2] on the device, or None
        self.eos_ids = eos_ids
        self._event = event
        self._host = host_ids  # pinned [N, 2], filled once the event has completed
        self._ids: list[list[int]] | None = None

    def settle(self) -> None:
        """Wait for the step and take its ids off the pinned buffer (which is then free)."""
        if self._ids is None:
            self._event.synchronize()
            self._ids = self._host.tolist()

    def result(self) -> StepLogits:
        self.settle()
        return StepLogits(self.rows, self._ids, self.eos_ids)


class _Captured:
    """One bucket's graph with every tensor it reads or writes: the graph holds raw addresses,
    so each must live as long as the graph does.  The pinned buffers the host fills and reads
    form a ring of RING launches, so a launch need not wait for the one before it."""

    def __init__(self, graph: torch.cuda.CUDAGraph, table: torch.Tensor, b: int,
                 logits: torch.Tensor, ids: torch.Tensor, work: cuda_attention.Workspace,
                 eos_index: torch.Tensor | None):
        self.graph = graph
        self.work = work
        self.eos_index = eos_index
        self.table = table  # int64 [B, ROW_FIELDS] on the device, read by the graph
        self.logits = logits  # float32 [B, n_vocab], written by each replay
        self.ids = ids  # int64 [B, 2]: argmax, argmax with eos masked
        self.hosts = [torch.zeros((b, cuda_attention.ROW_FIELDS), dtype=torch.long).pin_memory()
                      for _ in range(RING)]  # pinned twins of `table`
        self.host_ids = [torch.zeros((b, 2), dtype=torch.long).pin_memory() for _ in range(RING)]
        self.events = [torch.cuda.Event() for _ in range(RING)]
        self.owners: list[PendingStep | None] = [None] * RING
        self.turn = 0

    def next_slot(self) -> int:
        """The ring's next buffers, once the launch that used them last has completed."""
        i = self.turn
        self.turn = (i + 1) % RING
        owner = self.owners[i]
        if owner is not None:
            owner.settle()
            self.owners[i] = None
        return i


class DecodeGraphs:
    def __init__(self, net: GraphNetwork):
        self.net = net
        self.enabled = True
        # The family's fused kernels (llama: RMSNorm and SwiGLU in engine.cuda_elementwise;
        # deepseek2: its latent attention's inputs); read at capture.
        self.fused = True
        self.disabled_reason: str | None = None
        self.capture_seconds = 0.0
        self.replays = 0  # decoding steps
        self.prefill_replays = 0
        self._graphs: dict[tuple, _Captured] = {}
        self._pool = None
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    # --- which steps it takes ---
    def accepts(self, caches: list[KVCache]) -> bool:
        if not self.enabled or bucket_for(len(caches)) is None:
            return False
        dtype = caches[0].kv.dtype
        return all(c.kv.dtype == dtype and c.kv.stride(-1) == 1 and c.kv.stride(-2) == c.kv.shape[-1]
                   for c in caches)

    # --- the row table ---
    def _base(self, dtype: torch.dtype) -> torch.Tensor:
        """A one-position cache: the padding rows' target and the base that offsets count from."""
        if dtype not in self._scratch:
            lay = self.net.cache_layout()
            self._scratch[dtype] = torch.zeros((self.net.cfg.n_layer, lay.parts, lay.heads, 1, lay.width),
                                               dtype=dtype, device=self.net.device)
        return self._scratch[dtype]

    @staticmethod
    def _place(kv: torch.Tensor, base: torch.Tensor) -> tuple[int, int, int, int]:
        """(offset from base, layer stride, V offset, head stride) in elements of a cache's kv
        [n_layer, parts, heads, capacity, width] (a view into a pool or its own tensor)."""
        offset, rem = divmod(kv.data_ptr() - base.data_ptr(), kv.element_size())
        if rem:
            raise ValueError("cache memory is not aligned to its element size")
        return offset, kv.stride(0), kv.stride(1), kv.stride(2)

    def _fill(self, cap: _Captured, slot: int, rows: list[tuple[int, int, KVCache]], base: torch.Tensor) -> None:
        """The table of one launch: (token, position, cache) per row, padding rows after them."""
        host = cap.hosts[slot]
        table = host.numpy()  # the pinned buffer itself: no tensor is built per step
        n = len(rows)
        if n:
            table[:n] = [[t, p, *self._place(c.kv, base)] for t, p, c in rows]
        table[n:] = [0, 0, *self._place(base, base)]
        cap.table.copy_(host, non_blocking=True)

    def compute_dtype(self) -> torch.dtype:
        """The dtype the model's matmuls take their inputs in (where fused kernels write)."""
        return torch.float32 if self.net.fmt == "float32" else torch.bfloat16

    # --- capture ---
    def _step(self, table: torch.Tensor, base: torch.Tensor, work: cuda_attention.Workspace,
              eos_index: torch.Tensor | None, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = cuda_elementwise.FusedStepKernels(self.net.cfg.norm_eps, self.compute_dtype()) if self.fused else None
        logits = self.net.graph_step(table, base, work, kernels, shared)  # [B, n_vocab]
        return logits, greedy_pair(logits, eos_index)

    def _capture(self, b: int, dtype: torch.dtype, eos_ids: frozenset[int], n_ctx: int, shared: bool) -> _Captured:
        t0 = time.perf_counter()
        device = self.net.device
        base = self._base(dtype)
        table = torch.zeros((b, cuda_attention.ROW_FIELDS), dtype=torch.long, device=device)
        work = self.net.graph_workspace(b, n_ctx, self.compute_dtype() if self.fused else torch.float32)
        eos_index = eos_tensor(eos_ids, device)
        cap = _Captured(None, table, b, None, None, work, eos_index)  # type: ignore[arg-type]
        self._fill(cap, cap.next_slot(), [], base)  # every row padding: warm-up and capture write only scratch
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compiles the Triton kernels, creates library handles
            for _ in range(2):
                self._step(table, base, work, eos_index, shared)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, ids = self._step(table, base, work, eos_index, shared)
        self._pool = graph.pool()
        cap.graph, cap.logits, cap.ids = graph, logits, ids
        torch.cuda.synchronize(device)
        self.capture_seconds += time.perf_counter() - t0
        return cap

    # --- a step ---
    def _graph_for(self, n: int, dtype: torch.dtype, n_ctx: int, eos_ids: frozenset[int],
                   shared: bool = False) -> _Captured:
        """The graph for n rows (`shared`: rows of one cache, a prefill's), captured on first use."""
        b = bucket_for(n)
        key = (b, dtype, eos_ids, n_ctx, self.fused, shared)
        cap = self._graphs.get(key)
        if cap is None:
            try:
                cap = self._graphs[key] = self._capture(b, dtype, eos_ids, n_ctx, shared)
            except Exception as e:  # nothing was written to any cache: decode eagerly from now on
                self.enabled = False
                self.disabled_reason = f"{type(e).__name__}: {e}"[:300]
                raise GraphsUnavailable(self.disabled_reason) from e
        return cap

    def launch(self, tokens: list[int], caches: list[KVCache], eos_ids: frozenset[int] = frozenset(),
               ahead: int = 0, after: PendingStep | None = None, column: int = 0,
               keep_ids: bool = False) -> PendingStep:
        """Enqueue one step for each of N caches (N <= the largest bucket) and return without
        waiting for it: row i evaluates tokens[i] or, with `after`, column `column` of that
        earlier step's greedy ids (a token the host does not know yet), at position
        cache.n + ahead, storing its key and value there.  The caches' lengths are left as
        they are (`run` advances them); `keep_ids` keeps the step's ids on the device for a
        later step's `after`."""
        n = len(caches)
        cap = self._graph_for(n, caches[0].kv.dtype, max(c.n_ctx for c in caches), eos_ids)
        for c in caches:
            c.reserve(c.n + ahead + 1, written=c.n + ahead)
        slot = cap.next_slot()
        self._fill(cap, slot, [(t, c.n + ahead, c) for t, c in zip(tokens, caches)], self._base(caches[0].kv.dtype))
        if after is not None:
            cap.table[:n, cuda_attention.TOKEN].copy_(after.ids[:n, column])
        self.replays += 1
        return self._replay(cap, slot, n, eos_ids, keep_ids)

    def _replay(self, cap: _Captured, slot: int, n: int, eos_ids: frozenset[int], keep_ids: bool = False,
                rows: slice | None = None) -> PendingStep:
        """Replay a filled graph; its logits (`rows`, default the first n) and ids are copied out."""
        cap.graph.replay()
        logits = cap.logits[slice(0, n) if rows is None else rows].clone()  # the next replay overwrites them
        ids = cap.ids[:n].clone() if keep_ids else cap.ids[:n]
        host = cap.host_ids[slot][:n]
        host.copy_(ids, non_blocking=True)
        cap.events[slot].record()
        step = cap.owners[slot] = PendingStep(logits, ids if keep_ids else None, cap.events[slot], host, eos_ids)
        return step

    def prefill(self, tokens: list[int], cache: KVCache, start: int, logits: str = "last") -> torch.Tensor | None:
        """Tokens at positions start.. of one cache (room for them reserved, the positions
        before `start` valid), in steps of up to the largest bucket of rows: stores their keys
        and values and returns the logits as `LlamaModel.forward` does (`logits`: "last" ->
        [n_vocab], "all" -> [T, n_vocab], anything else -> None).  The cache's length is left
        as it is (the caller sets it)."""
        B = BUCKETS[-1]
        base = self._base(cache.kv.dtype)
        out = []
        for at in range(0, len(tokens), B):
            part = tokens[at: at + B]
            n = len(part)
            cap = self._graph_for(n, cache.kv.dtype, cache.n_ctx, frozenset(), shared=True)
            slot = cap.next_slot()
            self._fill(cap, slot, [(t, start + at + i, cache) for i, t in enumerate(part)], base)
            if logits == "all":
                want = slice(0, n)
            elif logits == "last" and at + B >= len(tokens):
                want = slice(n - 1, n)
            else:
                want = slice(0, 0)
            self.prefill_replays += 1
            out.append(self._replay(cap, slot, n, frozenset(), rows=want).rows)
        if logits == "last":
            return out[-1][0]
        return torch.cat(out) if logits == "all" else None

    def run(self, tokens: list[int], caches: list[KVCache], eos_ids: frozenset[int] = frozenset()) -> StepLogits:
        """One token for each of N caches (N <= the largest bucket): stores their keys and
        values, advances each cache by one and returns the step's logits."""
        out = self.launch(tokens, caches, eos_ids).result()
        for c in caches:
            c.n += 1
        return out

    @property
    def graph_count(self) -> int:
        """Graphs captured so far (decoding and prefill, every context size and dtype)."""
        return len(self._graphs)

    @property
    def captured_buckets(self) -> set[int]:
        """Batch sizes that have a captured graph."""
        return {key[0] for key in self._graphs}
