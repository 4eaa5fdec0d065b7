"""ds4-eval on the real embedded model (needs the weights: marked `model`)."""

import pytest

from ds4eval.cases.suites import load_suite
from ds4eval.config import EvalConfig
from ds4eval.run.runner import Runner, Status
from ds4eval.run.trace import TraceRecord


@pytest.mark.model
def test_three_sanity_cases_on_the_embedded_model(tmp_path):
    import engine

    from ds4eval.run.backends.engine_backend import EngineBackend

    model = engine.load_model()
    backend = EngineBackend(model, engine)
    assert not backend.supports_thinking  # SmolLM2 has no thinking tokens
    picked = {c.id: c for c in load_suite("sanity", tmp_path)}
    selected = [picked["choice-capital-france"], picked["int-add-small"], picked["text-sky-colour"]]
    cfg = EvalConfig(tokens=96, trace=str(tmp_path / "t.trace"))
    runner = Runner(cfg, selected, backend)
    states = runner.run()
    for st in states:
        assert st.status in (Status.PASSED, Status.FAILED), st.error
        assert 0 < st.gen_tokens <= 96 and st.prompt_tokens > 0 and st.output
        assert st.prompt_tokens + st.gen_tokens <= model.n_ctx
        lat = st.latency  # prefill, then one decode step per token
        assert lat.ttft_s > 0 and lat.e2e_s >= lat.ttft_s and lat.itl_per == "token"
        if st.gen_tokens > 1:
            assert 0 < lat.itl_s <= lat.itl_max_s
    from ds4eval.run.trace import read_trace

    records = read_trace(tmp_path / "t.trace").records
    assert len(records) == 3 and all(isinstance(r, TraceRecord) and r.model_output for r in records)
    assert all(r.ttft_s and r.e2e_s and r.concurrency == 1 for r in records)
    # Greedy decoding is deterministic: a second run of the same case gives the same output.
    again = Runner(cfg, selected[:1], backend).run()[0]
    assert again.output == states[0].output


@pytest.mark.model
def test_shards_merge_into_the_run_one_process_makes(tmp_path):
    """Three shards of eight sanity cases, each written as `run --shard I/3` writes it, merge into
    the trace of the whole run: same cases, numbers, greedy outputs and verdicts."""
    import engine

    from ds4eval.run import merge, shards
    from ds4eval.run.backends.engine_backend import EngineBackend
    from ds4eval.run.trace import read_trace

    backend = EngineBackend(engine.load_model(), engine)
    selected = load_suite("sanity", tmp_path)[:8]
    whole = EvalConfig(tokens=24, trace=str(tmp_path / "whole.trace"))
    Runner(whole, selected, backend).run()
    traces = []
    for i in range(3):
        part = shards.part(selected, shards.Shard(i, 3), 1, shards.filters_json((), (), ()))
        cfg = EvalConfig(tokens=24, trace=str(tmp_path / f"s{i}.trace"))
        Runner(cfg, part.cases, backend, numbers=part.numbers, shard_header=part.header_fields()).run()
        traces.append(merge.ShardTrace(cfg.trace, read_trace(cfg.trace)))
    merged = merge.merge(traces)
    expected = read_trace(whole.trace)
    assert merged.unfinished == [] and merged.header == expected.runs[0]

    def key(r):
        return r.index, r.source, r.id, r.status, r.picked, r.model_output, r.gen_tokens

    assert [key(r) for r in merged.records] == [key(r) for r in expected.records]
