"""The report flags of ds4-eval: --report-from, --report for a comparison and for a run,
--compare --format html, and their one-line errors."""

import json

import pytest
from click.testing import CliRunner
from openai_fakes import FakeOpenAI
from report_fakes import flip_pair, run_records, trace_text

from ds4eval import cli
from ds4eval.run import trace as tr


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def write(path, records):
    path.write_text(trace_text(records), encoding="utf-8", newline="")
    return path


def test_report_from_prints_markdown_or_writes_html_and_markdown(tmp_path):
    t = write(tmp_path / "run.trace", run_records())
    r = invoke("--report-from", t)
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"## ds4-eval report: `{t}`") and "| TOTAL | 13 | 8 | 12 |" in r.output
    r = invoke("--report-from", t, "--report", tmp_path / "r.html")
    assert r.exit_code == 0 and r.output == ""
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count('<tr class="case"') == 13
    assert "trace written" in page
    r = invoke("--report-from", t, "--report", tmp_path / "r.md")
    assert r.exit_code == 0 and (tmp_path / "r.md").read_text().startswith("## ds4-eval report")


def test_report_from_warns_about_skipped_blocks(tmp_path):
    t = tmp_path / "torn.trace"
    text = trace_text(run_records())
    t.write_text(text[:-40])
    r = invoke("--report-from", t, "--report", tmp_path / "r.md")
    assert r.exit_code == 0 and "warning:" in r.output and "skipped" in r.output
    assert "| TOTAL | 12 |" in (tmp_path / "r.md").read_text()


def test_compare_html_on_stdout_and_a_report_file_beside_the_text(tmp_path):
    base, new = flip_pair()
    b, n = write(tmp_path / "b.trace", base), write(tmp_path / "n.trace", new)
    r = invoke("--compare", b, n, "--strict", "--format", "html")
    assert r.exit_code == 1 and r.output.startswith("<!DOCTYPE html>") and 'id="flip-table"' in r.output
    assert "NEW-THINKING" in r.output  # outputs come from the traces' records
    r = invoke("--compare", b, n, "--strict", "--format", "json", "--report", tmp_path / "c.html")
    assert r.exit_code == 1 and json.loads(r.output)["total"]["mcnemar"]["pass_fail"] == 2
    page = (tmp_path / "c.html").read_text()
    assert 'id="delta-plot"' in page and page.count('<tr class="case"') == 10
    r = invoke("--compare", b, n, "--strict", "--report", tmp_path / "c.md")
    assert r.exit_code == 1 and "Pass rates" in r.output
    assert (tmp_path / "c.md").read_text().startswith("## ds4-eval --compare: ")


def test_compare_html_of_summaries(tmp_path):
    base, new = flip_pair()
    summaries = []
    for name, recs in (("b", base), ("n", new)):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"format": "ds4eval-summary", "version": 1, "suite": "toy", "model": "Toy 1B",
                                 "cases": [{"source": r.source, "id": r.id, "status": r.status, "picked": r.picked,
                                            "expected": r.expected, "case_hash": r.case_hash} for r in recs]}))
        summaries.append(p)
    r = invoke("--compare", *summaries, "--strict", "--format", "html")
    assert r.exit_code == 1 and "no output recorded" in r.output


@pytest.mark.parametrize("args, msg", [
    (["--report", "x.html"], "--report needs --trace FILE for a run"),
    (["--report-from", "/nonexistent.trace"], "cannot read /nonexistent.trace"),
    (["--report-from", "t.trace", "--regrade", "t.trace"], "at most one"),
    (["--report", "x.html", "--list-cases"], "--report applies to a run, --compare or --report-from"),
    (["--report", "", "--report-from", "t.trace"], "--report needs a file name"),
])
def test_bad_report_flags_are_one_line(args, msg):
    r = invoke(*args)
    assert r.exit_code == 2 and msg in r.output and r.output.count("\n") == 1, r.output


def test_unwritable_report_is_one_line(tmp_path):
    t = write(tmp_path / "run.trace", run_records())
    r = invoke("--report-from", t, "--report", tmp_path / "missing" / "r.html")
    assert r.exit_code == 2 and r.output.startswith("ds4-eval: error: cannot write the report ")
    assert r.output.count("\n") == 1
    r = invoke("--report-from", tmp_path / "x.trace")
    assert r.exit_code == 2 and r.output.count("\n") == 1


def test_a_trace_that_is_not_one(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello\n")
    r = invoke("--report-from", p)
    assert r.exit_code == 2 and "not a ds4-eval trace" in r.output


def _server_run(srv, *args):
    return invoke("--plain", "--backend", "openai", "--url", srv.url, "--domain", "arithmetic", *args)


def test_a_run_writes_the_report_of_the_records_it_appended(tmp_path):
    t, report = tmp_path / "run.trace", tmp_path / "run.html"
    with FakeOpenAI(reply=lambda q: "<think>adding up</think>Answer: 5") as srv:
        r = _server_run(srv, "--trace", t, "--report", report)
        assert r.exit_code == 0, r.output
        page = report.read_text()
        assert page.count('<tr class="case"') == 6 and "fake-model-1" in page and "adding up" in page
        # A second run appends to the same trace; its report covers its own six records only.
        r = _server_run(srv, "--trace", t, "--report", tmp_path / "second.md")
        assert r.exit_code == 0, r.output
    assert len(tr.read_trace(t).records) == 12
    md = (tmp_path / "second.md").read_text()
    assert "| TOTAL | 6 |" in md


def test_a_retry_reports_the_whole_trace(tmp_path):
    with FakeOpenAI(reply=lambda q: "Answer: 5") as srv:
        t = tmp_path / "run.trace"
        r = _server_run(srv, "--trace", t)
        assert r.exit_code == 0, r.output
        parsed = tr.read_trace(t)
        parsed.records[1].status = "STOPPED"
        t.write_text(trace_text(parsed.records))
        r = invoke("--plain", "--backend", "openai", "--url", srv.url, "--retry-incomplete", t,
                   "--report", tmp_path / "r.md")
        assert r.exit_code == 0, r.output
    md = (tmp_path / "r.md").read_text()
    assert "| TOTAL | 6 |" in md and "1 earlier record(s) superseded by retries" in md
