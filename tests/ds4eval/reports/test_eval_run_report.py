"""ds4eval.reports.run: one run's figures from its trace records, its tables and the markdown report."""

import pytest
from report_fakes import HOSTILE, counted_repeats, greedy_nondeterministic, rec, repeated_records, run_records

from ds4eval.reports import formats, markdown
from ds4eval.reports import run as run_report
from ds4eval.reports.document import Table, row
from ds4eval.verdict import stats


def render_markdown(report: run_report.RunReport) -> str:
    return formats.RUN_FORMATS["markdown"](report)


def test_rates_per_source_and_total_with_wilson_intervals():
    rep = run_report.build(run_records(), "toy.trace")
    by = {s.source: s for s in rep.sources}
    assert (by["alpha"].passed, by["alpha"].graded) == (4, 6)
    beta = by["beta"]
    assert (beta.cases, beta.passed, beta.graded, beta.ungraded) == (7, 4, 6, 1)
    t = rep.total
    iv = stats.wilson(8, 12)
    assert (t.passed, t.graded, t.records) == (8, 12, 13) and (t.rate, t.low, t.high) == (iv.rate, iv.low, iv.high)
    assert rep.statuses == {"PASSED": 8, "FAILED": 4, "ERROR": 1} and not rep.repeated
    assert rep.headline() == "passed 8 of 12 graded: 66.7% (95% CI 39.1%–86.2%); 1 not graded"
    assert rep.think_close == {"natural": 1}


def test_provenance_takes_the_common_value_and_notes_others():
    records = run_records()
    records[3].kv_type = "float32"
    rep = run_report.build(records, written="2026-05-01")
    prov = dict(rep.provenance)
    assert prov["kv cache"] == "float16 (+1 other value(s))" and prov["model"] == "Toy 1B"
    assert prov["ds4eval"] == "0.1.0 @ ffffffffffff" and prov["trace written"] == "2026-05-01"
    assert "endpoint" not in prov  # empty in every record


def test_the_latest_record_of_a_case_counts():
    records = [rec(1, "ERROR", None), rec(2), rec(1, "PASSED")]
    recs, superseded = run_report.latest_records(records)
    assert [(r.id, r.status) for r in recs] == [("c1", "PASSED"), ("c2", "PASSED")] and superseded == 1


def test_records_without_status_are_graded_from_their_output():
    old = rec(1, status=None, picked=None, output="so... Answer: 4")
    recs, _ = run_report.latest_records([old])
    assert recs[0].status == "PASSED" and recs[0].picked == "4"


def test_repeats_use_pass_at_1_with_a_bootstrap_interval():
    rep = run_report.build(repeated_records())
    assert rep.repeated and rep.repeats.repeats == 3
    t = rep.total
    assert t.rate == pytest.approx((1 + 0 + 2 / 3) / 3) and t.records == 9 and t.cases == 3
    iv = stats.bootstrap_mean([1.0, 0.0, 2 / 3])
    assert (t.low, t.high) == (iv.low, iv.high)
    assert "bootstrap" in rep.method() and dict(rep.provenance)["seed"] == "10..12 (3 values)"
    assert dict(rep.provenance)["repeats"] == "3"


def test_markdown_report_has_tables_and_no_outputs():
    md = render_markdown(run_report.build(run_records(), "toy.trace"))
    assert md.startswith("## ds4-eval report: `toy.trace`\n")
    assert "| source | cases | passed | graded | not graded | no answer | pass rate | 95% CI |" in md
    assert "| TOTAL | 13 | 8 | 12 | 1 | 0 | 66.7% | [39.1%, 86.2%] |" in md
    assert "| alpha |" in md and "| beta |" in md and "Wilson" in md
    assert "THINKING-TEXT" not in md and "What is" not in md and HOSTILE not in md
    assert "### Repeats" not in md


def test_markdown_escapes_pipes_and_lists_flaky_and_non_deterministic_cases():
    records = repeated_records() + greedy_nondeterministic()
    for r in records:
        if r.id == "c3":
            r.source = "a|b"
    md = render_markdown(run_report.build(records))
    assert "### Repeats (K = 3)" in md and "flaky 2" in md and "pass@3" in md
    assert "| a\\|b/c3 | 2/3 | 3 | 66.7% | P F P |" in md
    assert "gamma/c7" in md and "total is 5." in md
    # Markdown rows are single lines even when a text holds a newline.
    assert all(line.count("|") >= 2 for line in md.splitlines() if line.startswith("| gamma"))


def test_long_lists_are_cut_for_markdown():
    table = Table(("case",), tuple(row(f"c{i}") for i in range(run_report.MARKDOWN_ROWS + 7)))
    shown, more = run_report.capped(table, run_report.MARKDOWN_ROWS)
    assert len(markdown.escaped_table(shown)) == 2 + run_report.MARKDOWN_ROWS and more.lines == ("... and 7 more",)
    assert run_report.capped(shown, run_report.MARKDOWN_ROWS) == (shown,)
    # In the report: the flaky cases' table stops at MARKDOWN_ROWS rows and says how many more.
    flaky_cases = {f"c{i:03d}": 2 for i in range(run_report.MARKDOWN_ROWS + 7)}
    md = render_markdown(run_report.build(counted_repeats(flaky_cases)))
    flaky = md.split("Flaky cases", 1)[1]
    assert sum(line.startswith("| s/c") for line in flaky.splitlines()) == run_report.MARKDOWN_ROWS
    assert "\n\n... and 7 more\n" in flaky


def test_greedy_cases_that_differ_at_different_repeats_each_show_their_text():
    records = greedy_nondeterministic(3) + [
        rec(8, "PASSED", "4", repeat=r, output=o, source="gamma")
        for r, o in enumerate(["Sum: 4.\nAnswer: 4", "Total: 4.\nAnswer: 4", "Total: 4.\nAnswer: 4"])]
    table = run_report.nondeterministic_table(run_report.build(records).repeats)
    assert table.columns[-1] == "differing repeat from there"
    assert [(r.cells[1].text, r.cells[-1].text) for r in table.rows] == [("2", "total is 5.\nAnswer: 5"),
                                                                          ("1", "Total: 4.\nAnswer: 4")]
    alone = run_report.nondeterministic_table(run_report.build(greedy_nondeterministic(3)).repeats)
    assert alone.columns[-1] == "repeat 2 from there"


def test_nothing_recorded():
    rep = run_report.build([])
    assert rep.total.rate is None and rep.headline() == "no case was graded (0 recorded)"
    assert "no case was graded" in render_markdown(rep)


def _timed(records, concurrency=8):
    for k, r in enumerate(records, 1):
        r.ttft_s, r.itl_s, r.itl_max_s, r.e2e_s, r.itl_per = 0.1 * k, 0.002 * k, 0.25, 1.0 * k, "token"
        r.concurrency = concurrency
    return records


def test_latency_percentiles_of_the_graded_records_with_the_concurrency():
    rep = run_report.build(_timed(run_records()), "toy.trace")  # 12 graded, then 1 ERROR at k = 13
    lat = rep.latency
    assert lat.cases == 12 and lat.itl_per == "token"
    assert (lat.ttft.p50, lat.ttft.p90, lat.ttft.p99, lat.ttft.max) == pytest.approx((0.6, 1.1, 1.2, 1.2))
    assert lat.itl.max == 0.25 and lat.e2e.p90 == pytest.approx(11.0)
    assert dict(rep.provenance)["concurrency"] == "8" and run_report.concurrency(rep) == "8"
    table = run_report.latency_table(lat)
    assert [c.text for c in table.rows[1].cells] == ["ITL ms per token", "12.0", "22.0", "24.0", "250.0", "12"]
    md = render_markdown(rep)
    assert "### Latency (concurrency 8)" in md and "| TTFT s | 0.600 | 1.100 | 1.200 | 1.200 | 12 |" in md
    assert md.index("### Pass rates") < md.index("### Latency") < md.index("### Generated tokens")
    page = formats.RUN_FORMATS["html"](rep)
    assert "Latency (concurrency 8)" in page and "latency-table" in page


def test_traces_without_latency_show_no_latency_section():
    rep = run_report.build(run_records())
    assert rep.latency is None and run_report.concurrency(rep) == "?"
    assert "Latency" not in render_markdown(rep) and "concurrency" not in dict(rep.provenance)
