"""The per-case table of a comparison of two repeated runs: k/K on each side, Fisher p and the
class change, smallest p first; in the HTML page (sortable) and the markdown report (capped)."""

import re

from report_fakes import comparison, counted_repeats, rec

from ds4eval.reports import comparison as compare_report
from ds4eval.reports import formats

BASE = {"a": 5, "b": 3, "c": 0, "d": 5, "e": 2, "f": 4}
NEW = {"a": 0, "b": 1, "c": 0, "d": 4, "e": 5, "f": 4}


def render(cmp, fmt):
    return formats.render_comparison(cmp, fmt)


def _cmp(base=BASE, new=NEW, k=5):
    b, n = counted_repeats(base, k), counted_repeats(new, k)
    return comparison(b, n), b, n


def test_rows_are_ordered_by_p_and_name_the_class_change():
    cmp, _, _ = _cmp()
    table = compare_report.repeat_case_table(cmp)
    rows = [dict(zip(table.columns, (c.text for c in r.cells))) for r in table.rows]
    assert [r["case"] for r in rows][0] == "s/a"  # 5/5 -> 0/5: p = 1/252, the smallest
    by = {r["case"]: r for r in rows}
    assert (by["s/a"]["BASE k/K"], by["s/a"]["NEW k/K"], by["s/a"]["Fisher p"]) == ("5/5", "0/5", "0.004")
    assert by["s/a"]["change"] == "regressed"
    assert by["s/a"]["class BASE → NEW"] == "stable pass → stable fail"
    assert by["s/d"]["change"] == "became flaky" and by["s/e"]["change"] == "stopped being flaky"
    assert by["s/b"]["change"] == "lower" and by["s/b"]["class BASE → NEW"] == "flaky"
    assert by["s/c"]["change"] == "" and by["s/f"]["change"] == ""
    ps = [min(r.p_drop, r.p_rise) for r in cmp.repeats.ranked()]
    assert ps == sorted(ps)


def test_html_page_has_the_sortable_table_with_links_to_the_cases():
    cmp, _, _ = _cmp()
    page = render(cmp, "html")
    tbl = re.search(r'<table id="repeat-case-table" class="sortable">.*?</table>', page, re.S)[0]
    assert tbl.count("<tr data-change=") == len(BASE)
    first = re.search(r"<tbody><tr[^>]*>(.*?)</tr>", tbl, re.S)[1]
    assert "s/a" in first and "5/5" in first and "0/5" in first and 'class="rc rc-bad"' in first
    assert re.search(r'<a href="#case-\d+">s/a</a>', first)
    # Sort keys are numbers where the column is numeric, so the script sorts 0.25 before 1.
    assert re.search(r'<td data-sort="3\.968254e-03">0\.004</td>', first)
    assert "table.sortable" in page and "became flaky" in tbl and "stopped being flaky" in tbl
    assert '<span class="rc rc-same">same</span>' in tbl  # a share that did not move says so on the page


def test_markdown_has_the_table_capped_and_text_does_not():
    counts_b = {f"c{i:03d}": 5 for i in range(60)}
    counts_n = {f"c{i:03d}": (0 if i < 3 else 5) for i in range(60)}
    cmp, _, _ = _cmp(counts_b, counts_n)
    md = render(cmp, "markdown")
    section = md.split("### Per case, by Fisher p", 1)[1].split("###", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| s/")]
    assert len(rows) == compare_report.MARKDOWN_CASE_ROWS
    assert rows[0].startswith("| s/c000") and "regressed" in rows[0]
    assert "the 50 smallest p of 60 cases" in section
    assert "Per case, by Fisher p" not in render(cmp, "text")


def test_no_table_unless_both_runs_have_repeats():
    repeated = counted_repeats(BASE, 5)
    once = [rec(i, "PASSED", source="s", id=cid, temperature=0.7, seed=1)
            for i, cid in enumerate(BASE, start=1)]
    cmp = comparison(repeated, once)
    assert cmp.repeats is not None and not compare_report.both_repeated(cmp.repeats)
    assert "repeat-case-table" not in render(cmp, "html")
    assert "Per case, by Fisher p" not in render(cmp, "markdown")
