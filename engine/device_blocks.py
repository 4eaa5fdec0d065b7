"""GGUF blocks unpacked by torch ops on the device the weights go to.

Loading onto a GPU used to unpack every block with numpy on the host (engine.quants), pack the
result again and copy the unpacked forms over: a few seconds for a 1B model, most of a load.
Here a tensor's raw bytes, read from the file's mapping, cross to the device once as they are
stored, and the device unpacks them:

- `int4_groups(qtype, raw, n_cols)`: raw bytes [rows, row_bytes] (uint8, any device) of a Q4_0,
  Q4_1 or Q4_K matrix -> (nibbles uint8 [rows, n_cols / 2] with input 2j in the high nibble of
  byte j and 2j + 1 in the low one, the layout of engine.cuda_int4; scale and minimum float32
  [rows, n_cols / 32]), the same numbers as engine.quants.unpack_int4_groups.
- `int8_groups(qtype, raw, n_cols)`: raw bytes of an engine.quants.INT8_GROUPS type (Q8_0, Q6_K,
  Q5_0, Q5_1, Q5_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS) or of a 4-bit grouped one (Q4_0 as q - 8 without
  a minimum) -> `Int8Tensors(q int8 [rows, n_cols], scale float32 [rows, n_cols / group], group,
  minimum of scale's shape or None)`, the same numbers as engine.quants.unpack_int8_groups.
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
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf_file import TensorRecord
from engine.quants import BLOCK, GROUP, INT4_GROUPED, INT8_GROUPS, IQ4_LEVELS

DEQUANTIZED = frozenset({QT.F32, QT.F16, QT.BF16, QT.Q8_0})


class Int8Tensors(NamedTuple):
    """engine.quants.Int8Groups as tensors on the raw bytes' device: w[r, c] == q[r, c] *
    scale[r, c // group] (+ minimum[r, c // group]), in float32 in that order."""

    q: torch.Tensor  # int8 [rows, n_cols]
    scale: torch.Tensor  # float32 [rows, n_cols // group]
    group: int
    minimum: torch.Tensor | None  # float32 like scale; None for the types without one


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


def _int4_values(qtype: QT, raw: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [rows, n_cols] 0..15, scale, minimum float32 [rows, n_cols/32]) of a 4-bit type."""
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
    return q.reshape(rows, n_cols), scale.reshape(rows, n_cols // GROUP), minimum.reshape(rows, n_cols // GROUP)


def int4_groups(qtype: QT, raw: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nibbles [rows, n_cols/2] uint8, scale [rows, n_cols/32], minimum [rows, n_cols/32])."""
    q, scale, minimum = _int4_values(qtype, raw, n_cols)
    return (q[:, 0::2] << 4) | q[:, 1::2], scale, minimum


# Row v: the 8 bits of byte v, lowest first.  Unpacking bit planes is one gather from it
# (broadcast shifts of uint8 tensors took twice as long on a CPU: Q5_0's high bits of one
# DeepSeek-V2-Lite layer, 1.18 s against 0.57 s, interleaved).
_BIT_TABLE = ((torch.arange(256, dtype=torch.int32)[:, None] >> torch.arange(8, dtype=torch.int32)) & 1).to(torch.uint8)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[..., B] bytes -> [..., B, 8]: bit i of byte j at [j, i] (the high bits of Q5_0/Q5_1,
    Q5_K and Q3_K)."""
    return _BIT_TABLE.to(b.device)[b.long()]


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """[..., 32] bytes -> [..., 4, 32]: the 2-bit fields at shifts 0, 2, 4, 6 (Q2_K, Q3_K, and
    Q6_K's high bits)."""
    return torch.stack([(qs >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)


def _five_bit_32(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: a 4-byte word of high bits (bit j is element j's) and 16 nibble bytes ->
    [..., 32] values 0..31."""
    high = _bits(qh).reshape(*qh.shape[:-1], 32)  # element 8 * byte + bit
    return _low_then_high(qs) | (high << 4)


def _levels(codes: torch.Tensor) -> torch.Tensor:
    """IQ4_NL's and IQ4_XS's 4-bit codes -> their int8 levels (engine.quants.IQ4_LEVELS)."""
    return torch.from_numpy(IQ4_LEVELS).to(codes.device)[codes.long()]


# Each unpacker, as engine.quants' of the same name: blocks uint8 [rows, nb, bytes] -> (q int8
# [rows, nb, per_block], scale float32 [rows, nb, per_block // group], minimum likewise or None).
def _q8_0(b):
    return b[..., 2:34].view(torch.int8), _f16(b[..., 0:2])[..., None], None


def _q6_k(b):
    rows, nb = b.shape[:2]
    ql = b[..., 0:128].reshape(rows, nb, 2, 64)
    qh = b[..., 128:192].reshape(rows, nb, 2, 32)
    sc = b[..., 192:208].view(torch.int8).float()
    d = _f16(b[..., 208:210])
    # Each 128-element half: four runs of 32 from ql (low 4 bits) and qh (2 high bits).
    lo = torch.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=3)
    hi = _crumbs(qh)  # [rows, nb, 2, 4, 32]
    q = (lo | (hi << 4)).view(torch.int8) - 32  # 0..63 is the same byte in int8
    return q.reshape(rows, nb, 256), d[..., None] * sc, None


def _q5_0(b):
    return _five_bit_32(b[..., 2:6], b[..., 6:22]).view(torch.int8) - 16, _f16(b[..., 0:2])[..., None], None


def _q5_1(b):
    q = _five_bit_32(b[..., 4:8], b[..., 8:24]).view(torch.int8)
    return q, _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]


def _q5_k(b):
    rows, nb = b.shape[:2]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _q4k_scales(b[..., 4:16])
    qs = b[..., 48:176].reshape(rows, nb, 4, 1, 32)
    low = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, nb, 256)  # sub-blocks 2i, 2i+1 per run
    high = _bits(b[..., 16:48]).transpose(-1, -2).reshape(rows, nb, 256)  # bit i of byte j: element 32 i + j
    q = (low | (high << 4)).view(torch.int8)
    return q, d[..., None] * sc.float(), -(dmin[..., None] * mn.float())


def _q3_k(b):
    rows, nb = b.shape[:2]
    d = _f16(b[..., 108:110])
    lo, hi = b[..., 96:104], b[..., 104:108]
    # Sixteen 6-bit scales: low nibbles of bytes 0..7 then their high nibbles, each with two
    # high bits from bytes 8..11 (2-bit fields, byte j % 4, field j // 4).
    low4 = torch.cat([lo & 0x0F, lo >> 4], dim=-1)
    high2 = _crumbs(hi).reshape(rows, nb, 16)
    sc = ((low4 | (high2 << 4)).float() - 32)  # 0..63 - 32, exact in float32
    low2 = _crumbs(b[..., 32:96].reshape(rows, nb, 2, 32)).reshape(rows, nb, 256)  # half, shift, byte
    # A set bit in hmask means "no offset"; a clear one subtracts 4.
    high = _bits(b[..., 0:32]).transpose(-1, -2).reshape(rows, nb, 256)  # as Q5_K's
    q = low2.view(torch.int8) - ((1 - high) << 2).view(torch.int8)
    return q, d[..., None] * sc, None


def _q2_k(b):
    rows, nb = b.shape[:2]
    scales = b[..., 0:16]
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
    q = _crumbs(b[..., 16:80].reshape(rows, nb, 2, 32)).reshape(rows, nb, 256).view(torch.int8)
    scale = d[..., None] * (scales & 0x0F).float()
    return q, scale, -(dmin[..., None] * (scales >> 4).float())


def _iq4_nl(b):
    return _levels(_low_then_high(b[..., 2:18])), _f16(b[..., 0:2])[..., None], None


def _iq4_xs(b):
    rows, nb = b.shape[:2]
    d = _f16(b[..., 0:2])
    # 2 high bits per sub-block from a little-endian uint16 (torch shifts no uint16: widen to int32)
    word = b[..., 2:3].int() | (b[..., 3:4].int() << 8)  # [rows, nb, 1]
    high = (word >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
    low = b[..., 4:8]
    low = torch.stack([low & 0x0F, low >> 4], dim=-1).reshape(rows, nb, 8)
    ls = (low.int() | (high << 4)) - 32
    q = _levels(_low_then_high(b[..., 8:136].reshape(rows, nb, 8, 16))).reshape(rows, nb, 256)
    return q, d[..., None] * ls.float(), None


_INT8_UNPACK = {QT.Q8_0: _q8_0, QT.Q6_K: _q6_k, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1, QT.Q5_K: _q5_k,
                QT.Q3_K: _q3_k, QT.Q2_K: _q2_k, QT.IQ4_NL: _iq4_nl, QT.IQ4_XS: _iq4_xs}


def int8_groups(qtype: QT, raw: torch.Tensor, n_cols: int) -> Int8Tensors:
    """The 8-bit grouped form of an engine.quants.INT8_GROUPS type, or of a 4-bit grouped one
    (groups of 32; Q4_0 as q - 8 without a minimum, as gguf computes it) for a matrix that
    holds both kinds."""
    if qtype in INT4_GROUPED:
        q, scale, minimum = _int4_values(qtype, raw, n_cols)
        if qtype == QT.Q4_0:
            return Int8Tensors(q.view(torch.int8) - 8, scale, GROUP, None)
        return Int8Tensors(q.view(torch.int8), scale, GROUP, minimum)
    if qtype not in _INT8_UNPACK:
        raise ValueError(f"{qtype.name} is not an 8-bit grouped format")
    b = _blocks(qtype, raw, n_cols)
    rows = b.shape[0]
    q, scale, minimum = _INT8_UNPACK[qtype](b)

    def flat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(rows, -1).contiguous()

    return Int8Tensors(q.reshape(rows, n_cols).contiguous(), flat(scale), INT8_GROUPS[qtype], flat(minimum))


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
