"""Benchmark (pytest-benchmark): `ds4-eval --compare` of two traces of 10,000 cases each, the
command itself from reading the files to the printed report. The target is under 2 s; it is
measured, not asserted."""

import dataclasses

import numpy as np
import pytest

from click.testing import CliRunner

from ds4eval import cli
from ds4eval.run import trace as tr
from ds4eval.run.provenance import RenderedPrompt
from ds4eval.verdict import compare as cmp

N_CASES = 10_000


def _trace_pair(directory):
    """Realistic blocks: full provenance, a 110-token prompt, a 30-line output; 5 sources, about
    one case in ten flipped either way, some answers lost, generated lengths moved."""
    rng = np.random.default_rng(0)
    pieces = ["<|im_start|>", "system", "\n"] + [f" word{i}" for i in range(104)] + ["<|im_end|>", "\n", "assistant"]
    prompt = RenderedPrompt.of(list(range(len(pieces))), pieces)
    output = "Let me think.\n" * 29 + "Answer: 4"
    base, new = [], []
    for i in range(1, N_CASES + 1):
        passed = bool(rng.random() < 0.45)
        flipped = bool(rng.random() < 0.1)
        b = tr.TraceRecord(
            index=i, source=f"source-{i % 5}", id=f"case-{i}", status="PASSED" if passed else "FAILED",
            picked="4" if passed else "5", expected="4", answer_kind="integer", suite="big", model="Toy 1B",
            backend="engine", prompt_tokens=len(pieces), gen_tokens=int(rng.integers(20, 400)), elapsed_s=2.5,
            case_hash=f"sha256:{i:064x}", max_tokens=512, prompt_sha256=f"{i:064x}", model_sha256="ab" * 32,
            chat_template_sha256="cd" * 32, bos_eos="add_bos=no bos=1 eos=2", device="cpu", kv_type="float16",
            extractor_version="e1", ds4eval_version="0.1.0", git_commit="f" * 40,
            rendered_prompt=prompt.text, rendered_token_ends=prompt.ends_field,
            system_prompt="You are a careful problem solver.", question_prompt="What is it? " * 25,
            model_output=output)
        n = dataclasses.replace(b, gen_tokens=b.gen_tokens + int(rng.integers(-40, 40)), elapsed_s=2.4)
        if flipped:
            n = dataclasses.replace(n, status="FAILED" if passed else "PASSED", picked=None if passed else "4")
        base.append(b)
        new.append(n)
    paths = []
    for name, recs in (("base", base), ("new", new)):
        path = directory / f"{name}.trace"
        path.write_text("".join(map(tr.format_record, recs)), encoding="utf-8", newline="")
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def big_traces(tmp_path_factory):
    return _trace_pair(tmp_path_factory.mktemp("big"))


def _compare_command(base_path, new_path):
    return CliRunner().invoke(cli.main, ["--compare", str(base_path), str(new_path)])


def test_compare_two_traces_of_ten_thousand_cases(benchmark, big_traces):
    r = benchmark.pedantic(_compare_command, args=tuple(big_traces), rounds=3, iterations=1)
    assert r.exit_code in (0, 1) and "Verdict" in r.output and "source-4" in r.output
    # The same comparison as data: every case paired, the flips found, the resamples drawn.
    result = cmp.compare(*(cmp.read_run(p.read_text(encoding="utf-8"), str(p)) for p in big_traces))
    assert result.total.cases == N_CASES and len(result.sources) == 5
    assert result.total.test.discordant == len(result.flips) > 500
    assert result.total.interval.resamples >= 10_000
