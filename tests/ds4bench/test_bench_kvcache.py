"""ds4-bench kvcache: the prompt sizing and stream parsing alone, then a real run of ds4-server
subprocesses on a tiny random GGUF (no real weights)."""
from __future__ import annotations

import csv
import os

import pytest
from click.testing import CliRunner

from ds4bench import cli
from ds4bench import kvcache as kb
from engine.synthetic import RandomModelSpec, write_random_gguf


def test_size_prompt_lands_in_the_window():
    calls = []

    def count(system: str) -> int:  # about 1.7 tokens per word plus a template overhead
        calls.append(system)
        return 40 + int(len(system.split()) * 1.7)

    system, n = kb.size_prompt(count, 1000, seed=3)
    assert 1000 <= n <= 1050 and count(system) == n
    assert len(calls) < 12
    assert kb.system_text(50, 3) == kb.system_text(50, 3) != kb.system_text(50, 4)


def test_size_prompt_gives_up_with_a_message():
    with pytest.raises(kb.KVCacheBenchError):
        kb.size_prompt(lambda s: 10, 1000, seed=0)


def test_stream_parsing_stops_at_done_and_finds_output():
    lines = [": prefill", "", 'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}',
             'data: {"choices": [{"delta": {"content": "Hi"}, "finish_reason": null}]}',
             "data: [DONE]", 'data: {"late": 1}']
    chunks = kb.parse_sse_lines(lines)
    assert len(chunks) == 2
    assert not kb._is_output(chunks[0]) and kb._is_output(chunks[1])
    assert kb._is_output({"choices": [{"delta": {}, "finish_reason": "stop"}]})


def test_bad_settings_are_one_line_errors(tmp_path):
    (tmp_path / "x.kv").write_bytes(b"")
    for args in (["--prompt-tokens", "10"], ["--dir", str(tmp_path)], ["--model", str(tmp_path / "none.gguf")]):
        result = CliRunner().invoke(cli.main, ["kvcache", *args])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ds4-bench: error: ")


def test_restart_restores_the_prompt_through_the_server(tmp_path):
    model = write_random_gguf(tmp_path / "tiny.gguf", RandomModelSpec(n_ctx=4096, seed=5))
    out = tmp_path / "kv.csv"
    # The server's own policy checkpoints prompts of 2048 tokens and more.
    result = CliRunner().invoke(cli.main, ["kvcache", "--model", model, "--prompt-tokens", "2150",
                                           "--dir", str(tmp_path / "cache"), "--csv", str(out)])
    assert result.exit_code == 0, result.output
    assert "restored: time to first token" in result.output
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == list(kb.CSV_COLUMNS) and len(rows) == 1
    row = rows[0]
    assert 2150 <= int(row["n_prompt"]) <= 2300
    assert 2048 <= int(row["n_cached"]) < int(row["n_prompt"])
    assert int(row["n_written"]) >= 2048 and int(row["file_bytes"]) > 0
    assert float(row["cold_ttft_s"]) > 0 and float(row["restored_ttft_s"]) > 0
    assert row["same_output"] == "1"
    assert any(n.endswith(".kv") for n in os.listdir(tmp_path / "cache"))
