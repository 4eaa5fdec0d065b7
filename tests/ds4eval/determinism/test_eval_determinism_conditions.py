"""ds4eval.determinism.conditions: how the mixed condition groups prompts, and the requests each
condition sends, against a scripted target (no model, no network)."""

import itertools

import pytest

from ds4eval.determinism import prompts as own
from ds4eval.determinism.analysis import Completion
from ds4eval.determinism.conditions import CONDITIONS, Plan, RunContext, mixed_groups, run_conditions
from ds4eval.determinism.targets import Request


# ---------------------------------------------------------------- mixed_groups (pure)

@pytest.mark.parametrize("n, c", list(itertools.product(range(1, 12), (1, 2, 3, 4, 7))))
def test_every_prompt_is_counted_exactly_once_per_round_in_groups_of_c_plus_one(n, c):
    groups = mixed_groups(n, c, round_seed=11)
    counted = [i for members, k in groups for i in members[:k]]
    assert sorted(counted) == list(range(n))
    assert all(len(members) == c + 1 for members, _ in groups)
    assert len(groups) == -(-n // (c + 1))


@pytest.mark.parametrize("n, c", list(itertools.product(range(1, 12), (1, 2, 3, 4, 7))))
def test_companions_fill_only_a_short_last_group(n, c):
    groups = mixed_groups(n, c, round_seed=5)
    *full, (last, counted) = groups
    assert all(k == c + 1 for _, k in full)
    assert counted == (n % (c + 1) or c + 1)
    companions = last[counted:]
    assert all(0 <= i < n for i in companions)
    if n >= c + 1:
        # Enough prompts: the companions are other prompts, each at most once.
        assert not set(companions) & set(last[:counted]) and len(set(companions)) == len(companions)


def test_groups_are_the_same_for_a_seed_and_shuffled_by_it():
    assert mixed_groups(20, 3, 7) == mixed_groups(20, 3, 7)
    orders = {tuple(i for members, k in mixed_groups(20, 3, seed) for i in members[:k]) for seed in range(5)}
    assert len(orders) == 5


# ---------------------------------------------------------------- the conditions' requests

class ScriptedTarget:
    """Answers every request with its user text's words as tokens (up to max_tokens), and
    records each group of requests it was asked to run together."""

    supports_n = True

    def __init__(self, stream: bool = True, tokens: bool = True, fail: set[str] = frozenset()):
        self.supports_stream = stream
        self.tokens = tokens
        self.fail = fail
        self.calls: list[tuple[list[Request], float]] = []

    def generate(self, requests, stagger_s=0.0):
        self.calls.append((list(requests), stagger_s))
        return [[self.answer(r, i) for i in range(r.n)] for r in requests]

    def answer(self, r: Request, i: int) -> Completion:
        label = r.label if r.n == 1 else f"{r.label} choice {i}"
        if r.label in self.fail:
            return Completion(label, "", None, (), "", "HTTP 500")
        words = tuple(f"{w} " for w in r.user.split())[:r.max_tokens]
        return Completion(label, "".join(words), words if self.tokens else None,
                          (1.0,) * len(words) if self.tokens else (), "length")

    def describe(self):
        return {"backend": "scripted"}

    def close(self):
        pass

    def labels(self) -> list[str]:
        return [r.label for reqs, _ in self.calls for r in reqs]


def context(target, n_prompts=5, **plan) -> RunContext:
    return RunContext(target, own.own_prompts(n_prompts), Plan(**{"repeats": 2, "concurrency": (1, 3),
                                                                   "mixed_rounds": 2, "max_tokens": 8, **plan}))


def test_the_registry_names_the_kinds_in_the_order_a_run_measures_them():
    assert list(CONDITIONS) == ["alone", "mixed", "prefix", "shape"]


def test_alone_runs_first_and_every_prompt_repeats_by_itself():
    target = ScriptedTarget()
    ctx = context(target)
    groups = run_conditions(ctx, ["alone"])
    assert [(g.prompt, g.condition, len(g.completions)) for g in groups] == [(f"p0{i}", "alone", 2)
                                                                            for i in range(1, 6)]
    assert all(len(reqs) == 1 for reqs, _ in target.calls)
    assert target.labels() == ["alone 0"] * 5 + ["alone 1"] * 5
    req = target.calls[0][0][0]
    assert (req.system, req.user, req.max_tokens, req.temperature, req.seed, req.n, req.stream) == (
        own.OWN_SYSTEM, own.OWN_PROMPTS[0], 8, 0.0, 0, 1, False)
    assert ctx.reference["p01"] is groups[0].completions[0]
    # Asked for others only, alone still runs first: they compare with its completions.
    target = ScriptedTarget()
    run_conditions(context(target), ["prefix"])
    assert target.labels()[:10] == ["alone 0"] * 5 + ["alone 1"] * 5


def test_the_reference_is_the_first_alone_completion_that_came_back():
    ctx = context(ScriptedTarget(fail={"alone 0"}))
    run_conditions(ctx, ["alone"])
    assert ctx.reference["p01"].label == "alone 1" and not ctx.reference["p01"].error


def test_mixed_sends_groups_of_c_plus_one_staggered_and_counts_each_prompt_once_a_round():
    target = ScriptedTarget()
    ctx = context(target, n_prompts=5, stagger_s=0.25)
    groups = run_conditions(ctx, ["mixed"])
    mixed_calls = [(reqs, s) for reqs, s in target.calls if reqs[0].label.startswith("mixed")]
    assert all(s == 0.25 for _, s in mixed_calls)
    by_c = {c: [reqs for reqs, _ in mixed_calls if reqs[0].label.startswith(f"mixed C={c} ")] for c in (1, 3)}
    assert [len(r) for r in by_c[1]] == [2] * 6 and [len(r) for r in by_c[3]] == [4] * 4
    mixed = [g for g in groups if g.condition.startswith("mixed")]
    assert [g.condition for g in mixed] == ["mixed C=1"] * 5 + ["mixed C=3"] * 5
    for g in mixed:
        # The alone reference, then one completion per round: companions are not counted.
        assert g.completions[0] is ctx.reference[g.prompt]
        assert [c.label for c in g.completions[1:]] == [f"{g.condition} round 0", f"{g.condition} round 1"]


def test_prefix_sends_cold_sibling_and_two_warm_requests_behind_one_salted_context():
    target = ScriptedTarget()
    ctx = context(target, n_prompts=3, salt="s1")
    groups = [g for g in run_conditions(ctx, ["prefix"]) if g.condition == "prefix"]
    prefix_reqs = [r for reqs, _ in target.calls for r in reqs if r.label.startswith("prefix")]
    assert [r.label for r in prefix_reqs[:4]] == ["prefix cold", "prefix sibling", "prefix warm (context cached)",
                                                  "prefix warm (prompt cached)"]
    cold, sibling, warm, full = prefix_reqs[:4]
    assert cold.system == sibling.system == warm.system == full.system
    assert cold.system.startswith("Session s1-0.") and own.PREFIX_TEXT in cold.system
    assert prefix_reqs[4].system.startswith("Session s1-1.")  # each prompt its own fresh context
    assert sibling.user == own.OWN_PROMPTS[1] and sibling.max_tokens == 1
    assert cold.user == warm.user == full.user == own.OWN_PROMPTS[0] and cold.max_tokens == 8
    assert [c.label for c in groups[0].completions] == ["prefix cold", "prefix warm (context cached)",
                                                        "prefix warm (prompt cached)"]


def test_prefix_with_one_prompt_uses_a_variant_of_it_as_the_sibling():
    target = ScriptedTarget()
    run_conditions(context(target, n_prompts=1), ["prefix"])
    sibling = next(r for reqs, _ in target.calls for r in reqs if r.label == "prefix sibling")
    assert sibling.user == own.OWN_PROMPTS[0] + " Be brief."


def test_shape_compares_stream_n2_and_a_half_budget_with_the_reference():
    target = ScriptedTarget()
    ctx = context(target, n_prompts=2)
    groups = [g for g in run_conditions(ctx, ["shape"]) if g.condition != "alone"]
    assert [g.condition for g in groups] == ["stream"] * 2 + ["n=2"] * 2 + ["max_tokens"] * 2
    stream, _, n2, _, half, _ = groups
    assert [c.label for c in stream.completions] == ["alone 0", "stream"]
    assert [c.label for c in n2.completions] == ["alone 0", "n=2 choice 0", "n=2 choice 1"]
    assert half.completions[0].tokens == ctx.reference["p01"].tokens[:4]
    assert half.completions[0].finish == "length" and half.completions[1].label == "max_tokens=4"
    shaped = {r.label: r for reqs, _ in target.calls for r in reqs}
    assert shaped["stream"].stream and shaped["n=2"].n == 2 and shaped["max_tokens=4"].max_tokens == 4
    assert ctx.notes == []


def test_shape_skips_what_the_target_or_the_settings_rule_out_with_a_note():
    ctx = context(ScriptedTarget(stream=False, tokens=False), n_prompts=2, temperature=0.7)
    groups = run_conditions(ctx, ["shape"])
    assert {g.condition for g in groups} == {"alone"}
    assert ctx.notes == ["stream: not applicable to the in-process engine (no HTTP stream)",
                         "n=2: skipped, the run samples (two choices of one sampled request differ by design)",
                         "max_tokens: skipped, the stack returned no tokens to cut the reference at"]
