"""The reference gate (quality_testing.gate_reference): the committed reference file, the degraded
test model it is checked with, and the commands it runs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ds4eval.cases import case as cs
from ds4eval.cases.suites import load_suite
from ds4eval.verdict import gate as gt
from ds4eval.verdict import references as refs
from engine.gguf_file import read_gguf
from engine.synthetic import RandomModelSpec, write_random_gguf
from quality_testing import gate_reference as gr


def _reference() -> refs.Reference:
    (ref,) = refs.from_json(json.loads(gr.REFERENCES.read_text(encoding="utf-8")), "sanity_references.json")
    return ref


def test_the_reference_pins_the_current_sanity_suite_and_settings():
    ref = _reference()
    suite = {c.key: c for c in load_suite("sanity", Path("/nonexistent"))}
    assert sorted((c.source, c.id) for c in ref.cases) == sorted(suite)
    assert all(c.case_hash == cs.case_hash(suite[(c.source, c.id)]) for c in ref.cases)
    k = ref.key
    assert (k.suite, k.temperature, k.max_tokens, k.thinking) == (gr.SUITE, gr.TEMPERATURE, gr.TOKENS, False)
    assert ref.runs == gr.REFERENCE_RUNS and all(c.graded == ref.runs for c in ref.cases)
    assert not set(ref.seeds) & set(range(gr.SEED, gr.SEED + 100 * gr.REPEATS))  # gate seeds are never reference seeds


def test_the_reference_holds_no_case_text():
    text = gr.REFERENCES.read_text(encoding="utf-8")
    for case in load_suite("sanity", Path("/nonexistent")):
        assert case.question not in text and f'"{case.answer}"' not in text


def test_the_reference_was_made_on_the_embedded_model(embedded_sha):
    assert _reference().key.model_sha256 == embedded_sha


def test_the_planned_gate_catches_a_drop_of_about_ten_points():
    ref = _reference()
    pred = gt.predict(ref, gr.REPEATS)
    t = pred.threshold("sanity", gr.ALPHA)
    drop = gt.detectable_drop(pred.sources["sanity"], gr.REPEATS, t, 0.8, pred.phi)
    assert t >= 0 and drop is not None and drop < 0.13


def test_the_degraded_copy_changes_one_tensor_only(tmp_path):
    src = write_random_gguf(tmp_path / "m.gguf", RandomModelSpec(n_layer=2))
    name = "blk.1.ffn_norm.weight"
    gr.scaled_tensor_copy(src, str(tmp_path / "d.gguf"), name, 0.25)
    a, b = read_gguf(src), read_gguf(tmp_path / "d.gguf")
    assert a.metadata == b.metadata
    for t in a.tensors:
        x = np.frombuffer(a.tensors[t].data, dtype=np.uint8)
        y = np.frombuffer(b.tensors[t].data, dtype=np.uint8)
        assert (x == y).all() == (t != name), t
    assert np.allclose(b.tensors[name].data.view("<f4"), a.tensors[name].data.view("<f4") * 0.25)


def test_commands(tmp_path):
    run = gr.SampledRun(9000, 3, model="m.gguf").command(tmp_path / "t.trace")
    assert run[1:] == ["run", "--suite", "sanity", "--plain", "--temp", "0.7", "--seed", "9000", "--repeats", "3",
                       "--tokens", "128", "--trace", str(tmp_path / "t.trace"), "--model", "m.gguf"]
    gate = gr.gate_command(tmp_path / "t.trace", gr.REFERENCES, "m.gguf")
    assert gate[1:] == ["gate", str(tmp_path / "t.trace"), "--references", str(gr.REFERENCES), "--alpha", "0.01",
                        "--model", "m.gguf", "--allow-diff", "model"]
