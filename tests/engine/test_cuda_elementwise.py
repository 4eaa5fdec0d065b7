"""engine.cuda_elementwise's RMSNorm kernel against torch's expression, on contiguous rows and
on rows that are slices of wider ones (engine.models.deepseek2 norms its latent in place within
the projection's output).  On a CUDA device (gpu-marked) or under Triton's interpreter
(TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
import torch

from engine import cuda_elementwise
from engine.cuda_attention import AVAILABLE

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available() or not AVAILABLE, reason="needs a CUDA device and Triton")]),
           pytest.param("cpu", marks=pytest.mark.skipif(
               not (INTERPRETED and AVAILABLE), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_whole_and_sliced_rows(device, out_dtype):
    if device == "cpu" and out_dtype == torch.bfloat16:
        pytest.skip("no bfloat16 in Triton's interpreter")
    torch.manual_seed(0)
    wide = torch.randn(5, 700, device=device)
    w = torch.rand(512, device=device) + 0.5
    for x in (wide[:, 100:612], wide[:, :512].contiguous()):
        got = cuda_elementwise.rms_norm(x, w, 1e-6, out_dtype)
        want = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(out_dtype)
        assert got.shape == x.shape and got.dtype == out_dtype and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5 if out_dtype == torch.float32 else 1e-2, atol=1e-5)
