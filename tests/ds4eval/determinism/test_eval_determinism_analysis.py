"""ds4eval.determinism.analysis: distinct completions, where they part, near-tie or real, the
verdicts per condition, the result file and how much of a comparison's flips the noise explains.
Pure: every test builds its completions by hand."""

import json
import math
from fractions import Fraction

import pytest

from ds4eval.determinism import analysis as an
from ds4eval.determinism.analysis import Completion, ConditionVerdict, Divergence, Group, Outcome, Result


def comp(label: str, *tokens: str, gaps=None, error: str = "") -> Completion:
    """A completion with tokens; gaps default to 1.0 nats at every token."""
    if error:
        return Completion(label, "", None, (), "", error)
    gaps = tuple(gaps) if gaps is not None else (1.0,) * len(tokens)
    return Completion(label, "".join(tokens), tuple(tokens), gaps, "length")


def words(label: str, text: str) -> Completion:
    return Completion(label, text, None, (), "stop")


def group(*completions: Completion, prompt: str = "p01", condition: str = "alone") -> Group:
    return Group(prompt, condition, completions)


# ---------------------------------------------------------------- analyze

def test_identical_completions_are_one_distinct_and_have_no_divergence():
    o = an.analyze(group(comp("alone 0", "A", " b"), comp("alone 1", "A", " b"), comp("alone 2", "A", " b")))
    assert (o.completions, o.distinct, o.unit, o.divergence, o.errors) == (3, 1, "token", None, ())
    assert o.invariant


def test_distinct_counts_every_different_completion_once():
    o = an.analyze(group(comp("r", "A", " b", " c"), comp("x", "A", " b", " c"), comp("y", "A", " z", " c"),
                         comp("w", "A", " b", " q"), comp("v", "A", " z", " c")))
    assert (o.completions, o.distinct) == (5, 3) and not o.invariant


def test_the_divergence_is_the_earliest_parting_from_the_reference_with_both_sides():
    ref = comp("alone 0", "The", " sky", " is", " blue", gaps=(2.0, 0.5, 0.02, 3.0))
    later = comp("mixed C=4 round 0", "The", " sky", " is", " azure")
    earlier = comp("mixed C=4 round 1", "The", " sun", " is", " blue")
    o = an.analyze(group(ref, later, earlier, condition="mixed C=4"))
    assert o.divergence == Divergence(1, " sky", " sun", "mixed C=4 round 1", 0.5, "real")
    # Of two completions parting at the same token, the first one listed is named.
    o = an.analyze(group(ref, later, comp("again", "The", " sky", " is", " green")))
    assert o.divergence == Divergence(3, " blue", " azure", "mixed C=4 round 0", 3.0, "real")


def test_a_completion_that_ends_first_parts_where_it_ends():
    ref = comp("ref", "a", "b", gaps=(0.7, 0.8))
    longer = comp("longer", "a", "b", "c", gaps=(0.7, 0.8, 0.01))
    # The reference ended there: the gap is the other side's own at that token.
    assert an.analyze(group(ref, longer)).divergence == Divergence(2, "", "c", "longer", 0.01, "near-tie")
    ref = comp("ref", "a", "b", "c", gaps=(0.7, 0.8, 0.9))
    shorter = comp("shorter", "a", "b")
    assert an.analyze(group(ref, shorter)).divergence == Divergence(2, "c", "", "shorter", 0.9, "real")


@pytest.mark.parametrize("a, b, index", [
    ((), (), None), (("x",), ("x",), None), (("x", "y"), ("x", "z"), 1), (("x",), ("y",), 0),
    (("x",), ("x", "y"), 1), (("x", "y"), ("x",), 1), ((), ("x",), 0)])
def test_first_difference(a, b, index):
    assert an.first_difference(a, b) == index


def test_units_are_tokens_only_where_every_completion_has_tokens():
    both = an.analyze(group(comp("r", "one", " two"), comp("o", "one", " three")))
    assert both.unit == "token" and both.divergence.index == 1
    # One completion without tokens: every completion is compared by word, and a word
    # divergence has no gap to class it by, whatever gaps the tokens carried.
    mixed = an.analyze(group(comp("r", "one", " two", " four", gaps=(0.001, 0.001, 0.001)),
                             words("o", "one two three")))
    assert mixed.unit == "word"
    assert mixed.divergence == Divergence(4, "four", "three", "o", None, "unknown")  # words and the spaces between
    assert an.analyze(group(words("r", "a b"), words("o", "a  b"))).distinct == 2  # the text itself differs


@pytest.mark.parametrize("gap, margin, klass", [
    (0.01, 0.05, "near-tie"), (0.05, 0.05, "near-tie"), (0.0500001, 0.05, "real"), (2.5, 0.05, "real"),
    (0.3, 0.5, "near-tie"), (0.0, 0.0, "near-tie"), (None, 0.05, "unknown")])
def test_a_divergence_is_classed_by_the_reference_gap_against_the_margin(gap, margin, klass):
    assert an.classify(gap, margin) == klass
    ref = comp("r", "x", "y", gaps=(1.0, gap))
    o = an.analyze(group(ref, comp("o", "x", "z")), margin)
    assert (o.divergence.gap, o.divergence.klass) == (gap, klass)


def test_the_default_margin_is_the_documented_one():
    ref = comp("r", "x", "y", gaps=(1.0, an.DEFAULT_MARGIN))
    assert an.analyze(group(ref, comp("o", "x", "z"))).divergence.klass == "near-tie"


def test_failed_completions_are_left_out_of_the_counts_and_listed():
    o = an.analyze(group(comp("alone 0", "a"), comp("alone 1", error="HTTP 500: boom"), comp("alone 2", "a")))
    assert (o.completions, o.distinct, o.divergence) == (2, 1, None)
    assert o.errors == ("alone 1: HTTP 500: boom",)
    # A failed reference: the first completion that came back is the reference.
    o = an.analyze(group(comp("alone 0", error="timeout"), comp("alone 1", "a", "b"), comp("alone 2", "a", "c")))
    assert o.divergence == Divergence(1, "b", "c", "alone 2", 1.0, "real") and o.completions == 2
    # A failed request has no tokens but does not turn the comparison into words.
    assert o.unit == "token"
    none = an.analyze(group(comp("a", error="x"), comp("b", error="y")))
    assert (none.completions, none.distinct, none.divergence, len(none.errors)) == (0, 0, None, 2)


# ---------------------------------------------------------------- summarize

def outcome(prompt: str, condition: str, distinct: int = 1, klass: str = "real", errors=(), completions=3):
    div = None if distinct <= 1 else Divergence(1, "a", "b", "x", None if klass == "unknown" else 1.0, klass)
    return Outcome(prompt, condition, completions, distinct, "token", div, tuple(errors))


def test_summarize_gives_one_verdict_per_condition_in_order_of_appearance():
    outcomes = [outcome("p1", "alone"), outcome("p1", "mixed C=4", 2, "near-tie"),
                outcome("p2", "alone"), outcome("p2", "mixed C=4", 3, "real"),
                outcome("p3", "alone"), outcome("p3", "mixed C=4", 2, "unknown"),
                outcome("p1", "prefix", errors=("prefix warm: HTTP 503",)), outcome("p2", "prefix"),
                outcome("p1", "stream", completions=0, distinct=0, errors=("stream: x", "stream: y"))]
    verdicts = an.summarize(outcomes)
    assert [v.condition for v in verdicts] == ["alone", "mixed C=4", "prefix", "stream"]
    alone, mixed, prefix, stream = verdicts
    assert alone == ConditionVerdict("alone", 3, 0, 0, 0, 0, 1, 0)
    assert (alone.verdict, alone.invariant) == ("invariant", True)
    assert mixed == ConditionVerdict("mixed C=4", 3, 3, 1, 1, 1, 3, 0)
    assert (mixed.verdict, mixed.invariant) == ("varies", False)
    # A failed request makes the condition incomplete even where every answer agreed.
    assert prefix == ConditionVerdict("prefix", 2, 0, 0, 0, 0, 1, 1)
    assert (prefix.verdict, prefix.invariant) == ("incomplete", False)
    # No prompt measured at all: incomplete, never invariant.
    assert (stream.prompts, stream.failed, stream.verdict, stream.invariant) == (0, 2, "incomplete", False)
    assert an.summarize([]) == []


def test_a_result_is_invariant_only_when_every_condition_is():
    steady = [outcome("p1", "alone"), outcome("p1", "n=2")]
    assert Result({}, {}, tuple(steady)).invariant
    assert not Result({}, {}, (*steady, outcome("p2", "n=2", 2))).invariant
    assert not Result({}, {}, (*steady, outcome("p2", "alone", errors=("alone 1: x",)))).invariant
    assert not Result({}, {}, ()).invariant  # nothing measured proves nothing


def test_varying_prompts_under_some_or_all_conditions():
    r = Result({}, {}, (outcome("p1", "alone"), outcome("p1", "mixed C=1", 2), outcome("p2", "prefix", 2),
                        outcome("p3", "alone")))
    assert r.varying_prompts() == {"p1", "p2"}
    assert r.varying_prompts(["mixed C=1"]) == {"p1"}
    assert r.varying_prompts(["alone"]) == set()


# ---------------------------------------------------------------- the result file

def sample_result() -> Result:
    g = [group(comp("alone 0", "A", " b"), comp("alone 1", "A", " b")),
         group(comp("alone 0", "A", " b", gaps=(0.5, 0.01)), comp("mixed C=3 round 0", "A", " c"),
               condition="mixed C=3"),
         group(comp("prefix cold", "Ün", "icode ✓"), comp("prefix warm", "Ün", "icode ✗", gaps=(1.0, None)),
               comp("prefix warm 2", error="HTTP 500: \"quoted\""), prompt="s/q-1", condition="prefix"),
         group(words("alone 0", "plain words"), words("stream", "plain other"), prompt="p02", condition="stream"),
         group(comp("alone 0", "x", gaps=(2.25,)), comp("n=2 choice 0", "y"), comp("n=2 choice 1", "x"),
               prompt="p02", condition="n=2")]
    return Result({"backend": "openai", "url": "http://127.0.0.1:9", "served_model": "m"},
                  {"prompts": 2, "repeats": 2, "concurrency": [1, 3], "mixed_rounds": 1, "max_tokens": 16,
                   "temperature": 0.0, "seed": 0, "margin_nats": 0.05, "conditions": ["alone", "mixed", "shape"]},
                  tuple(an.analyze(x) for x in g), ("stream: a note", "n=2: another"), 12.345)


def test_the_result_file_reads_back_to_the_same_result_and_text():
    r = sample_result()
    text = r.to_json()
    back = an.read_result(text)
    assert back == r
    assert back.to_json() == text
    assert [v.verdict for v in back.verdicts] == ["invariant", "varies", "incomplete", "varies", "varies"]
    assert {o.divergence.klass for o in back.outcomes if o.divergence} == {"near-tie", "real", "unknown"}


def test_the_result_file_carries_format_version_and_verdicts():
    data = json.loads(sample_result().to_json())
    assert (data["format"], data["version"], data["invariant"]) == (an.FORMAT, an.VERSION, False)
    assert [(c["condition"], c["verdict"]) for c in data["conditions"]][:2] == [("alone", "invariant"),
                                                                               ("mixed C=3", "varies")]
    assert data["outcomes"][1]["divergence"] == {"index": 1, "reference": " b", "other": " c",
                                                 "other_label": "mixed C=3 round 0", "gap": 0.01,
                                                 "klass": "near-tie"}


def test_the_verdicts_are_read_not_recomputed():
    data = json.loads(sample_result().to_json())
    data["conditions"][0]["varying"] = 7
    back = an.read_result(json.dumps(data))
    assert back.verdicts[0].varying == 7


def edited(**changes) -> str:
    data = json.loads(sample_result().to_json())
    for k, v in changes.items():
        if v is KeyError:
            del data[k]
        else:
            data[k] = v
    return json.dumps(data)


@pytest.mark.parametrize("text, message", [
    ("", "noise.json: not JSON (Expecting value at line 1)"),
    ("{\n\"format\": ", "noise.json: not JSON (Expecting value at line 2)"),
    ("[1, 2]", "noise.json: not a ds4-eval determinism result (no \"format\": \"ds4eval-determinism\")"),
    (json.dumps({"format": "ds4eval-trace", "version": 1}),
     "noise.json: not a ds4-eval determinism result (no \"format\": \"ds4eval-determinism\")"),
    (edited(version=2), "noise.json: determinism format version 2, this ds4-eval reads 1"),
    (edited(version=KeyError), "noise.json: determinism format version None, this ds4-eval reads 1"),
    (edited(outcomes=KeyError), "noise.json: malformed determinism result (KeyError: 'outcomes')"),
])
def test_a_bad_file_is_one_line_naming_it(text, message):
    with pytest.raises(an.DeterminismInputError) as e:
        an.read_result(text, "noise.json")
    assert str(e.value) == message


@pytest.mark.parametrize("changes", [
    {"outcomes": None}, {"outcomes": [1]}, {"outcomes": [{"prompt": "p"}]}, {"conditions": ["alone"]},
    {"conditions": [{"condition": "alone", "surplus": 1}]}, {"stack": 5}, {"notes": 5},
    {"elapsed_s": "soon"}, {"settings": [1]},
])
def test_a_malformed_file_is_one_line_too(changes):
    with pytest.raises(an.DeterminismInputError) as e:
        an.read_result(edited(**changes), "noise.json")
    message = str(e.value)
    assert message.startswith("noise.json: malformed determinism result (") and "\n" not in message


def test_a_malformed_divergence_is_one_line():
    data = json.loads(sample_result().to_json())
    data["outcomes"][1]["divergence"]["extra"] = 1
    with pytest.raises(an.DeterminismInputError, match=r"^r\.json: malformed determinism result \(TypeError"):
        an.read_result(json.dumps(data), "r.json")
    data["outcomes"][1]["divergence"] = "token 1"
    with pytest.raises(an.DeterminismInputError, match=r"^r\.json: malformed"):
        an.read_result(json.dumps(data), "r.json")


# ---------------------------------------------------------------- explain_flips

def noise(varying: dict[str, bool]) -> Result:
    return Result({"url": "http://x"}, {}, tuple(outcome(p, "mixed C=4", 2 if v else 1) for p, v in varying.items()))


def test_flips_on_measured_cases_are_explained_by_case():
    n = noise({"s/a": True, "s/b": False, "s/c": False})
    e = an.explain_flips(n, ["s/a", "s/b", "s/x"], ["s/a", "s/b", "s/c", "s/x", "s/y"])
    assert e == an.NoiseExplanation(flips=3, compared=5, method="by case", explained=1, upper=1, measured=2,
                                    varying_share=pytest.approx(1 / 3))
    assert e.unexplained == 2


def test_a_varying_case_that_did_not_flip_explains_nothing():
    n = noise({"s/a": True, "s/b": False})
    e = an.explain_flips(n, ["s/b"], ["s/a", "s/b"])
    assert (e.method, e.explained, e.unexplained) == ("by case", 0, 1)


def test_a_run_that_measured_the_compared_cases_judges_by_case_even_without_a_flip_among_them():
    n = noise({"s/a": True, "s/b": False})
    e = an.explain_flips(n, ["s/x"], ["s/a", "s/b", "s/x"])  # the one flip is a case it did not measure
    assert (e.method, e.measured, e.explained, e.unexplained) == ("by case", 0, 0, 1)
    quiet = an.explain_flips(n, [], ["s/a", "s/b"])
    assert (quiet.method, quiet.flips, quiet.explained) == ("by case", 0, 0)


def test_flips_on_other_cases_are_explained_by_rate():
    n = noise({"p01": True, "p02": False, "p03": False, "p04": False})
    flipped = [f"s/{i}" for i in range(20)]
    compared = [f"s/{i}" for i in range(40)]
    e = an.explain_flips(n, flipped, compared)
    assert (e.method, e.flips, e.compared, e.measured, e.varying_share) == ("by rate", 20, 40, 0, 0.25)
    assert e.explained == 10  # a quarter of the 40 compared cases
    assert e.upper == an.binomial_upper(40, 0.25) and 10 < e.upper < 20
    assert e.unexplained == 20 - e.upper
    # Both figures are capped at the flips there are.
    few = an.explain_flips(n, flipped[:3], compared)
    assert (few.explained, few.upper, few.unexplained) == (3, 3, 0)


def test_an_invariant_stack_explains_no_flip():
    e = an.explain_flips(noise({"p01": False, "p02": False}), ["s/a", "s/b"], ["s/a", "s/b", "s/c"])
    assert (e.method, e.explained, e.upper, e.varying_share, e.unexplained) == ("by rate", 0, 0, 0.0, 2)


def direct_upper(n: int, p: Fraction, level: Fraction) -> int:
    """The smallest k with P(X <= k) >= level, summing the binomial terms exactly."""
    total = Fraction(0)
    for k in range(n + 1):
        total += math.comb(n, k) * p ** k * (1 - p) ** (n - k)
        if total >= level:
            return k
    return n


@pytest.mark.parametrize("n, p", [(1, "1/2"), (10, "1/10"), (40, "1/4"), (100, "3/100"), (250, "1/3"),
                                  (57, "9/10"), (1000, "1/200")])
@pytest.mark.parametrize("level", ["95/100", "1/2", "99/100"])
def test_binomial_upper_matches_a_direct_computation(n, p, level):
    p, level = Fraction(p), Fraction(level)
    assert an.binomial_upper(n, float(p), float(level)) == direct_upper(n, p, level)


def test_binomial_upper_edges():
    assert an.binomial_upper(0, 0.5) == 0
    assert an.binomial_upper(30, 0.0) == 0
    assert an.binomial_upper(30, 1.0) == 30
    assert an.binomial_upper(30, 1e-9) == 0
