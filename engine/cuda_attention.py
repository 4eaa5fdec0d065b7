"""Decode attention on CUDA in two Triton kernels: rows of any caches, each at its own length.

`decode_attention(qkv, rows, layer, kv_base, work)` is one decoding step's attention of one
layer for B rows.  `qkv` [B, (H + 2*Hkv) * D] float32 holds each row's rotated query, key and
value; `rows` [B, ROW_FIELDS] int64 holds, per row, its position `p` (the new token's; the
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
kernel merges the pieces.  A group's query heads share one program, so each key is read once
per kv head, and its products run on the tensor cores (the group padded to 16 rows).  As in
eager decoding, queries and probabilities enter the products in the cache's dtype (float32
caches: full float32 products) with float32 accumulation; the softmax is float32; the new key
and value enter rounded to the cache's dtype, as they would be read back.

`reference_attention` is the same function in torch ops, for tests.  Without Triton
(`AVAILABLE` is False) nothing here can run; callers keep their torch paths.
It does not compute projections or rope, and knows nothing of sessions.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports
    triton = None
    tl = None

AVAILABLE = triton is not None

# Columns of the row table: token, position, K offset, layer stride, V offset, head stride.
TOKEN, POS, K_OFFSET, LAYER_STRIDE, V_OFFSET, HEAD_STRIDE = range(6)
ROW_FIELDS = 6
BLOCK_N = 32  # positions per inner iteration


def split_size(n_rows: int, n_head_kv: int, n_ctx: int) -> int:
    """Positions per program: short pieces when few (row, kv head) pairs would leave the GPU
    idle, longer ones when many rows already fill it; at most 256 pieces per row."""
    pairs = n_rows * n_head_kv
    split = 64 if pairs <= 16 else 128 if pairs <= 64 else 256
    while -(-n_ctx // split) > 256:
        split *= 2
    return split


class Workspace:
    """Per-launch-shape scratch for the partial results (kept by a captured graph)."""

    def __init__(self, n_rows: int, n_head: int, head_dim: int, n_ctx: int, n_head_kv: int,
                 device: torch.device, out_dtype: torch.dtype = torch.float32):
        self.split = split_size(n_rows, n_head_kv, n_ctx)
        self.n_split = -(-n_ctx // self.split)
        self.dp = max(triton.next_power_of_2(head_dim), 16) if AVAILABLE else head_dim
        self.part = torch.empty((n_rows, n_head, self.n_split, self.dp), dtype=torch.float32, device=device)
        self.stat = torch.empty((n_rows, n_head, self.n_split, 2), dtype=torch.float32, device=device)
        # The output projection's input dtype: bfloat16 where it rounds its input to that anyway.
        self.out = torch.empty((n_rows, n_head * head_dim), dtype=out_dtype, device=device)


if AVAILABLE:
    @triton.jit
    def _attend_pieces(qkv_ptr, kv_ptr, rows_ptr, part_ptr, stat_ptr, layer, scale, qkv_stride,
                       H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                       D: tl.constexpr, DP: tl.constexpr, SPLIT: tl.constexpr, NSPLIT: tl.constexpr,
                       BLOCK: tl.constexpr, FIELDS: tl.constexpr, IEEE: tl.constexpr, STORE: tl.constexpr):
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
        q_row = qkv_ptr + b * qkv_stride
        q = tl.load(q_row + (h * G + g)[:, None] * D + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        # Scaled in float32, then in the cache's dtype for the tensor cores, as eager decoding does.
        q = (q * scale).to(kv_ptr.dtype.element_ty)  # [GP, DP]; rows >= G are zero padding
        # The new key and value, rounded to the cache's dtype as a later read would see them.
        k_new = tl.load(q_row + H * D + h * D + d, mask=dm, other=0.0).to(kv_ptr.dtype.element_ty)
        v_new = tl.load(q_row + (H + HKV) * D + h * D + d, mask=dm, other=0.0).to(kv_ptr.dtype.element_ty)
        lo = s * SPLIT
        hi = tl.minimum(lo + SPLIT, p_new + 1)
        if STORE:
            mine = (p_new >= lo) & (p_new < lo + SPLIT)
            tl.store(k_base + p_new * D + d, k_new, mask=dm & mine)
            tl.store(v_base + p_new * D + d, v_new, mask=dm & mine)

        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        # A fixed trip count keeps the loop free of loaded bounds; blocks past the row's end
        # are skipped whole.
        for j in range(0, SPLIT, BLOCK):
            if lo + j < hi:
                n = lo + j + tl.arange(0, BLOCK)
                nm = n < hi
                is_new = (n == p_new)[:, None]
                kv_mask = nm[:, None] & dm[None, :]
                k = tl.load(k_base + n[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
                k = tl.where(is_new, k_new[None, :], k)  # [BLOCK, DP]
                if IEEE:
                    sc = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    sc = tl.dot(q, tl.trans(k))  # [GP, BLOCK] float32
                sc = tl.where(nm[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_base + n[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
                v = tl.where(is_new, v_new[None, :], v)
                if IEEE:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        heads = b * H + h * G + g  # [GP]
        where = heads * NSPLIT + s
        tl.store(part_ptr + where[:, None] * DP + d[None, :], acc, mask=gm[:, None])
        tl.store(stat_ptr + where * 2, m_i, mask=gm)
        tl.store(stat_ptr + where * 2 + 1, l_i, mask=gm)

    @triton.jit
    def _store_rows(qkv_ptr, kv_ptr, rows_ptr, layer, qkv_stride, H: tl.constexpr, HKV: tl.constexpr,
                    D: tl.constexpr, DP: tl.constexpr, FIELDS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        row = rows_ptr + b * FIELDS
        p_new = tl.load(row + 1)
        k_base = kv_ptr + tl.load(row + 2) + layer * tl.load(row + 3) + h * tl.load(row + 5)
        d = tl.arange(0, DP)
        dm = d < D
        q_row = qkv_ptr + b * qkv_stride
        k_new = tl.load(q_row + H * D + h * D + d, mask=dm, other=0.0).to(kv_ptr.dtype.element_ty)
        v_new = tl.load(q_row + (H + HKV) * D + h * D + d, mask=dm, other=0.0).to(kv_ptr.dtype.element_ty)
        tl.store(k_base + p_new * D + d, k_new, mask=dm)
        tl.store(k_base + tl.load(row + 4) + p_new * D + d, v_new, mask=dm)

    @triton.jit
    def _merge_pieces(part_ptr, stat_ptr, rows_ptr, out_ptr,
                      H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SPLIT: tl.constexpr,
                      NSPLIT: tl.constexpr, NSP: tl.constexpr, FIELDS: tl.constexpr):
        b = tl.program_id(0)
        hh = tl.program_id(1)
        length = tl.load(rows_ptr + b * FIELDS + 1).to(tl.int32) + 1
        n_used = (length + SPLIT - 1) // SPLIT
        s = tl.arange(0, NSP)
        sm = s < n_used
        d = tl.arange(0, DP)
        where = (b * H + hh) * NSPLIT + s
        m = tl.load(stat_ptr + where * 2, mask=sm, other=float("-inf"))
        l = tl.load(stat_ptr + where * 2 + 1, mask=sm, other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))  # piece 0 always holds position 0: the max is finite
        acc = tl.load(part_ptr + where[:, None] * DP + d[None, :], mask=sm[:, None], other=0.0)
        num = tl.sum(w[:, None] * acc, axis=0)
        den = tl.sum(w * l, axis=0)
        tl.store(out_ptr + b * (H * D) + hh * D + d, (num / den).to(out_ptr.dtype.element_ty), mask=d < D)


def decode_attention(qkv: torch.Tensor, rows: torch.Tensor, layer: int, kv_base: torch.Tensor,
                     work: Workspace, n_head: int, n_head_kv: int, head_dim: int,
                     store_first: bool = False) -> torch.Tensor:
    """[B, H * D] attention outputs in work.out's dtype (overwritten by the next call);
    `store_first` for rows that share a cache (see the module's docstring)."""
    B = qkv.shape[0]
    H, Hkv, D = n_head, n_head_kv, head_dim
    G = H // Hkv
    if store_first:
        _store_rows[(B, Hkv)](qkv, kv_base, rows, layer, qkv.stride(0), H=H, HKV=Hkv, D=D, DP=work.dp,
                              FIELDS=ROW_FIELDS, num_warps=1)
    _attend_pieces[(B, Hkv, work.n_split)](
        qkv, kv_base, rows, work.part, work.stat, layer, D ** -0.5, qkv.stride(0),
        H=H, HKV=Hkv, G=G, GP=max(triton.next_power_of_2(G), 16), D=D, DP=work.dp, SPLIT=work.split,
        NSPLIT=work.n_split, BLOCK=BLOCK_N, FIELDS=ROW_FIELDS, IEEE=kv_base.dtype == torch.float32,
        STORE=not store_first, num_warps=4)
    _merge_pieces[(B, H)](
        work.part, work.stat, rows, work.out, H=H, D=D, DP=work.dp, SPLIT=work.split,
        NSPLIT=work.n_split, NSP=triton.next_power_of_2(work.n_split), FIELDS=ROW_FIELDS, num_warps=4)
    return work.out


def reference_attention(qkv: torch.Tensor, layer_kvs: list[torch.Tensor], positions: list[int],
                        n_head: int, n_head_kv: int, head_dim: int) -> torch.Tensor:
    """Torch ops: stores each row's K/V into its layer cache view [2, Hkv, cap, D] at its position,
    then attends with the kernel's roundings (queries and probabilities in the cache's dtype,
    float32 arithmetic) -> [B, H * D] float32."""
    H, Hkv, D = n_head, n_head_kv, head_dim
    out = []
    for i, (kv, p) in enumerate(zip(layer_kvs, positions)):
        kv[:, :, p] = qkv[i, H * D:].view(2, Hkv, D).to(kv.dtype)
        keys, vals = kv[0, :, : p + 1].float(), kv[1, :, : p + 1].float()  # [Hkv, L, D]
        q = (qkv[i, : H * D] * D ** -0.5).to(kv.dtype).float().view(Hkv, H // Hkv, D)
        probs = torch.softmax(q @ keys.transpose(1, 2), dim=-1).to(kv.dtype).float()
        out.append((probs @ vals).reshape(H * D))
    return torch.stack(out)
