"""The HTML pages (`reports.run.page` and `reports.comparison.page` rendered by `reports.html`)
on hand-made traces: escaping of hostile text, folded thinking, filters, plots and tables on one
run, a comparison and repeated runs, and linear size at 1,000 cases."""

import re
import time
from html.parser import HTMLParser
from pathlib import Path

import json

import pytest
from report_fakes import (HOSTILE, comparison, flip_pair, greedy_nondeterministic, rec, repeated_records,
                          run_records)

from ds4eval.cases import extract
from ds4eval.reports import formats
from ds4eval.reports import html as html_report
from ds4eval.reports import run as run_report
from ds4eval.reports.document import Cell, Table, row
from ds4eval.run import trace as tr
from ds4eval.verdict import compare

REPO = Path(__file__).resolve().parents[3]


def run_page(records, label="", written=""):
    return formats.render_run(records, "html", label, written)


def compare_page(cmp, written=("", "")):
    return formats.render_comparison(cmp, "html", written=written)


class Outline(HTMLParser):
    """Tags, ids and the text inside <script> of a page, as a browser's tokenizer sees them."""

    def __init__(self, page: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"
        if tag == "script":
            self.scripts.append("")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data

    def ids(self) -> set[str]:
        return {a["id"] for _, a in self.tags if a.get("id")}

    def count(self, tag: str, **attrs) -> int:
        return sum(1 for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in attrs.items()))


def test_hostile_text_is_escaped_everywhere():
    page = run_page(run_records(), label=f"run {HOSTILE}")
    o = Outline(page)
    # One script (ours): the trace's "</script>" never closes it or opens another one.
    assert page.count("<script>") == 1 and page.count("</script>") == 1 and len(o.scripts) == 1
    assert o.count("img") == 0 and "onerror=\"alert" not in page
    assert "&lt;/script&gt;&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;amp;" in page
    assert "document.getElementById" in o.scripts[0] and "alert" not in o.scripts[0]


def test_hostile_source_names_stay_inside_their_attributes():
    records = [rec(1, source='x" onmouseover="alert(1)'), rec(2, "FAILED", "5", source="<b>bold</b>")]
    page = run_page(records)
    o = Outline(page)
    sources = {a["data-source"] for t, a in o.tags if t == "tr" and "data-source" in a}
    assert sources == {'x" onmouseover="alert(1)', "<b>bold</b>"}
    assert not any("onmouseover" in a for _, a in o.tags)
    assert "<b>bold</b>" not in page and "&lt;b&gt;bold&lt;/b&gt;" in page


@pytest.mark.parametrize("output", [
    "<think>plan</think>\nAnswer: 4",
    "<think>a</think>b</think>Answer: 4",
    "<think>never closed Answer: 4",
    "plain Answer: 4",
    "reasoning without an opening tag</think>Answer: 4",
    "",
])
def test_split_thinking_shows_what_the_extractors_read(output):
    think, visible, closed = html_report.split_thinking(output)
    assert visible == extract.visible_answer(output)
    assert (think is None) == (extract.THINK_OPEN not in output and extract.THINK_CLOSE not in output)
    assert closed == (extract.THINK_CLOSE in output or extract.THINK_OPEN not in output)


def test_thinking_is_folded_and_dimmed_in_collapsed_details():
    page = run_page(run_records())
    m = re.search(r'<details class="think"><summary>thinking \([\d,]+ chars\)</summary><pre>([^<]*)</pre></details>'
                  r'<pre class="answer">([^<]*)</pre>', page)
    assert m and "THINKING-TEXT" in m[1] and m[2] == "\nAnswer: 4"
    assert "details.think > pre" in page  # the dimming rule
    # Every case's body sits inside a details element that starts closed.
    assert "<details open" not in page and page.count('<tr class="case"') == 13
    unclosed = html_report.output_html("<think>still going")
    assert "never closed" in unclosed and "no text after the thinking" in unclosed


def test_run_page_sections_filters_and_plots():
    page = run_page(run_records(), label="toy.trace", written="2026-05-01 10:00:00 +0000")
    o = Outline(page)
    assert {"provenance-table", "rate-table", "rate-plot", "length-histogram", "case-table", "filter-status",
            "filter-source", "filter-count"} <= o.ids()
    assert "flaky-table" not in o.ids()  # no repeats
    for text in ("Toy 1B", "abababababab", "float16", "greedy", "0.1.0 @ ffffffffffff", "2026-05-01 10:00:00"):
        assert text in page
    sources = [a.get("value") for t, a in o.tags if t == "option"]
    assert sources.count("alpha") == 1 and sources.count("beta") == 1 and "PASSED" in sources and "ERROR" in sources
    statuses = [a["data-status"] for t, a in o.tags if t == "tr" and "data-status" in a]
    assert statuses.count("FAILED") == 4 and statuses.count("ERROR") == 1
    # Per-source rates with Wilson intervals, sources linking to their filtered view.
    assert 'href="#source=alpha"' in page and "Wilson" in page
    assert o.count("circle") == 3  # alpha, beta, TOTAL
    assert o.count("rect") > 3  # histogram bars


def test_comparison_page_flips_both_sides_and_overlaid_histograms():
    base, new = flip_pair()
    cmp = comparison(base, new)
    page = compare_page(cmp, ("2026-05-01", "2026-05-02"))
    o = Outline(page)
    assert {"runs-table", "provenance-table", "rate-table", "delta-plot", "length-histogram", "flip-table",
            "case-table", "time-table"} <= o.ids()
    flips = re.search(r'<table id="flip-table">.*?</table>', page, re.S)[0]
    assert flips.count("pass→fail") == 2 and 'href="#case-2"' in flips and "no answer found" in flips
    assert 'class="s-base"' in page and 'class="s-new"' in page
    assert cmp.verdict in page and "NEW-THINKING" in page
    rows = {a["id"]: a["data-status"] for t, a in o.tags if t == "tr" and a.get("class") == "case"}
    assert rows["case-2"] == "FAILED base-PASSED pass-fail" and rows["case-1"] == "PASSED base-PASSED same"
    assert [a.get("value") for t, a in o.tags if t == "option"].count("pass-fail") == 1
    assert "2026-05-02" in page
    # The paired interval of the delta is the Comparison's own.
    iv = cmp.total.interval
    assert f"[{100 * iv.low:+.1f}, {100 * iv.high:+.1f}]" in page


def _summary(records) -> str:
    return json.dumps({"format": "ds4eval-summary", "version": 1, "suite": "toy", "model": "Toy 1B",
                       "cases": [{"source": r.source, "id": r.id, "status": r.status, "picked": r.picked,
                                  "expected": r.expected, "case_hash": r.case_hash} for r in records]})


def test_comparison_of_summaries_renders_without_outputs():
    base, new = flip_pair()
    cmp = compare.compare(compare.read_run(_summary(base), "b.json"), compare.read_run(_summary(new), "n.json"))
    assert cmp.base.records == () and cmp.new.records == ()
    page = compare_page(cmp)
    assert page.count('<tr class="case"') == 10 and "no output recorded" in page and "NEW-THINKING" not in page


def test_comparison_page_shows_the_records_the_runs_were_read_from():
    base, new = flip_pair()
    cmp = comparison(base, new)
    assert [r.id for r in cmp.new.records] == [r.id for r in new]
    page = compare_page(cmp)
    assert "NEW-THINKING" in page and "no output recorded" not in page


def test_excluded_cases_are_marked():
    base, new = flip_pair()
    new[4] = rec(5, source="alpha", case_hash="sha256:" + "9" * 64)
    page = compare_page(comparison(base, new))
    assert "excluded (pin)" in page and re.search(r'data-status="PASSED base-PASSED excluded"', page)


def test_repeats_show_classes_flaky_and_non_deterministic_cases():
    page = run_page(repeated_records() + greedy_nondeterministic())
    o = Outline(page)
    assert {"flaky-table", "nondeterministic-table", "repeats"} <= o.ids()
    assert "pass@1" in page and "pass@3" in page and "pass^3" in page and "flaky 2" in page
    flaky = re.search(r'<table id="flaky-table">.*?</table>', page, re.S)[0]
    assert "rep/c3" in flaky and "2/3" in flaky and "P F P" in flaky
    nondet = re.search(r'<table id="nondeterministic-table">.*?</table>', page, re.S)[0]
    assert "gamma/c7" in nondet and "<code>total is 5." in nondet
    assert page.count('<tr class="case"') == 12  # one row per case and repeat


def test_comparison_of_repeated_runs_shows_each_sides_repeats():
    recs = repeated_records()
    page = compare_page(comparison(recs, recs))
    assert "base-flaky-table" in page and "new-flaky-table" in page


def _many(n: int) -> list[tr.TraceRecord]:
    return [rec(i, "PASSED" if i % 4 else "FAILED", "4" if i % 4 else "5", source=f"src{i % 7}",
                output=f"<think>{'step ' * 40}</think>Answer: {i}\n" + "more text " * 30) for i in range(1, n + 1)]


def test_a_thousand_cases_render_in_linear_size():
    t0 = time.perf_counter()
    page = run_page(_many(1000))
    elapsed = time.perf_counter() - t0
    print(f"1,000-case run page: {len(page):,} chars in {elapsed:.2f} s")
    # Each further case adds the same amount of page: no per-case part grows with the run.
    sizes = {n: len(run_page(_many(n))) for n in (10, 100)}
    assert (len(page) - sizes[100]) / 900 == pytest.approx((sizes[100] - sizes[10]) / 90, rel=0.05)
    assert page.count('<tr class="case"') == 1000 and page.count("<details>") == 1000
    o = Outline(page)
    assert o.count("details", **{"class": "think"}) == 1000
    base, new = _many(1000), _many(1000)
    new[10] = rec(11, "FAILED", "9", source="src4")
    t0 = time.perf_counter()
    cpage = compare_page(comparison(base, new))
    print(f"1,000-case comparison page: {len(cpage):,} chars in {time.perf_counter() - t0:.2f} s")
    assert cpage.count('<tr class="case"') == 1000
    assert len(cpage) < 3 * len(page)


def test_table_cells_and_picked_values():
    assert run_report.picked_text(None) == "(none)" and run_report.picked_text(float("nan")) == "(none)"
    assert run_report.picked_text("") == "(none)" and run_report.picked_text("B") == "B"
    # Every cell's text is escaped; markup comes only from its style and its link.
    t = html_report.table(Table(("a", "b", "c"), (row("<x>", Cell("<i>y</i>", style="code"),
                                                      Cell("x&y", link='case-1"><script>')),), "t1"))
    assert "<td>&lt;x&gt;</td><td><code>&lt;i&gt;y&lt;/i&gt;</code></td>" in t and 'id="t1"' in t
    assert '<td><a href="#case-1&quot;&gt;&lt;script&gt;">x&amp;y</a></td>' in t


def test_no_network_resources():
    base, new = flip_pair()
    for page in (run_page(run_records()),
                 compare_page(comparison(base, new))):
        o = Outline(page)
        assert not [a for t, a in o.tags if "src" in a or (t == "link")]
        assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert "https://" not in page and "@import" not in page


def test_an_old_trace_without_statuses_is_graded_for_the_page():
    page = run_page(tr.read_trace(REPO / "traces" / "sanity-smollm2-greedy.trace").records)
    assert "passed 13 of 41 graded" in page and page.count('<tr class="case" id="case-1" data-status="FAILED"') == 1


def test_the_screenshot_tool_and_the_cli_parse_each_trace_once(tmp_path, monkeypatch):
    from ds4eval.reports import screenshot
    from ds4eval.verdict import compare as compare_mod

    base, new = flip_pair()
    paths = []
    for name, recs in (("b.trace", base), ("n.trace", new)):
        (tmp_path / name).write_text("".join(map(tr.format_record, recs)), encoding="utf-8")
        paths.append(str(tmp_path / name))
    parsed, parse = [], tr.parse_trace

    def counting(text):
        parsed.append(text)
        return parse(text)

    monkeypatch.setattr(compare_mod, "parse_trace", counting)
    monkeypatch.setattr(tr, "parse_trace", counting)
    page = screenshot.render_html(paths)
    assert len(parsed) == 2 and "NEW-THINKING" in page and page.count('<tr class="case"') == 10
    parsed.clear()
    page = screenshot.render_html(paths[:1])
    assert len(parsed) == 1 and page.count('<tr class="case"') == 10
    # The command line too: text on stdout and the HTML page from one read of each trace.
    from click.testing import CliRunner

    from ds4eval.cli import main
    parsed.clear()
    result = CliRunner().invoke(main, ["compare", *paths, "--report", str(tmp_path / "r.html")])
    assert result.exit_code in (0, 1) and len(parsed) == 2
    assert (tmp_path / "r.html").read_text(encoding="utf-8").count('<tr class="case"') == 10


def test_every_cell_style_of_the_model_has_its_markup():
    from ds4eval.reports import document

    assert set(html_report.CELL_STYLES) == set(document.STYLES)
    assert html_report.cell_html(Cell("PASSED", style="status", tag="PASSED")) == \
        '<span class="st st-PASSED">PASSED</span>'
    marked = Cell("a|<b>", style="tokens", pieces=("a", "<b>"), marked=1)
    assert html_report.cell_html(marked) == "<code>a|<mark>&lt;b&gt;</mark></code>"
