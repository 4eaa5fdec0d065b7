"""ds4eval.reports.determinism: a determinism result as a document (verdict, conditions,
divergences, failures, notes, settings) in text, markdown, HTML and JSON, and the comparison's
noise section. Results are built by hand through the pure analysis."""

import json

import pytest

from ds4eval.determinism.analysis import Completion, Group, NoiseExplanation, Result, analyze, explain_flips
from ds4eval.reports import determinism as rep
from ds4eval.reports.document import Table, Text

STACK = {"backend": "openai", "url": "http://127.0.0.1:8000", "served_model": "m"}
SETTINGS = {"prompts": 2, "repeats": 2, "concurrency": [1, 3], "max_tokens": 16, "margin_nats": 0.05}


def comp(label, *tokens, gaps=None, error=""):
    if error:
        return Completion(label, "", None, (), "", error)
    return Completion(label, "".join(tokens), tokens, tuple(gaps or (1.0,) * len(tokens)), "length")


def result(groups, notes=(), elapsed=3.5) -> Result:
    return Result(dict(STACK), dict(SETTINGS), tuple(analyze(g) for g in groups), tuple(notes), elapsed)


def steady() -> Result:
    return result([Group("p01", "alone", (comp("alone 0", "A", " b"), comp("alone 1", "A", " b"))),
                   Group("p01", "mixed C=3", (comp("alone 0", "A", " b"), comp("mixed C=3 round 0", "A", " b")))])


def unsteady(failures: int = 1) -> Result:
    ref = comp("alone 0", "A", " <b>", " c|d", gaps=(2.0, 0.01234, 0.9))
    failed = tuple(comp(f"prefix warm {i}", error=f"HTTP 500: boom {i}") for i in range(failures))
    return result([
        Group("p01", "alone", (ref, comp("alone 1", "A", " <b>", " c|d"))),
        Group("p01", "mixed C=3", (ref, comp("mixed C=3 round 0", "A", " <i>", " c|d"))),
        Group("p02", "mixed C=3", (ref, comp("mixed C=3 round 0", "A", " <b>", " e|f"))),
        Group("p01", "prefix", (ref, *failed)),
        Group("p02", "stream", (ref, Completion("stream", "A <b> c|d!", None))),
    ], notes=("stream: one note", "n=2: another"))


def table_rows(table: Table) -> list[list[str]]:
    return [[c.text for c in r.cells] for r in table.rows]


def test_the_verdict_line():
    assert rep.verdict_line(steady()) == "INVARIANT: one completion per prompt under every condition (2 conditions)"
    assert rep.verdict_line(unsteady()) == ("NOT INVARIANT: varies under mixed C=3, stream; incomplete under "
                                            "prefix (failed requests)")


def test_the_document_of_a_varying_run():
    doc = rep.document(unsteady())
    assert doc.title == "ds4-eval determinism"
    assert (doc.lead.style, doc.lead.tag) == ("verdict", "bad")
    assert [s.title for s in doc.sections] == ["Conditions", "Divergences", "Failed requests", "Notes", "Settings"]
    conditions = doc.sections[0].blocks[0]
    assert conditions.columns == rep.CONDITION_COLUMNS
    assert table_rows(conditions) == [["alone", "invariant", "1", "0", "0", "0", "0", "1", "0"],
                                      ["mixed C=3", "varies", "2", "2", "1", "1", "0", "2", "0"],
                                      ["prefix", "incomplete", "1", "0", "0", "0", "0", "1", "1"],
                                      ["stream", "varies", "1", "1", "0", "0", "1", "2", "0"]]
    assert [r.cells[1].tag for r in conditions.rows] == ["PASS", "FAIL", "FAIL", "FAIL"]
    divergences = doc.sections[1].blocks[0]
    assert divergences.columns == rep.DIVERGENCE_COLUMNS and divergences.style == "sortable"
    assert table_rows(divergences) == [
        ["p01", "mixed C=3", "2", "token 1", "' <b>'", "' <i>'", "mixed C=3 round 0", "0.0123", "near-tie"],
        ["p02", "mixed C=3", "2", "token 2", "' c|d'", "' e|f'", "mixed C=3 round 0", "0.9000", "real"],
        # Without tokens the texts are compared by word (and the spaces and signs between them).
        ["p02", "stream", "2", "word 9", "''", "'!'", "stream", "-", "unknown"]]
    assert doc.sections[2].blocks[0].lines == ("prefix warm 0: HTTP 500: boom 0",)
    notes = doc.sections[3].blocks[0]
    assert notes.lines == ("stream: one note", "n=2: another") and notes.note
    settings = dict(table_rows(doc.sections[4].blocks[0]))
    assert settings["stack url"] == "http://127.0.0.1:8000" and settings["concurrency"] == "1, 3"
    assert settings["elapsed"] == "3.5 s"


def test_the_document_of_a_steady_run_says_nothing_varied_and_has_no_empty_sections():
    doc = rep.document(steady())
    assert (doc.lead.text, doc.lead.tag) == (rep.verdict_line(steady()), "good")
    assert [s.title for s in doc.sections] == ["Conditions", "Divergences", "Settings"]
    assert doc.sections[1].blocks == (Text(("No prompt's completion varied.",)),)


def test_failed_requests_are_listed_up_to_fifty():
    lines = rep.document(unsteady(failures=53)).sections[2].blocks[0].lines
    assert len(lines) == 51 and lines[49] == "prefix warm 49: HTTP 500: boom 49" and lines[50] == "... and 3 more"


def test_text_markdown_and_html_render_the_same_document():
    r = unsteady()
    text = rep.render(r, "text")
    assert text.startswith("ds4-eval determinism\n") and rep.verdict_line(r) in text
    assert "mixed C=3    varies" in text and "' <i>'" in text and "0.0123" in text
    md = rep.render(r, "markdown")
    assert md.startswith("## ds4-eval determinism\n") and f"**{rep.verdict_line(r)}**" in md
    assert "| p01 | mixed C=3 | 2 | token 1 | ' <b>' | ' <i>' | mixed C=3 round 0 | 0.0123 | near-tie |" in md
    assert "| ' c\\|d' | ' e\\|f' |" in md  # a | in a token does not break the table
    page = rep.render(r, "html")
    assert page.startswith("<!DOCTYPE html>") and "NOT INVARIANT" in page
    assert "<code>&#x27; &lt;i&gt;&#x27;</code>" in page and "<i>" not in page  # token text is escaped


def test_json_is_the_result_file():
    r = unsteady()
    assert rep.render(r, "json") == r.to_json()
    assert json.loads(rep.render(r, "json"))["invariant"] is False
    assert set(rep.RENDERERS) == {"text", "markdown", "json", "html"}


# ---------------------------------------------------------------- the comparison's noise section

def noise_run(varying: dict[str, bool]) -> Result:
    ref = comp("alone 0", "a", "b")
    return result([Group(p, "mixed C=3", (ref, comp("mixed", "a", "c" if v else "b"))) for p, v in varying.items()])


def test_noise_lines_by_case():
    n = noise_run({"s/a": True, "s/b": False})
    e = explain_flips(n, ["s/a", "s/b", "s/x"], ["s/a", "s/b", "s/x"])
    assert rep.noise_lines(e, n) == (
        "1 of 3 flipped cases are cases whose output varies on http://127.0.0.1:8000 by itself (50% of the "
        "prompts it measured varied under some condition); the other 2 flips are not explained by its noise.",
        "1 flipped cases were not measured by the determinism run.")


def test_noise_lines_by_rate():
    n = noise_run({"p01": True, "p02": False, "p03": False, "p04": False})
    e = explain_flips(n, [f"s/{i}" for i in range(20)], [f"s/{i}" for i in range(40)])
    assert rep.noise_lines(e, n) == (
        f"The determinism run measured other prompts (25% of the prompts it measured varied under some condition "
        f"on http://127.0.0.1:8000): at that rate its noise changes about 10 of the 40 compared cases' outputs "
        f"(95% upper bound {e.upper}); at least {20 - e.upper} of the 20 flips are not explained by it.",)


def test_noise_lines_of_an_invariant_stack():
    n = steady()
    e = NoiseExplanation(4, 10, "by rate", 0, 0, 0, 0.0)
    assert rep.noise_lines(e, n) == ("The stack was invariant under every measured condition "
                                     "(http://127.0.0.1:8000): none of the 4 flips comes from its own "
                                     "non-determinism.",)


def test_noise_section_carries_the_lines_and_the_conditions_table():
    n = noise_run({"s/a": True})
    e = explain_flips(n, ["s/a"], ["s/a"])
    s = rep.noise_section(e, n)
    assert (s.title, s.key) == ("Stack noise", "noise")
    assert s.blocks[0] == Text(rep.noise_lines(e, n))
    assert table_rows(s.blocks[1]) == table_rows(rep.conditions_table(n))


@pytest.mark.parametrize("key", ["model", "url"])
def test_the_noise_lines_name_the_stack_by_url_or_model(key):
    n = Result({key: "X-STACK"}, {}, steady().outcomes)
    e = NoiseExplanation(1, 1, "by rate", 0, 0, 0, 0.0)
    assert "(X-STACK)" in rep.noise_lines(e, n)[0]
