"""engine.cuda_int4's launch rules and weight layout, which need no GPU (the kernels are
tested against float64 in tests/engine/test_cuda_graphs.py), and the one-row kernel's launch
options on a CUDA device or under Triton's interpreter (TRITON_INTERPRET=1: the activations are
bfloat16 values already and the kernel takes them as float32, as in test_cuda_moe.py)."""
from __future__ import annotations

import dataclasses
import os
import types

import numpy as np
import pytest
import torch

from engine import cuda_int4

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available() or not cuda_int4.AVAILABLE, reason="needs a CUDA device and Triton")]),
           pytest.param("cpu", marks=pytest.mark.skipif(
               not (INTERPRETED and cuda_int4.AVAILABLE), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"))]


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


def test_launches_cover_every_row_count_and_shape():
    for rows in (2, 16, 17, 64, 65, 2048):
        for n, k in ((960, 576), (576, 1536), (16384, 2048), (2048, 8192), (3072, 2048)):
            launch = cuda_int4.launch_for(rows, n, k)
            assert launch.bn in (16, 32, 64, 128) and launch.unroll in (1, 2, 4) and launch.warps in (2, 4, 8)


def test_one_row_products_of_all_but_the_largest_matrices_are_one_unsplit_kernel():
    shapes = ((960, 576), (3072, 576), (576, 1536), (576, 576), (3072, 2048), (2048, 2048), (16384, 2048),
              (2048, 8192))
    for n, k in shapes:
        launch = cuda_int4.gemv_launch_for(n, k)
        assert launch.bn & (launch.bn - 1) == 0 and launch.gb & (launch.gb - 1) == 0  # tl.arange sizes
        if n * k < cuda_int4.LARGE_GEMV_ELEMENTS:  # on an H200 (132 multiprocessors): no second kernel
            assert cuda_int4.split_k(k // cuda_int4.GROUP, -(-n // launch.bn), launch.waves * 132) == 1


def test_few_rows_take_one_row_products_only_on_small_matrices():
    assert cuda_int4.gemv_rows_for(960, 576) == 7 and cuda_int4.gemv_rows_for(576, 576) == 12
    assert cuda_int4.gemv_rows_for(3072, 576) == 2 and cuda_int4.gemv_rows_for(576, 1536) == 4
    assert all(cuda_int4.gemv_rows_for(n, k) == 1 for n, k in ((3072, 2048), (16384, 2048), (2048, 8192)))


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


def _matrix(n: int, k: int, device: str) -> tuple[cuda_int4.Int4Weight, torch.Tensor]:
    """A random int4 matrix on `device` and its float64 values."""
    rng = np.random.default_rng(k)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    w = cuda_int4.Int4Weight(q, scale, (-8 * scale).astype(np.float32), torch.device(device))
    return w, torch.from_numpy((q.astype(np.float64) - 8) * np.repeat(scale, 32, axis=1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k,gb", [(48, 320, 4), (40, 1024, 8)])  # as above: masked steps, splits
def test_one_row_products_of_normed_rows_match_the_norm_kernel(device, monkeypatch, n, k, gb):
    """`normed_gemv` norms the row inside the product: the products of cuda_elementwise's
    rms_norm (its scale summed in the product's own order: equal to float32 rounding), added
    into the residual too, and the float64 product of the normed rows."""
    from engine import cuda_elementwise
    operand = torch.bfloat16
    if device == "cpu":
        monkeypatch.setattr(cuda_int4, "OPERAND", cuda_int4.tl.float32)
        operand = torch.float32
    w, dense = _matrix(n, k, device)
    launch = cuda_int4.GemvLaunch(bn=16, gb=gb, warps=2, waves=64)
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(3, k, generator=g) * 3).to(device)
    norm_w = (torch.rand(k, generator=g) + 0.5).to(device)
    eps = 1e-5
    fused = w.normed_gemv(x, norm_w, eps, launch=launch)
    apart = w.gemv(cuda_elementwise.rms_norm(x, norm_w, eps, operand), launch=launch)
    assert (fused - apart).abs().max() <= 1e-5 * apart.abs().max()
    x64 = x.double().cpu()
    normed = x64 * torch.rsqrt((x64 * x64).mean(dim=1, keepdim=True) + eps) * norm_w.double().cpu()
    want = normed @ dense.T
    assert (fused.double().cpu() - want).abs().max() <= 1e-2 * want.abs().max()  # bfloat16 inputs on a GPU
    residual = torch.randn(3, n, generator=g).to(device)
    into = residual.clone()
    assert w.normed_gemv(x, norm_w, eps, into=into, launch=launch) is into
    assert torch.equal(into, residual + fused)
    with pytest.raises(ValueError, match="float32"):
        w.normed_gemv(x.to(torch.bfloat16), norm_w, eps)


def _interpreted_exp(monkeypatch, *modules) -> None:
    """Triton's interpreter has no libdevice: the modules' kernels take tl.exp (numpy's) there."""
    for module in modules:
        monkeypatch.setattr(module, "libdevice", types.SimpleNamespace(exp=lambda x: cuda_int4.tl.exp(x)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k,gb", [(48, 320, 4), (40, 1024, 8)])
def test_one_row_products_of_swiglu_rows_equal_the_swiglu_kernel(device, monkeypatch, n, k, gb):
    """`swiglu_gemv` forms silu(gate) * up inside the product, bit for bit as
    cuda_elementwise.swiglu does, added into the residual too, and the float64 product."""
    from engine import cuda_elementwise
    operand = torch.bfloat16
    if device == "cpu":
        monkeypatch.setattr(cuda_int4, "OPERAND", cuda_int4.tl.float32)
        _interpreted_exp(monkeypatch, cuda_int4, cuda_elementwise)
        operand = torch.float32
    w, dense = _matrix(n, k, device)
    launch = cuda_int4.GemvLaunch(bn=16, gb=gb, warps=2, waves=64)
    g = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(3, 2 * k, generator=g) * 3).to(device)
    fused = w.swiglu_gemv(gate_up, launch=launch)
    assert torch.equal(fused, w.gemv(cuda_elementwise.swiglu(gate_up, operand), launch=launch))
    gu64 = gate_up.double().cpu()
    want = (torch.nn.functional.silu(gu64[:, :k]) * gu64[:, k:]) @ dense.T
    assert (fused.double().cpu() - want).abs().max() <= 1e-2 * want.abs().max()
    residual = torch.randn(3, n, generator=g).to(device)
    into = residual.clone()
    assert w.swiglu_gemv(gate_up, into=into, launch=launch) is into
    assert torch.equal(into, residual + fused)
    with pytest.raises(ValueError, match=f"{2 * k} values"):
        w.swiglu_gemv(gate_up[:, :k])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k,gb,head_dim,rotated", [(1088, 320, 4, 64, 768), (96, 128, 8, 16, 96)])
def test_normed_one_row_products_turn_their_leading_pairs_by_each_rows_rope(device, monkeypatch, n, k, gb,
                                                                            head_dim, rotated):
    """`normed_gemv(..., rope=...)`: the leading `rotated` columns leave the kernel turned in
    adjacent pairs by each row's (cos, sin), as the llama family turns q and k (a complex
    product per pair), the columns after them untouched; a split product refuses."""
    if device == "cpu":
        monkeypatch.setattr(cuda_int4, "OPERAND", cuda_int4.tl.float32)
    w, _ = _matrix(n, k, device)
    launch = cuda_int4.GemvLaunch(bn=16, gb=gb, warps=2, waves=1)
    assert w.rotates_in_kernel(torch.device(device), launch)
    g = torch.Generator().manual_seed(n)
    rows, pairs = 3, head_dim // 2
    x = torch.randn(rows, k, generator=g).to(device)
    norm_w = (torch.rand(k, generator=g) + 0.5).to(device)
    angles = torch.rand(rows, pairs, generator=g) * 6.28
    rope = torch.polar(torch.ones_like(angles), angles)  # [rows, pairs] complex64
    got = w.normed_gemv(x, norm_w, 1e-5, launch=launch, rope=torch.view_as_real(rope).to(device), rotated=rotated)
    want = w.normed_gemv(x, norm_w, 1e-5, launch=launch).cpu()
    turned = torch.view_as_complex(want[:, :rotated].reshape(rows, -1, pairs, 2)) * rope[:, None, :]
    want[:, :rotated] = torch.view_as_real(turned).reshape(rows, rotated)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    assert torch.equal(got[:, rotated:].cpu(), want[:, rotated:])

    if k // 32 >= 2 * cuda_int4.MIN_GROUPS_PER_SPLIT:  # a matrix long enough to split
        split = cuda_int4.GemvLaunch(bn=16, gb=gb, warps=2, waves=1 << 12)
        assert not w.rotates_in_kernel(torch.device(device), split)
        with pytest.raises(ValueError, match="unsplit"):
            w.normed_gemv(x, norm_w, 1e-5, launch=split, rope=torch.view_as_real(rope).to(device), rotated=rotated)
    with pytest.raises(ValueError, match="rope must be"):
        w.normed_gemv(x, norm_w, 1e-5, launch=launch, rope=torch.view_as_real(rope).to(device), rotated=rotated + 1)


@pytest.mark.parametrize("device", DEVICES)
def test_graph_kernels_leave_the_norm_and_rotation_to_products_that_form_them(device, monkeypatch):
    """cuda_elementwise.FusedStepKernels(inputs=True) hands the norm and the rotation to an
    int4 matrix's one-row product (weights.Int4Linear.normed_product) and takes the separate
    kernels where the matrix cannot (a bias, too many rows for one-row products, another
    rope layout) or `inputs` is off; both ways give the same products."""
    from engine import cuda_elementwise
    from engine.weights import Int4Linear
    operand = torch.bfloat16
    if device == "cpu":
        monkeypatch.setattr(cuda_int4, "OPERAND", cuda_int4.tl.float32)
        operand = torch.float32
    n, k, head_dim = 96, 128, 16
    w, _ = _matrix(n, k, device)
    dev = torch.device(device)
    lin = Int4Linear.on_cuda(w, dev)
    biased = Int4Linear.on_cuda(w, dev, bias=torch.zeros(n, device=device))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, k, generator=g).to(device)
    norm_w = (torch.rand(k, generator=g) + 0.5).to(device)
    angles = torch.rand(2, head_dim // 2, generator=g) * 6.28
    rope = torch.polar(torch.ones_like(angles), angles).to(device)[:, None, :]  # [rows, 1, pairs]
    formed = cuda_elementwise.FusedStepKernels(1e-5, operand, inputs=True)
    apart = cuda_elementwise.FusedStepKernels(1e-5, operand)

    want = apart.normed_product(lin, x, norm_w)
    got = formed.normed_product(lin, x, norm_w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    turned = formed.normed_rotated_product(lin, x, norm_w, rope, 64)
    assert turned is not None
    want = want.clone()
    want[:, :64] = torch.view_as_real(torch.view_as_complex(want[:, :64].reshape(2, 4, 8, 2)) * rope).reshape(2, 64)
    torch.testing.assert_close(turned, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))

    assert apart.normed_rotated_product(lin, x, norm_w, rope, 64) is None
    assert formed.normed_rotated_product(biased, x, norm_w, rope, 64) is None
    assert formed.normed_rotated_product(lin, x, norm_w, rope[:1], 64) is None  # not a rope per row
    assert biased.normed_product(x, norm_w, 1e-5) is None
    many = torch.randn(w.gemv_rows + 1, k, generator=g).to(device)
    assert lin.normed_product(many, norm_w, 1e-5) is None
    assert lin.accumulate_swiglu(torch.zeros(w.gemv_rows + 1, n, device=device),
                                 torch.randn(w.gemv_rows + 1, 2 * k, device=device)) is False

    down, _ = _matrix(k, 64, device)  # [k, 64]: takes the SwiGLU of rows [gate, up] of 128 values
    down_lin = Int4Linear.on_cuda(down, dev)
    if device == "cpu":
        _interpreted_exp(monkeypatch, cuda_int4, cuda_elementwise)
    gate_up = torch.randn(2, 128, generator=g).to(device)
    residual = torch.randn(2, k, generator=g).to(device)
    mine, theirs = residual.clone(), residual.clone()
    formed.accumulate_swiglu(down_lin, mine, gate_up)
    apart.accumulate_swiglu(down_lin, theirs, gate_up)
    assert torch.equal(mine, theirs)
    assert Int4Linear.on_cuda(down, dev, bias=torch.zeros(k, device=device)).accumulate_swiglu(mine, gate_up) is False
    assert torch.equal(mine, theirs)  # untouched where the matrix declines
