"""GGML block formats: unpack raw GGUF tensor bytes into numbers.

Three entry points, all pure (numpy in, numpy out, no torch, no I/O):

- `dequantize(qtype, raw, n_cols)` -> float32 [rows, n_cols]; the oracle in the tests is
  `gguf.quants.dequantize`, which this must equal exactly.
- `unpack_int4_groups(qtype, raw, n_cols)` -> `Int4Groups(q, scale, minimum)` for the formats
  whose values are exactly `q * scale + minimum` over groups of 32 columns with 4-bit `q`
  (Q4_0, Q4_1, Q4_K).  The engine feeds these to torch's groupwise int4 matmul kernels
  without re-quantizing anything.
- `unpack_int8_groups(qtype, raw, n_cols)` -> `Int8Groups(q, scale, group)` for the formats
  whose values are exactly `q * scale` with 8-bit signed `q` over groups of 32 (Q8_0) or 16
  (Q6_K: scale = d * sc, a product of a float16 and an int8, exact in float32).

Block layouts (little-endian, one row = n_cols / block_size blocks):
  Q4_0  [d:f16][qs:16B]            w = d * (q - 8); q low nibbles are elements 0..15, high 16..31
  Q4_1  [d:f16][m:f16][qs:16B]     w = d * q + m
  Q8_0  [d:f16][qs:32 x i8]        w = d * q
  Q4_K  [d:f16][dmin:f16][scales:12B][qs:128B]  8 sub-blocks of 32, 6-bit scale/min each;
        w = d*sc_j*q - dmin*m_j; each 32-byte run of qs holds sub-block 2i (low) and 2i+1 (high)
  Q6_K  [ql:128B][qh:64B][scales:16 x i8][d:f16]  w = d * sc_j * (q6 - 32), 16 sub-blocks of 16
It does not handle the other k-quants or the i-quants; `SUPPORTED` lists what it does.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

GROUP = 32  # int4 group size used by the packed kernels

# The tensor types this module unpacks; their block geometry is gguf's own table.
SUPPORTED = frozenset({QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K})
# qtype -> (elements per block, bytes per block), as gguf defines them
BLOCK = {q: GGML_QUANT_SIZES[q] for q in SUPPORTED}
INT4_GROUPED = frozenset({QT.Q4_0, QT.Q4_1, QT.Q4_K})
INT8_GROUPS = {QT.Q8_0: 32, QT.Q6_K: 16}  # 8-bit grouped types -> inputs per scale
INT8_GROUPED = frozenset(INT8_GROUPS)


@dataclass(frozen=True)
class Int4Groups:
    """w[r, c] == q[r, c] * scale[r, c // 32] + minimum[r, c // 32], exactly."""

    q: np.ndarray  # uint8 [rows, cols], values 0..15
    scale: np.ndarray  # float32 [rows, cols // 32]
    minimum: np.ndarray  # float32 [rows, cols // 32]


@dataclass(frozen=True)
class Int8Groups:
    """w[r, c] == q[r, c] * scale[r, c // group], exactly."""

    q: np.ndarray  # int8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols // group]
    group: int


def _blocks(qtype: QT, raw: np.ndarray, n_cols: int) -> np.ndarray:
    """View raw bytes as uint8 [rows, blocks_per_row, bytes_per_block]."""
    per_block, nbytes = BLOCK[qtype]
    if n_cols <= 0 or n_cols % per_block:
        raise ValueError(f"{qtype.name}: row length {n_cols} is not a multiple of {per_block}")
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    row_bytes = n_cols // per_block * nbytes
    if raw.size % row_bytes:
        raise ValueError(f"{qtype.name}: {raw.size} bytes is not a whole number of rows of {row_bytes}")
    return raw.reshape(-1, n_cols // per_block, nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two trailing bytes -> float32 (from IEEE half)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] packed bytes -> [..., 32] values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes -> (scale[8], min[8]) 6-bit integers."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    minimum = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale, minimum


def unpack_int4_groups(qtype: QT, raw: np.ndarray, n_cols: int) -> Int4Groups:
    b = _blocks(qtype, raw, n_cols)
    rows = b.shape[0]
    if qtype == QT.Q4_0:
        d = _f16(b[..., 0:2])
        q = _nibbles_32(b[..., 2:18])
        scale, minimum = d, -8.0 * d
    elif qtype == QT.Q4_1:
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q = _nibbles_32(b[..., 4:20])
        scale, minimum = d, m
    elif qtype == QT.Q4_K:
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _q4k_scales(b[..., 4:16])
        qs = b[..., 16:144].reshape(rows, -1, 4, 32)  # 4 runs of 32 bytes per super-block
        q = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [rows, nb, 4, 2, 32] -> sub-block 2i, 2i+1
        scale = d[..., None] * sc.astype(np.float32)
        minimum = -(dmin[..., None] * mn.astype(np.float32))
    else:
        raise ValueError(f"{qtype.name} is not a 4-bit grouped format")
    return Int4Groups(
        q=np.ascontiguousarray(q.reshape(rows, n_cols)),
        scale=np.ascontiguousarray(scale.reshape(rows, n_cols // GROUP), dtype=np.float32),
        minimum=np.ascontiguousarray(minimum.reshape(rows, n_cols // GROUP), dtype=np.float32),
    )


def _q6_k_parts(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks -> (q - 32 as int8 [rows, 256 * nb], d * sc as float32 [rows, 16 * nb])."""
    rows, nb = b.shape[:2]
    ql = b[..., 0:128].reshape(rows, nb, 2, 64)
    qh = b[..., 128:192].reshape(rows, nb, 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32).reshape(rows, nb, 16)
    d = _f16(b[..., 208:210])
    # Each 128-element half: four runs of 32 built from ql (low 4 bits) and qh (2 high bits);
    # each run of 32 holds two sub-blocks of 16, in element order.
    lo = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
    q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)  # [rows, nb, 2, 4, 32]
    return q.reshape(rows, -1), (d[:, :, None] * sc).reshape(rows, -1)


def unpack_int8_groups(qtype: QT, raw: np.ndarray, n_cols: int) -> Int8Groups:
    b = _blocks(qtype, raw, n_cols)
    rows = b.shape[0]
    if qtype == QT.Q8_0:
        q = np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(rows, n_cols)
        return Int8Groups(q=q, scale=np.ascontiguousarray(_f16(b[..., 0:2])), group=INT8_GROUPS[qtype])
    if qtype == QT.Q6_K:
        q, scale = _q6_k_parts(b)
        return Int8Groups(q=np.ascontiguousarray(q), scale=np.ascontiguousarray(scale, dtype=np.float32),
                          group=INT8_GROUPS[qtype])
    raise ValueError(f"{qtype.name} is not an 8-bit grouped format")


def dequantize(qtype: QT, raw: np.ndarray, n_cols: int) -> np.ndarray:
    """Raw GGUF tensor bytes (or typed array for float types) -> float32 [rows, n_cols]."""
    if qtype not in SUPPORTED:
        raise ValueError(f"unsupported tensor type {qtype.name}")
    if qtype == QT.F32:
        return np.ascontiguousarray(raw).view(np.float32).reshape(-1, n_cols).copy()
    if qtype == QT.F16:
        return np.ascontiguousarray(raw).view(np.float16).reshape(-1, n_cols).astype(np.float32)
    if qtype == QT.BF16:
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(-1, n_cols)
    if qtype in INT4_GROUPED:
        g = unpack_int4_groups(qtype, raw, n_cols)
        rows = g.q.shape[0]
        q = g.q.reshape(rows, -1, GROUP).astype(np.float32)
        if qtype == QT.Q4_0:  # keep llama.cpp's rounding: d * (q - 8), not d*q - 8d
            return (g.scale[..., None] * (q - 8.0)).reshape(rows, n_cols)
        return (g.scale[..., None] * q + g.minimum[..., None]).reshape(rows, n_cols)
    b = _blocks(qtype, raw, n_cols)
    if qtype in INT8_GROUPED:
        g = unpack_int8_groups(qtype, raw, n_cols)
        rows = g.q.shape[0]
        q = g.q.reshape(rows, -1, g.group).astype(np.float32)
        return (g.scale[..., None] * q).reshape(rows, n_cols)
    raise AssertionError(qtype)
