"""Benchmark (pytest-benchmark) of the server's work per generated token; measured, not asserted
beyond the text coming out whole. `make bench` runs it.

`test_accept_per_token`: `TokenDecoder.accept` for each token of a 168-token reply, as a chat
completion request of the OpenAI API builds its job: the model's output splitter, the stop
matcher, the `/metrics` observer and the coalescing event sink the server wraps every job's sink
in, and the reply's `finish` once. This is the host work a batched server does per row of each
step, beside the engine's own, so at 16 rows it is 16 times this a step. A random GGUF with the
embedded tokenizer stands in for the model (`vocab_model`, conftest.py: no weights are loaded);
the text is tokenized, not generated.
"""
from __future__ import annotations

from server.api_openai import ChatCompletionRequest, chat_job
from server.jobs import CoalescingSink, Job, TextDelta, TokenDecoder
from server.metrics import ServerMetrics
from server.prompting import ToolCalling
from server.tools import ToolsConfig

REPLY = ("The water cycle moves water between the oceans, the air and the land. Sunlight warms the "
         "surface of seas and lakes, and some of that water evaporates into vapour. As the moist air "
         "rises it cools, and the vapour condenses into tiny droplets that gather as clouds. When the "
         "droplets grow heavy enough they fall as rain, snow or hail. Some of it soaks into the ground "
         "and refills aquifers; the rest runs off into streams and rivers that carry it back to the "
         "sea. Plants return water to the air through their leaves, a process called transpiration. "
         "Over a year the cycle moves about five hundred thousand cubic kilometres of water, and it "
         "shapes the weather, the climate and the landscapes we live in. Ice caps and glaciers hold "
         "a large share of the fresh water for centuries before it melts and joins the flow again.")


def test_accept_per_token(benchmark, vocab_model):
    model = vocab_model
    tokens = model.tokenize(REPLY, special=False)
    calling = ToolCalling.for_model(model, ToolsConfig())
    body = ChatCompletionRequest.model_validate({
        "model": "default", "messages": [{"role": "user", "content": "How does the water cycle work?"}],
        "max_tokens": 1024, "temperature": 0, "stream": True})
    gens, _ctx = chat_job(model, body, calling)
    metrics = ServerMetrics(model.name, 16)
    received: list[str] = []

    def sink(event) -> None:
        if isinstance(event, TextDelta):
            received.append(event.text)

    def decoder() -> tuple[tuple[TokenDecoder], dict]:
        received.clear()
        job = Job(1, gens[0], CoalescingSink(sink, 0.025), observer=metrics)
        return (TokenDecoder(model, job),), {}

    def reply(dec: TokenDecoder) -> None:
        for t in tokens:
            dec.accept(t)
        dec.finish("length")  # passes on what the sink holds; once a reply, as in the server

    benchmark.pedantic(reply, setup=decoder, rounds=200 if benchmark.enabled else 1, iterations=1)
    assert "".join(received).strip() == REPLY
    if benchmark.stats is None:  # --benchmark-disable: run once, nothing measured
        return
    per_token_us = benchmark.stats.stats.median / len(tokens) * 1e6
    benchmark.extra_info.update(tokens=len(tokens), us_per_token=round(per_token_us, 2))
    print(f"\naccept: {per_token_us:.2f} us per token over {len(tokens)} tokens")
