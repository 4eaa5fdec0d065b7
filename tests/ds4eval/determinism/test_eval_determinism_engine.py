"""`ds4-eval determinism` on the in-process engine (embedded model: marked `model`): the
engine's batch scheduler gives each prompt one completion alone, beside others, behind a cached
prefix and in every request shape it can take."""

import pytest

from ds4eval.determinism import prompts as own
from ds4eval.determinism.analysis import read_result
from ds4eval.determinism.conditions import CONDITIONS, Plan
from ds4eval.determinism.measure import measure
from ds4eval.determinism.targets import EngineTarget

pytestmark = pytest.mark.model

PLAN = Plan(repeats=2, concurrency=(1, 3), mixed_rounds=1, max_tokens=16, salt="engine-test")


@pytest.fixture(scope="module")
def result(embedded_path):
    target = EngineTarget.load(embedded_path, slots=4)
    try:
        return measure(target, own.own_prompts(4), PLAN, tuple(CONDITIONS), margin=0.05)
    finally:
        target.close()


def test_the_engine_is_invariant_under_every_condition(result):
    assert [(v.condition, v.verdict, v.prompts) for v in result.verdicts] == [
        ("alone", "invariant", 4), ("mixed C=1", "invariant", 4), ("mixed C=3", "invariant", 4),
        ("prefix", "invariant", 4), ("n=2", "invariant", 4), ("max_tokens", "invariant", 4)]
    assert result.invariant
    assert all(o.unit == "token" and o.divergence is None and not o.errors for o in result.outcomes)
    # Every completion was counted: the reference and the repeats, the mixed rounds, the prefix's three.
    counts = {(o.condition, o.completions) for o in result.outcomes}
    assert counts == {("alone", 2), ("mixed C=1", 2), ("mixed C=3", 2), ("prefix", 3), ("n=2", 3),
                      ("max_tokens", 2)}


def test_streaming_is_skipped_with_a_note_not_counted(result):
    assert "stream" not in {v.condition for v in result.verdicts}
    assert result.notes == ("stream: not applicable to the in-process engine (no HTTP stream)",)


def test_the_result_names_the_engine_and_the_settings_and_reads_back(result):
    assert result.stack["backend"] == "engine" and result.stack["slots"] == "4"
    assert result.stack["model"].endswith(".gguf")
    assert {k: result.settings[k] for k in ("prompts", "repeats", "concurrency", "mixed_rounds", "max_tokens")} == {
        "prompts": 4, "repeats": 2, "concurrency": [1, 3], "mixed_rounds": 1, "max_tokens": 16}
    assert read_result(result.to_json()).to_json() == result.to_json()
