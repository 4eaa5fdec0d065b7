"""RMSNorm on CUDA in one Triton kernel, writing the dtype the next matmul reads.

`rms_norm(x, w, eps, out_dtype)`: x [N, n] float32 (contiguous rows), w [n] float32 ->
x * rsqrt(mean(x^2) + eps) * w in `out_dtype`, one program per row, float32 arithmetic.
The torch expression (`LlamaModel._norm`, then the matmul's cast) is five elementwise and
reduction kernels and a cast; in a graph-replayed decoding step (engine.cuda_graphs), where
each kernel costs a few microseconds whatever its size, that is a third of a layer's kernels.
The mean square is summed in another order than torch's, so results differ in the last bits.
Without Triton (`cuda_attention.AVAILABLE` False) it is not used.  It knows nothing of models.
"""
from __future__ import annotations

import torch

from engine.cuda_attention import AVAILABLE, tl, triton

if AVAILABLE:
    @triton.jit
    def _rms_norm(x_ptr, w_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        m = c < n
        x = tl.load(x_ptr + r * n + c, mask=m, other=0.0)
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        tl.store(out_ptr + r * n + c, (x * inv * w).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    rows, n = x.shape
    if x.stride(1) != 1 or x.stride(0) != n:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm[(rows,)](x, w, out, n, eps, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out
