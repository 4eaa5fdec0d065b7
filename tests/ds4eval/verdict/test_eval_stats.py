"""ds4eval.verdict.stats: McNemar against textbook values and brute force; the paired bootstrap against
exact enumeration and by its coverage on synthetic paired data."""

import itertools
import math

import numpy as np
import pytest

from ds4eval.verdict import stats


@pytest.mark.parametrize("b, c, p_exact, mid_p", [
    # Fagerland, Lydersen and Laake (2013), BMC Med Res Methodol 13:91, Table 1 (airway
    # hyper-responsiveness before and after stem cell transplantation): exact 0.070, mid-p 0.039.
    (1, 7, 18 / 256, 10 / 256),
    (7, 1, 18 / 256, 10 / 256),
    # 1 against 9 of 10 discordant pairs: 2 (C(10,0) + C(10,1)) / 2**10, mid-p less C(10,1) / 2**10.
    (1, 9, 22 / 1024, 12 / 1024),
    # All one way: the smallest n with p < 0.05 is 6 (2/64).
    (5, 0, 2 / 32, 1 / 32),
    (6, 0, 2 / 64, 1 / 64),
    # All ties and no discordant pairs at all: nothing against the null.
    (4, 4, 1.0, 1.0),
    (0, 0, 1.0, 1.0),
])
def test_mcnemar_textbook_values(b, c, p_exact, mid_p):
    t = stats.mcnemar(b, c)
    assert t.p_exact == pytest.approx(p_exact, rel=1e-12) and t.mid_p == pytest.approx(mid_p, rel=1e-12)
    assert t.discordant == b + c


def _brute_force(b: int, c: int) -> tuple[float, float]:
    """Every way the n discordant pairs could have split, equally likely under the null: the
    one-sided tail at the smaller count, doubled (mid-p: the observed split counts half)."""
    n, k = b + c, min(b, c)
    below = equal = 0
    for signs in itertools.product((0, 1), repeat=n):
        x = sum(signs)
        below += x < k
        equal += x == k
    total = 2 ** n
    return min(1.0, 2 * (below + equal) / total), min(1.0, 2 * (below + equal / 2) / total)


@pytest.mark.parametrize("b, c", [(b, c) for b in range(8) for c in range(8) if b + c <= 12])
def test_mcnemar_agrees_with_brute_force(b, c):
    want_p, want_mid = _brute_force(b, c)
    t = stats.mcnemar(b, c)
    assert t.p_exact == pytest.approx(want_p, abs=1e-15) and t.mid_p == pytest.approx(want_mid, abs=1e-15)


def test_mcnemar_large_counts_are_exact_and_fast():
    t = stats.mcnemar(4_950, 5_050)
    # Normal approximation with continuity correction: z = (|b - c| - 1) / sqrt(b + c).
    z = (100 - 1) / math.sqrt(10_000)
    assert t.p_exact == pytest.approx(math.erfc(z / math.sqrt(2)), rel=0.02)
    assert stats.mcnemar(0, 3000).p_exact == 0.0  # 2**-2999 underflows to 0, never negative
    with pytest.raises(ValueError):
        stats.mcnemar(-1, 2)


def _exact_bootstrap(base, new):
    """The exact bootstrap distribution: every one of the n**n resamples of case indices."""
    d = np.asarray(new, int) - np.asarray(base, int)
    n = len(d)
    idx = np.array(list(itertools.product(range(n), repeat=n)))
    return d[idx].mean(axis=1)


@pytest.mark.parametrize("base, new", [
    ([1, 1, 1, 0, 0, 1], [1, 0, 1, 1, 0, 0]),
    ([0, 0, 0, 0, 1, 1, 1], [1, 1, 0, 0, 1, 1, 0]),
    ([1, 1, 1, 1, 1], [0, 1, 1, 1, 1]),
])
def test_bootstrap_agrees_with_exact_enumeration(base, new):
    exact = _exact_bootstrap(base, new)
    iv = stats.paired_bootstrap(np.array(base, bool), np.array(new, bool))
    n = len(base)
    assert iv.delta == pytest.approx(np.mean(new) - np.mean(base))
    lo, hi = np.quantile(exact, [0.025, 0.975])
    # The resampled quantiles land on the exact ones up to one step of the 1/n grid.
    assert abs(iv.low - lo) <= 1 / n + 1e-12 and abs(iv.high - hi) <= 1 / n + 1e-12
    # And the whole distribution matches: its mean and spread, within Monte Carlo error.
    rng = np.random.default_rng(stats.BOOTSTRAP_SEED)
    d = np.asarray(new, int) - np.asarray(base, int)
    counts = rng.multinomial(n, [np.mean(d > 0), np.mean(d < 0), np.mean(d == 0)], size=10_000)
    draws = (counts[:, 0] - counts[:, 1]) / n
    assert draws.mean() == pytest.approx(exact.mean(), abs=4 * exact.std() / 100)
    assert draws.std() == pytest.approx(exact.std(), rel=0.03)


def test_bootstrap_is_reproducible_and_degenerate_cases():
    rng = np.random.default_rng(1)
    base, new = rng.random(300) < 0.5, rng.random(300) < 0.6
    a, b = stats.paired_bootstrap(base, new), stats.paired_bootstrap(base, new)
    assert a == b and a.resamples >= 10_000 and a.low < a.delta < a.high
    assert stats.paired_bootstrap(base, new, seed=2) != a
    same = stats.paired_bootstrap(base, base)
    assert (same.delta, same.low, same.high) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        stats.paired_bootstrap([], [])
    with pytest.raises(ValueError):
        stats.paired_bootstrap([True], [True, False])


def test_bootstrap_coverage_on_synthetic_paired_data():
    """Datasets of 200 paired cases, strongly correlated (most cases keep their verdict): the 95%
    interval must cover the true delta about 95% of the time. An unpaired interval (treating the
    two sides as independent samples) is far wider here and would cover nearly always."""
    rng = np.random.default_rng(20240614)
    n, trials = 200, 400
    p_base, p_loss, p_gain = 0.5, 0.10, 0.16  # P(pass->fail | pass), P(fail->pass | fail)
    true_delta = (1 - p_base) * p_gain - p_base * p_loss
    covered, widths = 0, []
    for _ in range(trials):
        base = rng.random(n) < p_base
        u = rng.random(n)
        new = np.where(base, u >= p_loss, u < p_gain)
        iv = stats.paired_bootstrap(base, new, resamples=2_000, seed=int(rng.integers(1 << 30)))
        covered += iv.low <= true_delta <= iv.high
        widths.append(iv.high - iv.low)
    coverage = covered / trials
    assert 0.92 <= coverage <= 0.975, coverage
    unpaired_width = 2 * 1.96 * math.sqrt(2 * 0.5 * 0.5 / n)
    assert np.mean(widths) < 0.6 * unpaired_width



# ---------------------------------------------------------------- repeated runs

@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_and_pass_hat_k_against_enumeration(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            assert stats.pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
            assert stats.pass_hat_k(n, c, k) == pytest.approx(sum(all(s) for s in subsets) / len(subsets))
    assert stats.pass_at_k(n, 0, 1) == 0.0 and stats.pass_hat_k(n, n, n) == 1.0


def test_pass_at_k_refuses_impossible_counts():
    for args in ((3, 4, 1), (3, 1, 0), (3, 1, 4), (0, 0, 1)):
        with pytest.raises(ValueError):
            stats.pass_at_k(*args)


@pytest.mark.parametrize("table, two_sided, less, greater", [
    # Fisher's tea-tasting table: 3 of 4 cups right; one-sided 17/70, two-sided 34/70.
    ((3, 1, 1, 3), 34 / 70, 69 / 70, 17 / 70),
    # The dieting table of the usual textbook example: two-sided p = 0.002759.
    ((1, 9, 11, 3), 0.0027594, 0.0013797, 0.9999663),
    # No information: every table of these margins equally likely or only one possible.
    ((0, 0, 0, 0), 1.0, 1.0, 1.0),
    ((3, 0, 3, 0), 1.0, 1.0, 1.0),
])
def test_fisher_exact_known_tables(table, two_sided, less, greater):
    f = stats.fisher_exact(*table)
    assert f.p_two_sided == pytest.approx(two_sided, rel=1e-4)
    assert f.p_less == pytest.approx(less, rel=1e-4) and f.p_greater == pytest.approx(greater, rel=1e-4)


def test_fisher_exact_against_direct_enumeration_of_tables():
    # Every 2x2 table with small margins: sum the hypergeometric probabilities by hand.
    for a, b, c, d in itertools.product(range(4), repeat=4):
        row1, col1, n = a + b, a + c, a + b + c + d
        if n == 0:
            continue
        probs = {x: math.comb(row1, x) * math.comb(n - row1, col1 - x) / math.comb(n, col1)
                 for x in range(max(0, col1 - (n - row1)), min(row1, col1) + 1)}
        want = sum(p for p in probs.values() if p <= probs[a] * (1 + 1e-9))
        assert stats.fisher_exact(a, b, c, d).p_two_sided == pytest.approx(min(1.0, want), rel=1e-9)


def test_bootstrap_mean_covers_the_true_mean():
    rng = np.random.default_rng(3)
    hits = 0
    for trial in range(200):
        values = rng.binomial(3, 0.4, size=60) / 3
        iv = stats.bootstrap_mean(values, resamples=2000, seed=trial)
        hits += iv.low <= 0.4 <= iv.high
    assert 0.90 <= hits / 200 <= 0.99
    same = stats.bootstrap_mean([0.5, 0.5])
    assert (same.mean, same.low, same.high) == (0.5, 0.5, 0.5)
    assert stats.bootstrap_mean([0.0, 1.0, 1.0], seed=5) == stats.bootstrap_mean([0.0, 1.0, 1.0], seed=5)


# ---------------------------------------------------------------- one run

@pytest.mark.parametrize("passed, n, low, high", [
    # Textbook values of the 95% Wilson interval.
    (5, 10, 0.23659, 0.76341),
    (0, 10, 0.0, 0.27753),
    (10, 10, 0.72247, 1.0),
    (1, 1, 0.20654, 1.0),
])
def test_wilson_known_values(passed, n, low, high):
    iv = stats.wilson(passed, n)
    assert iv.rate == passed / n and iv.level == 0.95
    assert iv.low == pytest.approx(low, abs=1e-4) and iv.high == pytest.approx(high, abs=1e-4)


def test_wilson_bounds_are_where_the_score_test_just_rejects():
    # Each bound p solves (k/n - p)^2 = z^2 p (1 - p) / n.
    z = 1.959963984540054
    for k, n in ((13, 41), (3, 200), (99, 100)):
        iv = stats.wilson(k, n)
        for p in (iv.low, iv.high):
            assert (k / n - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, rel=1e-9)


def test_wilson_bounds_and_coverage():
    # Inside [0, 1], around the rate, exact at the ends, wider at a higher level.
    for n in (1, 2, 7, 50):
        for k in range(n + 1):
            iv = stats.wilson(k, n)
            assert 0.0 <= iv.low <= iv.rate <= iv.high <= 1.0
            wide = stats.wilson(k, n, level=0.99)
            assert wide.low <= iv.low and wide.high >= iv.high
    assert stats.wilson(0, 5).low == 0.0 and stats.wilson(5, 5).high == 1.0
    # Coverage of the true rate over binomial draws is close to the nominal 95%.
    rng = np.random.default_rng(7)
    draws = rng.binomial(80, 0.3, size=2000)
    covered = np.mean([stats.wilson(int(k), 80).low <= 0.3 <= stats.wilson(int(k), 80).high for k in draws])
    assert 0.92 <= covered <= 0.98


@pytest.mark.parametrize("passed, n, level", [(1, 0, 0.95), (-1, 3, 0.95), (4, 3, 0.95), (1, 3, 1.0)])
def test_wilson_rejects_bad_input(passed, n, level):
    with pytest.raises(ValueError):
        stats.wilson(passed, n, level)
