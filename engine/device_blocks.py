"""GGUF blocks unpacked by torch ops on the device the weights go to.

Loading onto a GPU used to unpack every block with numpy on the host (engine.quants), pack the
result again and copy the unpacked forms over: a few seconds for a 1B model, most of a load.
Here a tensor's raw bytes, read from the file's mapping, cross to the device once as they are
stored, and the device unpacks them:

- `int4_groups(qtype, raw, n_cols)`: raw bytes [rows, row_bytes] (uint8, any device) of a Q4_0,
  Q4_1 or Q4_K matrix -> (nibbles uint8 [rows, n_cols / 2] with input 2j in the high nibble of
  byte j and 2j + 1 in the low one, the layout of engine.cuda_int4; scale and minimum float32
  [rows, n_cols / 32]), the same numbers as engine.quants.unpack_int4_groups.
- `dequantize(qtype, raw, n_cols)`: float32 [rows, n_cols] of F32, F16, BF16 and Q8_0 tensors,
  equal to engine.quants.dequantize bit for bit; `DEQUANTIZED` lists the types.
- `raw_rows(record, device)`: a record's bytes on `device` as [rows, row_bytes] uint8.

The arithmetic is engine.quants' (float16 fields widened exactly, products of float32 values in
the same order), so a model loaded this way computes what one loaded through numpy computes; the
tests hold the two to each other on the CPU.  It does not choose kernels, hold weights or read
files (records come from engine.gguf_file).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf_file import TensorRecord
from engine.quants import BLOCK, GROUP, INT4_GROUPED

DEQUANTIZED = frozenset({QT.F32, QT.F16, QT.BF16, QT.Q8_0})


def raw_rows(record: TensorRecord, device: torch.device) -> torch.Tensor:
    """The record's bytes, as stored, on `device`: uint8 [rows, bytes per row]."""
    data = np.ascontiguousarray(record.data).view(np.uint8).reshape(record.shape[0], -1)
    with warnings.catch_warnings():
        # The mapping is read-only and torch warns about sharing it; it is only copied from.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data).to(device)


def _blocks(qtype: QT, raw: torch.Tensor, n_cols: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] -> [rows, blocks per row, bytes per block]."""
    per_block, nbytes = BLOCK[qtype]
    if n_cols <= 0 or n_cols % per_block:
        raise ValueError(f"{qtype.name}: row length {n_cols} is not a multiple of {per_block}")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != n_cols // per_block * nbytes:
        raise ValueError(f"{qtype.name}: expected uint8 rows of {n_cols // per_block * nbytes} bytes, "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    return raw.view(raw.shape[0], n_cols // per_block, nbytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> float32 [...] (IEEE half, widened exactly)."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _low_then_high(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] packed bytes -> [..., 32] values: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes -> (scale[8], min[8]), 6-bit integers."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    minimum = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, minimum


def int4_groups(qtype: QT, raw: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nibbles [rows, n_cols/2] uint8, scale [rows, n_cols/32], minimum [rows, n_cols/32])."""
    if qtype not in INT4_GROUPED:
        raise ValueError(f"{qtype.name} is not a 4-bit grouped format")
    b = _blocks(qtype, raw, n_cols)
    rows = b.shape[0]
    if qtype == QT.Q4_0:
        d = _f16(b[..., 0:2])
        q = _low_then_high(b[..., 2:18])
        scale, minimum = d, -8.0 * d
    elif qtype == QT.Q4_1:
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q = _low_then_high(b[..., 4:20])
        scale, minimum = d, m
    else:  # Q4_K
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _q4k_scales(b[..., 4:16])
        qs = b[..., 16:144].reshape(rows, -1, 4, 32)  # each 32-byte run: sub-blocks 2i (low), 2i+1 (high)
        q = torch.stack([qs & 0x0F, qs >> 4], dim=3)
        scale = d[..., None] * sc.float()
        minimum = -(dmin[..., None] * mn.float())
    q = q.reshape(rows, n_cols)
    nibbles = (q[:, 0::2] << 4) | q[:, 1::2]
    return nibbles, scale.reshape(rows, n_cols // GROUP), minimum.reshape(rows, n_cols // GROUP)


def dequantize(qtype: QT, raw: torch.Tensor, n_cols: int) -> torch.Tensor:
    """float32 [rows, n_cols] from raw bytes [rows, row_bytes] of a type in DEQUANTIZED."""
    if qtype not in DEQUANTIZED:
        raise ValueError(f"{qtype.name} is not dequantized on the device")
    rows = raw.shape[0]
    if qtype == QT.F32:
        return raw.contiguous().view(torch.float32).reshape(rows, n_cols).clone()
    if qtype == QT.F16:
        return raw.contiguous().view(torch.float16).reshape(rows, n_cols).float()
    if qtype == QT.BF16:
        return raw.contiguous().view(torch.bfloat16).reshape(rows, n_cols).float()
    b = _blocks(qtype, raw, n_cols)  # Q8_0: [d:f16][32 x int8]
    q = b[..., 2:34].contiguous().view(torch.int8).float()
    return (_f16(b[..., 0:2])[..., None] * q).reshape(rows, n_cols)
