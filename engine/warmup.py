"""Warm-up: a model's first uses of its CUDA paths, paid before the first request instead of inside it.

On CUDA a decoding step of N rows replays the graph of N's bucket, captured the first time that
bucket is met (engine.cuda_graphs); a short prefill replays prefill graphs of its own, one per
bucket of the last 64-token piece; and the first eager prefill chunk compiles the prefill
products' Triton kernels and creates cuBLAS's handles.  Each is tens of milliseconds to seconds,
and without a warm-up it lands in whichever request meets it first: docs/measurements.md
(round 16) found cases' first tokens 0.7-2.4 s late for it, in serial runs and in `--parallel`
ones.  `warm_up(model, rows)` meets all of them at once with throwaway sessions, as serving
engines capture their graphs at start-up:

- the prefill graphs: a prompt one token longer than each bucket (a prompt's last token runs
  as a one-row decoding step, so its prefill is the tokens before it: the bucket's length);
- the eager prefill: a prefill just past `PREFILL_GRAPH_TOKENS` and one of a whole chunk (the
  products of more rows take other kernels), each cut to the context;
- the decoding graphs: a batched step of every bucket up to `rows`' (a scheduler of N slots
  steps 1 to N rows).

The sessions are the model's own (`Model.new_session`, `new_sessions`), of its context size,
key/value type and end-of-generation ids, so the graphs captured are the very ones that later
steps look up; nothing any caller holds is touched, and later results are what they would have
been (a graph is the same whenever it is captured).  Where no step is captured (CPU, graphs off
or failed, `DS4_CUDA_GRAPHS=0`) it runs nothing and says why.  `plan` is the pure part: which
lengths and batch sizes a warm-up runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine import cuda_graphs
from engine.batch import decode_batch

if TYPE_CHECKING:
    from engine.model import Model


@dataclass(frozen=True)
class Plan:
    """What a warm-up runs: prompt lengths prefilled (each in a fresh session) and the batch
    sizes of the decoding steps after them."""

    prompts: tuple[int, ...]
    batches: tuple[int, ...]


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up did: its plan, the new graphs it captured and its wall time; `skipped`
    says why nothing ran (then `plan` is None), or why the graphs were off after it ran (a
    capture that failed turns them off)."""

    seconds: float
    plan: Plan | None = None
    graphs: int = 0
    skipped: str | None = None

    def describe(self) -> str:
        """One line for banners and run headers."""
        if self.plan is None:
            return f"warm-up: none ({self.skipped})"
        p = self.plan
        line = (f"warm-up: {self.graphs} CUDA graphs captured in {self.seconds:.2f} s (decoding steps of "
                f"{p.batches[0]}-{p.batches[-1]} rows, prompts of {p.prompts[0]}-{p.prompts[-1]} tokens)")
        return line if self.skipped is None else f"{line}; then {self.skipped}: steps run eagerly"


def plan(rows: int, n_ctx: int, buckets: tuple[int, ...], graph_tokens: int, chunk: int) -> Plan:
    """The warm-up of a model of `n_ctx` positions whose batches reach `rows` rows, its graphs'
    `buckets` of rows taking prefills of up to `graph_tokens` tokens and its eager prefill
    `chunk` tokens at a time: every bucket's prefill piece, the eager prefill just past
    `graph_tokens` and at a whole chunk, and the decoding steps of every bucket up to the one of
    `rows` (at most the largest).  A prompt of n tokens prefills its first n - 1 (its last is a
    decoding step), so each prompt is one token longer than the prefill it meets; it leaves a
    position free for the step after it."""
    if rows < 1:
        raise ValueError(f"a warm-up needs at least one row, got {rows}")
    longest = n_ctx - 1
    piece = min(buckets[-1], graph_tokens)
    prefills = (*(b for b in buckets if b <= piece), graph_tokens + 1, chunk)
    prompts = sorted({min(n + 1, longest) for n in prefills}) if longest >= 1 else []  # one position: none
    top = next(b for b in buckets if min(rows, buckets[-1]) <= b)
    return Plan(tuple(prompts), tuple(b for b in buckets if b <= top))


def _why_not(model: "Model") -> str | None:
    graphs = model.net.decode_graphs
    if graphs is None:
        return f"no captured steps on {model.device.type}"
    if not graphs.enabled:
        return f"CUDA graphs are off: {graphs.disabled_reason or 'turned off'}"
    return None


def warm_up(model: "Model", rows: int = 1) -> WarmUp:
    """Run `plan(rows, ...)` on throwaway sessions of `model` where its steps are captured
    (see the module docstring); a report of what ran."""
    t0 = time.perf_counter()
    skipped = _why_not(model)
    if skipped is not None:
        return WarmUp(0.0, skipped=skipped)
    graphs = model.net.decode_graphs
    before = graphs.graph_count
    p = plan(rows, model.n_ctx, cuda_graphs.BUCKETS, cuda_graphs.PREFILL_GRAPH_TOKENS, model.prefill_chunk)
    ids = [i % model.n_vocab for i in range(max(p.prompts, default=1))]  # any ids: only the shapes matter
    for n in p.prompts:
        model.new_session().sync(ids[:n])
    sessions = model.new_sessions(p.batches[-1])
    for b in p.batches:
        for s in sessions[:b]:
            s.sync(ids[:1])  # one position cached, so that every step fits any context
        decode_batch(sessions[:b], ids[:b] if b <= len(ids) else [0] * b)
    skipped = _why_not(model)  # a capture that failed turned the graphs off
    return WarmUp(time.perf_counter() - t0, p, graphs.graph_count - before, skipped)
