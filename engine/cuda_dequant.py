"""Int4 matmuls on CUDA for many rows: dequantize the matrix to bfloat16, then one GEMM.

torch's groupwise int4 kernel (`_weight_int4pack_mm`) is the fastest way to multiply a few
rows by a 4-bit matrix, but it stays near 28 TFLOP/s however many rows come (measured on an
H200: a 16384 x 2048 matrix took 0.156 ms at 64 rows and 4.8 ms at 2048, against 0.028 and
0.177 ms for a bfloat16 GEMM over the same values).  `DequantMatmul` keeps the matrix's
nibbles (two per byte, even input in the high nibble: the bytes the int4 kernel's layout is
made from) next to that kernel's bfloat16 (scale, zero) pairs, and from `min_rows` rows on
writes w = (q - 8) * scale + zero as bfloat16 into a scratch matrix with one Triton kernel
and multiplies with `torch.nn.functional.linear`.

`min_rows` is a measured rule, not a model: the dequantize kernel is still far from its
bandwidth floor (0.52 ms for that matrix, about 130 GB/s written), so it pays only for large
matrices and many rows.  Measured there: dequantize + GEMM took 0.55 ms at 512 rows and
0.68 ms at 2048 against 1.2 and 4.8 ms, and lifted a 2048-token prefill of a Llama-3.2-1B
shape from 13,800 to 71,600 tokens/s; at 64 rows (batched decoding) it lost (0.52 against
0.16 ms), and on the embedded model's small matrices it made prefill slower (62,900 against
79,800 tokens/s).  So: matrices of at least 4 Mi elements, from 512 rows on; others never.

The scratch matrix is shared by every matrix on a device (one stream runs them one after the
other) and only grows; a buffer it outgrows is kept, because a captured CUDA graph may still
write to it.  Without Triton nothing here is used.  It does not decide weight formats (see
engine.weights).
"""
from __future__ import annotations

import torch

from engine.cuda_attention import AVAILABLE, tl, triton

GROUP = 32
MIN_ELEMENTS = 4 * 2 ** 20  # smaller matrices keep the int4 kernel at any row count
MIN_ROWS = 512
NEVER = 1 << 62


def crossover_rows(n: int, k: int) -> int:
    """Fewest rows from which dequantize + GEMM is used for an n x k matrix (see above)."""
    return MIN_ROWS if n * k >= MIN_ELEMENTS else NEVER


_SCRATCH: dict[str, list[torch.Tensor]] = {}


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    held = _SCRATCH.setdefault(str(device), [])
    if not held or held[-1].numel() < numel:
        held.append(torch.empty(numel, dtype=torch.bfloat16, device=device))
    return held[-1]


if AVAILABLE:
    @triton.jit
    def _dequantize(q_ptr, sz_ptr, out_ptr, N, K, BN: tl.constexpr, BB: tl.constexpr, GROUP: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        byte = tl.program_id(1) * BB + tl.arange(0, BB)  # byte j holds inputs 2j (high) and 2j+1 (low)
        m = (n < N)[:, None] & (byte < K // 2)[None, :]
        q = tl.load(q_ptr + n[:, None] * (K // 2) + byte[None, :], mask=m, other=0).to(tl.int32)
        g = (2 * byte) // GROUP
        where = (g[None, :] * N + n[:, None]) * 2
        scale = tl.load(sz_ptr + where, mask=m, other=0.0).to(tl.float32)
        zero = tl.load(sz_ptr + where + 1, mask=m, other=0.0).to(tl.float32)
        even = ((q >> 4) - 8).to(tl.float32) * scale + zero
        odd = ((q & 15) - 8).to(tl.float32) * scale + zero
        row = out_ptr + n[:, None] * K + 2 * byte[None, :]
        tl.store(row, even.to(tl.bfloat16), mask=m)
        tl.store(row + 1, odd.to(tl.bfloat16), mask=m)


class DequantMatmul:
    """x [rows, K] -> x @ W^T [rows, N] bfloat16 through a bfloat16 copy of W made per call."""

    def __init__(self, nibbles: torch.Tensor, scales_zeros: torch.Tensor):
        self.nibbles = nibbles  # uint8 [N, K/2] on the device
        self.scales_zeros = scales_zeros  # bfloat16 [K/32, N, 2]: the int4 kernel's own
        self.n, half = nibbles.shape
        self.k = 2 * half
        self.min_rows = crossover_rows(self.n, self.k)

    def weight(self) -> torch.Tensor:
        """W as bfloat16 [N, K] in the shared scratch (valid until the next call on this device)."""
        out = _scratch(self.n * self.k, self.nibbles.device)[: self.n * self.k].view(self.n, self.k)
        bn, bb = 32, 64
        grid = (triton.cdiv(self.n, bn), triton.cdiv(self.k // 2, bb))
        _dequantize[grid](self.nibbles, self.scales_zeros, out, self.n, self.k, BN=bn, BB=bb, GROUP=GROUP)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight())
