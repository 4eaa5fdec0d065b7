"""Merging shard traces (ds4eval.run.merge): a good set makes the run one process would have
written; every way a set can fail to be one run is refused with a line that says which."""

import pytest

from ds4eval.cases.case import Case, case_hash
from ds4eval.run import merge as mg
from ds4eval.run import shards
from ds4eval.run import trace as tr


def case(i):
    return Case(source="src", id=f"c{i}", domain="d", title="", question=f"q{i}", choices=(), answer="1",
                aliases=(), answer_kind="integer", suites=("test",))


SELECTED = [case(i) for i in range(30)]


def record(c, number, repeat=0, status="PASSED", **kw):
    fields = dict(index=number, source=c.source, id=c.id, status=status, picked="1", expected="1",
                  answer_kind="integer", suite="test", model="Toy", model_sha256="ab" * 32,
                  chat_template_sha256="cd" * 32, temperature=0.0, seed=None, repeat=repeat,
                  case_hash=case_hash(c), model_output=f"Answer: 1 ({c.id}/{repeat})")
    fields.update(kw)
    return tr.TraceRecord(**fields)


def shard_text(index, count, selected=SELECTED, repeats=1, suite="test", filters="{}", status="PASSED",
               skip=(), **kw):
    part = shards.part(selected, shards.Shard(index, count), repeats, filters)
    header = tr.RunHeader(suite, tuple((n, c.source, c.id) for n, c in zip(part.numbers, part.cases)), repeats,
                          **part.header_fields())
    blocks = [record(c, n, r, status=status, suite=suite, **kw)
              for n, c in zip(part.numbers, part.cases) for r in range(repeats) if c.id not in skip]
    return tr.format_run_header(header) + "".join(map(tr.format_record, blocks))


def traces(texts):
    return [mg.ShardTrace(f"s{i}.trace", tr.parse_trace(t)) for i, t in enumerate(texts)]


def whole_run(repeats=1):
    header = tr.RunHeader("test", tuple((n, c.source, c.id) for n, c in enumerate(SELECTED, 1)), repeats)
    return header, [record(c, n, r) for n, c in enumerate(SELECTED, 1) for r in range(repeats)]


@pytest.mark.parametrize("count", [1, 3, 7])
@pytest.mark.parametrize("repeats", [1, 3])
def test_a_good_set_merges_into_the_run_one_process_writes(count, repeats):
    merged = mg.merge(traces([shard_text(i, count, repeats=repeats) for i in reversed(range(count))]))
    header, records = whole_run(repeats)
    assert merged.header == header and merged.records == records and merged.unfinished == []
    assert merged.shards == count
    # The text is an ordinary trace: it reads back as the same run.
    again = tr.parse_trace(merged.text())
    assert again.records == records and again.runs == [header] and again.problems == []


def test_a_retried_block_supersedes_the_one_before_it_and_unfinished_cases_are_listed():
    first = shard_text(0, 2, status="ERROR")
    retried = shard_text(0, 2, skip={c.id for c in SELECTED[:29]})  # the retry finished one case only
    merged = mg.merge(traces([first + retried, shard_text(1, 2, skip={"c1", "c2"})]))
    part0 = shards.part(SELECTED, shards.Shard(0, 2), 1, "{}")
    statuses = {r.id: r.status for r in merged.records}
    assert len(merged.records) == len({(r.id, r.repeat) for r in merged.records})
    for c in part0.cases:
        assert statuses[c.id] == ("PASSED" if c.id == "c29" else "ERROR")
    part1_ids = {c.id for c in shards.part(SELECTED, shards.Shard(1, 2), 1, "{}").cases}
    not_run = [f"src/{cid}" for cid in ("c1", "c2") if cid in part1_ids]
    assert [u for u in merged.unfinished if u.endswith("not run")] == [
        f"#{int(cid.split('/c')[1]) + 1} {cid}: not run" for cid in not_run]
    assert sum(u.endswith("ERROR") for u in merged.unfinished) == len(part0.cases) - (part0.cases[-1].id == "c29")


def refused(texts, namer=None):
    with pytest.raises(mg.MergeRefused) as e:
        mg.merge(traces(texts), namer)
    return e.value.problems


def test_overlapping_shards_are_refused_once():
    problems = refused([shard_text(0, 2), shard_text(1, 2), shard_text(1, 2)])
    assert problems == ["s1.trace and s2.trace are both shard 1/2 (overlapping shards)"]


def test_a_missing_shard_names_its_cases_when_it_can():
    part = shards.part(SELECTED, shards.Shard(2, 3), 1, "{}")
    namer = lambda header, missing: [f"#{n} {c.source}/{c.id}" for i in missing
                                     for n, c in zip(*(lambda p: (p.numbers, p.cases))(
                                         shards.part(SELECTED, shards.Shard(i, 3), 1, "{}")))]
    problems = refused([shard_text(0, 3), shard_text(1, 3)], namer)
    assert problems == [f"missing shard(s) 2/3: {len(part.cases)} case(s) not run: "
                        + ", ".join(f"#{n} src/{c.id}" for n, c in zip(part.numbers, part.cases))]
    assert refused([shard_text(0, 3), shard_text(1, 3)]) == [
        "missing shard(s) 2/3: their cases cannot be named without the case data"]


@pytest.mark.parametrize("other,what", [
    (dict(count=3), "shard count"),
    (dict(suite="other"), "suite"),
    (dict(repeats=2), "repeats"),
    (dict(filters='{"domains": ["d"]}'), "selection flags"),
    (dict(selected=SELECTED[:29]), "selection"),
])
def test_shards_of_different_runs_are_refused(other, what):
    index = 1 if "count" not in other else 2
    problems = refused([shard_text(0, 2), shard_text(index, **{"count": 2, **other})])
    assert len(problems) == 1 and problems[0].startswith(f"the shards differ in {what}")


@pytest.mark.parametrize("field,value,what", [
    ("model_sha256", "ef" * 32, "model"),
    ("chat_template_sha256", "", "chat template"),
    ("temperature", 0.7, "temperature"),
    ("top_p", 0.9, "top-p"),
    ("min_p", 0.05, "min-p"),
    ("seed", 7, "seed"),
])
def test_shards_of_different_models_or_settings_are_refused(field, value, what):
    problems = refused([shard_text(0, 2), shard_text(1, 2, **{field: value})])
    assert len(problems) == 1 and problems[0].startswith(f"the shards' records differ in {what}: ")
    assert "s0.trace" in problems[0] and "s1.trace" in problems[0]


def test_repeats_with_their_own_seeds_are_one_setting():
    # Repeat r samples with seed + r: the base seed is what the shards must agree on.
    texts = [shard_text(i, 2, repeats=2).replace("seed: \n", "seed: 5\n") for i in range(2)]
    seeded = [t.replace("seed: 5\nrepeat: 1", "seed: 6\nrepeat: 1") for t in texts]
    assert mg.merge(traces(seeded)).unfinished == []
    problems = refused([seeded[0], texts[1]])
    assert len(problems) == 1 and problems[0].startswith("the shards' records differ in seed")


def test_a_case_in_the_wrong_shard_is_refused():
    part1 = shards.part(SELECTED, shards.Shard(1, 2), 1, "{}")
    stray = tr.format_record(record(part1.cases[0], part1.numbers[0]))
    problems = refused([shard_text(0, 2) + stray, shard_text(1, 2)])
    assert f"s0.trace: case src/{part1.cases[0].id} belongs to shard 1/2, not 0/2" in problems
    assert any("is recorded in both s0.trace and s1.trace" in p for p in problems)


def test_traces_that_are_not_shards_are_refused():
    header, records = whole_run()
    plain = tr.format_run_header(header) + "".join(map(tr.format_record, records))
    assert refused([plain, shard_text(0, 2)]) == [
        "s0.trace: not a shard's trace (its run header names no shard; write shards with "
        "ds4-eval run --shard I/N)"]
    assert refused(["".join(map(tr.format_record, records))])[0].startswith("s0.trace: not a shard's trace (it has no")
    assert refused([]) == ["no shard traces given"]


def test_two_runs_in_one_file_are_refused():
    problems = refused([shard_text(0, 2) + shard_text(1, 2)])
    assert problems[0].startswith("s0.trace: its run headers disagree")


def test_skipped_blocks_of_the_inputs_are_kept_as_warnings():
    text = shard_text(0, 1) + "%%case 99 v1\nindex: 99\n"
    merged = mg.merge(traces([text]))
    assert len(merged.problems) == 1 and merged.problems[0].startswith("s0.trace: line ")
    assert mg.as_parsed(merged).runs == [merged.header]
