"""ds4eval.verdict.power: the exact power against brute force and against simulated paired data
(one run a side and repeats), the planned case counts and detectable drops against simulation,
and the populations and the unpaired formula by their definitions."""

import math

import numpy as np
import pytest

from ds4eval.verdict import power as pw
from ds4eval.verdict import stats

TRIALS = 20_000  # simulated comparisons per check: the standard error of a rate near 0.8 is 0.3 points
TOLERANCE = 0.02  # the brief's bound: planned and simulated power agree within 2 points


def _critical_table(n: int, alpha: float) -> np.ndarray:
    return np.array([pw.critical_better(m, alpha) for m in range(n + 1)])


def simulate_regressions(design: pw.Design, n: int, drop: float, trials: int, seed: int) -> float:
    """The share of `trials` simulated comparisons of n cases drawn from the design's population
    (NEW regressed by `drop`) that the exact McNemar / sign test calls a significant regression."""
    rng = np.random.default_rng(seed)
    base = np.asarray(design.population.rates)
    new = np.asarray(pw.regressed(design.population, drop).rates)
    kinds = rng.choice(base.size, p=design.population.weights, size=(trials, n))
    kb, kn = design.base_repeats, design.new_repeats
    x = rng.binomial(kb, base[kinds]) * kn
    y = rng.binomial(kn, new[kinds]) * kb
    worse, better = (y < x).sum(axis=1), (y > x).sum(axis=1)
    crit = _critical_table(n, design.alpha)
    return float(np.mean((worse > better) & (better <= crit[worse + better])))


@pytest.mark.parametrize("alpha", [0.05, 0.01, 0.1])
def test_critical_counts_are_mcnemars_decision(alpha):
    for m in range(1, 160):
        k = pw.critical_better(m, alpha)
        expected = max([c for c in range(m + 1) if m - c > c and stats.mcnemar(m - c, c).p_exact < alpha], default=-1)
        assert k == expected, m


def test_binomial_cdf_against_exact_sums():
    for n, p in [(10, 0.3), (41, 0.5), (200, 0.07), (1000, 0.9)]:
        for k in range(0, n + 1, max(1, n // 17)):
            exact = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))
            assert pw.binomial_cdf(k, n, p) == pytest.approx(exact, rel=1e-9, abs=1e-14)


def test_regression_power_against_enumeration():
    """Every (worse, better, tie) split of n cases, weighted by its multinomial chance."""
    n, pw_, pb, alpha = 13, 0.3, 0.1, 0.05
    total = 0.0
    for b in range(n + 1):
        for c in range(n + 1 - b):
            chance = math.comb(n, b) * math.comb(n - b, c) * pw_ ** b * pb ** c * (1 - pw_ - pb) ** (n - b - c)
            t = stats.mcnemar(b, c)
            total += chance * (t.p_exact < alpha and b > c)
    assert pw.regression_power(n, pw_, pb, alpha) == pytest.approx(total, rel=1e-9)


def test_populations():
    pop = pw.population_from_rates(0.4, 0.1)
    assert pop.pass_rate == pytest.approx(0.4) and pop.discordance == pytest.approx(0.1)
    assert pw.population_from_rates(0.3, 0.0).rates == (1.0, 0.0)
    every = pw.population_from_rates(0.2, 0.32)  # the most discordance there is: every case flaky at 20%
    assert every.rates == (0.2,) and every.discordance == pytest.approx(0.32)
    with pytest.raises(ValueError, match="impossible"):
        pw.population_from_rates(0.2, 0.4)
    low = pw.regressed(pop, 0.05)
    assert low.pass_rate == pytest.approx(0.35) and low.weights == pop.weights
    counts = [(3, 4), (0, 4), (4, 4), (2, 4)]
    assert pw.population_from_counts(counts).pass_rate == pytest.approx(9 / 16)
    # 2 c (K - c) / (K (K - 1)) averaged: (2*3*1 + 0 + 0 + 2*2*2) / 12 / 4
    assert pw.estimated_discordance(counts) == pytest.approx((6 + 8) / 12 / 4)
    assert pw.estimated_discordance([(1, 1), (0, 1)]) is None


def test_outcome_chances_one_run_a_side():
    pop = pw.population_from_rates(0.5, 0.2)
    assert pw.outcome_chances(pop, pop) == pytest.approx((0.1, 0.1))  # D / 2 each way: pure noise
    worse, better = pw.outcome_chances(pop, pw.regressed(pop, 0.05))
    assert worse - better == pytest.approx(0.05)  # the pass rate falls by the drop


def test_greedy_suite_of_41_cases_detects_only_large_drops():
    """The brief's motivating figure: 41 deterministic cases cannot see a 15-point drop."""
    drop = pw.detectable_drop(pw.Design(pw.population_from_rates(0.34, 0.0)), 41, 0.8)
    assert 0.15 < drop < 0.21


@pytest.mark.parametrize("rate, disc, repeats, n", [(0.5, 0.2, 1, 41), (0.34, 0.0, 1, 41), (0.6, 0.15, 3, 41),
                                                   (0.5, 0.2, 1, 300)])
def test_planned_power_matches_simulation(rate, disc, repeats, n):
    design = pw.Design(pw.population_from_rates(rate, disc), 0.05, repeats, repeats)
    drop = pw.detectable_drop(design, n, 0.8)
    assert drop is not None
    assert design.power(n, drop) >= 0.8
    simulated = simulate_regressions(design, n, drop, TRIALS, seed=7)
    assert abs(simulated - design.power(n, drop)) < TOLERANCE
    assert simulated >= 0.8 - TOLERANCE


@pytest.mark.parametrize("rate, disc, repeats", [(0.5, 0.2, 1), (0.34, 0.05, 1), (0.6, 0.15, 3), (0.5, 0.3, 5)])
def test_false_alarms_stay_below_alpha(rate, disc, repeats):
    design = pw.Design(pw.population_from_rates(rate, disc), 0.05, repeats, repeats)
    simulated = simulate_regressions(design, 41, 0.0, TRIALS, seed=11)
    # Two-sided test, one side judged: at most alpha / 2 in theory; alpha is the promise.
    assert simulated <= design.alpha / 2 + 0.005
    assert design.power(41, 0.0) == pytest.approx(simulated, abs=TOLERANCE)


def test_cases_needed_reach_the_power_and_one_fewer_mostly_does_not():
    design = pw.Design(pw.population_from_rates(0.5, 0.2))
    n = pw.cases_needed(design, 0.1, 0.8)
    assert design.power(n, 0.1) >= 0.8
    assert design.power(n - 1, 0.1) < 0.8
    simulated = simulate_regressions(design, n, 0.1, TRIALS, seed=3)
    assert simulated >= 0.8 - TOLERANCE


def test_repeats_and_pairing_need_fewer_cases():
    pop = pw.population_from_rates(0.5, 0.2)
    one = pw.cases_needed(pw.Design(pop), 0.1, 0.8)
    three = pw.cases_needed(pw.Design(pop, 0.05, 3, 3), 0.1, 0.8)
    assert three < one < pw.unpaired_cases(0.5, 0.1, 0.05, 0.8)


def test_unpaired_formula():
    z = 1.959963984540054 + 0.8416212335729143
    assert pw.unpaired_cases(0.5, 0.05, 0.05, 0.8) == math.ceil(2 * 0.25 * (z / 0.05) ** 2)
    n = 1000
    drop = pw.unpaired_detectable_drop(0.5, n, 0.05, 0.8)
    assert pw.unpaired_power(0.5, n, drop, 0.05) == pytest.approx(0.8)


def test_cases_needed_gives_up_beyond_the_limit():
    design = pw.Design(pw.population_from_rates(0.5, 0.2))
    assert pw.cases_needed(design, 0.01, 0.8, max_cases=2000) is None
    assert pw.detectable_drop(design, 3, 0.8) is None  # three cases never make p < 0.05
