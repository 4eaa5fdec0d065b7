"""The engine must reproduce the golden greedy continuations exactly on the CPU packed path."""
from __future__ import annotations

import json

import pytest

from quality_testing import golden


def test_golden_files_match_the_prompt_set():
    recs = golden.load_golden()
    assert {r["id"] for r in recs} == set(golden.GOLDEN_PROMPTS)
    for r in recs:
        assert r["prompt"] == golden.GOLDEN_PROMPTS[r["id"]]
        assert len(r["tokens"]) == r["n_tokens"] == golden.N_TOKENS
        assert r["weights"] == golden.WEIGHTS and r["device"] == golden.DEVICE


def test_golden_loader_rejects_foreign_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"id": "b", "tokens": []}), encoding="utf-8")
    with pytest.raises(Exception, match="golden record"):
        golden.load_golden(tmp_path)


@pytest.mark.model
def test_engine_reproduces_golden_continuations(packed_model, embedded_sha):
    assert packed_model.device.type == "cpu"
    bad = golden.check_golden(packed_model, embedded_sha)
    assert not bad, "\n".join(f"{b.id}: {b.message}" for b in bad)


@pytest.mark.model
def test_golden_check_reports_a_changed_continuation(packed_model, embedded_sha, tmp_path):
    """The check can fail: one altered token in a copy of the files is found and located."""
    for r in golden.load_golden():
        if r["id"] == "raw_history":  # a short prefix of the record keeps this test fast
            r["tokens"] = r["tokens"][:8]
            r["n_tokens"] = 8
            r["tokens"][5] = (r["tokens"][5] + 1) % packed_model.n_vocab
        else:
            r["gguf_sha256"] = "0" * 64
        (tmp_path / f"{r['id']}.json").write_text(json.dumps(r), encoding="utf-8")
    bad = {b.id: b.message for b in golden.check_golden(packed_model, embedded_sha, tmp_path)}
    assert bad.pop("raw_history").startswith("diverges at token 5")
    assert set(bad) == set(golden.GOLDEN_PROMPTS) - {"raw_history"}
    assert all(m == "made from another GGUF" for m in bad.values())
