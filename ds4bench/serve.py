"""`ds4-bench serve`: load-test any OpenAI-compatible server the way users are served.

Two kinds of load, each a "level" of the run:
  concurrency C  a closed loop: C clients, each sending its next request as soon as its
                 previous one ended, until `requests` requests were sent;
  rate R         an open loop: `requests` requests sent at Poisson arrival times of R per
                 second (exponential gaps drawn from `random.Random(seed)`: the same seed
                 gives the same schedule), whatever the server's state.
Every request is a streamed `/v1/chat/completions` (or `/v1/completions` with
`--endpoint completions`) with `stream_options.include_usage`, greedy, `max_tokens`
tokens, and a prompt of seeded pseudo-words that differs per request (a shared prompt
would let prefix caches flatter the server). One untimed request per run warms the server.

Per request (times from just before the request is sent):
  TTFT   until the first chunk that carries output (content, reasoning or a tool call)
  ITL    the gaps between successive output chunks (one value per gap, over all requests)
  TPOT   (E2EL - TTFT) / (completion_tokens - 1), from the server's usage; needs 2 tokens
  E2EL   until `data: [DONE]`
A request counts as completed only when its stream is HTTP 200, every `data:` line is JSON
without an "error" member, no `event: error` came, some output arrived, a choice carried a
finish_reason, a usage object with completion_tokens came, and the stream ended with
`[DONE]`. Anything else (including timeouts and refused connections) is failed, with the
reason, and never contributes latencies. Per level: completed and failed counts, request
throughput (completed / level seconds), output and total token throughput, and TTFT, ITL,
TPOT, E2EL in milliseconds as mean, median, p90, p95, p99 (linear interpolation between
order statistics, as numpy's default). Goodput (optional SLOs, e.g. ttft:500 tpot:50 in
ms): completed requests meeting every SLO per second.

Outputs: a table on stdout, progress on stderr, and on request a CSV (one row per level:
the columns of CSV_COLUMNS), a JSON document (config, levels, failure reasons) and a plot
(PNG or SVG by the file name) of throughput and latency against concurrency (or rate).
Before the first request the command probes the server's request features
(`ds4eval.run.probe`; `capability_needs`): without streaming usage it stops with one
line, a missing ignore_eos is a note; `--no-probe` skips that.
It speaks only the public HTTP API (httpx.AsyncClient), starts no server and does not
check the text of the replies.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Sequence

import click
from tabulate import tabulate

from ds4bench.csvfile import write_csv
from ds4bench.errors import RunFailure, UsageFailure
from ds4eval.atomicfile import atomic_path, write_text_atomic
from ds4eval.run import sse

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
METRICS = ("ttft", "itl", "tpot", "e2el")
STATS = ("mean", "median", "p90", "p95", "p99")
PERCENTILES = {"median": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0}
SLO_METRICS = ("ttft", "tpot", "e2el")
CSV_COLUMNS = ("mode", "level", "requests", "completed", "failed", "duration_s", "request_throughput",
               "output_token_throughput", "total_token_throughput", "goodput",
               *(f"{m}_{s}_ms" for m in METRICS for s in STATS))
_WORDS = ("river", "stone", "market", "window", "garden", "letter", "signal", "number", "winter", "bridge", "candle",
          "forest", "engine", "silver", "morning", "harbor", "paper", "story", "island", "valley", "mirror", "thread",
          "castle", "planet", "music", "orange", "pocket", "shadow", "summer", "ticket", "velvet", "wonder")


class ServeBenchError(ValueError):
    """Unusable settings or an unusable server; the message says which and why."""


@dataclass(frozen=True)
class ServeBenchConfig:
    """Settings of one `ds4-bench serve` run; each field is one command-line flag."""

    url: str = ""  # --url: server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    endpoint: str = "chat"  # --endpoint: chat (/v1/chat/completions) or completions (/v1/completions)
    model: str | None = None  # --served-model: "model" of the requests; None: the first of /v1/models
    concurrency: tuple[int, ...] = (1,)  # --concurrency: closed-loop levels
    rates: tuple[float, ...] = ()  # --rate: open-loop levels, requests per second
    requests: int = 16  # --requests: requests per level
    max_tokens: int = 32  # --max-tokens
    prompt_words: int = 48  # --prompt-words: pseudo-words in each prompt
    seed: int = 0  # --seed: prompts and Poisson schedule
    timeout_s: float = 300.0  # --timeout: seconds for one request, end to end
    warmup: int = 1  # --warmup: untimed requests before the first level
    goodput: tuple[tuple[str, float], ...] = ()  # --goodput: (metric, ms) SLOs
    api_key: str | None = None  # --api-key (also $OPENAI_API_KEY)
    csv: str | None = None
    json_path: str | None = None  # --json
    plot: str | None = None  # --plot: .png or .svg
    no_probe: bool = False  # --no-probe: skip the capability probe before the first request

    def validate(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ServeBenchError(f"--url must be an http(s) URL, not {self.url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ServeBenchError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, not {self.endpoint!r}")
        if not self.concurrency and not self.rates:
            raise ServeBenchError("nothing to run: give --concurrency and/or --rate")
        if any(c < 1 for c in self.concurrency):
            raise ServeBenchError(f"--concurrency values must be at least 1, not {list(self.concurrency)}")
        if any(not (r > 0 and math.isfinite(r)) for r in self.rates):
            raise ServeBenchError(f"--rate values must be positive requests per second, not {list(self.rates)}")
        for name, value in (("--requests", self.requests), ("--max-tokens", self.max_tokens),
                            ("--prompt-words", self.prompt_words)):
            if value < 1:
                raise ServeBenchError(f"{name} must be at least 1, not {value}")
        if self.warmup < 0:
            raise ServeBenchError(f"--warmup must be >= 0, not {self.warmup}")
        if not self.timeout_s > 0:
            raise ServeBenchError(f"--timeout must be positive, not {self.timeout_s}")
        if self.plot and os.path.splitext(self.plot)[1].lower() not in (".png", ".svg"):
            raise ServeBenchError(f"--plot {self.plot}: the name must end in .png or .svg")

    @property
    def base_url(self) -> str:
        base = self.url.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base


# ---------------------------------------------------------------- parsing flags (pure)

def parse_goodput(items: Iterable[str]) -> tuple[tuple[str, float], ...]:
    """["ttft:500 tpot:50"] or ["ttft:500", "tpot:50"] or "ttft:500,tpot:50" -> (("ttft", 500.0), ...)."""
    out: dict[str, float] = {}
    for item in items:
        for part in item.replace(",", " ").split():
            name, sep, value = part.partition(":")
            name = name.strip().lower()
            if not sep or name not in SLO_METRICS:
                raise ServeBenchError(f"--goodput wants METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}, "
                                      f"not {part!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ServeBenchError(f"--goodput {part!r}: {value!r} is not a number of milliseconds") from None
            if not (ms > 0 and math.isfinite(ms)):
                raise ServeBenchError(f"--goodput {part!r}: the limit must be positive")
            out[name] = ms
    return tuple(out.items())


def parse_numbers(text: str, kind: type) -> tuple:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        return tuple(kind(p) for p in parts)
    except ValueError:
        raise ServeBenchError(f"expected comma-separated numbers such as 1,2,4,8, not {text!r}") from None


# ---------------------------------------------------------------- workload (pure)

def prompt_text(index: int, words: int, seed: int) -> str:
    rng = random.Random(f"{seed}:{index}")
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"Request {index}. Continue this list of words with more words: {body}"


def request_body(cfg: ServeBenchConfig, model: str, index: int) -> dict[str, Any]:
    prompt = prompt_text(index, cfg.prompt_words, cfg.seed)
    body: dict[str, Any] = {"model": model, "max_tokens": cfg.max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Seconds from the level's start at which each of n requests is sent (first one at 0)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


# ---------------------------------------------------------------- one stream (pure)

@dataclass
class RequestResult:
    ok: bool
    error: str = ""  # why it failed
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float | None = None
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.completion_tokens < 2 or self.ttft_s is None or self.e2el_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.completion_tokens - 1)


def _chunk_has_output(chunk: dict) -> bool:
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")
                                        or delta.get("reasoning") or delta.get("tool_calls")):
            return True
    return False


def parse_stream(lines: Sequence[tuple[float, str]], status: int = 200, end_s: float | None = None) -> RequestResult:
    """A request's outcome from its SSE lines, each (seconds since the request was sent, line).

    `end_s` is when the stream closed (defaults to the last line's time). The rules of a
    completed request are in the module docstring; the first broken rule is the error.
    """
    if status != 200:
        body = " ".join(line for _, line in lines)[:200]
        return RequestResult(False, f"HTTP {status}: {body}".rstrip(": "))
    output_times: list[float] = []
    finish: str | None = None
    usage: dict | None = None
    done_at: float | None = None
    event_name = ""
    for t, raw in lines:
        line = raw.rstrip("\r")
        if not line:
            event_name = ""
            continue
        if line.startswith(":"):
            continue  # SSE comment: a keepalive
        if line.startswith("event:"):
            event_name = line[6:].strip()
            if event_name == "error":
                return RequestResult(False, "error event in the stream")
            continue
        if not line.startswith("data:"):
            continue
        if done_at is not None:
            return RequestResult(False, "data after [DONE]")
        try:
            chunk = sse.decode_data_line(line)
        except sse.StreamFault as e:
            return RequestResult(False, str(e))
        if chunk == sse.DONE:
            done_at = t
            continue
        if _chunk_has_output(chunk):
            output_times.append(t)
        for choice in chunk.get("choices") or []:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                finish = str(choice["finish_reason"])
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
    if done_at is None:
        return RequestResult(False, "the stream ended without [DONE]")
    if finish is None:
        return RequestResult(False, "no finish_reason in the stream")
    if usage is None or not isinstance(usage.get("completion_tokens"), int):
        return RequestResult(False, "no usage with completion_tokens in the stream")
    if not output_times:
        return RequestResult(False, "no output in the stream")
    itl = [b - a for a, b in zip(output_times, output_times[1:])]
    prompt_tokens = usage.get("prompt_tokens")
    return RequestResult(True, "", prompt_tokens if isinstance(prompt_tokens, int) else 0,
                         usage["completion_tokens"], output_times[0], itl,
                         end_s if end_s is not None else done_at, finish)


# ---------------------------------------------------------------- statistics (pure)

def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between the order statistics (numpy's default method); p in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p95, p99 in milliseconds (None for each when there are no values)."""
    if not values_s:
        return {s: None for s in STATS}
    ms = [v * 1000 for v in values_s]
    out: dict[str, float | None] = {"mean": statistics.fmean(ms)}
    for name, p in PERCENTILES.items():
        out[name] = percentile(ms, p)
    return out


def meets_slos(r: RequestResult, slos: Sequence[tuple[str, float]]) -> bool:
    """Whether a completed request is within every SLO (ms); a metric it lacks (TPOT of 1 token) passes."""
    if not r.ok:
        return False
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.e2el_s}
    return all(values[m] is None or values[m] * 1000 <= limit for m, limit in slos)


@dataclass
class LevelSummary:
    mode: str  # "concurrency" | "rate"
    level: float
    requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    goodput: float | None
    stats: dict[str, dict[str, float | None]]  # metric -> stat -> ms
    failures: dict[str, int]  # reason -> count

    def csv_row(self) -> dict[str, object]:
        row: dict[str, object] = {
            "mode": self.mode, "level": _num(self.level), "requests": self.requests, "completed": self.completed,
            "failed": self.failed, "duration_s": f"{self.duration_s:.3f}",
            "request_throughput": f"{self.request_throughput:.4f}",
            "output_token_throughput": f"{self.output_token_throughput:.3f}",
            "total_token_throughput": f"{self.total_token_throughput:.3f}",
            "goodput": "" if self.goodput is None else f"{self.goodput:.4f}"}
        for m in METRICS:
            for s in STATS:
                v = self.stats[m][s]
                row[f"{m}_{s}_ms"] = "" if v is None else f"{v:.3f}"
        return row


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def summarize(mode: str, level: float, results: Sequence[RequestResult], duration_s: float,
              slos: Sequence[tuple[str, float]] = ()) -> LevelSummary:
    done = [r for r in results if r.ok]
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.completion_tokens for r in done)
    all_tokens = out_tokens + sum(r.prompt_tokens for r in done)
    stats = {
        "ttft": describe([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl": describe([x for r in done for x in r.itl_s]),
        "tpot": describe([t for r in done if (t := r.tpot_s) is not None]),
        "e2el": describe([r.e2el_s for r in done if r.e2el_s is not None]),
    }
    goodput = sum(meets_slos(r, slos) for r in done) / dur if slos else None
    failures = dict(Counter(r.error for r in results if not r.ok))
    return LevelSummary(mode, level, len(results), len(done), len(results) - len(done), duration_s,
                        len(done) / dur, out_tokens / dur, all_tokens / dur, goodput, stats, failures)


# ---------------------------------------------------------------- load generation (async I/O)

async def send_request(client: Any, url: str, body: dict, timeout_s: float,
                       clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """POST one streamed request and parse what came back; never raises for server or network faults."""
    import httpx

    t0 = clock()
    lines: list[tuple[float, str]] = []
    status = 0

    async def consume() -> None:
        nonlocal status
        async with client.stream("POST", url, json=body) as resp:
            status = resp.status_code
            if status != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")
                lines.append((clock() - t0, text))
                return
            async for line in resp.aiter_lines():
                lines.append((clock() - t0, line))

    try:
        await asyncio.wait_for(consume(), timeout_s)
    except asyncio.TimeoutError:
        return RequestResult(False, f"timeout after {timeout_s:g} s")
    except httpx.HTTPError as e:
        return RequestResult(False, f"{type(e).__name__}: {str(e)[:120]}".rstrip(": "))
    return parse_stream(lines, status, clock() - t0)


class ProgressLine:
    """A one-line progress display on stderr: redrawn in place on a terminal, a few lines otherwise."""

    def __init__(self, label: str, total: int, stream: Any = None, min_interval: float = 0.2):
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = self.failed = 0
        self.min_interval = min_interval
        self._last = 0.0
        self._t0 = time.perf_counter()
        self._printed_tenths = -1

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.perf_counter()
        if self.tty:
            if now - self._last >= self.min_interval or self.done == self.total:
                self._last = now
                self.stream.write("\r" + self.render(now) + ("\n" if self.done == self.total else ""))
                self.stream.flush()
        else:
            tenths = self.done * 10 // max(self.total, 1)
            if tenths != self._printed_tenths and (tenths % 5 == 0 or self.done == self.total):
                self._printed_tenths = tenths
                self.stream.write(self.render(now) + "\n")
                self.stream.flush()

    def render(self, now: float) -> str:
        width = 24
        filled = width * self.done // max(self.total, 1)
        return (f"{self.label:<16} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"failed {self.failed}  {now - self._t0:6.1f} s")


async def run_closed_loop(send: Callable[[int], Awaitable[RequestResult]], concurrency: int, n: int,
                          first_index: int = 0, on_done: Callable[[RequestResult], None] = lambda _r: None,
                          ) -> tuple[list[RequestResult], float]:
    """C workers send requests first_index..first_index+n-1, each as soon as its previous one ended."""
    results: list[RequestResult | None] = [None] * n
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            results[i] = r = await send(first_index + i)
            on_done(r)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return [r for r in results if r is not None], time.perf_counter() - t0


async def run_open_loop(send: Callable[[int], Awaitable[RequestResult]], arrivals: Sequence[float],
                        first_index: int = 0, on_done: Callable[[RequestResult], None] = lambda _r: None,
                        ) -> tuple[list[RequestResult], float]:
    """Request i is sent at arrivals[i] seconds after the start, however many are still running."""
    t0 = time.perf_counter()

    async def one(i: int, at: float) -> RequestResult:
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        r = await send(first_index + i)
        on_done(r)
        return r

    results = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    return list(results), time.perf_counter() - t0


@dataclass
class ServeBenchResult:
    model: str
    endpoint: str
    levels: list[LevelSummary]


def capability_needs(cfg: ServeBenchConfig) -> list:
    """The request features this benchmark relies on (`ds4eval.run.capabilities`)."""
    from ds4eval.run.capabilities import Need

    return [Need("streaming usage", True, "to count a request as completed and its tokens"),
            Need("ignore_eos", False, "to make replies run to --max-tokens (without it they may end sooner; "
                                      "throughput counts the tokens the usage reports)")]


async def discover_model(client: Any, base: str) -> str:
    import httpx

    try:
        resp = await client.get(base + "/v1/models")
    except httpx.HTTPError as e:
        raise ServeBenchError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
    try:
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServeBenchError(f"{base}/v1/models gave no model (HTTP {resp.status_code}); "
                              f"pass --served-model") from None


async def run_serve_bench_async(cfg: ServeBenchConfig, progress_stream: Any = None) -> ServeBenchResult:
    import httpx

    cfg.validate()
    base = cfg.base_url
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = cfg.model or await discover_model(client, base)
        url = base + ENDPOINTS[cfg.endpoint]

        def send(i: int) -> Awaitable[RequestResult]:
            return send_request(client, url, request_body(cfg, model, i), cfg.timeout_s)

        for w in range(cfg.warmup):
            r = await send(-1 - w)
            if not r.ok:
                raise ServeBenchError(f"the warm-up request failed: {r.error}")
        levels: list[LevelSummary] = []
        index = 0
        plan = [("concurrency", float(c)) for c in cfg.concurrency] + [("rate", r) for r in cfg.rates]
        for mode, level in plan:
            bar = ProgressLine(f"{'C' if mode == 'concurrency' else 'rate'}={_num(level)}", cfg.requests,
                               progress_stream)
            on_done = lambda r: bar.update(r.ok)  # noqa: E731
            if mode == "concurrency":
                results, dur = await run_closed_loop(send, int(level), cfg.requests, index, on_done)
            else:
                arrivals = poisson_arrivals(level, cfg.requests, cfg.seed)
                results, dur = await run_open_loop(send, arrivals, index, on_done)
            index += cfg.requests
            levels.append(summarize(mode, level, results, dur, cfg.goodput))
    return ServeBenchResult(model, cfg.endpoint, levels)


# ---------------------------------------------------------------- output

def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render_table(result: ServeBenchResult, with_goodput: bool) -> str:
    headers = ["load", "done/failed", "req/s", "out tok/s"]
    if with_goodput:
        headers.append("goodput req/s")
    for m in METRICS:
        headers.append(f"{m.upper()} ms mean / p50 / p90 / p95 / p99")
    body = []
    for lv in result.levels:
        row = [f"{'C' if lv.mode == 'concurrency' else 'rate'}={_num(lv.level)}", f"{lv.completed}/{lv.failed}",
               f"{lv.request_throughput:.3f}", f"{lv.output_token_throughput:.1f}"]
        if with_goodput:
            row.append(_fmt(lv.goodput, 3))
        for m in METRICS:
            row.append(" / ".join(_fmt(lv.stats[m][s]) for s in STATS))
        body.append(row)
    return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)


def failure_lines(result: ServeBenchResult) -> list[str]:
    out = []
    for lv in result.levels:
        for reason, n in sorted(lv.failures.items(), key=lambda kv: -kv[1]):
            out.append(f"{lv.mode} {_num(lv.level)}: {n} failed: {reason}")
    return out


def ratio_lines(result: ServeBenchResult) -> list[str]:
    """Request throughput of every concurrency level against C=1, when C=1 was measured."""
    closed = {lv.level: lv for lv in result.levels if lv.mode == "concurrency"}
    one = closed.get(1.0)
    if one is None or one.request_throughput <= 0:
        return []
    return [f"C={_num(c)} / C=1 request throughput: {lv.request_throughput / one.request_throughput:.2f}x; "
            f"p99 TTFT {_fmt(lv.stats['ttft']['p99'])} ms" for c, lv in sorted(closed.items()) if c != 1.0]


def result_json(cfg: ServeBenchConfig, result: ServeBenchResult) -> dict[str, Any]:
    conf = asdict(cfg)
    conf.pop("api_key", None)
    conf["goodput"] = {m: ms for m, ms in cfg.goodput}
    return {"config": conf, "model": result.model, "endpoint": ENDPOINTS[result.endpoint],
            "levels": [asdict(lv) for lv in result.levels]}


def write_json(path: str, doc: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")


def write_plot(path: str, result: ServeBenchResult) -> None:
    """Two panels against the load (concurrency levels, else rates): throughput and latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = "concurrency" if any(lv.mode == "concurrency" for lv in result.levels) else "rate"
    levels = sorted((lv for lv in result.levels if lv.mode == mode), key=lambda lv: lv.level)
    xs = [lv.level for lv in levels]
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_t.plot(xs, [lv.request_throughput for lv in levels], "o-", label="requests/s")
    ax_t.set_xlabel(mode)
    ax_t.set_ylabel("requests/s")
    ax_tok = ax_t.twinx()
    ax_tok.plot(xs, [lv.output_token_throughput for lv in levels], "s--", color="tab:orange", label="output tok/s")
    ax_tok.set_ylabel("output tokens/s")
    ax_t.set_title("throughput")
    handles = ax_t.get_legend_handles_labels()[0] + ax_tok.get_legend_handles_labels()[0]
    ax_t.legend(handles, [h.get_label() for h in handles], loc="upper left")
    for metric, stat, style in (("ttft", "median", "o-"), ("ttft", "p99", "o:"), ("tpot", "median", "s-"),
                                ("e2el", "median", "^-")):
        ys = [lv.stats[metric][stat] for lv in levels]
        ax_l.plot(xs, [math.nan if y is None else y for y in ys], style, label=f"{metric.upper()} {stat}")
    ax_l.set_xlabel(mode)
    ax_l.set_ylabel("ms")
    ax_l.set_yscale("log")
    ax_l.set_title("latency")
    ax_l.legend(loc="upper left")
    for ax in (ax_t, ax_l):
        if mode == "concurrency" and len(xs) > 1:  # levels double: equal steps on a log axis, plain labels
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [_num(x) for x in xs])
            ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{result.model} via {ENDPOINTS[result.endpoint]}")
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=os.path.splitext(path)[1][1:].lower())
    finally:
        plt.close(fig)


# ---------------------------------------------------------------- command

@click.command("serve")
@click.option("--url", required=True, help="Server base URL, e.g. http://127.0.0.1:8000.")
@click.option("--endpoint", type=click.Choice(sorted(ENDPOINTS)), default="chat", show_default=True,
              help="chat: /v1/chat/completions; completions: /v1/completions.")
@click.option("--served-model", "model", default=None, help="Model name of the requests (default: /v1/models).")
@click.option("--concurrency", default=None,
              help="Closed-loop levels, e.g. 1,2,4,8 (default: 1, unless only --rate is given).")
@click.option("--rate", "rates", default="", help="Poisson arrival rates in requests/s, e.g. 0.5,1,2.")
@click.option("--requests", type=int, default=16, show_default=True, help="Requests per level.")
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--prompt-words", type=int, default=48, show_default=True, help="Pseudo-words per prompt.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts and of the arrivals.")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Seconds for one request, end to end.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed requests first.")
@click.option("--goodput", multiple=True,
              help="SLOs in ms: 'ttft:500 tpot:50' (quoted, comma-separated or repeated); metrics ttft, tpot, e2el.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="Bearer token (also $OPENAI_API_KEY).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="One row per level.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Config and all levels.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Throughput and latency against the load, .png or .svg.")
@click.option("--no-probe", is_flag=True, help="Skip the capability probe (streaming usage, ignore_eos) first.")
def serve_command(url: str, endpoint: str, model: str | None, concurrency: str | None, rates: str, requests: int,
                  max_tokens: int, prompt_words: int, seed: int, timeout_s: float, warmup: int,
                  goodput: tuple[str, ...], api_key: str | None, csv_path: str | None, json_path: str | None,
                  plot: str | None, no_probe: bool) -> int:
    """Load-test an OpenAI-compatible server: closed loop at concurrency C and Poisson arrivals at rate R."""
    try:
        cfg = ServeBenchConfig(url=url, endpoint=endpoint, model=model,
                               concurrency=parse_numbers(concurrency if concurrency is not None
                                                         else "" if rates else "1", int),
                               rates=parse_numbers(rates, float),
                               requests=requests, max_tokens=max_tokens, prompt_words=prompt_words, seed=seed,
                               timeout_s=timeout_s, warmup=warmup, goodput=parse_goodput(goodput), api_key=api_key,
                               csv=csv_path, json_path=json_path, plot=plot, no_probe=no_probe)
        cfg.validate()
    except ServeBenchError as e:
        raise UsageFailure(str(e)) from None
    for flag, path in (("--csv", cfg.csv), ("--json", cfg.json_path), ("--plot", cfg.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UsageFailure(f"{flag} {path}: its directory does not exist")
    if not cfg.no_probe:
        from ds4eval.run import probe as endpoint_probe

        try:
            for line in endpoint_probe.probe_or_stop(cfg.base_url, capability_needs(cfg), cfg.model, cfg.api_key):
                click.echo(f"note: {line}", err=True)
        except (endpoint_probe.ProbeUnreachable, endpoint_probe.FeatureMissing) as e:
            raise RunFailure(str(e)) from None
    try:
        result = asyncio.run(run_serve_bench_async(cfg))
    except ServeBenchError as e:
        raise RunFailure(str(e)) from None
    click.echo(f"{result.model} via {cfg.base_url}{ENDPOINTS[cfg.endpoint]}, {cfg.requests} requests per level, "
               f"max_tokens {cfg.max_tokens}")
    click.echo(render_table(result, bool(cfg.goodput)))
    extra = failure_lines(result) + ratio_lines(result)
    if extra:
        click.echo()
        for line in extra:
            click.echo(line)
    try:
        if cfg.csv:
            write_csv(cfg.csv, CSV_COLUMNS, [lv.csv_row() for lv in result.levels])
        if cfg.json_path:
            write_json(cfg.json_path, result_json(cfg, result))
        if cfg.plot:
            write_plot(cfg.plot, result)
    except OSError as e:
        raise RunFailure(f"cannot write the output: {e.strerror or e}") from None
    for flag, path in (("csv", cfg.csv), ("json", cfg.json_path), ("plot", cfg.plot)):
        if path:
            click.echo(f"wrote {flag} {path}", err=True)
    return 0
