"""Sampling filters and seeded reproducibility on fixed logits (no model)."""
from __future__ import annotations

import pytest
import torch

from engine.device_sampling import DeviceLogits
from engine.sampling import Sampler, SamplingParams, apply_logit_bias, filtered_probs, greedy_id

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])


def test_greedy_is_argmax_and_ignoring_eos_skips_it():
    assert Sampler(SamplingParams())(LOGITS) == 5
    assert Sampler(SamplingParams(argmax_ignoring_eos=True), frozenset({5}))(LOGITS) == 0
    assert Sampler(SamplingParams(argmax_ignoring_eos=True), frozenset({1}))(LOGITS) == 5  # eos not the best
    tie = torch.tensor([3.0, 1.0, 3.0])  # an eos id tied first with another: the other wins
    assert Sampler(SamplingParams(argmax_ignoring_eos=True), frozenset({0}))(tie) == 2
    assert torch.equal(tie, torch.tensor([3.0, 1.0, 3.0]))  # the caller's row is not modified


@pytest.mark.parametrize("row", [
    torch.tensor([1.0, 3.0, 3.0, -1.0]),  # ties: the lowest index
    torch.tensor([1.0, float("nan"), 5.0, float("nan")]),  # a NaN wins, the first one
    torch.full((5,), float("-inf")),
    torch.randn(49152),
    torch.randn(3, 70000)[1],  # a row of a batch
    torch.randn(70000)[::7],  # not contiguous
    torch.randn(5, dtype=torch.float64),
], ids=["ties", "nan", "all-inf", "vocab", "batch-row", "strided", "float64"])
def test_greedy_id_is_torch_argmax(row):
    assert greedy_id(row) == int(torch.argmax(row))


def test_top_k_keeps_k_tokens():
    p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert set(torch.nonzero(p).flatten().tolist()) == {0, 5}
    assert p.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_nucleus():
    full = torch.softmax(LOGITS, -1)
    p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=float(full[5]) + 1e-3))
    assert set(torch.nonzero(p).flatten().tolist()) == {0, 5}
    p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    assert torch.nonzero(p).flatten().tolist() == [5]


def test_min_p_drops_unlikely_tokens():
    p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))
    full = torch.softmax(LOGITS, -1)
    assert set(torch.nonzero(p).flatten().tolist()) == {i for i in range(6) if full[i] >= 0.3 * full.max()}


def test_seed_reproduces_the_stream_and_temperature_spreads_it():
    params = SamplingParams(temperature=1.5, seed=123)
    a = [Sampler(params)(LOGITS) for _ in range(1)]
    s1, s2 = Sampler(params), Sampler(params)
    draws1 = [s1(LOGITS) for _ in range(50)]
    draws2 = [s2(LOGITS) for _ in range(50)]
    assert draws1 == draws2 and draws1[0] == a[0]
    assert len(set(draws1)) > 2


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0),
                                dict(top_k=-3), dict(temperature=float("nan")), dict(logit_bias=((1, 101.0),)),
                                dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((1, float("nan")),))])
def test_invalid_params_are_rejected(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_temperature_below_float32_range_samples_the_argmax():
    # 1e-300 is 0 in float32: dividing by it used to give NaN probabilities.
    logits = torch.tensor([1.0, 3.0, float("-inf"), 2.0])
    for t in (1e-300, 5e-324, 1e-40):
        assert Sampler(SamplingParams(temperature=t, seed=1))(logits) == 1


def test_top_p_too_small_for_float32_keeps_the_most_likely_token():
    logits = torch.tensor([1.0, 3.0, 2.0])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=1e-300))
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_logit_bias_adds_bans_at_minus_100_and_forces_at_plus_100():
    biased = apply_logit_bias(LOGITS, ((0, 1.5), (5, -100.0)))
    assert biased[0] == pytest.approx(3.5) and biased[5] == float("-inf") and biased[1] == LOGITS[1]
    assert Sampler(SamplingParams(logit_bias=((5, -100.0),)))(LOGITS) == 0
    assert Sampler(SamplingParams(logit_bias=((0, 1.5),)))(LOGITS) == 0
    forced = SamplingParams(temperature=2.0, seed=1, logit_bias=((3, 100.0), (4, 100.0)))
    sampler = Sampler(forced)
    assert {sampler(LOGITS) for _ in range(50)} == {3, 4}
    # A ban wins over a sampler that would otherwise draw the token often.
    banned = Sampler(SamplingParams(temperature=1.5, seed=2, logit_bias=((5, -100.0), (0, -100.0))))
    assert not {banned(LOGITS) for _ in range(50)} & {0, 5}


def test_a_forced_token_that_a_mask_removed_leaves_the_mask_alone():
    masked = LOGITS.clone()
    masked[[1, 5]] = float("-inf")
    out = apply_logit_bias(masked, ((5, 100.0),))
    assert torch.equal(torch.isfinite(out), torch.isfinite(masked))


def test_a_biased_device_row_is_not_answered_from_the_steps_greedy_ids():
    row = DeviceLogits(LOGITS.clone(), greedy=5, greedy_no_eos=0, eos_ids=frozenset({5}))
    sampler = Sampler(SamplingParams(logit_bias=((5, -100.0), (1, 50.0))))
    assert row.greedy_column(sampler) is None and row.pick(sampler) == 1
    assert Sampler(SamplingParams(logit_bias=((5, -100.0), (1, 50.0))))(row) == 1
    draws = Sampler(SamplingParams(temperature=1.0, seed=3, logit_bias=((2, 100.0),)))
    assert {draws(row) for _ in range(10)} == {2}


def test_a_chooser_that_names_its_greedy_column_is_asked_and_other_choosers_are_not():
    """`greedy_column` (what a scheduler runs ahead on): a Sampler's column, a ColumnChooser's
    own answer, nothing for any other callable or for a row on the host."""
    from engine.device_sampling import ColumnChooser, greedy_column

    row = DeviceLogits(LOGITS.clone(), greedy=5, greedy_no_eos=0, eos_ids=frozenset({5}))

    class Names:
        def __init__(self, column):
            self.column, self.asked = column, []

        def __call__(self, logits) -> int:
            return 0

        def greedy_column(self, logits):
            self.asked.append(logits)
            return self.column

    assert isinstance(Names(1), ColumnChooser) and not isinstance(lambda logits: 0, ColumnChooser)
    for column in (0, 1, None):
        chooser = Names(column)
        assert greedy_column(row, chooser) == column and chooser.asked == [row]
        assert greedy_column(LOGITS, chooser) is None  # a host row: the step has no ids to run on
    assert greedy_column(row, lambda logits: 0) is None
    assert greedy_column(row, Sampler(SamplingParams(temperature=0.0))) == 0
    assert greedy_column(row, Sampler(SamplingParams(argmax_ignoring_eos=True), frozenset({5}))) == 1
