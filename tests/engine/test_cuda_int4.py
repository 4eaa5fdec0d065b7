"""engine.cuda_int4's launch rules and weight layout, which need no GPU, and its kernels on a
CUDA device or under Triton's interpreter (TRITON_INTERPRET=1: the activations are bfloat16
values already and the kernels take them as float32, as in test_cuda_moe.py): their values
against float64, the one-row kernel's launch options (whole models' products against float64 are
in tests/engine/test_cuda_graphs.py)."""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import cuda_int4
from engine.cuda_attention import dependent_launch_capable

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available() or not cuda_int4.AVAILABLE, reason="needs a CUDA device and Triton")]),
           pytest.param("cpu", marks=pytest.mark.skipif(
               not (INTERPRETED and cuda_int4.AVAILABLE), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"))]


def _gated_dtype(device: str, monkeypatch) -> torch.dtype:
    """The dtype gated products are written in, with the interpreter's stand-ins set on "cpu": it
    has no libdevice (its functions return None) and no bfloat16, so tl.exp (numpy's there)
    stands in for both sides of each comparison, float32 for the output and the operands."""
    if device != "cpu":
        return torch.bfloat16
    from engine import cuda_elementwise
    monkeypatch.setattr(cuda_int4, "OPERAND", cuda_int4.tl.float32)
    monkeypatch.setattr(cuda_elementwise, "libdevice", SimpleNamespace(exp=lambda v: cuda_int4.tl.exp(v)))
    return torch.float32


@pytest.mark.parametrize("n_groups", [1, 2, 18, 48, 64, 256, 257])
@pytest.mark.parametrize("tiles", [1, 15, 48, 256, 2000])
@pytest.mark.parametrize("max_split", [1, 4, 1 << 30])
def test_splits_divide_the_groups_and_aim_at_the_programs(n_groups, tiles, max_split):
    programs = 264
    s = cuda_int4.split_k(n_groups, tiles, programs, max_split)
    assert s >= 1 and n_groups % s == 0 and s <= max_split
    assert s == 1 or n_groups // s >= cuda_int4.MIN_GROUPS_PER_SPLIT
    assert s == 1 or tiles * s <= programs
    # the largest split with those properties
    better = [t for t in range(s + 1, min(n_groups, max_split) + 1) if n_groups % t == 0 and tiles * t <= programs
              and n_groups // t >= cuda_int4.MIN_GROUPS_PER_SPLIT]
    assert not better


def test_wide_matrices_are_not_split_and_narrow_ones_are():
    assert cuda_int4.split_k(64, 256, 264) == 1  # a 16384-wide gate/up matrix at 64-column tiles
    assert cuda_int4.split_k(256, 32, 264) == 8  # a 2048-wide down matrix over 8192 inputs
    assert cuda_int4.split_k(256, 32, 264, max_split=2) == 2  # many rows: fewer partial sums


def test_row_blocks():
    assert [cuda_int4.block_m(r) for r in (1, 16, 17, 32, 33, 64, 65, 2048)] == [16, 16, 32, 32, 64, 64, 64, 64]


def test_scale_pairs_keep_float16_where_exact_or_finite_else_float32():
    rng = np.random.default_rng(0)
    scale = torch.from_numpy(rng.random((5, 3)).astype(np.float16).astype(np.float32))
    minimum = torch.from_numpy(-rng.random((5, 3)).astype(np.float16).astype(np.float32))
    pairs = cuda_int4.scale_pairs(scale, minimum)
    assert pairs.dtype == torch.float16 and pairs.shape == (3, 5, 2)  # [groups, columns, (scale, min)]
    assert torch.equal(pairs[..., 0].T.float(), scale) and torch.equal(pairs[..., 1].T.float(), minimum)
    # Leading axes are kept (a stack of experts' matrices): [E, columns, groups] -> [E, groups, columns, 2].
    stacked = cuda_int4.scale_pairs(torch.stack([scale, 2 * scale]), torch.stack([minimum, minimum]))
    assert stacked.shape == (2, 3, 5, 2) and torch.equal(stacked[1, ..., 0].T.float(), 2 * scale)
    scale[4, 2] = 1e6
    wide = cuda_int4.scale_pairs(scale, minimum)
    assert wide.dtype == torch.float32 and wide[2, 4, 0] == 1e6


def test_large_matrices_take_cublas_from_gemm_rows_on():
    assert cuda_int4.gemm_rows_for(16384, 2048) == cuda_int4.GEMM_ROWS
    assert cuda_int4.gemm_rows_for(960, 576) == cuda_int4.NEVER


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k", [(40, 320), (16, 256), (33, 1024)])  # partial row and column tiles, and whole ones
def test_the_matrix_for_cublas_holds_every_weight_at_its_place(device, n, k):
    """`Int4Weight.weight()` (prefill chunks of large matrices multiply it with cuBLAS): every
    weight q * scale + minimum at its own place.  The scales and minimums are whole multiples of
    2**-10 that keep every weight exact in bfloat16 (Triton's interpreter rounds toward zero
    where the GPU rounds to nearest), and differ from group to group and row to row."""
    rng = np.random.default_rng(n * k)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = rng.integers(1, 8, size=(n, k // 32)).astype(np.float32) / 1024
    minimum = -rng.integers(0, 128, size=(n, k // 32)).astype(np.float32) / 1024
    w = cuda_int4.Int4Weight(q, scale, minimum, torch.device(device))
    exact = q.astype(np.float64) * np.repeat(scale, 32, axis=1) + np.repeat(minimum, 32, axis=1)
    want = torch.from_numpy(exact).to(torch.bfloat16)
    assert torch.equal(want.double(), torch.from_numpy(exact))  # exact in bfloat16, as meant
    assert torch.equal(w.weight().cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 3, 17, 70])
def test_all_kernels_match_the_float64_product(device, monkeypatch, rows):
    """The one-row kernel (`gemv`: each row alone) and both tensor-core kernels (`fused`: one and
    two tiles of rows, rows by columns and transposed) against the float64 product of
    q * scale + minimum: nibbles made numbers by bit operations must give every weight its
    value, at its place, with partial column tiles, a masked last loop step and the input axis
    split."""
    if device == "cpu":
        monkeypatch.setattr(cuda_int4, "OPERAND", cuda_int4.tl.float32)
    n, k = 48, 640  # 20 groups
    rng = np.random.default_rng(rows)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    minimum = (-rng.random((n, k // 32)) * 0.1).astype(np.float16).astype(np.float32)
    w = cuda_int4.Int4Weight(q, scale, minimum, torch.device(device))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).float().to(device)
    weights = q.astype(np.float64) * np.repeat(scale, 32, axis=1) + np.repeat(minimum, 32, axis=1)
    want = x.double().cpu() @ torch.from_numpy(weights).T
    one_row = cuda_int4.GemvLaunch(bn=16, gb=8, warps=2, waves=64)  # 3 column tiles, 3 steps of 8 groups
    assert cuda_int4.split_k(k // 32, 3, 64 * cuda_int4.multiprocessors(x.device)) > 1
    tiles = cuda_int4.Launch(bn=32, unroll=2, waves=64, split_cap=False)
    transposed = dataclasses.replace(tiles, transposed=True)
    assert cuda_int4.launch_for(rows, n, k).transposed == (rows <= cuda_int4.MAX_BLOCK_M)
    for got in (w.gemv(x), w.gemv(x, launch=one_row), w.fused(x), w.fused(x, launch=tiles),
                w.fused(x, launch=transposed)):
        assert got.shape == (rows, n)
        assert (got.double().cpu() - want).abs().max() <= 1e-5 * want.abs().max()


def test_launches_cover_every_row_count_and_shape():
    for rows in (2, 16, 17, 64, 65, 2048):
        for n, k in ((960, 576), (576, 1536), (16384, 2048), (2048, 8192), (3072, 2048)):
            launch = cuda_int4.launch_for(rows, n, k)
            assert launch.bn in (16, 32, 64, 128) and launch.unroll in (1, 2, 4) and launch.warps in (2, 4, 8)


def test_decoding_steps_take_the_transposed_kernel_and_split_wide_matrices_less_as_rows_grow():
    for n, k in ((960, 576), (576, 1536), (16384, 2048), (2048, 8192), (3072, 2048)):
        assert all(cuda_int4.launch_for(rows, n, k).transposed for rows in (2, 16, 17, 33, 64))
        assert not cuda_int4.launch_for(cuda_int4.MAX_BLOCK_M + 1, n, k).transposed  # prefill chunks
        assert all(cuda_int4.launch_for(rows, n, k).max_split == (8 if k >= 1024 else 2) for rows in (2, 64))
    waves = [cuda_int4.launch_for(rows, 16384, 2048).waves for rows in (4, 16, 32, 64)]
    assert waves == sorted(waves, reverse=True) and waves[0] > waves[-1]
    assert cuda_int4.split_k(64, 16384 // 64, cuda_int4.launch_for(64, 16384, 2048).waves * 132) == 1


def test_one_row_products_of_all_but_the_largest_matrices_are_one_unsplit_kernel():
    shapes = ((960, 576), (3072, 576), (576, 1536), (576, 576), (3072, 2048), (2048, 2048), (16384, 2048),
              (2048, 8192))
    for n, k in shapes:
        launch = cuda_int4.gemv_launch_for(n, k)
        assert launch.bn & (launch.bn - 1) == 0 and launch.gb & (launch.gb - 1) == 0  # tl.arange sizes
        if n * k < cuda_int4.LARGE_GEMV_ELEMENTS:  # on an H200 (132 multiprocessors): no second kernel
            assert cuda_int4.split_k(k // cuda_int4.GROUP, -(-n // launch.bn), launch.waves * 132) == 1


def test_few_rows_take_one_row_products_only_on_small_matrices():
    assert cuda_int4.gemv_rows_for(960, 576) == 30 and cuda_int4.gemv_rows_for(576, 576) == 50
    assert cuda_int4.gemv_rows_for(3072, 576) == 9 and cuda_int4.gemv_rows_for(576, 1536) == 18
    assert cuda_int4.gemv_rows_for(3072, 2048) == 2 and cuda_int4.gemv_rows_for(2048, 2048) == 4
    assert all(cuda_int4.gemv_rows_for(n, k) == 1 for n, k in ((16384, 2048), (2048, 8192)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k,gb", [(48, 320, 4), (40, 1024, 8)])  # 10 groups in steps of 4; 32 in 8 with splits
def test_one_row_products_prefetching_the_next_step(device, monkeypatch, n, k, gb):
    """`GemvLaunch.prefetch` loads each loop step's successor before its arithmetic: the same
    sums as without, bit for bit, and the float64 product of the matrix, with a masked last
    step, a partial last column tile, several rows and the input axis split."""
    if device == "cpu":
        monkeypatch.setattr(cuda_int4, "OPERAND", cuda_int4.tl.float32)
    rng = np.random.default_rng(n)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    w = cuda_int4.Int4Weight(q, scale, (-8 * scale).astype(np.float32), torch.device(device))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16).float().to(device)
    want = x.double().cpu() @ torch.from_numpy((q.astype(np.float64) - 8) * np.repeat(scale, 32, axis=1)).T
    base = cuda_int4.GemvLaunch(bn=16, gb=gb, warps=2, waves=64)  # 3 column tiles; the groups split 2 and 8 ways
    assert cuda_int4.split_k(k // 32, 3, 64 * cuda_int4.multiprocessors(x.device)) > 1
    plain = w.gemv(x, launch=base)
    ahead = w.gemv(x, launch=dataclasses.replace(base, prefetch=True))
    assert torch.equal(plain, ahead)
    assert (ahead.double().cpu() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_one_row_products_hold_for_activations_of_every_size(device, monkeypatch):
    """The one-row kernel reads nibbles as subnormals and scales activations by up to 2**85 and
    sums back by 2**SUBNORMAL_SHIFT (cuda_int4.SUBNORMAL_SHIFT): each column against the float64
    product, within float32's rounding of its terms' sizes, for a row of activations near
    2**-58 (the scaled sums stay normal), one near 2**42 (the scaled activations stay finite)
    and one of both and zeros; every nibble value at every bit of a word; each row as alone, split
    or not, and added into an output as the product added after."""
    _gated_dtype(device, monkeypatch)
    n, k = 48, 1024
    rng = np.random.default_rng(5)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    q[0] = np.arange(k) % 16  # each value at each place of a word
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    w = cuda_int4.Int4Weight(q, scale, (-8 * scale).astype(np.float32), torch.device(device))
    exponent = np.stack([rng.integers(-58, -50, size=k), rng.integers(30, 42, size=k), rng.integers(-58, 42, size=k)])
    mantissa = rng.choice([-1.0, 1.0], size=(3, k)) * (1 + rng.random((3, k)))
    mantissa[2] *= rng.random(k) > 0.05
    x = torch.from_numpy(np.ldexp(mantissa, exponent)).to(torch.bfloat16).float().to(device)
    assert 2.0 ** -62 < x[x != 0].abs().min() and x.abs().max() < 2.0 ** (cuda_int4.SUBNORMAL_SHIFT - 21)
    weights = torch.from_numpy((q.astype(np.float64) - 8) * np.repeat(scale, 32, axis=1))
    exact, size = x.double().cpu() @ weights.T, x.double().cpu().abs() @ weights.abs().T
    got = w.gemv(x)
    assert ((got.double().cpu() - exact).abs() <= 1e-5 * size).all()
    assert torch.equal(torch.cat([w.gemv(x[i:i + 1]) for i in range(3)]), got)
    split = cuda_int4.GemvLaunch(bn=16, gb=8, warps=2, waves=64)  # 3 column tiles, the groups split
    assert cuda_int4.split_k(k // 32, 3, 64 * cuda_int4.multiprocessors(x.device)) > 1
    assert ((w.gemv(x, launch=split).double().cpu() - exact).abs() <= 1e-5 * size).all()
    into = torch.randn(3, n, generator=torch.Generator().manual_seed(1)).to(device)
    assert torch.equal(w.gemv(x, into=into.clone()), into + got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,gemm_rows", [(1, cuda_int4.NEVER), (3, cuda_int4.NEVER), (70, cuda_int4.NEVER),
                                            (5, 4)])
def test_a_product_added_to_the_residual_is_the_product_added_after(device, monkeypatch, rows, gemm_rows):
    """`w(x, into=r)` is r + w(x), bit for bit, on every path: one row and a few (added in the
    kernel), rows past ADD_IN_KERNEL_ROWS (added after it) and the cuBLAS path (the bfloat16
    product added as it is, `gemm_rows` lowered here to reach it with a small matrix); and
    `w(x, narrow=True)` holds w(x)'s values, in bfloat16 on the cuBLAS path."""
    if device == "cpu":
        monkeypatch.setattr(cuda_int4, "OPERAND", cuda_int4.tl.float32)
    n, k = 40, 256
    rng = np.random.default_rng(rows)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    w = cuda_int4.Int4Weight(q, scale, (-8 * scale).astype(np.float32), torch.device(device))
    w.gemm_rows = gemm_rows
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).float().to(device)
    residual = torch.randn(rows, n, generator=torch.Generator().manual_seed(7)).to(device)
    product = w(x)
    assert product.dtype == torch.float32 and product.shape == (rows, n)
    narrow = w(x, narrow=True)  # bfloat16 where cuBLAS rounded the product to it, the same values
    assert narrow.dtype == (torch.bfloat16 if rows >= gemm_rows else torch.float32)
    assert torch.equal(narrow.float(), product)
    into = residual.clone()
    assert w(x, into=into) is into
    assert torch.equal(into, residual + product)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_paired_products_end_in_the_swiglu_of_the_plain_product(device, monkeypatch, rows):
    """`paired_halves().swiglu(x)` is engine.cuda_elementwise's SwiGLU of the plain product, bit
    for bit, on every path: the one-row kernel and both tensor-core layouts, split (the pairs
    added up and gated by the second kernel) and not (gated in the product's own), and the
    cuBLAS path (`gemm_rows` lowered to reach it with a small matrix); and the paired matrix's
    plain product is the plain one's columns in gate/up pairs."""
    from engine import cuda_elementwise
    out_dtype = _gated_dtype(device, monkeypatch)
    n, k = 48, 640  # 24 outputs: a partial tile of pairs at 32 columns; 20 groups
    rng = np.random.default_rng(rows)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    minimum = (-rng.random((n, k // 32)) * 0.1).astype(np.float16).astype(np.float32)
    w = cuda_int4.Int4Weight(q, scale, minimum, torch.device(device))
    paired = w.paired_halves()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).float().to(device)
    plain = w(x)
    assert torch.equal(paired(x), plain.view(rows, 2, n // 2).transpose(1, 2).reshape(rows, n))

    def swiglu(product):
        return cuda_elementwise.swiglu(product, out_dtype, torch.float32)

    split_row = cuda_int4.GemvLaunch(bn=16, gb=8, warps=2, waves=64)
    one_row = dataclasses.replace(split_row, waves=1)
    tiles = cuda_int4.Launch(bn=32, unroll=2, waves=64, split_cap=False)
    whole = dataclasses.replace(tiles, waves=1, max_split=1)
    programs = 64 * cuda_int4.multiprocessors(x.device)
    assert cuda_int4.split_k(k // 32, 3, programs) > 1 and cuda_int4.split_k(k // 32, 2, programs) > 1
    for launch in (split_row, one_row):
        got = paired.gemv(x, launch=launch, gated=out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, swiglu(w.gemv(x, launch=launch)))
    for launch in (tiles, whole, dataclasses.replace(tiles, transposed=True),
                   dataclasses.replace(whole, transposed=True)):
        got = paired.fused(x, launch=launch, gated=out_dtype)
        assert got.shape == (rows, n // 2) and torch.equal(got, swiglu(w.fused(x, launch=launch)))
    assert torch.equal(paired.swiglu(x, out_dtype), swiglu(plain))
    paired.gemm_rows = w.gemm_rows = 1
    assert torch.equal(paired.swiglu(x, torch.float32), cuda_elementwise.swiglu(w(x, narrow=True), torch.float32,
                                                                             torch.float32))
    with pytest.raises(ValueError, match="paired_halves"):
        w.swiglu(x, out_dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_a_paired_gate_up_matrix_answers_as_the_plain_one(device, monkeypatch):
    """`Linear.for_swiglu` on CUDA: a PairedInt4Linear whose plain, narrow and accumulated
    products are the plain matrix's, in [gate; up] order, and whose `swiglu` is the plain
    matrix's under torch ops (`out_dtype` None) and under fused kernels alike, bit for bit;
    with the switch off, the matrix itself."""
    from engine import cuda_elementwise
    from engine.models.llama import TorchKernels
    from engine.weights import Int4Linear, PairedInt4Linear
    out_dtype = _gated_dtype(device, monkeypatch)
    n, k, rows = 64, 256, 3
    rng = np.random.default_rng(5)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    plain = Int4Linear.on_cuda(cuda_int4.Int4Weight(q, scale, -8 * scale, torch.device(device)), torch.device(device))
    paired = plain.for_swiglu()
    assert isinstance(paired, PairedInt4Linear) and paired.for_swiglu() is paired
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).float().to(device)
    assert torch.equal(paired(x), plain(x))
    assert torch.equal(paired.narrow(x)[0], plain.narrow(x)[0]) and paired.narrow(x)[1] == torch.float32
    a, b = torch.ones(rows, n, device=device), torch.ones(rows, n, device=device)
    paired.accumulate(a, x)
    plain.accumulate(b, x)
    assert torch.equal(a, b)
    torch_ops = TorchKernels(torch.tensor(1e-5, device=device), n // 2)
    assert torch.equal(paired.swiglu(x, torch_ops), plain.swiglu(x, torch_ops))
    fused_ops = cuda_elementwise.FusedStepKernels(1e-5, out_dtype)
    assert torch.equal(paired.swiglu(x, fused_ops), plain.swiglu(x, fused_ops))
    monkeypatch.setattr(cuda_int4, "SWIGLU_IN_PRODUCTS", False)
    assert plain.for_swiglu() is plain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not cuda_int4.AVAILABLE
                    or not dependent_launch_capable(torch.device("cuda")),
                    reason="needs a CUDA device of compute capability 9.0 or more and a Triton with dependent launches")
@pytest.mark.parametrize("n,k,rows", [(960, 576, 1), (16384, 2048, 1),  # one row: unsplit, split
                                      (3072, 576, 16), (16384, 2048, 64)])  # tensor-core tiles: split, unsplit
def test_products_launched_as_dependents_give_the_same_bits(monkeypatch, n, k, rows):
    """A product that starts while the kernel before it runs (the one-row kernel's weights read,
    then a wait for that kernel) sums as one launched after it: here after the norm that writes
    its input, the two captured in a CUDA graph as decoding steps are; one row and tiles of rows
    on the tensor cores (DEPENDENT_GEMM_ELEMENTS), their split sums' kernel after them."""
    from engine import cuda_attention, cuda_elementwise
    from graph_replay import replayed_and_eager
    rng = np.random.default_rng(n)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    w = cuda_int4.Int4Weight(q, scale, (-8 * scale).astype(np.float32), torch.device("cuda"))
    assert (rows > w.gemv_rows) == (rows > 1)
    h = torch.randn(rows, k, device="cuda")
    norm_weight = torch.rand(k, device="cuda") + 0.5
    out = {}
    for dependent in (False, True):
        monkeypatch.setattr(cuda_attention, "DEPENDENT_LAUNCH", dependent)
        monkeypatch.setattr(cuda_int4, "DEPENDENT_GEMM_ELEMENTS", n * k if dependent else 0)

        def step():
            return (w(cuda_elementwise.rms_norm(h, norm_weight, 1e-5, torch.float32)),)
        (replayed,), (eager,) = replayed_and_eager(step, h)
        out[dependent] = replayed, eager
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    assert torch.equal(out[True][0], out[True][1])
