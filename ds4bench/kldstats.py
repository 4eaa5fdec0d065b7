"""Corpus KL divergence statistics: a base's stored top-K against a candidate. Pure numpy, no I/O.

Per scored position t (the distribution over the token after position t) the base keeps its
top-K token ids S_t with their log-probs log p_i, and the log-probability of the token that
actually follows. The candidate supplies log q_i for the ids of S_t it knows (all of them
for the engine, which has its whole distribution; only those inside its own top list for an
endpoint), its own top token and its log-probability of the following token.

KL(base || candidate) over a partition. With S'_t the ids of S_t whose candidate log-prob is
known, the vocabulary is split into the |S'_t| singletons and one "rest" bucket holding every
other token, with mass P_rest = 1 - sum_{S'} p_i on the base side and Q_rest = 1 - sum_{S'} q_i
on the candidate side:

    KL_t = sum_{i in S'} p_i (log p_i - log q_i) + P_rest (log P_rest - log Q_rest)

(a bucket of mass 0 adds 0; Q_rest is floored at REST_FLOOR so that rounding of a top list
that holds all the mass cannot divide by zero). Merging tokens can only lose information, so
KL_t <= the full-vocabulary KL, and the gap is exactly P_rest * KL(base tail || candidate
tail), the divergence inside the rest bucket weighted by its mass.  With S' = the whole
vocabulary it is the exact KL.  How much mass the rest holds depends on the model and the text
(the embedded 135M model leaves 11-17% of it outside its top 32 on the shipped corpus, on average;
`base_rest_mean` reports it), so compare KL figures made with the same K.

Other figures (`summarize`):
  perplexity   exp(-mean log p(next token)) for each side over all positions; the ratio
               candidate / base = exp(mean(log p_base - log p_cand)).
  intervals    95% percentile bootstrap over blocks of BLOCK consecutive positions of a
               window (positions next to each other are not independent draws): blocks are
               resampled with replacement, RESAMPLES times with a fixed seed, for the mean KL,
               the same-top rate and the perplexity ratio.
  same top     the base's top token (rank 1 of its top-K) equals the candidate's.
  RMS dp       sqrt(mean((q(next) - p(next))^2)), the probability of the following token.
  flips        positions whose top tokens differ, split by the base's top-2 gap
               log p_1 - log p_2: below `tie_gap` nats a near-tie (the order of two almost
               equal tokens), otherwise a real flip; the first differing position is kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

REST_FLOOR = 1e-12
BLOCK = 64
RESAMPLES = 2000
SEED = 7
DEFAULT_TIE_GAP = 0.1
PERCENTILES = (50.0, 99.0, 99.9)


@dataclass(frozen=True)
class Scores:
    """Per-position figures of one stack over T positions (numpy arrays, first axis T).

    top_ids [T, K] and top_logprobs [T, K]: the stack's own top list, best first (an id of -1
    pads a shorter list); lse [T]: log-sum-exp of the raw logits (NaN when unknown);
    target_logprobs [T]: log-prob of the token that follows; probe_logprobs [T, Kp]: log-probs
    at ids the caller asked for (NaN where the stack does not know them), or None.
    """

    top_ids: np.ndarray
    top_logprobs: np.ndarray
    lse: np.ndarray
    target_logprobs: np.ndarray
    probe_logprobs: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.target_logprobs.shape[0])


def concat_scores(parts: Sequence[Scores]) -> Scores:
    probe = None if any(p.probe_logprobs is None for p in parts) else np.concatenate([p.probe_logprobs for p in parts])
    return Scores(np.concatenate([p.top_ids for p in parts]), np.concatenate([p.top_logprobs for p in parts]),
                  np.concatenate([p.lse for p in parts]), np.concatenate([p.target_logprobs for p in parts]), probe)


def log_softmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise (log-softmax, log-sum-exp) in float64."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    return x - lse, lse[..., 0]


def scores_from_logits(logits: np.ndarray, targets: Sequence[int], k: int,
                       probe: np.ndarray | None = None) -> Scores:
    """The reference reduction of full logits [T, V] to `Scores` (the engine stack does the same in torch)."""
    lp, lse = log_softmax(logits)
    k = min(k, lp.shape[1])
    order = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    rows = np.arange(lp.shape[0])[:, None]
    tgt = lp[np.arange(lp.shape[0]), np.asarray(targets, dtype=np.int64)]
    pr = None if probe is None else lp[rows, np.asarray(probe, dtype=np.int64)]
    return Scores(order.astype(np.int64), lp[rows, order], lse, tgt, pr)


def position_kl(base_logprobs: np.ndarray, cand_logprobs: np.ndarray) -> np.ndarray:
    """KL_t over the base's top-K plus the rest bucket (module docstring); inputs [T, K], NaN = unknown."""
    lp = np.asarray(base_logprobs, dtype=np.float64)
    lq = np.asarray(cand_logprobs, dtype=np.float64)
    known = ~np.isnan(lq) & np.isfinite(lp)
    lq0, lp0 = np.where(known, lq, 0.0), np.where(known, lp, 0.0)
    p, q = np.where(known, np.exp(lp0), 0.0), np.where(known, np.exp(lq0), 0.0)
    head = (p * (lp0 - lq0)).sum(axis=1)
    p_rest = np.clip(1.0 - p.sum(axis=1), 0.0, 1.0)
    q_rest = np.maximum(1.0 - q.sum(axis=1), REST_FLOOR)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.where(p_rest > 0, p_rest * (np.log(np.where(p_rest > 0, p_rest, 1.0)) - np.log(q_rest)), 0.0)
    return head + tail


def full_kl(base_logits: np.ndarray, cand_logits: np.ndarray) -> np.ndarray:
    """Brute-force KL(base || candidate) over the whole vocabulary, per row: the oracle for tests."""
    lp, _ = log_softmax(base_logits)
    lq, _ = log_softmax(cand_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float


@dataclass(frozen=True)
class FirstFlip:
    position: int  # index among all scored positions
    window: int
    offset: int  # position inside the window: the distribution after its token `offset`
    base_top: int
    cand_top: int
    base_gap: float  # base log p_1 - log p_2, nats


@dataclass(frozen=True)
class KLDSummary:
    positions: int
    windows: int
    kl_mean: Interval
    kl_median: float
    kl_p99: float
    kl_p999: float
    kl_max: float
    same_top: Interval
    ppl_base: float
    ppl_cand: float
    ppl_ratio: Interval
    rms_dp: float
    flips: int
    near_ties: int
    real_flips: int
    tie_gap: float
    first_flip: FirstFlip | None
    known_share: float  # share of base top-K entries whose candidate log-prob was known
    base_rest_mean: float  # mean base mass outside the top-K


def block_ids(window_lengths: Sequence[int], block: int = BLOCK) -> np.ndarray:
    """Block number of every position: windows are cut into runs of `block` positions."""
    out, nxt = [], 0
    for n in window_lengths:
        nb = max(1, -(-int(n) // block))
        out.append(nxt + np.arange(int(n)) // block)
        nxt += nb
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def bootstrap_ratio(num: np.ndarray, den: np.ndarray, blocks: np.ndarray, resamples: int = RESAMPLES,
                    seed: int = SEED, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of sum(num) / sum(den) with blocks resampled with replacement."""
    nb = int(blocks.max()) + 1 if blocks.size else 0
    if nb < 2:
        v = float(num.sum() / den.sum())
        return v, v
    bn = np.bincount(blocks, weights=num, minlength=nb)
    bd = np.bincount(blocks, weights=den, minlength=nb)
    rng = np.random.default_rng(seed)
    stats = []
    chunk = max(1, 4_000_000 // nb)
    for start in range(0, resamples, chunk):
        draw = rng.integers(0, nb, size=(min(chunk, resamples - start), nb))
        stats.append(bn[draw].sum(axis=1) / bd[draw].sum(axis=1))
    allv = np.concatenate(stats)
    tail = (1.0 - level) / 2
    low, high = np.quantile(allv, [tail, 1.0 - tail])
    return float(low), float(high)


def window_of(window_lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(window index, offset inside the window) of every position."""
    win = np.repeat(np.arange(len(window_lengths)), window_lengths)
    starts = np.concatenate([[0], np.cumsum(window_lengths)[:-1]]).astype(np.int64) if len(window_lengths) else []
    return win, np.arange(int(np.sum(window_lengths))) - np.repeat(starts, window_lengths)


def summarize(base: Scores, cand: Scores, window_lengths: Sequence[int], tie_gap: float = DEFAULT_TIE_GAP,
              block: int = BLOCK, resamples: int = RESAMPLES, seed: int = SEED) -> tuple[KLDSummary, np.ndarray]:
    """Every figure of the module docstring, and the per-position KL array. `cand.probe_logprobs`
    holds the candidate's log-probs at `base.top_ids`."""
    n = len(base)
    if n == 0 or len(cand) != n or int(np.sum(window_lengths)) != n:
        raise ValueError(f"positions differ: base {n}, candidate {len(cand)}, windows {int(np.sum(window_lengths))}")
    if cand.probe_logprobs is None or cand.probe_logprobs.shape != base.top_logprobs.shape:
        raise ValueError("the candidate's log-probs at the base's top-K ids are missing")
    kl = position_kl(base.top_logprobs, cand.probe_logprobs)
    blocks = block_ids(window_lengths, block)
    ones = np.ones(n)
    kl_lo, kl_hi = bootstrap_ratio(kl, ones, blocks, resamples, seed)
    same = (base.top_ids[:, 0] == cand.top_ids[:, 0]).astype(np.float64)
    st_lo, st_hi = bootstrap_ratio(same, ones, blocks, resamples, seed)
    lb = base.target_logprobs.astype(np.float64)
    lc = cand.target_logprobs.astype(np.float64)
    d = lb - lc
    r_lo, r_hi = bootstrap_ratio(d, ones, blocks, resamples, seed)
    gap = (base.top_logprobs[:, 0].astype(np.float64) - base.top_logprobs[:, 1]) if base.top_logprobs.shape[1] > 1 \
        else np.full(n, np.inf)
    flipped = same == 0
    near = flipped & (gap < tie_gap)
    first = None
    if flipped.any():
        i = int(np.argmax(flipped))
        win, off = window_of(window_lengths)
        first = FirstFlip(i, int(win[i]), int(off[i]), int(base.top_ids[i, 0]), int(cand.top_ids[i, 0]), float(gap[i]))
    med, p99, p999 = (float(x) for x in np.percentile(kl, PERCENTILES))
    p_base_head = np.exp(np.where(np.isfinite(base.top_logprobs), base.top_logprobs, -np.inf).astype(np.float64))
    summary = KLDSummary(
        positions=n, windows=len(window_lengths),
        kl_mean=Interval(float(kl.mean()), kl_lo, kl_hi), kl_median=med, kl_p99=p99, kl_p999=p999,
        kl_max=float(kl.max()),
        same_top=Interval(float(same.mean()), st_lo, st_hi),
        ppl_base=float(np.exp(-lb.mean())), ppl_cand=float(np.exp(-lc.mean())),
        ppl_ratio=Interval(float(np.exp(d.mean())), float(np.exp(r_lo)), float(np.exp(r_hi))),
        rms_dp=float(np.sqrt(np.mean((np.exp(lc) - np.exp(lb)) ** 2))),
        flips=int(flipped.sum()), near_ties=int(near.sum()), real_flips=int((flipped & ~near).sum()),
        tie_gap=float(tie_gap), first_flip=first,
        known_share=float(np.mean(~np.isnan(cand.probe_logprobs))),
        base_rest_mean=float(np.mean(np.clip(1.0 - p_base_head.sum(axis=1), 0.0, 1.0))),
    )
    return summary, kl


def window_rows(kl: np.ndarray, base: Scores, cand: Scores, window_lengths: Sequence[int]) -> list[dict[str, float]]:
    """Per window: positions, mean and max KL, same-top rate, both perplexities."""
    rows, start = [], 0
    for w, n in enumerate(window_lengths):
        sl = slice(start, start + int(n))
        start += int(n)
        rows.append({"window": w, "positions": int(n), "kl_mean": float(kl[sl].mean()), "kl_max": float(kl[sl].max()),
                     "same_top": float(np.mean(base.top_ids[sl, 0] == cand.top_ids[sl, 0])),
                     "ppl_base": float(np.exp(-np.mean(base.target_logprobs[sl], dtype=np.float64))),
                     "ppl_cand": float(np.exp(-np.mean(cand.target_logprobs[sl], dtype=np.float64)))})
    return rows
