"""ds4eval.verdict.stats: the paired TOST (Tango's score test) by its definition, its size at the
margin on simulated paired data, and Holm's step-down adjustment against hand-worked values and by
its family-wise error on simulated null p-values."""

import math

import numpy as np
import pytest

from ds4eval.verdict import stats


def test_no_discordant_cases_on_a_small_suite_is_not_equivalence():
    """A Wald test would call 41 identical verdicts equivalent within any margin; the score test
    asks whether a drop of the margin could plausibly have left no flip: 0.95^41 = 0.12 can."""
    assert not stats.paired_equivalence(0, 0, 41, 0.05).equivalent
    assert stats.paired_equivalence(0, 0, 41, 0.10).equivalent
    # With no discordant pairs and d0 = margin the statistic is -sqrt(n margin / (1 - margin)).
    e = stats.paired_equivalence(0, 0, 41, 0.05)
    assert e.p_lower == pytest.approx(0.5 * math.erfc(math.sqrt(41 * 0.05 / 0.95) / math.sqrt(2)))


def test_equivalence_is_symmetric_and_follows_the_observed_change():
    a = stats.paired_equivalence(10, 4, 400, 0.05)
    b = stats.paired_equivalence(4, 10, 400, 0.05)
    assert a.p_lower == pytest.approx(b.p_upper) and a.p_upper == pytest.approx(b.p_lower)
    assert a.delta == pytest.approx(-6 / 400)
    assert not stats.paired_equivalence(40, 4, 400, 0.05).equivalent  # a 9-point drop
    with pytest.raises(ValueError):
        stats.paired_equivalence(5, 5, 8, 0.05)


@pytest.mark.parametrize("n, noise", [(200, 0.1), (500, 0.3), (1000, 0.05)])
def test_tost_size_at_the_margin(n, noise):
    """When NEW is truly `margin` worse, equivalence is claimed at most alpha of the time (within
    simulation error: 4,000 trials, standard error 0.35 points)."""
    rng = np.random.default_rng(5)
    margin, alpha, trials = 0.05, 0.05, 4000
    p_b, p_c = noise / 2 + margin, noise / 2
    counts = rng.multinomial(n, [p_b, p_c, 1 - p_b - p_c], size=trials)
    claimed = sum(stats.paired_equivalence(int(b), int(c), n, margin, alpha).equivalent for b, c, _ in counts)
    assert claimed / trials <= alpha + 0.015


def test_holm_by_hand():
    r = stats.holm([0.01, 0.04, 0.03, 0.2], alpha=0.05)
    # sorted 0.01, 0.03, 0.04, 0.2 against 0.05/4, 0.05/3, 0.05/2, 0.05: only the first passes.
    assert [x.rejected for x in r] == [True, False, False, False]
    assert [x.adjusted for x in r] == pytest.approx([0.04, 0.09, 0.09, 0.2])
    assert [x.rejected for x in stats.holm([0.001, 0.012, 0.02], 0.05)] == [True, True, True]
    assert stats.holm([], 0.05) == []


def test_holm_family_wise_error():
    rng = np.random.default_rng(9)
    trials, m, alpha = 5000, 5, 0.05
    p = rng.uniform(size=(trials, m))
    any_rejected = sum(any(x.rejected for x in stats.holm(list(row), alpha)) for row in p)
    assert any_rejected / trials <= alpha + 0.01
