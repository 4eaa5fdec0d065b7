"""Power of the paired verdicts: what drop a comparison can detect, and how many cases it needs. Pure.

The model
- A suite's cases are a `Population`: each case's chance of passing under one system (a case
  drawn from the suite at random). Two runs of the same system disagree on a case with chance
  2 p (1 - p); the mean of that over cases is the *discordance*, the noise a paired test works
  against (0 for greedy decoding of one model file, which is deterministic).
- A regression of `drop` (a share: 0.05 is 5 points) multiplies every case's chance of passing
  by 1 - drop / P, where P is the population's pass rate: the pass rate falls by exactly `drop`,
  a case that always passed now fails with chance drop / P, and a case that never passed stays
  failed (`regressed`).
- A paired comparison sorts every case into worse / better / tie: with one run a side, a
  pass->fail flip / fail->pass flip / same verdict; with K repeats a side, a lower / higher /
  equal share of passing repeats. With cases drawn independently, (worse, better) is
  Multinomial(n, p_worse, p_better) (`outcome_chances`), and the verdict is the exact McNemar
  (sign) test of `stats.mcnemar`: a significant regression when its two-sided exact p < alpha
  and worse > better.

Contract
- `regression_power(n, p_worse, p_better, alpha)`: the chance of that verdict, computed exactly
  (a sum over the number of discordant cases m of P(m) P(reject | m); no simulation).
  `critical_better(m, alpha)`: the most "better" cases m discordant cases may hold and still
  be a significant regression (-1: none), equal to `stats.mcnemar`'s decision.
- `cases_needed(...)`: the fewest cases whose power reaches the target (None: not within
  MAX_CASES); exact power is saw-toothed in n (the test is discrete), so a few more cases than
  the answer can fall short by a hair: the smallest n is what is reported.
- `detectable_drop(...)`: the smallest drop detected with the target power at n cases
  (bisection, to DROP_TOLERANCE); None when even a drop to zero passes is not.
- `population_from_rates(P, D)`: the simplest suite with pass rate P and discordance D: a share
  f = D / (2 P (1 - P)) of cases flaky at P itself, the rest always passing or never in the
  proportion P : 1 - P (any D up to its maximum 2 P (1 - P), where every case is flaky).
  `population_from_counts` takes per-case (passed, graded) counts of repeats.
- `unpaired_cases` / `unpaired_detectable_drop` / `unpaired_power`: the two-sample z-test
  sizing of TensorRT-LLM's accuracy suite, n = 2 sigma^2 (z_(1-a) + z_(power))^2 / drop^2 per
  side with sigma^2 = P (1 - P), here one-sided at alpha / 2 (the error rate the paired test
  allows in the drop direction), so the two designs are sized for the same false alarms.
- `binomial_cdf(k, n, p)`: P(Binomial(n, p) <= k), summed in log space over the terms that
  matter; what the exact computations above are built on.
It reads no files and prints nothing; `plan` and `compare` use it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

import numpy as np

MAX_CASES = 1_000_000
SAWTOOTH_WALK = 8  # cases below the bisection's answer also tried (the saw-tooth spans a few)
DROP_TOLERANCE = 1e-4  # a detectable drop is found to a hundredth of a point
_WINDOW_SD = 8  # binomial sums cover the mean +- this many standard deviations (the rest < 1e-14)


# ---------------------------------------------------------------- binomial arithmetic

@functools.lru_cache(maxsize=8)
def _log_factorials(size: int) -> np.ndarray:
    return np.array([math.lgamma(k + 1) for k in range(size + 1)])


def _log_fact(n: int) -> np.ndarray:
    size = 1024
    while size < n:
        size *= 4
    return _log_factorials(size)


def _log_pmf(ks: np.ndarray, n: int, p: float) -> np.ndarray:
    """log P(X = k) for X ~ Binomial(n, p), for each k of `ks` (0 <= k <= n)."""
    lf = _log_fact(n)
    out = lf[n] - lf[ks] - lf[n - ks]
    with np.errstate(divide="ignore", invalid="ignore"):
        if p <= 0.0:
            return np.where(ks == 0, 0.0, -np.inf)
        if p >= 1.0:
            return np.where(ks == n, 0.0, -np.inf)
        return out + ks * math.log(p) + (n - ks) * math.log1p(-p)


def _window(n: int, p: float) -> tuple[int, int]:
    sd = math.sqrt(n * p * (1 - p))
    reach = _WINDOW_SD * sd + 30
    return max(0, int(n * p - reach)), min(n, int(math.ceil(n * p + reach)))


def _sum_exp(logs: np.ndarray) -> float:
    if logs.size == 0:
        return 0.0
    top = float(np.max(logs))
    if top == -math.inf:
        return 0.0
    return math.exp(top) * float(np.sum(np.exp(logs - top)))


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed over the terms that matter (see _WINDOW_SD)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    lo, hi = _window(n, p)
    if k < lo:
        return 0.0
    if k >= hi:
        return 1.0
    # Sum the smaller side, so the answer keeps its relative precision in either tail.
    if k - lo < hi - k:
        return min(1.0, _sum_exp(_log_pmf(np.arange(lo, k + 1), n, p)))
    return max(0.0, 1.0 - _sum_exp(_log_pmf(np.arange(k + 1, hi + 1), n, p)))


@functools.lru_cache(maxsize=200_000)
def critical_better(m: int, alpha: float) -> int:
    """The most cases that improved, of m discordant cases, with which the rest are still a
    significant regression: the largest k < m / 2 with 2 P(Binomial(m, 1/2) <= k) < alpha;
    -1 when no split of m is significant."""
    if m < 1:
        return -1
    z = NormalDist().inv_cdf(1 - alpha / 2)
    k = max(-1, min((m - 1) // 2, int(m / 2 - z * math.sqrt(m) / 2)))
    while k >= 0 and 2 * binomial_cdf(k, m, 0.5) >= alpha:
        k -= 1
    while k + 1 < m - (k + 1) and 2 * binomial_cdf(k + 1, m, 0.5) < alpha:
        k += 1
    return k


def _cdf_rows(ks: np.ndarray, ms: np.ndarray, p: float) -> np.ndarray:
    """P(Binomial(m, p) <= k) for each pair of `ks` and `ms`, at once: each row sums its terms
    inside the window of _WINDOW_SD around its mean (absolute error below 1e-14)."""
    sd = np.sqrt(ms * p * (1 - p))
    reach = _WINDOW_SD * sd + 30
    lo = np.maximum(0, np.floor(ms * p - reach)).astype(np.int64)
    top = np.minimum(ks, np.minimum(ms, np.ceil(ms * p + reach))).astype(np.int64)
    width = int(max(1, (top - lo).max() + 1))
    js = lo[:, None] + np.arange(width)[None, :]  # [rows, width]
    inside = js <= top[:, None]
    js = np.where(inside, js, 0)
    mm = np.broadcast_to(ms[:, None], js.shape)
    lf = _log_fact(int(ms.max()))
    with np.errstate(divide="ignore", invalid="ignore"):
        if p <= 0.0:
            terms = np.where(js == 0, 0.0, -np.inf)
        elif p >= 1.0:
            terms = np.where(js == mm, 0.0, -np.inf)
        else:
            terms = lf[mm] - lf[js] - lf[mm - js] + js * math.log(p) + (mm - js) * math.log1p(-p)
    out = np.where(inside, np.exp(terms), 0.0).sum(axis=1)
    return np.where(ks < 0, 0.0, np.clip(out, 0.0, 1.0))


def regression_power(n: int, p_worse: float, p_better: float, alpha: float) -> float:
    """The chance that n cases, each worse with chance p_worse and better with p_better,
    make a significant regression in the exact McNemar (sign) test at alpha."""
    if n < 1:
        return 0.0
    d = p_worse + p_better
    if d <= 0.0:
        return 0.0
    d = min(d, 1.0)
    share_better = p_better / d
    lo, hi = _window(n, d)
    ms = np.arange(max(lo, 1), hi + 1)
    weights = np.exp(_log_pmf(ms, n, d))
    crits = np.array([critical_better(int(m), alpha) for m in ms])
    # Given m discordant cases, a regression is "at most crit(m) of them better".
    return float(np.clip(np.dot(weights, _cdf_rows(crits, ms, share_better)), 0.0, 1.0))


# ---------------------------------------------------------------- populations

@dataclass(frozen=True)
class Population:
    """Each kind of case's chance of passing under one system, with the share of the suite's
    cases of that kind; cases are drawn from it at random."""

    rates: tuple[float, ...]
    weights: tuple[float, ...]  # shares of the cases, summing to 1

    def __post_init__(self) -> None:
        if not self.rates or len(self.rates) != len(self.weights):
            raise ValueError("a population needs one weight per rate, and at least one rate")
        if any(not 0.0 <= r <= 1.0 for r in self.rates) or any(w < 0 for w in self.weights):
            raise ValueError("rates must be in [0, 1] and weights >= 0")
        if not math.isclose(sum(self.weights), 1.0, abs_tol=1e-9):
            raise ValueError("weights must sum to 1")

    @classmethod
    def of(cls, rates: Sequence[float], weights: Sequence[float] | None = None) -> "Population":
        """From rates and (unnormalized) weights; equal weights by default. Equal rates merge."""
        w = np.ones(len(rates)) if weights is None else np.asarray(weights, dtype=float)
        merged: dict[float, float] = {}
        for r, x in zip(rates, w):
            if x > 0:
                merged[float(r)] = merged.get(float(r), 0.0) + float(x)
        total = sum(merged.values())
        if not merged or total <= 0:
            raise ValueError("a population needs at least one case")
        return cls(tuple(merged), tuple(x / total for x in merged.values()))

    @property
    def pass_rate(self) -> float:
        return float(np.dot(self.rates, self.weights))

    @property
    def discordance(self) -> float:
        """The share of cases two independent single runs disagree on."""
        r = np.asarray(self.rates)
        return float(np.dot(2 * r * (1 - r), self.weights))


def max_discordance(pass_rate: float) -> float:
    """The most two runs can disagree at this pass rate: every case flaky at the pass rate."""
    return 2 * pass_rate * (1 - pass_rate)


def population_from_rates(pass_rate: float, discordance: float) -> Population:
    """A share D / (2 P (1 - P)) of cases flaky at P, the rest stable (see the module)."""
    if not 0.0 <= pass_rate <= 1.0:
        raise ValueError("the pass rate must be in [0, 1]")
    top = max_discordance(pass_rate)
    if not 0.0 <= discordance <= top + 1e-12:
        raise ValueError(f"a discordance of {discordance:g} is impossible at a pass rate of {pass_rate:g}: "
                         f"it must be in [0, {top:.4g}]")
    if top == 0.0:  # every case passes, or none does: nothing can be flaky
        return Population.of((1.0, 0.0), (pass_rate, 1.0 - pass_rate))
    flaky = 1.0 if discordance >= top - 1e-12 else discordance / top
    return Population.of((1.0, pass_rate, 0.0), (pass_rate * (1 - flaky), flaky, (1 - pass_rate) * (1 - flaky)))


def population_from_counts(counts: Sequence[tuple[int, int]]) -> Population:
    """Per case (passed, graded) over repeats -> its observed share of passing (cases never
    graded are left out)."""
    rates = [p / g for p, g in counts if g > 0]
    if not rates:
        raise ValueError("no graded case to estimate pass rates from")
    return Population.of(rates)


def estimated_discordance(counts: Sequence[tuple[int, int]]) -> float | None:
    """The unbiased estimate of the discordance from per-case repeat counts: the mean of
    2 c (K - c) / (K (K - 1)) over cases graded at least twice; None when none was."""
    terms = [2 * p * (g - p) / (g * (g - 1)) for p, g in counts if g >= 2]
    return sum(terms) / len(terms) if terms else None


def regressed(pop: Population, drop: float) -> Population:
    """`pop` after a regression of `drop`: every case's chance scaled by 1 - drop / P."""
    if not 0.0 <= drop <= pop.pass_rate + 1e-12:
        raise ValueError(f"a drop of {drop:g} exceeds the pass rate {pop.pass_rate:g}")
    scale = max(0.0, 1.0 - drop / pop.pass_rate)
    return Population(tuple(r * scale for r in pop.rates), pop.weights)


def _share_pmfs(rates: np.ndarray, k: int) -> np.ndarray:
    """[cases, k + 1]: each case's Binomial(k, rate) distribution of passing repeats."""
    ks = np.arange(k + 1)
    lf = _log_fact(k)
    comb = np.exp(lf[k] - lf[ks] - lf[k - ks])
    with np.errstate(divide="ignore", invalid="ignore"):
        out = comb * np.power.outer(rates, ks) * np.power.outer(1 - rates, k - ks)
    return np.nan_to_num(out)


def outcome_chances(base: Population, new: Population, base_repeats: int = 1,
                    new_repeats: int = 1) -> tuple[float, float]:
    """(p_worse, p_better): the chance that a case drawn at random passes a smaller / larger
    share of its repeats under `new` than under `base` (the populations pair kind by kind, as
    `regressed` makes them)."""
    if len(base.rates) != len(new.rates) or base.weights != new.weights:
        raise ValueError("the populations must list the same kinds of case")
    if base_repeats < 1 or new_repeats < 1:
        raise ValueError("repeats must be at least 1")
    b = _share_pmfs(np.asarray(base.rates), base_repeats)  # [cases, Kb + 1]
    a = _share_pmfs(np.asarray(new.rates), new_repeats)    # [cases, Kn + 1]
    # Shares x / Kb and y / Kn compared without division: y Kb against x Kn.
    x = np.arange(base_repeats + 1)[:, None] * new_repeats
    y = np.arange(new_repeats + 1)[None, :] * base_repeats
    joint = b[:, :, None] * a[:, None, :]  # [kinds, Kb + 1, Kn + 1]
    w = np.asarray(base.weights)
    worse = float(np.dot((joint * (y < x)).sum(axis=(1, 2)), w))
    better = float(np.dot((joint * (y > x)).sum(axis=(1, 2)), w))
    return worse, better


# ---------------------------------------------------------------- planning

@dataclass(frozen=True)
class Design:
    """A paired comparison to plan: the population of BASE, repeats a side and the test level."""

    population: Population
    alpha: float = 0.05
    base_repeats: int = 1
    new_repeats: int = 1

    def chances(self, drop: float) -> tuple[float, float]:
        return outcome_chances(self.population, regressed(self.population, drop), self.base_repeats,
                               self.new_repeats)

    def power(self, n: int, drop: float) -> float:
        """The chance that n cases show a regression of `drop` as significant."""
        return regression_power(n, *self.chances(drop), self.alpha)


def cases_needed(design: Design, drop: float, power: float, max_cases: int = MAX_CASES) -> int | None:
    """The fewest cases with which `design` detects `drop` with at least `power` (see the module)."""
    worse, better = design.chances(drop)

    def enough(n: int) -> bool:
        return regression_power(n, worse, better, design.alpha) >= power

    # Bracket around the normal approximation, bisect on the (nearly monotone) power, then walk
    # down a few cases for the saw-tooth: a smaller n just below can reach the target too.
    d, effect = worse + better, worse - better
    inv = NormalDist().inv_cdf
    guess = (inv(1 - design.alpha / 2) * math.sqrt(d) + inv(power) * math.sqrt(max(d - effect ** 2, 0.0))) ** 2
    start = max(1, min(max_cases, int(guess / max(effect, 1e-12) ** 2)))
    if enough(start):  # walk down until too few
        hi, lo = start, max(1, int(start / 1.25))
        while enough(lo):
            if lo == 1:
                return 1
            hi, lo = lo, max(1, int(lo / 1.25))
    else:  # walk up until enough
        lo, hi = start, min(max_cases, math.ceil(start * 1.25) + 1)
        while not enough(hi):
            if hi == max_cases:
                return None
            lo, hi = hi, min(max_cases, math.ceil(hi * 1.25) + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if enough(mid):
            hi = mid
        else:
            lo = mid
    best = hi
    for n in range(hi - 1, max(0, hi - 1 - SAWTOOTH_WALK), -1):
        if enough(n):
            best = n
    return best


def detectable_drop(design: Design, n: int, power: float) -> float | None:
    """The smallest drop (a share) that n cases detect with at least `power`; None if none does."""
    top = design.population.pass_rate
    if n < 1 or design.power(n, top) < power:
        return None
    lo, hi = 0.0, top
    while hi - lo > DROP_TOLERANCE:
        mid = (lo + hi) / 2
        if design.power(n, mid) >= power:
            hi = mid
        else:
            lo = mid
    return hi


def _z_sum(alpha: float, power: float) -> float:
    inv = NormalDist().inv_cdf
    return inv(1 - alpha / 2) + inv(power)


def unpaired_cases(pass_rate: float, drop: float, alpha: float, power: float) -> int:
    """Cases per run the unpaired two-sample z-test needs (see the module)."""
    if drop <= 0:
        raise ValueError("the drop must be positive")
    return math.ceil(2 * pass_rate * (1 - pass_rate) * (_z_sum(alpha, power) / drop) ** 2)


def unpaired_detectable_drop(pass_rate: float, n: int, alpha: float, power: float) -> float:
    """The smallest drop the unpaired z-test detects at n cases per run."""
    return _z_sum(alpha, power) * math.sqrt(2 * pass_rate * (1 - pass_rate) / n)


def unpaired_power(pass_rate: float, n: int, drop: float, alpha: float) -> float:
    """The unpaired z-test's power against `drop` at n cases per run (normal approximation)."""
    sd = math.sqrt(2 * pass_rate * (1 - pass_rate) / n)
    if sd == 0:
        return 1.0 if drop > 0 else 0.0
    return NormalDist().cdf(drop / sd - NormalDist().inv_cdf(1 - alpha / 2))
