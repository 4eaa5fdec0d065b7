"""Engine dequantization against gguf-py's reference dequantizer, and the weight matrices built
from it on every CPU kernel path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf import quants as gq

from engine import kernels
from engine.gguf_file import TensorRecord
from engine.quants import (CODED, FIFTH_BIT_CODES, INT4_GROUPED, INT8_GROUPS, INT8_WITH_MINIMUM, LEVEL_CODES,
                           SUPPORTED, dequantize, unpack_coded_groups, unpack_int4_groups, unpack_int8_groups)
from engine.synthetic import _encode
from engine.weights import (DenseLinear, Embedding, F16Linear, Int4Linear, Int8Linear, KQuantLinear, RowByRow,
                            build_linear)

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=kernels.host_paths())
def cpu(request) -> kernels.CpuKernels:
    return kernels.cpu_kernels(request.param)

NEW_TYPES = [QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q3_K, QT.Q2_K, QT.IQ4_NL, QT.IQ4_XS]
TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K, *NEW_TYPES]


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


@pytest.mark.parametrize("qtype", NEW_TYPES + [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_dequantize_equals_gguf_on_random_blocks(qtype, seed):
    """Every field of every block random (scales, codes, high bits, signs of the float16 scales
    and minimums), not only what the synthetic writer produces: bit for bit with gguf."""
    per, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(5, 1024 // per, nbytes), dtype=np.uint8)
    layout = {QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q5_K: (0, 2), QT.Q3_K: (108,), QT.Q2_K: (80, 82),
              QT.IQ4_NL: (0,), QT.IQ4_XS: (0,), QT.Q4_K: (0, 2), QT.Q6_K: (208,)}
    for off in layout[qtype]:  # finite float16 fields of both signs
        raw[..., off: off + 2] = rng.normal(0, 0.05, (5, 1024 // per, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(5, -1)
    ref = gq.dequantize(raw, qtype).reshape(5, 1024)
    got = dequantize(qtype, raw, 1024)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.IQ3_S, QT.TQ1_0, QT.IQ1_M], ids=lambda q: q.name)
def test_unsupported_type_is_named(qtype):
    assert qtype not in SUPPORTED
    with pytest.raises(ValueError, match=f"unsupported tensor type {qtype.name}$"):
        dequantize(qtype, np.zeros(1024, np.uint8), 256)


def test_bad_row_length_is_an_error():
    with pytest.raises(ValueError, match="multiple of 256"):
        dequantize(QT.Q4_K, np.zeros(144, np.uint8), 100)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K])
def test_int4_linear_matches_dequantized_matmul(qtype, cpu):
    raw = encoded(qtype, rows=96, cols=512, seed=3)
    rec = TensorRecord("w", qtype, (96, 512), raw)
    lin = build_linear([rec], "packed", CPU, cpu=cpu)
    assert isinstance(lin, RowByRow if cpu.name == "torch" else Int4Linear)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ torch.from_numpy(gq.dequantize(raw, qtype).reshape(96, 512)).double().T
    got = lin(x).double()
    # bfloat16 activations and scales: about 3 significant digits.
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.parametrize("rows", [40, 259])
def test_int4_linear_of_any_height(rows, cpu):
    """Heights that are not a multiple of 16 (a vocabulary of 32001, say) load and compute
    like the others: the kernels' padding rows never show."""
    raw = encoded(QT.Q4_1, rows=rows, cols=256, seed=4)
    lin = build_linear([TensorRecord("w", QT.Q4_1, (rows, 256), raw)], "packed", CPU, cpu=cpu)
    assert lin.out_features == rows
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    got = lin(x)
    assert got.shape == (3, rows) and got.is_contiguous()
    ref = x.bfloat16().double() @ torch.from_numpy(gq.dequantize(raw, QT.Q4_1).reshape(rows, 256)).double().T
    # The compiled kernels keep float32 scales; torch's int4 kernel rounds them to bfloat16.
    bound = 1e-2 if cpu.name == "torch" else 1e-5
    assert (got.double() - ref).abs().max() <= bound * ref.abs().max()


@pytest.mark.parametrize("qtype,scale_bytes", [(QT.Q4_0, 2), (QT.Q4_1, 2), (QT.Q4_K, 4)], ids=lambda v: str(v))
def test_int4_linear_holds_float16_scales_where_exact_and_counts_them(qtype, scale_bytes, cpu):
    """Q4_0 and Q4_1 scales are float16 fields and stay float16; Q4_K's (products) stay float32."""
    if cpu.name == "torch":
        pytest.skip("the torch path keeps no int4 layout")
    lin = build_linear([TensorRecord("w", qtype, (40, 512), encoded(qtype, 40, 512, 6))], "packed", CPU, cpu=cpu)
    groups = 48 // 16 * 512 // 32  # 40 rows padded to 48, in blocks of 16 columns by 32 inputs
    assert lin.nbytes == groups * 256 + groups * 32 * scale_bytes


def test_fused_rows_and_permutation():
    a = TensorRecord("a", QT.Q4_1, (32, 64), encoded(QT.Q4_1, 32, 64, 1))
    b = TensorRecord("b", QT.Q8_0, (32, 64), encoded(QT.Q8_0, 32, 64, 2))
    perm = np.random.default_rng(0).permutation(64)
    lin = build_linear([a, b], "float32", torch.device("cpu"), row_perm=perm)
    assert isinstance(lin, DenseLinear) and lin.out_features == 64
    full = np.concatenate([dequantize(QT.Q4_1, a.data, 64), dequantize(QT.Q8_0, b.data, 64)])
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), x @ torch.from_numpy(full[perm]).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype,fmt", [(QT.Q4_1, "packed"), (QT.Q4_0, "packed"), (QT.Q8_0, "packed"),
                                       (QT.Q4_1, "float32")])
def test_accumulate_adds_the_product_to_the_residual(qtype, fmt, cpu):
    bias = TensorRecord("b", QT.F32, (48,), np.linspace(-1, 1, 48, dtype=np.float32).view(np.uint8))
    for biases in (None, [bias]):
        lin = build_linear([TensorRecord("w", qtype, (48, 256), encoded(qtype, 48, 256, 5))], fmt,
                           CPU, biases=biases, cpu=cpu)
        x, r = torch.randn(3, 256), torch.randn(3, 48)
        out = r.clone()
        lin.accumulate(out, x)
        assert torch.equal(out, r + lin(x))


@pytest.mark.parametrize("qtype", sorted(INT8_GROUPS, key=lambda q: q.name), ids=lambda q: q.name)
def test_int8_groups_reconstruct_exactly(qtype):
    raw = encoded(qtype, cols=512)
    g = unpack_int8_groups(qtype, raw, 512)
    assert g.q.dtype == np.int8 and g.group == INT8_GROUPS[qtype]
    assert (g.minimum is not None) == (qtype in INT8_WITH_MINIMUM)
    w = g.q.astype(np.float32).reshape(6, -1, g.group) * g.scale[..., None]
    if g.minimum is not None:
        w += g.minimum[..., None]
    np.testing.assert_array_equal(w.reshape(6, 512), gq.dequantize(raw, qtype).reshape(6, 512))
    # The products are exact in float32: scale * q in float64 rounds to nothing.
    exact = g.q.astype(np.float64).reshape(6, -1, g.group) * g.scale.astype(np.float64)[..., None]
    np.testing.assert_array_equal(exact, exact.astype(np.float32))


@pytest.mark.parametrize("qtype", sorted(INT4_GROUPED), ids=lambda q: q.name)
def test_int4_types_in_int8_form_are_the_same_weights(qtype):
    """For a fused matrix mixing 4-bit and 8-bit grouped types the 4-bit ones are unpacked to
    int8 groups too: the same float32 weights."""
    raw = encoded(qtype, cols=512)
    g = unpack_int8_groups(qtype, raw, 512)
    w = g.q.astype(np.float32).reshape(6, -1, 32) * g.scale[..., None]
    if g.minimum is not None:
        w += g.minimum[..., None]
    np.testing.assert_array_equal(w.reshape(6, 512), dequantize(qtype, raw, 512))


@pytest.mark.parametrize("rows", [40, 48])
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q6_K, QT.F16, QT.F32, QT.BF16, *NEW_TYPES], ids=lambda q: q.name)
def test_other_types_keep_the_file_weights_and_rows_independent(qtype, rows, cpu):
    """Each type's matrix on each path: the int8 op (float32 activations), the int4 op with
    codes where the path takes them (activations rounded to bfloat16), Q6_K, Q3_K and Q2_K at
    their own width where the path has them (float32 activations), float16 otherwise; the file's weights, counted in
    nbytes, and a row's result independent of the others."""
    raw = encoded(qtype, rows=rows, cols=512, seed=4)
    round_x = False
    bias = TensorRecord("b", QT.F32, (rows,), np.linspace(-1, 1, rows, dtype=np.float32).view(np.uint8))
    lin = build_linear([TensorRecord("w", qtype, (rows, 512), raw)], "packed", CPU, biases=[bias], cpu=cpu)
    exact = torch.from_numpy(dequantize(qtype, raw, 512)).double()
    if cpu.name == "torch":
        assert isinstance(lin, RowByRow)
        w = exact.half().double()  # torch's float16 kernel (FBGEMM) or bfloat16 matmul
    elif cpu.int4_codes and qtype in CODED:  # codes, scales, minimums: the file's weights, x in bfloat16
        padded = rows + -rows % 16
        assert isinstance(lin, Int4Linear) and lin.in_features == 512
        assert (lin.high is not None) == (qtype in FIFTH_BIT_CODES) and (lin.levels is not None) == (qtype in LEVEL_CODES)
        codes = padded * 512 // 8 if lin.high is not None else lin.levels.nbytes if lin.levels is not None else 0
        assert lin.nbytes == padded * 256 + padded * 512 // 32 * 2 * lin.scales_zeros.element_size() + codes + rows * 4
        w = exact
        round_x = True
    elif qtype in (QT.Q6_K, QT.Q3_K, QT.Q2_K) and cpu.kq is not None:  # their own width, scale bytes, d (dmin)
        padded = rows + -rows % 16
        bits, supers = {QT.Q6_K: (6, 1), QT.Q3_K: (3, 1), QT.Q2_K: (2, 2)}[qtype]
        assert isinstance(lin, KQuantLinear) and lin.in_features == 512
        assert lin.nbytes == (padded * 512 * bits // 8 + padded * 512 // 16 + padded * 512 // 256 * 2 * supers
                              + rows * 4)
        w = exact
    elif qtype in INT8_GROUPS:  # 8-bit q and their scales: exactly the file's weights
        padded = rows + -rows % 16  # whole blocks of 16 columns
        assert isinstance(lin, Int8Linear)
        if qtype in (QT.Q8_0, QT.Q5_0, QT.Q5_1, QT.IQ4_NL):  # one float16 scale a block in the file
            assert lin.scales.dtype == torch.float16
        if qtype == QT.Q5_1:  # its minimum is a float16 field too
            assert lin.minimums.dtype == torch.float16
        minimum = lin.minimums.element_size() if qtype in INT8_WITH_MINIMUM else 0
        per_group = lin.scales.element_size() + minimum
        assert lin.nbytes == padded * 512 + padded * 512 // INT8_GROUPS[qtype] * per_group + rows * 4
        w = exact
    else:  # rounded once to float16
        assert isinstance(lin, F16Linear)
        w = exact.half().double()
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (9, rows) and got.is_contiguous()
    ref = (x.bfloat16() if round_x else x).double() @ w.T + torch.linspace(-1, 1, rows).double()
    bound = 1e-2 if cpu.name == "torch" and not cpu_has_fbgemm() else 1e-5
    assert (got.double() - ref).abs().max() <= bound * ref.abs().max()
    # A row's result does not depend on the other rows of the batch (batched decoding relies on it).
    rows_alone = torch.cat([lin(x[i: i + 1]) for i in range(9)])
    assert torch.equal(rows_alone, got)


@pytest.mark.parametrize("parts", [(QT.Q5_K, QT.Q5_K, QT.Q6_K), (QT.Q3_K, QT.Q3_K, QT.Q4_K),
                                   (QT.IQ4_NL, QT.Q5_0, QT.Q8_0), (QT.Q5_1, QT.Q4_0, QT.Q2_K)],
                         ids=lambda p: "+".join(q.name for q in p))
def test_fused_mixtures_of_grouped_types_keep_the_file_weights(parts, cpu):
    """q/k/v of a Q5_K_M or Q3_K_M file mix types (v in Q6_K or Q4_K): one Int8Linear at the
    smallest group, exactly the file's weights, rows independent, counted in nbytes."""
    records = [TensorRecord(f"w{i}", q, (32, 512), encoded(q, 32, 512, 10 + i)) for i, q in enumerate(parts)]
    perm = np.random.default_rng(2).permutation(96)
    lin = build_linear(records, "packed", CPU, row_perm=perm, cpu=cpu)
    exact = torch.from_numpy(np.concatenate([dequantize(r.qtype, r.data, 512) for r in records])[perm]).double()
    if cpu.name == "torch":
        assert isinstance(lin, RowByRow)
        exact = exact.half().double()
    else:
        assert isinstance(lin, Int8Linear)
        group = min(INT8_GROUPS.get(q, 32) for q in parts)
        minimums = any(q in INT8_WITH_MINIMUM or q in (QT.Q4_1, QT.Q4_K) for q in parts)
        per_group = lin.scales.element_size() + (4 if minimums else 0)  # float32 minimums
        assert lin.nbytes == 96 * 512 + 96 * 512 // group * per_group
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3))
    got = lin(x)
    ref = x.double() @ exact.T
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(torch.cat([lin(x[i: i + 1]) for i in range(6)]), got)


@pytest.mark.parametrize("qtype", sorted(CODED), ids=lambda q: q.name)
def test_coded_groups_are_the_file_weights(qtype):
    """value(code) * scale + minimum per group of 32 is gguf's weight (a signed zero aside:
    Q5_0's d * (q - 16) at q = 16 is -0 for a negative d, q * d - 16 d is +0)."""
    raw = encoded(qtype, cols=512, seed=6)
    g = unpack_coded_groups(qtype, raw, 512)
    assert g.codes.dtype == np.uint8 and int(g.codes.max()) < (16 if qtype in LEVEL_CODES or qtype in INT4_GROUPED else 32)
    assert (g.levels is not None) == (qtype in LEVEL_CODES)
    values = (g.codes if g.levels is None else g.levels[g.codes]).astype(np.float32)
    w = values.reshape(6, -1, 32) * g.scale[..., None] + g.minimum[..., None]
    np.testing.assert_array_equal(w.reshape(6, 512), dequantize(qtype, raw, 512))


@pytest.mark.parametrize("parts,coded", [((QT.Q5_1, QT.Q4_K, QT.Q5_0), True), ((QT.IQ4_NL, QT.IQ4_XS), True),
                                         ((QT.Q5_K, QT.Q4_1), True), ((QT.IQ4_NL, QT.Q5_0), False)],
                         ids=["q5-q4", "iq4", "q5_k-q4_1", "levels-with-linear"])
def test_fused_coded_types_stay_int4_where_their_codes_agree(parts, coded, cpu):
    """A fused matrix of coded types with the same code values (plain codes of 4 and 5 bits, or
    the IQ4 levels) is one int4 matrix with codes on a path that takes them; levels with plain
    codes fall back to int8.  The file's weights, x rounded to bfloat16, rows independent."""
    if not cpu.int4_codes:
        pytest.skip(f"the {cpu.name} path takes no codes")
    records = [TensorRecord(f"w{i}", q, (32, 512), encoded(q, 32, 512, 20 + i)) for i, q in enumerate(parts)]
    n = 32 * len(parts)
    perm = np.random.default_rng(4).permutation(n)
    lin = build_linear(records, "packed", CPU, row_perm=perm, cpu=cpu)
    exact = torch.from_numpy(np.concatenate([dequantize(r.qtype, r.data, 512) for r in records])[perm]).double()
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(5))
    got = lin(x)
    if coded:
        assert isinstance(lin, Int4Linear)
        assert (lin.high is not None) == any(q in FIFTH_BIT_CODES for q in parts)
        x = x.bfloat16()
    else:
        assert isinstance(lin, Int8Linear)
    ref = x.double() @ exact.T
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(torch.cat([lin(x[i: i + 1].float()) for i in range(6)]), got)


def cpu_has_fbgemm() -> bool:
    from engine.weights import fbgemm_available

    return fbgemm_available()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("fmt", ["packed", "float32"])
def test_embedding_rows_equal_dequantized_table(qtype, fmt):
    raw = encoded(qtype, rows=12, cols=256, seed=5)
    emb = Embedding(TensorRecord("token_embd.weight", qtype, (12, 256), raw), fmt, torch.device("cpu"))
    table = torch.from_numpy(dequantize(qtype, raw, 256))
    ids = torch.tensor([3, 0, 11, 3])
    got = emb(ids)
    assert got.dtype == torch.float32 and got.shape == (4, 256)
    assert torch.equal(got, table[ids])
    # The packed format reads rows from the file's bytes instead of holding a table.
    assert emb.nbytes == (0 if fmt == "packed" else table.nbytes)
