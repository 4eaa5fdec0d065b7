"""Times graph-replayed decoding steps of the dense shapes on CUDA under several settings, alternated
in one process: values of `engine.cuda_int4.GEMV_ROW_ELEMENTS` (the most rows x n x k a product runs
as one-row products before the tensor-core kernel takes it), `engine.cuda_int4.DEPENDENT_GEMM_ELEMENTS`
(the largest matrices whose tensor-core products launch as programmatic dependents, 0 for none),
sets of `engine.cuda_graphs.BUCKETS` (the batch sizes that have graphs of their own; the others replay the
next larger one's), `engine.cuda_int4.SWIGLU_IN_PRODUCTS` (gate/up products ending in the SwiGLU, or
the SwiGLU kernel after them), `engine.cuda_attention.PIECES` (the decode attention's piece
lengths), `engine.cuda_attention.ROPE_IN_ATTENTION` (q and k turned by the attention's kernels, or
by torch's ops before them), `engine.cuda_attention.EARLY_CACHE_READS` (the attention's first cache
reads before its wait), `engine.cuda_attention.BLOCKS` (the positions a piece's inner iteration
reads, for one row and for more) and `engine.cuda_attention.PIECE_PROGRAMS` (the most programs a
step's attention launches, 0 for no cap); a script for the device, not a test.

The shapes are `ds4bench/cuda_paths.py`'s random files (SmolLM2-135M, Llama-3.2-1B), written
into `--models` on first use.  The model is loaded once per setting (each Int4Weight reads the
one-row limit, and each gate/up matrix the SwiGLU switch, when it is built; the buckets are set
again before each timing, as graphs are looked up by them), each row count's sessions are made
and stepped once (which captures that bucket's graph, and its attention's pieces and launch
options, under that setting), and then 32-step timings of every setting are alternated
`--repeats` times per row count, each from the same `--cached` positions (default 128).  It
prints, per row count, every setting's median milliseconds a step and its speed against the
first (every combination of the values given is a setting; the first values make the base).

    PYTHONPATH=$PWD python tests/engine/step_timing.py --models /tmp/models --shape smollm2-135m \\
        --rows 1,2,4,8,16 --gemv-mi 4,8,16,32,64 --swiglu-in-products 1,0 --rope-in-attention 1,0
    PYTHONPATH=$PWD python tests/engine/step_timing.py --models /tmp/models --rows 3,6,12 \\
        --buckets "1,2,4,8,16,32,64;1,2,3,4,6,8,12,16,24,32,48,64"
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from typing import Callable, NamedTuple

import torch

import engine
from ds4bench.cuda_paths import SHAPES, batch_sessions, model_file, run_steps
from engine import cuda_attention, cuda_graphs, cuda_int4

STEPS = 32  # steps a timing


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


class Knob(NamedTuple):
    """A module setting the script varies: its flag, its values' separator on the command line,
    how a value is read, set and shown, and the default (the setting's value now)."""

    flag: str
    module: object
    name: str
    parse: Callable[[str], object]
    show: Callable[[object], str]
    separator: str = ","
    write: Callable[[object], str] = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else str(int(v))

    def default(self) -> str:
        return self.write(getattr(self.module, self.name))


KNOBS = (
    Knob("gemv-mi", cuda_int4, "GEMV_ROW_ELEMENTS", lambda v: int(v) * 2 ** 20, lambda v: f"{v >> 20} Mi",
         write=lambda v: str(v >> 20)),
    Knob("buckets", cuda_graphs, "BUCKETS", _ints, lambda v: f"buckets {v}", ";"),
    Knob("dependent-gemm", cuda_int4, "DEPENDENT_GEMM_ELEMENTS", int, lambda v: f"gemm dependent to {v}"),
    Knob("swiglu-in-products", cuda_int4, "SWIGLU_IN_PRODUCTS", lambda v: v == "1",
         lambda v: f"swiglu {'in' if v else 'after'}"),
    Knob("pieces", cuda_attention, "PIECES", _ints, lambda v: f"pieces {v}", ";"),
    Knob("rope-in-attention", cuda_attention, "ROPE_IN_ATTENTION", lambda v: v == "1",
         lambda v: f"rope {'in' if v else 'before'}"),
    Knob("early-cache-reads", cuda_attention, "EARLY_CACHE_READS", lambda v: v == "1",
         lambda v: f"cache reads {'early' if v else 'after the wait'}"),
    Knob("attention-blocks", cuda_attention, "BLOCKS", _ints, lambda v: f"blocks {v}", ";"),
    Knob("piece-programs", cuda_attention, "PIECE_PROGRAMS", lambda v: int(v) or None,
         lambda v: f"programs {v or 'any'}", write=lambda v: str(v or 0)),
)


class Setting(NamedTuple):
    values: tuple  # one per knob, in KNOBS' order

    def value(self, name: str) -> object:
        return next(v for k, v in zip(KNOBS, self.values) if k.name == name)

    def apply(self) -> None:
        for knob, value in zip(KNOBS, self.values):
            setattr(knob.module, knob.name, value)

    def label(self, varied: list[bool]) -> str:
        shown = [k.show(v) for k, v, on in zip(KNOBS, self.values, varied) if on]
        return ", ".join(shown) or "as set"


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
    for knob in KNOBS:
        what = "sets" if knob.separator == ";" else "values"
        ap.add_argument(f"--{knob.flag}", default=knob.default(),
                        help=f"{what} of {knob.name}, separated by '{knob.separator}' (default: as now)")
    ap.add_argument("--cached", type=int, default=128, help="positions each row holds before the timed steps")
    ap.add_argument("--ctx", type=int, help="the model's context (default: --cached and the timed steps')")
    ap.add_argument("--repeats", type=int, default=5, help="alternated timings per value and row count")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    choices = [[k.parse(v) for v in getattr(args, k.flag.replace("-", "_")).split(k.separator)] for k in KNOBS]
    settings = [Setting(tuple(values)) for values in itertools.product(*choices)]
    varied = [len(c) > 1 for c in choices]
    os.makedirs(args.models, exist_ok=True)
    path = model_file(args.models, args.shape)
    n_vocab = SHAPES[args.shape]["n_vocab"]
    device = torch.device(args.device)
    held = {}
    for setting in settings:
        setting.apply()
        model = engine.load_model(path, device=args.device, ctx=args.ctx or args.cached + 4 * STEPS)
        for n in rows:
            sessions, first = batch_sessions(model, n, args.cached, n_vocab)
            timed(sessions, first, device, args.cached)  # captures this bucket's graph under this setting
            held[setting, n] = sessions, first
    for n in rows:
        ms = {setting: [] for setting in settings}
        for _ in range(args.repeats):
            for setting in settings:
                setting.apply()  # the buckets pick the graph a step replays
                ms[setting].append(timed(*held[setting, n], device, args.cached))
        base = statistics.median(ms[settings[0]])
        cells = "  ".join(f"{s.label(varied)}, bucket {_bucket(n, s.value('BUCKETS'))}: "
                          f"{statistics.median(ms[s]):.4f} ms ({base / statistics.median(ms[s]):.3f}x)"
                          for s in settings)
        print(f"{args.shape} rows {n:2d}: {cells}", flush=True)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if n <= b), 0)


if __name__ == "__main__":
    main()
