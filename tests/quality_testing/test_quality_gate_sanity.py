"""The quality gate (quality_testing.gate_quality): the committed baseline and the gate's verdicts,
with the suite run replaced by prepared traces."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4eval.cases import case as cs
from ds4eval.cases.suites import load_suite
from ds4eval.run import trace as tr
from ds4eval.verdict import compare as cmp
from quality_testing import gate_quality as gq


def _baseline() -> list[tr.TraceRecord]:
    return tr.read_trace(gq.BASELINE).records


def test_the_baseline_pins_the_current_sanity_suite():
    """A change to a sanity case must come with a new baseline (and the comparison that justifies it)."""
    records = _baseline()
    suite = {c.key: c for c in load_suite("sanity", Path("/nonexistent"))}
    assert sorted((r.source, r.id) for r in records) == sorted(suite)
    assert all(r.case_hash == cs.case_hash(suite[(r.source, r.id)]) for r in records)
    assert all(r.status in ("PASSED", "FAILED") and r.temperature == 0.0 for r in records)
    assert {r.max_tokens for r in records} == {gq.TOKENS} and len({r.model_sha256 for r in records}) == 1
    assert all(r.prompt_sha256 and r.rendered_prompt and r.rendered_token_ends for r in records)


def test_the_baseline_was_made_on_the_embedded_model(embedded_path):
    from ds4eval.run.provenance import file_sha256

    assert gq.baseline_model(cmp.read_run(gq.BASELINE.read_text(encoding="utf-8"), "b")) == file_sha256(embedded_path)


def _setup(tmp_path, monkeypatch, new_records, model_bytes=b"gguf"):
    model = tmp_path / "m.gguf"
    model.write_bytes(model_bytes)
    sha = hashlib.sha256(b"gguf").hexdigest()
    base = [dataclasses.replace(r, model_sha256=sha) for r in _baseline()]
    baseline = tmp_path / "baseline.trace"
    baseline.write_text("".join(map(tr.format_record, base)), encoding="utf-8")
    runs = []

    def fake_run(cfg, trace):
        runs.append(cfg)
        records = new_records([dataclasses.replace(r, model_sha256=sha) for r in base])
        trace.write_text("".join(map(tr.format_record, records)), encoding="utf-8")

    monkeypatch.setattr(gq, "run_suite", fake_run)
    return baseline, model, runs


def _flip_first_pass(records):
    i = next(i for i, r in enumerate(records) if r.status == "PASSED")
    records[i] = dataclasses.replace(records[i], status="FAILED", picked=None)
    return records


def _gain_first_failure(records):
    i = next(i for i, r in enumerate(records) if r.status == "FAILED")
    records[i] = dataclasses.replace(records[i], status="PASSED", picked=records[i].expected)
    return records


@pytest.mark.parametrize("change, code, says", [
    (lambda rs: rs, 0, "ok: no significant regression"),
    (_flip_first_pass, 1, "FAILED: regression under --strict: 1 pass→fail"),
    (_gain_first_failure, 0, "re-baseline on purpose"),
    (lambda rs: [r for r in rs if r.status != "PASSED" or r is not next(x for x in rs if x.status == "PASSED")],
     1, "FAILED: regression under --strict: 1 lost pass(es)"),  # a run cut short loses a pass
])
def test_gate_verdicts(tmp_path, monkeypatch, change, code, says):
    baseline, model, runs = _setup(tmp_path, monkeypatch, change)
    r = CliRunner().invoke(gq.main, ["--baseline", str(baseline), "--model", str(model)])
    assert r.exit_code == code, r.output
    assert says in r.output and "## ds4-eval --compare" in r.output and "### Pass rates" in r.output
    assert runs[0].tokens == gq.TOKENS


def test_gate_refuses_a_baseline_of_another_model_before_running(tmp_path, monkeypatch):
    baseline, model, runs = _setup(tmp_path, monkeypatch, lambda rs: rs, model_bytes=b"other model")
    r = CliRunner().invoke(gq.main, ["--baseline", str(baseline), "--model", str(model)])
    assert r.exit_code == 2 and "the baseline was made on model sha256" in r.output and not runs
    r = CliRunner().invoke(gq.main, ["--baseline", str(tmp_path / "none.trace"), "--model", str(model)])
    assert r.exit_code == 2 and "--rebaseline" in r.output


def test_rebaseline_prints_the_comparison_then_writes(tmp_path, monkeypatch):
    baseline, model, runs = _setup(tmp_path, monkeypatch, _gain_first_failure)
    before = baseline.read_text()
    r = CliRunner().invoke(gq.main, ["--baseline", str(baseline), "--model", str(model), "--rebaseline"])
    assert r.exit_code == 0, r.output
    assert r.output.index("### Flips") < r.output.index("wrote the baseline")
    after = tr.read_trace(baseline).records
    assert baseline.read_text() != before and len(after) == 41
    passed = sum(x.status == "PASSED" for x in tr.read_trace(gq.BASELINE).records)
    assert sum(x.status == "PASSED" for x in after) == passed + 1


def test_the_suite_runs_on_the_path_every_avx2_cpu_shares():
    env = gq.reference_environment(None, ["avx512", "avx2", "portable", "torch"], {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "DS4_CPU_KERNELS": "avx2", "ATEN_CPU_CAPABILITY": "avx2"}
    # a CPU without AVX2 (aarch64): the environment as it is, the engine's own choice
    assert gq.reference_environment(None, ["portable", "torch"], {"DS4_CPU_KERNELS": "torch"}) == \
        {"DS4_CPU_KERNELS": "torch"}
    # a path named on the command line wins, and torch's own dispatch is left alone
    assert gq.reference_environment("portable", ["avx2"], {}) == {"DS4_CPU_KERNELS": "portable"}
