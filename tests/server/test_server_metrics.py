"""`GET /metrics`: the Prometheus view of one app, scraped and parsed with prometheus_client's
own parser. The scripted fake engine gives exact counts (requests by endpoint and status,
tokens, histogram observations, a cancel, an error); tiny random GGUF models cover the batched
loop's occupancy and the disk KV cache counters."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.config import ServerConfig
from server.jobs import GenerationRequest, JobStats, SamplingSpec, ServingLoad
from server.kvstore import KVStoreConfig
from server.kvstore_policy import SavePolicy
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.prompting import prompt_ids
from server.worker import InferenceWorker
from server_fake_engine import DEFAULT_REPLY, FakeModel
from server_support import TEST_CLIENT_HOST, fake_app, live_server, raw_request

CHAT = "/v1/chat/completions"
SLOW_WORD = "slowly"


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition, keyed by (sample name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels: str) -> float:
    labels.setdefault("model_name", "fake-model")
    return found[(name, frozenset(labels.items()))]


def http(found: dict, handler: str, method: str, status: int) -> float:
    return found.get(("http_requests_total", frozenset({"handler": handler, "method": method,
                                                        "status": str(status)}.items())), 0.0)


def scrape(base_or_client) -> dict:
    get = base_or_client.get if hasattr(base_or_client, "get") else None
    r = get("/metrics") if get else httpx.get(base_or_client + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE
    return samples(r.text)


def wait_until(check, limit_s: float = 10.0):
    deadline = time.monotonic() + limit_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


# --- the observer alone, on hand-made timings -----------------------------------------------------

def test_the_observer_turns_a_jobs_times_into_histogram_observations():
    m = ServerMetrics("m")
    stats = JobStats(job_id=1, n_prompt=10, n_cached=4, queued_at=100.0)
    stats.started_at = 101.0
    m.job_started(stats)
    for now in (103.0, 103.5, 104.5):  # as TokenDecoder.accept reports them
        stats.n_generated += 1
        m.token(stats, now)
        stats.last_token_at = now
        stats.first_token_at = stats.first_token_at or now
    stats.status, stats.finish_reason, stats.finished_at = "done", "length", 105.0
    m.job_finished(stats)
    found = samples(m.render(ServingLoad(0, 0, 13, 64, 1), None).decode())
    v = lambda name, **kw: value(found, name, model_name="m", **kw)  # noqa: E731
    assert v("vllm:time_to_first_token_seconds_sum") == 3.0 and v("vllm:time_to_first_token_seconds_count") == 1
    assert v("vllm:inter_token_latency_seconds_sum") == 1.5 and v("vllm:inter_token_latency_seconds_count") == 2
    assert v("vllm:e2e_request_latency_seconds_sum") == 5.0
    assert v("vllm:request_queue_time_seconds_sum") == 1.0
    assert v("vllm:request_prefill_time_seconds_sum") == 2.0
    assert v("vllm:request_decode_time_seconds_sum") == 2.0
    assert v("vllm:inter_token_latency_seconds_bucket", le="0.5") == 1
    assert v("vllm:inter_token_latency_seconds_bucket", le="1.0") == 2
    assert v("vllm:prompt_tokens_total") == 10 and v("vllm:generation_tokens_total") == 3
    assert v("vllm:prefix_cache_queries_total") == 10 and v("vllm:prefix_cache_hits_total") == 4
    assert v("vllm:request_success_total", finished_reason="length") == 1
    assert v("vllm:request_success_total", finished_reason="stop") == 0
    assert v("ds4:kv_cache_tokens") == 13 and v("vllm:kv_cache_usage_perc") == 13 / 64


def test_each_app_counts_in_its_own_registry():
    with TestClient(fake_app()) as a, TestClient(fake_app()) as b:
        assert a.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        # The answer can reach the client a moment before the worker records the job.
        assert a.app.state.worker.wait_finished(1, 5) is not None
        assert value(scrape(a), "vllm:request_success_total", finished_reason="stop") == 1
        assert value(scrape(b), "vllm:request_success_total", finished_reason="stop") == 0


def test_route_templates_and_methods_bound_the_http_labels():
    with TestClient(fake_app(), raise_server_exceptions=False) as c:
        assert c.get("/v1/models/one").status_code == 404 and c.get("/v1/models/two").status_code == 404
        assert c.request("BREW", "/health").status_code == 405
        assert c.get("/health").status_code == 200
        found = scrape(c)
    assert http(found, "/v1/models/{model_id:path}", "GET", 404) == 2
    assert http(found, "/health", "other", 405) == 1 and http(found, "/health", "GET", 200) == 1
    assert sum(v for (name, _), v in found.items() if name == "http_requests_total") == 4


# --- a live server on the scripted engine -----------------------------------------------------------

def reply(prompt: str) -> str:
    return "y" * 3000 if SLOW_WORD in prompt else DEFAULT_REPLY


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_counts_after_streamed_and_plain_requests_an_error_and_a_cancel():
    model = FakeModel(reply, decode_delay=0.002)
    with live_server(fake_app(model)) as srv:
        base = srv.base
        plain = httpx.post(base + CHAT, json={"messages": user("hi")}).json()
        with httpx.stream("POST", base + CHAT, json={"messages": user("hi again"), "stream": True,
                                                     "stream_options": {"include_usage": True}}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        streamed = json.loads(lines[-1][len("data: "):])
        short = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 5}).json()
        assert httpx.post(base + CHAT, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
        assert httpx.get(base + "/no/such/path").status_code == 404
        # A non-streaming request whose client hangs up while it decodes: cancelled, 499.
        sock = raw_request(srv.port, "POST", CHAT, json.dumps({"messages": user(SLOW_WORD)}).encode())
        assert wait_until(lambda: srv.worker.busy and len(srv.worker.finished) == 3)
        time.sleep(0.2)
        sock.close()
        assert wait_until(lambda: http(scrape(base), CHAT, "POST", 499) == 1)
        assert wait_until(lambda: len(srv.worker.finished) == 4)
        stats = list(srv.worker.finished)
        found = scrape(base)

    assert [s.status for s in stats] == ["done", "done", "done", "cancelled"]
    cancelled = stats[-1]
    assert cancelled.n_generated > 0
    v = lambda name, **kw: value(found, name, **kw)  # noqa: E731
    # Requests by how they ended, and HTTP responses by route and status.
    assert {r: v("vllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")} \
        == {"stop": 2, "length": 1, "abort": 1, "error": 0}
    assert http(found, CHAT, "POST", 200) == 2 and http(found, CHAT, "POST", 400) == 1
    assert http(found, CHAT, "POST", 499) == 1 and http(found, "/v1/completions", "POST", 200) == 1
    assert http(found, "none", "GET", 404) == 1
    assert http(found, "/metrics", "GET", 200) >= 1  # the scrapes while waiting for the 499
    # Tokens: the answers' usage plus what the cancelled request had generated.
    usages = [plain["usage"], streamed["usage"], short["usage"]]
    assert v("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages) + cancelled.n_prompt
    assert v("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) + cancelled.n_generated
    assert v("vllm:prefix_cache_queries_total") == v("vllm:prompt_tokens_total")
    assert v("vllm:prefix_cache_hits_total") == sum(s.n_cached for s in stats)
    # Histograms: one observation per request, one per token after each request's first.
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time"):
        assert v(f"vllm:{name}_seconds_count") == 4, name
        assert v(f"vllm:{name}_seconds_sum") > 0, name
    assert v("vllm:inter_token_latency_seconds_count") == sum(s.n_generated - 1 for s in stats)
    assert v("vllm:inter_token_latency_seconds_bucket", le="+Inf") == v("vllm:inter_token_latency_seconds_count")
    # Nothing runs now; the one session holds what the last request left.
    assert v("vllm:num_requests_running") == 0 and v("vllm:num_requests_waiting") == 0
    assert v("ds4:kv_cache_capacity_tokens") == model.n_ctx and v("ds4:batch_slots") == 1
    assert 0 < v("ds4:kv_cache_tokens") <= model.n_ctx
    assert v("vllm:kv_cache_usage_perc") == v("ds4:kv_cache_tokens") / model.n_ctx


def test_running_and_waiting_while_one_request_decodes_and_one_queues():
    model = FakeModel(reply, decode_delay=0.005)
    # One job at a time, so that the second request waits (by default it would be interleaved).
    with live_server(fake_app(model, interleave=1)) as srv:
        body = json.dumps({"messages": user(SLOW_WORD), "stream": True}).encode()
        first = raw_request(srv.port, "POST", CHAT, body)
        assert wait_until(lambda: srv.worker.busy)
        second = raw_request(srv.port, "POST", CHAT, body)
        found = wait_until(lambda: (lambda f: f if value(f, "vllm:num_requests_waiting") == 1 else None)(
            scrape(srv.base)))
        assert found, "the second request never showed as waiting"
        assert value(found, "vllm:num_requests_running") == 1
        first.close()
        second.close()
        assert wait_until(lambda: len(srv.worker.finished) == 2)
        after = wait_until(lambda: (lambda f: f if http(f, CHAT, "POST", 200) == 2 else None)(scrape(srv.base)))
    assert value(after, "vllm:request_success_total", finished_reason="abort") == 2
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0


# --- the batched loop and the disk cache, on tiny GGUF models -------------------------------------

def test_the_batched_loops_occupancy_per_step(tiny_model):
    metrics = ServerMetrics(tiny_model.name, n_slots=2)
    w = InferenceWorker(tiny_model, n_slots=2, observer=metrics)
    # Both queued before the loop starts: it takes them together, so they share every step.
    jobs = [w.submit(GenerationRequest(prompt_text=q, prompt_ids=tuple(prompt_ids(tiny_model, q)), max_tokens=12,
                                       sampling=SamplingSpec(temperature=0.0, ignore_eos=True)), lambda _e: None)
            for q in ("first question", "second question")]
    w.start()
    try:
        assert all(w.wait_finished(job.id, 60) is not None for job in jobs)
        found = samples(metrics.render(w.load(), None).decode())
    finally:
        w.stop()
    v = lambda name, **kw: value(found, name, model_name=tiny_model.name, **kw)  # noqa: E731
    steps = v("ds4:batch_busy_slots_count")
    one = v("ds4:batch_busy_slots_bucket", le="1.0")
    assert steps > 0 and v("ds4:batch_busy_slots_bucket", le="2.0") == steps
    assert one < steps  # at least one step decoded both
    assert v("ds4:batch_busy_slots_sum") == one * 1 + (steps - one) * 2
    assert v("ds4:batch_step_seconds_count") == steps and 0 < v("ds4:batch_step_seconds_sum") < 60
    assert v("ds4:batch_slots") == 2 and v("ds4:kv_cache_capacity_tokens") == 2 * tiny_model.n_ctx
    assert v("vllm:generation_tokens_total") == 24
    assert v("vllm:request_success_total", finished_reason="length") == 2


SMALL = SavePolicy(trim=4, align=16, interval=64, min_tokens=16, min_gain=8)
SYSTEM = "You answer questions about the weather, briefly and politely. " * 2


def kv_app(model, directory: Path):
    return create_app(model, ServerConfig(kv=KVStoreConfig(directory=str(directory)), allowed_hosts=(TEST_CLIENT_HOST,)), kv_save_policy=SMALL)


def test_disk_cache_counters_across_a_restart(tiny_model, tmp_path):
    from engine import load_model

    d = tmp_path / "kv"
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Will it rain?"}],
            "max_tokens": 4, "temperature": 0}
    with TestClient(kv_app(tiny_model, d)) as c:
        assert c.post(CHAT, json=body).status_code == 200
        cold = samples(c.get("/metrics").text)
        sizes_after_first = sum(f.stat().st_size for f in d.glob("*.kv"))
    v = lambda found, name: value(found, name, model_name=tiny_model.name)  # noqa: E731
    assert v(cold, "ds4:kv_disk_hits_total") == 0 and v(cold, "ds4:kv_disk_lookups_total") >= 1
    assert v(cold, "ds4:kv_disk_saves_total") >= 1
    assert v(cold, "ds4:kv_disk_saved_bytes_total") == sizes_after_first == v(cold, "ds4:kv_disk_bytes")
    assert v(cold, "ds4:kv_disk_saved_tokens_total") > 0 and v(cold, "ds4:kv_disk_restored_bytes_total") == 0

    # Another app on the same directory, as after a restart: its counters start from zero.
    files = {f.stat().st_size for f in d.glob("*.kv")}
    with TestClient(kv_app(load_model(tiny_model.path), d)) as c:
        r = c.post(CHAT, json=body)
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        warm = samples(c.get("/metrics").text)
    assert cached > 0
    assert v(warm, "ds4:kv_disk_hits_total") == 1 and v(warm, "ds4:kv_disk_lookups_total") == 1
    assert v(warm, "ds4:kv_disk_restored_tokens_total") == cached
    assert v(warm, "ds4:kv_disk_restored_bytes_total") in files
    assert v(warm, "vllm:prefix_cache_hits_total") == cached


def test_worker_metrics_expose_what_prometheus_clients_own_would():
    """The per-token counter and histogram (written by the worker thread without locks) give the
    same exposition as prometheus_client's `Counter` and `Histogram` fed the same values: names,
    types, help, labels, every bucket's bound and count, the sum; `_created` aside (a time)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from server.metrics import ITL_BUCKETS, WorkerCounter, WorkerHistogram

    values = [0.0, 0.001, 0.0010001, 0.02, 0.3, 5.0, 7.5, 1e-9, 0.075, 0.075]
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("vllm:generation_tokens", "Generated tokens.", ["model_name"], registry=theirs).labels("m")
    hist = Histogram("vllm:inter_token_latency_seconds", "Between tokens.", ["model_name"], buckets=ITL_BUCKETS,
                     registry=theirs).labels("m")
    our_counter = WorkerCounter("vllm:generation_tokens", "Generated tokens.", "m")
    our_hist = WorkerHistogram("vllm:inter_token_latency_seconds", "Between tokens.", "m", ITL_BUCKETS)
    ours.register(our_counter)
    ours.register(our_hist)
    for v in values:
        counter.inc()
        our_counter.inc()
        hist.observe(v)
        our_hist.observe(v)

    def shown(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines()
                if "_created{" not in line]

    assert shown(ours) == shown(theirs)
    found = samples(generate_latest(ours).decode())
    assert found[("vllm:inter_token_latency_seconds_bucket", frozenset({("model_name", "m"), ("le", "0.001")}))] == 3
    assert ("vllm:inter_token_latency_seconds_created", frozenset({("model_name", "m")})) in found
