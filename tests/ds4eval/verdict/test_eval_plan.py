"""ds4eval.verdict.plan and `ds4-eval plan`: the baseline read from a trace (its repeats estimate the
noise), the three designs side by side, and the command's text, JSON and one-line errors."""

import json

import pytest
from click.testing import CliRunner
from report_fakes import counted_repeats, flip_pair, trace_text

from ds4eval import cli
from ds4eval.verdict import plan as pl
from ds4eval.verdict import power as pw


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def test_baseline_from_repeats_estimates_the_discordance():
    counts = {"a": 5, "b": 0, "c": 3, "d": 1, "e": 5}
    b = pl.baseline_from_records(counted_repeats(counts, k=5), "r.trace")
    assert (b.cases, b.repeats) == (5, 5)
    assert b.population.pass_rate == pytest.approx(14 / 25)
    assert b.discordance == pytest.approx(pw.estimated_discordance([(c, 5) for c in counts.values()]))
    assert "5 repeats" in b.discordance_note


def test_baseline_from_one_greedy_run_assumes_no_noise():
    base, _ = flip_pair(10)
    b = pl.baseline_from_records(base, "g.trace")
    assert b.discordance == 0.0 and b.repeats == 1 and "assumed 0" in b.discordance_note
    assert b.overridden(None, None) is b
    sampled = b.overridden(None, 0.0)
    assert sampled.discordance_note == "given" and sampled.population.pass_rate == pytest.approx(1.0)
    noisy = pl.baseline_from_records(flip_pair(10)[1], "n.trace").overridden(None, 0.1)
    assert noisy.discordance == 0.1 and noisy.population.pass_rate == pytest.approx(0.8) and noisy.cases == 10


def test_plan_shows_pairing_and_repeats_save_cases():
    p = pl.make_plan(pl.Baseline.given(0.5, 0.2), drop=0.1, cases=41, repeats=4)
    one, rep, unpaired = p.designs
    assert "McNemar" in one.name and "4 repeats" in rep.name and "TensorRT-LLM" in unpaired.name
    assert rep.cases_needed < one.cases_needed < unpaired.cases_needed
    assert rep.detectable_drop < one.detectable_drop < unpaired.detectable_drop
    design = pw.Design(pw.population_from_rates(0.5, 0.2))
    assert one.cases_needed == pw.cases_needed(design, 0.1, 0.8)
    assert one.power_at_cases == pytest.approx(design.power(41, 0.1))


def test_plan_refuses_a_drop_beyond_the_pass_rate():
    with pytest.raises(ValueError, match="at most the pass rate"):
        pl.make_plan(pl.Baseline.given(0.1, 0.05), drop=0.2, cases=10)
    with pytest.raises(ValueError, match="--cases"):
        pl.make_plan(pl.Baseline.given(0.5, 0.05), drop=0.05)


def test_plan_command_text_and_json(tmp_path):
    t = tmp_path / "r.trace"
    t.write_text(trace_text(counted_repeats({"a": 5, "b": 0, "c": 3, "d": 1, "e": 4, "f": 2}, k=5)))
    r = invoke("plan", t, "--drop", 20)
    assert r.exit_code == 0, r.output
    assert "6 cases; pass rate 50.0%" in r.output and "5 repeats a side" in r.output
    assert "unpaired two-sample z-test" in r.output
    r = invoke("plan", "--pass-rate", 0.34, "--discordance", 0, "--cases", 41, "--format", "json")
    obj = json.loads(r.output)
    assert obj["format"] == "ds4eval-plan" and obj["cases"] == 41 and obj["drop"] == 0.05
    assert 0.15 < obj["designs"][0]["detectable_drop"] < 0.21


@pytest.mark.parametrize("args, msg", [
    ((), "plan needs a baseline"),
    (("--pass-rate", 0.5), "--pass-rate needs --discordance"),
    (("--pass-rate", 50, "--discordance", 0.1), "--pass-rate must be a share"),
    (("--pass-rate", 0.5, "--discordance", 0.1, "--drop", 0), "--drop is in percentage points"),
    (("--pass-rate", 0.5, "--discordance", 0.1, "--power", 80), "--power must be in (0, 1)"),
    (("--pass-rate", 0.5, "--discordance", 0.1), "give --cases N"),
    (("--pass-rate", 0.2, "--discordance", 0.5, "--cases", 9), "impossible"),
    (("missing.trace",), "cannot read missing.trace"),
])
def test_plan_command_errors_are_one_line(args, msg):
    r = invoke("plan", *args)
    assert r.exit_code == 2 and r.output.count("\n") == 1 and msg in r.output, r.output
