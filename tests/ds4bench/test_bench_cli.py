"""ds4-bench command line on a tiny random GGUF (no real weights): engine, random-gguf, errors;
and the ds4 runner's batched decoding."""
from __future__ import annotations

import csv
import sys

import pytest
from click.testing import CliRunner

from ds4bench import cli
from ds4bench import engine_bench as eb
from engine.synthetic import RandomModelSpec, write_random_gguf

TINY_ARGS = ["--prompt-lengths", "8,24", "--decode-contexts", "4,24", "--decode-tokens", "3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_random_gguf(tmp_path_factory.mktemp("bench") / "tiny.gguf", RandomModelSpec(seed=7))


def invoke(args):
    return CliRunner().invoke(cli.main, args)


def error_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("ds4-bench: error: ")
    assert result.exception is None or isinstance(result.exception, SystemExit)
    return lines[0]


def test_engine_on_tiny_model_writes_csv_and_table(tiny, tmp_path):
    out = tmp_path / "bench.csv"
    r = invoke(["engine", "--model", tiny, "--repeats", "2", "--csv", str(out), *TINY_ARGS])
    assert r.exit_code == 0, r.output
    assert "prefill 24" in r.output and "decode 3 after 4" in r.output
    assert "ds4 load" not in r.output  # the 3 s load bar is for the embedded model only
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    # per repetition: load, prefill 8, prefill 24, decode after 4, decode after 24
    assert len(rows) == 2 * 5
    assert {r["engine"] for r in rows} == {"ds4"}
    assert {r["model"] for r in rows} == {"tiny.gguf"}
    assert {int(r["ctx"]) for r in rows} == {27}
    assert sorted((r["metric"], r["n_prompt"]) for r in rows if r["repeat"] == "0") == [
        ("decode", "24"), ("decode", "4"), ("load", "0"), ("prefill", "24"), ("prefill", "8")]
    for row in rows:
        assert float(row["seconds"]) > 0
        if row["metric"] != "load":
            assert float(row["tokens_per_s"]) > 0


def test_engine_measures_batches(tiny, tmp_path):
    out = tmp_path / "bench.csv"
    r = invoke(["engine", "-m", tiny, "--repeats", "1", "--warmup", "0", "--csv", str(out), *TINY_ARGS,
                "--batch-sizes", "1,3", "--batch-context", "30"])
    assert r.exit_code == 0, r.output
    assert "decode 3 x1 after 30, decode 3 x3 after 30" in r.output  # the plan line
    assert any(line.startswith("decode x3 after 30") for line in r.output.splitlines())  # the table
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 + 2
    batched = [row for row in rows if row["metric"] == "decode_batch"]
    assert [(row["batch"], row["n_prompt"], row["n_decode"]) for row in batched] == [("1", "30", "3"), ("3", "30", "3")]
    assert {int(row["ctx"]) for row in rows} == {33}  # the batch context + decode tokens is the longest step
    for row in batched:
        tps = float(row["tokens_per_s"])
        assert tps == pytest.approx(int(row["batch"]) * 3 / float(row["seconds"]), rel=1e-3)
    assert {row["batch"] for row in rows if row["metric"] != "decode_batch"} == {"1"}


@pytest.mark.parametrize("length", [1, 9])
def test_ds4_batched_greedy_tokens_equal_each_row_decoded_alone(untied, length):
    from ds4bench.runners import Ds4Runner

    runner = Ds4Runner(untied, ctx=32)
    runner.load()
    try:
        vocab = runner.vocab()
        rows = eb.batch_rows(vocab, 3, length, seed=0)
        runner.prefill_batch(rows)
        batched = runner.decode_batch(12, vocab.eos_ids)
        alone = []
        for ids in rows:
            runner.prefill(ids)
            alone.append(runner.decode(12, vocab.eos_ids))
        assert batched == alone  # on the CPU each row's logits are bitwise those of decoding it alone
        assert len({t for row in batched for t in row}) > 6  # the rows really decode different tokens
        banned = frozenset(batched[0][:4]) | vocab.eos_ids
        runner.prefill_batch(rows)
        masked = runner.decode_batch(12, banned)
        assert all(len(row) == 12 and not banned & set(row) for row in masked)
    finally:
        runner.close()


def test_engine_with_a_model_runs_where_the_embedded_model_is_not_installed(tiny, monkeypatch):
    import engine

    def not_installed():
        raise engine.ModelLoadError("the embedded model is not installed")

    monkeypatch.setattr(engine, "default_model_path", not_installed)
    r = invoke(["engine", "--model", tiny, "--repeats", "1", "--warmup", "0", *TINY_ARGS])
    assert r.exit_code == 0, r.output
    assert "decode 3 after 24" in r.output and "ds4 load" not in r.output


def test_compare_without_llama_cpp_is_a_one_line_error(tiny, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    out = tmp_path / "never.csv"
    r = invoke(["engine", "--model", tiny, "--compare", "llama.cpp", "--csv", str(out), *TINY_ARGS])
    assert r.exit_code == 2
    line = error_line(r)
    assert "llama-cpp-python is not installed" in line and "pip install 'ds4eval[llamacpp]'" in line
    assert not out.exists()


@pytest.mark.parametrize("args, words", [
    (["--repeats", "0"], "--repeats"),
    (["--ctx", "10"], "too small"),
    (["--prompt-lengths", "8,x"], "comma-separated"),
    (["--device", "tpu"], "tpu"),
    (["--compare", "vllm"], "vllm"),
    (["--csv", "/nonexistent-dir/x.csv"], "directory does not exist"),
    (["--batch-sizes", "0,2"], "--batch-sizes must be positive"),
    (["--batch-sizes", "4", "--compare", "llama.cpp"], "llama-cpp-python decodes one sequence"),
])
def test_bad_flags_are_one_line_errors(tiny, args, words):
    r = invoke(["engine", "--model", tiny, *TINY_ARGS, *args])
    assert r.exit_code == 2
    assert words in error_line(r)


def test_missing_model_is_a_one_line_error(tmp_path):
    r = invoke(["engine", "--model", str(tmp_path / "nope.gguf"), *TINY_ARGS])
    assert r.exit_code == 2
    assert "model file not found" in error_line(r)


@pytest.mark.parametrize("flag", ["-m", "--model"])
def test_model_flag_has_a_short_form(tmp_path, flag):
    # -m selects the model as it does in ds4, ds4-server and ds4-eval.
    r = invoke(["engine", flag, str(tmp_path / "nope.gguf"), *TINY_ARGS])
    assert r.exit_code == 2
    assert "model file not found" in error_line(r)


def test_every_subcommand_with_a_model_option_takes_m():
    with_model = {}
    for name, command in cli.main.commands.items():
        for param in command.params:
            if "--model" in getattr(param, "opts", ()):
                with_model[name] = param.opts
    assert {"engine", "sessions", "kvcache", "product"} <= set(with_model)
    assert all("-m" in opts for opts in with_model.values()), with_model


def test_truncated_model_is_a_one_line_error_in_file_terms(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(tiny, "rb").read()[:-64])
    r = invoke(["engine", "-m", str(cut), *TINY_ARGS])
    assert r.exit_code != 0
    last = r.output.strip().splitlines()[-1]  # after the plan line
    assert last.startswith("ds4-bench: error: ") and last.endswith("truncated download?")


def test_random_gguf_imitates_shapes_and_tokenizer(tiny, tmp_path):
    from engine import load_model

    out = tmp_path / "like.gguf"
    r = invoke(["random-gguf", str(out), "--like", tiny, "--qtype", "Q8_0", "--seed", "3"])
    assert r.exit_code == 0, r.output
    a, b = load_model(tiny), load_model(str(out))
    assert a.config == b.config
    assert a.tokenize("the cat") == b.tokenize("the cat")
    assert a.quant == "Q4_1" and b.quant == "Q8_0"
    assert b.metadata["general.file_type"] == 7  # MOSTLY_Q8_0
    sa, sb = a.new_session(), b.new_session()
    sa.sync([5, 6, 7])
    sb.sync([5, 6, 7])
    assert not (sa.logits == sb.logits).all()  # fresh random weights, not a copy


def test_random_gguf_keeps_the_dominant_type_by_default(tiny, tmp_path):
    from ds4bench.random_gguf import spec_like

    spec = spec_like(tiny, seed=1)
    assert (spec.qtype, spec.embed_qtype, spec.tied_output) == ("Q4_1", "Q8_0", True)
    assert spec.tokenizer_from == tiny and spec.seed == 1


def test_random_gguf_errors(tiny, tmp_path):
    r = invoke(["random-gguf", str(tmp_path / "x.gguf"), "--like", str(tmp_path / "missing.gguf")])
    assert r.exit_code == 2 and "not found" in error_line(r)
    r = invoke(["random-gguf", str(tmp_path / "x.gguf"), "--like", tiny, "--qtype", "Q4_K"])
    assert r.exit_code == 2 and "block size" in error_line(r)  # 64 columns cannot hold 256-wide blocks
    assert not (tmp_path / "x.gguf").exists()


def test_every_engine_flag_maps_to_a_config_field():
    fields = set(eb.EngineBenchConfig.__dataclass_fields__)
    params = {p.name for p in cli.main.commands["engine"].params}
    assert params - {"csv_path"} | {"csv"} == fields
