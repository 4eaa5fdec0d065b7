"""Tests for the speed gate (quality_testing.gate_speed); the quality gate's are in test_quality_gate_sanity.py."""
from __future__ import annotations

import shutil

import pytest

from quality_testing import gate_speed as gs


def _samples(base, work):
    return {"base": [{"prefill_tps": p, "decode_tps": d} for p, d in base],
            "work": [{"prefill_tps": p, "decode_tps": d} for p, d in work]}


def test_speed_judge_uses_ratio_of_medians():
    s = _samples([(100, 50), (110, 52), (90, 10)], [(95, 45), (99, 47), (500, 46)])
    ratios, failed = gs.judge(s, 0.10)
    assert ratios["prefill_tps"] == pytest.approx(99 / 100)
    assert ratios["decode_tps"] == pytest.approx(46 / 50)
    assert failed == ()
    ratios, failed = gs.judge(s, 0.05)
    assert failed == ("decode_tps",)


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


@pytest.mark.parametrize("flag", ["--product-floor", "--product-own-max"])
@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_product_limits_out_of_range_are_usage_errors(flag, value):
    from click.testing import CliRunner

    r = CliRunner().invoke(gs.main, ["--base", "HEAD", flag, value])
    assert r.exit_code == 2
    assert f"{flag} must be in [0, 1)" in r.output and "Traceback" not in r.output
