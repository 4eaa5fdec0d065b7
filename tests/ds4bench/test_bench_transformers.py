"""`ds4-bench engine --compare transformers`: the transformers runner on tiny random GGUFs.

The CPU tests run it eagerly (compiling takes about a minute on a 2-core machine); the
compiled step, the way it is meant to be measured, is checked on a GPU."""
from __future__ import annotations

import csv
import sys

import pytest
from click.testing import CliRunner

from ds4bench import cli
from ds4bench import engine_bench as eb
from ds4bench.runners import TransformersRunner, TransformersUnavailable
from engine.synthetic import RandomModelSpec, write_random_gguf

pytest.importorskip("transformers")
pytestmark = pytest.mark.reference

TINY_ARGS = ["--prompt-lengths", "8,24", "--decode-contexts", "4,24", "--decode-tokens", "3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_random_gguf(tmp_path_factory.mktemp("hf") / "tiny.gguf", RandomModelSpec(seed=7))


@pytest.mark.parametrize("spec", [
    RandomModelSpec(seed=1),
    RandomModelSpec(arch="qwen2", n_layer=3, n_embd=96, n_head=6, n_head_kv=3, tied_output=False, seed=2,
                    rope_base=500000.0),
])
def test_the_model_has_the_shape_of_the_gguf(tmp_path, spec):
    runner = TransformersRunner(write_random_gguf(tmp_path / "m.gguf", spec), ctx=64, compile=False)
    runner.load()
    try:
        model = runner.model
        cfg = model.config
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (spec.n_layer, spec.n_embd, spec.n_ff)
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (spec.n_head, spec.n_head_kv)
        assert cfg.vocab_size == runner.shape.n_vocab and cfg.tie_word_embeddings == spec.tied_output
        assert cfg.rope_parameters["rope_theta"] == spec.rope_base
        assert type(model).__name__.lower().startswith(spec.arch)
        assert next(model.parameters()).dtype.is_floating_point and str(next(model.parameters()).dtype) == "torch.bfloat16"
        assert model.lm_head.weight.shape == (runner.shape.n_vocab, spec.n_embd)
    finally:
        runner.close()


def test_decoding_is_greedy_repeatable_and_masks_the_banned_ids(tiny):
    runner = TransformersRunner(tiny, ctx=64, compile=False)
    runner.load()
    try:
        prompt = list(range(3, 30))
        runner.prefill(prompt)
        first = runner.decode(12, frozenset())
        assert len(first) == 12
        runner.prefill(prompt)
        assert runner.decode(12, frozenset()) == first
        banned = frozenset(first)
        runner.prefill(prompt)
        masked = runner.decode(12, banned)
        assert len(masked) == 12 and not banned & set(masked)
        # Decoding continues from where the last decode stopped: 6 + 6 tokens are the 12.
        runner.prefill(prompt)
        assert runner.decode(6, frozenset()) + runner.decode(6, frozenset()) == first
    finally:
        runner.close()


@pytest.mark.parametrize("length", [1, 9])
def test_batched_decoding_equals_each_row_alone_and_masks_the_banned_ids(untied, length):
    runner = TransformersRunner(untied, ctx=32, compile=False)
    runner.load()
    try:
        rows = eb.batch_rows(runner.vocab(), 3, length, seed=0)
        runner.prefill_batch(rows)
        batched = runner.decode_batch(12, frozenset())
        alone = []
        for ids in rows:
            runner.prefill(ids)
            alone.append(runner.decode(12, frozenset()))
        assert batched == alone
        assert len({t for row in batched for t in row}) > 6  # the rows really decode different tokens
        banned = frozenset(t for row in batched for t in row[:3])
        runner.prefill_batch(rows)
        masked = runner.decode_batch(12, banned)
        assert all(len(row) == 12 and not banned & set(row) for row in masked)
        # A batch of a new size gets a cache of its own; decoding continues from where it stopped.
        runner.prefill_batch(rows[:2])
        assert runner.decode_batch(6, frozenset()) == [row[:6] for row in batched[:2]]
        assert runner.decode_batch(6, frozenset()) == [row[6:] for row in batched[:2]]
    finally:
        runner.close()


def test_the_command_prints_ratios_against_transformers_without_a_bar(tiny, tmp_path):
    out = tmp_path / "m.csv"
    r = CliRunner().invoke(cli.main, ["engine", "--model", tiny, "--compare", "transformers", "--transformers-eager",
                                      "--repeats", "1", "--warmup", "0", "--csv", str(out), *TINY_ARGS,
                                      "--batch-sizes", "1,3", "--batch-context", "6"])
    assert r.exit_code == 0, r.output
    assert "ds4/transformers" in r.output
    x3 = next(line for line in r.output.splitlines() if line.startswith("decode x3 after 6"))
    assert x3.endswith("x")  # the ratio column
    # No llama.cpp bar against transformers, and no 3 s load bar for a model other than the embedded one.
    assert "PASS" not in r.output and "FAIL" not in r.output
    rows = list(csv.DictReader(open(out)))
    assert {row["engine"] for row in rows} == {"ds4", "transformers"}
    hf = [row for row in rows if row["engine"] == "transformers"]
    assert {row["weights"] for row in hf} == {"bf16-random"}
    assert sorted((row["metric"], row["n_prompt"], row["batch"]) for row in hf) == [
        ("decode", "24", "1"), ("decode", "4", "1"), ("decode_batch", "6", "1"), ("decode_batch", "6", "3"),
        ("load", "0", "1"), ("prefill", "24", "1"), ("prefill", "8", "1")]


def test_without_transformers_the_command_says_how_to_install_it(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(TransformersUnavailable, match=r"pip install 'ds4eval\[reference\]'"):
        TransformersRunner(tiny, ctx=64)
    r = CliRunner().invoke(cli.main, ["engine", "--model", tiny, "--compare", "transformers", *TINY_ARGS])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4-bench: error: transformers is not installed")


@pytest.mark.gpu
def test_the_compiled_cuda_step_matches_eager_decoding(tiny):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    outputs = []
    for compile in (False, True):
        runner = TransformersRunner(tiny, ctx=64, device="cuda", compile=compile)
        runner.load()
        try:
            runner.prefill(list(range(3, 30)))
            decoded = [runner.decode(16, frozenset())]
            for n in (3, 1, 3):  # a new batch size compiles, a repeated one reuses its graph
                runner.prefill_batch([list(range(3 + i, 30 + i)) for i in range(n)])
                decoded.append(runner.decode_batch(16, frozenset()))
            outputs.append(decoded)
        finally:
            runner.close()
    assert outputs[0] == outputs[1]
