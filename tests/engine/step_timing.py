"""Times graph-replayed decoding steps of the dense shapes on CUDA under several settings,
alternated in one process: values of `engine.cuda_int4.GEMV_ROW_ELEMENTS` (the most rows x n x k
a product runs as one-row products before the tensor-core kernel takes it), sets of
`engine.cuda_graphs.BUCKETS` (the batch sizes that have graphs of their own; the others replay
the next larger one's), `engine.cuda_int4.SWIGLU_IN_PRODUCTS` (gate/up products ending in the
SwiGLU, or the SwiGLU kernel after them), `engine.cuda_attention.PIECES` (the decode
attention's piece lengths) and `engine.cuda_attention.ROPE_IN_ATTENTION` (q and k turned by the
attention's kernels, or by torch's ops before them); a script for the device, not a test.

The shapes are `ds4bench/cuda_paths.py`'s random files (SmolLM2-135M, Llama-3.2-1B), written
into `--models` on first use.  The model is loaded once per setting (each Int4Weight reads the
one-row limit, and each gate/up matrix the SwiGLU switch, when it is built; the buckets are set again before each timing, as graphs are
looked up by them), each row count's sessions are made and stepped once (which captures that
bucket's graph, and its attention's pieces, under that setting), and then 32-step timings of
every setting are alternated `--repeats` times per row count, each from the same `--cached`
positions (default 128).  It prints, per row
count, every setting's median milliseconds a step and its speed against the first.

    PYTHONPATH=$PWD python tests/engine/step_timing.py --models /tmp/models --shape smollm2-135m \\
        --rows 1,2,4,8,16 --gemv-mi 4,8,16,32,64 --swiglu-in-products 1,0 --rope-in-attention 1,0
    PYTHONPATH=$PWD python tests/engine/step_timing.py --models /tmp/models --rows 3,6,12 \\
        --buckets "1,2,4,8,16,32,64;1,2,3,4,6,8,12,16,24,32,48,64"
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import NamedTuple

import torch

import engine
from ds4bench.cuda_paths import SHAPES, batch_sessions, model_file, run_steps
from engine import cuda_attention, cuda_graphs, cuda_int4

STEPS = 32  # steps a timing


class Setting(NamedTuple):
    mi: int  # GEMV_ROW_ELEMENTS in Mi elements
    buckets: tuple[int, ...]
    swiglu: bool
    pieces: tuple[int, ...]
    rope: bool

    def apply(self) -> None:
        cuda_int4.GEMV_ROW_ELEMENTS = self.mi * 2 ** 20
        cuda_graphs.BUCKETS = self.buckets
        cuda_int4.SWIGLU_IN_PRODUCTS = self.swiglu
        cuda_attention.PIECES = self.pieces
        cuda_attention.ROPE_IN_ATTENTION = self.rope

    def label(self, n: int) -> str:
        return (f"{self.mi} Mi, bucket {_bucket(n, self.buckets)}, swiglu {'in' if self.swiglu else 'after'}, "
                f"pieces {self.pieces}, rope {'in' if self.rope else 'before'}")


def timed(sessions: list, first: list[int], device: torch.device, cached: int) -> float:
    """Milliseconds a step over STEPS steps from `cached` positions; the sessions are left there."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    run_steps(sessions, first, STEPS)
    sync()
    ms = (time.perf_counter() - t0) / STEPS * 1e3
    for s in sessions:
        s.truncate(cached)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", required=True, help="folder of the random files (written on first use)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--rows", default="1,2,4,8,16", help="row counts of the timed steps")
    ap.add_argument("--gemv-mi", default="16", help="GEMV_ROW_ELEMENTS values in Mi elements")
    ap.add_argument("--buckets", default=",".join(map(str, cuda_graphs.BUCKETS)),
                    help="sets of BUCKETS, separated by ';' (each setting is a one-row limit, a set, a "
                         "SwiGLU switch and a set of pieces: every combination; the first is the base)")
    ap.add_argument("--swiglu-in-products", default="1" if cuda_int4.SWIGLU_IN_PRODUCTS else "0",
                    help="values of SWIGLU_IN_PRODUCTS (1, 0)")
    ap.add_argument("--pieces", default=",".join(map(str, cuda_attention.PIECES)),
                    help="sets of the attention's PIECES, separated by ';'")
    ap.add_argument("--rope-in-attention", default="1" if cuda_attention.ROPE_IN_ATTENTION else "0",
                    help="values of ROPE_IN_ATTENTION (1, 0)")
    ap.add_argument("--cached", type=int, default=128, help="positions each row holds before the timed steps")
    ap.add_argument("--repeats", type=int, default=5, help="alternated timings per value and row count")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    settings = [Setting(int(v), tuple(int(b) for b in bs.split(",")), p == "1", tuple(int(x) for x in ps.split(",")),
                        r == "1")
                for v in args.gemv_mi.split(",") for bs in args.buckets.split(";")
                for p in args.swiglu_in_products.split(",") for ps in args.pieces.split(";")
                for r in args.rope_in_attention.split(",")]
    os.makedirs(args.models, exist_ok=True)
    path = model_file(args.models, args.shape)
    n_vocab = SHAPES[args.shape]["n_vocab"]
    device = torch.device(args.device)
    held = {}
    for setting in settings:
        setting.apply()
        model = engine.load_model(path, device=args.device, ctx=args.cached + 4 * STEPS)
        for n in rows:
            sessions, first = batch_sessions(model, n, args.cached, n_vocab)
            timed(sessions, first, device, args.cached)  # captures this bucket's graph under this setting
            held[setting, n] = sessions, first
    for n in rows:
        ms = {setting: [] for setting in settings}
        for _ in range(args.repeats):
            for setting in settings:
                cuda_graphs.BUCKETS = setting.buckets
                ms[setting].append(timed(*held[setting, n], device, args.cached))
        base = statistics.median(ms[settings[0]])
        cells = "  ".join(f"{s.label(n)}: {statistics.median(ms[s]):.4f} ms ({base / statistics.median(ms[s]):.3f}x)"
                          for s in settings)
        print(f"{args.shape} rows {n:2d}: {cells}", flush=True)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if n <= b), 0)


if __name__ == "__main__":
    main()
