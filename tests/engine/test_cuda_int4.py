"""engine.cuda_int4's launch rules and weight layout, which need no GPU (the kernels are
tested against float64 in tests/engine/test_cuda_graphs.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import cuda_int4


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
