"""Benchmark (pytest-benchmark, `make bench`): `ds4-eval merge` of 100 shard traces holding
100,000 cases, the command itself from reading the files to writing the merged trace. The target
is under 10 s; it is measured, not asserted. Writing the 100,000 cases alone takes about 20 s,
so the test runs only under `make bench` (DS4_BENCH=1)."""

import os

import pytest
from click.testing import CliRunner

from ds4eval import cli
from ds4eval.run import shards
from ds4eval.run import trace as tr

N_CASES = 100_000
N_SHARDS = 100


def _shard_traces(directory):
    """Blocks with full provenance, a 300-character prompt and a 10-line output per case."""
    ids = [("big", f"case-{i}") for i in range(N_CASES)]
    digest = shards.selection_digest(((s, i, f"sha256:{n:064x}") for n, (s, i) in enumerate(ids)), 1)
    owned: dict[int, list[tuple[int, str, str]]] = {k: [] for k in range(N_SHARDS)}
    for n, (s, i) in enumerate(ids, 1):
        owned[shards.assign(s, i, N_SHARDS)].append((n, s, i))
    for k, cases in owned.items():
        header = tr.RunHeader("big", tuple(cases), 1, shard=f"{k}/{N_SHARDS}", selection=digest, selected=N_CASES,
                              filters="{}")
        blocks = [tr.format_run_header(header)]
        for n, s, i in cases:
            blocks.append(tr.format_record(tr.TraceRecord(
                index=n, source=s, id=i, status="PASSED" if n % 3 else "FAILED", picked="4", expected="4",
                answer_kind="integer", suite="big", model="Toy 1B", backend="engine", prompt_tokens=90,
                gen_tokens=60, elapsed_s=1.5, case_hash=f"sha256:{n - 1:064x}", max_tokens=512,
                model_sha256="ab" * 32, chat_template_sha256="cd" * 32, device="cpu", kv_type="float16",
                system_prompt="You are a careful problem solver.", question_prompt="What is it? " * 25,
                model_output="Let me think.\n" * 9 + "Answer: 4")))
        (directory / f"shard-{k:03d}.trace").write_text("".join(blocks), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    return _shard_traces(tmp_path_factory.mktemp("shards"))


@pytest.mark.skipif(not os.environ.get("DS4_BENCH"), reason="100,000 cases: DS4_BENCH=1 (make bench)")
def test_merge_100_shards_of_100k_cases(benchmark, shard_set, tmp_path):
    out = tmp_path / "run.trace"

    def merge():
        return CliRunner().invoke(cli.main, ["merge", str(shard_set), "-o", str(out)])

    result = benchmark.pedantic(merge, rounds=3, iterations=1)
    assert result.exit_code == 0, result.output
    assert f"merged {N_SHARDS} shard(s), {N_SHARDS} file(s): {N_CASES} cases" in result.output
