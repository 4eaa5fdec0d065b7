"""The deepseek2 family on random-weight GGUFs (tests/engine/deepseek2_models.py): the forward
pass against a plain float64 reference (keys and values expanded per head, not absorbed) in
F32 and a packed type, for a V2-like file (q bottleneck, softmax routing, attn_kv_b) and a
V3-like one (no q bottleneck, sigmoid routing with expert bias and groups, renormalised and
scaled weights, attn_k_b/attn_v_b) and with YaRN; the routing rule; the latent cache (its
layout and bytes per token); prefill against token-by-token decoding and batched decoding
against alone, bit for bit on CPU; prefix reuse and a restored disk-cache payload against a
fresh prefill; the weight accounting; agreement with transformers' DeepseekV3 built from the
same weights; the captured-graph step (`graph_step`, with engine.cuda_attention's latent
kernel) against the eager step on CPU under Triton's interpreter (TRITON_INTERPRET=1); and the
CUDA path, graphs included (gpu-marked, skipped without a device)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import engine
from engine import SamplingParams, generate
from engine.batch import decode_batch
from engine.config import ModelConfig, UnsupportedModel
from engine import cuda_attention, cuda_graphs, cuda_moe
from engine.models import deepseek2, qwen_moe
from engine.models.deepseek2 import route, yarn_rope
from gguf_files import file_maker
from deepseek2_models import DeepSeek2Spec, reference_logits, write_random_deepseek2
from moe_models import read_weights

TOKENS = [5, 77, 130, 2, 250, 9, 9, 41, 200, 13, 66, 101, 3]
VARIANTS = {
    "v2": dict(),
    "v3": dict(nope=32, q_lora_rank=0, gating="sigmoid", weights_norm=True, weights_scale=2.5, split_kv_b=True),
    "yarn": dict(yarn_factor=4.0),
}
# Seeds whose routing decisions on TOKENS (experts and groups) all have a clear margin in
# Q4_0, so that the packed path's rounding cannot flip one.
PACKED_SEEDS = {"v2": 8, "v3": 0}
GREEDY = SamplingParams(argmax_ignoring_eos=True)


@pytest.fixture(scope="module")
def ds_gguf(tmp_path_factory):
    """ds_gguf(variant, qtype, **spec) -> path of a cached random deepseek2 model."""
    return file_maker(tmp_path_factory.mktemp("deepseek2"),
                      lambda path, variant, qtype, kw: write_random_deepseek2(
                          path, DeepSeek2Spec(qtype=qtype, **{**VARIANTS[variant], **kw})),
                      kind="v2", qtype="F32")


def all_logits(m, tokens: list[int]) -> np.ndarray:
    ids = torch.tensor(tokens, device=m.device)
    return m.net.forward(ids, 0, m.new_session().cache, logits="all").double().cpu().numpy()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float32_forward_matches_float64_reference(ds_gguf, variant):
    path = ds_gguf(variant)
    ref = reference_logits(path, TOKENS).logits
    got = all_logits(engine.load_model(path, weights="float32"), TOKENS)
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()


def test_a_chunk_attending_in_one_batch_matches_the_reference(ds_gguf):
    """The other devices' prefill (all rows of a chunk in one masked batch), run on CPU."""
    path = ds_gguf("v2")
    ref = reference_logits(path, TOKENS).logits
    m = engine.load_model(path, weights="float32")
    m.net.rows_alone = False
    s = m.new_session()
    chunks = [s.extend_logits(TOKENS[:5]), s.extend_logits(TOKENS[5:])]  # the second sees a cached past
    got = torch.cat(chunks).double().numpy()
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()


def test_pooled_rows_attending_in_one_batch_agree_with_alone(ds_gguf):
    """The other devices' decoding (a step's pooled rows in one masked batch over the longest
    row's length), run on CPU: within float32 rounding of each row decoded alone."""
    m = engine.load_model(ds_gguf("v3"), weights="float32")
    m.net.rows_alone = False
    batch = m.new_sessions(3)
    for s, n in zip(batch, (3, 6, 9)):
        s.sync(TOKENS[:n])
    while batch[0].n_past < len(TOKENS):
        live = [s for s in batch if s.n_past < len(TOKENS)]
        decode_batch(live, [TOKENS[s.n_past] for s in live])
    m.net.rows_alone = True
    alone = m.new_session()
    alone.sync(TOKENS)
    for s in batch:
        torch.testing.assert_close(s.logits, alone.logits, rtol=0, atol=1e-5 * float(alone.logits.abs().max()))


@pytest.mark.parametrize("variant", list(PACKED_SEEDS))
def test_packed_forward_matches_float64_reference(ds_gguf, variant):
    path = ds_gguf(variant, "Q4_0", seed=PACKED_SEEDS[variant])
    ref = reference_logits(path, TOKENS)
    assert min(ref.margins) > 2e-3  # the precondition the seeds were chosen for
    scale = np.abs(ref.logits).max()
    exact = all_logits(engine.load_model(path, weights="float32"), TOKENS)
    assert np.abs(exact - ref.logits).max() <= 2e-5 * scale  # the 4-bit weights read back exactly
    m = engine.load_model(path)
    assert type(m.net.blocks[1].experts[0].gate_up).__name__ == "Int4Linear"  # experts stay packed
    got = all_logits(m, TOKENS)
    # 4-bit weights with bfloat16 activations, and a float16 latent cache.
    assert np.abs(got - ref.logits).max() <= 2e-2 * scale
    assert (got.argmax(-1) == ref.logits.argmax(-1)).mean() >= 0.75


def test_route_follows_llama_cpp():
    scores = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    probs = torch.softmax(scores, -1)
    ids, w = route(scores, 2, "softmax")
    assert ids.tolist() == [[1, 2], [0, 1]]  # a tie goes to the lower index
    torch.testing.assert_close(w, probs.gather(1, ids))
    ids, w = route(scores, 2, "softmax", normalise=True, scale=2.5)
    torch.testing.assert_close(w.sum(-1), torch.full((2,), 2.5))
    # The bias changes the choice, not the weights: sigmoid scores of the chosen experts.
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    ids, w = route(scores, 2, "sigmoid", bias=bias)
    assert ids.tolist() == [[3, 1], [3, 0]]
    torch.testing.assert_close(w, torch.sigmoid(scores).gather(1, ids))
    # Groups {0, 1} and {2, 3}: the group whose two best biased scores sum highest wins.
    s = torch.tensor([[4.0, -4.0, 1.0, 1.0]])
    ids, _ = route(s, 2, "sigmoid", n_groups=2, n_groups_used=1)
    assert ids.tolist() == [[2, 3]]  # expert 0 is the best alone, but its group sums lower
    ids, _ = route(s, 2, "sigmoid")
    assert ids.tolist() == [[0, 2]]


@pytest.mark.parametrize("n_expert", [8, 16, 24, 64, 100])
@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_a_rows_routing_does_not_depend_on_the_other_rows(gating, n_expert):
    # torch's elementwise sigmoid rounds its vector body and its scalar tail differently, so
    # over [T, n_expert] with a small expert count a row's weights once moved with T
    # (deepseek2.sigmoid_rows); a prefill chunk and a decoding step must route a row alike.
    torch.manual_seed(n_expert)
    for _ in range(20):
        scores = torch.randn(37, n_expert) * 3
        bias = torch.randn(n_expert) if gating == "sigmoid" else None
        together = route(scores, 4, gating, bias=bias, normalise=True, scale=2.5)
        alone = [route(scores[i: i + 1].clone(), 4, gating, bias=bias, normalise=True, scale=2.5) for i in range(37)]
        assert torch.equal(together[0], torch.cat([a[0] for a in alone]))
        assert torch.equal(together[1], torch.cat([a[1] for a in alone]))
    torch.testing.assert_close(deepseek2.sigmoid_rows(scores), torch.sigmoid(scores), rtol=1e-6, atol=0)


def test_config_reads_the_deepseek2_keys(ds_gguf):
    cfg = engine.load_model(ds_gguf("v2")).config
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim, cfg.head_dim_v, cfg.rope_dim) == (32, 32, 32, 24, 16)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_expert_shared, cfg.n_layer_dense_lead) == (8, 2, 1, 1)
    assert cfg.expert_gating == "softmax" and cfg.n_expert_groups == 0 and cfg.expert_weights_norm is False
    cfg = engine.load_model(ds_gguf("v3")).config  # the *_mla keys win over the cache-row ones
    assert (cfg.q_lora_rank, cfg.head_dim, cfg.head_dim_v, cfg.n_head_kv) == (0, 48, 24, 1)
    assert cfg.expert_gating == "sigmoid" and (cfg.n_expert_groups, cfg.n_group_used) == (4, 2)
    assert cfg.expert_weights_norm is True and cfg.expert_weights_scale == 2.5


def test_settings_the_engine_cannot_honour_are_refused():
    a = "deepseek2"
    meta = {"general.architecture": a, f"{a}.block_count": 1, f"{a}.embedding_length": 64,
            f"{a}.feed_forward_length": 96, f"{a}.attention.head_count": 4, f"{a}.attention.key_length": 48,
            f"{a}.rope.dimension_count": 16, f"{a}.context_length": 256, f"{a}.vocab_size": 10}
    with pytest.raises(UnsupportedModel, match="expert_gating_func 3"):
        ModelConfig.from_metadata({**meta, f"{a}.expert_gating_func": 3})
    cfg = ModelConfig.from_metadata(meta)
    assert cfg.expert_gating == "softmax"  # unstated: llama.cpp's default for older files
    with pytest.raises(UnsupportedModel, match="rope scaling 'linear'"):
        yarn_rope(cfg, {f"{a}.rope.scaling.type": "linear", f"{a}.rope.scaling.factor": 2.0})
    inv, factor = yarn_rope(cfg, {f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": 1.0})
    assert factor == 1.0 and torch.equal(inv, yarn_rope(cfg, {})[0])  # a factor of 1 scales nothing


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_the_cache_holds_one_latent_row_per_layer_and_position(ds_gguf, variant):
    """n_layer * (kv_lora_rank + rope_dim) * element size a token, not per-head keys and values."""
    m = engine.load_model(ds_gguf(variant))
    spec = DeepSeek2Spec(**VARIANTS[variant])
    row = spec.kv_lora_rank + spec.rope
    assert m.kv_dtype == torch.float16
    assert m.kv_bytes_per_token == spec.n_layer * row * 2
    assert m.kv_bytes_per_token < 2 * spec.n_layer * spec.n_head * (spec.nope + spec.rope) * 2
    s = m.new_session()
    s.sync(TOKENS)
    assert s.cache.kv.shape[:3] == (spec.n_layer, 1, 1) and s.cache.kv.shape[4] == row
    pool = m.net.new_pool(3, 64, torch.float32)
    assert pool.kv.shape == (spec.n_layer, 1, 3, 1, pool.capacity, row)
    assert m.memory_bytes(2, 128) - m.memory_bytes(1, 128) == 128 * m.kv_bytes_per_token


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_decoding_equals_prefill_exactly(ds_gguf, variant, qtype):
    """Every row attends alone through the absorbed projections, in prefill and in decoding
    alike, so the logits agree bit for bit (no tolerance)."""
    m = engine.load_model(ds_gguf(variant, qtype, seed=PACKED_SEEDS[variant]))
    full = m.net.forward(torch.tensor(TOKENS), 0, m.new_session().cache, logits="all")
    s = m.new_session()
    s.sync(TOKENS[:3])
    rows = [s.logits]
    for t in TOKENS[3:]:
        s.eval(t)
        rows.append(s.logits)
    assert torch.equal(torch.stack(rows), full[2:])


@pytest.mark.parametrize("pooled", [False, True], ids=["own-caches", "pooled"])
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_batched_decoding_equals_alone(ds_gguf, variant, pooled):
    """Rows at different lengths, routed to different experts, decoded together, each bit for
    bit as alone."""
    m = engine.load_model(ds_gguf(variant, "Q4_0", seed=PACKED_SEEDS[variant]))
    m.prefill_chunk = 5
    prompts = [TOKENS[: 2 + 3 * i] for i in range(4)]
    batch = m.new_sessions(4) if pooled else [m.new_session() for _ in prompts]
    for s, p in zip(batch, prompts):
        s.sync(p)
    for step in range(3):
        decode_batch(batch, [7 + step + 40 * i for i in range(4)])
    for i, (s, p) in enumerate(zip(batch, prompts)):
        one = m.new_session()
        one.sync(p)
        for step in range(3):
            one.eval(7 + step + 40 * i)
        assert torch.equal(s.logits, one.logits)


def test_prefix_reuse_and_copies_equal_a_fresh_prefill(ds_gguf):
    m = engine.load_model(ds_gguf("v3", "Q4_0", seed=PACKED_SEEDS["v3"]))
    fresh = m.new_session()
    fresh.sync(TOKENS)
    s = m.new_session()
    s.sync(TOKENS[:6] + [200, 201])
    assert s.sync(TOKENS) == 6  # the shared prefix stays cached
    assert torch.equal(s.logits, fresh.logits)
    copy = m.new_sessions(2)[1]
    copy.copy_prefix_from(fresh, 9)
    copy.sync(TOKENS)
    assert torch.equal(copy.logits, fresh.logits)


@pytest.mark.parametrize("kv_type", [None, "f32"])
def test_a_restored_payload_equals_a_fresh_prefill(ds_gguf, kv_type):
    """The disk cache's entry: the latent rows and the tokens, nothing per head; restoring it
    and continuing gives the fresh session's logits bit for bit."""
    m = engine.load_model(ds_gguf("v2", "Q4_0", seed=PACKED_SEEDS["v2"]), kv_type=kv_type)
    fresh = m.new_session()
    fresh.sync(TOKENS)
    data = fresh.save_payload()
    header = 26  # engine.session's payload header
    assert len(data) == header + 4 * len(TOKENS) + len(TOKENS) * m.kv_bytes_per_token
    restored = m.new_sessions(2)[1]  # a pooled slot, to cover that layout too
    restored.load_payload(data)
    assert restored.tokens == TOKENS and torch.equal(restored.logits, fresh.logits)
    for t in (40, 41, 42):
        fresh.eval(t)
        restored.eval(t)
    assert torch.equal(restored.logits, fresh.logits)
    other = engine.load_model(ds_gguf("v2", kv_lora_rank=64), kv_type=kv_type)  # a wider latent
    with pytest.raises(ValueError, match="another shape"):
        other.new_session().load_payload(data)


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_weight_bytes_count_every_tensor(ds_gguf, variant):
    """In float32 every tensor of the file is held once, as float32 (the latent up-projections
    as W_k and W_v): the accounting is the file's element count times four."""
    path = ds_gguf(variant)
    _, W = read_weights(path)
    assert engine.load_model(path, weights="float32").net.weight_bytes == 4 * sum(w.size for w in W.values())


def test_sessions_generate(ds_gguf):
    m = engine.load_model(ds_gguf("v3", "Q4_0", seed=PACKED_SEEDS["v3"]), ctx=64)
    s = m.new_session()
    s.sync(m.prompt_ids(TOKENS))
    assert len(list(generate(s, GREEDY, 20))) == 20


def transformers_logits(path: str, spec: DeepSeek2Spec, tokens: list[int]) -> np.ndarray:
    """Logits of transformers' own DeepseekV3 (sigmoid routing, expert bias, groups) or, for a
    softmax-routed spec, DeepseekV2 (greedy top-k), float64, built from the GGUF's weights
    (llama.cpp's converter keeps the checkpoint's interleaved rope layout, which both expect)."""
    transformers = pytest.importorskip("transformers")
    _, W = read_weights(path)
    H, rank, nope = spec.n_head, spec.kv_lora_rank, spec.nope
    rope = {"rope_type": "default", "rope_theta": spec.rope_base}
    if spec.yarn_factor:  # the checkpoint's mscale = mscale_all_dim = 1 is llama.cpp's log multiplier 0.1
        rope = {**rope, "rope_type": "yarn", "factor": spec.yarn_factor, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": spec.n_ctx // 4, "mscale": 1.0, "mscale_all_dim": 1.0}
    kw = dict(vocab_size=W["token_embd.weight"].shape[0], hidden_size=spec.n_embd, intermediate_size=spec.n_ff,
              moe_intermediate_size=spec.n_ff_exp, num_hidden_layers=spec.n_layer, num_attention_heads=H,
              num_key_value_heads=H, n_shared_experts=spec.n_shared, n_routed_experts=spec.n_expert,
              routed_scaling_factor=spec.weights_scale, kv_lora_rank=rank, q_lora_rank=spec.q_lora_rank or None,
              qk_rope_head_dim=spec.rope, v_head_dim=spec.v_dim, qk_nope_head_dim=nope,
              num_experts_per_tok=spec.n_expert_used, first_k_dense_replace=spec.n_dense,
              norm_topk_prob=spec.weights_norm, rms_norm_eps=1e-6, max_position_embeddings=spec.n_ctx,
              rope_parameters=rope, tie_word_embeddings=False, attn_implementation="eager",
              experts_implementation="eager")
    if spec.gating == "sigmoid":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            n_group=spec.n_groups, topk_group=spec.n_groups_used, rope_interleave=True, **kw))
    else:
        assert not spec.weights_norm  # DeepseekV2's greedy router does not renormalise
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(topk_method="greedy", **kw))

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    sd = {"model.embed_tokens.weight": t(W["token_embd.weight"]), "lm_head.weight": t(W["output.weight"]),
          "model.norm.weight": t(W["output_norm.weight"])}
    for i in range(spec.n_layer):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        a = h + "self_attn."
        if spec.q_lora_rank:
            sd[a + "q_a_proj.weight"] = t(W[b + "attn_q_a.weight"])
            sd[a + "q_a_layernorm.weight"] = t(W[b + "attn_q_a_norm.weight"])
            sd[a + "q_b_proj.weight"] = t(W[b + "attn_q_b.weight"])
        else:
            sd[a + "q_proj.weight"] = t(W[b + "attn_q.weight"])
        sd[a + "kv_a_proj_with_mqa.weight"] = t(W[b + "attn_kv_a_mqa.weight"])
        sd[a + "kv_a_layernorm.weight"] = t(W[b + "attn_kv_a_norm.weight"])
        if b + "attn_kv_b.weight" in W:
            kv_b = W[b + "attn_kv_b.weight"]
        else:  # undo the converter's split: per head, k_b transposed back, then v_b
            kv_b = np.concatenate([W[b + "attn_k_b.weight"].transpose(0, 2, 1), W[b + "attn_v_b.weight"]], axis=1)
        sd[a + "kv_b_proj.weight"] = t(kv_b.reshape(-1, rank))
        sd[a + "o_proj.weight"] = t(W[b + "attn_output.weight"])
        sd[h + "input_layernorm.weight"] = t(W[b + "attn_norm.weight"])
        sd[h + "post_attention_layernorm.weight"] = t(W[b + "ffn_norm.weight"])
        if i < spec.n_dense:
            for n in ("gate", "up", "down"):
                sd[h + f"mlp.{n}_proj.weight"] = t(W[b + f"ffn_{n}.weight"])
            continue
        sd[h + "mlp.gate.weight"] = t(W[b + "ffn_gate_inp.weight"])
        if b + "exp_probs_b.bias" in W:
            sd[h + "mlp.gate.e_score_correction_bias"] = t(W[b + "exp_probs_b.bias"])
        sd[h + "mlp.experts.gate_up_proj"] = t(np.concatenate([W[b + "ffn_gate_exps.weight"],
                                                               W[b + "ffn_up_exps.weight"]], axis=1))
        sd[h + "mlp.experts.down_proj"] = t(W[b + "ffn_down_exps.weight"])
        for n in ("gate", "up", "down"):
            sd[h + f"mlp.shared_experts.{n}_proj.weight"] = t(W[b + f"ffn_{n}_shexp.weight"])
    model = model.double().eval()
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("variant, kw", [pytest.param("v3", {}, marks=pytest.mark.slow),
                                         ("v3", dict(q_lora_rank=32, yarn_factor=4.0)), ("v2", {})],
                         ids=["v3", "v3-q-lora-yarn", "v2"])
def test_agrees_with_transformers(ds_gguf, variant, kw):
    path = ds_gguf(variant, **kw)
    theirs = transformers_logits(path, DeepSeek2Spec(**{**VARIANTS[variant], **kw}), TOKENS)
    scale = np.abs(theirs).max()
    # transformers routes, and DeepseekV2 rotates, in float32 even in a float64 model, and both
    # compute their rope frequencies in float32
    assert np.abs(reference_logits(path, TOKENS).logits - theirs).max() <= 1e-5 * scale
    got = all_logits(engine.load_model(path, weights="float32"), TOKENS)
    assert np.abs(got - theirs).max() <= 2e-5 * scale


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.gpu
@needs_cuda
def test_cuda_forward_matches_reference_and_decoding_agrees(ds_gguf, variant):
    path = ds_gguf(variant, "Q4_0", seed=PACKED_SEEDS[variant])
    ref = reference_logits(path, TOKENS).logits
    scale = np.abs(ref).max()
    exact = all_logits(engine.load_model(path, device="cuda", weights="float32", kv_type="f32"), TOKENS)
    assert np.abs(exact - ref).max() <= 1e-3 * scale
    m = engine.load_model(path, device="cuda")
    got = all_logits(m, TOKENS)
    assert np.abs(got - ref).max() <= 5e-2 * scale
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    full = m.new_session()
    full.sync(TOKENS)
    batch = m.new_sessions(3)
    for s, n in zip(batch, (3, 6, 9)):
        s.sync(TOKENS[:n])
    while batch[0].n_past < len(TOKENS):
        live = [s for s in batch if s.n_past < len(TOKENS)]
        decode_batch(live, [TOKENS[s.n_past] for s in live])
    tol = 2e-2 * float(full.logits.abs().max())
    for s in batch:
        torch.testing.assert_close(s.logits.float().cpu(), full.logits.float().cpu(), rtol=2e-2, atol=tol)


@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.gpu
@needs_cuda
def test_cuda_stacked_experts_agree_with_the_per_expert_path(ds_gguf, variant, monkeypatch):
    """engine.cuda_moe's kernels against each expert run as its own Linear (v3: sigmoid routing
    with groups, bias and scale, all on the device)."""
    path = ds_gguf(variant, "Q4_0", seed=PACKED_SEEDS[variant])
    m = engine.load_model(path, device="cuda")
    assert isinstance(m.net.blocks[1].experts, cuda_moe.StackedExperts)
    with monkeypatch.context() as mp:
        mp.setattr(deepseek2, "routed_experts", qwen_moe.stacked_experts)
        old = engine.load_model(path, device="cuda")
    assert isinstance(old.net.blocks[1].experts, list)
    want = all_logits(old, TOKENS)
    assert np.abs(all_logits(m, TOKENS) - want).max() <= 1e-2 * np.abs(want).max()
    a, b = m.new_session(), old.new_session()
    for s in (a, b):
        s.sync(TOKENS[:4])
        for t in TOKENS[4:]:
            s.eval(t)
    torch.testing.assert_close(a.logits.float().cpu(), b.logits.float().cpu(), rtol=1e-2,
                               atol=1e-2 * float(b.logits.abs().max()))


@pytest.mark.gpu
@needs_cuda
def test_cuda_deepseek2_layers_never_wait_for_the_host(ds_gguf):
    """The FFN (routing with groups and bias, shared and routed experts) under torch's sync debug
    mode set to raise; and a whole batched decoding step, whose syncs (its positions and tokens
    copied to the device as it starts) must not grow with the number of layers."""
    import warnings
    path = ds_gguf("v3", "Q4_0", seed=PACKED_SEEDS["v3"], n_layer=12)
    m = engine.load_model(path, device="cuda")
    xs = [torch.randn(rows, m.config.n_embd, device="cuda") for rows in (1, 3, 40)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs:
            for blk in m.net.blocks:
                m.net.feed_forward(blk, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    batch = m.new_sessions(3)
    for s, n in zip(batch, (3, 6, 9)):
        s.sync(TOKENS[:n])
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            decode_batch(batch, [7, 8, 9])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message)[:80] for w in caught if "synchroniz" in str(w.message)]
    print(f"{len(syncs)} synchronizing calls in a 3-row step of 12 layers: {syncs}")
    assert len(syncs) < m.config.n_layer - 1


def graph_rows(tokens: list[int], caches: list, positions: list[int], base: torch.Tensor) -> torch.Tensor:
    """A graph's row table (engine.cuda_attention's fields) for caches whose memory lies at
    whole elements from `base`."""
    return torch.tensor([[t, p, (c.kv.data_ptr() - base.data_ptr()) // c.kv.element_size(), c.kv.stride(0),
                          c.kv.stride(1), c.kv.stride(2)] for t, c, p in zip(tokens, caches, positions)])


@pytest.mark.skipif(not (os.environ.get("TRITON_INTERPRET") == "1" and cuda_attention.AVAILABLE),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("fused", [False, True], ids=["torch-inputs", "fused-inputs"])
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_graph_step_equals_the_eager_step_under_the_interpreter(ds_gguf, variant, fused):
    """`graph_step`, what engine.cuda_graphs captures, run on CPU: rows of three caches at
    different lengths against forward_rows, and a prefill's rows of one cache (stored first)
    against forward; the latent rows they store equal the eager ones.  `fused`: the graphs'
    fused kernels, with the latent's inputs made by one kernel."""
    from engine.cuda_elementwise import FusedStepKernels

    m = engine.load_model(ds_gguf(variant, "F32"), weights="float32", kv_type="f32")
    kernels = FusedStepKernels(m.config.norm_eps, torch.float32) if fused else None
    net, cfg = m.net, m.config
    base = torch.zeros(cfg.n_layer, 1, 1, 1, cfg.kv_lora_rank + cfg.rope_dim)
    graph, eager = m.new_sessions(3), m.new_sessions(3)
    for a, b, n in zip(graph, eager, (3, 6, 11)):
        a.sync(TOKENS[:n])
        b.sync(TOKENS[:n])
    caches = [s.cache for s in graph]
    pos = [c.n for c in caches]
    for c in caches:
        c.reserve(c.n + 1)
    work = net.graph_workspace(3, m.n_ctx, torch.float32)
    got = net.graph_step(graph_rows([7, 8, 9], caches, pos, base), base, work, kernels, False)
    want = net.forward_rows(torch.tensor([7, 8, 9]), [s.cache for s in eager])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    for a, b, p in zip(caches, eager, pos):
        torch.testing.assert_close(a.kv[:, :, :, : p + 1], b.cache.kv[:, :, :, : p + 1], rtol=1e-5, atol=1e-6)

    start, T = 4, len(TOKENS) - 4
    one, whole = m.new_session(), m.new_session()
    one.sync(TOKENS[:start])
    assert one.cache.n == start
    one.cache.reserve(start + T)
    rows = graph_rows(TOKENS[start:], [one.cache] * T, list(range(start, start + T)), base)
    got = net.graph_step(rows, base, net.graph_workspace(T, m.n_ctx, torch.float32), kernels, True)
    want = net.forward(torch.tensor(TOKENS), 0, whole.cache, logits="all")[start:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_agree_with_eager_steps(ds_gguf, variant):
    """Prefill, one-row and three-row decoding steps replayed from captured graphs against the
    same steps run eagerly, token by token on the same inputs; and a greedy session running
    steps ahead picks, at every step, its own logits' argmax."""
    path = ds_gguf(variant, "Q4_0", seed=PACKED_SEEDS[variant])
    graphs, eager = engine.load_model(path, device="cuda"), engine.load_model(path, device="cuda")
    g = graphs.net.decode_graphs
    assert g is not None and "CUDA graphs" in graphs.net.attention_path
    eager.net.decode_graphs = None
    pair = [m.new_session() for m in (graphs, eager)]
    for s in pair:
        s.sync(TOKENS[:5])
    scale = float(pair[1].logits.abs().max())
    for t in [None, *TOKENS[5:]]:
        if t is not None:
            for s in pair:
                s.eval(t)
        torch.testing.assert_close(pair[0].logits.float(), pair[1].logits.float(), rtol=2e-2, atol=2e-2 * scale)
    assert g.prefill_replays >= 1 and g.replays >= len(TOKENS) - 5

    batches = [m.new_sessions(3) for m in (graphs, eager)]
    for batch in batches:
        for s, n in zip(batch, (3, 6, 9)):
            s.sync(TOKENS[:n])
        for step in range(4):
            decode_batch(batch, [7 + step, 40 + step, 90 + step])
    assert cuda_graphs.bucket_for(3) in g.captured_buckets
    for a, b in zip(*batches):
        torch.testing.assert_close(a.logits.float(), b.logits.float(), rtol=2e-2, atol=2e-2 * scale)

    s = graphs.new_session()
    s.sync(TOKENS[:5])
    out = list(generate(s, GREEDY, 10))
    check = graphs.new_session()
    check.sync(TOKENS[:5])
    for t in out:
        row = check.logits.float().cpu().numpy().copy()
        row[list(graphs.eos_ids)] = -np.inf  # GREEDY masks the end-of-generation ids
        assert int(row.argmax()) == t
        check.eval(t)
