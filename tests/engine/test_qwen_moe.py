"""The qwen3moe/qwen2moe family on random-weight GGUFs (tests/engine/moe_models.py): the forward
pass against a plain float64 reference in F32 and a packed type (Q4_0, whose 3-D expert tensors
stay 4-bit), the routing rule and its metadata switch, only routed experts running, decoding
against prefill and batched against alone bit for bit on CPU, the weight accounting, agreement
with transformers' implementations built from the same weights, and the CUDA path (gpu-marked,
skipped without a device)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import engine
from engine import SamplingParams, generate
from engine.batch import decode_batch
from engine import cuda_moe
from engine.models import qwen_moe
from engine.models.qwen_moe import route
from gguf_files import file_maker
from moe_models import MoeSpec, read_weights, reference_logits, write_random_moe

TOKENS = [5, 77, 130, 2, 250, 9, 9, 41, 200, 13, 66, 101, 3]
ARCHS = ["qwen3moe", "qwen2moe"]
# Seeds whose routing decisions on TOKENS all have a clear margin, so that the packed path's
# rounding (bfloat16 activations) cannot flip one and the comparison stays about the arithmetic.
PACKED_SEEDS = {"qwen3moe": 7, "qwen2moe": 4}
GREEDY = SamplingParams(argmax_ignoring_eos=True)


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """moe_gguf(arch, qtype, **spec) -> path of a cached random MoE model."""
    return file_maker(tmp_path_factory.mktemp("moe"),
                      lambda path, arch, qtype, kw: write_random_moe(path, MoeSpec(arch=arch, qtype=qtype, **kw)),
                      kind="qwen3moe", qtype="F32")


def all_logits(m, tokens: list[int]) -> np.ndarray:
    ids = torch.tensor(tokens, device=m.device)
    return m.net.forward(ids, 0, m.new_session().cache, logits="all").double().cpu().numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_forward_matches_float64_reference(moe_gguf, arch):
    path = moe_gguf(arch)
    ref = reference_logits(path, TOKENS).logits
    got = all_logits(engine.load_model(path, weights="float32"), TOKENS)
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_forward_matches_float64_reference(moe_gguf, arch, qtype):
    path = moe_gguf(arch, qtype, seed=PACKED_SEEDS[arch])
    ref = reference_logits(path, TOKENS)
    assert min(ref.margins) > 2e-3  # the precondition the seeds were chosen for
    scale = np.abs(ref.logits).max()
    exact = all_logits(engine.load_model(path, weights="float32"), TOKENS)
    assert np.abs(exact - ref.logits).max() <= 2e-5 * scale  # the 4-bit weights read back exactly
    got = all_logits(engine.load_model(path), TOKENS)
    # float16 weights (F32) or 4-bit ones with bfloat16 activations, and a float16 cache.
    assert np.abs(got - ref.logits).max() <= 2e-2 * scale
    assert (got.argmax(-1) == ref.logits.argmax(-1)).mean() >= 0.75


def test_packed_experts_stay_packed(moe_gguf):
    m = engine.load_model(moe_gguf("qwen3moe", "Q4_0", seed=PACKED_SEEDS["qwen3moe"]))
    blk = m.net.blocks[0]
    assert len(blk.experts) == 8
    assert type(blk.experts[3].gate_up).__name__ == "Int4Linear"
    assert (blk.experts[3].gate_up.out_features, blk.experts[3].gate_up.in_features) == (128, 64)
    assert (blk.experts[3].down.out_features, blk.experts[3].down.in_features) == (64, 64)


def test_renormalisation_follows_the_family_and_the_metadata(moe_gguf):
    """qwen3moe renormalises its top-k weights, qwen2moe does not; expert_weights_norm wins."""
    assert engine.load_model(moe_gguf("qwen3moe")).net.renormalise
    assert not engine.load_model(moe_gguf("qwen2moe")).net.renormalise
    told = moe_gguf("qwen3moe", weights_norm=False)
    m = engine.load_model(told, weights="float32")
    assert not m.net.renormalise and m.config.expert_weights_norm is False
    ref = reference_logits(told, TOKENS).logits
    got = all_logits(m, TOKENS)
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()
    default = all_logits(engine.load_model(moe_gguf("qwen3moe"), weights="float32"), TOKENS)
    assert np.abs(default - got).max() > 1e-3  # the switch changed the numbers


def test_route_picks_the_most_probable_experts():
    scores = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    ids, w = route(scores, 2, renormalise=False)
    probs = torch.softmax(scores, -1)
    assert ids.tolist() == [[1, 2], [0, 1]]  # a tie goes to the lower index
    torch.testing.assert_close(w, probs.gather(1, ids))
    ids, w = route(scores, 2, renormalise=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))


def test_config_reads_the_expert_keys(moe_gguf):
    cfg = engine.load_model(moe_gguf("qwen2moe")).config
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp) == (8, 2, 64, 128)
    assert cfg.qkv_bias and not cfg.qk_norm and cfg.rope_style == "neox"
    cfg = engine.load_model(moe_gguf("qwen3moe")).config
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.n_ff_shexp == 0 and cfg.expert_weights_norm is None


class Counting:
    """An expert that records how many rows each of its calls got."""

    def __init__(self, inner, calls: list):
        self.inner, self.calls = inner, calls

    def __call__(self, h):
        self.calls.append(h.shape[0])
        return self.inner(h)

    def add_to(self, out, h, scale=None):  # the CPU path's way of running an expert
        self.calls.append(h.shape[0])
        self.inner.add_to(out, h, scale)


def test_only_the_routed_experts_run_once_each(moe_gguf):
    m = engine.load_model(moe_gguf("qwen3moe"), weights="float32")
    blk = m.net.blocks[1]
    calls: dict[int, list] = {e: [] for e in range(len(blk.experts))}
    blk.experts = [Counting(x, calls[e]) for e, x in enumerate(blk.experts)]
    cache = m.new_session().cache
    m.net.forward(torch.tensor(TOKENS[:1]), 0, cache)
    assert sum(len(c) for c in calls.values()) == 2  # one token: its two experts, one row each
    assert all(c in ([], [1]) for c in calls.values())
    for c in calls.values():
        c.clear()
    m.net.forward(torch.tensor(TOKENS[1:]), 1, cache)  # 12 rows: each routed expert once, over all its rows
    assert all(len(c) <= 1 for c in calls.values())
    assert sum(sum(c) for c in calls.values()) == 2 * (len(TOKENS) - 1)


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_equals_prefill_exactly(moe_gguf, arch, qtype):
    m = engine.load_model(moe_gguf(arch, qtype))
    full = m.net.forward(torch.tensor(TOKENS), 0, m.new_session().cache, logits="all")
    s = m.new_session()
    s.sync(TOKENS[:3])
    rows = [s.logits]
    for t in TOKENS[3:]:
        s.eval(t)
        rows.append(s.logits)
    assert torch.equal(torch.stack(rows), full[2:])


@pytest.mark.parametrize("pooled", [False, True], ids=["own-caches", "pooled"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decoding_equals_alone(moe_gguf, arch, pooled):
    """Rows routed to different experts, decoded together, each bit for bit as alone."""
    m = engine.load_model(moe_gguf(arch, "Q4_0"))
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


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_bytes_count_every_expert(moe_gguf, arch):
    """In float32 every tensor of the file is held once, as float32: the accounting is the file's
    element count times four (experts, routers and the shared expert included)."""
    path = moe_gguf(arch)
    _, W = read_weights(path)
    m = engine.load_model(path, weights="float32")
    assert m.net.weight_bytes == 4 * sum(w.size for w in W.values())
    packed = engine.load_model(moe_gguf(arch, "Q4_0")).net
    experts = sum(e.nbytes for blk in packed.blocks for e in blk.experts)
    assert 0 < experts < packed.weight_bytes


def test_sessions_generate(moe_gguf):
    m = engine.load_model(moe_gguf("qwen2moe", "Q4_0"), ctx=64)
    s = m.new_session()
    s.sync(m.prompt_ids(TOKENS))
    assert len(list(generate(s, GREEDY, 20))) == 20


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.gpu
@needs_cuda
def test_cuda_forward_matches_float64_reference(moe_gguf, arch, qtype):
    path = moe_gguf(arch, qtype, seed=PACKED_SEEDS[arch])
    ref = reference_logits(path, TOKENS).logits
    exact = all_logits(engine.load_model(path, device="cuda", weights="float32", kv_type="f32"), TOKENS)
    assert np.abs(exact - ref).max() <= 1e-3 * np.abs(ref).max()
    got = all_logits(engine.load_model(path, device="cuda"), TOKENS)
    assert np.abs(got - ref).max() <= 5e-2 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.gpu
@needs_cuda
def test_cuda_decoding_and_batches_agree_with_prefill(moe_gguf, arch):
    m = engine.load_model(moe_gguf(arch, "Q4_0", seed=PACKED_SEEDS[arch]), device="cuda")
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


def per_expert(path: str, monkeypatch) -> engine.Model:
    """The model on CUDA with each expert its own Linear (the path that reads the routing back)."""
    with monkeypatch.context() as mp:
        mp.setattr(qwen_moe, "stacks_experts", lambda device, fmt: False)
        return engine.load_model(path, device="cuda")


@pytest.mark.parametrize("qtype", ["Q4_0", "F32"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.gpu
@needs_cuda
def test_cuda_stacked_experts_agree_with_the_per_expert_path(moe_gguf, arch, qtype, monkeypatch):
    """engine.cuda_moe's kernels (4-bit, or the bfloat16 stack of an F32 file) against each expert
    run as its own Linear, in a prefill chunk (the grouped GEMM) and row by row (the indexed
    products); the stacked path's bytes are the experts' own."""
    path = moe_gguf(arch, qtype, seed=PACKED_SEEDS[arch])
    m = engine.load_model(path, device="cuda")
    assert isinstance(m.net.blocks[0].experts, cuda_moe.StackedExperts) and m.net.captures_graphs
    old = per_expert(path, monkeypatch)
    assert not old.net.captures_graphs and old.net.decode_graphs is None
    if qtype == "Q4_0":
        assert m.net.weight_bytes == old.net.weight_bytes
    want = all_logits(old, TOKENS)
    scale = np.abs(want).max()
    assert np.abs(all_logits(m, TOKENS) - want).max() <= 1e-2 * scale
    ref = reference_logits(path, TOKENS).logits
    s = m.new_session()
    s.sync(TOKENS[:1])
    rows = [s.logits.float().cpu().numpy()]
    for t in TOKENS[1:]:
        s.eval(t)
        rows.append(s.logits.float().cpu().numpy())
    assert np.abs(np.stack(rows) - ref).max() <= 5e-2 * np.abs(ref).max()
    assert m.net.decode_graphs.replays > 0  # decoded through captured graphs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.gpu
@needs_cuda
def test_cuda_moe_graphs_equal_eager(moe_gguf, arch):
    """The stacked FFN replayed from a captured graph gives the eager call's bits, at 1 row and at
    a wide batch; whole graph-decoded steps agree with eager ones within the CUDA bound (their
    attention and norms are other kernels)."""
    m = engine.load_model(moe_gguf(arch, "Q4_0", seed=PACKED_SEEDS[arch]), device="cuda")
    torch.manual_seed(0)
    for rows in (1, 4, 24):
        x0 = torch.randn(rows, m.config.n_embd, device="cuda")
        eager = x0.clone()
        for blk in m.net.blocks:
            m.net.feed_forward_stacked(blk, eager)
        x = x0.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m.net.feed_forward_stacked(m.net.blocks[0], x0.clone())  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for blk in m.net.blocks:
                m.net.feed_forward_stacked(blk, x)
        x.copy_(x0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, eager)
    eager_model = engine.load_model(moe_gguf(arch, "Q4_0", seed=PACKED_SEEDS[arch]), device="cuda")
    eager_model.net.decode_graphs = None
    graph_s, eager_s = m.new_session(), eager_model.new_session()
    for s in (graph_s, eager_s):
        s.sync(TOKENS[:3])
    for t in TOKENS[3:]:  # teacher-forced: TOKENS' routing margins are the seeds' (see PACKED_SEEDS)
        graph_s.eval(t)
        eager_s.eval(t)
        scale = float(eager_s.logits.abs().max())
        torch.testing.assert_close(graph_s.logits, eager_s.logits, rtol=2e-2, atol=2e-2 * scale)
    assert m.net.decode_graphs.replays >= len(TOKENS) - 3 and m.net.decode_graphs.enabled


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.gpu
@needs_cuda
def test_cuda_moe_never_waits_for_the_host(moe_gguf, arch):
    """Routing and experts under torch's sync debug mode set to raise: no read-back, at decoding
    widths and a prefill chunk's."""
    m = engine.load_model(moe_gguf(arch, "Q4_0", seed=PACKED_SEEDS[arch]), device="cuda")
    xs = [torch.randn(rows, m.config.n_embd, device="cuda") for rows in (1, 3, 40)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs:
            for blk in m.net.blocks:
                m.net.feed_forward_stacked(blk, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(x).all() for x in xs)


def transformers_logits(path: str, spec: MoeSpec, tokens: list[int]) -> np.ndarray:
    """Logits of transformers' own Qwen3MoE / Qwen2MoE, float64, built from the GGUF's weights
    (llama.cpp's qwen converter keeps the checkpoint's q/k layout, so no permutation applies)."""
    transformers = pytest.importorskip("transformers")
    _, W = read_weights(path)
    kw = dict(vocab_size=W["token_embd.weight"].shape[0], hidden_size=spec.n_embd, intermediate_size=spec.n_ff,
              moe_intermediate_size=spec.n_ff_exp, num_hidden_layers=spec.n_layer,
              num_attention_heads=spec.n_head, num_key_value_heads=spec.n_head_kv, head_dim=spec.head_dim,
              num_experts=spec.n_expert, num_experts_per_tok=spec.n_expert_used, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": spec.rope_base}, tie_word_embeddings=False,
              max_position_embeddings=spec.n_ctx, attn_implementation="eager", experts_implementation="eager")
    if spec.arch == "qwen3moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(norm_topk_prob=True, **kw))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            norm_topk_prob=False, shared_expert_intermediate_size=spec.n_ff_shexp, **kw))

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    sd = {"model.embed_tokens.weight": t(W["token_embd.weight"]), "lm_head.weight": t(W["output.weight"]),
          "model.norm.weight": t(W["output_norm.weight"])}
    for i in range(spec.n_layer):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
            sd[h + f"self_attn.{theirs}.weight"] = t(W[b + f"attn_{ours}.weight"])
            if b + f"attn_{ours}.bias" in W:
                sd[h + f"self_attn.{theirs}.bias"] = t(W[b + f"attn_{ours}.bias"])
        if spec.arch == "qwen3moe":
            sd[h + "self_attn.q_norm.weight"] = t(W[b + "attn_q_norm.weight"])
            sd[h + "self_attn.k_norm.weight"] = t(W[b + "attn_k_norm.weight"])
        sd[h + "input_layernorm.weight"] = t(W[b + "attn_norm.weight"])
        sd[h + "post_attention_layernorm.weight"] = t(W[b + "ffn_norm.weight"])
        sd[h + "mlp.gate.weight"] = t(W[b + "ffn_gate_inp.weight"])
        sd[h + "mlp.experts.gate_up_proj"] = t(np.concatenate([W[b + "ffn_gate_exps.weight"],
                                                               W[b + "ffn_up_exps.weight"]], axis=1))
        sd[h + "mlp.experts.down_proj"] = t(W[b + "ffn_down_exps.weight"])
        if spec.arch == "qwen2moe":
            for n in ("gate", "up", "down"):
                sd[h + f"mlp.shared_expert.{n}_proj.weight"] = t(W[b + f"ffn_{n}_shexp.weight"])
            sd[h + "mlp.shared_expert_gate.weight"] = t(W[b + "ffn_gate_inp_shexp.weight"][None])
    model = model.double().eval()
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_agrees_with_transformers(moe_gguf, arch):
    path = moe_gguf(arch)
    theirs = transformers_logits(path, MoeSpec(arch=arch), TOKENS)
    scale = np.abs(theirs).max()
    # transformers computes its rope frequencies in float32 even in a float64 model
    assert np.abs(reference_logits(path, TOKENS).logits - theirs).max() <= 1e-6 * scale
    got = all_logits(engine.load_model(path, weights="float32"), TOKENS)
    assert np.abs(got - theirs).max() <= 2e-5 * scale
