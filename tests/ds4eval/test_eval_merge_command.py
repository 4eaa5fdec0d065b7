"""`ds4-eval merge`, `list --shard`, and shard sets standing for one trace in compare, report and
regrade: the command line around ds4eval.run.merge (files in, files out, exit statuses)."""

import os

import pytest
from click.testing import CliRunner

from ds4eval import cli
from ds4eval.cases.case import case_hash
from ds4eval.cases.suites import load_suite
from ds4eval.run import shards
from ds4eval.run import trace as tr

SANITY = load_suite("sanity", None)


def invoke(*args, env=None):
    return CliRunner().invoke(cli.main, [str(a) for a in args], env=env or {})


def write_shards(directory, count, status="PASSED", skip=(), names="s{}.trace"):
    """The traces `ds4-eval run --shard I/N` would write for the sanity suite (outputs made up)."""
    paths = []
    for i in range(count):
        part = shards.part(SANITY, shards.Shard(i, count), 1, shards.filters_json((), (), ()))
        header = tr.RunHeader("sanity", tuple((n, c.source, c.id) for n, c in zip(part.numbers, part.cases)), 1,
                              **part.header_fields())
        blocks = [tr.TraceRecord(index=n, source=c.source, id=c.id, status=status, picked=c.answer,
                                 expected=c.answer, answer_kind=c.answer_kind, aliases=list(c.aliases),
                                 nchoices=len(c.choices), suite="sanity", model="Toy", case_hash=case_hash(c),
                                 model_output=f"Answer: {c.answer}")
                  for n, c in zip(part.numbers, part.cases) if c.id not in skip]
        path = directory / names.format(i)
        path.write_text(tr.format_run_header(header) + "".join(map(tr.format_record, blocks)), encoding="utf-8")
        paths.append(path)
    return paths


def test_merge_writes_the_whole_run(tmp_path):
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    paths = write_shards(shard_dir, 3)
    out = tmp_path / "run.trace"
    r = invoke("merge", *paths, "-o", out)
    assert r.exit_code == 0, r.output
    assert f"merged 3 shard(s), 3 file(s): {len(SANITY)} cases, {len(SANITY)} of {len(SANITY)} graded" in r.output
    parsed = tr.read_trace(out)
    assert [rec.index for rec in parsed.records] == list(range(1, len(SANITY) + 1))
    assert parsed.runs[0].cases == tuple((n, c.source, c.id) for n, c in enumerate(SANITY, 1))
    assert not parsed.runs[0].shard
    # A directory and a glob pattern name the same set.
    for spec in (shard_dir, shard_dir / "s*.trace"):
        again = tmp_path / "again.trace"
        assert invoke("merge", spec, "-o", again).exit_code == 0
        assert again.read_text() == out.read_text()
    # The merged trace is not a shard: a directory holding it with its shards is not one run.
    (shard_dir / "run.trace").write_bytes(out.read_bytes())
    r = invoke("merge", shard_dir, "-o", again)
    assert r.exit_code == 2 and "run.trace: not a shard's trace" in r.output


def test_merge_refuses_a_bad_set_with_a_line_per_problem_and_writes_nothing(tmp_path):
    paths = write_shards(tmp_path, 3)
    out = tmp_path / "run.trace"
    r = invoke("merge", paths[0], paths[1], paths[1], "-o", out)  # the same file twice counts once
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    missing = shards.part(SANITY, shards.Shard(2, 3), 1, "{}")
    assert lines[0].startswith(f"ds4-eval: missing shard(s) 2/3: {len(missing.cases)} case(s) not run: #")
    assert all(f"sanity/{c.id}" in lines[0] for c in missing.cases)
    assert lines[-1] == "ds4-eval: error: refused to merge 2 trace(s): 1 problem(s) above"
    assert not out.exists() and os.listdir(tmp_path) == sorted(os.listdir(tmp_path)) and \
        {p.name for p in tmp_path.iterdir()} == {"s0.trace", "s1.trace", "s2.trace"}
    copy = tmp_path / "copy.trace"
    copy.write_bytes(paths[1].read_bytes())
    r = invoke("merge", *paths, copy, "-o", out)
    assert r.exit_code == 2 and "are both shard 1/3 (overlapping shards)" in r.output and not out.exists()


def test_merge_with_unfinished_cases_writes_the_run_and_exits_3(tmp_path):
    paths = write_shards(tmp_path, 2, skip={SANITY[0].id})
    out = tmp_path / "run.trace"
    r = invoke("merge", *paths, "-o", out)
    assert r.exit_code == 3
    assert f"not graded: #1 sanity/{SANITY[0].id}: not run" in r.output
    assert f"`ds4-eval retry {out}` runs them" in r.output
    assert len(tr.read_trace(out).records) == len(SANITY) - 1


def test_merge_checks_its_destination_before_reading(tmp_path):
    paths = write_shards(tmp_path, 2)
    r = invoke("merge", *paths, "-o", tmp_path / "no" / "run.trace")
    assert r.exit_code == 2 and "no directory" in r.output
    r = invoke("merge", tmp_path / "nothing*.trace", "-o", tmp_path / "run.trace")
    assert r.exit_code == 2 and "no file matches" in r.output


def test_compare_report_and_regrade_take_a_shard_set_for_one_trace(tmp_path):
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    write_shards(shard_dir, 4)
    whole = tmp_path / "whole.trace"
    assert invoke("merge", shard_dir, "-o", whole).exit_code == 0
    r = invoke("compare", whole, shard_dir)
    assert r.exit_code == 0 and f"{len(SANITY)} comparable cases" in r.output
    r = invoke("compare", shard_dir / "s*.trace", whole, "--format", "json")
    assert r.exit_code == 0
    r = invoke("report", shard_dir)
    assert r.exit_code == 0 and f"passed {len(SANITY)} of {len(SANITY)} graded" in r.output
    r = invoke("regrade", shard_dir / "s*.trace")
    assert r.exit_code == 0 and f"passed={len(SANITY)} failed=0" in r.output
    # A set that is not one run is refused everywhere, not read as half a run.
    os.remove(shard_dir / "s3.trace")
    for args in (("compare", whole, shard_dir), ("report", shard_dir), ("regrade", shard_dir)):
        r = invoke(*args)
        assert r.exit_code == 2 and "missing shard(s) 3/4" in r.output, args


def test_list_shows_a_shards_cases_with_their_numbers(tmp_path):
    r = invoke("list", "--shard", "1/3")
    part = shards.part(SANITY, shards.Shard(1, 3), 1, "{}")
    assert r.exit_code == 0
    assert f"{len(part.cases)} of the {len(SANITY)} cases of suite sanity in shard 1/3" in r.output
    r = invoke("list", "--shard", "auto", env={"JOB_COMPLETION_INDEX": "1", "DS4EVAL_SHARD_COUNT": "3"})
    assert r.exit_code == 0 and f"{len(part.cases)} of the {len(SANITY)} cases" in r.output
    r = invoke("list", "--shard", "3/3")
    assert r.exit_code == 2 and "index must be in 0..count-1" in r.output
    r = invoke("run", "--shard", "auto", "--plain")
    assert r.exit_code == 2 and "no array-job index in the environment" in r.output


@pytest.mark.slow
@pytest.mark.model
def test_a_shard_run_again_runs_only_what_its_trace_lacks(tmp_path):
    """An array task started again on its own trace (preempted, or its pod restarted) continues
    its shard: the cases already graded are not run again."""
    trace = tmp_path / "shard.trace"
    args = ["run", "--plain", "-n", "8", "--domain", "arithmetic", "--shard", "0/2", "--trace", trace]
    assert invoke(*args).exit_code == 0
    first = tr.read_trace(trace)
    text = trace.read_text()
    trace.write_text(text[:text.rindex("%%case ")])  # the task died before its last case ended
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert f"already holds it; 1 of {len(first.records)} case runs left" in r.output
    again = tr.read_trace(trace)
    assert [(x.id, x.model_output) for x in again.records] == [(x.id, x.model_output) for x in first.records]
    assert len(again.runs) == 2 and again.runs[1].cases == ((first.records[-1].index, "sanity", first.records[-1].id),)
    r = invoke(*args)
    assert r.exit_code == 0 and "0 of" in r.output and len(tr.read_trace(trace).records) == len(first.records)


def test_run_checks_its_outputs_before_the_first_case(tmp_path):
    for flag in ("--summary", "--report", "--trace"):
        extra = ["--trace", tmp_path / "t.trace"] if flag == "--report" else []
        r = invoke("run", "--plain", flag, tmp_path / "missing" / "out.html", *extra)
        assert r.exit_code == 2 and "no directory" in r.output and "cases" not in r.output, (flag, r.output)
