"""GGML block formats: unpack raw GGUF tensor bytes into numbers.

Three entry points, all pure (numpy in, numpy out, no torch, no I/O):

- `dequantize(qtype, raw, n_cols)` -> float32 [rows, n_cols]; the oracle in the tests is
  `gguf.quants.dequantize`, which this must equal exactly.
- `unpack_int4_groups(qtype, raw, n_cols)` -> `Int4Groups(q, scale, minimum)` for the formats
  whose values are exactly `q * scale + minimum` over groups of 32 columns with 4-bit `q`
  (Q4_0, Q4_1, Q4_K).  The engine feeds these to torch's groupwise int4 matmul kernels
  without re-quantizing anything.
- `unpack_coded_groups(qtype, raw, n_cols)` -> `CodedGroups(codes, scale, minimum, levels)` for
  the formats whose values are exactly `value(code) * scale + minimum` over groups of 32
  columns with a 4- or 5-bit code (`CODED`: the 4-bit types above, Q5_0, Q5_1, Q5_K, IQ4_NL,
  IQ4_XS), value being the code itself or, for the IQ4 types, the level it names.
- `unpack_int8_groups(qtype, raw, n_cols)` -> `Int8Groups(q, scale, group, minimum)` for the
  formats whose values are exactly `q * scale (+ minimum)` with an 8-bit signed `q` over groups
  of 32 or 16 columns (`INT8_GROUPS`), the scale (and minimum) a float16 field or the product
  of one and a small integer, exact in float32: Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, Q3_K, Q2_K,
  IQ4_NL and IQ4_XS (the IQ4 types' q is the level a 4-bit code names, -127..113).  Only
  `INT8_WITH_MINIMUM` (Q5_1, Q5_K, Q2_K) have a minimum.

Block layouts (little-endian, one row = n_cols / block_size blocks; sub-block j of a k-quant
covers elements 32j.. (or 16j..); "nibbles" = low nibbles of 16 bytes are elements 0..15,
high nibbles 16..31):
  Q4_0   [d:f16][qs:16B]            w = d * (q - 8), nibbles
  Q4_1   [d:f16][m:f16][qs:16B]     w = d * q + m
  Q5_0   [d:f16][qh:u32][qs:16B]    w = d * (q - 16); q = nibble | bit j of qh << 4
  Q5_1   [d:f16][m:f16][qh:u32][qs:16B]  w = d * q + m, q as Q5_0's
  Q8_0   [d:f16][qs:32 x i8]        w = d * q
  IQ4_NL [d:f16][qs:16B]            w = d * LEVEL[nibble]
  Q4_K   [d:f16][dmin:f16][scales:12B][qs:128B]  8 sub-blocks of 32, 6-bit scale/min each;
         w = d*sc_j*q - dmin*m_j; each 32-byte run of qs holds sub-block 2i (low) and 2i+1 (high)
  Q5_K   [d:f16][dmin:f16][scales:12B][qh:32B][qs:128B]  Q4_K plus a fifth bit: element 32i + j
         takes bit i of qh[j]
  Q6_K   [ql:128B][qh:64B][scales:16 x i8][d:f16]  w = d * sc_j * (q6 - 32), 16 sub-blocks of 16
  Q3_K   [hmask:32B][qs:64B][scales:12B][d:f16]  16 sub-blocks of 16, signed 6-bit scales (minus
         32); q = 2-bit field - 4 where bit i of hmask[j] (element 32i + j) is clear; w = d*sc_j*q
  Q2_K   [scales:16B][qs:64B][d:f16][dmin:f16]  16 sub-blocks of 16, a byte each (scale low
         nibble, min high); w = d*sc_j*q - dmin*m_j, q 2 bits
  IQ4_XS [d:f16][scales_h:u16][scales_l:4B][qs:128B]  8 sub-blocks of 32 with 6-bit scales
         (minus 32); w = d*ls_j*LEVEL[nibble], nibbles per sub-block
In Q2_K and Q3_K each 32-byte run of qs holds four sub-runs of 32 elements, at bit shifts 0, 2,
4 and 6.  It does not handle the remaining i-quants (IQ1_*, IQ2_*, IQ3_*), the ternary TQ1_0 /
TQ2_0, MXFP4 or NVFP4, nor Q8_1/Q8_K (llama.cpp's activation types); `SUPPORTED` lists what it
does, and dequantize() names the type it refuses.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

GROUP = 32  # int4 group size used by the packed kernels

# The tensor types this module unpacks; their block geometry is gguf's own table.
INT4_GROUPED = frozenset({QT.Q4_0, QT.Q4_1, QT.Q4_K})
# 8-bit grouped types -> inputs per scale (and per minimum, for INT8_WITH_MINIMUM)
INT8_GROUPS = {QT.Q8_0: 32, QT.Q6_K: 16, QT.Q5_0: 32, QT.Q5_1: 32, QT.Q5_K: 32, QT.Q3_K: 16, QT.Q2_K: 16,
               QT.IQ4_NL: 32, QT.IQ4_XS: 32}
INT8_GROUPED = frozenset(INT8_GROUPS)
INT8_WITH_MINIMUM = frozenset({QT.Q5_1, QT.Q5_K, QT.Q2_K})
# Types whose values are a 4- or 5-bit code's value times a scale plus a minimum, over groups of
# 32: the code itself (LINEAR_CODES), or a level of IQ4_LEVELS (the IQ4 types).
FIFTH_BIT_CODES = frozenset({QT.Q5_0, QT.Q5_1, QT.Q5_K})  # codes of 5 bits: 0..31
LINEAR_CODES = INT4_GROUPED | FIFTH_BIT_CODES
LEVEL_CODES = frozenset({QT.IQ4_NL, QT.IQ4_XS})
CODED = LINEAR_CODES | LEVEL_CODES
SUPPORTED = frozenset({QT.F32, QT.F16, QT.BF16}) | INT4_GROUPED | INT8_GROUPED
# qtype -> (elements per block, bytes per block), as gguf defines them
BLOCK = {q: GGML_QUANT_SIZES[q] for q in SUPPORTED}


@dataclass(frozen=True)
class Int4Groups:
    """w[r, c] == q[r, c] * scale[r, c // 32] + minimum[r, c // 32], exactly."""

    q: np.ndarray  # uint8 [rows, cols], values 0..15
    scale: np.ndarray  # float32 [rows, cols // 32]
    minimum: np.ndarray  # float32 [rows, cols // 32]


@dataclass(frozen=True)
class Int8Groups:
    """w[r, c] == q[r, c] * scale[r, c // group] (+ minimum[r, c // group]), computed in
    float32 in that order; the products are exact, so only the addition of a minimum rounds."""

    q: np.ndarray  # int8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols // group]
    group: int
    minimum: np.ndarray | None = None  # float32 [rows, cols // group]; None for the types without


@dataclass(frozen=True)
class CodedGroups:
    """w[r, c] == value(codes[r, c]) * scale[r, c // 32] + minimum[r, c // 32], exactly, where
    value(code) is the code (0..31) or, with `levels`, levels[code] (codes 0..15)."""

    codes: np.ndarray  # uint8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols // 32]
    minimum: np.ndarray  # float32 [rows, cols // 32]
    levels: np.ndarray | None = None  # int8 [16]


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


def _bits(b: np.ndarray, n: int) -> np.ndarray:
    """[..., B] bytes -> [..., n, B]: bit i of every byte in row i (the high-bit planes of
    Q5_K, Q3_K and, as a 32-bit word, Q5_0/Q5_1)."""
    return (b[..., None, :] >> np.arange(n, dtype=np.uint8)[:, None]) & 1


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """[..., 32] bytes -> [..., 4, 32]: the 2-bit fields at shifts 0, 2, 4, 6 (Q2_K, Q3_K)."""
    return (qs[..., None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3


def _five_bit_32(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: a 4-byte word of high bits (bit j is element j's) and 16 nibble bytes ->
    [..., 32] values 0..31."""
    high = _bits(qh, 8)  # [..., 8 bits, 4 bytes]: element 8 * byte + bit
    high = high.swapaxes(-1, -2).reshape(*qh.shape[:-1], 32)
    return _nibbles_32(qs) | (high << 4)


# IQ4_NL's and IQ4_XS's 16 non-uniform levels, indexed by the 4-bit code.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


# Each unpacker: blocks uint8 [rows, nb, bytes] -> (q int8 [rows, nb, per_block],
# scale float32 [rows, nb, per_block // group], minimum of the same shape or None), such that
# w = scale * q (+ minimum) per group, computed in float32 in that order, is gguf's value.
def _q8_0(b):
    return b[..., 2:34].view(np.int8), _f16(b[..., 0:2])[..., None], None


def _q6_k(b):
    rows, nb = b.shape[:2]
    ql = b[..., 0:128].reshape(rows, nb, 2, 64)
    qh = b[..., 128:192].reshape(rows, nb, 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    # Each 128-element half: four runs of 32 built from ql (low 4 bits) and qh (2 high bits);
    # each run of 32 holds two sub-blocks of 16, in element order.
    lo = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
    q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)  # [rows, nb, 2, 4, 32]
    return q.reshape(rows, nb, 256), d[..., None] * sc, None


def _q5_0(b):
    q = _five_bit_32(b[..., 2:6], b[..., 6:22]).astype(np.int8) - np.int8(16)
    return q, _f16(b[..., 0:2])[..., None], None


def _q5_1(b):
    q = _five_bit_32(b[..., 4:8], b[..., 8:24]).astype(np.int8)
    return q, _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]


def _q5_k(b):
    rows, nb = b.shape[:2]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _q4k_scales(b[..., 4:16])
    qs = b[..., 48:176].reshape(rows, nb, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, nb, 256)  # sub-blocks 2i, 2i+1 per run
    high = _bits(b[..., 16:48], 8).reshape(rows, nb, 256)  # bit i of byte j: element 32 i + j
    q = (low | (high << 4)).astype(np.int8)
    return q, d[..., None] * sc.astype(np.float32), -(dmin[..., None] * mn.astype(np.float32))


def _q3_k(b):
    rows, nb = b.shape[:2]
    d = _f16(b[..., 108:110])
    lo, hi = b[..., 96:104], b[..., 104:108]
    # Sixteen 6-bit scales: low nibbles of bytes 0..7 then their high nibbles, each with two
    # high bits from bytes 8..11 (2-bit fields, byte j % 4, field j // 4).
    low4 = np.concatenate([lo & 0x0F, lo >> 4], axis=-1)
    high2 = _crumbs(hi).reshape(rows, nb, 16)
    sc = ((low4 | (high2 << 4)).astype(np.int16) - 32).astype(np.float32)
    low2 = _crumbs(b[..., 32:96].reshape(rows, nb, 2, 32)).reshape(rows, nb, 256)  # half, shift, byte
    # A set bit in hmask means "no offset"; a clear one subtracts 4.
    high = _bits(b[..., 0:32], 8).reshape(rows, nb, 256)
    q = low2.astype(np.int8) - ((1 - high).astype(np.int8) << 2)
    return q, d[..., None] * sc, None


def _q2_k(b):
    rows, nb = b.shape[:2]
    scales = b[..., 0:16]
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
    q = _crumbs(b[..., 16:80].reshape(rows, nb, 2, 32)).reshape(rows, nb, 256).astype(np.int8)
    scale = d[..., None] * (scales & 0x0F).astype(np.float32)
    return q, scale, -(dmin[..., None] * (scales >> 4).astype(np.float32))


def _iq4_nl(b):
    return IQ4_LEVELS[_nibbles_32(b[..., 2:18])], _f16(b[..., 0:2])[..., None], None


def _iq4_xs_codes(b):
    """IQ4_XS blocks -> (codes [rows, nb, 256], scale float32 [rows, nb, 8])."""
    rows, nb = b.shape[:2]
    d = _f16(b[..., 0:2])
    high = b[..., 2:4].copy().view(np.uint16)  # [rows, nb, 1]: 2 high bits per sub-block
    high = (high >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    low = b[..., 4:8]
    low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(rows, nb, 8)
    ls = (low | (high.astype(np.uint8) << 4)).astype(np.int16) - 32
    codes = _nibbles_32(b[..., 8:136].reshape(rows, nb, 8, 16)).reshape(rows, nb, 256)
    return codes, d[..., None] * ls.astype(np.float32)


def _iq4_xs(b):
    codes, scale = _iq4_xs_codes(b)
    return IQ4_LEVELS[codes], scale, None


_INT8_UNPACK = {QT.Q8_0: _q8_0, QT.Q6_K: _q6_k, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1, QT.Q5_K: _q5_k,
                QT.Q3_K: _q3_k, QT.Q2_K: _q2_k, QT.IQ4_NL: _iq4_nl, QT.IQ4_XS: _iq4_xs}


def unpack_int8_groups(qtype: QT, raw: np.ndarray, n_cols: int) -> Int8Groups:
    """The 8-bit grouped form of `INT8_GROUPS` types, and of the 4-bit grouped ones (groups of
    32; Q4_0 as q - 8 without a minimum) for a matrix that fuses both kinds."""
    if qtype in INT4_GROUPED:
        g4 = unpack_int4_groups(qtype, raw, n_cols)
        if qtype == QT.Q4_0:  # d * (q - 8), as gguf computes it
            return Int8Groups(q=g4.q.astype(np.int8) - np.int8(8), scale=g4.scale, group=GROUP)
        return Int8Groups(q=g4.q.astype(np.int8), scale=g4.scale, group=GROUP, minimum=g4.minimum)
    if qtype not in _INT8_UNPACK:
        raise ValueError(f"{qtype.name} is not an 8-bit grouped format")
    b = _blocks(qtype, raw, n_cols)
    rows = b.shape[0]
    q, scale, minimum = _INT8_UNPACK[qtype](b)

    def flat(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a.reshape(rows, -1), dtype=np.float32)

    return Int8Groups(q=np.ascontiguousarray(q).reshape(rows, n_cols), scale=flat(scale),
                      group=INT8_GROUPS[qtype], minimum=flat(minimum))


def unpack_coded_groups(qtype: QT, raw: np.ndarray, n_cols: int) -> CodedGroups:
    """The coded form of a `CODED` type (see CodedGroups).  Q5_0's w = d * (q - 16) becomes
    q * d - 16 d, exact in float32 (q has 5 bits, d 11); the IQ4 types' codes are their nibbles."""
    if qtype in INT4_GROUPED:
        g4 = unpack_int4_groups(qtype, raw, n_cols)
        return CodedGroups(codes=g4.q, scale=g4.scale, minimum=g4.minimum)
    if qtype not in CODED:
        raise ValueError(f"{qtype.name} is not a coded format")
    b = _blocks(qtype, raw, n_cols)
    rows = b.shape[0]
    levels = None
    if qtype in LEVEL_CODES:
        levels = IQ4_LEVELS
        if qtype == QT.IQ4_NL:
            codes, scale = _nibbles_32(b[..., 2:18]), _f16(b[..., 0:2])[..., None]
        else:
            codes, scale = _iq4_xs_codes(b)
        minimum = np.zeros_like(scale)
    else:
        q, scale, minimum = _INT8_UNPACK[qtype](b)
        if qtype == QT.Q5_0:
            q, minimum = q + np.int8(16), -16.0 * scale
        codes = q.astype(np.uint8)

    def flat(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(rows, -1), dtype=np.float32)

    return CodedGroups(codes=np.ascontiguousarray(codes).reshape(rows, n_cols), scale=flat(scale),
                       minimum=flat(minimum), levels=levels)


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
    g = unpack_int8_groups(qtype, raw, n_cols)
    rows = g.q.shape[0]
    w = g.scale[..., None] * g.q.reshape(rows, -1, g.group).astype(np.float32)
    if g.minimum is not None:
        w += g.minimum[..., None]
    return w.reshape(rows, n_cols)
