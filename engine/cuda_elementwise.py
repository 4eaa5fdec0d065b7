"""The elementwise steps of a CUDA decoding step, one Triton kernel each, writing the dtype
the next matmul reads.

- `rms_norm(x, w, eps, out_dtype)`: x [N, n] float32 (rows of contiguous elements, which may
  be slices of wider rows), w [n] float32 ->
  x * rsqrt(mean(x^2) + eps) * w, one program per row, float32 arithmetic.  The torch
  expression (`engine.models.llama.TorchKernels.norm`, then the matmul's cast) is five elementwise and reduction
  kernels and a cast.  The mean square is summed in another order than torch's, so results
  differ in the last bits.
- `head_norms_(qkv, q_weight, k_weight, H, Hkv, eps)`: qwen3's per-head RMSNorms of the query
  and key heads, in place in the projections' rows, float32: one kernel where torch's
  expression is five for each and two copies back.
- `swiglu(gate_up, out_dtype, op_dtype=None, paired=False)`: gate_up [N, 2 * n_ff] (gate, then
  up, or with `paired` gate j and up j side by side; float32
  from int4 products, bfloat16 from dense ones and from int4 products of prefill rows, which
  cuBLAS rounded to it: `op_dtype` float32 then) -> silu(gate) * up [N, n_ff], computed as torch
  computes `F.silu(gate) * up` on tensors of `op_dtype` (default gate_up's; float32 arithmetic,
  each op's result rounded to it), so eager and graph steps agree bitwise up to here; torch's is
  a slice, two kernels and a cast.  Rounding to bfloat16 here is the rounding the int4 products
  apply to their inputs anyway.

- `FusedStepKernels(eps, out_dtype)`: the two as engine.models.llama's StepKernels, for graph
  steps and eager prefill chunks alike.

- `greedy_pair(rows, eos_index)`: each row's argmax, plain and with end-of-generation ids
  masked (engine.device_sampling's greedy ids), in two kernels.

In a graph-replayed decoding step (engine.cuda_graphs), where each kernel costs a few
microseconds whatever its size, kernels saved are time saved.  Without Triton
(`cuda_attention.AVAILABLE` False) nothing here is used.  It knows nothing of models.
"""
from __future__ import annotations

import torch

from engine.cuda_attention import AVAILABLE, dependent_launch, tl, triton

if AVAILABLE:
    from triton.language.extra import libdevice

    from engine.cuda_attention import dependent_start

    # torch dtypes as the SwiGLU kernel's rounding dtype (`swiglu`'s op_dtype)
    _OP_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _rms_norm(x_ptr, w_ptr, out_ptr, n, x_stride, eps, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr):
        dependent_start(DEPENDENT)
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        m = c < n
        x = tl.load(x_ptr + r * x_stride + c, mask=m, other=0.0)
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        tl.store(out_ptr + r * n + c, (x * inv * w).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _head_norms(x_ptr, qw_ptr, kw_ptr, row_stride, eps, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)  # q heads first, then k heads
        d = tl.arange(0, DP)
        m = d < D
        p = x_ptr + t * row_stride + h * D + d
        x = tl.load(p, mask=m, other=0.0)
        w = tl.where(h < H, tl.load(qw_ptr + d, mask=m, other=0.0), tl.load(kw_ptr + d, mask=m, other=0.0))
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        tl.store(p, x * inv * w, mask=m)

    @triton.jit
    def silu_times(gate, up, OP: tl.constexpr):
        """silu(gate) * up of float32 values, as torch computes `F.silu(gate) * up` on tensors of
        the dtype OP: x / (1 + exp(-x)) with the accurate exp and a correctly rounded division,
        each op's result rounded to OP (returned in OP).  The one formula of every SwiGLU kernel
        (here and engine.cuda_int4's products that end in it), so they agree bitwise."""
        silu = tl.div_rn(gate, 1.0 + libdevice.exp(-gate)).to(OP).to(tl.float32)
        return (silu * up).to(OP)

    @triton.jit
    def _swiglu(gu_ptr, out_ptr, n_ff, BLOCK: tl.constexpr, OP: tl.constexpr, PAIRED: tl.constexpr,
                DEPENDENT: tl.constexpr):
        dependent_start(DEPENDENT)
        r = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < n_ff
        if PAIRED:  # gate j and up j side by side (engine.cuda_int4.Int4Weight.paired_halves' columns)
            gate_at, up_at = gu_ptr + r * 2 * n_ff + 2 * c, gu_ptr + r * 2 * n_ff + 2 * c + 1
        else:
            gate_at, up_at = gu_ptr + r * 2 * n_ff + c, gu_ptr + r * 2 * n_ff + n_ff + c
        gate = tl.load(gate_at, mask=m, other=0.0).to(tl.float32)
        up = tl.load(up_at, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * n_ff + c, silu_times(gate, up, OP).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _chunk_argmax(rows_ptr, eos_ptr, val_ptr, idx_ptr, n_vocab, stride, n_chunks,
                      E: tl.constexpr, HAS_EOS: tl.constexpr, BLOCK: tl.constexpr):
        """Per (row, chunk of the vocabulary): the max and its lowest index, plain and with the
        end-of-generation ids masked."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        i = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(rows_ptr + r * stride + i, mask=i < n_vocab, other=float("-inf"))
        v0, i0 = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        if HAS_EOS:
            eos = tl.load(eos_ptr + tl.arange(0, E))  # padded with -1
            hit = tl.max((i[:, None] == eos[None, :]).to(tl.int32), axis=1)
            v1, i1 = tl.max(tl.where(hit > 0, float("-inf"), x), axis=0, return_indices=True,
                            return_indices_tie_break_left=True)
        else:
            v1, i1 = v0, i0
        at = (r * n_chunks + c) * 2
        tl.store(val_ptr + at, v0)
        tl.store(val_ptr + at + 1, v1)
        tl.store(idx_ptr + at, c * BLOCK + i0)
        tl.store(idx_ptr + at + 1, c * BLOCK + i1)

    @triton.jit
    def _merge_argmax(val_ptr, idx_ptr, out_ptr, n_chunks, NC: tl.constexpr):
        r = tl.program_id(0)
        k = tl.program_id(1)  # 0: plain, 1: eos masked
        c = tl.arange(0, NC)
        m = c < n_chunks
        at = (r * n_chunks + c) * 2 + k
        v = tl.load(val_ptr + at, mask=m, other=float("-inf"))
        idx = tl.load(idx_ptr + at, mask=m, other=0)
        _, best = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)  # lowest chunk
        tl.store(out_ptr + r * 2 + k, tl.sum(tl.where(c == best, idx, 0), axis=0).to(tl.int64))


ARGMAX_BLOCK = 4096


def greedy_pair(rows: torch.Tensor, eos_index: torch.Tensor | None) -> torch.Tensor:
    """rows [N, n_vocab] float32 -> [N, 2] int64: each row's argmax, and its argmax with the
    ids in `eos_index` masked; ties go to the lowest id, as torch.argmax's do.  Two kernels
    (chunks of the vocabulary, then their merge) where torch takes a copy, two one-block
    reductions and a stack."""
    n, n_vocab = rows.shape
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    chunks = triton.cdiv(n_vocab, ARGMAX_BLOCK)
    vals = torch.empty((n, chunks, 2), dtype=torch.float32, device=rows.device)
    idx = torch.empty((n, chunks, 2), dtype=torch.int32, device=rows.device)
    out = torch.empty((n, 2), dtype=torch.int64, device=rows.device)
    has_eos = eos_index is not None and eos_index.numel() > 0
    eos, e = rows, 1  # without ids the kernel never reads `eos`
    if has_eos:
        e = triton.next_power_of_2(eos_index.numel())
        pad = e - eos_index.numel()
        eos = torch.cat([eos_index, eos_index.new_full((pad,), -1)]) if pad else eos_index
    _chunk_argmax[(n, chunks)](rows, eos, vals, idx, n_vocab, rows.stride(0), chunks, E=e, HAS_EOS=has_eos,
                               BLOCK=ARGMAX_BLOCK, num_warps=8)
    _merge_argmax[(n, 2)](vals, idx, out, chunks, NC=triton.next_power_of_2(chunks), num_warps=1)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    rows, n = x.shape
    if x.stride(1) != 1:  # rows may lie apart (a slice of wider rows), their elements may not
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    block = triton.next_power_of_2(n)
    dependent = dependent_launch(x.device)
    _rms_norm[(rows,)](x, w, out, n, x.stride(0), eps, BLOCK=block, DEPENDENT=dependent, launch_pdl=dependent,
                       num_warps=4 if block <= 1024 else 8)
    return out


def head_norms_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_head: int, n_head_kv: int,
                eps: float) -> None:
    """In place: each query head of qkv [T, (H + 2*Hkv) * D] float32 RMS-normed by q_weight [D],
    each key head by k_weight (qwen3's per-head norms), values untouched; one kernel."""
    T, width = qkv.shape
    D = width // (n_head + 2 * n_head_kv)
    if qkv.stride(1) != 1:
        raise ValueError("head_norms_ takes rows of contiguous elements")
    _head_norms[(T, n_head + n_head_kv)](qkv, q_weight, k_weight, qkv.stride(0), eps, H=n_head, D=D,
                                         DP=triton.next_power_of_2(D), num_warps=1 if D <= 128 else 4)


def swiglu(gate_up: torch.Tensor, out_dtype: torch.dtype, op_dtype: torch.dtype | None = None,
           paired: bool = False) -> torch.Tensor:
    rows, width = gate_up.shape
    n_ff = width // 2
    gate_up = gate_up.contiguous()
    out = torch.empty((rows, n_ff), dtype=out_dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(n_ff), 2048)
    op = _OP_DTYPES[op_dtype or gate_up.dtype]
    dependent = dependent_launch(out.device)
    _swiglu[(rows, triton.cdiv(n_ff, block))](gate_up, out, n_ff, BLOCK=block, OP=op, PAIRED=paired,
                                              DEPENDENT=dependent, launch_pdl=dependent,
                                              num_warps=4 if block <= 1024 else 8)
    return out


class FusedStepKernels:
    """A forward pass's norms and SwiGLU (engine.models.llama.StepKernels) as the kernels above,
    writing the dtype the following matmul computes in."""

    def __init__(self, eps: float, out_dtype: torch.dtype):
        self.eps = eps
        self.out_dtype = out_dtype

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.out_dtype)

    def swiglu(self, gate_up: torch.Tensor, op_dtype: torch.dtype | None = None) -> torch.Tensor:
        return swiglu(gate_up, self.out_dtype, op_dtype)
