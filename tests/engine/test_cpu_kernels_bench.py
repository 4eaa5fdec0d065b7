"""Benchmarks (pytest-benchmark) of the CPU matmul kernels of every path this CPU runs;
measured, not asserted.  `make bench` runs them.

The embedded model's int4 matrices (fused q/k/v 960 x 576, gate/up 3072 x 576, down 576 x
1536) and its Q8_0 output head (49152 x 576, the int8 kernel) at 1, 8, 32 and 128 rows, with
random weights of the real layouts.  The int4 matrices' scales are exactly float16 values (as
Q4_0 and Q4_1 files give them), timed as float16 and as float32 scales side by side.  Per path (engine.kernels.host_paths: amx, avx512, avx2,
portable), so one machine compares its vector kernels with the AVX2 ones, and the amx path's
figures show the crossover that engine.weights.TILE_MIN_ROWS encodes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import kernels
from engine.weights import int4_pack

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
PATHS = [p for p in kernels.host_paths() if p != "torch"]


def ops(path: str) -> kernels.CpuKernels:
    why = kernels.unavailable_reason(path)
    if why is not None:
        pytest.skip(why)
    return kernels.cpu_kernels(path)


@pytest.fixture(scope="module")
def matrices():
    rng = np.random.default_rng(0)
    out = {}
    for name, (n, k) in SHAPES.items():
        q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
        scale = (rng.random((n, k // 32), dtype=np.float32) * 0.02).astype(np.float16).astype(np.float32)
        packed, scales = int4_pack(q, scale, (-8 * scale).astype(np.float32))
        assert scales.dtype == torch.float16
        out[name] = {"float16": (packed, scales), "float32": (packed, scales.float())}
    n, k = HEAD
    q = rng.integers(-128, 128, size=(n // 16, k // 32, 32, 16), dtype=np.int8)
    out["head"] = torch.from_numpy(q), torch.from_numpy(rng.random((n // 16, k // 32, 16), dtype=np.float32))
    return out


@pytest.mark.parametrize("scales", ["float16", "float32"])
@pytest.mark.parametrize("rows", [1, 8, 32, 128])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("path", PATHS)
def test_int4_kernel(benchmark, matrices, path, shape, rows, scales):
    ks = ops(path)
    op = ks.int4_tiles if ks.int4_tiles is not None and rows >= 32 else ks.int4
    packed, scales = matrices[shape][scales]
    x = torch.randn(rows, SHAPES[shape][1])
    y = benchmark(op, x, packed, scales)
    assert y.shape == (rows, SHAPES[shape][0]) and bool(torch.isfinite(y).all())


@pytest.mark.parametrize("rows", [1, 8, 32])
@pytest.mark.parametrize("path", PATHS)
def test_int8_head(benchmark, matrices, path, rows):
    q, scales = matrices["head"]
    x = torch.randn(rows, HEAD[1])
    y = benchmark(ops(path).int8, x, q, scales)
    assert y.shape == (rows, HEAD[0]) and bool(torch.isfinite(y).all())
