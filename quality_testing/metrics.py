"""Comparisons of next-token logit vectors: an engine's against a reference's.

`compare(ref, eng)` takes two [n_vocab] logit vectors for the same position and returns a
`PositionStats`; `summarize` reduces many to mean and max. All maths is float64 on numpy
arrays, so the comparison itself adds no error worth speaking of. Pure: no I/O, no model.

Metrics (p = softmax(reference), q = softmax(engine)):
  max_abs      max_i |eng_i - ref_i|
  rms          sqrt(mean_i (eng_i - ref_i)^2)
  kl           KL(p || q) = sum_i p_i (log p_i - log q_i), nats: the reference's view of
               how much probability mass the engine moved
  top1         1 when the engine's argmax is the reference's, else 0; with `tie` > 0, also 1
               when the engine's argmax has a reference logit within `tie` of the reference's
               maximum (a reference stored in float16 cannot order tokens closer than its
               rounding: see `float16_tie`)
  overlap_k    |top-k(ref) ∩ top-k(eng)| / k, for k = 5 and 20
  dp_top       q[t] - p[t] where t is the reference's argmax (signed; thresholds use |dp_top|)
Logits are compared raw, not shifted: both implementations produce unnormalized scores of
the same output head, so a constant offset between them is itself a difference worth seeing.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

TOPK = (5, 20)


@dataclass(frozen=True)
class PositionStats:
    max_abs: float
    rms: float
    kl: float
    top1: float
    overlap5: float
    overlap20: float
    dp_top: float


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _topk(x: np.ndarray, k: int) -> set[int]:
    k = min(k, x.size)  # a vocabulary smaller than k: the whole of it
    return set(np.argpartition(-x, k - 1)[:k].tolist())


def float16_tie(ref: np.ndarray) -> float:
    """The spacing of float16 numbers at the size of the largest reference logit: closer ties are noise."""
    return float(np.spacing(np.float16(np.abs(np.asarray(ref, dtype=np.float64)).max())))


def compare(ref: np.ndarray, eng: np.ndarray, tie: float = 0.0) -> PositionStats:
    ref = np.asarray(ref, dtype=np.float64).reshape(-1)
    eng = np.asarray(eng, dtype=np.float64).reshape(-1)
    if ref.shape != eng.shape:
        raise ValueError(f"logit vectors differ in size: {ref.shape[0]} vs {eng.shape[0]}")
    d = eng - ref
    lp, lq = log_softmax(ref), log_softmax(eng)
    p = np.exp(lp)
    t = int(ref.argmax())
    overlaps = [len(_topk(ref, k) & _topk(eng, k)) / min(k, ref.size) for k in TOPK]
    return PositionStats(
        max_abs=float(np.abs(d).max()),
        rms=float(np.sqrt(np.mean(d * d))),
        kl=float(max(0.0, np.sum(p * (lp - lq)))),  # clamp: rounding can give -1e-17
        top1=1.0 if ref[int(eng.argmax())] >= ref[t] - tie else 0.0,
        overlap5=overlaps[0],
        overlap20=overlaps[1],
        dp_top=float(np.exp(lq[t]) - p[t]),
    )


def compare_rows(ref: np.ndarray, eng: np.ndarray, float16_ref: bool = False) -> list[PositionStats]:
    """Row-wise `compare` of two [P, n_vocab] arrays; `float16_ref`: forgive ties below float16 rounding."""
    if ref.shape != eng.shape:
        raise ValueError(f"logit arrays differ in shape: {ref.shape} vs {eng.shape}")
    return [compare(r, e, float16_tie(r) if float16_ref else 0.0) for r, e in zip(ref, eng)]


@dataclass(frozen=True)
class Summary:
    n: int
    mean: PositionStats
    max: PositionStats  # per metric the worst value: the largest, or for top1/overlaps the smallest


WORSE_IS_LOWER = {"top1", "overlap5", "overlap20"}


def summarize(stats: Sequence[PositionStats]) -> Summary:
    if not stats:
        raise ValueError("nothing to summarize")
    mean, worst = {}, {}
    for f in fields(PositionStats):
        vals = np.array([getattr(s, f.name) for s in stats], dtype=np.float64)
        mean[f.name] = float(vals.mean())
        if f.name in WORSE_IS_LOWER:
            worst[f.name] = float(vals.min())
        elif f.name == "dp_top":
            worst[f.name] = float(vals[np.abs(vals).argmax()])
        else:
            worst[f.name] = float(vals.max())
    return Summary(len(stats), PositionStats(**mean), PositionStats(**worst))
