"""ds4eval.verdict.repeats on hand-made traces: classes, supersession, pass@k figures, determinism."""

import pytest

from ds4eval.run.trace import TraceRecord
from ds4eval.verdict import repeats
from ds4eval.verdict import stats


def rec(case, repeat, status, output="Answer: 4", temperature=0.7, source="s"):
    return TraceRecord(index=1, source=source, id=case, status=status, repeat=repeat, temperature=temperature,
                       model_output=output)


def test_classes_and_counts():
    records = [rec("a", r, "PASSED") for r in range(3)] + [rec("b", r, "FAILED") for r in range(3)] \
        + [rec("c", 0, "PASSED"), rec("c", 1, "FAILED"), rec("c", 2, "PASSED")] \
        + [rec("d", r, "ERROR") for r in range(3)]
    cases = repeats.group(records)
    assert [(c.id, c.klass, c.passed, c.graded) for c in cases] == [
        ("a", "stable pass", 3, 3), ("b", "stable fail", 0, 3), ("c", "flaky", 2, 3), ("d", "ungraded", 0, 0)]
    s = repeats.summarize(cases)
    assert s.repeats == 3 and s.counts == {"stable pass": 1, "stable fail": 1, "flaky": 1, "ungraded": 1}
    assert s.pass_at_1.mean == pytest.approx((1 + 0 + 2 / 3) / 3)
    assert s.full_cases == 3
    assert s.pass_at_k == pytest.approx((1 + 0 + stats.pass_at_k(3, 2, 3)) / 3)
    assert s.pass_hat_k == pytest.approx((1 + 0 + 0) / 3)
    assert [c.id for c in s.flaky()] == ["c"]


def test_a_later_record_of_the_same_repeat_supersedes_the_earlier():
    cases = repeats.group([rec("a", 0, "ERROR"), rec("a", 1, "PASSED"), rec("a", 0, "PASSED")])
    assert len(cases) == 1 and cases[0].klass == "stable pass" and cases[0].graded == 2
    assert [r.repeat for r in cases[0].records] == [0, 1]


def test_greedy_repeats_that_differ_are_non_deterministic_with_the_first_differing_token():
    outs = ["So the sum is 4.\nAnswer: 4", "So the sum is 4.\nAnswer: 4", "So the total is 5.\nAnswer: 5"]
    cases = repeats.group([rec("g", r, "PASSED" if r < 2 else "FAILED", o, temperature=0.0)
                           for r, o in enumerate(outs)])
    d = cases[0].difference
    assert (d.repeat, d.token, d.char) == (2, 4, len("So the "))  # So, space, the, space | sum
    assert d.base_text.startswith("sum is") and d.other_text.startswith("total is")
    s = repeats.summarize(cases)
    assert [c.id for c in s.nondeterministic] == ["g"]
    # Sampled runs differ by design: not reported as non-deterministic.
    sampled = repeats.group([rec("h", r, "PASSED", o) for r, o in enumerate(outs)])
    assert sampled[0].difference is not None and repeats.summarize(sampled).nondeterministic == ()


def test_first_difference_with_a_model_tokenizer_and_identical_outputs():
    split = lambda text: [text[i:i + 2] for i in range(0, len(text), 2)]  # noqa: E731 - two-character tokens
    d = repeats.first_difference(["abcdef", "abcxef"], split)
    assert (d.repeat, d.token, d.char) == (1, 1, 2)
    assert repeats.first_difference(["same", "same", "same"]) is None
    # One output a prefix of the other: the difference is where the shorter one ends.
    d = repeats.first_difference(["Answer: 4", "Answer: 4 because"])
    assert d.char == len("Answer: 4") and d.base_text == "" and d.other_text == " because"


def test_no_repeats_is_one_repeat_per_case():
    s = repeats.summarize(repeats.group([rec("a", 0, "PASSED"), rec("b", 0, "FAILED")]))
    assert s.repeats == 1 and s.pass_at_1.mean == 0.5 and s.pass_at_k == 0.5 and s.nondeterministic == ()
