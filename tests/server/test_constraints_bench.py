"""Benchmarks (pytest-benchmark) of constrained decoding; measured, not asserted. `make bench` runs them.

- `test_mask_step`: the per-token cost of a JSON-schema constraint over the embedded model's
  vocabulary (49,152 tokens): `decide` (llguidance's mask, unpacked to a bool row), the masked
  logits, and `advance`, per token of a 40-token document. A random GGUF with the embedded
  tokenizer stands in for the model, so no weights are loaded.
- `test_model_tokens_per_s_with_and_without_schema` (only with DS4_BENCH=1: it loads the
  embedded model): greedy decoding on the embedded model through `TokenDecoder`, free and
  under a schema, in alternating rounds of one run; prints both rates and their ratio.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from server.constraints import GrammarConstraint, apply_mask, json_grammar
from server.jobs import GenerationRequest, Job, SamplingSpec, TokenDecoder

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "city", "tags", "ok"], "additionalProperties": False}
DOCUMENT = '{"name": "Ada Lovelace", "age": 36, "city": "London", "tags": ["math", "engines", "poetry"], "ok": true}'


def test_mask_step(benchmark, vocab_model):
    model = vocab_model
    tokens = model.tokenize(DOCUMENT)
    grammar = json_grammar(SCHEMA)
    logits = torch.randn(model.n_vocab)
    GrammarConstraint(model, grammar)  # the vocabulary is built once per model, outside the timing

    def document() -> None:
        c = GrammarConstraint(model, grammar)
        for t in tokens:
            step = c.decide()
            if step is not None and step.allowed is not None:
                apply_mask(logits, step.allowed)
            c.advance(t)
        assert c.complete

    benchmark(document)
    if benchmark.stats is None:  # --benchmark-disable: run once, nothing measured
        return
    per_token_us = benchmark.stats.stats.mean / len(tokens) * 1e6
    benchmark.extra_info["tokens"] = len(tokens)
    benchmark.extra_info["us_per_token"] = round(per_token_us, 1)
    print(f"\nmask step: {per_token_us:.1f} us per token over {len(tokens)} tokens, vocabulary {model.n_vocab}")


def _decode(model, prompt_ids, budget: int, constraint) -> tuple[int, float]:
    req = GenerationRequest(prompt_text="", prompt_ids=tuple(prompt_ids), max_tokens=budget,
                            sampling=SamplingSpec(temperature=0.0, ignore_eos=constraint is None),
                            new_constraint=constraint)
    decoder = TokenDecoder(model, Job(1, req, lambda _e: None))
    from engine import Sampler, SamplingParams
    sampler = Sampler(SamplingParams(temperature=0.0), model.eos_ids)
    session = model.new_session()
    session.sync(list(prompt_ids))
    start = time.perf_counter()
    n = 0
    for _ in range(budget):
        token = decoder.choose(session.logits, sampler)
        n += 1
        if not decoder.accept(token):
            break
        session.eval(token)
    return n, time.perf_counter() - start


@pytest.mark.model
@pytest.mark.skipif(not os.environ.get("DS4_BENCH"), reason="loads the embedded model: DS4_BENCH=1 (make bench)")
def test_model_tokens_per_s_with_and_without_schema(benchmark):
    from engine import load_model
    from server.prompting import prompt_ids

    model = load_model()
    text = model.render_chat([{"role": "user", "content": "Describe a famous scientist as JSON."}])
    ids = prompt_ids(model, text)
    grammar = json_grammar(SCHEMA)

    def schema(m, _splitter):
        return GrammarConstraint(m, grammar)
    _decode(model, ids, 8, schema)  # warm-up: kernels, the grammar's vocabulary
    totals = {"free": [0, 0.0], "schema": [0, 0.0]}

    def rounds() -> None:
        for _ in range(2):
            for name, c in (("free", None), ("schema", schema)):
                n, dt = _decode(model, ids, 48, c)
                totals[name][0] += n
                totals[name][1] += dt

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    free, constrained = (totals[k][0] / totals[k][1] for k in ("free", "schema"))
    benchmark.extra_info.update(free_tok_s=round(free, 1), schema_tok_s=round(constrained, 1),
                                ratio=round(constrained / free, 3))
    print(f"\nembedded model, greedy: free {free:.1f} tok/s, under a JSON schema {constrained:.1f} tok/s, "
          f"ratio {constrained / free:.3f} ({totals['free'][0]} and {totals['schema'][0]} tokens)")
