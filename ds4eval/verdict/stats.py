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
- Repeated runs: `pass_at_k(n, c, k)` and `pass_hat_k(n, c, k)` are the unbiased estimators of
  "at least one of k samples passes" and "all k pass" from c passes in n samples;
  `fisher_exact(a, b, c, d)` tests a case's pass counts on two sides (exact, two-sided and both
  one-sided p-values); `bootstrap_mean(values)` is the percentile interval of a mean over cases.
- One run: `wilson(passed, n, level=0.95) -> RateInterval` is the Wilson score interval of a
  pass rate (closed form, no resampling). It stays inside [0, 1] and is not degenerate at 0 or
  n passes, where the normal-approximation (Wald) interval collapses to a point.
- Equivalence: `paired_equivalence(b, c, n, margin, alpha) -> Equivalence` is the two one-sided
  tests (TOST) of "the paired pass-rate change lies within +-margin", each one Tango's score
  test for the difference of paired proportions (Tango 1998), whose variance comes from the
  maximum-likelihood cell shares under the null boundary: unlike a Wald test it does not claim
  equivalence from zero discordant pairs on a handful of cases. b and c may be fractional (an
  expected table; see `compare`).
- Several tests at once: `holm(p_values, alpha) -> list[HolmResult]` is Holm's step-down
  adjustment (family-wise error <= alpha under any dependence), in the order given.
It does not decide what is a regression (see `compare`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
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


# ---------------------------------------------------------------- repeated runs

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k samples passes, from c passes in n
    samples: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021). Exact up to the final division."""
    _check_counts(n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that all of k samples pass ("pass^k"): C(c, k) / C(n, k)."""
    _check_counts(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


def _check_counts(n: int, c: int, k: int) -> None:
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= passes <= samples and 1 <= k <= samples (got n={n}, c={c}, k={k})")


@dataclass(frozen=True)
class Fisher:
    table: tuple[int, int, int, int]  # (a, b, c, d): row 1 = (a, b), row 2 = (c, d)
    p_two_sided: float
    p_less: float      # P(first cell <= a): row 1's share is lower than row 2's
    p_greater: float   # P(first cell >= a)


def fisher_exact(a: int, b: int, c: int, d: int) -> Fisher:
    """Fisher's exact test of the 2x2 table [[a, b], [c, d]] with fixed margins.

    The first cell is hypergeometric given the margins. Two-sided p sums the tables no more
    probable than the observed one (the usual definition, with a relative tolerance of 1e-7 so
    that tables of equal probability are not split by rounding). Exact integer arithmetic for
    the probabilities' numerators."""
    if min(a, b, c, d) < 0:
        raise ValueError("table counts must be >= 0")
    row1, col1, n = a + b, a + c, a + b + c + d
    lo, hi = max(0, col1 - (n - row1)), min(row1, col1)
    weights = {x: math.comb(row1, x) * math.comb(n - row1, col1 - x) for x in range(lo, hi + 1)}
    total = math.comb(n, col1)
    observed = weights[a]
    limit = observed * (1 + 1e-7)
    two = sum(w for w in weights.values() if w <= limit)
    less = sum(w for x, w in weights.items() if x <= a)
    greater = sum(w for x, w in weights.items() if x >= a)
    return Fisher((a, b, c, d), min(1.0, two / total), min(1.0, less / total), min(1.0, greater / total))


@dataclass(frozen=True)
class MeanInterval:
    mean: float
    low: float
    high: float
    level: float
    resamples: int
    seed: int
    n: int


def bootstrap_mean(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                   level: float = 0.95) -> MeanInterval:
    """Percentile bootstrap interval of the mean of per-case values (for example each case's
    share of passing repeats), resampling cases with replacement. Fixed seed."""
    v = np.asarray(values, dtype=float)
    if v.ndim != 1 or v.size == 0:
        raise ValueError("need a non-empty 1-D sequence")
    if resamples < 1 or not 0 < level < 1:
        raise ValueError("need resamples >= 1 and 0 < level < 1")
    mean = float(v.mean())
    if np.all(v == v[0]):
        return MeanInterval(mean, mean, mean, level, resamples, seed, int(v.size))
    rng = np.random.default_rng(seed)
    # Chunks keep the index matrix small for large runs.
    means, chunk = [], max(1, 2_000_000 // v.size)
    for start in range(0, resamples, chunk):
        m = min(chunk, resamples - start)
        means.append(v[rng.integers(0, v.size, size=(m, v.size))].mean(axis=1))
    allm = np.concatenate(means)
    tail = (1.0 - level) / 2
    low, high = np.quantile(allm, [tail, 1.0 - tail])
    return MeanInterval(mean, float(low), float(high), level, resamples, seed, int(v.size))


# ---------------------------------------------------------------- one run

@dataclass(frozen=True)
class RateInterval:
    passed: int
    n: int
    rate: float  # passed / n
    low: float
    high: float
    level: float


def wilson(passed: int, n: int, level: float = 0.95) -> RateInterval:
    """Wilson score interval of the pass rate passed/n (Wilson 1927): the rates p whose
    normal-approximation test |passed/n - p| <= z sqrt(p (1 - p) / n) does not reject."""
    if n < 1 or not 0 <= passed <= n:
        raise ValueError(f"need n >= 1 and 0 <= passed <= n (got passed={passed}, n={n})")
    if not 0 < level < 1:
        raise ValueError("need 0 < level < 1")
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    p, z2 = passed / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At 0 or n passes the bound is exactly 0 or 1; rounding would leave it a hair off.
    low = 0.0 if passed == 0 else max(0.0, centre - half)
    high = 1.0 if passed == n else min(1.0, centre + half)
    return RateInterval(passed, n, p, low, high, level)


# ---------------------------------------------------------------- equivalence

@dataclass(frozen=True)
class Equivalence:
    margin: float      # the change judged negligible, as a share (0.05 = 5 points)
    alpha: float
    delta: float       # observed (c - b) / n: NEW's pass rate minus BASE's
    p_lower: float     # test of "NEW is worse by margin or more" (H0: delta <= -margin)
    p_upper: float     # test of "NEW is better by margin or more" (H0: delta >= margin)

    @property
    def p(self) -> float:
        """The TOST p-value: the larger of the two one-sided p-values."""
        return max(self.p_lower, self.p_upper)

    @property
    def equivalent(self) -> bool:
        return self.p < self.alpha


def _tango_z(b: float, c: float, n: int, d0: float) -> float:
    """Tango's score statistic for H0: p_b - p_c = d0, where p_b is the share of pass->fail
    pairs and p_c of fail->pass pairs. The null variance uses the constrained maximum-likelihood
    p_c, the root of 2n x^2 + (-(b + c) + (2n - b + c) d0) x - c d0 (1 - d0) = 0."""
    qa, qb, qc = 2 * n, -(b + c) + (2 * n - b + c) * d0, -c * d0 * (1 - d0)
    x = (-qb + math.sqrt(max(0.0, qb * qb - 4 * qa * qc))) / (2 * qa)
    var = n * (2 * x + d0 * (1 - d0))
    if var <= 0:  # d0 = 0 with no discordant pairs: nothing against the null
        return 0.0
    return (b - c - n * d0) / math.sqrt(var)


def paired_equivalence(b: float, c: float, n: int, margin: float, alpha: float = 0.05) -> Equivalence:
    """TOST of |p_c - p_b| < margin on n paired cases with b pass->fail and c fail->pass pairs."""
    if n < 1 or b < 0 or c < 0 or b + c > n:
        raise ValueError(f"need n >= 1 and 0 <= b, c with b + c <= n (got b={b}, c={c}, n={n})")
    if not 0 < margin < 1 or not 0 < alpha < 1:
        raise ValueError("need 0 < margin < 1 and 0 < alpha < 1")
    phi = NormalDist().cdf
    # "NEW worse by >= margin" is p_b - p_c >= margin: rejected when z is far below zero.
    p_lower = phi(_tango_z(b, c, n, margin))
    # "NEW better by >= margin" is p_b - p_c <= -margin: rejected when z is far above zero.
    p_upper = 1 - phi(_tango_z(b, c, n, -margin))
    return Equivalence(margin, alpha, (c - b) / n, p_lower, p_upper)


# ---------------------------------------------------------------- several tests

@dataclass(frozen=True)
class HolmResult:
    p: float
    adjusted: float  # Holm-adjusted p: compare with alpha directly
    rejected: bool


def holm(p_values: Sequence[float], alpha: float = 0.05) -> list[HolmResult]:
    """Holm's step-down procedure over the given p-values, results in the order given.

    Sorted ascending, the i-th smallest (from 0) is compared with alpha / (m - i); testing
    stops at the first that is not below it. The adjusted p is the running maximum of
    (m - i) p_(i), capped at 1, so `adjusted < alpha` is the same decision."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return [HolmResult(p, a, a < alpha) for p, a in zip(p_values, adjusted)]
