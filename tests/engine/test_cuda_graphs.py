"""Graph-replayed CUDA decoding against eager CUDA decoding and the CPU float32 path
(engine.cuda_graphs, engine.cuda_attention, engine.device_sampling; skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

import engine
from engine import SamplingParams, cuda_graphs, generate
from engine.batch import BatchScheduler, GenRequest, decode_batch
from run_ahead_scripts import assert_same, dropping_ops, run_script

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOKENS = [5, 77, 130, 2, 250, 9, 9, 41, 200, 13, 66, 101, 3, 17, 140, 22]
GREEDY = SamplingParams(argmax_ignoring_eos=True)


def cuda_pair(path: str, **kw) -> tuple[engine.Model, engine.Model]:
    """The same GGUF loaded twice on CUDA: decoding through graphs, and eagerly."""
    graphs = engine.load_model(path, device="cuda", **kw)
    eager = engine.load_model(path, device="cuda", **kw)
    assert graphs.net.decode_graphs is not None, "graph decoding is not available here"
    eager.net.decode_graphs = None
    return graphs, eager


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("turned", [False, True], ids=["turned-first", "turned-in-kernel"])
def test_attention_kernel_matches_torch_over_pool_slots_and_standalone_caches(dtype, turned):
    """Rows storing their own keys and values (decoding); with `turned` the kernel turns q and k
    by a rope table itself (the keys it stores to one unit of the cache's precision of torch's)."""
    from engine import cuda_attention as ca

    torch.manual_seed(0)
    H, Hkv, D, n_ctx, n_layer = 9, 3, 64, 600, 2
    pool = torch.randn(n_layer, 2, 3, Hkv, 640, D, device="cuda").to(dtype)
    solo = torch.randn(n_layer, 2, Hkv, 512, D, device="cuda").to(dtype)
    caches = [pool[:, :, 2], solo, pool[:, :, 0], solo.new_zeros(n_layer, 2, Hkv, 1, D)]
    pos = [5, 511, 599, 0]
    qkv = torch.randn(len(caches), (H + 2 * Hkv) * D, device="cuda")
    rows = torch.tensor([[0, p, (c.data_ptr() - solo.data_ptr()) // c.element_size(),
                          c.stride(0), c.stride(1), c.stride(2)] for c, p in zip(caches, pos)], device="cuda")
    work = ca.Workspace(len(caches), H, D, n_ctx, Hkv, torch.device("cuda"))
    table = torch.polar(torch.ones(n_ctx, D // 2), torch.rand(n_ctx, D // 2) * 6.3).cuda() if turned else None
    expect = [c.clone() for c in caches]
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]  # where probabilities round
    for layer in range(n_layer):
        got = ca.decode_attention(qkv, rows, layer, solo, work, H, Hkv, D,
                                  rope=None if table is None else ca.rope_pairs(table)).clone()
        ref = ca.reference_attention(qkv, [c[layer] for c in expect], pos, H, Hkv, D, table)
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    for c, e, p in zip(caches, expect, pos):
        if turned:  # the turned keys may part from torch's in their last bit before rounding
            torch.testing.assert_close(c, e, rtol=tol, atol=tol)
            others = torch.arange(c.shape[3], device="cuda") != p
            assert torch.equal(c[:, :, :, others], e[:, :, :, others])  # nothing but the new rows moved
        else:
            assert torch.equal(c, e)  # the new keys and values landed where torch put them, nothing else moved


@pytest.mark.parametrize("length", [2, 16, 40, 64, 100, 256, 300])
def test_graph_prefill_equals_eager_prefill(tiny_gguf, length):
    """Prompts of up to PREFILL_GRAPH_TOKENS tokens prefill as graph replays (64 rows each),
    longer ones eagerly: the same logits within the eager/graph bound, the same cache, and the
    greedy continuation equal.  (A sync prefills all but the last token, which is a decoding
    step.)"""
    from engine.cuda_graphs import PREFILL_GRAPH_TOKENS

    graphs, eager = cuda_pair(tiny_gguf("llama", "Q4_1", n_ctx=512))  # room for the longest prompt
    prompt = (TOKENS * 20)[:length]
    out = []
    for m in (graphs, eager):
        s = m.new_session()
        before = graphs.net.decode_graphs.prefill_replays
        s.sync(prompt)
        replays = graphs.net.decode_graphs.prefill_replays - before
        out.append((s.logits.clone(), s.cache.kv[:, :, :, :length].float().clone(), list(generate(s, GREEDY, 8))))
        if m is graphs:
            body = length - 1
            assert replays == (-(-body // 64) if body <= PREFILL_GRAPH_TOKENS else 0)
    scale = float(out[1][0].abs().max())
    torch.testing.assert_close(out[0][0], out[1][0], rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=2e-2, atol=2e-2 * float(out[1][1].abs().max()))
    assert out[0][2] == out[1][2]


def test_graph_prefill_extends_a_session_and_scores_every_position(tiny_gguf):
    """A prefill after a cached prefix (start > 0) and one asking for every position's logits
    (prompt scoring) through the graphs, against the eager forward pass."""
    graphs, eager = cuda_pair(tiny_gguf("qwen3", "Q4_K"))
    grown = graphs.new_session()
    grown.sync(TOKENS[:5])
    grown.sync(TOKENS)
    whole = eager.new_session()
    whole.sync(TOKENS)
    scale = float(whole.logits.abs().max())
    torch.testing.assert_close(grown.logits, whole.logits, rtol=2e-2, atol=2e-2 * scale)
    ids = torch.tensor((TOKENS * 5)[:70], device="cuda")
    rows = [m.net.forward(ids, 0, m.new_session().cache, logits="all") for m in (graphs, eager)]
    assert rows[0].shape == rows[1].shape == (70, graphs.n_vocab)
    torch.testing.assert_close(rows[0], rows[1], rtol=2e-2, atol=2e-2 * float(rows[1].abs().max()))
    # A chunk asked for no logits returns none, as the eager pass does.
    assert graphs.net.forward(ids[:20], 0, graphs.new_session().cache, logits="none") is None


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("llama", "Q4_K"), ("qwen2", "Q4_0"),
                                        ("qwen3", "Q8_0"), ("llama", "F16")])
@pytest.mark.parametrize("rope_in_attention", [False, True], ids=["rope-before", "rope-in-attention"])
def test_graph_greedy_tokens_equal_eager(tiny_gguf, monkeypatch, arch, qtype, rope_in_attention):
    """Greedy tokens and logits of graph decoding (its prefill replays included) against eager
    decoding; with `rope_in_attention` the graphs' attention turns q and k itself
    (`cuda_attention.ROPE_IN_ATTENTION`, read when a graph is captured)."""
    from engine import cuda_attention
    monkeypatch.setattr(cuda_attention, "ROPE_IN_ATTENTION", rope_in_attention)
    graphs, eager = cuda_pair(tiny_gguf(arch, qtype))
    out = []
    for m in (graphs, eager):
        s = m.new_session()
        s.sync(TOKENS)
        out.append((list(generate(s, GREEDY, 40)), s.logits))
    assert out[0][0] == out[1][0]
    scale = float(out[1][1].abs().max())
    torch.testing.assert_close(out[0][1], out[1][1], rtol=2e-2, atol=2e-2 * scale)
    assert graphs.net.decode_graphs.replays >= 40


def test_graph_batches_equal_eager_batches_with_padding_and_scattered_slots(tiny_gguf):
    graphs, eager = cuda_pair(tiny_gguf("llama", "Q4_1"))
    prompts = [TOKENS[:3], TOKENS[:9], TOKENS, TOKENS[4:11], TOKENS[2:14]]
    streams = []
    for m in (graphs, eager):
        pool = m.new_sessions(len(prompts))
        for s, p in zip(pool, prompts):
            s.sync(p)
        made = [[] for _ in pool]
        for step in range(12):
            rows = list(range(len(pool))) if step % 3 else [0, 2, 4]  # 5 rows (a padded bucket), or 3 scattered
            toks = [int(pool[i].raw_logits.argmax()) for i in rows]
            for i, t in zip(rows, toks):
                made[i].append(t)
            decode_batch([pool[i] for i in rows], toks)
        streams.append(made)
    assert streams[0] == streams[1]
    assert cuda_graphs.bucket_for(5) > 5  # the 5-row steps replay a graph with a padding row
    assert graphs.net.decode_graphs.captured_buckets >= {1, cuda_graphs.bucket_for(3), cuda_graphs.bucket_for(5)}


def test_graph_session_decode_matches_its_own_prefill(tiny_gguf):
    graphs, _ = cuda_pair(tiny_gguf("qwen2", "Q4_1"))
    s = graphs.new_session()
    s.sync(TOKENS[:6])
    for t in TOKENS[6:]:
        s.eval(t)
    full = graphs.new_session()
    full.sync(TOKENS)
    torch.testing.assert_close(s.logits, full.logits, rtol=2e-2, atol=2e-2 * float(full.logits.abs().max()))


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("qwen3", "Q4_K")])
def test_swiglu_ending_the_gate_up_products_changes_no_bit(tiny_gguf, monkeypatch, arch, qtype):
    """gate/up matrices held in pairs, their products ending in the SwiGLU
    (`cuda_int4.SWIGLU_IN_PRODUCTS`), against the product and then the SwiGLU kernel: the same
    logits bit for bit, through graphs (one row and a batch of five, a padded graph) and
    eagerly (torch's SwiGLU of the products put back in [gate; up] order)."""
    from engine import cuda_int4
    from engine.weights import PairedInt4Linear
    path = tiny_gguf(arch, qtype)
    logits = {}
    for paired in (True, False):
        monkeypatch.setattr(cuda_int4, "SWIGLU_IN_PRODUCTS", paired)
        graphs, eager = cuda_pair(path)
        assert isinstance(graphs.net.blocks[0].w_gate_up, PairedInt4Linear) == paired
        got = []
        for m in (graphs, eager):
            s = m.new_session()
            s.sync(TOKENS)
            for _ in range(8):
                got.append(s.logits.clone())
                s.eval(int(s.logits.argmax()))
            pool = m.new_sessions(5)
            for i, p in enumerate(pool):
                p.sync(TOKENS[i: i + 6])
            for _ in range(4):
                decode_batch(pool, [int(p.raw_logits.argmax()) for p in pool])
                got.extend(p.logits.clone() for p in pool)
        logits[paired] = got
    assert all(torch.equal(a, b) for a, b in zip(logits[True], logits[False], strict=True))


def _teacher_forced(m: engine.Model, ids: list[int]) -> torch.Tensor:
    s = m.new_session()
    s.sync(ids[:1])
    rows = [s.logits]
    for t in ids[1:-1]:
        s.eval(t)
        rows.append(s.logits)
    return torch.stack(rows)


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("qwen3", "Q4_K")])
def test_graph_teacher_forced_agrees_with_cpu_float32(tiny_gguf, arch, qtype):
    path = tiny_gguf(arch, qtype)
    ids = (TOKENS * 8)[:96]
    cpu = engine.load_model(path, weights="float32")
    ref = cpu.net.forward(torch.tensor(ids[:-1]), 0, cpu.new_session().cache, logits="all")
    graphs, eager = cuda_pair(path)
    stats = {}
    for name, m in (("graphs", graphs), ("eager", eager)):
        got = _teacher_forced(m, ids)
        top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        kl = torch.sum(torch.softmax(ref, -1) * (torch.log_softmax(ref, -1) - torch.log_softmax(got, -1)), -1)
        stats[name] = (top1, float(kl.mean()))
    print(f"{arch} {qtype} top-1 / mean KL vs CPU float32: {stats}")
    assert stats["graphs"][0] >= 0.9
    assert stats["graphs"][0] >= stats["eager"][0] - 0.03
    assert stats["graphs"][1] <= max(2 * stats["eager"][1], 1e-3)


def _int4_weights(m: engine.Model):
    return [lin.cuda_weight for blk in m.net.blocks for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down)
            if getattr(lin, "cuda_weight", None) is not None]


def _random_int4(n: int, k: int, seed: int, big: bool = False):
    import numpy as np

    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    minimum = (-8 * scale + rng.standard_normal(scale.shape) * 1e-3).astype(np.float16).astype(np.float32)
    if big:  # values float16 cannot hold: the pairs are kept in float32
        scale[0, 0], minimum[0, 0] = 1e5, -1e6
    dense = (q.reshape(n, -1, 32) * scale[..., None] + minimum[..., None]).reshape(n, k)
    return q, scale, minimum, torch.from_numpy(dense).double()


@pytest.mark.parametrize("n,k,big", [(960, 576, False), (3072, 2048, False), (576, 1536, True),
                                     (576, 576, False), (2048, 8192, False)])
def test_int4_gemm_sums_exact_group_products(n, k, big):
    """Against float64 over the same bfloat16-rounded activations: only float32 summation
    separates them, at every row count of decoding batches and beyond (split and unsplit)."""
    from engine.cuda_int4 import Int4Weight

    q, scale, minimum, dense = _random_int4(n, k, seed=n, big=big)
    w = Int4Weight(q, scale, minimum, torch.device("cuda"))
    assert w.pairs.dtype == (torch.float32 if big else torch.float16)
    torch.manual_seed(0)
    for rows in (1, 3, 16, 17, 64, 65, 200):
        x = torch.randn(rows, k, device="cuda")
        want = x.bfloat16().double().cpu() @ dense.T
        got = w(x).double().cpu()
        assert got.dtype == torch.float64 and got.shape == (rows, n)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
        assert torch.equal(w(x.bfloat16()), w(x))  # the kernel rounds float32 input itself


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (3072, 2048)])
def test_int4_products_added_into_an_output_equal_adding_the_product(n, k):
    """`into` (the residual stream) is added in the product's last kernel: the same one
    float32 addition as adding the product afterwards, for one row, the split GEMM and
    (3072 x 2048 from 512 rows) the cuBLAS path."""
    from engine.cuda_int4 import Int4Weight

    q, scale, minimum, _ = _random_int4(n, k, seed=k)
    w = Int4Weight(q, scale, minimum, torch.device("cuda"))
    torch.manual_seed(1)
    for rows in (1, 3, 64, 600):
        x, r = torch.randn(rows, k, device="cuda"), torch.randn(rows, n, device="cuda")
        into = r.clone()
        assert w(x, into=into) is into
        assert torch.equal(into, r + w(x))
        strided = torch.randn(rows, 2 * n, device="cuda")[:, :n]  # not contiguous: added afterwards
        want = strided + w(x)
        w(x, into=strided)
        assert torch.equal(strided, want)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_and_swiglu_match_torch(out_dtype):
    import torch.nn.functional as F

    from engine import cuda_elementwise as ce

    torch.manual_seed(0)
    for rows, n, n_ff in ((1, 576, 1536), (64, 2048, 8192), (3, 100, 3000)):
        x, w = torch.randn(rows, n, device="cuda"), torch.randn(n, device="cuda")
        want = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w).to(out_dtype)
        got = ce.rms_norm(x, w, 1e-5, out_dtype)
        assert got.dtype == out_dtype
        torch.testing.assert_close(got, want, rtol=1e-5 if out_dtype == torch.float32 else 1e-2, atol=1e-5)
        for dtype in (torch.float32, torch.bfloat16):  # the outputs of int4 and of dense products
            gate_up = (torch.randn(rows, 2 * n_ff, device="cuda") * 4).to(dtype)
            want = (F.silu(gate_up[:, :n_ff]) * gate_up[:, n_ff:]).to(out_dtype)
            got = ce.swiglu(gate_up, out_dtype)
            assert got.dtype == out_dtype and got.shape == (rows, n_ff)
            assert torch.equal(got, want)  # torch's own arithmetic: graph and eager steps agree here


@pytest.mark.parametrize("n_vocab", [49152, 128256, 5000])
def test_greedy_pair_kernel_matches_torch_argmax(n_vocab):
    from engine import cuda_elementwise as ce

    torch.manual_seed(n_vocab)
    rows = torch.randn(5, n_vocab, device="cuda")
    rows[0, 17] = rows[0, 4097] = rows[0, n_vocab - 1] = 50.0  # a tie across chunks: the lowest id wins
    rows[1, :] = float("-inf")  # nothing finite: id 0, like torch
    rows[2, 4096] = 60.0
    for eos in ([17, 4096, 3], [n_vocab - 1], []):
        index = torch.tensor(eos, dtype=torch.long, device="cuda") if eos else None
        masked = rows if index is None else rows.index_fill(1, index, float("-inf"))
        want = torch.stack([rows.argmax(-1), masked.argmax(-1)], dim=1)
        assert torch.equal(ce.greedy_pair(rows, index), want)


def test_int4_gemm_rows_of_a_batch_match_rows_computed_alone():
    from engine.cuda_int4 import Int4Weight

    q, scale, minimum, _ = _random_int4(2048, 2048, seed=3)
    w = Int4Weight(q, scale, minimum, torch.device("cuda"))
    x = torch.randn(64, 2048, device="cuda")
    batch = w(x)
    for rows in (1, 5, 32):
        torch.testing.assert_close(w(x[:rows]), batch[:rows], rtol=1e-6, atol=1e-6 * float(batch.abs().max()))


@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (2048, 8192)])
def test_few_rows_as_one_row_products_equal_each_row_alone(n, k):
    """Up to `gemv_rows` rows run as one-row products in one launch: each row's bits are those of
    the row alone, split or not (2048 x 8192 is split), and added into an output alike."""
    from engine.cuda_int4 import Int4Weight, gemv_rows_for

    q, scale, minimum, dense = _random_int4(n, k, seed=n + k)
    w = Int4Weight(q, scale, minimum, torch.device("cuda"))
    assert w.gemv_rows == gemv_rows_for(n, k) >= 1
    w.gemv_rows = 8  # also the matrices that take the GEMM from 2 rows on
    torch.manual_seed(2)
    x = torch.randn(8, k, device="cuda")
    alone = torch.cat([w(x[i:i + 1]) for i in range(8)])
    for rows in (2, 5, 8):
        assert torch.equal(w(x[:rows]), alone[:rows])
        r = torch.randn(rows, n, device="cuda")
        into = r.clone()
        w(x[:rows], into=into)
        assert torch.equal(into, r + alone[:rows])
    want = x.bfloat16().double().cpu() @ dense.T
    torch.testing.assert_close(alone.double().cpu(), want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q4_0"])
def test_dequantized_cublas_path_matches_the_int4_gemm(tiny_gguf, qtype):
    m = engine.load_model(tiny_gguf("qwen2", qtype), device="cuda")
    weights = _int4_weights(m)
    assert weights and all(w.gemm_rows > 16 for w in weights)  # tiny matrices: never worth it
    torch.manual_seed(0)
    for w in weights:
        for rows in (1, 7, 64):
            x = torch.randn(rows, w.k, device="cuda")
            want = w(x)
            w.gemm_rows = 1
            got = w(x)
            w.gemm_rows = 1 << 30
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    ids = torch.tensor(TOKENS * 4, device="cuda")
    want = m.net.forward(ids, 0, m.new_session().cache, logits="all")
    for w in weights:
        w.gemm_rows = 1
    got = m.net.forward(ids, 0, m.new_session().cache, logits="all")
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_device_logits_cross_only_when_read_and_sample_on_the_device(tiny_gguf):
    from engine.device_sampling import DeviceLogits

    graphs, _ = cuda_pair(tiny_gguf("llama", "Q4_1"))
    s = graphs.new_session()
    s.sync(TOKENS)
    raw = s.raw_logits
    assert isinstance(raw, DeviceLogits) and raw.device.type == "cuda"
    host = s.logits
    assert host.device.type == "cpu" and torch.equal(host, raw.row.cpu())
    assert raw.greedy == int(host.argmax())
    hot = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3)
    a = [engine.Sampler(hot, graphs.eos_ids)(raw) for _ in range(1)]
    draws = [engine.Sampler(hot, graphs.eos_ids)(raw) for _ in range(3)]
    assert draws == a * 3  # the same seed, the same token
    allowed = set(torch.topk(host, 20).indices.tolist())
    sampler = engine.Sampler(SamplingParams(temperature=1.5, top_k=20, seed=1), graphs.eos_ids)
    assert {sampler(raw) for _ in range(50)} <= allowed
    assert engine.Sampler(SamplingParams(temperature=1.0, top_k=1, seed=0))(raw) == raw.greedy


# --- run-ahead: greedy sessions launch the next steps before the caller evaluates them ---

def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


@pytest.mark.parametrize("sampling", [SamplingParams(argmax_ignoring_eos=True), SamplingParams(temperature=0.0)])
def test_run_ahead_decodes_bitwise_like_stepping_across_cache_growth(tiny_gguf, monkeypatch, sampling):
    m = engine.load_model(tiny_gguf("llama", "Q4_1", n_ctx=1024), device="cuda")
    prompt = _prompt(250, 1)  # the cache's first 256 positions fill up while steps run ahead

    def ops(s, record):
        s.sync(prompt)
        for _ in range(24):
            t = s.sample(sampling)
            if t in m.eos_ids and not sampling.argmax_ignoring_eos:
                break
            s.eval(t)
            record(t)
    g = m.net.decode_graphs
    replays = g.replays
    ahead = run_script(m, monkeypatch, 2, ops)
    launched, replays = g.replays - replays, g.replays
    assert_same(ahead, run_script(m, monkeypatch, 0, ops))
    stepped = g.replays - replays
    records = len(ahead) - 1  # the last entry is the saved payload
    assert records >= 5 and stepped == 1 + records  # the sync's frontier step and one per record
    # The steps ran ahead: each sample launches its token's successor (the first sample its
    # token too), so the successor of the last token is launched and never adopted.
    if sampling.argmax_ignoring_eos:
        assert launched == stepped + 1
    else:  # unless an end token stopped the script, which launches nothing ahead of it
        assert stepped <= launched <= stepped + 1


def test_run_ahead_is_dropped_by_another_token_truncate_sync_restore_and_reset(tiny_gguf, monkeypatch):
    m = engine.load_model(tiny_gguf("qwen2", "Q4_0"), device="cuda")
    ops = dropping_ops(TOKENS)
    assert_same(run_script(m, monkeypatch, 2, ops), run_script(m, monkeypatch, 0, ops))


def test_run_ahead_of_interleaved_sessions_and_up_to_the_context_end(tiny_gguf, monkeypatch):
    m = engine.load_model(tiny_gguf("llama", "Q4_K"), device="cuda")  # n_ctx 256

    def ops(s, record):
        other = m.new_session()
        s.sync(_prompt(240, 2))
        other.sync(_prompt(30, 3))
        while s.n_past < m.n_ctx:
            s.eval(s.sample(GREEDY))
            other.eval(other.sample(GREEDY))  # four steps ahead in flight: the ring of host buffers wraps
            record(list(other.tokens))
    assert_same(run_script(m, monkeypatch, 2, ops), run_script(m, monkeypatch, 0, ops))


def test_sampling_and_generate_without_run_ahead_launch_nothing_extra(tiny_gguf, monkeypatch):
    m = engine.load_model(tiny_gguf("llama", "Q4_1"), device="cuda")
    s = m.new_session()
    s.sync(TOKENS)
    g = m.net.decode_graphs
    before = g.replays
    hot = SamplingParams(temperature=0.8, seed=3)
    for _ in range(5):
        s.eval(s.sample(hot))
    assert g.replays - before == 5  # a sampled token is never guessed ahead
    before = g.replays
    out = list(generate(s, GREEDY, 10))
    assert len(out) == 10 and g.replays - before <= 9 + 2


@pytest.mark.parametrize("invariant", [False, True], ids=["batched", "batch-invariant"])
def test_scheduler_run_ahead_decodes_bitwise_like_stepping(tiny_gguf, invariant):
    """BatchScheduler(run_ahead=True) against the same requests without it: greedy requests of
    different lengths on fewer slots than requests (rows finish and join, so launched steps are
    dropped as well as taken; the longest decodes alone at the end), one whose greedy choice
    may stop at an end-of-generation id (another greedy column: no step ahead while it
    decodes) and one sampled; the same tokens, and the sessions' last logits bitwise.
    Batch-invariant mode launches one-row steps ahead only."""
    m = engine.load_model(tiny_gguf("llama", "Q4_1", n_ctx=512), device="cuda", batch_invariant=invariant)

    def serve(run_ahead: bool):
        sched = BatchScheduler(m, 3, check_memory=False, run_ahead=run_ahead)
        reqs = [GenRequest(_prompt(20 + 7 * i, i), GREEDY, n) for i, n in enumerate((12, 21, 30, 60))]
        reqs.append(GenRequest(_prompt(15, 8), SamplingParams(temperature=0.0), 14))
        reqs.append(GenRequest(_prompt(11, 9), SamplingParams(temperature=0.9, seed=4), 10))
        for r in reqs:
            sched.submit(r)
        sched.run()
        return [r.output for r in reqs], [sched.session(i).raw_logits.row.clone() for i in range(3)], sched.adopted

    ahead, ahead_logits, adopted = serve(True)
    stepped, stepped_logits, none = serve(False)
    assert ahead == stepped and none == 0 and adopted >= 10
    for a, b in zip(ahead_logits, stepped_logits):
        assert torch.equal(a, b)
