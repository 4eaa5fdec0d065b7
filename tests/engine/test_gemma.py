"""The gemma2/gemma3 family on random-weight GGUFs: the forward pass against a plain float64
reference (tests/gemma_models.py), past the sliding window and with soft-capping that
bites; decoding against prefill, batched against alone, the hyperparameters read from the
metadata, and the CUDA path (gpu-marked, skipped without a device)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import engine
from engine import SamplingParams, generate
from engine.batch import decode_batch
from engine.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplate, ChatTemplateRejected
from engine.config import ModelConfig
from engine.kernels import host_paths
from engine.models.gemma import GemmaParams
from gguf_files import file_maker
from gemma_models import GemmaSpec, reference_logits, vocabulary, write_random_gemma

QTYPES = ["F32", "F16", "Q8_0", "Q4_K", "Q6_K"]
# 13 tokens against a window of 4: most positions of a local layer see only part of the past.
TOKENS = [5, 77, 130, 2, 250, 9, 9, 41, 200, 13, 66, 101, 3]
GREEDY = SamplingParams(argmax_ignoring_eos=True)


def spec(arch: str, qtype: str = "F32", **kw) -> GemmaSpec:
    wide = qtype in ("Q4_K", "Q6_K")  # k-quant blocks span 256 columns
    base = dict(arch=arch, qtype=qtype, n_embd=256 if wide else 64, n_ff=512 if wide else 128,
                head_dim=64 if wide else 32, seed=len(qtype) + len(arch))
    if arch == "gemma2":  # two layers (local, global), caps low enough to bite on random weights
        base.update(n_layer=2, attn_softcap=3.0, final_softcap=5.0)
    base.update(kw)
    return GemmaSpec(**base)


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    """gemma_gguf(arch, qtype, **spec) -> path of a cached random Gemma model."""
    return file_maker(tmp_path_factory.mktemp("gemma"),
                      lambda path, arch, qtype, kw: write_random_gemma(path, spec(arch, qtype, **kw)),
                      kind="gemma3", qtype="F32")


def all_logits(m, tokens: list[int]) -> np.ndarray:
    ids = torch.tensor(tokens, device=m.device)
    return m.net.forward(ids, 0, m.new_session().cache, logits="all").double().cpu().numpy()


def decoded_logits(m, tokens: list[int], prompt: int = 3) -> torch.Tensor:
    """The logits after the first `prompt` tokens, then after each further token decoded one
    by one: [len(tokens) - prompt + 1, n_vocab]."""
    s = m.new_session()
    s.sync(tokens[:prompt])
    rows = [s.logits]
    for t in tokens[prompt:]:
        s.eval(t)
        rows.append(s.logits)
    return torch.stack(rows)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_forward_matches_float64_reference(gemma_gguf, arch, qtype):
    path = gemma_gguf(arch, qtype)
    ref = reference_logits(path, TOKENS)
    if arch == "gemma2":  # the caps are exercised, not bypassed
        assert ref.max_score > 3.0 and ref.max_logit > 5.0
    scale = np.abs(ref.logits).max()
    got = all_logits(engine.load_model(path, weights="float32"), TOKENS)
    assert np.abs(got - ref.logits).max() <= 2e-5 * scale
    got = all_logits(engine.load_model(path), TOKENS)
    # Packed path: bfloat16/float16 matmul inputs and a float16 cache.
    assert np.abs(got - ref.logits).max() <= 2e-2 * scale
    assert (got.argmax(-1) == ref.logits.argmax(-1)).mean() >= 0.75


def test_linear_rope_scaling_applies_to_global_layers(gemma_gguf):
    path = gemma_gguf("gemma3", rope_scale=8.0)
    ref = reference_logits(path, TOKENS).logits
    got = all_logits(engine.load_model(path, weights="float32"), TOKENS)
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()
    unscaled = all_logits(engine.load_model(gemma_gguf("gemma3"), weights="float32"), TOKENS)
    assert np.abs(got[1:] - unscaled[1:]).max() > 1e-3  # the scaling changed something


def test_the_window_hides_what_lies_past_it(gemma_gguf):
    """Same weights, a window of 4 and one wider than the text: equal until the small window
    is full, different after (so the window is honoured, not just declared)."""
    windowed = all_logits(engine.load_model(gemma_gguf("gemma3", window=4), weights="float32"), TOKENS)
    unbounded = all_logits(engine.load_model(gemma_gguf("gemma3", window=256), weights="float32"), TOKENS)
    np.testing.assert_allclose(windowed[:4], unbounded[:4], rtol=1e-5, atol=1e-5)
    assert all(np.abs(windowed[t] - unbounded[t]).max() > 1e-3 for t in range(4, len(TOKENS)))


def test_soft_capping_bounds_the_logits(gemma_gguf):
    m = engine.load_model(gemma_gguf("gemma2"), weights="float32")
    capped = all_logits(m, TOKENS)
    assert np.abs(capped).max() < 5.0
    uncapped = all_logits(engine.load_model(gemma_gguf("gemma2", attn_softcap=None, final_softcap=None),
                                            weights="float32"), TOKENS)
    assert np.abs(uncapped).max() > 5.0


def test_hyperparameters_come_from_the_metadata(gemma_gguf):
    g3 = engine.load_model(gemma_gguf("gemma3", local_rope_base=500.0, pattern=3)).net.params
    assert (g3.window, g3.pattern, g3.local_rope_base, g3.global_rope_base) == (4, 3, 500.0, 1_000_000.0)
    assert [g3.is_local(i) for i in range(6)] == [True, True, False, True, True, False]
    assert g3.query_scale == pytest.approx(32 ** -0.5) and g3.attn_softcap is None
    defaults = engine.load_model(gemma_gguf("gemma3")).net.params
    assert defaults.pattern == 6 and defaults.local_rope_base == 10000.0
    g2 = engine.load_model(gemma_gguf("gemma2")).net.params
    assert (g2.pattern, g2.attn_softcap, g2.final_softcap) == (2, 3.0, 5.0)
    assert g2.local_rope_base == g2.global_rope_base


def test_query_scale_follows_the_27b_rule():
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 62, "gemma3.embedding_length": 5376,
            "gemma3.feed_forward_length": 21504, "gemma3.attention.head_count": 32,
            "gemma3.attention.head_count_kv": 16, "gemma3.attention.key_length": 128,
            "gemma3.context_length": 131072, "gemma3.vocab_size": 262144,
            "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    cfg = ModelConfig.from_metadata(meta)
    p = GemmaParams.from_metadata(cfg, meta)
    assert p.query_scale == pytest.approx(168 ** -0.5) and p.global_rope_scale == 8.0
    small = GemmaParams.from_metadata(dataclasses.replace(cfg, n_layer=34), {**meta, "gemma3.block_count": 34})
    assert small.query_scale == pytest.approx(128 ** -0.5)
    told = GemmaParams.from_metadata(cfg, {**meta, "gemma3.attention.scale": 0.1})
    assert told.query_scale == pytest.approx(0.1)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_decoding_equals_prefill_exactly(gemma_gguf, arch):
    """Token by token past the window, bit for bit the prefill's logits (CPU, packed)."""
    m = engine.load_model(gemma_gguf(arch, "Q8_0"))
    full = m.net.forward(torch.tensor(TOKENS), 0, m.new_session().cache, logits="all")
    assert torch.equal(decoded_logits(m, TOKENS), full[2:])


@pytest.mark.parametrize("kernel_path", host_paths())
def test_every_cpu_kernel_path_matches_the_reference_and_decodes_as_it_prefills(gemma_gguf, kernel_path):
    """The compiled paths (attention with the window and the score cap in the kernel, block
    ops) and the torch ops path: each within the packed bounds of the float64 reference, and
    each decoding token by token to its own prefill's logits, bit for bit."""
    path = gemma_gguf("gemma2", "Q8_0")
    ref = reference_logits(path, TOKENS)
    m = engine.load_model(path, cpu_kernels=kernel_path)
    assert (m.net.kernels is None) == (kernel_path == "torch")
    got = all_logits(m, TOKENS)
    assert np.abs(got - ref.logits).max() <= 2e-2 * np.abs(ref.logits).max()
    assert np.array_equal(decoded_logits(m, TOKENS).double().numpy(), got[2:])


def test_a_bfloat16_cache_on_cpu_keeps_the_torch_attention(gemma_gguf):
    """The compiled attention reads float32 and float16 caches; a bfloat16 one (--kv-type bf16)
    runs the torch ops, still within the packed bounds and decoding as it prefills."""
    path = gemma_gguf("gemma3", "Q8_0")
    ref = reference_logits(path, TOKENS).logits
    m = engine.load_model(path, kv_type="bf16")
    assert m.net.kernels is not None and m.new_session().cache.kv.dtype == torch.bfloat16
    got = all_logits(m, TOKENS)
    assert np.abs(got - ref).max() <= 2e-2 * np.abs(ref).max()
    assert np.array_equal(decoded_logits(m, TOKENS).double().numpy(), got[2:])


@pytest.mark.parametrize("arch,qtype", [("gemma2", "Q8_0"), ("gemma3", "Q4_K"), ("gemma3", "Q6_K")])
def test_decoding_in_block_ops_gives_the_bits_of_the_kernels_one_by_one(gemma_gguf, arch, qtype):
    """One row and three rows a step, past the window (and the ring), with each layer half in
    one op and with the same kernels called one by one: the same logits and caches."""
    m = engine.load_model(gemma_gguf(arch, qtype, n_ctx=512))
    assert m.net.block_ops is not None
    assert all(b.wqkv.vector_operands(1) is not None and b.w_down.vector_operands(1) is not None
               for b in m.net.blocks)  # every half takes its op

    def run() -> list[torch.Tensor]:
        sessions = [m.new_session() for _ in range(3)]
        for i, s in enumerate(sessions):
            s.sync(TOKENS[: 3 + 2 * i])
        out = []
        for step in range(10):
            ids = [int(s.logits.argmax()) for s in sessions]
            if step % 2:
                sessions[0].eval(ids[0])
            else:
                decode_batch(sessions, ids)
            out += [s.logits.clone() for s in sessions]
        return out + [s.cache.ring_kv.clone() for s in sessions if s.cache.ring_kv is not None]

    fused = run()
    m.net.block_ops = None
    assert all(torch.equal(a, b) for a, b in zip(fused, run()))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_batched_prefill_masks_as_rows_attend(gemma_gguf, arch):
    """The masked one-batch prefill (the CUDA path), run on CPU in chunks that start inside and
    past the window, against the row-by-row prefill."""
    m = engine.load_model(gemma_gguf(arch, "F32"), weights="float32")
    rows = all_logits(m, TOKENS)
    m.net.batched_prefill = True
    m.prefill_chunk = 5
    s = m.new_session()
    chunks = np.concatenate([c.double().numpy() for _, c in s.iter_extend_logits(TOKENS)])
    np.testing.assert_allclose(chunks, rows, rtol=1e-5, atol=1e-5 * np.abs(rows).max())


@pytest.mark.parametrize("pooled", [False, True], ids=["own-caches", "pooled"])
def test_batched_decoding_equals_alone(gemma_gguf, pooled):
    m = engine.load_model(gemma_gguf("gemma3", "Q4_K", n_ctx=512))
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


def test_sessions_generate_and_report_their_memory(gemma_gguf):
    m = engine.load_model(gemma_gguf("gemma3", "Q8_0"), ctx=64)
    cfg = m.config
    layer = 2 * cfg.n_head_kv * cfg.head_dim * 2  # K and V of one layer at one position, float16
    # 6 layers: 5 local in a ring of 2 * window - 1 = 7 positions, 1 global that keeps every one.
    assert m.kv_bytes_per_token == layer
    assert m.net.kv_bytes(64, m.kv_dtype) == 64 * layer + 5 * 7 * layer
    assert m.memory_bytes(2, 64) == m.weight_bytes + 2 * (64 + 35) * layer + m.net.work_bytes(m.prefill_chunk, 64)
    s = m.new_session()
    s.sync(m.prompt_ids(TOKENS))
    assert len(list(generate(s, GREEDY, 20))) == 20


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.gpu
@needs_cuda
def test_cuda_forward_matches_float64_reference(gemma_gguf, arch, qtype):
    path = gemma_gguf(arch, qtype)
    ref = reference_logits(path, TOKENS).logits
    got = all_logits(engine.load_model(path, device="cuda"), TOKENS)
    assert np.abs(got - ref).max() <= 5e-2 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    exact = all_logits(engine.load_model(path, device="cuda", weights="float32", kv_type="f32"), TOKENS)
    assert np.abs(exact - ref).max() <= 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.gpu
@needs_cuda
def test_cuda_decoding_and_batches_agree_with_prefill(gemma_gguf, arch):
    m = engine.load_model(gemma_gguf(arch, "Q8_0"), device="cuda")
    full = m.new_session()
    full.sync(TOKENS)
    batch = m.new_sessions(3)
    for s, n in zip(batch, (3, 6, 9)):
        s.sync(TOKENS[:n])
    while batch[0].n_past < len(TOKENS):
        decode_batch([s for s in batch if s.n_past < len(TOKENS)],
                     [TOKENS[s.n_past] for s in batch if s.n_past < len(TOKENS)])
    tol = 2e-2 * float(full.logits.abs().max())
    for s in batch:
        torch.testing.assert_close(s.logits.float().cpu(), full.logits.float().cpu(), rtol=2e-2, atol=tol)


def gemma_template(**meta) -> ChatTemplate:
    """The template a Gemma vocabulary without a chat template of its own gets."""
    tokens, _, _ = vocabulary()
    return ChatTemplate.from_gguf_metadata({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.bos_token_id": 2,
                                            "tokenizer.ggml.eos_token_id": 1, **meta})


def test_a_gemma_vocabulary_without_a_template_gets_gemma_turns():
    tpl = gemma_template()
    assert tpl.spec.is_fallback and tpl.source == GEMMA_TEMPLATE
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi there \n"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}]
    # No system turn: its text and a blank line open the first user turn; contents are trimmed.
    assert tpl.render(chat) == ("<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
                                "<start_of_turn>model\nHello!<end_of_turn>\n"
                                "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")
    assert tpl.render(chat[1:2], add_generation_prompt=False) == "<bos><start_of_turn>user\nHi there<end_of_turn>\n"
    with pytest.raises(ChatTemplateRejected, match="alternate"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    # A template in the file wins; a vocabulary without Gemma's turn tokens keeps ChatML.
    assert gemma_template(**{"tokenizer.chat_template": "{{ 'own' }}"}).render([]) == "own"
    assert ChatTemplate.from_gguf_metadata({"tokenizer.ggml.tokens": ["a"]}).source == CHATML_TEMPLATE


def test_a_rendered_gemma_chat_tokenizes_to_its_control_tokens(gemma_gguf):
    m = engine.load_model(gemma_gguf("gemma3", "Q8_0"))
    ids = m.prompt_ids(m.tokenize_prompt(m.render_prompt([{"role": "user", "content": "<end_of_turn>the"}])))
    controls = [m.tokenizer.piece(i) for i in ids if m.tokenizer.is_control(i)]
    # One BOS (the template's); the message's control spelling stays text.
    assert controls == ["<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_turn>"]
    assert m.detokenize_prompt(ids).count("<end_of_turn>") == 2
    assert {1, m.tokenizer.spec.tokens.index("<end_of_turn>")} <= m.eos_ids
