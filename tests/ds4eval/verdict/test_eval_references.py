"""ds4eval.verdict.references and `ds4-eval reference record`: keys, recording from repeated runs,
matching (and the one-line error naming what differs), the file format round trip, and that the
file holds no text of the cases."""

import json

import pytest
from click.testing import CliRunner
from report_fakes import counted_repeats, rec, trace_text

from ds4eval import cli
from ds4eval.verdict import references as refs


def sampled(counts: dict[str, int], k: int = 4, **kw):
    out = counted_repeats(counts, k)
    for r in out:
        for name, value in kw.items():
            setattr(r, name, value)
    return out


COUNTS = {"a": 4, "b": 0, "c": 2, "d": 3}


def test_record_counts_each_repeat_as_a_run():
    ref = refs.record([("one.trace", sampled(COUNTS)), ("two.trace", sampled(COUNTS))], "Q4_1")
    assert ref.runs == 8 and ref.key.quant == "Q4_1" and ref.key.temperature == 0.7
    assert [(c.id, c.passed, c.graded) for c in ref.cases] == [("a", 8, 8), ("b", 0, 8), ("c", 4, 8), ("d", 6, 8)]
    # counted_repeats passes the first `passes` repeats: run r passes the cases with count > r.
    assert ref.run_passed == (3, 3, 2, 1) * 2 and ref.run_graded == (4,) * 8
    assert ref.seeds == (1, 2, 3, 4) * 2
    assert ref.pass_rate == pytest.approx(18 / 32)


def test_record_refuses_mixed_settings_and_cases():
    with pytest.raises(refs.ReferenceError, match="differs from one.trace in kv_type"):
        refs.record([("one.trace", sampled(COUNTS)), ("two.trace", sampled(COUNTS, kv_type="bfloat16"))])
    with pytest.raises(refs.ReferenceError, match="does not hold the same cases"):
        refs.record([("one.trace", sampled(COUNTS)), ("two.trace", sampled({"a": 1}))])
    with pytest.raises(refs.ReferenceError, match="mix settings"):
        refs.key_of(sampled(COUNTS)[:2] + sampled(COUNTS, temperature=1.0)[2:])


def test_find_matches_by_file_hash_and_names_what_differs():
    ref = refs.record([("r", sampled(COUNTS))], "Q4_1")
    other = refs.record([("r", sampled(COUNTS, kv_type="float32"))], "Q4_1")
    found = refs.find([other, ref], refs.key_of(sampled(COUNTS, model="renamed"), ""))  # same sha, no quant known
    assert found is ref
    key = refs.key_of(sampled(COUNTS, model_sha256="ef" * 32, temperature=1.0), "Q8_0")
    with pytest.raises(refs.ReferenceError) as e:
        refs.find([ref, other], key)
    msg = str(e.value)
    assert "\n" not in msg and "no reference matches this run (2 in the file)" in msg
    assert "model_sha256: reference ababababab" in msg and "temperature: reference 0.7, run 1.0" in msg
    assert refs.find([ref], key.__class__(**{**key.__dict__, "temperature": 0.7}), allow=("model",)) is ref


def test_greedy_keys_ignore_top_p():
    a = refs.key_of([rec(1, temperature=0.0, top_p=0.9)])
    b = refs.key_of([rec(1, temperature=0.0, top_p=1.0)])
    assert not a.differences(b)


def test_file_round_trip_and_upsert():
    one = refs.record([("r", sampled(COUNTS))], "Q4_1")
    two = refs.record([("r", sampled(COUNTS, kv_type="float32"))], "Q4_1")
    again = refs.record([("r", sampled(COUNTS)), ("s", sampled(COUNTS))], "Q4_1")
    stored = refs.upsert(refs.upsert([one], two), again)
    assert stored == [again, two]
    obj = json.loads(json.dumps(refs.to_json(stored)))
    assert obj["format"] == "ds4eval-references" and obj["version"] == 1
    assert refs.from_json(obj) == stored


@pytest.mark.parametrize("obj, msg", [
    ([], "is not a ds4-eval reference file"),
    ({"format": "ds4eval-references", "version": 2}, "version 2"),
    ({"format": "ds4eval-references", "version": 1, "references": [{"key": {}}]}, "reference 1 is malformed"),
])
def test_bad_files_are_one_line_errors(obj, msg):
    with pytest.raises(refs.ReferenceError, match=msg):
        refs.from_json(obj)


def test_record_command_writes_no_case_text(tmp_path):
    records = sampled(COUNTS)
    for r in records:
        r.question_prompt, r.model_output = "SECRET-QUESTION", "SECRET-ANSWER"
    t = tmp_path / "r.trace"
    t.write_text(trace_text(records))
    out = tmp_path / "refs.json"
    r = CliRunner().invoke(cli.main, ["reference", "record", str(t), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "recorded the reference" in r.output and "4 runs, 4 cases" in r.output
    text = out.read_text()
    assert "SECRET" not in text and "What is" not in text and "Be brief" not in text
    r = CliRunner().invoke(cli.main, ["reference", "record", str(t), "--into", str(out)])
    assert r.exit_code == 0 and r.output.startswith("replaced the reference")
    assert len(json.loads(out.read_text())["references"]) == 1


@pytest.mark.parametrize("args, msg", [
    (("r.trace",), "give one of -o FILE"),
    (("r.trace", "-o", "x.json", "--into", "y.json"), "give one of -o FILE"),
    (("missing.trace", "-o", "x.json"), "cannot read missing.trace"),
])
def test_record_command_errors(tmp_path, monkeypatch, args, msg):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.trace").write_text(trace_text(sampled(COUNTS)))
    r = CliRunner().invoke(cli.main, ["reference", "record", *args])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and msg in r.output, r.output
