"""Extractor self-test: a table of real-looking model outputs and what must be extracted.

Contract
- `SELF_TEST_CASES` is the regression table; every kind in `ds4eval.cases.answerkinds` has rows
  (a new kind brings its own), and each rule of `extract`/`grade` that has bitten a real run
  has a row naming it.
- `run_self_test()` returns the failing rows (empty list: all good); `ds4-eval selftest`
  prints them and exits non-zero on any failure.
Rows use made-up questions only; no benchmark content appears here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds4eval.cases import grade


@dataclass(frozen=True)
class SelfTestCase:
    name: str
    kind: str
    answer: str
    output: str
    picked: str | None
    passed: bool
    aliases: tuple[str, ...] = ()
    nchoices: int = 4


def _c(name, output, picked, answer="C", nchoices=4):
    return SelfTestCase(name, "choice", answer, output, picked, picked == answer, nchoices=nchoices)


SELF_TEST_CASES: tuple[SelfTestCase, ...] = (
    # choice: prose words that look like letters
    _c("pronoun I before the letter", "Answer: I think it is C", "C"),
    _c("article A before the letter", "Answer: A careful reading shows C", "C"),
    _c("contraction I'll", "Answer: I'll go with C.", "C"),
    _c("curly-apostrophe contraction", "Answer: I’m fairly sure it is C", "C"),
    _c("lone I is an option", "Answer: I.", "I", answer="I", nchoices=10),
    _c("lone A is an option", "Answer: A", "A", answer="A"),
    _c("A followed by a copula", "Answer: A is correct", "A", answer="A"),
    # choice: negated distractors
    _c("negated distractor first", "Answer: not B, it is C", "C"),
    _c("negation after the pick", "Answer: D, not B", "D", answer="D"),
    _c("isn't", "Answer: it isn't B; C", "C"),
    _c("rules out", "Answer: this rules out A, so C", "C"),
    _c("eliminate", "Answer: eliminate option B and pick C", "C"),
    _c("reject", "Answer: reject D; the answer is C", "C"),
    _c("except", "Answer: all except B hold, choose C", "C"),
    _c("negation before the marker does not count", "It is not B.\nAnswer: B", "B", answer="B"),
    # choice: marker and formatting variants
    _c("last answer line wins", "Answer: A\nWait, recheck.\nFinal answer: C", "C"),
    _c("markdown bold marker", "**Answer:** (C)", "C"),
    _c("marker ends its line", "Final answer:\n\n**C**", "C"),
    _c("boxed letter", "Answer: $\\boxed{C}$", "C"),
    _c("thinking ignored", "<think>Answer: B</think>\nAnswer: C", "C"),
    _c("unclosed thinking has no answer", "<think>Answer: C", None),
    _c("letter beyond the options is not an option", "Answer: E", None),
    _c("fallback 'the answer is'", "So the answer is (C).", "C"),
    _c("bare letter reply", "C.", "C"),
    _c("one option echoed", "C. Tokyo", "C"),
    _c("all options echoed is no answer", "A. Beijing\nB. Seoul\nC. Tokyo", None),
    _c("article in a sentence is no answer", "A fish lives in water.", None),
    # choice: letter case of the marker and of the option
    _c("lower-case marker", "answer: C", "C"),
    _c("upper-case marker", "ANSWER: C", "C"),
    _c("title-case final marker", "Final Answer: C", "C"),
    _c("lower-case option letter", "Answer: c", "C"),
    _c("lower-case option in parentheses", "Answer: (c).", "C"),
    _c("lower-case option in bold", "Answer: **c**", "C"),
    _c("lower-case article stays prose", "Answer: a careful reading shows C", "C"),
    _c("lower-case letter in a sentence is no option", "Answer: it is a trick", None),
    # choice: markdown emphasis and code spans
    _c("bold marker and letter", "**Answer: C**", "C"),
    _c("italic letter", "Answer: *C*", "C"),
    _c("underscore italic letter", "Answer: _C_", "C"),
    _c("underscore bold letter", "Answer: __C__", "C"),
    _c("code span letter", "Answer: `C`", "C"),
    _c("bold option with its text", "Answer: **C. Tokyo**", "C"),
    _c("emphasis does not turn a pronoun into an option", "Answer: *I* think it is C", "C"),
    # choice: trailing punctuation and full-width characters
    _c("letter with trailing punctuation", "Answer: C!", "C"),
    _c("letter with a closing bracket and period", "Answer: C).", "C"),
    _c("full-width colon and letter", "Answer：Ｃ", "C"),
    _c("full-width parentheses", "Answer: （Ｃ）", "C"),
    _c("ideographic full stop", "答案 Answer: C。", "C"),
    # integer
    SelfTestCase("working after =", "integer", "293", "Answer: m+n = 256+37 = 293", "293", True),
    SelfTestCase("leading zero", "integer", "82", "Final answer: 082", "82", True),
    SelfTestCase("first integer on the line", "integer", "70", "Answer: 70 (bases 21 and 49)", "70", True),
    SelfTestCase("the answer is phrase", "integer", "12", "3 + 9 = 12, wait.\nThe answer is 12.", "12", True),
    SelfTestCase("Answer: line beats a later phrase", "integer", "5", "Answer: 5\nThe answer is right.", "5", True),
    SelfTestCase("fallback to last integer", "integer", "16", "So there are 3 ways, then 16 total.", "16", True),
    SelfTestCase("boxed integer", "integer", "588", "Answer: $\\boxed{588}$", "588", True),
    SelfTestCase("thousands separator", "integer", "3986729", "Answer: 3,986,729", "3986729", True),
    SelfTestCase("suffix is not a match", "integer", "25", "Answer: 5", "5", False),
    SelfTestCase("negative integer", "integer", "-4", "Answer: -4", "-4", True),
    SelfTestCase("decimal is not an integer", "integer", "12", "Answer: 12.5", None, False),
    SelfTestCase("upper-case marker", "integer", "42", "FINAL ANSWER: 42", "42", True),
    SelfTestCase("bold integer", "integer", "42", "Answer: **42**", "42", True),
    SelfTestCase("underscore italic integer", "integer", "42", "Answer: _42_", "42", True),
    SelfTestCase("code span integer", "integer", "42", "Answer: `42`", "42", True),
    SelfTestCase("integer with trailing punctuation", "integer", "42", "Answer: 42!", "42", True),
    SelfTestCase("full-width digits", "integer", "42", "Answer：４２", "42", True),
    SelfTestCase("full-width minus and digits", "integer", "-7", "Answer: －７", "-7", True),
    # rational
    SelfTestCase("fraction", "rational", "25/2", "Answer: 25/2", "25/2", True, ("12.5",)),
    SelfTestCase("decimal equals fraction", "rational", "25/2", "Answer: 12.5", "25/2", True),
    SelfTestCase("latex frac", "rational", "25/2", "Answer: $\\frac{25}{2}$", "25/2", True),
    SelfTestCase("dfrac after =", "rational", "25/2", "Answer: S = \\dfrac{25}{2}", "25/2", True),
    SelfTestCase("unreduced fraction", "rational", "25/2", "Answer: 50/4", "25/2", True),
    SelfTestCase("wrong value", "rational", "25/2", "Answer: 25/3", "25/3", False),
    SelfTestCase("suffix of the value", "rational", "25/2", "Answer: 5/2", "5/2", False),
    # exact text
    SelfTestCase("spacing and case", "exact_text", "2n-2", "Answer: 2N - 2", "2n-2", True, ("2(n-1)",)),
    SelfTestCase("alias", "exact_text", "2n-2", "Answer: $2(n-1)$", "2(n-1)", True, ("2(n-1)",)),
    SelfTestCase("boxed text", "exact_text", "Paris", "The answer: \\boxed{\\text{Paris}}.", "paris", True),
    SelfTestCase("trailing period", "exact_text", "blue", "Answer: Blue.", "blue", True),
    SelfTestCase("different text", "exact_text", "blue", "Answer: red", "red", False),
    SelfTestCase("quoted answer", "exact_text", "blue", 'The answer is "blue"', "blue", True),
    SelfTestCase("sentence ending in the answer", "exact_text", "Rome", "The capital of Italy is Rome.",
                 "rome", True),
    SelfTestCase("quoted letter after is", "exact_text", "a", "The first letter is 'A'.", "a", True),
    SelfTestCase("sentence with a wrong answer", "exact_text", "white", "Snow is blue.", "blue", False),
    SelfTestCase("italic text", "exact_text", "cats", "Answer: *cats*", "cats", True),
    SelfTestCase("underscore italic text", "exact_text", "cats", "Answer: _cats_", "cats", True),
    SelfTestCase("underscores inside a word stay", "exact_text", "snake_case", "Answer: snake_case",
                 "snake_case", True),
    SelfTestCase("code span text", "exact_text", "cats", "Answer: `cats`", "cats", True),
    SelfTestCase("text with a trailing comma", "exact_text", "Rome", "Answer: Rome,", "rome", True),
    SelfTestCase("text with a trailing question mark", "exact_text", "Rome", "Answer: Rome?", "rome", True),
    SelfTestCase("full-width text", "exact_text", "Rome", "Answer：Ｒｏｍｅ。", "rome", True),
    SelfTestCase("full-width rational", "rational", "25/2", "Answer: ２５／２", "25/2", True),
    SelfTestCase("bold rational", "rational", "25/2", "Answer: **25/2**.", "25/2", True),
    # ordered sequences
    SelfTestCase("plain list", "ordered_sequence", "1,3,5", "Answer: 1, 3, 5", "1, 3, 5", True),
    SelfTestCase("order matters", "ordered_sequence", "1,3,5", "Answer: 5, 3, 1", "5, 3, 1", False),
    SelfTestCase("missing element", "ordered_sequence", "1,3,5", "Answer: 1, 3", "1, 3", False),
    SelfTestCase("tuples", "ordered_sequence", "(1,8,19),(2,7,13)", "Answer: (1, 8, 19), (2, 7, 13)",
                 "(1,8,19), (2,7,13)", True),
    SelfTestCase("tuple alias order", "ordered_sequence", "(1,2),(3,4)", "Answer: (3,4), (1,2)",
                 "(3,4), (1,2)", True, ("(3,4),(1,2)",)),
    SelfTestCase("words and and", "ordered_sequence", "no, yes, yes", "**Answer:** No, yes and yes.",
                 "no, yes, yes", True),
    SelfTestCase("serial comma and sentence", "ordered_sequence", "2,4,6",
                 "The first three even numbers are 2, 4, and 6.", "2, 4, 6", True),
    SelfTestCase("mixed words", "ordered_sequence", "satire, horror, 2", "Answer: **satire, horror, 2**",
                 "satire, horror, 2", True),
    SelfTestCase("code span list", "ordered_sequence", "1,3,5", "Answer: `1, 3, 5`", "1, 3, 5", True),
    SelfTestCase("full-width commas", "ordered_sequence", "1,3,5", "Answer: １，３，５", "1, 3, 5", True),
    # line sets
    SelfTestCase("bold line", "line_set", "12", "Answer: **12**", "12", True),
    SelfTestCase("lower-case marker and line", "line_set", "12", "answer: line 12.", "12", True),
    SelfTestCase("full-width line number", "line_set", "12", "Answer：１２", "12", True),
    SelfTestCase("line inside range", "line_set", "17-20", "Answer: 20", "20", True),
    SelfTestCase("line outside range", "line_set", "17-20", "Answer: 16", "16", False),
    SelfTestCase("several lines", "line_set", "3,13-15", "Answer: lines 13, 14", "13,14", True),
    SelfTestCase("one named line outside", "line_set", "3,13-15", "Answer: 3, 9", "3,9", False),
    SelfTestCase("safe claim on a buggy function", "line_set", "11", "Answer: 0", "0", False),
    SelfTestCase("safe function", "line_set", "0", "Answer: 0 (safe)", "0", True),
    SelfTestCase("explanation after the line", "line_set", "12", "Answer: Line 12 (count * count overflows)",
                 "12", True),
    SelfTestCase("fallback to a named line", "line_set", "8", "The bug is on line 8.", "8", True),
    SelfTestCase("nothing named", "line_set", "8", "Answer: the memcpy", None, False),
)


def run_self_test(cases=None) -> list[tuple[SelfTestCase, grade.Verdict]]:
    """Rows whose extracted answer or verdict differs from the table (default: SELF_TEST_CASES)."""
    failures = []
    for c in SELF_TEST_CASES if cases is None else cases:
        v = grade.grade_output(c.kind, c.answer, c.output, c.aliases, c.nchoices)
        if v.picked != c.picked or v.passed != c.passed:
            failures.append((c, v))
    return failures


def covered_kinds(cases=None) -> frozenset[str]:
    """Answer kinds that have at least one self-test row."""
    return frozenset(c.kind for c in (SELF_TEST_CASES if cases is None else cases))
