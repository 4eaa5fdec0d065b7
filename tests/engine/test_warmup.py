"""engine.warmup: which prompts and batches a warm-up runs (pure), that it runs nothing where no
step is captured (CPU), and on CUDA (skipped without a GPU) that it leaves nothing for later
requests to capture and changes no result."""
from __future__ import annotations

import pytest
import torch

import engine
from engine import SamplingParams, cuda_graphs, generate
from engine.batch import BatchScheduler, GenRequest
from engine.warmup import Plan, WarmUp, plan

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def test_the_plan_meets_every_prefill_bucket_both_eager_prefills_and_the_batches_up_to_the_rows():
    p = plan(12, 4096, BUCKETS, graph_tokens=256, chunk=2048)
    # A prompt's last token is a decoding step: its prefill is one token shorter.
    assert p.prompts == (2, 3, 5, 9, 17, 33, 65, 258, 2049)
    fine = plan(12, 4096, (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), 256, 2048).prompts
    assert fine == (2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 258, 2049)
    assert p.batches == (1, 2, 4, 8, 16)  # 12 rows replay the 16-row graph
    assert plan(1, 4096, BUCKETS, 256, 2048).batches == (1,)
    assert plan(16, 4096, BUCKETS, 256, 2048).batches == (1, 2, 4, 8, 16)
    assert plan(500, 4096, BUCKETS, 256, 2048).batches == BUCKETS  # more rows than graphs: the eager step after
    assert plan(6, 4096, (1, 2, 3, 4, 6, 8), 256, 2048).batches == (1, 2, 3, 4, 6)


def test_prompts_fit_the_context_and_prefill_pieces_their_bucket():
    p = plan(1, 100, BUCKETS, graph_tokens=256, chunk=2048)
    assert p.prompts == (2, 3, 5, 9, 17, 33, 65, 99)  # the eager lengths cut to the context, one position free
    assert plan(1, 2, BUCKETS, 256, 2048).prompts == (1,)
    assert plan(1, 1, BUCKETS, 256, 2048).prompts == ()  # one position leaves no room for a prompt
    assert plan(1, 4096, BUCKETS, graph_tokens=16, chunk=512).prompts == (2, 3, 5, 9, 17, 18, 513)


def test_a_plan_needs_a_row():
    with pytest.raises(ValueError, match="at least one row"):
        plan(0, 4096, BUCKETS, 256, 2048)


def test_the_report_line_names_what_ran_or_why_nothing_did():
    ran = WarmUp(1.234, Plan((1, 2, 257), (1, 2, 4)), graphs=9)
    assert ran.describe() == ("warm-up: 9 CUDA graphs captured in 1.23 s (decoding steps of 1-4 rows, "
                              "prompts of 1-257 tokens)")
    assert WarmUp(0.0, skipped="no captured steps on cpu").describe() == "warm-up: none (no captured steps on cpu)"
    failed = WarmUp(2.0, Plan((1,), (1,)), graphs=0, skipped="CUDA graphs are off: OutOfMemoryError: x")
    assert failed.describe() == ("warm-up: 0 CUDA graphs captured in 2.00 s (decoding steps of 1-1 rows, prompts "
                                 "of 1-1 tokens); then CUDA graphs are off: OutOfMemoryError: x: steps run eagerly")


def test_on_cpu_nothing_runs(tiny_gguf):
    model = engine.load_model(tiny_gguf("llama", "Q4_1"), device="cpu")
    done = model.warm_up(8)
    assert done.plan is None and done.graphs == 0 and done.skipped == "no captured steps on cpu"


gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_after_a_warm_up_requests_capture_nothing_and_decode_as_without_it(tiny_gguf, device, arch):
    """A warmed-up model's prompts (graph and eager prefills) and batched steps of up to its rows
    capture no graph, and give the greedy tokens of a model that was not warmed up."""
    path = tiny_gguf(arch, "Q4_1", n_ctx=512)
    warm, cold = (engine.load_model(path, device=device) for _ in range(2))
    done = warm.warm_up(4)
    graphs = warm.net.decode_graphs
    assert done.plan is not None and done.skipped is None and done.graphs == graphs.graph_count > 0
    count, seconds = graphs.graph_count, graphs.capture_seconds
    assert graphs.captured_buckets == set(cuda_graphs.BUCKETS)  # the prefill pieces'; decoding's are 1-4

    params = SamplingParams(argmax_ignoring_eos=True)

    def greedy(model, n: int) -> list[int]:
        s = model.new_session()
        s.sync([3 + i % 200 for i in range(n)])  # ids within the tiny vocabulary
        return list(generate(s, params, 6))

    def run(model) -> list[list[int]]:
        out = [greedy(model, n) for n in (5, 40, 300)]  # graph prefills and an eager one
        sched = BatchScheduler(model, 3)
        reqs = [GenRequest(list(range(7 + i, 20 + 3 * i)), params, 8) for i in range(3)]
        for r in reqs:
            sched.submit(r)
        while sched.busy:  # batched steps of up to 3 rows
            sched.step()
        return [*out, *(r.output for r in reqs)]

    assert run(warm) == run(cold)
    assert graphs.graph_count == count and graphs.capture_seconds == seconds
