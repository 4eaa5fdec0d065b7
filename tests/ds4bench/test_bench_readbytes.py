"""ds4bench.readbytes: the weight bytes a decoding step reads (routed experts by their expected
share) and the bandwidth bound; and `ds4-bench engine --bandwidth`'s lines."""
from __future__ import annotations

import pytest

from ds4bench import engine_bench as eb
from ds4bench import readbytes as rb

SIZES = {"token_embd.weight": 1000, "blk.0.attn_q.weight": 50, "blk.0.ffn_gate_inp.weight": 8,
         "blk.0.ffn_up_exps.weight": 800, "blk.0.ffn_down_exps.weight": 800, "blk.0.ffn_up_shexp.weight": 20,
         "output.weight": 1000}


def test_one_row_reads_its_experts_share_and_one_embedding_row():
    step = rb.step_bytes(SIZES, n_expert=8, n_expert_used=2, n_vocab=100)
    assert step.dense == 10 + 50 + 8 + 20 + 1000
    assert step.experts == pytest.approx(1600 * 2 / 8) and step.experts_total == 1600
    assert step.per_token == step.total


def test_rows_touch_the_expected_distinct_experts():
    assert rb.expected_experts(8, 2, 1) == 2
    assert rb.expected_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))  # 3.5: some overlap
    assert rb.expected_experts(128, 8, 64) == pytest.approx(128 * (1 - (120 / 128) ** 64))
    step = rb.step_bytes(SIZES, 8, 2, 100, rows=4)
    assert step.dense == 4 * 10 + 1078 and step.experts == pytest.approx(1600 * (1 - 0.75 ** 4))
    assert step.per_token < rb.step_bytes(SIZES, 8, 2, 100).per_token


def test_a_tied_head_reads_the_whole_table_and_dense_models_have_no_experts():
    tied = {k: v for k, v in SIZES.items() if k != "output.weight"}
    assert rb.step_bytes(tied, 8, 2, 100).dense == 1000 + 50 + 8 + 20
    dense = {"token_embd.weight": 100, "blk.0.ffn_up.weight": 30}
    step = rb.step_bytes(dense, 0, 0, 10)
    assert (step.total, step.experts_total) == (130, 0)
    assert "routed" not in rb.describe(step)


def test_bound_and_description():
    step = rb.StepBytes(rows=2, dense=1_000_000_000, experts=1_000_000_000.0, experts_total=8_000_000_000)
    assert rb.bound_tokens_per_s(step, 4000) == pytest.approx(2 * 4000 / 2)
    assert rb.describe(step) == "weights read per decoding step of 2 rows: 2 GB (routed experts 1 of 8 GB)"


def test_bandwidth_lines_give_each_engines_share():
    stats = {"ds4": eb.Stat(50, 40, 60, 3), "llama.cpp": eb.Stat(100, 90, 110, 3)}
    row = eb.SummaryRow("decode", 16, 128, "tok/s", stats, 0.5)
    batch = eb.SummaryRow("decode_batch", 128, 128, "tok/s", {"ds4": eb.Stat(400, 400, 400, 1)}, None, batch=32)
    load = eb.SummaryRow("load", 0, 0, "s", {"ds4": eb.Stat(1, 1, 1, 1)}, None)
    lines = eb.bandwidth_lines([load, row, batch], ["ds4", "llama.cpp"], lambda n: 200.0 * n, 4800)
    assert lines == ["decode 128 after 16: weight-read bound 200.0 tok/s at 4800 GB/s; ds4 25%, llama.cpp 50%",
                     "decode x32 after 128: weight-read bound 6400.0 tok/s at 4800 GB/s; ds4 6%"]
    with pytest.raises(eb.BenchConfigError, match="--bandwidth"):
        eb.EngineBenchConfig(bandwidth=0).validate()
