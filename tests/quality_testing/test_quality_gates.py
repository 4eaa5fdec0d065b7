"""Tests for the speed gate (quality_testing.gate_speed); the quality gate's are in test_quality_gate_sanity.py."""
from __future__ import annotations

import shutil

import pytest

from quality_testing import gate_speed as gs


def _samples(base, work):
    return {"base": [{"prefill_tps": p, "decode_tps": d} for p, d in base],
            "work": [{"prefill_tps": p, "decode_tps": d} for p, d in work]}


def test_speed_judge_takes_the_median_of_paired_ratios():
    # Repetition 2 has a slow moment on both sides; pairing keeps it from moving one side alone.
    s = _samples([(100, 50), (110, 52), (50, 20)], [(95, 45), (99, 52), (52, 19)])
    ratios, failed = gs.judge(s, 0.10)
    assert ratios["prefill_tps"] == pytest.approx(0.95)  # median of 0.95, 0.9, 1.04
    assert ratios["decode_tps"] == pytest.approx(0.95)  # median of 0.9, 1.0, 0.95
    assert failed == ()
    assert gs.judge(s, 0.04)[1] == ("prefill_tps", "decode_tps")


def test_speed_judge_a_slow_spell_over_more_work_than_base_samples_does_not_fail():
    # A spell hits repetitions 2 and 3 whole and repetition 1's working-tree side only: the
    # ratio of medians would read 60/100, the paired ratios 1, 0.6, 1, 1, 1.
    base = [(100, 100), (100, 100), (60, 60), (60, 60), (100, 100)]
    work = [(100, 100), (60, 60), (60, 60), (60, 60), (100, 100)]
    assert gs.judge(_samples(base, work), 0.10) == ({"prefill_tps": 1.0, "decode_tps": 1.0}, ())


def test_speed_judge_needs_paired_samples():
    with pytest.raises(ValueError):
        gs.judge(_samples([(1, 1)] * 2, [(1, 1)]), 0.1)


def test_speed_judge_fails_a_clear_regression_only_past_the_threshold():
    s = _samples([(100, 100)] * 3, [(70, 100)] * 3)
    assert gs.judge(s, 0.10)[1] == ("prefill_tps",)
    assert gs.judge(s, 0.25)[1] == ("prefill_tps",)
    assert gs.judge(s, 0.35)[1] == ()


def test_has_engine(tmp_path):
    assert not gs.has_engine(tmp_path)
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text('"""stub"""\n')
    assert not gs.has_engine(tmp_path)
    (tmp_path / "engine" / "__init__.py").write_text("from engine.model import load_model\n")
    assert gs.has_engine(tmp_path)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_extract_tree_reads_a_commit_without_touching_the_repository(tmp_path):
    sha = gs._git("rev-parse", "HEAD").decode().strip()
    gs.extract_tree(sha, tmp_path)
    assert (tmp_path / "pyproject.toml").is_file()
    with pytest.raises(gs.GateError):
        gs._git("rev-parse", "--verify", "--quiet", "no-such-ref^{commit}")


@pytest.mark.model
@pytest.mark.slow
def test_speed_gate_runs_against_head(embedded_path):
    cfg = gs.SpeedGateConfig(base="HEAD", threshold=0.99, repeats=1, trials=1, prefill_tokens=16, decode_context=4,
                             decode_tokens=4, model=embedded_path)
    lines = []
    res = gs.run_gate(cfg, echo=lines.append)
    if res is None:
        assert "no engine" in lines[-1]
        return
    assert set(res.ratios) == set(gs.METRICS) and all(r > 0 for r in res.ratios.values())
    assert len(res.samples["base"]) == len(res.samples["work"]) == 1
    assert "ratio" in gs.render(res, cfg)


@pytest.mark.model
@pytest.mark.slow  # make test's ci-speed step runs this product step in full (gate_speed.run_product)
def test_product_step_measures_the_working_tree(embedded_path):
    cfg = gs.SpeedGateConfig(model=embedded_path, product_floor=0.01, product_own_max=0.9, product_rounds=1,
                             product_tokens=12, product_streams=0)
    lines = []
    res = gs.run_product(cfg, echo=lines.append)
    assert "ds4bench.cli product" in lines[0]
    for path in ("engine", "ds4-eval", "server"):
        assert path in res.table
    assert res.failures == ()
    assert "ms per token outside the step" in res.table  # the own-work share the gate judges


def _result(ratio):
    samples = _samples([(100, 100)], [(100 * ratio, 100)])
    return gs.GateResult("0" * 40, samples, *gs.judge(samples, 0.25))


@pytest.mark.parametrize("second, code", [(1.0, 0), (0.5, 1)])
def test_a_failing_comparison_is_measured_again_and_the_second_is_the_verdict(monkeypatch, second, code):
    from click.testing import CliRunner

    runs = iter([_result(0.5), _result(second)])
    monkeypatch.setattr(gs, "run_gate", lambda cfg: next(runs))
    r = CliRunner().invoke(gs.main, ["--base", "HEAD", "--threshold", "0.25", "--product-floor", "0"])
    assert r.exit_code == code, r.output
    assert "first run failed (prefill_tps): measured again" in r.output
    assert r.output.count("paired ratio") == 2
    assert next(runs, None) is None  # measured exactly twice


def test_a_passing_comparison_is_measured_once(monkeypatch):
    from click.testing import CliRunner

    runs = iter([_result(0.9), _result(0.1)])
    monkeypatch.setattr(gs, "run_gate", lambda cfg: next(runs))
    r = CliRunner().invoke(gs.main, ["--base", "HEAD", "--threshold", "0.25", "--product-floor", "0"])
    assert r.exit_code == 0 and "measured again" not in r.output


@pytest.mark.parametrize("flag", ["--product-floor", "--product-own-max"])
@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_product_limits_out_of_range_are_usage_errors(flag, value):
    from click.testing import CliRunner

    r = CliRunner().invoke(gs.main, ["--base", "HEAD", flag, value])
    assert r.exit_code == 2
    assert f"{flag} must be in [0, 1)" in r.output and "Traceback" not in r.output
