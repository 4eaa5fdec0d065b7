"""Times decoding steps of a mixture-of-experts model on CUDA, at 1 row and at 32 (or any
widths), and engine.cuda_moe's experts alone; a script for the device, not a test.

It writes a random GGUF of a real model's shape (`SHAPES`: engine.synthetic's Qwen3-30B-A3B
and DeepSeek-V2-Lite presets, their full vocabularies and heads included) with random blocks of
the chosen type, falling back, for matrices whose rows are not whole blocks of it, to the type
llama.cpp's quantizer falls back to (Q4_K -> Q5_0, which the stacked experts hold as int8).
Then, for each width:

- step: `decode_batch` over that many pooled sessions, `--steps` steps after warm-up, median
  of `--repeats` timings (both families decode through captured graphs);
- with `--per-expert`, the same steps with each expert its own Linear (the path that reads the
  routing back every layer, without graphs), loaded a second time;
- experts: one layer's routed experts (`StackedExperts.__call__` with random routing) replayed
  from a CUDA graph over every MoE layer, so launch overhead is as in a graph-decoded step;
  with `--sweep`, the same for grids of launch shapes (engine.cuda_moe.MoeLaunch, `SWEEPS`),
  fastest first.

With `--dependent 0,64` it instead compares values of `cuda_moe.DEPENDENT_EXPERT_ROWS`, and with
`--compare "gemm_unroll=2;gemm_unroll=1,gemm_stages=4"` launches (the default with the fields
named): a model loaded per value (its graphs captured under it), the steps and the routed
experts of every value timed in turn, `--repeats` times, and each value's medians printed
against the first's.

The bytes one token reads (attention, its routed experts, shared experts; the head left out)
over the step time give the bandwidth a one-row step reaches.

    PYTHONPATH=$PWD:tests/engine python tests/engine/moe_timing.py --shape qwen3-30b-a3b --layers 12
    PYTHONPATH=$PWD:tests/engine python tests/engine/moe_timing.py --shape deepseek-v2-lite --rows 1,32 --sweep
    PYTHONPATH=$PWD:tests/engine python tests/engine/moe_timing.py --layers 12 --rows 1,32 --dependent 0,64
    PYTHONPATH=$PWD:tests/engine python tests/engine/moe_timing.py --layers 12 --rows 32 --compare "gemm_unroll=2;gemm_unroll=1"
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, NamedTuple

import torch

import engine
from engine import cuda_moe
from engine.batch import decode_batch
from engine.models import qwen_moe
from engine.synthetic import PRESETS, write_moe_gguf

SHAPES = ("qwen3-30b-a3b", "deepseek-v2-lite")  # engine.synthetic.PRESETS


def write_shape(path: str, preset: str, n_layer: int, qtype: str) -> str:
    """The preset's GGUF with `n_layer` layers and `qtype` layer matrices (engine.synthetic)."""
    spec = dataclasses.replace(PRESETS[preset], n_layer=n_layer, qtype=qtype)
    report = write_moe_gguf(path, spec)
    return f"{report.n_tensors} tensors"


def token_bytes(m: engine.Model) -> int:
    """Bytes of weights one decoded token reads, the head and embedding left out: every dense
    matrix of a layer, and k of its n_expert routed experts (deepseek2's absorbed products from
    their per-head stacks where it holds them, not from the float32 copies)."""
    total = 0
    for blk in m.net.blocks:
        total += blk.nbytes
        for stack, copy in (("k_stack", "w_k"), ("v_stack", "w_v")):
            if getattr(blk, stack, None) is not None:
                total -= getattr(blk, copy).nbytes
        if isinstance(blk.experts, cuda_moe.StackedExperts):
            total -= blk.experts.nbytes * (blk.experts.n_expert - m.config.n_expert_used) // blk.experts.n_expert
    return total


def warm_sessions(m: engine.Model, rows: int) -> list:
    """`rows` pooled sessions of 16 positions each, stepped (so their bucket's graph is captured)
    and truncated back."""
    sessions = m.new_sessions(rows)
    for i, s in enumerate(sessions):
        s.sync([5 + (i * 7 + j) % 200 for j in range(16)])
    for _ in range(3):
        decode_batch(sessions, [9] * rows)
    for s in sessions:
        s.truncate(16)
    return sessions


def step_seconds(sessions: list, steps: int, r: int = 0) -> float:
    """Seconds of one decoding step of the sessions over `steps` steps; they are left at 16 positions."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(steps):
        decode_batch(sessions, [10 + (step + r) % 100] * len(sessions))
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    for s in sessions:  # keep the contexts short and equal across repeats
        s.truncate(16)
    return seconds


def time_steps(m: engine.Model, rows: int, steps: int, repeats: int) -> float:
    """Median seconds of one decoding step of `rows` pooled sessions."""
    sessions = warm_sessions(m, rows)
    return statistics.median(step_seconds(sessions, steps, r) for r in range(repeats))


def stacked_layers(m: engine.Model) -> list[cuda_moe.StackedExperts]:
    return [b.experts for b in m.net.blocks if isinstance(getattr(b, "experts", None), cuda_moe.StackedExperts)]


class Variant(NamedTuple):
    """A setting compared by `compare_variants`: its label, what it sets before its model loads
    and before each of its timings (module settings read at launch), and its experts' launch."""

    label: str
    apply: Callable[[], None]
    launch: cuda_moe.MoeLaunch


def dependent_variants(values: list[int]) -> list[Variant]:
    """`cuda_moe.DEPENDENT_EXPERT_ROWS` at each value."""
    return [Variant(f"dependent to {v} rows", lambda v=v: setattr(cuda_moe, "DEPENDENT_EXPERT_ROWS", v),
                    cuda_moe.LAUNCH) for v in values]


def launch_variants(spec: str) -> list[Variant]:
    """Launches separated by ';', each the default with the fields named (FIELD=INT, ',' between
    fields; a bool field takes 0 and 1): "gemm_unroll=2;gemm_unroll=1,gemm_stages=4"."""
    variants = []
    for text in spec.split(";"):
        fields = dict(item.split("=") for item in text.split(","))
        values = {f: type(getattr(cuda_moe.LAUNCH, f))(int(v)) for f, v in fields.items()}
        variants.append(Variant(text, lambda: None, dataclasses.replace(cuda_moe.LAUNCH, **values)))
    return variants


def compare_variants(path: str, variants: list[Variant], rows_list: list[int], steps: int, repeats: int) -> None:
    """Whole steps and the routed experts alone under each variant (a model loaded per variant,
    its graphs captured under it), the timings alternated; prints each variant's medians and
    their speed against the first's."""
    models = {}
    for v in variants:
        v.apply()
        models[v.label] = engine.load_model(path, device="cuda", ctx=512)
        for layer in stacked_layers(models[v.label]):
            layer.launch = v.launch
    k = models[variants[0].label].config.n_expert_used
    for rows in rows_list:
        held = {}
        for v in variants:
            v.apply()
            held[v.label] = warm_sessions(models[v.label], rows)
        step_s = {v.label: [] for v in variants}
        experts_s = {v.label: [] for v in variants}
        for r in range(repeats):
            for v in variants:
                v.apply()
                step_s[v.label].append(step_seconds(held[v.label], steps, r))
                experts_s[v.label].append(time_experts(stacked_layers(models[v.label]), rows, k, v.launch))
        base = variants[0].label
        base_step, base_experts = statistics.median(step_s[base]), statistics.median(experts_s[base])
        cells = []
        for v in variants:
            step, experts = statistics.median(step_s[v.label]), statistics.median(experts_s[v.label])
            cells.append(f"{v.label}: step {step * 1e3:.3f} ms ({base_step / step:.3f}x), "
                         f"experts {experts * 1e3:.3f} ms ({base_experts / experts:.3f}x)")
        print(f"rows {rows:3d}: " + "; ".join(cells), flush=True)


def time_experts(layers: list[cuda_moe.StackedExperts], rows: int, k: int, launch: cuda_moe.MoeLaunch,
                 replays: int = 20) -> float:
    """Seconds of every layer's routed experts at `rows` rows, replayed from one CUDA graph."""
    first = layers[0]
    g = torch.Generator(device="cuda").manual_seed(rows)
    h = torch.randn(rows, first.n_embd, device="cuda", generator=g)
    ids = torch.stack([torch.randperm(first.n_expert, device="cuda", generator=g)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, device="cuda", generator=g)
    x = torch.zeros(rows, first.n_embd, device="cuda")
    for e in layers:
        e.launch = launch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first(h, ids, weights, into=x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for e in layers:
            e(h, ids, weights, into=x)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / replays


# Grids of launch shapes, swept one after the other from the defaults, each from the fastest
# shape the grid before it found: for a few rows how the work spreads (the down product's
# programs, weights loaded a step early), then tile sizes; for more rows the grouped GEMM's
# tile order and size, then its pipeline and groups per loop step.
SWEEPS = {"rows": [dict(gemv_down=cuda_moe.DOWN_SHAPES, gemv_prefetch=(False, True)),
                   dict(gemv_bn=(4, 8, 16, 32), gemv_gb=(8, 16, 32), gemv_warps=(2, 4, 8))],
          "blocks": [dict(gemm_transposed_bm=(0, 64), gemm_bn=(64, 128), gemm_warps=(4, 8)),
                     dict(gemm_stages=(2, 3, 4), gemm_unroll=(1, 2, 4))]}


def sweep(layers: list[cuda_moe.StackedExperts], rows: int, k: int) -> list[tuple[float, cuda_moe.MoeLaunch]]:
    """Every shape timed, fastest first."""
    found = []
    best = cuda_moe.LAUNCH
    for grid in SWEEPS["rows" if rows <= cuda_moe.GEMV_MAX_ROWS else "blocks"]:
        for values in itertools.product(*grid.values()):
            launch = dataclasses.replace(best, **dict(zip(grid, values)))
            try:
                found.append((time_experts(layers, rows, k, launch), launch))
            except Exception as e:  # a shape the compiler refuses (registers, shared memory)
                print(f"  {launch}: {type(e).__name__}", file=sys.stderr)
        best = min(found, key=lambda f: f[0])[1]
    return sorted(found, key=lambda f: f[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=0, help="layers to write (default: the shape's)")
    ap.add_argument("--qtype", default="Q4_K")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="time a grid of launch shapes of the experts")
    ap.add_argument("--gguf", help="use (or keep) the GGUF at this path")
    ap.add_argument("--dependent", help="values of cuda_moe.DEPENDENT_EXPERT_ROWS to compare, separated by ',' "
                                        "(each a model of its own, timings alternated)")
    ap.add_argument("--compare", metavar="LAUNCHES",
                    help="engine.cuda_moe.MoeLaunch settings to compare, ';' between them, each FIELD=INT[,...] "
                         "(each a model of its own, timings alternated)")
    ap.add_argument("--per-expert", action="store_true",
                    help="also time the per-expert path (each expert its own Linear, routing read back)")
    args = ap.parse_args(argv)
    n_layer = args.layers or PRESETS[args.shape].n_layer
    path = args.gguf or os.path.join(tempfile.mkdtemp(), f"{args.shape}-{n_layer}.gguf")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        written = write_shape(path, args.shape, n_layer, args.qtype)
        size = os.path.getsize(path) / 2 ** 30
        print(f"wrote {path} ({size:.1f} GiB, {written}) in {time.perf_counter() - t0:.0f} s")
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.dependent or args.compare:
        variants = (dependent_variants([int(v) for v in args.dependent.split(",")]) if args.dependent
                    else launch_variants(args.compare))
        compare_variants(path, variants, rows_list, args.steps, args.repeats)
        return 0
    t0 = time.perf_counter()
    m = engine.load_model(path, device="cuda", ctx=512)
    print(f"loaded in {time.perf_counter() - t0:.0f} s; graphs: {getattr(m.net, 'decode_graphs', None) is not None}")
    layers = stacked_layers(m)
    print(f"{len(layers)} stacked layers: gate/up {layers[0].gate_up.format}, down {layers[0].down.format}")
    per_token = token_bytes(m)
    k = m.config.n_expert_used
    old = None
    if args.per_expert:
        qwen_moe.stacks_experts = lambda device, fmt: False  # this process only
        old = engine.load_model(path, device="cuda", ctx=512)
    for rows in rows_list:
        if old is not None:
            before = time_steps(old, rows, args.steps, args.repeats)
            print(f"rows {rows:3d}: per-expert path {before * 1e3:7.3f} ms, {rows / before:8.1f} tok/s", flush=True)
        step = time_steps(m, rows, args.steps, args.repeats)
        experts = time_experts(layers, rows, k, cuda_moe.LAUNCH)
        line = (f"rows {rows:3d}: step {step * 1e3:7.3f} ms, {rows / step:8.1f} tok/s; routed experts of "
                f"{len(layers)} layers {experts * 1e3:7.3f} ms")
        if rows == 1:
            line += f"; {per_token / 2 ** 20:.0f} MiB per token, {per_token / step / 1e9:.0f} GB/s"
        print(line, flush=True)
        if args.sweep:
            for seconds, launch in sweep(layers, rows, k)[:5]:
                print(f"    {seconds * 1e3:7.3f} ms  {launch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
