"""engine.device_blocks: torch unpacking of GGUF blocks equals engine.quants' numpy unpacking bit
for bit (checked on the CPU; the same ops run on the GPU at load), and the CUDA matrices built
from it equal the ones built from the host's unpacking."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine import cuda_int4, device_blocks
from engine.gguf_file import TensorRecord
from engine.quants import BLOCK, dequantize, unpack_int4_groups

CPU = torch.device("cpu")


def blocks(qtype: QT, rows: int, cols: int, seed: int, extreme: bool = False) -> np.ndarray:
    """Random bytes in `qtype`'s blocks whose float16 fields are finite (of every magnitude with
    `extreme`, so that Q4_K's products of two fields can leave float16's range)."""
    rng = np.random.default_rng(seed)
    per, nbytes = BLOCK[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    fields = {QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q4_K: (0, 2), QT.Q8_0: (0,)}[qtype]
    for off in fields:
        mag = 10.0 ** rng.uniform(-8, 4.5, size=(rows, cols // per, 1)) if extreme else rng.random((rows, cols // per, 1))
        sign = rng.choice([-1.0, 1.0], size=mag.shape)
        raw[..., off: off + 2] = (sign * mag).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K])
@pytest.mark.parametrize("extreme", [False, True])
def test_int4_groups_equal_the_host_unpacking(qtype, extreme):
    cols = 512
    raw = blocks(qtype, 24, cols, seed=int(qtype) + extreme, extreme=extreme)
    nibbles, scale, minimum = device_blocks.int4_groups(qtype, torch.from_numpy(raw), cols)
    host = unpack_int4_groups(qtype, raw, cols)
    assert torch.equal(nibbles, torch.from_numpy((host.q[:, ::2] << 4) | host.q[:, 1::2]))
    assert np.array_equal(scale.numpy().view(np.uint32), host.scale.view(np.uint32))
    assert np.array_equal(minimum.numpy().view(np.uint32), host.minimum.view(np.uint32))


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0])
def test_dequantize_equals_the_host_dequantization(qtype):
    rows, cols = 7, 96
    rng = np.random.default_rng(5)
    if qtype == QT.Q8_0:
        raw = blocks(qtype, rows, cols, seed=3)
    else:
        dtype = {QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16}[qtype]
        raw = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = (raw.view(np.uint32) >> 16).astype(np.uint16) if qtype == QT.BF16 else raw.astype(dtype)
        raw = raw.view(np.uint8).reshape(rows, -1)
    got = device_blocks.dequantize(qtype, torch.from_numpy(raw), cols)
    want = dequantize(qtype, raw, cols)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_raw_rows_are_the_records_bytes_by_row():
    raw = blocks(QT.Q4_1, 3, 64, seed=1)
    rec = TensorRecord("w", QT.Q4_1, (3, 64), raw.reshape(-1))
    rows = device_blocks.raw_rows(rec, CPU)
    assert rows.shape == (3, raw.shape[1]) and torch.equal(rows, torch.from_numpy(raw))


def test_wrong_shapes_and_types_are_refused():
    raw = torch.zeros(2, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="expected uint8 rows of 40 bytes"):
        device_blocks.int4_groups(QT.Q4_1, raw, 64)
    with pytest.raises(ValueError, match="not a 4-bit grouped format"):
        device_blocks.int4_groups(QT.Q8_0, raw, 64)
    with pytest.raises(ValueError, match="not dequantized on the device"):
        device_blocks.dequantize(QT.Q6_K, raw, 256)


@pytest.mark.parametrize("qtype,extreme", [(QT.Q4_1, False), (QT.Q4_K, True)])
def test_weights_built_from_device_groups_equal_the_host_built_ones(qtype, extreme):
    # Int4Weight holds tensors only; on the CPU its two constructors can be compared exactly,
    # including the float32 fallback of the scale pairs when a product leaves float16's range.
    cols = 256
    raw = blocks(qtype, 32, cols, seed=11, extreme=extreme)
    host = unpack_int4_groups(qtype, raw, cols)
    a = cuda_int4.Int4Weight(host.q, host.scale, host.minimum, CPU)
    b = cuda_int4.Int4Weight.from_nibbles(*device_blocks.int4_groups(qtype, torch.from_numpy(raw), cols))
    assert (a.n, a.k, a.gemm_rows) == (b.n, b.k, b.gemm_rows)
    assert torch.equal(a.nibbles, b.nibbles) and torch.equal(a.words, b.words)
    assert a.pairs.dtype == b.pairs.dtype and torch.equal(a.pairs, b.pairs)
    if extreme:
        assert b.pairs.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_linear_from_the_device_path_equals_the_host_path():
    from engine.weights import build_linear

    if not cuda_int4.AVAILABLE:
        pytest.skip("Triton is not installed")
    cols, dev = 256, torch.device("cuda")
    recs = [TensorRecord(f"w{i}", QT.Q4_K, (16 * (i + 1), cols), blocks(QT.Q4_K, 16 * (i + 1), cols, seed=i).reshape(-1))
            for i in range(3)]
    perm = np.random.default_rng(0).permutation(16 + 32 + 48)
    lin = build_linear(recs, "packed", dev, row_perm=perm)
    parts = [unpack_int4_groups(r.qtype, r.data, r.n_cols) for r in recs]
    q, s, m = (np.concatenate(x)[perm] for x in zip(*[(p.q, p.scale, p.minimum) for p in parts]))
    ref = cuda_int4.Int4Weight(q, s, m, dev)
    got = lin.cuda_weight
    assert torch.equal(got.nibbles, ref.nibbles) and torch.equal(got.pairs, ref.pairs)
    x = torch.randn(5, cols, device=dev)
    assert torch.equal(lin(x), ref(x))
