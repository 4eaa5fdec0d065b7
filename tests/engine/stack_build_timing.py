"""Times building one layer's stacked experts (engine.cuda_moe.StackedWeight) of a real model's
shape: the int8 stacks unpacked by torch on the device (engine.device_blocks) against the host
path they replaced (engine.quants' numpy unpacking, then copied; test_device_blocks'
reference), interleaved A/B in one process; a script, not a test.

The layer's expert tensors are random blocks of engine.synthetic's preset shape, each in
`--qtype` or llama.cpp's fallback for rows that are not whole blocks of it (DeepSeek-V2-Lite at
Q4_K: gate/up Q4_K, which stack as int4 and are left out, down Q5_0), built in memory rather
than read from a file.  Every round checks that both paths built the same stack.

    PYTHONPATH=$PWD:tests/engine python tests/engine/stack_build_timing.py --device cpu
    PYTHONPATH=$PWD:tests/engine python tests/engine/stack_build_timing.py --qtype Q6_K --repeats 7
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from gguf import GGMLQuantizationType as QT

from engine import cuda_moe
from engine.gguf_file import TensorRecord
from engine.synthetic import PRESETS, fitted
from test_device_blocks import expert_part, host_int8_stack


def layer_parts(preset: str, qtype: QT) -> dict[str, list[TensorRecord]]:
    """The stacks of one layer of `preset`: {"gate_up": [gate, up], "down": [down]}."""
    spec = PRESETS[preset]
    e, d, f = spec.n_expert, spec.n_embd, spec.n_ff_exp
    gate, up = (expert_part(n, fitted(qtype, d), e, f, d, seed=i, extreme=False) for i, n in enumerate(("gate", "up")))
    return {"gate_up": [gate, up], "down": [expert_part("down", fitted(qtype, f), e, d, f, seed=2, extreme=False)]}


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=("deepseek-v2-lite", "qwen3-30b-a3b"), default="deepseek-v2-lite")
    ap.add_argument("--qtype", default="Q4_K")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    stacks = {name: parts for name, parts in layer_parts(args.preset, QT[args.qtype]).items()
              if cuda_moe.stack_format([r.qtype for r in parts]) == "int8"}
    if not stacks:
        print(f"{args.preset} at {args.qtype}: no int8 stack in a layer")
        return 1
    print(f"{args.preset} at {args.qtype} on {device} (torch threads {torch.get_num_threads()}): "
          + ", ".join(f"{n} {'+'.join(r.qtype.name for r in p)} {p[0].shape}" for n, p in stacks.items()))
    host, dev = [], []
    for i in range(args.repeats):  # the first round includes each path's warm-up
        th = td = 0.0
        for parts in stacks.values():
            t, (q, pairs) = timed(lambda: host_int8_stack(parts, parts[0].shape[0], device), device)
            th += t
            t, stack = timed(lambda: cuda_moe.StackedWeight(parts, device), device)
            td += t
            if not (torch.equal(stack.q, q) and torch.equal(stack.pairs, pairs)):
                raise AssertionError("the two paths built different stacks")
        host.append(th)
        dev.append(td)
        print(f"round {i}: host numpy {th:.3f} s, device_blocks {td:.3f} s", flush=True)
    h, d = statistics.median(host[1:] or host), statistics.median(dev[1:] or dev)
    print(f"median after the first round: host numpy {h:.3f} s, device_blocks on {device.type} {d:.3f} s "
          f"({h / d:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
