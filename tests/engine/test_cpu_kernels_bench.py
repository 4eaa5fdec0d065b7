"""Benchmarks (pytest-benchmark) of the CPU int4 kernels; measured, not asserted. `make bench` runs them.

The embedded model's int4 matrices (fused q/k/v 960 x 576, gate/up 3072 x 576, down 576 x
1536) at 1, 8, 32 and 128 rows, through the vector kernel and the AMX tile kernel, with
random weights of the real layout (engine.weights.int4_pack).  The pair of figures per shape
and row count shows the crossover that engine.weights.TILE_MIN_ROWS encodes.  Skips where a
kernel is not available (no AVX512-BF16 / AMX, no compiler).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import kernels
from engine.weights import int4_pack

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}
OPS = {"vectors": kernels.int4_linear, "tiles": kernels.int4_linear_tiles}


@pytest.fixture(scope="module")
def matrices():
    rng = np.random.default_rng(0)
    out = {}
    for name, (n, k) in SHAPES.items():
        q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
        scale = (rng.random((n, k // 32), dtype=np.float32) * 0.02).astype(np.float32)
        out[name] = int4_pack(q, scale, (-8 * scale).astype(np.float32))
    return out


@pytest.mark.parametrize("rows", [1, 8, 32, 128])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kernel", sorted(OPS))
def test_int4_kernel(benchmark, matrices, kernel, shape, rows):
    op = OPS[kernel]()
    if op is None:
        pytest.skip(f"the {kernel} kernel is not available here")
    packed, scales = matrices[shape]
    x = torch.randn(rows, SHAPES[shape][1])
    y = benchmark(op, x, packed, scales)
    assert y.shape == (rows, SHAPES[shape][0]) and bool(torch.isfinite(y).all())
