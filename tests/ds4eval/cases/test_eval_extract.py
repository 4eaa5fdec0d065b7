"""Extraction and grading: the self-test table, the spec's regressions, and the real keys."""

import pytest
from hypothesis import given, strategies as st

from ds4eval.cases import answerkinds
from ds4eval.cases import case as cs
from ds4eval.cases import extract as ex
from ds4eval.cases import grade
from ds4eval.cases import selftest


@pytest.mark.parametrize("row", selftest.SELF_TEST_CASES, ids=lambda r: f"{r.kind}:{r.name}")
def test_self_test_row(row):
    v = grade.grade_output(row.kind, row.answer, row.output, row.aliases, row.nchoices)
    assert (v.picked, v.passed) == (row.picked, row.passed)


def test_self_test_covers_every_kind_and_detects_a_wrong_row():
    assert selftest.covered_kinds() == set(answerkinds.NAMES)
    bad = selftest.SelfTestCase("deliberately wrong", "integer", "5", "Answer: 6", "6", True)
    assert len(selftest.run_self_test([bad])) == 1
    assert selftest.run_self_test() == []


@pytest.mark.parametrize("output, want", [
    ("Answer: I think it is C", "C"),
    ("Answer: A careful reading shows C", "C"),
    ("Answer: I'll go with C.", "C"),
    ("Answer: I.", "I"),
    ("Answer: D, not B", "D"),
    ("Answer: not B", None),
    ("Answer: The correct option is H", "H"),
])
def test_choice_spec_examples(output, want):
    assert ex.extract_choice(output, 10) == want


@pytest.mark.parametrize("output, want", [
    ("Answer: m+n = 256+37 = 293", "293"),
    ("Final answer: 082", "82"),
    ("blah 12 and 13\nso 14 then", "14"),
    ("<think>Answer: 5</think>The result is 7.", "7"),
])
def test_integer_spec_examples(output, want):
    assert ex.extract_integer(output) == want


def test_rational_equivalences():
    for out in ("Answer: 25/2", "Answer: 12.5", "Answer: \\frac{25}{2}", "Answer: $\\boxed{\\dfrac{25}{2}}$"):
        assert grade.grade_output("rational", "25/2", out).passed, out
    assert not grade.grade_output("rational", "25/2", "Answer: 5").passed


def test_visible_answer_uses_text_after_last_think_close():
    assert ex.visible_answer("<think>a</think>b</think>c") == "c"
    assert ex.visible_answer("<think>still going") == ""
    assert ex.visible_answer("plain") == "plain"


def test_line_spec_parsing():
    assert ex.parse_line_spec("3,13-15") == {3, 13, 14, 15}
    with pytest.raises(ValueError):
        ex.parse_line_spec("5-")


def test_every_data_key_grades_correct_when_fed_back(data_dir):
    for f in ("core.jsonl", "hard.jsonl"):
        for c in cs.load_file(data_dir / f).cases:
            for key in (c.answer, *c.aliases):
                assert grade.grade_output(c.answer_kind, c.answer, f"Answer: {key}", c.aliases,
                                          c.nchoices).passed, (c.source, c.id)


# A valid key of each kind: the first self-test row's, so that a new kind needs no entry here.
_EXAMPLE_KEY = {kind: next(r.answer for r in selftest.SELF_TEST_CASES if r.kind == kind)
                for kind in answerkinds.NAMES}


@given(st.text())
def test_extractors_never_crash(text):
    for kind in answerkinds.NAMES:
        picked = answerkinds.extract(kind, text, 10)
        assert picked is None or isinstance(picked, str)
        grade.is_correct(kind, picked, _EXAMPLE_KEY[kind], (), 10)


def test_registry_records_are_named_by_their_key_and_unknown_kinds_are_refused():
    for name, kind in answerkinds.KINDS.items():
        assert kind.name == name
        assert "Answer:" in kind.prompt_instruction(4)
    assert answerkinds.lookup("choice").prompt_instruction(4).endswith("(A-D).")
    with pytest.raises(ValueError, match="unknown answer kind 'essay'"):
        answerkinds.lookup("essay")
    with pytest.raises(ValueError, match="unknown answer kind"):
        grade.grade_output("essay", "x", "Answer: x")
    assert not grade.is_correct("essay", None, "x")
