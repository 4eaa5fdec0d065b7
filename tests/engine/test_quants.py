"""Engine dequantization and int4 packing against gguf-py's reference dequantizer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from engine.gguf_file import TensorRecord
from engine.quants import INT4_GROUPED, dequantize, unpack_int4_groups
from engine.synthetic import _encode
from engine.weights import DenseLinear, Int4Linear, build_linear

TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K]


def encoded(qtype: QT, rows: int = 6, cols: int = 512, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.3
    return _encode(w, qtype, rng)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_equals_gguf_reference(qtype):
    raw = encoded(qtype)
    ref = gq.dequantize(raw, qtype).reshape(6, 512)
    got = dequantize(qtype, raw, 512)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("qtype", sorted(INT4_GROUPED), ids=lambda q: q.name)
def test_int4_groups_reconstruct_exactly(qtype):
    raw = encoded(qtype)
    g = unpack_int4_groups(qtype, raw, 512)
    assert g.q.min() >= 0 and g.q.max() <= 15
    rebuilt = (g.q.reshape(6, -1, 32) * g.scale[..., None] + g.minimum[..., None]).reshape(6, 512)
    np.testing.assert_allclose(rebuilt, gq.dequantize(raw, qtype).reshape(6, 512), rtol=0, atol=1e-6)


def test_bad_row_length_is_an_error():
    with pytest.raises(ValueError, match="multiple of 256"):
        dequantize(QT.Q4_K, np.zeros(144, np.uint8), 100)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K])
def test_int4_linear_matches_dequantized_matmul(qtype):
    raw = encoded(qtype, rows=96, cols=512, seed=3)
    rec = TensorRecord("w", qtype, (96, 512), raw)
    lin = build_linear([rec], "packed", torch.device("cpu"))
    assert isinstance(lin, Int4Linear)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ torch.from_numpy(gq.dequantize(raw, qtype).reshape(96, 512)).double().T
    got = lin(x).double()
    # bfloat16 activations and scales: about 3 significant digits.
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_fused_rows_and_permutation():
    a = TensorRecord("a", QT.Q4_1, (32, 64), encoded(QT.Q4_1, 32, 64, 1))
    b = TensorRecord("b", QT.Q8_0, (32, 64), encoded(QT.Q8_0, 32, 64, 2))
    perm = np.random.default_rng(0).permutation(64)
    lin = build_linear([a, b], "float32", torch.device("cpu"), row_perm=perm)
    assert isinstance(lin, DenseLinear) and lin.out_features == 64
    full = np.concatenate([dequantize(QT.Q4_1, a.data, 64), dequantize(QT.Q8_0, b.data, 64)])
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), x @ torch.from_numpy(full[perm]).T, rtol=1e-5, atol=1e-5)
