"""Two stacks on one GGUF, end to end: `ds4-eval run` against ds4-server and against llama-cpp-python's
server (both on 127.0.0.1, greedy, the embedded model), then `ds4-eval compare` of the two traces.
Every case must be comparable without `--allow-diff` (one file served under two names is one
model), and the token counts must be brought to one rule: ds4-server states that it counts the
end-of-sequence token, llama.cpp's rule is measured (it does not)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from ds4eval import cli
from ds4eval.run import trace as tr

from real_servers import LLAMA_CPP, served

pytestmark = [pytest.mark.model, pytest.mark.slow,
              pytest.mark.skipif(LLAMA_CPP is None, reason="llama-cpp-python (extra 'llamacpp') missing")]

CASES = ("int-add-small", "int-add-tens", "text-capital-italy", "choice-sky-colour", "text-plural-cat")
# llama.cpp's sampler applies a repetition penalty of 1.1 unless told otherwise, even when greedy.
GREEDY_LLAMA = '{"repeat_penalty": 1.0}'


def run(url: str, trace, model_path: str, *extra: str):
    args = ["run", "--plain", "--backend", "openai", "--url", url, "--suite", "sanity", "-n", "96",
            "--model-file", model_path, "--tokenizer", model_path, "--trace", str(trace), *extra,
            *(a for c in CASES for a in ("--case-id", c))]
    return CliRunner().invoke(cli.main, args, env={"DS4EVAL_DATA": os.environ.get("DS4EVAL_DATA", "")})


def test_ds4_server_and_llama_cpp_on_one_gguf_compare_case_by_case(embedded_path, measures_counting, tmp_path):
    ds4, llama = tmp_path / "ds4.trace", tmp_path / "llama.trace"
    with served("ds4-server", embedded_path) as url:
        r = run(url, ds4, embedded_path)
        assert r.exit_code == 0, r.output
    with served("llama.cpp", embedded_path) as url:
        r = run(url, llama, embedded_path, "--request-extra", GREEDY_LLAMA)
        assert r.exit_code == 0, r.output
    base, new = tr.read_trace(ds4).records, tr.read_trace(llama).records
    assert {rec.model_sha256 for rec in base + new} == {base[0].model_sha256} and base[0].model_sha256
    assert {rec.prompt_sha256 for rec in base} == {rec.prompt_sha256 for rec in new}
    assert {rec.gen_tokens_eos for rec in base} == {"yes"} and {rec.gen_tokens_eos for rec in new} == {"no"}
    assert base[0].served_model != new[0].served_model  # one file, two names

    r = CliRunner().invoke(cli.main, ["compare", "--format", "json", str(ds4), str(llama)])
    assert r.exit_code in (0, 1), r.output
    result = json.loads(r.stdout)
    assert result["total"]["cases"] == len(CASES) and not [c for c in result["cases"] if c["excluded"]]
    assert result["token_counting"] == {"base_counts_eos": "yes", "new_counts_eos": "no", "aligned": True}
    # A reply that is the same text on both stacks and ended by itself is one token longer on
    # ds4-server, and the comparison counts it the same on both.
    same = 0
    for case in result["cases"]:
        b = next(rec for rec in base if rec.id == case["id"])
        n = next(rec for rec in new if rec.id == case["id"])
        if b.model_output == n.model_output and b.gen_tokens < 96:
            same += 1
            assert b.gen_tokens == n.gen_tokens + 1, case["id"]
            assert case["base_gen_tokens"] == case["new_gen_tokens"] == n.gen_tokens, case["id"]
    assert same >= 1
