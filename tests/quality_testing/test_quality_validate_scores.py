"""Tests for quality_testing.validate_scores: coverage checks on the real suites and on made-up cases."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ds4eval.cases import case as cs
from ds4eval.cases import selftest
from quality_testing import validate_scores as vs


def _data_dir() -> Path:
    env = os.environ.get("DS4EVAL_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "eval-data"


def _case(**kw) -> cs.Case:
    obj = dict(source="t", id="x", question="q?", answer="B", choices=["p", "q", "r"], answer_kind="choice",
               suites=["sanity"])
    obj.update(kw)
    return cs.parse_case(obj)


def _check(cases, covered=None, failures=()):
    pf = cs.ParsedFile(cases=list(cases))
    return vs.check_scores({"f": pf}, {"f": ["sanity"]}, list(failures),
                           selftest.covered_kinds() if covered is None else covered)


def test_repository_suites_have_full_scorer_coverage():
    parsed, suites = vs.load_inputs(_data_dir())
    rep = vs.check_scores(parsed, suites, selftest.run_self_test(), selftest.covered_kinds())
    assert rep.ok, rep.problems
    assert rep.suites_checked["sanity"] > 0
    assert set(rep.suites_checked) | set(rep.suites_skipped) == set(cs.KNOWN_SUITES)


def test_good_cases_pass():
    rep = _check([_case(), _case(id="n", answer="42", choices=[], answer_kind="integer"),
                  _case(id="r", answer="3/4", choices=[], answer_kind="rational")])
    assert rep.ok, rep.problems
    assert rep.kinds_used == {"choice", "integer", "rational"}


def test_kind_without_self_tests_is_reported():
    rep = _check([_case(id="n", answer="42", choices=[], answer_kind="integer")], covered=frozenset({"choice"}))
    assert any("'integer'" in p and "self-test" in p for p in rep.problems)


def test_failing_self_test_row_is_reported():
    row = selftest.SELF_TEST_CASES[0]
    rep = _check([_case()], failures=[(row, type("V", (), {"picked": None})())])
    assert any(row.name in p for p in rep.problems)


def test_parse_problems_and_absent_files_are_told_apart():
    bad = cs.parse_cases(json.dumps({"source": "t", "id": "y"}) + "\n")
    rep = vs.check_scores({"f": bad, "g": None}, {"f": ["sanity"], "g": ["core", "hard"]}, [],
                          selftest.covered_kinds())
    assert any(p.startswith("f:1:") for p in rep.problems)
    assert set(rep.suites_skipped) == {"core", "hard"}


def test_verbatim_answers_grade_as_correct_and_wrong_letters_do_not():
    assert vs.verbatim_problems(_case()) == []
    assert vs.verbatim_problems(_case(id="s", answer="alpha, beta", choices=[], answer_kind="ordered_sequence")) == []
    assert vs.verbatim_problems(_case(id="l", answer="7", choices=[], answer_kind="line_set")) == []
