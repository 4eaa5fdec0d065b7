"""ds4eval.verdict.gate and `ds4-eval gate`: the predicted distribution by its definition, the
planned threshold's false-alarm rate and power on simulated references and runs, Holm over
sources, and the command's verdicts and exit statuses."""

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner
from report_fakes import counted_repeats, rec, trace_text

from ds4eval import cli
from ds4eval.verdict import gate as gt
from ds4eval.verdict import references as refs

# A suite like the sanity suite under sampling: many cases that rarely pass, a few that mostly do.
TRUTH = np.r_[np.full(14, 0.0), np.full(10, 0.06), np.full(8, 0.3), np.full(6, 0.6), np.full(3, 0.95)]
REFERENCE_RUNS = 12


def cases_of(counts, graded=REFERENCE_RUNS, source="s"):
    return [refs.ReferenceCase(source, f"c{i}", f"h{i}", int(c), graded) for i, c in enumerate(counts)]


def test_predicted_passes_is_the_beta_binomial():
    p = gt.predicted_passes(3, 10, 4, prior=(0.5, 0.5))
    a, b = 3.5, 7.5
    beta = lambda x, y: math.exp(math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y))  # noqa: E731
    expected = [math.comb(4, x) * beta(x + a, 4 - x + b) / beta(a, b) for x in range(5)]
    assert p == pytest.approx(expected)
    assert gt.predicted_total(cases_of([3, 3]), 1).sum() == pytest.approx(1.0)


def test_fitted_prior_follows_the_suite():
    a, b = gt.fit_prior(cases_of(np.random.default_rng(0).binomial(REFERENCE_RUNS, TRUTH)))
    assert 0.1 < a / (a + b) < 0.3  # the suite's mean pass share
    assert gt.fit_prior(cases_of([12, 12, 12])) == gt.JEFFREYS  # all always pass: nothing to fit
    assert gt.fit_prior(cases_of([1, 0], graded=1)) == gt.JEFFREYS  # one run a case


def reference_of(passes: np.ndarray) -> refs.Reference:
    """A reference of source "s" from a [runs, cases] matrix of passes."""
    runs = passes.shape[0]
    totals = tuple(int(x) for x in passes.sum(axis=1))
    return refs.Reference(refs.key_of(counted_repeats({"a": 1})), runs, (), totals, (passes.shape[1],) * runs, {},
                          tuple(cases_of(passes.sum(axis=0), graded=runs)), {"s": totals})


def simulated_reference(rng, truth=TRUTH, runs=REFERENCE_RUNS):
    return reference_of(rng.random((runs, truth.size)) < truth)


def planned_threshold(ref, repeats, alpha):
    pred = gt.predict(ref, repeats)
    return pred.threshold("s", alpha), pred


@pytest.mark.parametrize("repeats, alpha", [(1, 0.05), (3, 0.05), (3, 0.01)])
def test_false_alarms_stay_below_alpha(repeats, alpha):
    """Over 300 simulated references of 12 runs, each judging 200 unchanged runs (60,000 gates)."""
    rng = np.random.default_rng(3)
    fails = trials = 0
    for _ in range(300):
        t, _ = planned_threshold(simulated_reference(rng), repeats, alpha)
        runs = rng.binomial(repeats, np.broadcast_to(TRUTH, (200, TRUTH.size))).sum(axis=1)
        fails += int((runs <= t).sum())
        trials += runs.size
    assert fails / trials <= alpha + 0.005


def test_a_seed_shared_by_every_case_widens_the_threshold():
    """Runs whose cases share a random shock (a seed that sends them all astray) spread more than
    independent cases; the reference's run totals and measured dispersion widen the prediction,
    and the false alarms fall towards alpha (not to it: see the figures below)."""
    rng = np.random.default_rng(8)
    bad = 0.1  # one run in ten: every case's chance divided by four

    def runs_of(n):
        shock = np.where(rng.random((n, 1)) < bad, 0.25, 1.0)
        return rng.random((n, TRUTH.size)) < TRUTH * shock

    truth_mean = TRUTH * (1 - bad * 0.75)
    fails = naive = trials = 0
    for _ in range(200):
        t, pred = planned_threshold(reference_of(runs_of(24)), 3, 0.01)
        t_naive = gt.threshold(pred.totals["s"], 0.01)
        totals = sum(runs_of(300).sum(axis=1).reshape(100, 3).T)  # 100 gate runs of 3 repeats
        fails += int((totals <= t).sum())
        naive += int((totals <= t_naive).sum())
        trials += totals.size
    # Measured: 2.1% against 5.7% for the per-case model alone (1.4% with 48 reference runs). A
    # reference of 24 runs holds 2.4 shocked runs on average and sometimes none, so the tail of a
    # 3-repeat sum stays uncertain.
    assert truth_mean.sum() > 0 and fails < naive and fails / trials <= 0.025


@pytest.mark.parametrize("repeats", [1, 3])
def test_power_reaches_the_planned_value(repeats):
    rng = np.random.default_rng(4)
    ref = simulated_reference(rng)
    cases = list(ref.cases)
    t, pred = planned_threshold(ref, repeats, 0.01)
    drop = gt.detectable_drop(cases, repeats, t, 0.8, pred.phi)
    assert drop is not None
    rates = np.array([c.passed / c.graded for c in cases])
    scaled = rates * (1 - drop / rates.mean())
    runs = rng.binomial(repeats, np.broadcast_to(scaled, (20_000, scaled.size))).sum(axis=1)
    simulated = float(np.mean(runs <= t))
    assert simulated >= 0.8 - 0.02


def _reference(counts_by_source: dict[str, list[int]]):
    """Counts per case; run totals as even as the counts allow."""
    cases = [c for src, counts in counts_by_source.items() for c in cases_of(counts, source=src)]
    per_source = {src: tuple(sum(counts) // REFERENCE_RUNS + (r < sum(counts) % REFERENCE_RUNS)
                             for r in range(REFERENCE_RUNS)) for src, counts in counts_by_source.items()}
    totals = tuple(sum(v[r] for v in per_source.values()) for r in range(REFERENCE_RUNS))
    return refs.Reference(refs.key_of(counted_repeats({"a": 1})), REFERENCE_RUNS, (), totals,
                          (len(cases),) * REFERENCE_RUNS, {}, tuple(cases), per_source)


def test_judge_and_holm_over_sources():
    ref = _reference({"x": [10] * 20, "y": [6] * 20})
    counts = {(c.source, c.id): (1 if c.source == "y" else 0, 1, c.case_hash) for c in ref.cases}
    result = gt.judge(ref, counts, 1, alpha=0.01)
    x, y = result.sources
    assert x.failed and not y.failed and result.exit_status == 1
    assert x.observed == 0 and y.observed == 20 and x.threshold >= 0
    assert (x.adjusted, y.adjusted) == tuple(h.adjusted for h in gt.stats.holm([x.p, y.p], 0.01))
    text = gt.render_text(result)
    assert "gate: FAILED (x below the reference's noise)" in text
    assert json.loads(json.dumps(gt.as_json(result)))["failed"] is True


def test_judge_refuses_a_run_that_does_not_fit():
    ref = _reference({"x": [5, 6, 7]})
    counts = {(c.source, c.id): (1, 1, c.case_hash) for c in ref.cases}
    with pytest.raises(gt.GateInputError, match="lacks 1 of the reference's 3 cases"):
        gt.judge(ref, {k: v for k, v in list(counts.items())[:2]}, 1)
    stale = {**counts, ("x", "c0"): (1, 1, "other")}
    with pytest.raises(gt.GateInputError, match="changed content"):
        gt.judge(ref, stale, 1)
    extra = {**counts, ("x", "new"): (1, 1, "h")}
    assert gt.judge(ref, extra, 1).notes == ("1 case(s) of the run are not in the reference and are left out",)


def _runs(counts: dict[str, int], k: int, seed: int, **kw):
    """k sampled repeats of source "s"; case number n passes `counts[id]` of them, spread over
    the repeats (repeat r passes when (r + n) mod k < count), so run totals stay even."""
    out = []
    for n, (cid, passes) in enumerate(counts.items(), start=1):
        for r in range(k):
            ok = (r + n) % k < passes
            out.append(rec(n, "PASSED" if ok else "FAILED", "4" if ok else "5", source="s", id=cid, repeat=r,
                           temperature=0.7, seed=seed + r, **kw))
    return out


def test_gate_command_passes_fails_and_refuses(tmp_path):
    counts = {f"c{i}": 6 if i < 10 else 2 for i in range(20)}
    ref_trace, refs_file = tmp_path / "ref.trace", tmp_path / "refs.json"
    ref_trace.write_text(trace_text(_runs(counts, 12, 100)))
    assert CliRunner().invoke(cli.main, ["reference", "record", str(ref_trace), "-o", str(refs_file)]).exit_code == 0
    same, worse = tmp_path / "same.trace", tmp_path / "worse.trace"
    # A quarter of the reference's passes, spread over 3 repeats: 1.5 of 3 and 0.5 of 3 on average.
    same.write_text(trace_text(_runs({k: (1 + i % 2) if i < 10 else i % 2 for i, k in enumerate(counts)}, 3, 900)))
    worse.write_text(trace_text(_runs({k: 0 for k in counts}, 3, 900)))
    r = CliRunner().invoke(cli.main, ["gate", str(same), "--references", str(refs_file)])
    assert r.exit_code == 0 and "gate: ok" in r.output, r.output
    r = CliRunner().invoke(cli.main, ["gate", str(worse), "--references", str(refs_file), "--format", "json"])
    assert r.exit_code == 1 and json.loads(r.output)["failed"] is True, r.output
    other = tmp_path / "other.trace"
    other.write_text(trace_text(_runs(counts, 3, 900, kv_type="bfloat16")))
    r = CliRunner().invoke(cli.main, ["gate", str(other), "--references", str(refs_file)])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert "no reference matches this run (1 in the file); the closest differs in kv_type: reference float16, " \
           "run bfloat16" in r.output
    r = CliRunner().invoke(cli.main, ["gate", str(other), "--references", str(refs_file), "--allow-diff", "kv_type"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli.main, ["gate", str(same), "--references", str(ref_trace)])
    assert r.exit_code == 2 and "is not JSON" in r.output
