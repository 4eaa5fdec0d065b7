"""Weight matrices in the form the engine's kernels take.

`build_linear(records, fmt, device, cpu=...)` turns one or more GGUF matrices (concatenated
along the output dimension, so q/k/v or gate/up run as one matmul) into a callable `Linear`.
On CPU the kernels come from the `engine.kernels.CpuKernels` path chosen at load (`cpu`):

- `Int4Linear`: Q4_0 / Q4_1 / Q4_K stay 4-bit.  Their values are exactly q*scale + min over
  groups of 32.  On CPU the compiled kernels take the scales and minimums in float16 where
  every one of a matrix's is exactly a float16 (Q4_0 and Q4_1, whose file fields are float16),
  else in float32 (Q4_K, whose scales are products); the kernels widen float16 to float32
  exactly, so the choice changes no bit of a result, only the bytes streamed per token (a
  sixth fewer for the embedded model).  Activations are rounded to bfloat16,
  each group's dot product is exact products summed in float32, and the output is float32.
  Below `TILE_MIN_ROWS` rows (decoding, narrow batches) the path's vector kernel runs
  (AVX512-BF16, AVX2 or portable; the first two compute the same bits); from there on
  (prefill chunks, wide batches), on the `amx` path, the tile kernel, which multiplies 16
  rows at a time and differs from the vector kernel only in the order in which a group's 32
  products are summed (last bits of float32).  On CUDA it is engine.cuda_int4's Triton GEMM,
  which computes the same way (activations rounded to bfloat16, exact group products, scales
  in float16 where exact, else float32) and scales with the number of rows; from a measured number of rows on (prefill
  chunks of large matrices) that module dequantizes to bfloat16 for cuBLAS instead.  CUDA
  without Triton runs torch's groupwise int4 weight-only layout with zero = min + 8*scale.
  On the CPU paths whose int4 op takes codes (`CpuKernels.int4_codes`: avx512, amx), Q5_0,
  Q5_1, Q5_K, IQ4_NL and IQ4_XS are int4 matrices too: the 5-bit types with a plane of fifth
  bits, the IQ4 types with their 16 levels as the codes' values (engine.quants.CODED), the
  file's weights exactly, activations rounded to bfloat16 as for Q4_*.  Measured against the
  int8 op on two threads of an AVX512-BF16 host: one decoded row 1.2x (5-bit) and 1.4x (IQ4)
  as fast, a decoding step of a Q5_K_M-like file 1.1x; the price is the bfloat16 activations
  (corpus KL of SmolLM2's weights in Q5_0, Q5_1, IQ4_NL: 2.5e-7 to 3.4e-7 on the int8 op,
  3.8e-5 to 5.1e-5 as codes, what its Q4_1 file measures).  The avx2 and portable int4 ops
  have no such lookup (AVX2's one-row op converts nibbles in place, which a fifth bit or a
  table breaks), so those paths keep these types in the int8 op.
  On a GPU the file's blocks cross as stored and are unpacked there (engine.device_blocks),
  as are the float and Q8_0 tensors that become dense matrices and embedding tables.  A
  [gate; up] matrix there becomes a `PairedInt4Linear` (`Linear.for_swiglu`), its rows in
  gate/up pairs, whose `swiglu` ends the product in the SwiGLU.
- `Int8Linear` (CPU): Q8_0, and Q6_K, Q3_K and Q2_K where `KQuantLinear` does not take them
  (and, where the int4 op takes no codes or a fused matrix mixes them with the types above,
  Q5_0, Q5_1, Q5_K, IQ4_NL and IQ4_XS) stay 8-bit
  with their group scales (float16 where exact, as for Q4_0 above, else float32), and
  minimums where the type has them (Q5_1, Q5_K, Q2_K), float16 where exact as well (Q5_1's):
  exactly the file's weights (the embedded model's output head is Q8_0), float32 activations
  and output.  A fused matrix whose parts mix these types (a Q5_K_M file's q/k in Q5_K and v in
  Q6_K) runs as one, at the smallest group of its parts (a scale of 32 inputs repeated for
  each 16), with the 4-bit types among them unpacked to int8 too.  Chosen over a float16 copy
  by measurement (docs/engine.md, "Weights"): one decoded row of a matrix larger than the
  caches took the float16 kernel 1.02x to 1.46x as long, and int8 holds 1.125 to 1.5 bytes a
  weight against 2; matrices that stay in cache ran alike.
- `KQuantLinear` (CPU, the `avx512` and `amx` paths): a matrix of Q6_K, Q3_K or Q2_K alone at
  the file's own width (0.82, 0.45 and 0.33 bytes a weight against the int8 layout's 1.25 and
  1.5), in tiles that the kernel unpacks in registers: the int8 op's weights and arithmetic,
  the same bits.
- `F16Linear` (CPU): every other type is dequantized once to float16 (11 mantissa bits kept),
  float32 activations and output.
- `DenseLinear`: bfloat16 on CUDA, float32 everywhere when `fmt == "float32"`.
- `RowByRow` (CPU, the `torch` path, where no kernel is compiled): every type dequantized once
  to float16 for FBGEMM's GEMM (float32 where the torch build has no FBGEMM: aarch64), called
  once per row, because their result for a row depends on how many rows they are given; slow
  for prefill and 4 to 8 times the memory of 4-bit weights, but the contract below holds, and
  closer to float32 than torch's int4 kernel, whose scales are bfloat16.
- `Embedding`: token rows as float32.  On CPU the packed format dequantizes just the rows it
  is asked for from the file's own bytes, so a model whose head is tied to its embedding
  keeps one copy of the table in memory (the head's).

The CPU contract, on every path: a row's result depends on that row alone (the number of
rows, the other rows and the thread count do not change a bit of it), so batched decoding
reproduces single decoding and a prefill chunk's matmuls equal a decoding step's (the `amx`
path's tile kernel aside, which stays within the last bits).
`fmt == "float32"` dequantizes everything to float32: the slow, exact reference path.
Inputs are [T, in] in any float dtype (converted to the kernel's); outputs are [T, out] in the
compute dtype (`out_dtype`), so callers add them into a float32 residual without another copy.
It does not decide which tensors a model needs (see engine.models) nor which CPU path runs
(see engine.kernels).
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Iterable, Protocol, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from engine import cuda_int4, device_blocks
from engine.gguf_file import TensorRecord
from engine.kernels import CpuKernels
from engine.quants import (BLOCK, FIFTH_BIT_CODES, GROUP, INT4_GROUPED, INT8_GROUPS, IQ4_LEVELS, LEVEL_CODES,
                           LINEAR_CODES, Int8Groups, dequantize, unpack_int4_groups)

WEIGHT_FORMATS = ("packed", "float32")

# From this many rows on, CPU int4 products take the AMX tile kernel where it exists: below it
# the vector kernel is as fast or faster (measured on the embedded model's shapes), and decoding
# batches of up to 16 rows keep one kernel, so a batched row computes like a row decoded alone.
TILE_MIN_ROWS = 32
COLUMNS = 16  # the CPU kernels' output columns per block: other heights are padded with zeros
# The types CpuKernels.repack_int8 lays out in 8-bit form from the file's blocks, alone or fused
# (`int8_layout` of engine.quants.unpack_int8_groups, fused by `fuse_int8_groups`, is the
# reference the tests hold it to).
INT8_REPACKED = frozenset(INT8_GROUPS) | INT4_GROUPED
# The k-quants CpuKernels.kq holds at their own width, a matrix of one of them alone.
K_QUANT_TILES = frozenset({QT.Q6_K, QT.Q3_K, QT.Q2_K})


class SwiGLUKernels(Protocol):
    """What `Linear.swiglu` asks of a forward pass's elementwise kernels (engine.models.llama's
    StepKernels): the SwiGLU of a product, and `out_dtype`, the dtype its fused CUDA kernels
    write for the next product (None: torch ops, in the product's dtype)."""

    out_dtype: torch.dtype | None

    def swiglu(self, gate_up: torch.Tensor, op_dtype: torch.dtype | None = None) -> torch.Tensor: ...


class Linear:
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def narrow(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """(y, dtype): self(x)'s values, of `dtype`, held in y in the narrowest dtype that keeps
        them exactly, for a consumer that computes from them as from tensors of `dtype`: an
        int4 product of many rows on CUDA, which cuBLAS rounded to bfloat16, stays bfloat16
        (half the bytes written and read back); elsewhere y is self(x)."""
        y = self(x)
        return y, y.dtype

    def accumulate(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out += x @ W^T for a float32 `out` (the residual stream); kernels that can add in
        their last step do so, saving a kernel and a tensor."""
        out += self(x)

    def swiglu(self, x: torch.Tensor, ops: SwiGLUKernels) -> torch.Tensor:
        """silu(gate) * up for this [gate; up] matrix (gate's rows, then up's) times x: `ops`'
        SwiGLU of the product; a matrix whose products can end in it (`for_swiglu`) does so."""
        gate_up, values = self.narrow(x)
        return ops.swiglu(gate_up, values)

    def for_swiglu(self) -> "Linear":
        """This [gate; up] matrix in the form whose `swiglu` is fastest: itself, or on CUDA an
        int4 matrix whose products end in the SwiGLU (`PairedInt4Linear`)."""
        return self

    def vector_operands(self, rows: int) -> list[torch.Tensor] | None:
        """The CPU vector op's operands where a product of `rows` rows is that op alone, with
        nothing around it (no bias, no padding columns): int4 (packed, scales) or int8 (q,
        scales[, minimums]), what engine/kernels/block.cpp takes in place of calling this
        matrix; None for every other matrix."""
        return None

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class DenseLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # [out, in], compute dtype
        self.bias = bias  # float32 [out] or None
        self.out_features, self.in_features = weight.shape

    @property
    def out_dtype(self) -> torch.dtype:
        return self.weight.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight)
        return y if self.bias is None else y.float() + self.bias

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)


@functools.cache
def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class Fp16Linear(Linear):
    """float16 weights prepacked for FBGEMM; float32 in, float32 out (the CPU `torch` path,
    inside RowByRow: its result for a row depends on the number of rows)."""

    out_dtype = torch.float32

    def __init__(self, weight: np.ndarray, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        # Prepacking rounds the float32 weights to float16 (round to nearest).
        self.packed = torch.ops.quantized.linear_prepack_fp16(torch.from_numpy(weight), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)

    @property
    def nbytes(self) -> int:
        return 2 * self.out_features * self.in_features + (0 if self.bias is None else self.bias.nbytes)


class RowByRow(Linear):
    """`inner` called on one row at a time: a row's result is then the one-row result whatever
    the batch, for kernels whose result depends on the number of rows (torch's)."""

    def __init__(self, inner: Linear):
        self.inner = inner
        self.out_features, self.in_features = inner.out_features, inner.in_features
        self.out_dtype = getattr(inner, "out_dtype", torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.inner(x)
        return torch.cat([self.inner(x[i: i + 1]) for i in range(x.shape[0])])

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


def _pad_rows(n: int, *arrays: np.ndarray) -> list[np.ndarray]:
    """Arrays of n rows padded with zero rows to a multiple of COLUMNS."""
    pad = -n % COLUMNS
    return [np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a for a in arrays]


def _column_blocks(a: np.ndarray, group: int) -> np.ndarray:
    """[N, K] -> [N/16, ceil(K/group), group, 16]: the CPU kernels' layout, one block of 16
    output columns over one group of inputs with the columns contiguous (K zero-padded)."""
    n, k = a.shape
    kb = -(-k // group)
    if kb * group != k:
        a = np.concatenate([a, np.zeros((n, kb * group - k), a.dtype)], axis=1)
    return np.ascontiguousarray(a.reshape(n // COLUMNS, COLUMNS, kb, group).transpose(0, 2, 3, 1))


class _CpuKernelLinear(Linear):
    """A CPU kernel of a CpuKernels path over weights laid out in blocks of 16 columns; outputs
    of padding columns are sliced off, biases added after."""

    out_dtype = torch.float32

    def __init__(self, n: int, k: int, bias: torch.Tensor | None):
        self.out_features, self.in_features = n, k
        self.bias = bias
        self._pad = -n % COLUMNS

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        y = self._product(x)
        if self._pad:
            y = y[:, : self.out_features].contiguous()
        return y if self.bias is None else y + self.bias


class Int8Linear(_CpuKernelLinear):
    """8-bit grouped types on CPU: int8 q [N/16, K/G, G, 16], scales [N/16, K/G, 16] per group
    (float16 where every one is exactly a float16, as Q8_0's and Q5_0's are, else float32: the
    kernel widens them exactly, so only the bytes streamed change) and, for the types with them,
    minimums like the scales, float16 where exact in the same way (the layout of
    engine/kernels/dense_linear.cpp; CpuKernels.repack_int8 or `int8_layout` makes it), whose
    rows past `out_features` are padding."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, out_features: int, op,
                 bias: torch.Tensor | None = None, minimums: torch.Tensor | None = None):
        super().__init__(out_features, q.shape[1] * q.shape[2], bias)
        self.q, self.scales, self.minimums, self._op = q, scales, minimums, op

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.minimums is None:
            return self._op(x, self.q, self.scales)
        return self._op(x, self.q, self.scales, self.minimums)

    def vector_operands(self, rows: int) -> list[torch.Tensor] | None:
        if self.bias is not None or self._pad:
            return None
        return [self.q, self.scales] + ([] if self.minimums is None else [self.minimums])

    @property
    def nbytes(self) -> int:
        held = self.q.nbytes + self.scales.nbytes + (0 if self.minimums is None else self.minimums.nbytes)
        return held + (0 if self.bias is None else self.bias.nbytes)


class KQuantLinear(_CpuKernelLinear):
    """Q6_K, Q3_K or Q2_K matrices on CPU at their own width (CpuKernels.kq, laid out by
    CpuKernels.repack_kq: packed uint8 [N/16, K/16, 192, 96 or 64], sc int8 [N/16, K/16, 16], d
    float16 [N/16, K/256, 16] and Q2_K's dmin like d): the int8 op's weights and arithmetic, so
    the same bits, from 0.82 (Q6_K), 0.45 (Q3_K) or 0.33 (Q2_K) bytes a weight instead of 1.25
    (1.5); rows past `out_features` are padding."""

    def __init__(self, packed: torch.Tensor, sc: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor | None,
                 out_features: int, op, bias: torch.Tensor | None = None):
        super().__init__(out_features, packed.shape[1] * 16, bias)
        self.packed, self.sc, self.d, self.dmin, self._op = packed, sc, d, dmin, op

    def _operands(self) -> list[torch.Tensor]:
        return [self.packed, self.sc, self.d] + ([] if self.dmin is None else [self.dmin])

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, *self._operands())

    def vector_operands(self, rows: int) -> list[torch.Tensor] | None:
        if self.bias is not None or self._pad:
            return None
        return self._operands()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._operands()) + (0 if self.bias is None else self.bias.nbytes)


def int8_layout(q: np.ndarray, scale: np.ndarray, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 q [N, K] and scales [N, K/group] in Int8Linear's layout, rows padded to whole blocks;
    the scales in float16 where every one is exactly a float16 (`exact_scale_dtype`)."""
    q, scale = _pad_rows(q.shape[0], q, scale)
    return torch.from_numpy(_column_blocks(q, group)), narrowed_if_exact(group_values_layout(scale))


def narrowed_if_exact(values: torch.Tensor) -> torch.Tensor:
    """Float32 group values (scales, minimums) as float16 where every one is exactly a float16
    (`exact_scale_dtype`): the kernels widen them exactly, so only the bytes streamed change."""
    return values.half() if exact_scale_dtype(values.numpy()) == np.float16 else values


def group_values_layout(values: np.ndarray) -> torch.Tensor:
    """Per-group float32 values [N, K/group] (scales, minimums) in Int8Linear's layout
    [N/16, K/group, 16], rows padded to whole blocks."""
    (values,) = _pad_rows(values.shape[0], values)
    return torch.from_numpy(_column_blocks(values, 1)[:, :, 0])


def fuse_int8_groups(parts: Sequence[Int8Groups]) -> Int8Groups:
    """Matrices in 8-bit grouped form stacked along the output dimension, at the smallest group
    among them (a larger group's scale and minimum repeated; group sizes divide each other),
    with zero minimums for parts without one where another has them: the same weights."""
    group = min(p.group for p in parts)

    def regroup(a: np.ndarray, p: Int8Groups) -> np.ndarray:
        return a if p.group == group else np.repeat(a, p.group // group, axis=1)

    scale = np.concatenate([regroup(p.scale, p) for p in parts])
    minimum = None
    if any(p.minimum is not None for p in parts):
        minimum = np.concatenate([np.zeros_like(regroup(p.scale, p)) if p.minimum is None else regroup(p.minimum, p)
                                  for p in parts])
    return Int8Groups(q=np.concatenate([p.q for p in parts]), scale=scale, group=group, minimum=minimum)


class F16Linear(_CpuKernelLinear):
    """Any other type on CPU: float16 weights, engine/kernels/dense_linear.cpp."""

    def __init__(self, weight: np.ndarray, op, bias: torch.Tensor | None = None):
        n, k = weight.shape
        super().__init__(n, k, bias)
        (w,) = _pad_rows(n, weight.astype(np.float16))
        self.w = torch.from_numpy(_column_blocks(w, GROUP))
        self._op = op

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.w)

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + (0 if self.bias is None else self.bias.nbytes)


class Embedding:
    """`emb(tokens)` -> float32 [T, n_embd] rows of a token table."""

    def __init__(self, record: TensorRecord, fmt: str, device: torch.device):
        self.device = device
        self.qtype = record.qtype
        self.n_rows, self.n_cols = record.shape
        self.table: torch.Tensor | None = None
        self.rows: np.ndarray | None = None
        if fmt == "packed" and device.type == "cpu":
            per_block, block_bytes = BLOCK[record.qtype]
            raw = np.ascontiguousarray(record.data).view(np.uint8)  # a view of the mapping, not a copy
            self.rows = raw.reshape(self.n_rows, self.n_cols // per_block * block_bytes)
        else:
            dtype = torch.float32 if fmt == "float32" else torch.bfloat16
            self.table = device_float([record], device).to(dtype)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table[tokens].float()
        return torch.from_numpy(dequantize(self.qtype, self.rows[tokens.numpy()], self.n_cols))

    @property
    def nbytes(self) -> int:
        """Bytes held in memory; the quantized rows stay in the file mapping."""
        return 0 if self.table is None else self.table.nbytes


def cuda_inner_k_tiles(k: int) -> int:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"int4 CUDA kernel needs in_features divisible by 32, got {k}")


def int4_pack(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of the compiled int4 kernel (engine/kernels/int4_linear.cpp).  For each 16
    output columns and group of 32 inputs, 8 chunks of 32 bytes: byte 2j + e of chunk c holds
    column j's input 2c + e in its low nibble and input 2(c + 8) + e in its high one, so that
    widening a chunk to 16-bit lanes gives two vectors of (input pair, column) bfloat16 operands.
    Scales and minimums become [N/16, K/32, 2, 16], float16 when all of them are exactly float16
    values, else float32 (`exact_scale_dtype`).  The readable statement of the layout: the engine
    builds it from the file's blocks with CpuKernels.repack_int4, which the tests hold to this
    function."""
    n, k = q.shape
    ng, kb = n // 16, k // GROUP
    qq = q.reshape(ng, 16, kb, 16, 2).transpose(0, 2, 3, 1, 4)  # [ng, kb, pair, column, e]
    packed = (qq[:, :, :8] | (qq[:, :, 8:] << 4)).reshape(ng, kb, 8, 32)

    def per_group(a: np.ndarray) -> np.ndarray:
        return a.reshape(ng, 16, kb).transpose(0, 2, 1)

    sm = np.ascontiguousarray(np.stack([per_group(scale), per_group(minimum)], axis=2), dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(sm.astype(exact_scale_dtype(sm)))


def fifth_bits(codes: np.ndarray) -> torch.Tensor:
    """The fifth bits of 5-bit codes [N, K] (N a multiple of 16) in the int4 kernel's layout,
    uint8 [N/16, K/32, 16, 4]: for each input pair p of a group, a little-endian 32-bit mask over
    the bytes of the chunk int4_pack puts that pair in (byte 2j + e: column j, input 2p + e).
    The readable statement of the layout, as int4_pack's: the engine builds it from the file's
    blocks with CpuKernels.repack_codes, which the tests hold to this function."""
    n, k = codes.shape
    ng, kb = n // 16, k // GROUP
    bits = (codes >> 4).reshape(ng, 16, kb, 16, 2).transpose(0, 2, 3, 1, 4)  # [ng, kb, pair, column, e]
    packed = np.packbits(bits.reshape(ng, kb, 16, 32).astype(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(np.ascontiguousarray(packed))


def coded_kind(records: Sequence[TensorRecord]) -> str | None:
    """'linear' or 'levels' where all of `records` are coded types that fuse (engine.quants'
    LINEAR_CODES, or LEVEL_CODES), else None."""
    if all(r.qtype in LINEAR_CODES for r in records):
        return "linear"
    if all(r.qtype in LEVEL_CODES for r in records):
        return "levels"
    return None


def exact_scale_dtype(values: np.ndarray) -> type:
    """float16 when every float32 value survives the round trip through float16 bit for bit
    (so the kernels, which widen it exactly, compute the same bits), else float32."""
    values = np.asarray(values, dtype=np.float32)
    with np.errstate(over="ignore"):  # an overflow to infinity is simply not exact
        back = values.astype(np.float16).astype(np.float32)
    return np.float16 if np.array_equal(back.view(np.uint32), values.view(np.uint32)) else np.float32


class Int4Linear(Linear):
    """A 4-bit matrix.  On CPU it is built in the compiled kernels' layout (`from_cpu_layout`,
    from CpuKernels.repack_int4, with float16 or float32 scales; `nbytes` counts them as they
    are held); `Int4Linear(q, scale, minimum, device)` builds it on CUDA."""

    def __init__(self, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray, device: torch.device,
                 bias: torch.Tensor | None = None):
        if device.type == "cpu":
            raise ValueError("int4 matrices on CPU come from Int4Linear.from_cpu_layout")
        n, k = q.shape
        self.out_features, self.in_features = n, k
        self.bias = bias
        self.device = device
        if device.type == "cuda" and cuda_int4.AVAILABLE:
            self._cuda = cuda_int4.Int4Weight(q, scale, minimum, device)
            self.out_dtype = torch.float32
            return
        # CUDA without Triton: torch's layout takes outputs in blocks of 16 (a head over a
        # vocabulary of 32001, say, gets zero rows, sliced off) and two nibbles per byte, even
        # column in the high nibble.
        self._pad = -n % COLUMNS
        q, scale, minimum = _pad_rows(n, q, scale, minimum)
        q8 = torch.from_numpy(np.ascontiguousarray((q[:, ::2] << 4) | q[:, 1::2])).to(device)
        self.packed = torch.ops.aten._convert_weight_to_int4pack(q8, cuda_inner_k_tiles(k))
        # [K/G, N, 2]: (scale, zero) per group, the layout the kernel reads.
        sz = np.stack([scale, minimum + 8.0 * scale], axis=-1).transpose(1, 0, 2)
        self.scales_zeros = torch.from_numpy(np.ascontiguousarray(sz)).to(device, torch.bfloat16)
        self._mm = torch.ops.aten._weight_int4pack_mm

    @classmethod
    def on_cuda(cls, weight: "cuda_int4.Int4Weight", device: torch.device,
                bias: torch.Tensor | None = None) -> "Int4Linear":
        """A CUDA matrix already built on its device (engine.device_blocks, Int4Weight.from_nibbles)."""
        self = cls.__new__(cls)
        self.out_features, self.in_features = weight.n, weight.k
        self.bias, self.device = bias, device
        self._cuda, self.out_dtype = weight, torch.float32
        return self

    @classmethod
    def from_cpu_layout(cls, packed: torch.Tensor, scales: torch.Tensor, out_features: int, cpu: CpuKernels,
                        bias: torch.Tensor | None = None, high: torch.Tensor | None = None,
                        levels: torch.Tensor | None = None) -> "Int4Linear":
        """A CPU matrix in the kernels' layout (int4_pack's; CpuKernels.repack_int4 makes it),
        whose rows past `out_features` are padding; with the 5-bit codes' `high` bits
        (`fifth_bits`) or the IQ4 types' `levels` (float32 [16]), which only the vector op
        takes (CpuKernels.int4_codes), at every number of rows."""
        self = cls.__new__(cls)
        self.out_features, self.in_features = out_features, packed.shape[1] * GROUP
        self.bias, self.device = bias, torch.device("cpu")
        self._pad = packed.shape[0] * COLUMNS - out_features
        self.packed, self.scales_zeros = packed, scales
        self.high, self.levels = high, levels
        coded = high is not None or levels is not None
        if coded and not cpu.int4_codes:
            raise ValueError(f"the {cpu.name} CPU kernels take no 5-bit or IQ4 codes")
        self._op, self._tiles, self._add = cpu.int4, None if coded else cpu.int4_tiles, cpu.int4_add
        self.out_dtype = torch.float32
        return self

    out_dtype = torch.bfloat16
    _cuda: "cuda_int4.Int4Weight | None" = None
    _op = None  # set only where the CPU kernel runs
    _tiles = None
    _add = None
    _pad = 0
    high: torch.Tensor | None = None
    levels: torch.Tensor | None = None

    def _uses_tiles(self, x: torch.Tensor) -> bool:
        return self._tiles is not None and x.shape[0] >= TILE_MIN_ROWS

    def _codes(self) -> list[torch.Tensor]:
        return [t for t in (self.high, self.levels) if t is not None]

    def vector_operands(self, rows: int) -> list[torch.Tensor] | None:
        if self._add is None or self.bias is not None or self._pad or (self._tiles is not None and rows >= TILE_MIN_ROWS):
            return None
        return [self.packed, self.scales_zeros] + self._codes()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._op is not None:
            if x.dtype != torch.float32 or x.stride(-1) != 1:
                x = x.float().contiguous()
            if self._uses_tiles(x):
                y = self._tiles(x, self.packed, self.scales_zeros)
            else:
                y = self._op(x, self.packed, self.scales_zeros, self.high, self.levels)
        elif self._cuda is not None:
            y = self._cuda(x)
        else:
            y = self._mm(x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros)
        if self._pad:
            y = y[:, : self.out_features].contiguous()
        return y if self.bias is None else y.float() + self.bias

    def narrow(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        if self._cuda is not None and self.bias is None:
            return self._cuda(x, narrow=True), torch.float32
        return super().narrow(x)

    def for_swiglu(self) -> Linear:
        if self._cuda is None or self.bias is not None or not cuda_int4.SWIGLU_IN_PRODUCTS:
            return self
        return PairedInt4Linear.on_cuda(self._cuda.paired_halves(), self.device)

    def accumulate(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if self._cuda is not None and self.bias is None:
            self._cuda(x, into=out)
        elif (self._add is not None and self.bias is None and out.dtype == torch.float32 and out.stride(-1) == 1
              and not self._uses_tiles(x)):
            # The vector op adds into the residual stream itself: the same bits as out += self(x).
            if x.dtype != torch.float32 or x.stride(-1) != 1:
                x = x.float().contiguous()
            self._add(x, self.packed, self.scales_zeros, out, self.high, self.levels)
        else:
            out += self(x)

    @property
    def cuda_weight(self) -> "cuda_int4.Int4Weight | None":
        """The CUDA matrix (engine.cuda_int4), whose `gemm_rows` says from how many rows it
        is dequantized for cuBLAS; None on CPU or without Triton."""
        return self._cuda

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.nbytes
        if self._cuda is not None:
            return self._cuda.nbytes + bias
        return self.packed.nbytes + self.scales_zeros.nbytes + sum(t.nbytes for t in self._codes()) + bias


class PairedInt4Linear(Int4Linear):
    """A [gate; up] int4 matrix on CUDA held with its rows in gate/up pairs
    (cuda_int4.Int4Weight.paired_halves): `swiglu` under fused kernels is then the products'
    own last kernel, the same bits as the product and then the SwiGLU kernel, one kernel and
    one [rows, 2 * n_ff] float32 tensor fewer a step (engine.cuda_int4.SWIGLU_IN_PRODUCTS).  Its
    plain products come back in [gate; up] order, through a copy (no decoding step takes them)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _unpaired(self._cuda(x))

    def narrow(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        return _unpaired(self._cuda(x, narrow=True)), torch.float32

    def accumulate(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out += self(x)

    def swiglu(self, x: torch.Tensor, ops: SwiGLUKernels) -> torch.Tensor:
        if ops.out_dtype is None:  # torch ops: they take the product in [gate; up] order
            return super().swiglu(x, ops)
        return self._cuda.swiglu(x, ops.out_dtype)

    def for_swiglu(self) -> Linear:
        return self


def _unpaired(y: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * n] products whose columns are gate/up pairs -> [gate; up] columns."""
    rows, n = y.shape
    return y.view(rows, n // 2, 2).transpose(1, 2).reshape(rows, n)


def _coded_linear(records: Sequence[TensorRecord], kind: str, row_perm: np.ndarray | None, cpu: CpuKernels,
                  bias: torch.Tensor | None) -> Int4Linear:
    """A matrix of coded types of one `coded_kind` in the int4 kernel's layout (CpuKernels.repack_codes,
    which the tests hold to `int4_pack` and `fifth_bits` of engine.quants.unpack_coded_groups),
    with fifth bits where a type has them and the levels of the IQ4 types."""
    n = sum(r.shape[0] for r in records)
    packed, scales, high = cpu.repack_codes([_raw_rows(r) for r in records], [int(r.qtype) for r in records],
                                            _row_order(records, row_perm), records[0].n_cols, COLUMNS)
    five = any(r.qtype in FIFTH_BIT_CODES for r in records)
    levels = torch.from_numpy(IQ4_LEVELS.astype(np.float32)) if kind == "levels" else None
    return Int4Linear.from_cpu_layout(packed, scales, n, cpu, bias, high=high if five else None, levels=levels)


def _raw_rows(record: TensorRecord) -> torch.Tensor:
    """A matrix's file bytes as uint8 [rows, row bytes], a view of the mapping (not a copy)."""
    raw = np.ascontiguousarray(record.data).view(np.uint8).reshape(record.shape[0], -1)
    with warnings.catch_warnings():  # the mapping is read-only, and the repacking ops only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


def _row_order(records: Sequence[TensorRecord], row_perm: np.ndarray | None) -> torch.Tensor:
    """int64 [N]: which row of the concatenated records each output row is."""
    n = sum(r.shape[0] for r in records)
    return torch.from_numpy(np.arange(n, dtype=np.int64) if row_perm is None else row_perm.astype(np.int64))


def split_experts(record: TensorRecord) -> list[TensorRecord]:
    """A stacked expert tensor [n_expert, rows, cols] (ffn_*_exps; GGUF dims cols, rows, n_expert)
    as one 2-D record per expert, each a view of its own contiguous bytes in the file: an
    expert's rows are whole rows of blocks, so any tensor type splits the same way and each
    part builds a Linear like any matrix."""
    if len(record.shape) != 3:
        raise ValueError(f"{record.name}: expected a 3-D expert tensor, got shape {record.shape}")
    n_expert, rows, cols = record.shape
    flat = record.data.reshape(-1)
    size = flat.shape[0] // n_expert
    return [TensorRecord(f"{record.name}[{e}]", record.qtype, (rows, cols), flat[e * size: (e + 1) * size])
            for e in range(n_expert)]


def device_float(records: Sequence[TensorRecord], device: torch.device) -> torch.Tensor:
    """float32 [rows, cols] on `device` of records stacked along their rows: on a GPU the raw
    bytes cross once and the device dequantizes them (engine.device_blocks) where it can."""
    if device.type == "cuda" and all(r.qtype in device_blocks.DEQUANTIZED for r in records):
        return torch.cat([device_blocks.dequantize(r.qtype, device_blocks.raw_rows(r, device), r.n_cols)
                          for r in records])
    k = records[0].n_cols
    parts = [to_float(r).reshape(-1, k) for r in records]
    return torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts)).to(device)


def to_float(record: TensorRecord) -> np.ndarray:
    """Dequantize a record to float32 with its torch-order shape."""
    return dequantize(record.qtype, record.data, record.n_cols).reshape(record.shape)


# The fewest bytes a weight of each type takes once laid out for any path (CPU kernels, CUDA,
# torch's float16 or float32 copies): the file's codes widened to 4 bits (the int4 op, scales and
# minimums at least float16 per 32), 4 bits plus fifth-bit planes, Q6_K's, Q3_K's and Q2_K's
# own width with their scale bytes and float16 super-block scales (KQuantLinear), or 8 bits (the
# int8 op, scales at least float16 per group); float types at least float16.
_MIN_BYTES_PER_WEIGHT = {**{t: 0.5 + 4 / 32 for t in INT4_GROUPED | LEVEL_CODES},
                         **{t: 0.5 + 1 / 8 + 4 / 32 for t in FIFTH_BIT_CODES},
                         QT.Q6_K: 0.75 + 1 / 16 + 2 / 256, QT.Q3_K: 0.375 + 1 / 16 + 2 / 256,
                         QT.Q2_K: 0.25 + 1 / 16 + 4 / 256, QT.Q8_0: 1 + 2 / 32}


def min_resident_bytes(records: Iterable[TensorRecord], n_layer: int) -> int:
    """A lower bound on the memory a model's weights take once built, from its tensor records
    alone: the layers' tensors (blk.0 .. blk.{n_layer - 1}) and the output head, each at the
    fewest bytes per weight any path lays its type out in.  The token embedding is left out (a
    quantized one stays in the file's mapping).  So a load whose bound exceeds the memory
    available cannot succeed, and can be refused before any work."""
    def counted(name: str) -> bool:
        block, index = (name.split(".") + [""])[:2]
        return name == "output.weight" or (block == "blk" and index.isdigit() and int(index) < n_layer)

    return int(sum(math.prod(r.shape) * _MIN_BYTES_PER_WEIGHT.get(r.qtype, 2.0) for r in records if counted(r.name)))


def build_linear(records: Sequence[TensorRecord], fmt: str, device: torch.device,
                 biases: Sequence[TensorRecord] | None = None,
                 row_perm: np.ndarray | None = None, cpu: CpuKernels | None = None) -> Linear:
    """One Linear computing the concatenation of `records` along the output dimension.

    `row_perm` (over the concatenated rows) reorders outputs; the rope code uses it to turn
    neox-style q/k into the adjacent-pair layout.  `cpu` is the CPU kernel path (required on
    CPU with the packed format; ignored elsewhere).
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r} (expected one of {WEIGHT_FORMATS})")
    in_features = {r.n_cols for r in records}
    if len(in_features) != 1:
        raise ValueError(f"cannot fuse matrices of different widths: {[r.name for r in records]}")
    bias = None
    if biases:
        b = np.concatenate([to_float(r).reshape(-1) for r in biases])
        if row_perm is not None:
            b = b[row_perm]
        bias = torch.from_numpy(np.ascontiguousarray(b)).to(device)
    k = in_features.pop()
    packed_cpu = fmt == "packed" and device.type == "cpu"
    if packed_cpu and cpu is None:
        raise ValueError("the packed format on CPU needs a CPU kernel path (engine.kernels.cpu_kernels)")
    n = sum(r.shape[0] for r in records)
    if packed_cpu and cpu.int4 is not None and all(r.qtype in INT4_GROUPED for r in records) and k % 64 == 0:
        packed, scales = cpu.repack_int4([_raw_rows(r) for r in records], [int(r.qtype) for r in records],
                                         _row_order(records, row_perm), k, COLUMNS)
        return Int4Linear.from_cpu_layout(packed, scales, n, cpu, bias)
    int4 = all(r.qtype in INT4_GROUPED for r in records) and k % 64 == 0
    if fmt == "packed" and device.type == "cuda" and cuda_int4.AVAILABLE and int4:
        # The file's blocks cross to the GPU as they are and are unpacked there.
        parts = [device_blocks.int4_groups(r.qtype, device_blocks.raw_rows(r, device), r.n_cols) for r in records]
        nibbles, scale, minimum = (torch.cat(x) for x in zip(*parts))
        if row_perm is not None:
            at = torch.from_numpy(np.ascontiguousarray(row_perm)).to(device)
            nibbles, scale, minimum = nibbles[at], scale[at], minimum[at]
        return Int4Linear.on_cuda(cuda_int4.Int4Weight.from_nibbles(nibbles, scale, minimum), device, bias)
    if fmt == "packed" and device.type != "cpu" and int4:
        parts = [unpack_int4_groups(r.qtype, r.data, r.n_cols) for r in records]
        q = np.concatenate([p.q for p in parts])
        scale = np.concatenate([p.scale for p in parts])
        minimum = np.concatenate([p.minimum for p in parts])
        if row_perm is not None:
            q, scale, minimum = q[row_perm], scale[row_perm], minimum[row_perm]
        return Int4Linear(q, scale, minimum, device, bias)
    kind = coded_kind(records) if packed_cpu and cpu.int4_codes and k % GROUP == 0 else None
    if kind is not None:
        return _coded_linear(records, kind, row_perm, cpu, bias)
    kinds = {r.qtype for r in records}
    if packed_cpu and cpu.kq is not None and len(kinds) == 1 and kinds <= K_QUANT_TILES:
        packed, sc, d, dmin = cpu.repack_kq([_raw_rows(r) for r in records], int(records[0].qtype),
                                            _row_order(records, row_perm), k, COLUMNS)
        return KQuantLinear(packed, sc, d, dmin if dmin.numel() else None, n, cpu.kq, bias)
    if packed_cpu and cpu.int8 is not None and all(r.qtype in INT8_REPACKED for r in records):
        q8, scale8, min8 = cpu.repack_int8([_raw_rows(r) for r in records], [int(r.qtype) for r in records],
                                           _row_order(records, row_perm), k, COLUMNS)
        return Int8Linear(q8, scale8, n, cpu.int8, bias, minimums=min8 if min8.numel() else None)
    if device.type == "cuda":
        wd = device_float(records, device)
        if row_perm is not None:
            wd = wd[torch.from_numpy(np.ascontiguousarray(row_perm)).to(device)]
        return DenseLinear(wd.to(torch.float32 if fmt == "float32" else torch.bfloat16).contiguous(), bias)
    w = np.concatenate([to_float(r).reshape(-1, k) for r in records])
    if row_perm is not None:
        w = w[row_perm]
    w = np.ascontiguousarray(w)
    if packed_cpu and cpu.f16 is not None:
        return F16Linear(w, cpu.f16, bias)
    if packed_cpu:  # the torch path: torch's float16 (FBGEMM) or float32 matmul, one row at a time
        if fbgemm_available():
            return RowByRow(Fp16Linear(w, bias))
        return RowByRow(DenseLinear(torch.from_numpy(w), bias))
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    return DenseLinear(torch.from_numpy(w).to(device=device, dtype=dtype), bias)

