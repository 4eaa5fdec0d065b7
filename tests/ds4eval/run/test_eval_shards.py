"""Which cases a shard runs (ds4eval.run.shards): a stable split by case identity, and the
array-job variables `--shard auto` reads."""

import collections

import pytest

from ds4eval.cases.case import Case
from ds4eval.run import shards


def case(i, source="src"):
    return Case(source=source, id=f"c{i}", domain="d", title="", question=f"q{i}", choices=(), answer="1",
                aliases=(), answer_kind="integer", suites=("test",))


def test_the_shards_partition_the_selection_and_keep_its_order():
    selected = [case(i) for i in range(200)]
    parts = [shards.part(selected, shards.Shard(i, 4), 1, "{}") for i in range(4)]
    numbers = sorted(n for p in parts for n in p.numbers)
    assert numbers == list(range(1, 201))
    for p in parts:
        assert p.numbers == sorted(p.numbers)
        assert [selected[n - 1] for n in p.numbers] == p.cases
        assert p.selected == 200 and p.selection == parts[0].selection
    # Balanced on average: no shard of 200 cases over 4 is far from 50.
    assert all(30 <= len(p.cases) <= 70 for p in parts)


def test_adding_cases_moves_no_other_case():
    before = {c.id: shards.assign(c.source, c.id, 8) for c in map(case, range(100))}
    grown = [case(i) for i in range(150)]
    after = {c.id: shards.assign(c.source, c.id, 8) for c in grown}
    assert all(after[k] == v for k, v in before.items())
    # ...but the grown suite is another selection, which the digest tells apart.
    assert (shards.part(grown, shards.Shard(0, 8), 1, "{}").selection
            != shards.part(grown[:100], shards.Shard(0, 8), 1, "{}").selection)


def test_the_split_depends_on_the_identity_only():
    # The same id under another source is another case; the rule is fixed (a golden value).
    assert shards.assign("sanity", "int-add-small", 4) == shards.assign("sanity", "int-add-small", 4)
    counts = collections.Counter(shards.assign("s", f"id{i}", 3) for i in range(3000))
    assert set(counts) == {0, 1, 2} and min(counts.values()) > 900


def test_the_digest_covers_content_and_repeats():
    a = [("s", "x", "sha256:1"), ("s", "y", "sha256:2")]
    assert shards.selection_digest(a, 1) == shards.selection_digest(list(a), 1)
    assert shards.selection_digest(a, 1) != shards.selection_digest(a, 2)
    assert shards.selection_digest(a, 1) != shards.selection_digest([a[0], ("s", "y", "sha256:3")], 1)
    assert shards.selection_digest(a, 1) != shards.selection_digest(a[::-1], 1)


@pytest.mark.parametrize("text,expected", [("0/1", (0, 1)), ("3/4", (3, 4)), (" 2/16 ", (2, 16))])
def test_parse_shard(text, expected):
    s = shards.parse_shard(text)
    assert (s.index, s.count) == expected and str(s) == f"{expected[0]}/{expected[1]}"


@pytest.mark.parametrize("text", ["4/4", "1/0", "-1/4", "1", "a/b", "1/2/3", ""])
def test_parse_shard_refuses(text):
    with pytest.raises(shards.ShardError):
        shards.parse_shard(text)


@pytest.mark.parametrize("env,expected", [
    ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0"}, (0, 4)),
    ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1"}, (3, 4)),
    ({"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0",
      "SLURM_ARRAY_TASK_STEP": "4"}, (2, 4)),
    ({"JOB_COMPLETION_INDEX": "5", "DS4EVAL_SHARD_COUNT": "6"}, (5, 6)),
])
def test_shard_from_env(env, expected):
    s = shards.shard_from_env(env)
    assert (s.index, s.count) == expected
    assert shards.resolve("auto", env) == s


@pytest.mark.parametrize("env,message", [
    ({}, "no array-job index"),
    ({"SLURM_ARRAY_TASK_ID": "1"}, "SLURM_ARRAY_TASK_COUNT is not set"),
    ({"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "2"}, "not a whole number"),
    ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_STEP": "2"}, "not on the array"),
    ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "2"}, "out of range"),
    ({"JOB_COMPLETION_INDEX": "0"}, "DS4EVAL_SHARD_COUNT is not set"),
])
def test_shard_from_env_refuses_with_one_line(env, message):
    with pytest.raises(shards.ShardError, match=message) as e:
        shards.shard_from_env(env)
    assert "\n" not in str(e.value)


def test_resolve_without_a_shard_is_the_whole_selection():
    assert shards.resolve(None, {"SLURM_ARRAY_TASK_ID": "1"}) is None
    assert shards.resolve("1/3", {}) == shards.Shard(1, 3)
