"""Speed and exactness of the engine's CUDA paths on random models of two real shapes.

    python ds4bench/cuda_paths.py --label after --models /tmp/models --out DIR [--exactness]

Shapes: SmolLM2-135M (30 layers, 576 wide, 9 heads / 3 kv heads, vocabulary 49152, Q4_1
layers, Q8_0 embedding) and a Llama-3.2-1B-like model (16 layers, 2048 wide, 32 / 8 heads,
vocabulary 128256, Q4_K layers, float16 tied embedding), written once into `--models` by
`engine.synthetic` with a filler vocabulary of the real size.  Per shape, after one untimed
repetition, the median of `--repeats`: prefill of 2048 tokens into a fresh session; greedy
decoding of 128 tokens at batch 1 after 16 and after 2048 tokens; `decode_batch` aggregate
tokens/s of N sessions of 128 tokens each, N in 1, 8, 64 (and 64 at 1024), 32 steps; kernels
and launch calls per decoded token and the GPU's busy share, from torch's profiler over 8
steps.  Where the engine has graph decoding, the eager CUDA path is measured beside it in the
same process (`--skip-eager` leaves it out; `--skip-speed` measures nothing).  `--exactness` (SmolLM2 shape) compares greedy tokens of graph and eager
decoding and teacher-forced logits of each CUDA path against the CPU float32 path (top-1
agreement, mean and max KL over 256 positions).

It imports only `engine`, so the same file measures an older checkout (run it with that
tree first on PYTHONPATH).  Results go to stdout as `RESULT` lines and to DIR/LABEL.json.
It is a measurement script, not part of `ds4-bench`'s commands.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import engine
from engine import SamplingParams, generate
from engine.batch import decode_batch

SHAPES = {
    "smollm2-135m": dict(arch="llama", n_layer=30, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3,
                         n_vocab=49152, rope_base=100000.0, qtype="Q4_1", embed_qtype="Q8_0"),
    "llama-3.2-1b": dict(arch="llama", n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8,
                         n_vocab=128256, rope_base=500000.0, qtype="Q4_K", embed_qtype="F16"),
}
CTX = 2304
GREEDY = SamplingParams(argmax_ignoring_eos=True)
RESULTS: dict[str, object] = {}


def emit(label: str, key: str, value: object) -> None:
    RESULTS[key] = value
    print(f"RESULT {label} {key} {value}", flush=True)


def vocab_gguf(path: str, n_vocab: int) -> str:
    """A tokenizer-only GGUF: engine.synthetic's byte-level tokenizer grown to `n_vocab` tokens."""
    from gguf import GGUFWriter

    from engine.synthetic import add_metadata, byte_level_tokenizer

    if os.path.exists(path):
        return path
    w = GGUFWriter(path + ".tmp", "llama")
    add_metadata(w, byte_level_tokenizer(n_vocab))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(path + ".tmp", path)
    return path


def model_file(models: str, name: str) -> str:
    from engine.synthetic import RandomModelSpec, write_random_gguf

    path = os.path.join(models, f"{name}.gguf")
    if not os.path.exists(path):
        shape = dict(SHAPES[name])
        vocab = vocab_gguf(os.path.join(models, f"vocab-{shape['n_vocab']}.gguf"), shape.pop("n_vocab"))
        t0 = time.perf_counter()
        # The embedded model's training context, so that graphs may be timed at its full length.
        write_random_gguf(path, RandomModelSpec(**shape, n_ctx=8192, tokenizer_from=vocab, name=name, seed=1))
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def ids_for(n: int, seed: int, n_vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_vocab - 3, (n,), generator=g).tolist()


def greedy_of(s) -> int:
    raw = s.raw_logits if hasattr(s, "raw_logits") else s.logits
    return int(raw.argmax())


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def median_rate(work: float, fn, repeats: int) -> tuple[float, float, float]:
    fn()  # untimed warm-up repetition
    rates = [work / timed(fn) for _ in range(repeats)]
    return statistics.median(rates), min(rates), max(rates)


def fmt(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.1f} [{r[1]:.1f}, {r[2]:.1f}]"


def bench_prefill(m, n_vocab: int, repeats: int) -> tuple[float, float, float]:
    ids = ids_for(2048, 0, n_vocab)
    return median_rate(2048, lambda: m.new_session().sync(ids), repeats)


def bench_decode(m, ctx: int, n_vocab: int, repeats: int) -> tuple[float, float, float]:
    s = m.new_session()
    ids = ids_for(ctx, 1, n_vocab)

    def run() -> None:
        s.sync(ids)
        list(generate(s, GREEDY, 128))
    s.sync(ids)
    rates = []
    run()
    for _ in range(repeats):
        s.sync(ids)
        rates.append(128 / timed(lambda: list(generate(s, GREEDY, 128))))
    return statistics.median(rates), min(rates), max(rates)


def batch_sessions(m, n: int, ctx: int, n_vocab: int) -> tuple[list, list[int]]:
    sessions = m.new_sessions(n)
    for i, s in enumerate(sessions):
        s.sync(ids_for(ctx, 100 + i, n_vocab))
    return sessions, [greedy_of(s) for s in sessions]


def run_steps(sessions, first: list[int], k: int) -> None:
    toks = list(first)
    for step in range(k):
        decode_batch(sessions, toks)
        if step + 1 < k:
            toks = [greedy_of(s) for s in sessions]


def bench_batch(m, n: int, ctx: int, n_vocab: int, repeats: int) -> tuple[float, float, float]:
    sessions, first = batch_sessions(m, n, ctx, n_vocab)

    def run() -> None:
        run_steps(sessions, first, 32)
        for s in sessions:
            s.truncate(ctx)
    return median_rate(n * 32, run, repeats)


def profile_steps(m, n: int, n_vocab: int) -> dict:
    """Kernels and launch calls per step of N rows, and the GPU's busy share while stepping."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sessions, first = batch_sessions(m, n, 128, n_vocab)
    run_steps(sessions, first, 4)
    launches = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run_steps(sessions, [greedy_of(s) for s in sessions], 8)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower()
               and "memset" not in e.name.lower()]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    calls = sum(1 for e in events if e.name in launches)
    graphs = sum(1 for e in events if e.name == "cudaGraphLaunch")
    per_name: dict[str, float] = {}
    for e in kernels:
        per_name[e.name[:60]] = per_name.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / 8
    top = dict(sorted(per_name.items(), key=lambda kv: -kv[1])[:6])
    return {"kernels_per_step": len(kernels) / 8, "launch_calls_per_step": calls / 8,
            "graph_launches_per_step": graphs / 8, "gpu_busy_share": busy_us / (wall * 1e6),
            "profiled_step_ms": wall / 8 * 1e3, "gpu_us_per_step": busy_us / 8,
            "top_kernels_us_per_step": {k: round(v, 1) for k, v in top.items()}}


def exactness(m_graph, path: str, label: str) -> None:
    """Greedy tokens graph vs eager; teacher-forced logits of CUDA paths vs CPU float32."""
    eager = engine.load_model(path, device="cuda", ctx=CTX)
    eager.net.decode_graphs = None
    n_vocab = m_graph.n_vocab
    prompt = ids_for(16, 7, n_vocab)
    outs = []
    for m in (m_graph, eager):
        s = m.new_session()
        s.sync(prompt)
        outs.append(list(generate(s, GREEDY, 128)))
    same = next((i for i, (a, b) in enumerate(zip(*outs)) if a != b), len(outs[0]))
    emit(label, "exact.greedy_128_batch1_first_divergence", same)
    emit(label, "exact.greedy_128_batch1_equal", outs[0] == outs[1])
    streams = []
    for m in (m_graph, eager):
        sessions, first = batch_sessions(m, 8, 64, n_vocab)
        made, toks = [], list(first)
        for _ in range(32):
            made.append(toks)
            decode_batch(sessions, toks)
            toks = [greedy_of(s) for s in sessions]
        streams.append(made)
    eq = sum(a == b for ra, rb in zip(*streams) for a, b in zip(ra, rb))
    emit(label, "exact.greedy_32x8_batch_equal_share", eq / (32 * 8))

    ids = ids_for(257, 9, n_vocab)
    cpu = engine.load_model(path, weights="float32", ctx=CTX)
    ref = cpu.net.forward(torch.tensor(ids[:-1]), 0, cpu.new_session().cache, logits="all").float()
    ref_logp = torch.log_softmax(ref, -1)
    ref_top = ref.argmax(-1)

    def compare(name: str, got: torch.Tensor) -> None:
        logp = torch.log_softmax(got.float(), -1)
        kl = torch.sum(ref_logp.exp() * (ref_logp - logp), -1)
        emit(label, f"exact.{name}.top1_vs_cpu_f32", round(float((got.argmax(-1) == ref_top).float().mean()), 4))
        emit(label, f"exact.{name}.mean_kl", f"{float(kl.mean()):.3e}")
        emit(label, f"exact.{name}.max_kl", f"{float(kl.max()):.3e}")

    for name, m in (("graph_decode", m_graph), ("eager_decode", eager)):
        s = m.new_session()
        s.sync(ids[:1])
        rows = [s.logits]
        for t in ids[1:-1]:
            s.eval(t)
            rows.append(s.logits)
        compare(name, torch.stack(rows))
    pre = m_graph.net.forward(torch.tensor(ids[:-1], device="cuda"), 0, m_graph.new_session().cache,
                              logits="all").float().cpu()
    compare("cuda_prefill", pre)


def int4_crossover(m, label: str, name: str) -> None:
    """Milliseconds per product of block 0's matrices at growing row counts: the engine's int4
    GEMM (engine.cuda_int4), torch's int4 kernel over the same nibbles, dequantize + cuBLAS,
    and a resident bfloat16 matrix; where each path pays."""
    from engine.weights import cuda_inner_k_tiles

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def ms(fn) -> float:
        for _ in range(3):
            fn()
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        return round(start.elapsed_time(end) / 20, 4)

    blk = m.net.blocks[0]
    for mat in ("wqkv", "w_gate_up", "w_down"):
        w = getattr(getattr(blk, mat), "cuda_weight", None)
        if w is None:
            return
        dense = w.weight().clone()  # [N, K] bfloat16
        packed = torch.ops.aten._convert_weight_to_int4pack(w.nibbles, cuda_inner_k_tiles(w.k))
        pairs = w.pairs.float()
        sz = torch.stack([pairs[..., 0], pairs[..., 1] + 8 * pairs[..., 0]], -1).to(torch.bfloat16)
        out = {}
        for rows in (1, 8, 16, 32, 64, 128, 512, 2048):
            x = torch.randn(rows, w.k, device="cuda", dtype=torch.bfloat16)
            out[rows] = (ms(lambda: w.fused(x)),
                         ms(lambda: torch.ops.aten._weight_int4pack_mm(x, packed, 32, sz)),
                         ms(lambda: torch.nn.functional.linear(x, w.weight())),
                         ms(lambda: torch.nn.functional.linear(x, dense)))
        emit(label, f"{name}.ms_fused_torchint4_dequant_bf16.{mat}_{w.n}x{w.k}", out)


def sdpa_probe(m) -> str:
    """Which SDPA backends accept the prefill attention call of this model."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = m.config
    q = torch.randn(1, cfg.n_head, 2048, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, cfg.n_head_kv, 2048, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    ok = []
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([b]):
                torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
            ok.append(b.name)
        except RuntimeError:
            pass
    return ",".join(ok)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--exactness", action="store_true")
    ap.add_argument("--skip-eager", action="store_true", help="measure graph decoding only")
    ap.add_argument("--skip-speed", action="store_true", help="only the exactness comparisons")
    a = ap.parse_args()
    os.makedirs(a.models, exist_ok=True)
    label = a.label
    emit(label, "engine_file", engine.__file__)
    emit(label, "torch", torch.__version__)
    for name in a.shapes.split(","):
        path = model_file(a.models, name)
        t0 = time.perf_counter()
        m = engine.load_model(path, device="cuda", ctx=CTX)
        emit(label, f"{name}.load_s", round(time.perf_counter() - t0, 2))
        n_vocab = m.n_vocab
        graphs = getattr(m.net, "decode_graphs", None)
        paths = [("eager", None)] if graphs is None else [("graphs", True)] + [("eager", False)] * (not a.skip_eager)
        if a.skip_speed:
            if a.exactness and name == "smollm2-135m":
                exactness(m, path, f"{label}.{name}")
            del m
            continue
        emit(label, f"{name}.prefill_chunk", m.prefill_chunk)
        emit(label, f"{name}.sdpa_backends", sdpa_probe(m))
        emit(label, f"{name}.prefill2048_tok_s", fmt(bench_prefill(m, n_vocab, a.repeats)))
        if m.prefill_chunk != 128:
            chunk = m.prefill_chunk
            m.prefill_chunk = 128
            emit(label, f"{name}.prefill2048_chunk128_tok_s", fmt(bench_prefill(m, n_vocab, a.repeats)))
            m.prefill_chunk = chunk
        for tag, on in paths:
            if graphs is not None:
                graphs.enabled = on
            for ctx in (16, 2048):
                emit(label, f"{name}.{tag}.decode128_after{ctx}_tok_s", fmt(bench_decode(m, ctx, n_vocab, a.repeats)))
            for n, ctx in ((1, 128), (8, 128), (64, 128), (64, 1024)):
                emit(label, f"{name}.{tag}.batch_n{n}_ctx{ctx}_aggregate_tok_s",
                     fmt(bench_batch(m, n, ctx, n_vocab, a.repeats)))
            for n in (1, 64):
                try:
                    emit(label, f"{name}.{tag}.profile_n{n}", profile_steps(m, n, n_vocab))
                except Exception as e:  # the profiler is a diagnostic: never lose the run to it
                    emit(label, f"{name}.{tag}.profile_n{n}", f"failed: {type(e).__name__}: {e}")
            torch.cuda.empty_cache()
        if graphs is not None:
            graphs.enabled, graphs.fused = True, False  # what the fused elementwise kernels are worth
            emit(label, f"{name}.graphs_torch_elementwise.decode128_after16_tok_s", fmt(bench_decode(m, 16, n_vocab, a.repeats)))
            emit(label, f"{name}.graphs_torch_elementwise.batch_n64_ctx128_aggregate_tok_s",
                 fmt(bench_batch(m, 64, 128, n_vocab, a.repeats)))
            graphs.fused = True
            emit(label, f"{name}.graph_capture_s", round(graphs.capture_seconds, 2))
            emit(label, f"{name}.graphs_disabled_reason", graphs.disabled_reason)
            int4_crossover(m, label, name)
            emit(label, f"{name}.graph_buckets", sorted(graphs.captured_buckets))
        if a.exactness and name == "smollm2-135m":
            exactness(m, path, f"{label}.{name}")
        del m
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, f"{label}.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
