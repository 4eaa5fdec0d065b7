"""engine.cuda_elementwise's RMSNorm kernels against torch's expression: whole rows and rows
that are slices of wider ones (engine.models.deepseek2 norms its latent within the projection's
output), and qwen3's per-head norms in place.  On a CUDA device (gpu-marked) or under Triton's
interpreter (TRITON_INTERPRET=1)."""
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [(4, 2, 64), (32, 4, 128)], ids=lambda h: "x".join(map(str, h)))
def test_head_norms_norm_query_and_key_heads_in_place(device, heads):
    """qwen3's per-head q/k norms: each query head by the q weight, each key head by the k
    weight, the values untouched, as engine.models.llama's torch expression computes them."""
    H, Hkv, D = heads
    torch.manual_seed(1)
    qkv = torch.randn(3, (H + 2 * Hkv) * D + 8, device=device)[:, :-8]  # rows wider than the projections
    q_w, k_w = torch.rand(D, device=device) + 0.5, torch.rand(D, device=device) + 0.5
    want = qkv.clone()

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    want[:, : H * D] = norm(want[:, : H * D].view(3, H, D), q_w).view(3, -1)
    want[:, H * D: (H + Hkv) * D] = norm(want[:, H * D: (H + Hkv) * D].view(3, Hkv, D), k_w).view(3, -1)
    cuda_elementwise.head_norms_(qkv, q_w, k_w, H, Hkv, 1e-6)
    torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (H + Hkv) * D:], want[:, (H + Hkv) * D:])


@pytest.mark.parametrize("device", [p for p in DEVICES if p.values[0] == "cuda"])  # bfloat16 inputs
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_swiglu_of_float32_values_held_in_bfloat16(device, out_dtype):
    """A prefill's gate/up product that cuBLAS rounded to bfloat16 (`Linear.narrow`) gives the
    SwiGLU of the same values in float32, bit for bit, with `op_dtype` float32; without it the
    ops round to bfloat16, as torch's on bfloat16 tensors."""
    torch.manual_seed(2)
    narrow = (torch.randn(4, 2 * 1536, device=device) * 3).to(torch.bfloat16)
    wide = cuda_elementwise.swiglu(narrow.float(), out_dtype)
    assert torch.equal(cuda_elementwise.swiglu(narrow, out_dtype, torch.float32), wide)
    g, u = narrow[:, :1536].float(), narrow[:, 1536:].float()
    assert torch.equal(wide, (torch.nn.functional.silu(g) * u).to(out_dtype))
    as_bf16 = cuda_elementwise.swiglu(narrow, out_dtype)
    g, u = narrow[:, :1536], narrow[:, 1536:]
    assert torch.equal(as_bf16, (torch.nn.functional.silu(g) * u).to(out_dtype))
    assert not torch.equal(as_bf16.float(), wide.float())


def test_torch_swiglu_of_float32_values_held_in_bfloat16():
    """TorchKernels (eager CUDA without Triton's kernels, CPU) computes a `Linear.narrow` product
    as the float32 tensor it stands for."""
    from engine.models.llama import TorchKernels
    ops = TorchKernels(torch.tensor(1e-6), 64)
    narrow = (torch.randn(3, 128, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    assert torch.equal(ops.swiglu(narrow, torch.float32), ops.swiglu(narrow.float()))
    assert ops.swiglu(narrow).dtype == torch.bfloat16
