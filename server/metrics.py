"""Prometheus metrics of ds4-server (`GET /metrics`): one `ServerMetrics` per app.

Names and labels follow vLLM's `vllm:` family where vLLM has the quantity (its set has the
latency histograms that llama.cpp's `llamacpp:` set lacks), so a dashboard built for vLLM
needs few changes; quantities vLLM has no name for are `ds4:`, and the HTTP counter is the
`http_requests_total{handler,method,status}` of the FastAPI instrumentation vLLM ships.
Every engine metric carries `model_name`. docs/server.md lists them with their meaning.

How values arrive:
- Jobs: `ServerMetrics` is the worker's `server.jobs.JobObserver`. The loops call
  `job_started`, `token` (each generated token) and `job_finished` on the worker thread, and
  the batched loop `batch_step` after each scheduler step. Each call updates a few
  prometheus_client children, whose own locks are held for a few microseconds; nothing here
  waits on the engine or holds a lock across a forward pass. The two per-token quantities
  (generated tokens, inter-token latency) are `WorkerCounter` and `WorkerHistogram` instead:
  plain numbers that only the worker thread writes, read by the scrape, because a batched
  step calls `token` once per row and prometheus_client's locked children cost more than
  the rest of a token's host work.
- HTTP: `HttpMetrics`, an ASGI middleware, counts every response by route template, method
  and status once the response is over (a stream when it ends).
- Scrape time: `render(load, kv)` reads what is now (`server.jobs.ServingLoad`: running,
  waiting, KV cache tokens) and the disk cache's counters (`server.kvstore.KVStoreStats`)
  and returns the text exposition format.

Each instance has its own `CollectorRegistry`, never prometheus_client's global one, so
several apps in one process (tests) keep separate counts. It does not serve HTTP (the
endpoint table's `/metrics` row does) nor time anything the ledger does not already time.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any, Awaitable, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from server.jobs import JobStats, ServingLoad
from server.kvstore import KVStoreStats

# The classic text format: every Prometheus version and most other scrapers read it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets in seconds, from a fast GPU token to a long CPU prefill.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
# A batched step: a GPU's decoding step of a small model (under a millisecond) to a CPU prefill chunk.
STEP_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
                   1280.0, 2560.0)

# vLLM's finished_reason of a job that did not end by itself, by ledger status.
ENDED_REASONS = {"cancelled": "abort", "failed": "error"}
FINISHED_REASONS = ("stop", "length", "abort", "error")

UNMATCHED = "none"
"""The handler label of a request no route matches (keeps unknown paths out of the labels)."""
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
OTHER_METHOD = "other"
"""The method label of any method not in `METHODS` (a client may send any token as a method)."""


class _LoadCollector:
    """The scrape-time families: what `ServerMetrics.render` was handed for this scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.load: ServingLoad | None = None
        self.kv: KVStoreStats | None = None

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def collect(self) -> Iterable[Metric]:
        load = self.load
        if load is not None:
            yield self._gauge("vllm:num_requests_running", "Requests taken by the inference loop and not finished.",
                              load.running)
            yield self._gauge("vllm:num_requests_waiting", "Requests queued and not yet started.", load.waiting)
            capacity = max(1, load.kv_capacity_tokens)
            yield self._gauge("vllm:kv_cache_usage_perc",
                              "Fraction of the resident sessions' KV cache holding tokens (1 = full).",
                              load.kv_tokens / capacity)
            yield self._gauge("ds4:kv_cache_tokens",
                              "Tokens held in the resident sessions' KV caches (serving or kept for prefix reuse).",
                              load.kv_tokens)
            yield self._gauge("ds4:kv_cache_capacity_tokens", "Tokens the resident sessions' KV caches can hold.",
                              load.kv_capacity_tokens)
            yield self._gauge("ds4:batch_slots", "Resident sessions (--batched-session; 1 when serial).", load.slots)
        kv = self.kv
        if kv is not None:
            for name, doc, value in (
                ("ds4:kv_disk_lookups", "Disk KV cache lookups.", kv.lookups),
                ("ds4:kv_disk_hits", "Disk KV cache lookups that restored a checkpoint.", kv.hits),
                ("ds4:kv_disk_restored_tokens", "Tokens restored from disk checkpoints.", kv.tokens_restored),
                ("ds4:kv_disk_restored_bytes", "Bytes of disk checkpoints read back by hits.", kv.bytes_restored),
                ("ds4:kv_disk_saves", "Checkpoints written to the disk KV cache.", kv.writes),
                ("ds4:kv_disk_saved_tokens", "Tokens written in disk checkpoints.", kv.tokens_written),
                ("ds4:kv_disk_saved_bytes", "Bytes written in disk checkpoints.", kv.bytes_written),
                ("ds4:kv_disk_evictions", "Disk checkpoints evicted to stay within the budget.", kv.evicted),
            ):
                yield self._counter(name, doc, value)
            yield self._gauge("ds4:kv_disk_bytes", "Bytes of the disk KV cache's files.", kv.bytes)
            yield self._gauge("ds4:kv_disk_budget_bytes", "Size budget of the disk KV cache.", kv.budget_bytes)
            yield self._gauge("ds4:kv_disk_entries", "Checkpoints in the disk KV cache.", kv.entries)


class WorkerCounter:
    """A counter that one thread increments without a lock (a collector of its registry): the
    exposition of a prometheus_client `Counter` of one `model_name` child, `_created` included."""

    def __init__(self, name: str, doc: str, model_name: str) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.value = 0
        self.created = time.time()

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily(self.name, self.doc, labels=["model_name"])
        c.add_metric([self.model_name], float(self.value), created=self.created)
        yield c


class WorkerHistogram:
    """A histogram that one thread observes into without a lock (a collector of its registry):
    the exposition of a prometheus_client `Histogram` of one `model_name` child. A scrape reads
    a copy of the bucket counts, so its buckets and count always agree; its sum may miss the
    observation being made at that moment."""

    def __init__(self, name: str, doc: str, model_name: str, buckets: Sequence[float]) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value

    def collect(self) -> Iterable[Metric]:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, n in zip(self.bounds + (float("inf"),), counts):
            cumulative += n
            buckets.append((floatToGoString(bound), float(cumulative)))
        h = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        h.add_metric([self.model_name], buckets, total)
        h.add_sample(self.name + "_created", {"model_name": self.model_name}, self.created)
        yield h


class ServerMetrics:
    """The metrics of one app: a `JobObserver` for the loops, `http_response` for the
    middleware, `render` for the scrape."""

    def __init__(self, model_name: str, n_slots: int = 1) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, m, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of started requests (cached ones included).")
        self.generation_tokens = WorkerCounter("vllm:generation_tokens", "Generated tokens.", model_name)
        r.register(self.generation_tokens)
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up for reuse (all prompt tokens of started requests).")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prompt tokens not recomputed: kept in a resident session or restored from disk.")
        success = Counter("vllm:request_success", "Finished requests by how they ended.",
                          m + ["finished_reason"], registry=r)
        self.finished = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "From a request's submission to its first generated token.", TTFT_BUCKETS)
        self.itl = WorkerHistogram("vllm:inter_token_latency_seconds",
                                   "Between consecutive generated tokens of a request.", model_name, ITL_BUCKETS)
        r.register(self.itl)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "From a request's submission to its end.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "From a request's submission to the start of its prefill.", REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "ds4:request_queue_time_seconds",
            "From a client request's arrival to the start of its first job: one observation per request, "
            "however many choices or prompts it has (vllm:request_queue_time_seconds counts each of them).",
            REQUEST_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "From the start of a request's prefill to its first token.", REQUEST_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "From a request's first token to its end.", REQUEST_BUCKETS)
        self.busy_slots = histogram("ds4:batch_busy_slots",
                                    "Resident sessions serving a request, per batched decode step.",
                                    tuple(float(i) for i in range(1, max(1, n_slots) + 1)))
        self.step_time = histogram("ds4:batch_step_seconds",
                                   "Wall time of a batched step: every busy slot's token and at most one "
                                   "prefill or scoring chunk.", STEP_BUCKETS)
        self.http = Counter("http_requests", "HTTP responses by route, method and status.",
                            ["handler", "method", "status"], registry=r)
        self._load = _LoadCollector(model_name)
        r.register(self._load)
        self._render_lock = threading.Lock()

    # -- the JobObserver seam (worker thread) --

    def job_started(self, stats: JobStats) -> None:
        if stats.started_at is not None:
            self.queue_time.observe(stats.started_at - stats.queued_at)
        if stats.request_queue_s is not None:
            self.request_queue_time.observe(stats.request_queue_s)

    def token(self, stats: JobStats, now: float) -> None:
        self.generation_tokens.inc()
        if stats.last_token_at is None:
            self._prompt_done(stats)
            self.ttft.observe(now - stats.queued_at)
        else:
            self.itl.observe(now - stats.last_token_at)

    def job_finished(self, stats: JobStats) -> None:
        if stats.first_token_at is None and stats.started_at is not None:
            self._prompt_done(stats)  # it ended without a token: its prompt is counted now
        reason = stats.finish_reason if stats.status == "done" else ENDED_REASONS.get(stats.status, "error")
        self.finished.get(reason or "error", self.finished["error"]).inc()
        end = stats.finished_at
        if end is None:
            return
        self.e2e.observe(end - stats.queued_at)
        if stats.started_at is not None and stats.first_token_at is not None:
            self.prefill_time.observe(stats.first_token_at - stats.started_at)
            self.decode_time.observe(end - stats.first_token_at)

    def batch_step(self, busy_slots: int, seconds: float) -> None:
        self.busy_slots.observe(busy_slots)
        self.step_time.observe(seconds)

    def _prompt_done(self, stats: JobStats) -> None:
        self.prompt_tokens.inc(stats.n_prompt)
        self.prefix_queries.inc(stats.n_prompt)
        self.prefix_hits.inc(stats.n_cached)

    # -- HTTP (event loop) --

    def http_response(self, handler: str, method: str, status: int) -> None:
        self.http.labels(handler, method, str(status)).inc()

    # -- the scrape --

    def render(self, load: ServingLoad | None, kv: KVStoreStats | None) -> bytes:
        """The text exposition of every metric, with `load` and `kv` as the current values."""
        with self._render_lock:  # one scrape's values stay together
            self._load.load, self._load.kv = load, kv
            return generate_latest(self.registry)


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class HttpMetrics:
    """ASGI middleware: `metrics.http_response(route template, method, status)` per response.

    The route is the one the router chose (`scope["route"]`, set while routing), so
    `/v1/models/{model_id:path}` is one label whatever the id; a path no route matches is
    `UNMATCHED`, a method outside `METHODS` is `OTHER_METHOD`, so clients cannot grow the label set. A response that never started (the app raised) counts as 500, as the
    server then answers."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = scope.get("route")
            method = scope["method"] if scope["method"] in METHODS else OTHER_METHOD
            self.metrics.http_response(getattr(route, "path", UNMATCHED), method, status)
