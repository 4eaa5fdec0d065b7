"""Decode attention on CUDA in two Triton kernels: rows of any caches, each at its own length.

`decode_attention(qkv, rows, layer, kv_base, work)` is one decoding step's attention of one
layer for B rows.  `qkv` [B, (H + 2*Hkv) * D] float32 holds each row's rotated query, key and
value (or, given a rope table, its unrotated query and key, which the kernels turn by the row's
position as they load them: one kernel a layer fewer than turning them first); `rows` [B,
ROW_FIELDS] int64 holds, per row, its position `p` (the new token's; the
row attends to positions 0..p) and where its cache lies: the element offset of layer 0's K,
head 0, position 0 from `kv_base` (any tensor of the caches' dtype; the caches themselves may
be separate allocations or slots of one pool), the layer stride, the offset from K to V and
the head stride (positions are D apart, elements contiguous).  The new key and value are
stored at position p and the row's attention output [B, H * D] is returned (float32, or the
dtype the workspace was made for).

With `store_first`, one kernel stores every row's key and value before any row attends, so
rows may share a cache at consecutive positions: T tokens of one session in one call are its
causal prefill, row i seeing the cache's past and rows 0..i (engine.cuda_graphs' prefill).
Without it each row's own program stores its key and value, one launch fewer, for rows of
distinct caches (decoding).

Because every address and length is read from device memory, one launch shape serves any mix
of sessions and lengths, so a decoding step that calls this can be captured once in a CUDA
graph per batch size and replayed (engine.cuda_graphs).  Only the positions a row has are
read: the sequence axis is split into `split`-sized pieces, one program per (row, kv head,
piece) with an online softmax over it (pieces past a row's end do nothing), and a second
kernel merges the pieces.  A workspace with fewer pieces than its context needs (`Workspace`'s
`max_programs`) stretches each longer row's pieces to cover its positions, read from the row
table like everything else.  A group's query heads share one program, so each key is read once
per kv head, and its products run on the tensor cores (the group padded to 16 rows).  As in
eager decoding, queries and probabilities enter the products in the cache's dtype (float32
caches: full float32 products) with float32 accumulation; the softmax is float32; the new key
and value enter rounded to the cache's dtype, as they would be read back.

`latent_attention(q_lat, q_rope, new, rows, layer, kv_base, work, ...)` is the same for
multi-head latent attention (engine.models.deepseek2): every position caches one row of
`rank + rope` values (the latent, then the shared rotated key part), every head's key is that
whole row and its value the latent part.  `q_lat` [B, H, rank] holds each head's absorbed
query, `q_rope` [B, H, rope] its rotated part, `new` [B, rank + rope] each row's new cache row;
the result is each head's attention-weighted latent [B, H * rank].  One program serves 16
heads of a row's piece of positions, so each cached row is read once per 16 heads; the products
run on the tensor cores as above.  Its workspace (`Workspace.latent`) bounds the partial
results' memory, which the latent's width would otherwise make large at many rows and long
contexts.  `latent_inputs` makes `q_rope` and `new` from a layer's projections in one kernel
(the latent's RMSNorm, the rotation of the query's and key's rope parts), where torch's ops
take eight.

`prefill_inputs(qkv, kv, start, ...)` is an eager prefill chunk's side of attention before torch's
fused kernels: its projections turned (float32), keys and values stored into the layer's cache,
queries returned [T, H, D] in the cache's dtype, in one kernel.

`dependent_launch(device)`: whether this module's, engine.cuda_elementwise's and the one-row int4
kernels are launched as programmatic dependents on `device` (Hopper on, a Triton with grid
dependency control): each lets the next kernel launch as it starts and waits for the one
before it before reading what that one writes, so a decoding step's short kernels start while
the one before them runs.  Measured on an H100: one-row decoding 1.29x faster on the 135M
shape, the same bits.  What a kernel reads before its wait must be something no kernel of the
chain writes: weights, the row table (written by copies before a step's kernels), and the
cache's positions before each row's own (`EARLY_CACHE_READS`).

`reference_attention` and `reference_latent` are the same functions in torch ops, for tests.
Without Triton (`AVAILABLE` is False) nothing here can run; callers keep their torch paths.
It computes no projections and knows nothing of sessions.
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports
    triton = None
    tl = None

AVAILABLE = triton is not None
try:  # grid dependency control (programmatic dependent launch, sm_90 on): Triton 3.3 on
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _GDC = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:
    gdc_launch_dependents = gdc_wait = None
    _GDC = False
# Whether kernels start while the kernel before them runs (see `dependent_launch`).
DEPENDENT_LAUNCH = True


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` are launched as programmatic dependents of the kernel before
    them.  Such a kernel lets the next one launch as soon as it starts (`gdc_launch_dependents`),
    then waits for the one before it to finish (`gdc_wait`) before it reads anything that one
    may write; the one-row int4 product first reads some of its weights.  A step's kernels then
    start while the kernel before them runs, instead of after it ends.  The results are the same
    bits (tests/engine/test_cuda_int4.py)."""
    return DEPENDENT_LAUNCH and dependent_launch_capable(device)


def dependent_launch_capable(device: torch.device) -> bool:
    """Whether `device` and this Triton can launch kernels as dependents (sm_90 on)."""
    return _GDC and device.type == "cuda" and device_capability(device.index) >= (9, 0)


@functools.cache
def device_capability(index: int | None) -> tuple[int, int]:
    """CUDA device `index`'s (major, minor) compute capability, asked of the driver once: it is
    asked at every launch, and the host's time counts in eager prefill."""
    return torch.cuda.get_device_capability(index)


# Columns of the row table: token, position, K offset, layer stride, V offset, head stride.
TOKEN, POS, K_OFFSET, LAYER_STRIDE, V_OFFSET, HEAD_STRIDE = range(6)
ROW_FIELDS = 6
# Positions per inner iteration of a grouped-query piece (at most its length): for one row, and
# for more; read when a workspace is made, so a graph keeps those it was captured with.  64 for one
# row against 32 on an H100 (docs/measurements.md, round 24), one loop trip a piece of 64 instead
# of two: whole one-row steps 1.01-1.07x (135M shape, after 300 and 6,000 positions), 1.03-1.06x
# (1B, after 300 and 3,000), the embedded model's in `ds4-bench product` 1.057x; at 3 to 16 rows
# 64 ran 0.98-1.02x, and 2 or 8 warps a program were slower than 4 at every row count.
BLOCKS = (64, 32)
LATENT_HEADS = 16  # query heads per latent program (the tensor cores' smallest tile)
# A latent program's launch shape: positions per inner iteration, warps, and `split_size`'s
# piece lengths.  Swept on an H200 at DeepSeek-V2-Lite's widths (16 heads, latent 512, rope 64;
# one call, its merge included): one row after 150 and 2,100 positions 8.6 and 8.8 us, where
# (16, 4 warps, pieces of 64) took 13.6 and 14.4; 32 rows after 150 positions 29.8 us, against
# 35.8 with pieces of 128.
LATENT_BLOCK = 32
LATENT_WARPS = 8
LATENT_SPLITS = (32, 256, 256)
# `split_size`'s piece lengths for the grouped-query programs (few, some and many (row, kv head)
# pairs); read when a workspace is made, so a graph keeps those it was captured with.  Pieces of
# 64 up to 64 pairs: on an H100, 6 and 16 rows of the 135M shape 1.03-1.11x, 6 rows of the 1B
# shape 1.01-1.04x, after 512 and 2,048 positions; 128 for more pairs gained at 512 positions
# but lost 1.4-2.2% at 2,048 on the 1B shape (docs/measurements.md, round 19).
PIECES = (64, 64, 256)
# The most programs a grouped-query step's attention launches (`Workspace`'s `max_programs`; read
# when a graph's workspace is made), or None: pieces cover the whole context at any length.  A
# graph's pieces cover its model's context, so at 16 rows of the 135M shape's 8,192 positions an
# uncapped step launched 6,144 programs a layer, nearly all past their rows' ends.  512 against
# none on an H100 (docs/measurements.md, round 23): 6 to 16 rows after 3,500 positions 1.05-1.09x
# (135M shape) and 4 to 8 rows 1.05-1.08x (1B shape), 16 rows after 300 positions 1.02x; one
# row unchanged (it has fewer pairs than the cap allows pieces), 3 rows after 3,500 0.99x; the
# embedded model's 16 rows in `ds4-bench product` 1.07x.  256 lost at 3,500 positions (0.88-0.96x).
PIECE_PROGRAMS = 512
# Whether the graphs' decoding steps pass their rope table to `decode_attention` (read when a
# graph is captured) instead of turning q and k with torch's ops first: on an H100 1.027-1.041x
# a step, one row and 16, both dense shapes (tests/engine/step_timing.py --rope-in-attention).
ROPE_IN_ATTENTION = True
# Whether the decoding kernel, where its rows store their own keys, reads the first block of each
# piece of the cache before it waits for the kernel before it, and each block's successor before
# the block's arithmetic (read at launch, so at a capture): on an H100 1.012x (one row) and 1.019x
# (16 rows) a step on the Llama-3.2-1B shape, 1.027x and 1.054x on the SmolLM2-135M shape
# (docs/measurements.md, round 20).
EARLY_CACHE_READS = True
MERGE_WIDTH = 128  # output values per merging program
LATENT_PART_BYTES = 64 << 20  # at most this much float32 scratch for a latent step's pieces


def split_size(n_rows: int, n_head_kv: int, n_ctx: int, sizes: tuple[int, int, int] | None = None) -> int:
    """Positions per program: short pieces (`sizes[0]`) when at most 16 (row, kv head) pairs
    would leave the GPU idle, longer ones (`sizes[1]` up to 64 pairs, then `sizes[2]`) when many
    rows already fill it; at most 256 pieces per row."""
    sizes = sizes or PIECES
    pairs = n_rows * n_head_kv
    split = sizes[0] if pairs <= 16 else sizes[1] if pairs <= 64 else sizes[2]
    while -(-n_ctx // split) > 256:
        split *= 2
    return split


def _padded(n: int) -> int:
    return max(triton.next_power_of_2(n), 16) if AVAILABLE else n


class Workspace:
    """Per-launch-shape scratch for the partial results (kept by a captured graph): `n_head`
    outputs of `head_dim` values per row, with `n_head_kv` programs per row and piece.

    `max_programs` (grouped-query attention only) caps the programs a step launches: with at
    most max_programs // (n_rows * n_head_kv) pieces per row (`stretch`), a row too long for
    them splits its positions into that many pieces of whole `split`s instead, so rows at
    short contexts keep short pieces and long ones run fewer, longer programs.  A piece reads
    `block` positions an inner iteration (BLOCKS)."""

    def __init__(self, n_rows: int, n_head: int, head_dim: int, n_ctx: int, n_head_kv: int,
                 device: torch.device, out_dtype: torch.dtype = torch.float32, max_part_bytes: int | None = None,
                 splits: tuple[int, int, int] | None = None, max_programs: int | None = None):
        self.split = split_size(n_rows, n_head_kv, n_ctx, splits)
        self.dp = _padded(head_dim)
        if max_part_bytes is not None:
            while self.split < n_ctx and n_rows * n_head * -(-n_ctx // self.split) * self.dp * 4 > max_part_bytes:
                self.split *= 2
        self.n_split = -(-n_ctx // self.split)
        if max_programs is not None:
            self.n_split = max(1, min(self.n_split, max_programs // (n_rows * n_head_kv)))
        self.stretch = self.n_split * self.split < n_ctx
        self.block = min(BLOCKS[0] if n_rows == 1 else BLOCKS[1], self.split)
        self.part = torch.empty((n_rows, n_head, self.n_split, self.dp), dtype=torch.float32, device=device)
        self.stat = torch.empty((n_rows, n_head, self.n_split, 2), dtype=torch.float32, device=device)
        # The output projection's input dtype: bfloat16 where it rounds its input to that anyway.
        self.out = torch.empty((n_rows, n_head * head_dim), dtype=out_dtype, device=device)

    @classmethod
    def latent(cls, n_rows: int, n_head: int, rank: int, n_ctx: int, device: torch.device) -> "Workspace":
        """Scratch for `latent_attention`: float32 outputs of `rank` values per head."""
        return cls(n_rows, n_head, rank, n_ctx, -(-n_head // LATENT_HEADS), device,
                   max_part_bytes=LATENT_PART_BYTES, splits=LATENT_SPLITS)


if AVAILABLE:
    @triton.jit
    def dependent_start(DEPENDENT: tl.constexpr):
        """A kernel's first step where it is launched as a dependent (`dependent_launch`): the
        next kernel may launch, and this one waits for the one before it."""
        if DEPENDENT:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def _softmax_block(sc, values, acc, m_i, l_i, IEEE: tl.constexpr):
        """One block of scores [G, BLOCK] and its values [BLOCK, DP] into a running softmax's
        (acc [G, DP], max [G], denominator [G]), probabilities entering the product in the
        values' dtype (full float32 products for float32 values)."""
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        if IEEE:
            pv = tl.dot(p, values, input_precision="ieee")
        else:
            pv = tl.dot(p.to(values.dtype), values)
        return acc * alpha[:, None] + pv, m_new, l_i * alpha + tl.sum(p, axis=1)

    @triton.jit
    def _store_piece(part_ptr, stat_ptr, where, acc, m_i, l_i, mask, d, DP: tl.constexpr):
        """A piece's partial result of each head (`where` [G]: its slot, `mask`: real heads)."""
        tl.store(part_ptr + where[:, None] * DP + d[None, :], acc, mask=mask[:, None])
        tl.store(stat_ptr + where * 2, m_i, mask=mask)
        tl.store(stat_ptr + where * 2 + 1, l_i, mask=mask)

    @triton.jit
    def _turned(ptr, d, dm, cos, sin):
        """Values at `ptr + d` (d: one head's value indices, any leading axes) turned by rope:
        value 2i of pair i becomes x cos - y sin and value 2i + 1 becomes x sin + y cos (x, y
        the pair's values; `cos`, `sin` per value, from `_turns`)."""
        x = tl.load(ptr + d, mask=dm, other=0.0)
        partner = tl.load(ptr + (d + 1 - 2 * (d % 2)), mask=dm, other=0.0)
        return x * cos + partner * tl.where(d % 2 == 0, -sin, sin)

    @triton.jit
    def _turns(rope_ptr, p, d, dm, D: tl.constexpr):
        """Each of a head's values' (cos, sin) at position p, from a [positions, D] table of
        (cos, sin) pairs."""
        pair = rope_ptr + p * D + (d - d % 2)
        return tl.load(pair, mask=dm, other=1.0), tl.load(pair + 1, mask=dm, other=0.0)

    @triton.jit
    def _new_key(q_row, rope_ptr, p, h, d, dm, H: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr):
        """A row's new key of kv head h, float32, turned by rope at p where ROPE."""
        k_ptr = q_row + H * D + h * D
        if ROPE:
            cos, sin = _turns(rope_ptr, p, d, dm, D)
            k = _turned(k_ptr, d, dm, cos, sin)
        else:
            k = tl.load(k_ptr + d, mask=dm, other=0.0)
        return k

    @triton.jit
    def _piece_span(p_new, SPLIT: tl.constexpr, NSPLIT: tl.constexpr, STRETCH: tl.constexpr):
        """Positions per piece for a row whose newest position is p_new: SPLIT, or where the
        workspace's pieces do not cover its context (STRETCH), the fewest whole SPLITs that
        cover the row's positions with NSPLIT pieces."""
        if STRETCH:
            span = ((p_new + SPLIT) // SPLIT + NSPLIT - 1) // NSPLIT * SPLIT
        else:
            span = SPLIT
        return span

    @triton.jit
    def _cache_block(k_base, v_base, n, hi, d, dm, D: tl.constexpr):
        """Keys and values [BLOCK, DP] at cache positions n (those before `hi`) of one head."""
        kv_mask = (n < hi)[:, None] & dm[None, :]
        k = tl.load(k_base + n[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + n[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        return k, v

    @triton.jit
    def _attend_pieces(qkv_ptr, kv_ptr, rows_ptr, rope_ptr, part_ptr, stat_ptr, layer, scale, qkv_stride,
                       H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                       D: tl.constexpr, DP: tl.constexpr, SPLIT: tl.constexpr, NSPLIT: tl.constexpr,
                       BLOCK: tl.constexpr, FIELDS: tl.constexpr, IEEE: tl.constexpr, STORE: tl.constexpr,
                       ROPE: tl.constexpr, EARLY: tl.constexpr, DEPENDENT: tl.constexpr, STRETCH: tl.constexpr):
        """EARLY (rows that store their own keys): the piece's first block of the cache is
        read before the wait for the kernel before (which writes qkv, never the cache: the
        positions before a row's own were stored by earlier steps, and its own position is
        taken from qkv), and each block's successor before the block's arithmetic."""
        if DEPENDENT:
            gdc_launch_dependents()
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        row = rows_ptr + b * FIELDS
        p_new = tl.load(row + 1).to(tl.int32)
        k_off = tl.load(row + 2)
        layer_stride = tl.load(row + 3)
        v_off = tl.load(row + 4)
        head_stride = tl.load(row + 5)
        k_base = kv_ptr + k_off + layer * layer_stride + h * head_stride
        v_base = k_base + v_off
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        gm = g < G
        dm = d < D
        span = _piece_span(p_new, SPLIT, NSPLIT, STRETCH)
        lo = s * span
        if lo > p_new:  # a piece past the row's end, which the merge does not read
            return
        hi = tl.minimum(lo + span, p_new + 1)
        if EARLY:
            k_next, v_next = _cache_block(k_base, v_base, lo + tl.arange(0, BLOCK), hi, d, dm, D)
        if DEPENDENT:
            gdc_wait()

        q_row = qkv_ptr + b * qkv_stride
        q_mask = gm[:, None] & dm[None, :]
        q_heads = q_row + (h * G + g)[:, None] * D
        if ROPE:
            cos, sin = _turns(rope_ptr, p_new, d, dm, D)
            q = _turned(q_heads, d[None, :], q_mask, cos[None, :], sin[None, :])
        else:
            q = tl.load(q_heads + d[None, :], mask=q_mask, other=0.0)
        # Scaled in float32, then in the cache's dtype for the tensor cores, as eager decoding does.
        q = (q * scale).to(kv_ptr.dtype.element_ty)  # [GP, DP]; rows >= G are zero padding
        # The new key and value, rounded to the cache's dtype as a later read would see them.
        k_new = _new_key(q_row, rope_ptr, p_new, h, d, dm, H, D, ROPE).to(kv_ptr.dtype.element_ty)
        v_new = tl.load(q_row + (H + HKV) * D + h * D + d, mask=dm, other=0.0).to(kv_ptr.dtype.element_ty)
        if STORE:  # the piece that holds the row's position stores its key and value
            p_vec = d * 0 + p_new  # (a vector: Triton's interpreter takes no scalar in a mask)
            mine = dm & (p_vec >= lo) & (p_vec < lo + span)
            tl.store(k_base + p_new * D + d, k_new, mask=mine)
            tl.store(v_base + p_new * D + d, v_new, mask=mine)

        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        # A fixed trip count keeps the inner loop free of loaded bounds; blocks past the row's
        # end are skipped whole.  A stretched piece runs it once per SPLIT of its span.
        for c in range(0, span, SPLIT):
            for j in range(0, SPLIT, BLOCK):
                if lo + c + j < hi:
                    n = lo + c + j + tl.arange(0, BLOCK)
                    nm = n < hi
                    is_new = (n == p_new)[:, None]
                    if EARLY:
                        k, v = k_next, v_next
                        k_next, v_next = _cache_block(k_base, v_base, n + BLOCK, hi, d, dm, D)
                    else:
                        k, v = _cache_block(k_base, v_base, n, hi, d, dm, D)
                    k = tl.where(is_new, k_new[None, :], k)  # [BLOCK, DP]
                    if IEEE:
                        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
                    else:
                        sc = tl.dot(q, tl.trans(k))  # [GP, BLOCK] float32
                    sc = tl.where(nm[None, :], sc, float("-inf"))
                    v = tl.where(is_new, v_new[None, :], v)
                    acc, m_i, l_i = _softmax_block(sc, v, acc, m_i, l_i, IEEE)
        _store_piece(part_ptr, stat_ptr, (b * H + h * G + g) * NSPLIT + s, acc, m_i, l_i, gm, d, DP)

    @triton.jit
    def _store_rows(qkv_ptr, kv_ptr, rows_ptr, rope_ptr, layer, qkv_stride, H: tl.constexpr, HKV: tl.constexpr,
                    D: tl.constexpr, DP: tl.constexpr, FIELDS: tl.constexpr, ROPE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        row = rows_ptr + b * FIELDS
        p_new = tl.load(row + 1)
        k_base = kv_ptr + tl.load(row + 2) + layer * tl.load(row + 3) + h * tl.load(row + 5)
        d = tl.arange(0, DP)
        dm = d < D
        q_row = qkv_ptr + b * qkv_stride
        k_new = _new_key(q_row, rope_ptr, p_new, h, d, dm, H, D, ROPE).to(kv_ptr.dtype.element_ty)
        v_new = tl.load(q_row + (H + HKV) * D + h * D + d, mask=dm, other=0.0).to(kv_ptr.dtype.element_ty)
        tl.store(k_base + p_new * D + d, k_new, mask=dm)
        tl.store(k_base + tl.load(row + 4) + p_new * D + d, v_new, mask=dm)

    @triton.jit
    def _merge_pieces(part_ptr, stat_ptr, rows_ptr, out_ptr,
                      H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SPLIT: tl.constexpr,
                      NSPLIT: tl.constexpr, NSP: tl.constexpr, FIELDS: tl.constexpr, DB: tl.constexpr,
                      DEPENDENT: tl.constexpr, STRETCH: tl.constexpr):
        dependent_start(DEPENDENT)
        b = tl.program_id(0)
        hh = tl.program_id(1)
        p_new = tl.load(rows_ptr + b * FIELDS + 1).to(tl.int32)
        span = _piece_span(p_new, SPLIT, NSPLIT, STRETCH)
        n_used = (p_new + span) // span
        s = tl.arange(0, NSP)
        sm = s < n_used
        d = tl.program_id(2) * DB + tl.arange(0, DB)  # this program's DB of the DP values
        where = (b * H + hh) * NSPLIT + s
        m = tl.load(stat_ptr + where * 2, mask=sm, other=float("-inf"))
        l = tl.load(stat_ptr + where * 2 + 1, mask=sm, other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))  # piece 0 always holds position 0: the max is finite
        acc = tl.load(part_ptr + where[:, None] * DP + d[None, :], mask=sm[:, None], other=0.0)
        num = tl.sum(w[:, None] * acc, axis=0)
        den = tl.sum(w * l, axis=0)
        tl.store(out_ptr + b * (H * D) + hh * D + d, (num / den).to(out_ptr.dtype.element_ty), mask=d < D)

    @triton.jit
    def _attend_latent(ql_ptr, qr_ptr, new_ptr, kv_ptr, rows_ptr, part_ptr, stat_ptr, layer, scale, ql_row, ql_head,
                       H: tl.constexpr, GH: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
                       E: tl.constexpr, EP: tl.constexpr, SPLIT: tl.constexpr, NSPLIT: tl.constexpr,
                       BLOCK: tl.constexpr, FIELDS: tl.constexpr, IEEE: tl.constexpr, STORE: tl.constexpr):
        b = tl.program_id(0)
        hg = tl.program_id(1)
        s = tl.program_id(2)
        W: tl.constexpr = R + E  # a cached row: the latent, then the rotated key part
        row = rows_ptr + b * FIELDS
        p_new = tl.load(row + 1).to(tl.int32)
        lo = s * SPLIT
        if lo > p_new:  # a piece past the row's end, which the merge does not read
            return
        base = kv_ptr + tl.load(row + 2) + layer * tl.load(row + 3)
        heads = hg * GH + tl.arange(0, GH)
        hm = heads < H
        r = tl.arange(0, RP)
        e = tl.arange(0, EP)
        rm = r < R
        em = e < E
        dt = kv_ptr.dtype.element_ty
        q_lat = tl.load(ql_ptr + b * ql_row + heads[:, None] * ql_head + r[None, :], mask=hm[:, None] & rm[None, :],
                        other=0.0)
        q_lat = (q_lat * scale).to(dt)
        q_rope = tl.load(qr_ptr + (b * H + heads)[:, None] * E + e[None, :], mask=hm[:, None] & em[None, :], other=0.0)
        q_rope = (q_rope * scale).to(dt)
        new_lat = tl.load(new_ptr + b * W + r, mask=rm, other=0.0).to(dt)
        new_rope = tl.load(new_ptr + b * W + R + e, mask=em, other=0.0).to(dt)
        hi = tl.minimum(lo + SPLIT, p_new + 1)
        if STORE:
            # Stored by the first head group's program whose piece holds p_new.
            if (hg == 0) & (p_new >= lo) & (p_new < lo + SPLIT):
                tl.store(base + p_new * W + r, new_lat, mask=rm)
                tl.store(base + p_new * W + R + e, new_rope, mask=em)

        m_i = tl.full([GH], float("-inf"), tl.float32)
        l_i = tl.zeros([GH], tl.float32)
        acc = tl.zeros([GH, RP], tl.float32)
        for j in range(0, SPLIT, BLOCK):
            if lo + j < hi:
                n = lo + j + tl.arange(0, BLOCK)
                nm = n < hi
                is_new = (n == p_new)[:, None]
                lat = tl.load(base + n[:, None] * W + r[None, :], mask=nm[:, None] & rm[None, :], other=0.0)
                lat = tl.where(is_new, new_lat[None, :], lat)  # [BLOCK, RP]
                rot = tl.load(base + n[:, None] * W + R + e[None, :], mask=nm[:, None] & em[None, :], other=0.0)
                rot = tl.where(is_new, new_rope[None, :], rot)  # [BLOCK, EP]
                if IEEE:
                    sc = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
                    sc += tl.dot(q_rope, tl.trans(rot), input_precision="ieee")
                else:
                    sc = tl.dot(q_lat, tl.trans(lat))
                    sc += tl.dot(q_rope, tl.trans(rot))  # [GH, BLOCK] float32
                sc = tl.where(nm[None, :], sc, float("-inf"))
                acc, m_i, l_i = _softmax_block(sc, lat, acc, m_i, l_i, IEEE)
        _store_piece(part_ptr, stat_ptr, (b * H + heads) * NSPLIT + s, acc, m_i, l_i, hm, r, RP)

    @triton.jit
    def _store_latent(new_ptr, kv_ptr, rows_ptr, layer, W: tl.constexpr, WP: tl.constexpr, FIELDS: tl.constexpr):
        b = tl.program_id(0)
        row = rows_ptr + b * FIELDS
        base = kv_ptr + tl.load(row + 2) + layer * tl.load(row + 3)
        w = tl.arange(0, WP)
        new = tl.load(new_ptr + b * W + w, mask=w < W, other=0.0).to(kv_ptr.dtype.element_ty)
        tl.store(base + tl.load(row + 1) * W + w, new, mask=w < W)

    @triton.jit
    def _latent_inputs(q_ptr, kv_ptr, turn_ptr, w_ptr, qr_ptr, new_ptr, q_row, kv_row, eps,
                       H: tl.constexpr, HP: tl.constexpr, HD: tl.constexpr, NOPE: tl.constexpr,
                       R: tl.constexpr, RP: tl.constexpr, E: tl.constexpr, EH: tl.constexpr):
        b = tl.program_id(0)
        W: tl.constexpr = R + E
        r = tl.arange(0, RP)
        rm = r < R
        lat = tl.load(kv_ptr + b * kv_row + r, mask=rm, other=0.0)
        w = tl.load(w_ptr + r, mask=rm, other=0.0)
        inv = tl.rsqrt(tl.sum(lat * lat, axis=0) / R + eps)  # engine.cuda_elementwise's RMSNorm
        tl.store(new_ptr + b * W + r, lat * inv * w, mask=rm)
        i = tl.arange(0, EH)  # rotated pairs (2i, 2i + 1)
        im = i < E // 2
        cos = tl.load(turn_ptr + b * E + 2 * i, mask=im, other=1.0)
        sin = tl.load(turn_ptr + b * E + 2 * i + 1, mask=im, other=0.0)
        k = kv_ptr + b * kv_row + R + 2 * i
        x0 = tl.load(k, mask=im, other=0.0)
        x1 = tl.load(k + 1, mask=im, other=0.0)
        tl.store(new_ptr + b * W + R + 2 * i, x0 * cos - x1 * sin, mask=im)
        tl.store(new_ptr + b * W + R + 2 * i + 1, x0 * sin + x1 * cos, mask=im)
        h = tl.arange(0, HP)
        m = (h < H)[:, None] & im[None, :]
        q = q_ptr + b * q_row + h[:, None] * HD + NOPE + 2 * i[None, :]
        y0 = tl.load(q, mask=m, other=0.0)
        y1 = tl.load(q + 1, mask=m, other=0.0)
        out = qr_ptr + (b * H + h[:, None]) * E + 2 * i[None, :]
        tl.store(out, y0 * cos[None, :] - y1 * sin[None, :], mask=m)
        tl.store(out + 1, y0 * sin[None, :] + y1 * cos[None, :], mask=m)

    @triton.jit
    def _prefill_inputs(qkv_ptr, rope_ptr, q_ptr, kv_ptr, start, qkv_stride, k_head, v_offset,
                        H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                        HB: tl.constexpr, ROPE: tl.constexpr):
        t = tl.program_id(0)
        hh = tl.program_id(1) * HB + tl.arange(0, HB)  # query heads, then key heads, then value heads
        d = tl.arange(0, DP)
        m = (hh < H + 2 * HKV)[:, None] & (d < D)[None, :]
        row = qkv_ptr + t * qkv_stride + hh[:, None] * D
        x = tl.load(row + d[None, :], mask=m, other=0.0).to(tl.float32)
        p = start + t
        if ROPE:
            cos, sin = _turns(rope_ptr, p, d, d < D, D)
            x = tl.where((hh < H + HKV)[:, None], _turned(row, d[None, :], m, cos[None, :], sin[None, :]), x)
        is_q = (hh < H)[:, None]
        tl.store(q_ptr + (t * H + hh[:, None]) * D + d[None, :], x.to(q_ptr.dtype.element_ty), mask=m & is_q)
        kv_head = tl.where(hh < H + HKV, hh - H, hh - H - HKV)
        at = kv_ptr + tl.where(hh < H + HKV, 0, v_offset)[:, None] + kv_head[:, None] * k_head + p * D + d[None, :]
        tl.store(at, x.to(kv_ptr.dtype.element_ty), mask=m & ~is_q)


def decode_attention(qkv: torch.Tensor, rows: torch.Tensor, layer: int, kv_base: torch.Tensor,
                     work: Workspace, n_head: int, n_head_kv: int, head_dim: int,
                     store_first: bool = False, rope: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H * D] attention outputs in work.out's dtype (overwritten by the next call);
    `store_first` for rows that share a cache (see the module's docstring).  With `rope`, a
    [positions, D] float32 table of each pair's (cos, sin) (`rope_pairs`), qkv's queries and keys
    enter unrotated and the kernels turn them by each row's position as they load them."""
    B = qkv.shape[0]
    H, Hkv, D = n_head, n_head_kv, head_dim
    G = H // Hkv
    turns = qkv if rope is None else rope  # an unread pointer where ROPE is off
    if rope is not None and (rope.dtype != torch.float32 or rope.shape[1] != D or not rope.is_contiguous()):
        raise ValueError(f"rope must be a contiguous [positions, {D}] float32 table, "
                         f"got {tuple(rope.shape)} {rope.dtype}")
    if store_first:
        _store_rows[(B, Hkv)](qkv, kv_base, rows, turns, layer, qkv.stride(0), H=H, HKV=Hkv, D=D, DP=work.dp,
                              FIELDS=ROW_FIELDS, ROPE=rope is not None, num_warps=1)
    dependent = dependent_launch(qkv.device)
    _attend_pieces[(B, Hkv, work.n_split)](
        qkv, kv_base, rows, turns, work.part, work.stat, layer, D ** -0.5, qkv.stride(0),
        H=H, HKV=Hkv, G=G, GP=max(triton.next_power_of_2(G), 16), D=D, DP=work.dp, SPLIT=work.split,
        NSPLIT=work.n_split, BLOCK=work.block, FIELDS=ROW_FIELDS, IEEE=kv_base.dtype == torch.float32,
        STORE=not store_first, ROPE=rope is not None, EARLY=EARLY_CACHE_READS and not store_first,
        DEPENDENT=dependent, STRETCH=work.stretch, launch_pdl=dependent, num_warps=4)
    _merge(work, rows, B, H, D)
    return work.out


def prefill_inputs(qkv: torch.Tensor, kv: torch.Tensor, start: int, n_head: int, n_head_kv: int, head_dim: int,
                   rope: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill chunk's attention inputs in one kernel: `qkv` [T, (H + 2*Hkv) * D] (any float
    dtype, rows of contiguous elements) holds the projections of T rows at positions start..;
    with `rope` (`rope_pairs`' [positions, D] float32 table) queries and keys are turned by each
    row's position, in float32.  Keys and values are stored into the layer's cache `kv` [2, Hkv,
    cap, D] (rounded to its dtype) and the queries returned as [T, H, D] in that dtype, so that
    `.transpose(0, 1)` is the [H, T, D] view the fused attention kernels read without a copy."""
    T = qkv.shape[0]
    H, Hkv, D = n_head, n_head_kv, head_dim
    if qkv.stride(-1) != 1 or qkv.shape[1] != (H + 2 * Hkv) * D:
        raise ValueError(f"qkv must be [T, {(H + 2 * Hkv) * D}] with contiguous rows, got {tuple(qkv.shape)}")
    if kv.shape[0] != 2 or kv.shape[1] != Hkv or kv.shape[3] != D or kv.stride(2) != D or kv.stride(3) != 1:
        raise ValueError(f"kv must be a layer's [2, {Hkv}, cap, {D}] cache, got {tuple(kv.shape)}")
    if start + T > kv.shape[2]:
        raise ValueError(f"positions {start}..{start + T - 1} do not fit a cache of {kv.shape[2]}")
    if rope is not None and (rope.dtype != torch.float32 or rope.shape[1] != D or not rope.is_contiguous()
                             or rope.shape[0] < start + T):
        raise ValueError(f"rope must be a contiguous [positions, {D}] float32 table of at least {start + T} "
                         f"positions, got {tuple(rope.shape)} {rope.dtype}")
    q = torch.empty((T, H, D), dtype=kv.dtype, device=qkv.device)
    if T:
        dp = triton.next_power_of_2(D)
        hb = max(1, min(triton.next_power_of_2(H + 2 * Hkv), 2048 // dp))
        _prefill_inputs[(T, triton.cdiv(H + 2 * Hkv, hb))](
            qkv, qkv if rope is None else rope, q, kv, start, qkv.stride(0), kv.stride(1), kv.stride(0),
            H=H, HKV=Hkv, D=D, DP=dp, HB=hb, ROPE=rope is not None, num_warps=4)
    return q


def _merge(work: Workspace, rows: torch.Tensor, B: int, H: int, D: int) -> None:
    """work.out <- the pieces' partial results merged, each head's D values in programs of
    MERGE_WIDTH (one program where D fits in one)."""
    db = min(work.dp, MERGE_WIDTH)
    dependent = dependent_launch(rows.device)
    _merge_pieces[(B, H, work.dp // db)](
        work.part, work.stat, rows, work.out, H=H, D=D, DP=work.dp, SPLIT=work.split,
        NSPLIT=work.n_split, NSP=triton.next_power_of_2(work.n_split), FIELDS=ROW_FIELDS, DB=db,
        DEPENDENT=dependent, STRETCH=work.stretch, launch_pdl=dependent, num_warps=4)


def latent_inputs(q: torch.Tensor, kv: torch.Tensor, turns: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  n_head: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's projections -> latent_attention's inputs, in one kernel: q [B, H * head_dim]
    float32 (each head's nope unrotated values, then its adjacent pairs to rotate) and kv [B,
    rank + rope] float32 (the latent, then the key's pairs), rows of contiguous elements that may
    be slices of wider rows; turns [B, rope / 2, 2] (cos, sin) at each row's position.  Returns
    (the heads' rotated parts [B, H, rope], the new cache rows [B, rank + rope]: the latent
    RMS-normed by `norm_weight`, then the rotated key part), float32 and contiguous."""
    B, W = kv.shape
    E = turns.shape[1] * 2
    R = W - E
    head_dim = q.shape[1] // n_head
    if q.stride(1) != 1 or kv.stride(1) != 1:
        raise ValueError("latent_inputs takes rows of contiguous elements")
    q_rope = torch.empty((B, n_head, E), dtype=torch.float32, device=q.device)
    new = torch.empty((B, W), dtype=torch.float32, device=q.device)
    _latent_inputs[(B,)](q, kv, turns.contiguous(), norm_weight, q_rope, new, q.stride(0), kv.stride(0), eps,
                         H=n_head, HP=triton.next_power_of_2(n_head), HD=head_dim, NOPE=nope, R=R,
                         RP=triton.next_power_of_2(R), E=E, EH=triton.next_power_of_2(E // 2), num_warps=4)
    return q_rope, new


def latent_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, layer: int,
                     kv_base: torch.Tensor, work: Workspace, scale: float, store_first: bool = False) -> torch.Tensor:
    """[B, H * rank] float32: each head's softmax(scale * [q_lat, q_rope] . cached rows) over the
    row's positions 0..p, applied to the latent parts (see the module's docstring).  q_lat
    [B, H, rank] (any row and head strides, its values contiguous: e.g. a batched product's
    [H, B, rank] output transposed), q_rope [B, H, rope] and new [B, rank + rope] contiguous;
    `store_first` as in decode_attention."""
    B, H, rank = q_lat.shape
    W = new.shape[1]
    if q_lat.stride(2) != 1:
        q_lat = q_lat.contiguous()
    if store_first:
        _store_latent[(B,)](new, kv_base, rows, layer, W=W, WP=triton.next_power_of_2(W), FIELDS=ROW_FIELDS,
                            num_warps=4)
    _attend_latent[(B, -(-H // LATENT_HEADS), work.n_split)](
        q_lat, q_rope.contiguous(), new, kv_base, rows, work.part, work.stat, layer, scale, q_lat.stride(0),
        q_lat.stride(1), H=H, GH=LATENT_HEADS, R=rank, RP=work.dp, E=W - rank, EP=_padded(W - rank),
        SPLIT=work.split, NSPLIT=work.n_split, BLOCK=LATENT_BLOCK, FIELDS=ROW_FIELDS,
        IEEE=kv_base.dtype == torch.float32, STORE=not store_first, num_warps=LATENT_WARPS)
    _merge(work, rows, B, H, rank)
    return work.out


def reference_latent(q: torch.Tensor, new: torch.Tensor, layers: list[torch.Tensor], positions: list[int],
                     rank: int, scale: float) -> torch.Tensor:
    """Torch ops: stores each row's new cache row into its layer cache [capacity, W] at its
    position, then attends with latent_attention's roundings (queries and probabilities in the
    cache's dtype, float32 arithmetic) -> [B, H * rank] float32.  Rows sharing a layer at
    consecutive positions see each other as a prefill's rows do."""
    for i, (layer, p) in enumerate(zip(layers, positions)):
        layer[p] = new[i].to(layer.dtype)
    out = []
    for i, (layer, p) in enumerate(zip(layers, positions)):
        cached = layer[: p + 1].float()  # [L, W]
        qs = (q[i] * scale).to(layer.dtype).float()  # [H, W]
        probs = torch.softmax(qs @ cached.T, dim=-1).to(layer.dtype).float()
        out.append((probs @ cached[:, :rank]).reshape(-1))
    return torch.stack(out)


def rope_pairs(table: torch.Tensor) -> torch.Tensor:
    """A [positions, D / 2] complex rope table as decode_attention's `rope`: [positions, D]
    float32, each pair's cos then sin (a view where the table is complex64)."""
    return torch.view_as_real(table.to(torch.complex64)).flatten(1)


def reference_attention(qkv: torch.Tensor, layer_kvs: list[torch.Tensor], positions: list[int],
                        n_head: int, n_head_kv: int, head_dim: int, rope: torch.Tensor | None = None) -> torch.Tensor:
    """Torch ops: stores each row's K/V into its layer cache view [2, Hkv, cap, D] at its position,
    then attends with the kernel's roundings (queries and probabilities in the cache's dtype,
    float32 arithmetic) -> [B, H * D] float32.  `rope` [positions, D / 2] complex: queries and
    keys are turned by it first, as the models' torch ops turn them."""
    H, Hkv, D = n_head, n_head_kv, head_dim
    if rope is not None:
        qkv = qkv.clone()
        turns = rope[torch.tensor(positions, device=rope.device)].unsqueeze(1)  # [B, 1, D/2]
        torch.view_as_complex(qkv.view(len(positions), -1, D // 2, 2))[:, : H + Hkv].mul_(turns)
    out = []
    for i, (kv, p) in enumerate(zip(layer_kvs, positions)):
        kv[:, :, p] = qkv[i, H * D:].view(2, Hkv, D).to(kv.dtype)
        keys, vals = kv[0, :, : p + 1].float(), kv[1, :, : p + 1].float()  # [Hkv, L, D]
        q = (qkv[i, : H * D] * D ** -0.5).to(kv.dtype).float().view(Hkv, H // Hkv, D)
        probs = torch.softmax(q @ keys.transpose(1, 2), dim=-1).to(kv.dtype).float()
        out.append((probs @ vals).reshape(H * D))
    return torch.stack(out)
