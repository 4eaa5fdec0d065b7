"""The phi3 family and Mistral-style (windowed) llama files on random-weight GGUFs.

The forward pass against the plain float64 reference of tests/engine/phi3_models.py, with
partial rotary, LongRoPE and prompts longer than the window; the window honoured on the
compiled-kernel and torch-ops CPU paths alike; prefill in chunks against decoding token by
token, batched rows against the same rows alone (bit for bit on CPU); and the CUDA path
(gpu-marked, skipped without a device).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import engine
from engine.batch import decode_batch
from engine.config import ModelConfig, UnsupportedModel
from engine.gguf_file import read_gguf
from engine.kernels import cpu_kernels
from engine.models.phi3 import Phi3Model
from gguf_files import file_maker
from phi3_models import Phi3Spec, reference_logits, write_random_phi3

# 13 tokens against a window of 4: most positions see only part of the past.
TOKENS = [5, 77, 130, 2, 250, 9, 9, 41, 200, 13, 66, 101, 3]
# phi3 with partial rotary (16 of 32 dimensions turn) and a Mistral-style llama file.
VARIANTS = {"phi3": dict(arch="phi3", rope_dim=16), "phi3-full-rope": dict(arch="phi3"),
            "mistral": dict(arch="llama")}
PATHS = ["kernel", "torch-ops"]


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory):
    """phi3_gguf(variant, qtype, **spec) -> path of a cached random model."""
    # One seed per variant and type: files that differ in one setting share their weights.
    return file_maker(tmp_path_factory.mktemp("phi3"),
                      lambda path, variant, qtype, kw: write_random_phi3(path, Phi3Spec(
                          **{**VARIANTS[variant], "qtype": qtype, "seed": len(variant) + len(qtype), **kw})),
                      kind="phi3", qtype="F32")


def load(path: str, attention: str = "kernel", **kw):
    m = engine.load_model(path, **kw)
    if attention == "torch-ops":
        m.net.attention_kernel = None
    else:
        assert m.net.attention_kernel is not None
    return m


def all_logits(m, tokens: list[int]) -> np.ndarray:
    ids = torch.tensor(tokens, device=m.device)
    return m.net.forward(ids, 0, m.new_session().cache, logits="all").double().cpu().numpy()


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_float64_reference(phi3_gguf, variant, qtype, attention):
    path = phi3_gguf(variant, qtype)
    ref = reference_logits(path, TOKENS)
    scale = np.abs(ref).max()
    got = all_logits(load(path, attention, weights="float32"), TOKENS)
    assert np.abs(got - ref).max() <= 2e-5 * scale
    got = all_logits(load(path, attention), TOKENS)  # packed: low-precision matmuls, float16 cache
    assert np.abs(got - ref).max() <= 2e-2 * scale
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("variant", ["phi3", "mistral"])
def test_the_window_hides_what_lies_past_it(phi3_gguf, variant, attention):
    """Same weights, a window of 4 and one wider than the text: equal until the small window
    is full, different after (so the window is honoured, not just declared)."""
    windowed = all_logits(load(phi3_gguf(variant, window=4), attention, weights="float32"), TOKENS)
    unbounded = all_logits(load(phi3_gguf(variant, window=None), attention, weights="float32"), TOKENS)
    np.testing.assert_allclose(windowed[:4], unbounded[:4], rtol=1e-5, atol=1e-5)
    assert all(np.abs(windowed[t] - unbounded[t]).max() > 1e-3 for t in range(4, len(TOKENS)))


def test_partial_rotary_leaves_the_rest_of_each_head_unturned(phi3_gguf):
    partial = all_logits(load(phi3_gguf("phi3", window=None), weights="float32"), TOKENS)
    same_weights = phi3_gguf("phi3-full-rope", window=None, seed=len("phi3") + len("F32"))
    full = all_logits(load(same_weights, weights="float32"), TOKENS)
    assert np.abs(partial[1:] - full[1:]).max() > 1e-3  # the rope dim changed something


@pytest.mark.parametrize("ctx, long", [(32, False), (64, True)])
def test_longrope_takes_the_short_factors_within_the_original_context(phi3_gguf, ctx, long):
    path = phi3_gguf("phi3", long_rope=True, attn_factor=1.2)
    m = load(path, weights="float32", ctx=ctx)
    assert m.net.rope_by_context and m.net.decode_graphs is None
    assert (m.net.rope_for(ctx) is m.net.rope_long) == long
    ref = reference_logits(path, TOKENS, n_ctx=ctx)
    assert np.abs(all_logits(m, TOKENS) - ref).max() <= 2e-5 * np.abs(ref).max()
    other = reference_logits(path, TOKENS, n_ctx=96 - ctx)
    assert np.abs(ref[1:] - other[1:]).max() > 1e-3  # the two tables differ where it matters


def test_hyperparameters_come_from_the_metadata(phi3_gguf):
    m = load(phi3_gguf("phi3"))
    assert (m.config.rope_dim, m.config.head_dim, m.config.sliding_window) == (16, 32, 4)
    assert m.config.rope_style == "neox" and "sliding window 4" in m.net.attention_path
    assert load(phi3_gguf("mistral", window=None)).config.sliding_window is None
    meta = {"general.architecture": "llama", "llama.block_count": 1, "llama.embedding_length": 64,
            "llama.feed_forward_length": 64, "llama.attention.head_count": 2, "llama.context_length": 64,
            "llama.vocab_size": 10, "llama.attention.sliding_window": 4096}
    assert ModelConfig.from_metadata(meta).sliding_window == 4096


def test_fused_tensors_must_split_where_the_metadata_says(phi3_gguf):
    """An ffn_up or attn_qkv of another height than the shape implies is refused by name, not
    split in the wrong place."""
    g = read_gguf(phi3_gguf("phi3"))
    cfg = ModelConfig.from_metadata(g.metadata)
    with pytest.raises(UnsupportedModel, match=r"blk\.0\.ffn_up\.weight has 192 rows, not 128"):
        Phi3Model(dataclasses.replace(cfg, n_ff=64), g, "float32", torch.device("cpu"), cpu_kernels())


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("variant", ["phi3", "mistral"])
def test_decoding_equals_prefill_exactly(phi3_gguf, variant, attention):
    """Token by token past the window, and a prefill in chunks that start inside and past it,
    bit for bit the whole prefill's logits (CPU, packed)."""
    m = load(phi3_gguf(variant, "Q8_0"), attention)
    full = m.net.forward(torch.tensor(TOKENS), 0, m.new_session().cache, logits="all")
    s = m.new_session()
    s.sync(TOKENS[:3])
    rows = [s.logits]
    for t in TOKENS[3:]:
        s.eval(t)
        rows.append(s.logits)
    assert torch.equal(torch.stack(rows), full[2:])
    m.prefill_chunk = 5
    chunks = torch.cat([c for _, c in m.new_session().iter_extend_logits(TOKENS)])
    assert torch.equal(chunks, full)


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("pooled", [False, True], ids=["own-caches", "pooled"])
@pytest.mark.parametrize("variant", ["phi3", "mistral"])
def test_batched_decoding_equals_alone(phi3_gguf, variant, pooled, attention):
    m = load(phi3_gguf(variant, "Q4_0"), attention)
    m.prefill_chunk = 5
    prompts = [TOKENS[: 2 + 3 * i] for i in range(4)]  # inside and past the window
    batch = m.new_sessions(4) if pooled else [m.new_session() for _ in prompts]
    for s, p in zip(batch, prompts):
        s.sync(p)
    for step in range(3):
        decode_batch(batch, [7 + step] * 4)
    for s, p in zip(batch, prompts):
        one = m.new_session()
        one.sync(p)
        for step in range(3):
            one.eval(7 + step)
        assert torch.equal(s.logits, one.logits)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
@pytest.mark.parametrize("variant", ["phi3", "mistral"])
@pytest.mark.gpu
@needs_cuda
def test_cuda_forward_matches_float64_reference(phi3_gguf, variant, qtype):
    path = phi3_gguf(variant, qtype)
    ref = reference_logits(path, TOKENS)
    got = all_logits(engine.load_model(path, device="cuda"), TOKENS)
    assert np.abs(got - ref).max() <= 5e-2 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    exact = all_logits(engine.load_model(path, device="cuda", weights="float32", kv_type="f32"), TOKENS)
    assert np.abs(exact - ref).max() <= 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("variant", ["phi3", "mistral"])
@pytest.mark.gpu
@needs_cuda
def test_cuda_decoding_chunks_and_batches_agree_with_prefill(phi3_gguf, variant):
    """Pooled rows (one masked batch), chunks starting past the window (SDPA with a mask) and
    single rows, all against the whole prompt's prefill."""
    m = engine.load_model(phi3_gguf(variant, "Q8_0"), device="cuda")
    assert m.net.decode_graphs is None  # graphs attend to every position: off with a window
    full = m.new_session()
    full.sync(TOKENS)
    batch = m.new_sessions(3)
    for s, n in zip(batch, (3, 6, 9)):
        s.sync(TOKENS[:n])
    while batch[0].n_past < len(TOKENS):
        decode_batch([s for s in batch if s.n_past < len(TOKENS)],
                     [TOKENS[s.n_past] for s in batch if s.n_past < len(TOKENS)])
    m.prefill_chunk = 5
    chunked = m.new_session()
    chunked.sync(TOKENS)
    tol = 2e-2 * float(full.logits.abs().max())
    for s in batch + [chunked]:
        torch.testing.assert_close(s.logits.float().cpu(), full.logits.float().cpu(), rtol=2e-2, atol=tol)


def test_rows_on_both_sides_of_the_longrope_switch_decode_as_alone(phi3_gguf):
    """One batch holding a cache within the original context (short factors) and one beyond
    it (long factors): each row rotates by its own cache's table."""
    m = load(phi3_gguf("phi3", "Q8_0", long_rope=True))
    net, step = m.net, torch.tensor([7, 7])

    def prefilled(n_ctx: int):
        cache = net.new_cache(n_ctx, torch.float16)
        net.forward(torch.tensor(TOKENS[:6]), 0, cache, logits="none")
        return cache

    together = net.forward_rows(step, [prefilled(32), prefilled(64)])
    alone = [net.forward_rows(step[:1], [prefilled(n)])[0] for n in (32, 64)]
    assert torch.equal(together, torch.stack(alone))
    assert not torch.equal(alone[0], alone[1])
