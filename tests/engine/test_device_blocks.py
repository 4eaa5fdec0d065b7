"""engine.device_blocks: torch unpacking of GGUF blocks equals engine.quants' numpy unpacking bit
for bit (checked on the CPU; the same ops run on the GPU at load), and the CUDA matrices and
stacked experts built from it equal the ones built from the host's unpacking."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine import cuda_int4, cuda_moe, device_blocks
from engine.gguf_file import TensorRecord
from engine.quants import BLOCK, INT4_GROUPED, INT8_GROUPS, dequantize, unpack_int4_groups, unpack_int8_groups

CPU = torch.device("cpu")
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA device")])
# Where each block type keeps its float16 fields (scales, minimums), by byte offset.
FLOAT16_FIELDS = {QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q4_K: (0, 2), QT.Q8_0: (0,), QT.Q5_0: (0,), QT.Q5_1: (0, 2),
                  QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q3_K: (108,), QT.Q2_K: (80, 82), QT.IQ4_NL: (0,),
                  QT.IQ4_XS: (0,)}


def blocks(qtype: QT, rows: int, cols: int, seed: int, extreme: bool = False) -> np.ndarray:
    """Random bytes in `qtype`'s blocks whose float16 fields are finite (of every magnitude with
    `extreme`, so that the K types' products of a field and a sub-block scale can leave
    float16's range); every other bit (codes, high bits, sub-block scales) takes all values."""
    rng = np.random.default_rng(seed)
    per, nbytes = BLOCK[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    for off in FLOAT16_FIELDS[qtype]:
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


def bits(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.cpu().numpy().view(np.uint32)


@pytest.mark.parametrize("qtype", sorted(INT8_GROUPS.keys() | INT4_GROUPED), ids=lambda t: t.name)
@pytest.mark.parametrize("extreme", [False, True])
def test_int8_groups_equal_the_host_unpacking(qtype, extreme):
    # 7 rows, 3 blocks a row (of 32 or 256 inputs): nothing in the unpacking may assume more
    cols = 3 * BLOCK[qtype][0]
    raw = blocks(qtype, 7, cols, seed=int(qtype) + 100 * extreme, extreme=extreme)
    got = device_blocks.int8_groups(qtype, torch.from_numpy(raw), cols)
    host = unpack_int8_groups(qtype, raw, cols)
    assert got.q.dtype == torch.int8 and got.q.shape == (7, cols) and got.group == host.group
    assert np.array_equal(got.q.numpy(), host.q)
    assert got.scale.dtype == torch.float32 and np.array_equal(bits(got.scale), host.scale.view(np.uint32))
    assert (got.minimum is None) == (host.minimum is None)
    if host.minimum is not None:
        assert np.array_equal(bits(got.minimum), host.minimum.view(np.uint32))


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
    with pytest.raises(ValueError, match="not an 8-bit grouped format"):
        device_blocks.int8_groups(QT.F16, raw, 20)
    with pytest.raises(ValueError, match="Q6_K: expected uint8 rows of 210 bytes"):
        device_blocks.int8_groups(QT.Q6_K, raw, 256)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        device_blocks.int8_groups(QT.Q5_0, raw, 40)


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


def host_int8_stack(parts: list[TensorRecord], n_expert: int,
                    device: torch.device = CPU) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [E, n, k], pairs) of an int8 stack as it was built before: numpy's unpacking of every
    part on the host, a larger group's scale and minimum repeated per smaller group, per expert
    the parts' rows one after the other, then copied to `device`."""
    groups = [unpack_int8_groups(r.qtype, r.data, r.n_cols) for r in parts]
    group = min(g.group for g in groups)

    def per_expert(arrays: list[np.ndarray]) -> torch.Tensor:
        joined = np.concatenate([a.reshape(n_expert, -1, a.shape[-1]) for a in arrays], axis=1)
        return torch.from_numpy(np.ascontiguousarray(joined)).to(device)

    def regrouped(g, values: np.ndarray | None) -> np.ndarray:
        return np.repeat(np.zeros_like(g.scale) if values is None else values, g.group // group, axis=1)

    pairs = cuda_int4.scale_pairs(per_expert([regrouped(g, g.scale) for g in groups]),
                                  per_expert([regrouped(g, g.minimum) for g in groups]))
    return per_expert([g.q for g in groups]), pairs


def expert_part(name: str, qtype: QT, n_expert: int, rows: int, cols: int, seed: int, extreme: bool) -> TensorRecord:
    raw = blocks(qtype, n_expert * rows, cols, seed=seed, extreme=extreme)
    return TensorRecord(name, qtype, (n_expert, rows, cols), raw.reshape(-1))


# CHUNK_WEIGHTS for the stacks below (3 experts of 7 + 5 rows of 512): all at once, one expert
# at a time, and two then one
CHUNKS = [pytest.param(cuda_moe.CHUNK_WEIGHTS, id="whole"), pytest.param(1, id="1-expert"),
          pytest.param(2 * 7 * 512, id="2-experts")]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("qtypes,extreme", [
    ((QT.Q5_0,), False),  # DeepSeek-V2-Lite's down projections
    ((QT.Q6_K, QT.Q4_K), True),  # groups of 16 and 32 in one stack; float32 pairs
    ((QT.Q8_0, QT.Q4_0), False),  # a type with no minimum beside one held as q - 8
    ((QT.Q5_K, QT.Q2_K), False),
    ((QT.IQ4_XS, QT.Q5_1), False),
    ((QT.Q3_K, QT.IQ4_NL), False),
], ids=lambda v: "-".join(t.name for t in v) if isinstance(v, tuple) else str(v))
def test_int8_stacks_built_on_the_device_equal_the_host_built_ones(monkeypatch, chunk, device, qtypes, extreme):
    """Several experts, parts of different row counts (none a multiple of 16) and types, built
    in chunks of experts: the stack's int8 values and (scale, minimum) pairs are the ones
    numpy's unpacking gave."""
    monkeypatch.setattr(cuda_moe, "CHUNK_WEIGHTS", chunk)
    E, k = 3, 512
    parts = [expert_part(f"part{i}", t, E, rows, k, seed=10 * i + int(t), extreme=extreme)
             for i, (t, rows) in enumerate(zip(qtypes * 2, (7, 5)))]
    stack = cuda_moe.StackedWeight(parts, torch.device(device))
    q, pairs = host_int8_stack(parts, E, torch.device(device))
    assert stack.format == cuda_moe.stack_format(qtypes) == "int8" and stack.n == 12
    assert stack.q.device == q.device and stack.pairs.device == pairs.device
    assert stack.group == min(INT8_GROUPS.get(t, 32) for t in qtypes)
    assert stack.q.is_contiguous() and torch.equal(stack.q, q)
    assert stack.pairs.dtype == pairs.dtype and torch.equal(stack.pairs, pairs)
    if extreme:
        assert pairs.dtype == torch.float32


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_int4_stacks_built_in_chunks_hold_each_experts_groups(monkeypatch, chunk, device):
    monkeypatch.setattr(cuda_moe, "CHUNK_WEIGHTS", chunk)
    E, k = 3, 512
    parts = [expert_part("gate", QT.Q4_K, E, 7, k, seed=1, extreme=True),
             expert_part("up", QT.Q4_0, E, 5, k, seed=2, extreme=False)]
    stack = cuda_moe.StackedWeight(parts, torch.device(device))
    assert stack.format == "int4" and stack.nibbles.device.type == device
    groups = [unpack_int4_groups(r.qtype, r.data, k) for r in parts]
    q = np.concatenate([g.q.reshape(E, -1, k) for g in groups], axis=1)
    scale, minimum = (torch.from_numpy(np.concatenate([getattr(g, f).reshape(E, -1, k // 32) for g in groups], axis=1))
                      for f in ("scale", "minimum"))
    assert torch.equal(stack.nibbles.cpu(), torch.from_numpy((q[..., ::2] << 4) | q[..., 1::2]))
    assert torch.equal(stack.pairs.cpu(), cuda_int4.scale_pairs(scale, minimum))
    assert stack.pairs.dtype == torch.float32  # Q4_K's extreme scale products leave float16's range
