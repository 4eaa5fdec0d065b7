"""Paired statistics for two runs over the same cases. Pure functions; numpy only.

Contract
- `mcnemar(b, c) -> McNemar`: b and c are the discordant pairs (pass->fail and fail->pass).
  `p_exact` is the exact two-sided McNemar test, the binomial test of the discordant pairs:
  under "the change moves no case's chance of passing", X ~ Binomial(b + c, 1/2) and
  p = min(1, 2 P(X <= min(b, c))). `mid_p` subtracts the probability of the observed split
  itself, P(X = min(b, c)), which removes most of the exact test's conservatism (Fagerland,
  Lydersen and Laake 2013). With no discordant pairs both are 1. Exact integer arithmetic.
- `paired_bootstrap(base, new, resamples=10_000, seed=BOOTSTRAP_SEED, level=0.95)`: the
  percentile interval of mean(new) - mean(base) over cases resampled with replacement (both
  sides of a case travel together). Each case's paired difference is -1, 0 or +1, so a
  resample's sum depends only on how many of its n draws hit each kind, and those counts are
  Multinomial(n, observed shares): drawing the counts is the same distribution as drawing n
  case indices, in O(resamples) instead of O(resamples x cases). Fixed seed: the same inputs
  always give the same interval.
It does not decide what is a regression (see `compare`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

BOOTSTRAP_SEED = 14
BOOTSTRAP_RESAMPLES = 10_000


@dataclass(frozen=True)
class McNemar:
    b: int  # base passed, new failed
    c: int  # base failed, new passed
    p_exact: float
    mid_p: float

    @property
    def discordant(self) -> int:
        return self.b + self.c


def _lower_tail_count(n: int, k: int) -> int:
    """sum_{i <= k} C(n, i), exactly."""
    term = total = 1
    for i in range(k):
        term = term * (n - i) // (i + 1)
        total += term
    return total


def mcnemar(b: int, c: int) -> McNemar:
    if b < 0 or c < 0:
        raise ValueError("discordant counts must be >= 0")
    n, k = b + c, min(b, c)
    if n == 0:
        return McNemar(b, c, 1.0, 1.0)
    tail = _lower_tail_count(n, k)
    denom = 1 << n
    p_exact = min(1.0, 2 * tail / denom)
    mid_p = min(1.0, (2 * tail - math.comb(n, k)) / denom)
    return McNemar(b, c, p_exact, mid_p)


@dataclass(frozen=True)
class Interval:
    delta: float  # observed mean(new) - mean(base)
    low: float
    high: float
    level: float
    resamples: int
    seed: int
    n: int


def paired_bootstrap(base: Sequence[bool], new: Sequence[bool], resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> Interval:
    """Percentile bootstrap interval of the paired pass-rate delta (see the module docstring)."""
    b = np.asarray(base, dtype=bool)
    a = np.asarray(new, dtype=bool)
    if b.shape != a.shape or b.ndim != 1:
        raise ValueError("base and new must be 1-D and of equal length")
    n = int(b.size)
    if n == 0:
        raise ValueError("no cases to resample")
    if resamples < 1 or not 0 < level < 1:
        raise ValueError("need resamples >= 1 and 0 < level < 1")
    up = int(np.count_nonzero(a & ~b))
    down = int(np.count_nonzero(b & ~a))
    delta = (up - down) / n
    if up == down == 0:
        return Interval(0.0, 0.0, 0.0, level, resamples, seed, n)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, [up / n, down / n, (n - up - down) / n], size=resamples)
    deltas = (counts[:, 0] - counts[:, 1]) / n
    tail = (1.0 - level) / 2
    low, high = np.quantile(deltas, [tail, 1.0 - tail])
    return Interval(delta, float(low), float(high), level, resamples, seed, n)
