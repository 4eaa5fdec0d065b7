"""Golden continuations: the step judgement (pure), the files' format, and the engine against them.

The model tests run teacher-forced on the CPU packed path: the engine passes; a broken kernel
(one layer missing an input group, or every int4 matmul 1% off) fails; a perturbation of
rounding size passes (the check is not bit-exact).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from quality_testing import golden

# A vocabulary of 6 ids; id 5 plays the end-of-generation token.
EOS = frozenset({5})


def _step(pairs):
    return [[i, lp] for i, lp in pairs]


def _logprobs(values):
    """Log-probs over 6 ids from (id -> log-prob) for the listed ids, the rest far below."""
    lp = np.full(6, -30.0)
    for i, v in values.items():
        lp[i] = v
    return lp


STEP = _step([(2, -0.5), (3, -1.5), (0, -2.5)])  # a clear winner: gap 1.0 nats
TIE = _step([(2, -0.70), (3, -0.72), (0, -2.5)])  # gap 0.02 nats < TIE_MARGIN


def test_judge_exact_match():
    v = golden.judge_step(STEP, _logprobs({2: -0.5, 3: -1.5, 0: -2.5}), EOS)
    assert v.ok and v.argmax_ok and v.delta_ok and not v.near_tie and not v.forgiven
    assert v.chosen == v.stored == 2 and v.runner_up == 3
    assert v.gap == pytest.approx(1.0) and v.max_delta == 0.0


def test_judge_accepts_a_flip_at_a_near_tie():
    v = golden.judge_step(TIE, _logprobs({2: -0.715, 3: -0.705, 0: -2.5}), EOS)
    assert v.near_tie and v.chosen == 3 and v.ok and v.forgiven
    assert v.max_delta == pytest.approx(0.015)


def test_judge_rejects_a_third_token_at_a_near_tie():
    v = golden.judge_step(TIE, _logprobs({2: -0.72, 3: -0.73, 4: -0.70, 0: -2.5}), EOS)
    assert v.near_tie and v.chosen == 4 and not v.argmax_ok and not v.ok


def test_judge_rejects_a_flip_at_a_clear_step_even_with_deltas_within_the_bound():
    step = _step([(2, -0.6), (3, -0.9)])  # gap 0.3 nats >= TIE_MARGIN
    v = golden.judge_step(step, _logprobs({2: -0.8, 3: -0.7}), EOS)  # each 0.2 off, within LOGPROB_BOUND
    assert not v.near_tie and v.chosen == 3 and v.delta_ok
    assert not v.argmax_ok and not v.ok and not v.forgiven


def test_judge_rejects_a_logprob_delta_over_the_bound():
    v = golden.judge_step(STEP, _logprobs({2: -0.5, 3: -1.5, 0: -2.5 - 1.5 * golden.LOGPROB_BOUND}), EOS)
    assert v.argmax_ok and not v.delta_ok and not v.ok
    assert v.worst == 0 and v.max_delta == pytest.approx(1.5 * golden.LOGPROB_BOUND)
    assert (v.worst_stored, v.worst_engine) == (-2.5, pytest.approx(-2.5 - 1.5 * golden.LOGPROB_BOUND))


def test_judge_masks_end_of_generation_as_recording_does():
    v = golden.judge_step(STEP, _logprobs({5: -0.1, 2: -0.5, 3: -1.5, 0: -2.5}), EOS)
    assert v.chosen == 2 and v.ok
    assert golden.judge_step(STEP, _logprobs({5: -0.1, 2: -0.5, 3: -1.5, 0: -2.5})).chosen == 5


def test_judge_fails_on_nan():
    v = golden.judge_step(STEP, _logprobs({2: -0.5, 3: math.nan, 0: -2.5}), EOS)
    assert math.isnan(v.max_delta) and not v.ok


def test_top_entries_rank_without_eos_and_put_the_choice_first():
    lp = _logprobs({5: -0.1, 2: -0.5, 3: -0.5, 0: -2.123456789})
    assert golden.top_entries(lp, EOS, 2, k=3) == [[2, -0.5], [3, -0.5], [0, -2.12346]]
    assert golden.top_entries(lp, EOS, 3, k=3)[0] == [3, -0.5]  # an exact tie: the engine's pick leads


def test_summarize_counts_and_finds_the_first_failure():
    ok = golden.judge_step(STEP, _logprobs({2: -0.5, 3: -1.5, 0: -2.5}))
    flip = golden.judge_step(TIE, _logprobs({2: -0.715, 3: -0.705, 0: -2.5}))
    bad = golden.judge_step(STEP, _logprobs({2: -0.5, 3: -0.9, 0: -2.5}))
    r = golden.summarize("x", [ok, flip, bad] + [ok] * 5)
    assert (r.steps, r.near_ties, r.forgiven, r.failed, r.first_failure) == (8, 1, 1, 1, 2)
    assert r.verdicts[2] is bad and r.worst_step == 2 and r.max_delta == pytest.approx(0.6)
    assert not r.ok and r.mean_ok and r.mean_delta == pytest.approx((0.015 + 0.6) / 8)
    clean = golden.summarize("x", [ok, flip])
    assert clean.ok and clean.first_failure is None


def test_summarize_fails_a_prompt_whose_every_step_moved_within_the_step_bound():
    moved = golden.judge_step(STEP, _logprobs({2: -0.5, 3: -1.5, 0: -2.5 + 0.3}))
    assert moved.ok  # 0.3 nats: within LOGPROB_BOUND at any single step
    r = golden.summarize("x", [moved] * 8)
    assert r.failed == 0 and r.first_failure is None
    assert not r.mean_ok and not r.ok and r.mean_delta == pytest.approx(0.3)
    exact = golden.judge_step(STEP, _logprobs({2: -0.5, 3: -1.5, 0: -2.5}))
    assert golden.summarize("x", [moved] + [exact] * 3).ok  # mean 0.075


def _record(**over):
    rec = {"version": golden.FORMAT_VERSION, "id": "a", "tokens": [2, 3], "n_tokens": 2,
           "top": [_step([(2, -0.1), (4, -3.0)]), _step([(3, -0.2), (1, -2.0)])]}
    rec.update(over)
    return rec


def test_validate_record_accepts_the_format_and_refuses_an_old_one():
    golden.validate_record(_record(), "a.json")
    old = {"id": "a", "tokens": [2, 3], "n_tokens": 2}
    with pytest.raises(golden.GoldenFormatError, match="older format.*--write"):
        golden.validate_record(old, "a.json")


@pytest.mark.parametrize("over, match", [
    ({"n_tokens": 3}, "disagree in length"),
    ({"top": [_step([(2, -0.1), (4, -3.0)]), _step([(1, -0.2), (3, -2.0)])]}, "step 1 stores token 3"),
    ({"top": [_step([(2, -0.1)]), _step([(3, -0.2), (1, -2.0)])]}, "step 0 needs at least two"),
])
def test_validate_record_refuses_inconsistent_records(over, match):
    with pytest.raises(golden.GoldenFormatError, match=match):
        golden.validate_record(_record(**over), "a.json")


def test_format_record_round_trips_with_one_step_a_line():
    rec = _record(text="ça", prompt=[{"role": "user", "content": "é"}])
    text = golden.format_record(rec)
    assert json.loads(text) == rec
    assert '\n  [[2, -0.1], [4, -3.0]],\n  [[3, -0.2], [1, -2.0]]\n' in text and "ça" in text


def test_summary_line():
    ok = golden.judge_step(STEP, _logprobs({2: -0.5, 3: -1.5, 0: -2.4997}))
    flip = golden.judge_step(TIE, _logprobs({2: -0.715, 3: -0.705, 0: -2.5}))
    report = golden.GoldenReport((), (golden.summarize("x", [ok, flip]), golden.summarize("y", [ok])))
    assert golden.summary_line(report, 2) == ("2/2 golden continuations reproduced (3 steps; 1 near-tie step "
                                              "forgiven, of 1 within TIE_MARGIN; max |Δlogprob| 0.015, "
                                              "largest prompt mean 0.0077)")
    failed = golden.GoldenReport((golden.GoldenMismatch("y", "..."),), report.prompts)
    assert golden.summary_line(failed, 2).startswith("1/2 golden")


def test_golden_files_match_the_prompt_set():
    recs = golden.load_golden()
    assert {r["id"] for r in recs} == set(golden.GOLDEN_PROMPTS)
    for r in recs:
        assert r["prompt"] == golden.GOLDEN_PROMPTS[r["id"]]
        assert len(r["tokens"]) == len(r["top"]) == r["n_tokens"] == golden.N_TOKENS
        assert all(len(step) == r["top_k"] == golden.TOP_K for step in r["top"])
        assert r["weights"] == golden.WEIGHTS and r["device"] == golden.DEVICE
        assert r["version"] == golden.FORMAT_VERSION and r["recorded_on"]["machine"]


def test_golden_loader_rejects_foreign_and_old_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"id": "b", "tokens": []}), encoding="utf-8")
    with pytest.raises(golden.GoldenFormatError, match="golden record"):
        golden.load_golden(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"id": "a", "tokens": [1], "n_tokens": 1}), encoding="utf-8")
    with pytest.raises(golden.GoldenFormatError, match="older format"):
        golden.load_golden(tmp_path)


def _short_copy(packed_model, tmp_path, keep: str, n: int) -> None:
    """The golden files with only `keep`'s first n steps judged; the others are left out by
    marking them as made from another GGUF (the check then skips their steps)."""
    for r in golden.load_golden():
        if r["id"] == keep:
            r["tokens"], r["top"], r["n_tokens"] = r["tokens"][:n], r["top"][:n], n
        else:
            r["gguf_sha256"] = "0" * 64
        (tmp_path / f"{r['id']}.json").write_text(golden.format_record(r), encoding="utf-8")


@pytest.mark.model
def test_engine_reproduces_golden_continuations(packed_model, embedded_sha):
    assert packed_model.device.type == "cpu"
    report = golden.check_golden(packed_model, embedded_sha)
    assert report.ok, "\n".join(f"{b.id}: {b.message}" for b in report.mismatches)
    assert report.steps == len(golden.GOLDEN_PROMPTS) * golden.N_TOKENS
    assert report.max_delta <= golden.LOGPROB_BOUND


def _drop_last_input_group(model):
    """One layer's int4 matmul ignores its last group of 32 inputs (a loop bound one group short)."""
    import engine.weights

    target = model.net.blocks[len(model.net.blocks) // 2].w_down
    original = engine.weights.Int4Linear.__call__

    def broken(self, x):
        if self is target:
            x = x.clone()
            x[..., -32:] = 0
        return original(self, x)
    return broken


def _every_output_one_percent_high(model):
    """Every int4 matmul's output 1% high (a scale rounded or converted wrongly)."""
    import engine.weights

    original = engine.weights.Int4Linear.__call__
    return lambda self, x: original(self, x) * 1.01


@pytest.mark.model
@pytest.mark.parametrize("bug", [_drop_last_input_group, _every_output_one_percent_high])
def test_golden_check_fails_a_broken_kernel(packed_model, embedded_sha, tmp_path, monkeypatch, bug):
    """A kernel bug is found within a dozen steps and reported in words: the dropped group by
    single steps past LOGPROB_BOUND, the 1% error (no step past the bounds) by the mean."""
    import engine.weights

    _short_copy(packed_model, tmp_path, "chat_capital", 12)
    monkeypatch.setattr(engine.weights.Int4Linear, "__call__", bug(packed_model))
    # The residual adds go through the (broken) product too, not the kernel's own add, and so do
    # decoding steps, not the compiled layer halves that call the kernels directly.
    monkeypatch.setattr(engine.weights.Int4Linear, "accumulate", engine.weights.Linear.accumulate)
    monkeypatch.setattr(packed_model.net, "block_ops", None)
    report = golden.check_golden(packed_model, embedded_sha, tmp_path)
    bad = {b.id: b for b in report.mismatches}
    found = bad.pop("chat_capital")
    if found.step is None:
        assert found.message.startswith("fails on average") and "> MEAN_LOGPROB_BOUND" in found.message
    else:
        assert found.message.startswith(f"fails at step {found.step}: ") and "> LOGPROB_BOUND" in found.message
    assert set(bad) == set(golden.GOLDEN_PROMPTS) - {"chat_capital"}
    assert all(b.message == "made from another GGUF" for b in bad.values())


@pytest.mark.model
def test_golden_check_is_not_bit_exact(packed_model, embedded_sha, tmp_path, monkeypatch):
    """Every int4 matmul scaled by 1 + 1e-6 (a rounding-size change, as another CPU's kernel
    makes) moves the log-probs far past the files' own rounding (5e-5) but passes."""
    import engine.weights

    _short_copy(packed_model, tmp_path, "chat_capital", 12)
    original = engine.weights.Int4Linear.__call__
    monkeypatch.setattr(engine.weights.Int4Linear, "__call__", lambda self, x: original(self, x) * (1 + 1e-6))
    monkeypatch.setattr(packed_model.net, "block_ops", None)  # decoding steps through the scaled products too
    report = golden.check_golden(packed_model, embedded_sha, tmp_path)
    assert {b.id for b in report.mismatches} == set(golden.GOLDEN_PROMPTS) - {"chat_capital"}
    [result] = report.prompts
    assert result.ok and result.steps == 12
    assert result.max_delta > 1e-3  # the change did move the log-probs, and the check forgave it
