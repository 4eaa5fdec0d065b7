"""Tests for quality_testing.metrics: the logit comparison maths, on hand-made vectors."""
from __future__ import annotations

import math

import numpy as np
import pytest

from quality_testing import metrics as mx


def test_identical_vectors_show_no_difference():
    x = np.random.default_rng(0).normal(size=300) * 5
    s = mx.compare(x, x.copy())
    assert s.max_abs == 0 and s.rms == 0 and s.kl == 0
    assert s.top1 == 1 and s.overlap5 == 1 and s.overlap20 == 1 and s.dp_top == 0


def test_constant_offset_moves_logits_but_not_probabilities():
    x = np.random.default_rng(1).normal(size=300)
    s = mx.compare(x, x + 0.5)
    assert s.max_abs == pytest.approx(0.5) and s.rms == pytest.approx(0.5)
    assert s.kl < 1e-12 and s.top1 == 1 and abs(s.dp_top) < 1e-12


def test_kl_and_dp_top_match_hand_computation():
    ref = np.array([2.0, 1.0, 0.0])
    eng = np.array([1.0, 2.0, 0.0])
    p = np.exp(ref) / np.exp(ref).sum()
    q = np.exp(eng) / np.exp(eng).sum()
    s = mx.compare(ref, eng)
    assert s.kl == pytest.approx(float(np.sum(p * np.log(p / q))))
    assert s.dp_top == pytest.approx(q[0] - p[0]) and s.dp_top < 0
    assert s.top1 == 0
    assert s.max_abs == 1.0 and s.rms == pytest.approx(math.sqrt(2 / 3))


def test_topk_overlap_counts_shared_members():
    ref = np.arange(40, dtype=np.float64)  # top-5: 35..39
    eng = ref.copy()
    eng[39], eng[0] = -10.0, 100.0  # 39 leaves the top, 0 enters
    s = mx.compare(ref, eng)
    assert s.overlap5 == pytest.approx(4 / 5)
    assert s.overlap20 == pytest.approx(19 / 20)
    assert s.top1 == 0


def test_float16_inputs_are_compared_in_float64():
    x = np.linspace(-20, 20, 1000)
    s = mx.compare(x.astype(np.float16), x)
    assert 0 < s.max_abs < 0.01  # float16 rounding near |20|
    assert s.top1 == 1


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        mx.compare(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError):
        mx.compare_rows(np.zeros((2, 3)), np.zeros((3, 3)))


def test_summary_worst_takes_the_right_direction():
    a = mx.PositionStats(1.0, 0.1, 0.01, 1.0, 1.0, 0.9, -0.2)
    b = mx.PositionStats(3.0, 0.3, 0.03, 0.0, 0.6, 1.0, 0.1)
    s = mx.summarize([a, b])
    assert s.n == 2
    assert s.mean.max_abs == 2.0 and s.mean.top1 == 0.5
    assert s.max.max_abs == 3.0 and s.max.kl == 0.03
    assert s.max.top1 == 0.0 and s.max.overlap5 == 0.6 and s.max.overlap20 == 0.9
    assert s.max.dp_top == -0.2  # largest magnitude, sign kept
    with pytest.raises(ValueError):
        mx.summarize([])


def test_ties_below_float16_rounding_are_forgiven_only_when_asked():
    ref = np.array([20.0, 20.005, 3.0])  # float16 cannot tell the first two apart
    eng = np.array([20.01, 20.0, 3.0])
    assert mx.compare(ref, eng).top1 == 0
    assert mx.float16_tie(ref) == pytest.approx(2 ** -6)
    assert mx.compare(ref, eng, tie=mx.float16_tie(ref)).top1 == 1
    assert mx.compare_rows(ref[None], eng[None], float16_ref=True)[0].top1 == 1
    far = np.array([19.0, 20.0, 3.0])  # a real disagreement stays one
    assert mx.compare(far, np.array([20.0, 19.0, 3.0]), tie=mx.float16_tie(far)).top1 == 0
