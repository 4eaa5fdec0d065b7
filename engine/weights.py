"""Weight matrices in the form torch has fast kernels for.

`build_linear(records, fmt, device)` turns one or more GGUF matrices (concatenated along
the output dimension, so q/k/v or gate/up run as one matmul) into a callable `Linear`:

- `Int4Linear`: Q4_0 / Q4_1 / Q4_K stay 4-bit.  Their values are exactly q*scale + min over
  groups of 32, which is torch's groupwise int4 weight-only layout with
  zero = min + 8*scale, so nothing is re-quantized; scale/zero are stored in bfloat16 (the
  kernels' requirement) and activations enter the kernel as bfloat16.
- `DenseLinear`: every other type is dequantized once, to bfloat16, or float32 when
  `fmt == "float32"`.  The output head (whose input is RMS-normalised, so it cannot overflow
  float16's range) uses float16 on CPU instead: its matrix-vector kernel is about twice as
  fast there, and the head is the largest single matrix of a small model.

`fmt == "float32"` dequantizes everything to float32: the slow, exact reference path.
Inputs are [T, in] in any float dtype (converted to the kernel's); outputs are [T, out] in the
compute dtype (`out_dtype`), so callers add them into a float32 residual without another copy.
It does not decide which tensors a model needs (see engine.models).
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from engine.gguf_file import TensorRecord
from engine.quants import GROUP, INT4_GROUPED, dequantize, unpack_int4_groups

WEIGHT_FORMATS = ("packed", "float32")


class Linear:
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

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


def _cpu_pack_numpy(q: np.ndarray) -> np.ndarray:
    """torch's CPU int4 layout, built directly: per 64 output rows, for each column k, 32 bytes
    whose low nibbles are rows 0..31 and high nibbles rows 32..63 of that block."""
    n, k = q.shape
    blocks = q.reshape(n // 64, 2, 32, k)
    return np.ascontiguousarray((blocks[:, 0] | (blocks[:, 1] << 4)).transpose(0, 2, 1)).reshape(n, k // 2)


@functools.cache
def _cpu_layout_known() -> bool:
    """Whether _cpu_pack_numpy reproduces this torch build's packing (checked once on a probe)."""
    probe = np.random.default_rng(0).integers(0, 16, size=(128, 64), dtype=np.uint8)
    ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(probe.astype(np.int32)), 1)
    return ref.dtype == torch.uint8 and np.array_equal(ref.numpy(), _cpu_pack_numpy(probe))


def _cuda_inner_k_tiles(k: int) -> int:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"int4 CUDA kernel needs in_features divisible by 32, got {k}")


class Int4Linear(Linear):
    def __init__(self, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray, device: torch.device,
                 bias: torch.Tensor | None = None):
        n, k = q.shape
        self.out_features, self.in_features = n, k
        self.bias = bias
        self.device = device
        if device.type == "cuda":
            # The CUDA kernel takes two nibbles per byte, even column in the high nibble.
            q8 = torch.from_numpy(np.ascontiguousarray((q[:, ::2] << 4) | q[:, 1::2])).to(device)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(q8, _cuda_inner_k_tiles(k))
        elif n % 64 == 0 and _cpu_layout_known():
            self.packed = torch.from_numpy(_cpu_pack_numpy(q))  # same bytes, without int32 copies
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        # [K/G, N, 2]: (scale, zero) per group, the layout both kernels read.
        sz = np.stack([scale, minimum + 8.0 * scale], axis=-1).transpose(1, 0, 2)
        self.scales_zeros = torch.from_numpy(np.ascontiguousarray(sz)).to(device, torch.bfloat16)
        self._mm = (torch.ops.aten._weight_int4pack_mm if device.type == "cuda"
                    else torch.ops.aten._weight_int4pack_mm_for_cpu)

    out_dtype = torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros)
        return y if self.bias is None else y.float() + self.bias

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes + (0 if self.bias is None else self.bias.nbytes)


def dense_dtype(fmt: str, device: torch.device, normalized_input: bool = False) -> torch.dtype:
    if fmt == "float32":
        return torch.float32
    return torch.float16 if normalized_input and device.type == "cpu" else torch.bfloat16


def to_float(record: TensorRecord) -> np.ndarray:
    """Dequantize a record to float32 with its torch-order shape."""
    return dequantize(record.qtype, record.data, record.n_cols).reshape(record.shape)


def build_linear(records: Sequence[TensorRecord], fmt: str, device: torch.device,
                 biases: Sequence[TensorRecord] | None = None,
                 row_perm: np.ndarray | None = None, normalized_input: bool = False) -> Linear:
    """One Linear computing the concatenation of `records` along the output dimension.

    `row_perm` (over the concatenated rows) reorders outputs; the rope code uses it to turn
    neox-style q/k into the adjacent-pair layout.
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
    if fmt == "packed" and all(r.qtype in INT4_GROUPED for r in records) and k % 64 == 0:
        parts = [unpack_int4_groups(r.qtype, r.data, r.n_cols) for r in records]
        q = np.concatenate([p.q for p in parts])
        scale = np.concatenate([p.scale for p in parts])
        minimum = np.concatenate([p.minimum for p in parts])
        if row_perm is not None:
            q, scale, minimum = q[row_perm], scale[row_perm], minimum[row_perm]
        return Int4Linear(q, scale, minimum, device, bias)
    w = np.concatenate([to_float(r).reshape(-1, k) for r in records])
    if row_perm is not None:
        w = w[row_perm]
    dtype = dense_dtype(fmt, device, normalized_input)
    weight = torch.from_numpy(np.ascontiguousarray(w)).to(device=device, dtype=dtype)
    return DenseLinear(weight, bias)
