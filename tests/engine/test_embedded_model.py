"""The embedded SmolLM2-135M-Instruct through the public API."""
from __future__ import annotations

import pytest

import engine
from engine import SamplingParams, generate

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model():
    return engine.load_model()


def test_loads_with_expected_shape(model):
    assert model.config.arch == "llama" and model.config.n_layer == 30 and model.n_ctx == 8192
    assert model.quant == "Q4_1" and model.eos_id == 2 and 2 in model.eos_ids
    assert model.weight_bytes < 150 * 2**20  # packed: int4 layers, float16 head


def test_greedy_answer(model):
    s = model.new_session()
    s.sync(model.prompt_ids(model.render_chat([{"role": "user", "content": "What is the capital of France?"}])))
    out = [t for t in generate(s, SamplingParams(), 24) if t not in model.eos_ids]
    assert "Paris" in model.detokenize(out)


def test_packed_and_float32_agree_on_greedy_tokens(model):
    exact = engine.load_model(weights="float32")
    ids = model.prompt_ids(model.render_chat([{"role": "user", "content": "List three fruits."}]))
    outs = []
    for m in (model, exact):
        s = m.new_session()
        s.sync(ids)
        outs.append(list(generate(s, SamplingParams(argmax_ignoring_eos=True), 16)))
    agree = sum(a == b for a, b in zip(*outs))
    assert outs[0][:4] == outs[1][:4] and agree >= 8
