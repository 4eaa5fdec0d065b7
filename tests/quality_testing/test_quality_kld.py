"""The corpus-KLD release gate's judge (quality_testing.gate_kld): each bound bites, alone."""
from __future__ import annotations

import dataclasses

from ds4bench.kldstats import Interval, KLDSummary
from quality_testing import gate_kld as gk

GOOD = KLDSummary(positions=2000, windows=4, kl_mean=Interval(1e-4, 8e-5, 1.2e-4), kl_median=5e-5, kl_p99=1e-3,
                  kl_p999=4e-3, kl_max=1e-2, same_top=Interval(0.99, 0.985, 0.995), ppl_base=20.0, ppl_cand=20.02,
                  ppl_ratio=Interval(1.001, 1.0, 1.002), rms_dp=3e-3, flips=20, near_ties=15, real_flips=5,
                  tie_gap=0.1, first_flip=None, known_share=1.0, base_rest_mean=0.05)


def test_measured_like_figures_pass():
    assert gk.judge(GOOD) == []


def test_every_bound_fails_on_its_own():
    b = gk.BOUNDS
    worse = {
        "mean KL": {"kl_mean": Interval(b.max_kl_mean * 2, 0, 1)},
        "p99.9": {"kl_p999": b.max_kl_p999 * 2},
        "same-top": {"same_top": Interval(b.min_same_top - 0.01, 0, 1)},
        "perplexity ratio": {"ppl_ratio": Interval(1 + 2 * b.max_ppl_ratio_dev, 1, 1.1)},
        "real argmax flips": {"real_flips": int(b.max_real_flips_share * GOOD.positions) + 1},
    }
    for word, change in worse.items():
        failures = gk.judge(dataclasses.replace(GOOD, **change))
        assert len(failures) == 1 and word in failures[0], (word, failures)
