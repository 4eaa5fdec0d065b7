"""`ds4-eval compare`'s power statement, per-source Holm tests and --equivalence: the figures
against `power` and `stats` and against simulation, the exit status, and every medium."""

import json

import pytest
from click.testing import CliRunner
from report_fakes import comparison, counted_repeats, rec, trace_text

from ds4eval import cli
from ds4eval.reports import formats
from ds4eval.verdict import power as pw
from ds4eval.verdict import stats
from test_eval_power import TOLERANCE, simulate_regressions


def greedy_pair(n: int, base_pass: int, flips_down: int = 0, flips_up: int = 0, sources: int = 1):
    """n cases; BASE passes the first base_pass; NEW fails `flips_down` of those and passes
    `flips_up` of the others."""
    base, new = [], []
    for i in range(1, n + 1):
        src = f"s{i % sources}"
        bp = i <= base_pass
        np_ = (i > flips_down) if bp else (i - base_pass <= flips_up)
        base.append(rec(i, "PASSED" if bp else "FAILED", "4" if bp else "5", source=src))
        new.append(rec(i, "PASSED" if np_ else "FAILED", "4" if np_ else "5", source=src))
    return base, new


def test_power_line_of_a_greedy_comparison_matches_the_plan_and_simulation():
    c = comparison(*greedy_pair(41, 14))
    a = c.assurance
    assert (a.cases, a.discordance, a.power) == (41, 0.0, 0.8)
    design = pw.Design(pw.population_from_rates(14 / 41, 0.0))
    assert a.detectable_drop == pytest.approx(pw.detectable_drop(design, 41, 0.8))
    assert 0.15 < a.detectable_drop < 0.21  # 41 greedy cases miss a 15-point drop
    simulated = simulate_regressions(design, 41, a.detectable_drop, 20_000, seed=21)
    assert simulated >= 0.8 - TOLERANCE and abs(simulated - design.power(41, a.detectable_drop)) < TOLERANCE
    text = formats.render_comparison(c, "text")
    assert f"a drop of {100 * a.detectable_drop:.1f} points or more is caught with probability 0.8" in text


def test_power_of_a_noisy_comparison_uses_the_observed_discordance():
    c = comparison(*greedy_pair(200, 100, flips_down=20, flips_up=20))
    assert c.assurance.discordance == pytest.approx(0.2)
    design = pw.Design(pw.population_from_rates(0.5, 0.2))
    assert c.assurance.detectable_drop == pytest.approx(pw.detectable_drop(design, 200, 0.8))
    stricter = comparison(*greedy_pair(200, 100, flips_down=20, flips_up=20), power=0.95)
    assert stricter.assurance.detectable_drop > c.assurance.detectable_drop


def test_power_with_repeats_uses_the_sign_test_design():
    counts = {f"c{i}": i % 6 for i in range(30)}
    base = counted_repeats(counts, k=5)
    c = comparison(base, base)
    pop = pw.population_from_counts([(v, 5) for v in counts.values()])
    assert c.assurance.detectable_drop == pytest.approx(pw.detectable_drop(pw.Design(pop, 0.05, 5, 5), 30, 0.8))
    assert c.assurance.discordance == pytest.approx(pw.estimated_discordance([(v, 5) for v in counts.values()]))


def test_nothing_to_lose_states_it():
    c = comparison(*greedy_pair(10, 0))
    assert c.assurance.detectable_drop is None
    assert "no drop is caught" in formats.render_comparison(c, "text")


@pytest.mark.parametrize("n, down, up, equivalent", [(400, 0, 0, True), (41, 0, 0, False), (400, 30, 0, False),
                                                      (400, 8, 6, True)])
def test_equivalence_verdict_and_exit_status(n, down, up, equivalent):
    c = comparison(*greedy_pair(n, n // 2, down, up), equivalence=0.05)
    e = c.assurance.equivalence
    assert e == stats.paired_equivalence(down, up, n, 0.05, 0.05)
    assert e.equivalent is equivalent
    assert c.exit_status == (0 if equivalent else 1)
    text = formats.render_comparison(c, "text")
    shown = "shown" if equivalent else "not shown"
    assert f"equivalence within ±5 points: {shown}" in text


def test_equivalence_with_repeats_uses_the_expected_table():
    counts = {f"c{i}": i % 6 for i in range(60)}
    c = comparison(counted_repeats(counts, k=5), counted_repeats(counts, k=5), equivalence=0.2)
    assert c.assurance.equivalence.delta == 0.0
    worse = sum(v / 5 * (1 - v / 5) for v in counts.values())
    assert c.assurance.equivalence == stats.paired_equivalence(worse, worse, 60, 0.2, 0.05)


def test_holm_over_sources_names_the_significant_ones():
    base, new = greedy_pair(60, 60, sources=2)
    for i in range(0, 60, 2):  # source s0 (even ids) loses 12 cases, s1 none
        if i < 24:
            new[i] = rec(i + 1, "FAILED", "5", source="s1" if (i + 1) % 2 else "s0")
    c = comparison(base, new)
    tests = {t.source: t for t in c.assurance.sources}
    assert set(tests) == {"s0", "s1"}
    ps = [tests["s1"].p, tests["s0"].p]
    assert [tests[s].adjusted for s in ("s1", "s0")] == [h.adjusted for h in stats.holm(ps, 0.05)]
    md = formats.render_comparison(c, "markdown")
    assert "Holm's step-down over 2 sources" in md
    regressed = [t.source for t in c.assurance.sources if t.regression]
    assert f"significant regressions after Holm: {', '.join(regressed) if regressed else 'none'}" in md


def test_one_source_has_no_holm_table():
    c = comparison(*greedy_pair(20, 10))
    assert c.assurance.sources == ()
    assert "Holm" not in formats.render_comparison(c, "markdown")


def test_json_and_html_carry_the_assurance():
    c = comparison(*greedy_pair(60, 30, 3, 1, sources=2), equivalence=0.1)
    obj = json.loads(formats.render_comparison(c, "json"))
    a = obj["assurance"]
    assert a["detectable_drop"] == c.assurance.detectable_drop and a["equivalence"]["margin"] == 0.1
    assert [s["source"] for s in a["sources"]] == [t.source for t in c.assurance.sources]
    html = formats.render_comparison(c, "html")
    assert "Power and equivalence" in html and "holm-table" in html


def test_compare_command_flags(tmp_path):
    base, new = greedy_pair(41, 20)
    b, n = tmp_path / "b.trace", tmp_path / "n.trace"
    b.write_text(trace_text(base))
    n.write_text(trace_text(new))
    r = CliRunner().invoke(cli.main, ["compare", str(b), str(n), "--power", "0.9"])
    assert r.exit_code == 0 and "caught with probability 0.9" in r.output
    r = CliRunner().invoke(cli.main, ["compare", str(b), str(n), "--equivalence", "5"])
    assert r.exit_code == 1 and "equivalence within ±5 points: not shown" in r.output
    r = CliRunner().invoke(cli.main, ["compare", str(b), str(n), "--equivalence", "150"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "--equivalence is in percentage points" in r.output
