"""The embedded model as llama.cpp's own quantizer writes it (the `llamacpp` extra): the files
people download come from that quantizer, with its mixtures and its fallback types for rows
that 256-wide blocks do not tile (SmolLM2's 576-wide rows take Q5_0, Q5_1, Q4_0 or IQ4_NL
beside the k-quants), so the engine must load each and keep the packed path's promise against
its own float32 path on every CPU path this host runs: mean KL at most 2e-4 (docs/engine.md).
The source is the embedded model's weights written as F16 (tests/engine/gguf_files.py); the
quantizer runs in this process, a few seconds a file.  Skipped without llama-cpp-python or the
embedded model."""
from __future__ import annotations

import ctypes
import importlib.util

import numpy as np
import pytest
import torch

import engine
from engine import kernels
from gguf_files import retyped_copy

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                reason="llama-cpp-python (the llamacpp extra) is not installed")

# The _M mixtures people download most, and single types llama.cpp writes with its fallbacks.
FTYPES = ["Q4_K_M", "Q5_K_M", "Q3_K_M", "Q6_K", "IQ4_XS", "Q2_K"]
PATHS = [p for p in kernels.host_paths() if p != "torch"]
TEXT = ("The committee met on Tuesday to review the budget, and after a long discussion about the "
        "new library, the roads and the school, it agreed to postpone the vote until spring.")
KL_BOUND = 2e-4  # the packed path's promise against the float32 path


@pytest.fixture(scope="module")
def quantized(smollm2_gguf, tmp_path_factory):
    """ftype -> the embedded model in that llama.cpp file type, quantized once per module."""
    import llama_cpp

    root = tmp_path_factory.mktemp("llamacpp")
    source = retyped_copy(smollm2_gguf, str(root / "f16.gguf"), "F16")
    made: dict[str, str] = {}

    def make(ftype: str) -> str:
        if ftype not in made:
            dst = str(root / f"{ftype}.gguf")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            params.nthread = 2
            assert llama_cpp.llama_model_quantize(source.encode(), dst.encode(), ctypes.byref(params)) == 0
            made[ftype] = dst
        return made[ftype]

    return make


def all_logits(m: engine.Model, ids: list[int]) -> np.ndarray:
    return m.net.forward(torch.tensor(ids), 0, m.new_session().cache, logits="all").double().numpy()


def mean_kl(p: np.ndarray, q: np.ndarray) -> float:
    lp = p - np.logaddexp.reduce(p, axis=-1, keepdims=True)
    lq = q - np.logaddexp.reduce(q, axis=-1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("ftype", FTYPES)
def test_llamacpp_files_load_and_keep_the_promise_on_every_path(quantized, ftype):
    path = quantized(ftype)
    exact = engine.load_model(path, weights="float32")
    ids = exact.tokenize(TEXT)
    assert len(ids) > 30
    want = all_logits(exact, ids)
    for cpu in PATHS:
        got = all_logits(engine.load_model(path, cpu_kernels=cpu), ids)
        kl = mean_kl(want, got)
        assert kl <= KL_BOUND, (ftype, cpu, kl)
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9, (ftype, cpu)
