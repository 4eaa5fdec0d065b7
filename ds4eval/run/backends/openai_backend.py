"""OpenAI-compatible backend: streams chat completions from any server over HTTP (httpx).

Contract
- POSTs `{url}/v1/chat/completions` (or `{url}/chat/completions` when the URL already ends in
  `/v1`) with `stream: true` and `stream_options.include_usage`, a system and a user message,
  `max_tokens` = the job's budget (capped by `--ctx` minus the prompt estimate when given), the
  sampling settings, and `seed` when set. With `--nothink` it also sends
  `chat_template_kwargs: {"enable_thinking": false}`, which vLLM, llama.cpp and ds4-server read;
  `--chat-template-kwargs` objects are merged over that, and `--request-extra` is merged into
  the body last (its keys win: it exists to override server defaults such as llama.cpp's
  repeat_penalty 1.1).
- Endpoints: every --url (and every line of --url-file, `ds4eval.run.endpoints.configured_urls`)
  is one endpoint; an `EndpointPool` sends each request to the one with the fewest in flight
  (--concurrency stays the run's total), and each result names the endpoint that served it
  (`GenerationResult.endpoint`, the trace's `endpoint`).
- `probe(needs)` (called once before the first case) probes every endpoint at once: it GETs
  `{base}/v1/models` (a server that cannot be reached or refuses the API key fails with one
  line; one without a model list, 404, is still usable), then, unless --no-probe, the features
  in `needs` (`ds4eval.run.probe`), and with several endpoints their chat templates where
  exposed. `ds4eval.run.probe.settle` decides: endpoints that do not answer are left out with a
  note, and a mixed set (models, templates, findings) raises `ProbeError` with one line per
  difference unless --allow-mixed-endpoints. The first model id of the first endpoint becomes
  `model_name` (shown in the report and traces), and each endpoint's own first id the `model`
  it is sent, unless `--served-model` is given. It returns the notes to print.
- `capability_needs(config)`: the request features a run relies on (streaming usage always,
  `n` with --repeats, `seed` with --temp > 0 and --seed, `ignore_eos` when --request-extra
  sends it), which `probe` checks before the first case.
- Failover: a request that fails for its endpoint's sake (a connection error, a timeout before
  any text, HTTP 5xx or 429) goes again to another endpoint where there is one, after a short
  jittered backoff or the server's Retry-After (`EndpointPool.retry_delay`), at most
  `max_failures` + (endpoints) attempts in all. A retried request starts from scratch: the text
  of the failed attempt is dropped from the result, so nothing is graded twice. Other failures
  (4xx, error events, broken JSON, a stream that ends without [DONE]) end the case ERROR as
  before: another endpoint would answer them the same. With no endpoint left in
  rotation the request waits while the pool re-probes; once the pool gives up (--endpoint-wait)
  every case not yet answered ends STOPPED, with the reason as its error, for `ds4-eval retry`.
- Reasoning deltas (`reasoning_content` or `reasoning`) are recorded inside `<think>...</think>`
  so the trace and the extractors see the same shape as the engine backend's output.
- A stream counts as complete only with a finish reason and `[DONE]`; an HTTP error, an error
  event, broken JSON or a stream that ends early make the case ERROR with the reason.
  Token counts come from the final usage chunk; without one they are counted with
  `--tokenizer`'s tokenizer (`ds4eval.run.tokencount`), else reported unknown (`tokens_known`
  False), never as the number of stream chunks (a chunk may hold several tokens).
- Latency (`ds4eval.run.latency`): each result's clock starts as the request goes out; every
  chunk that carries reasoning or content text is an arrival (TTFT is the first), the end is
  the last byte read. The mean inter-token gap is per token when the result's token count is
  known (usage, `--tokenizer`), else per chunk; with `n` > 1 the choices share the start and
  the end and each has its own arrivals.
- `run_group(jobs, ctxs)` runs the repeats of one case (`--repeats`) as one request with `n`
  (the choices demultiplexed by index); the first 4xx answer to `n` > 1 switches the backend to
  one request per repeat for the rest of the run. With `n` > 1 a server's usage is one total, so
  per-repeat token counts come from `--tokenizer` or are unknown.
- Thread-safe: one `httpx.Client` shared by `--concurrency` workers. `interrupt()` (the
  runner's stop) wakes cases blocked waiting for stream data; they end STOPPED.
It never reaches into server internals.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import httpx

from ds4eval.cases.extract import THINK_CLOSE, THINK_OPEN
from ds4eval.config import EvalConfig
from ds4eval.run import probe as endpoint_probe
from ds4eval.run import sse
from ds4eval.run.capabilities import Need, api_root, served_model_ids
from ds4eval.run.endpoints import POLL_S, EndpointPool, EndpointStats, PoolPolicy, retry_after_seconds
from ds4eval.run.httperrors import error_message, reason
from ds4eval.run.latency import LatencyClock
from ds4eval.run.runner import CaseContext, GenerationJob, GenerationResult

REPROBE_TIMEOUT_S = 5.0  # a re-probe of an endpoint out of rotation: one GET of its model list
PROBE_THREADS = 32       # endpoints probed at once before a run


def models_url(base: str) -> str:
    base = base.rstrip("/")
    for tail in ("/chat/completions", "/completions"):
        if base.endswith(tail):
            base = base[: -len(tail)]
            break
    return base + "/models" if base.endswith("/v1") else base + "/v1/models"


class ProbeError(Exception):
    pass


def capability_needs(config: EvalConfig) -> list[Need]:
    """The request features a run of this backend relies on (`ds4eval.run.capabilities`)."""
    needs = [Need("streaming usage", config.tokenizer is None,
                  "for token counts (without usage, --tokenizer GGUF counts them)")]
    if config.repeats > 1:
        needs.append(Need("n", False, "to send the repeats of a case as one request (else one request per repeat)"))
    if config.temperature > 0 and config.seed is not None:
        needs.append(Need("seed", True, "for reproducible sampling with --temp > 0 and --seed"))
    if config.request_extra_fields().get("ignore_eos"):
        needs.append(Need("ignore_eos", True, "by --request-extra"))
    return needs


def completions_url(base: str) -> str:
    base = base.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + "/v1/chat/completions"


class StreamError(Exception):
    pass


@dataclass
class _Attempt:
    """One request to one endpoint: its results, and why it failed for the endpoint's sake ("" when
    it did not: it succeeded, was stopped, or failed for a reason another endpoint would share)."""

    results: list[GenerationResult]
    failure: str = ""
    retry_after_s: float | None = None


class OpenAIBackend:
    name = "openai"

    def __init__(self, config: EvalConfig, transport: httpx.BaseTransport | None = None, *,
                 urls: Sequence[str] | None = None, note=lambda line: None, policy: PoolPolicy | None = None):
        self.config = config
        self.urls = list(config.urls if urls is None else urls) or [""]
        self.model_name = config.served_model or "default"
        self.request_model = config.served_model or "default"
        self._models: dict[str, str] = {}  # an endpoint's own model name, where it differs (mixed sets)
        self._note = note
        self._policy = policy or PoolPolicy(wait_s=config.endpoint_wait_s)
        self.pool = EndpointPool(self.urls, self._policy, note=note)
        self.extra = config.request_extra_fields()
        self.template_kwargs = config.template_kwargs()
        self._live: set[httpx.Response] = set()
        self._live_lock = threading.Lock()
        self._cut = False
        self.counter = None
        if config.tokenizer:
            from ds4eval.run.tokencount import TokenCounter

            self.counter = TokenCounter.from_gguf(config.tokenizer)
        self.n_supported: bool | None = None  # whether the server takes n > 1; None until tried
        self.n_ctx = config.ctx
        self.max_concurrency = max(1, config.concurrency)
        headers = {"Accept": "text/event-stream"}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        self._client = httpx.Client(
            headers=headers, transport=transport,
            timeout=httpx.Timeout(connect=30.0, read=config.request_timeout_s, write=30.0, pool=None))

    def close(self) -> None:
        self._client.close()

    def provenance(self) -> dict[str, str]:
        """What this backend knows about the run (see ds4eval.run.provenance): the endpoint (the
        endpoints, space-separated, when there are several; each trace record names its own) and
        the model name it sends; the server's model file and template are not visible from here."""
        return {"endpoint": " ".join(completions_url(u) for u in self.urls), "served_model": self.model_name}

    def endpoint_stats(self) -> list[EndpointStats]:
        """Per endpoint: requests, failures, removals, whether it is out of rotation now."""
        return self.pool.stats()

    @contextlib.contextmanager
    def _live_response(self, resp: httpx.Response):
        with self._live_lock:
            self._live.add(resp)
        try:
            yield
        finally:
            with self._live_lock:
                self._live.discard(resp)

    def interrupt(self) -> None:
        """Wake every case blocked waiting for stream data (the runner calls this on stop): a
        server that sends nothing for a while (a long prefill without keep-alives) would
        otherwise hold the stop until --request-timeout. Shutting the socket down wakes the
        blocked read; closing it would not."""
        with self._live_lock:
            live = list(self._live)
            self._cut = self._cut or bool(live)
        for resp in live:
            stream = resp.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed

    def probe(self, needs: Sequence[Need] = ()) -> list[str]:
        """Probe every endpoint before any case, all at once (see the module docstring); returns
        the notes to print, ProbeError with the lines to stop with."""
        several = len(self.urls) > 1
        with ThreadPoolExecutor(max_workers=min(len(self.urls), PROBE_THREADS),
                                thread_name_prefix="ds4eval-probe") as pool:
            checks = list(pool.map(lambda url: self._check(url, needs, several), self.urls))
        settled = endpoint_probe.settle(checks, self.config.allow_mixed_endpoints)
        if settled.error:
            raise ProbeError("\n".join(settled.error))
        self.urls = [c.url for c in settled.usable]
        self.pool = EndpointPool(self.urls, self._policy, note=self._note)
        if not self.config.served_model:
            first = [c.models[0] if c.models else "default" for c in settled.usable]
            self.model_name = self.request_model = first[0]
            self._models = {c.url: m for c, m in zip(settled.usable, first) if m != first[0]}
        return list(settled.notes)

    def _check(self, url: str, needs: Sequence[Need], several: bool) -> endpoint_probe.EndpointCheck:
        try:
            ids = self._model_ids(url)
        except ProbeError as e:
            return endpoint_probe.EndpointCheck(url, error=str(e))
        template = endpoint_probe.template_sha256(self._client, api_root(url)) if several else ""
        if self.config.no_probe or not needs:
            return endpoint_probe.EndpointCheck(url, models=tuple(ids), template_sha256=template)
        model = self.config.served_model or (ids[0] if ids else "default")
        try:
            verdict = endpoint_probe.judge_needs(url, needs, model, self.config.api_key)
        except endpoint_probe.ProbeUnreachable as e:
            return endpoint_probe.EndpointCheck(url, error=str(e))
        return endpoint_probe.EndpointCheck(url, models=tuple(ids), template_sha256=template,
                                            findings=verdict.findings, stop=verdict.stop, notes=verdict.notes)

    def _model_ids(self, base: str) -> list[str]:
        """One GET of the model list of the endpoint at `base`: its model ids ([] when it has no
        list); ProbeError (one line) when it cannot be reached or refuses the API key."""
        try:
            resp = self._client.get(models_url(base), headers={"Accept": "application/json"},
                                    timeout=httpx.Timeout(30.0))
        except httpx.HTTPError as e:
            raise ProbeError(f"cannot reach the server at {base}: {reason(e)}") from None
        if resp.status_code in (401, 403):
            raise ProbeError(f"the server at {base} refused the request (HTTP {resp.status_code}: "
                             f"{error_message(resp.text)}); check --api-key")
        if resp.status_code >= 400:
            return []  # reachable; some servers have no model list
        try:
            return served_model_ids(resp.json())
        except ValueError:
            return []

    def _answers(self, base: str) -> bool:
        """The re-probe of an endpoint out of rotation: does its model list answer at all (any
        status below 500: a server without a list, or one refusing the key, is up)?"""
        try:
            resp = self._client.get(models_url(base), headers={"Accept": "application/json"},
                                    timeout=httpx.Timeout(REPROBE_TIMEOUT_S))
        except httpx.HTTPError:
            return False
        return resp.status_code < 500

    def request_body(self, job: GenerationJob) -> dict:
        max_tokens = job.max_tokens
        if self.n_ctx:
            # Without the server's tokenizer, assume 3 characters per token: that overestimates
            # the prompt of typical text, so the request stays within --ctx.
            est = (len(job.system_prompt) + len(job.question_prompt)) // 3 + 16
            max_tokens = max(1, min(max_tokens, self.n_ctx - est))
        body = {
            "model": self.request_model,
            "messages": [{"role": "system", "content": job.system_prompt},
                         {"role": "user", "content": job.question_prompt}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "temperature": job.temperature,
            "top_p": job.top_p,
        }
        if job.min_p:
            body["min_p"] = job.min_p
        if job.seed is not None:
            body["seed"] = job.seed
        kwargs = {} if job.think else {"enable_thinking": False}
        kwargs.update(self.template_kwargs)
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        for key, value in self.extra.items():
            if key == "chat_template_kwargs" and isinstance(value, dict):
                body[key] = {**body.get(key, {}), **value}
            else:
                body[key] = value
        return body

    def run_case(self, job: GenerationJob, ctx: CaseContext) -> GenerationResult:
        return self._stream(self.request_body(job), [job], [ctx])[0]

    def run_group(self, jobs: list[GenerationJob], ctxs: list[CaseContext]) -> list[GenerationResult]:
        """Repeats of one case in one request with `n` = len(jobs) (the first job's seed; a
        server such as ds4-server gives sequence i the seed + i, as K requests would have). A
        server that refuses `n` > 1 (a 4xx) is asked once per repeat from then on."""
        if len(jobs) == 1 or self.n_supported is False:
            return [self.run_case(j, c) for j, c in zip(jobs, ctxs)]
        body = self.request_body(jobs[0])
        body["n"] = len(jobs)
        results = self._stream(body, jobs, ctxs)
        refused = results[0].error.startswith("HTTP 4") and not any(r.output for r in results)
        if refused and self.n_supported is None:
            self.n_supported = False
            return [self.run_case(j, c) for j, c in zip(jobs, ctxs)]
        if not results[0].error:
            self.n_supported = True
        return results

    def _stream(self, body: dict, jobs: list[GenerationJob], ctxs: list[CaseContext]) -> list[GenerationResult]:
        """One streaming request whose choice i belongs to jobs[i] and ctxs[i], sent to the pool's
        choice of endpoint and, when it fails for that endpoint's sake, to another (see Failover in
        the module docstring)."""
        tried: list[str] = []
        attempt: _Attempt | None = None

        def stop_reason() -> str | None:  # a stop or a switch of the case; sticky once set
            return _first(ctx.checkpoint() for ctx in ctxs)

        for n_attempt in range(self._policy.max_failures + len(self.urls)):
            if attempt is not None:
                if any(r.output for r in attempt.results):
                    for ctx in ctxs:  # the live view only: the result holds the new attempt's text alone
                        ctx.text(f"\n[{attempt.failure}: starting again]\n", False)
                why = self._wait(self.pool.retry_delay(n_attempt - 1, attempt.retry_after_s), stop_reason)
                if why:
                    return _unsent(jobs, why, "")
            endpoint = self.pool.take(self._answers, lambda: stop_reason() is not None, avoid=tried)
            if endpoint is None:
                why = stop_reason()
                if why:
                    return _unsent(jobs, why, "")
                last = f"{attempt.failure}; " if attempt is not None else ""
                return _unsent(jobs, "stop", f"{last}no endpoint has answered for {self._policy.wait_s:g} s")
            current = None
            try:
                current = self._attempt(endpoint.url, body, jobs, ctxs)
            finally:  # an exception of ours is no fault of the endpoint's
                self.pool.release(endpoint, ok=current is None or not current.failure,
                                  reason=current.failure if current is not None else "")
            attempt = current
            if not attempt.failure:
                return attempt.results
            tried.append(endpoint.url)
        return attempt.results  # out of attempts: the last failure is the case's error

    def _wait(self, seconds: float, stop_reason) -> str | None:
        """Sleep `seconds` in short steps; the case's stop or switch as soon as there is one."""
        left = seconds
        while left > 0:
            why = stop_reason()
            if why:
                return why
            step = min(POLL_S, left)
            self.pool.sleep(step)
            left -= step
        return stop_reason()

    def _attempt(self, base: str, body: dict, jobs: list[GenerationJob], ctxs: list[CaseContext]) -> _Attempt:
        """The request to the endpoint at `base`."""
        n = len(jobs)
        if base in self._models:
            body = {**body, "model": self._models[base]}
        started = time.perf_counter()  # the request goes out next: every choice's clock starts here
        choices = [_Choice(job.think, LatencyClock(started)) for job in jobs]
        done = False
        usage = None
        error, interrupted = "", None
        failure, retry_after = "", None
        for ctx in ctxs:
            ctx.prefill(0, 0)
        try:
            with self._client.stream("POST", completions_url(base), json=body) as resp, self._live_response(resp):
                if resp.status_code >= 400:
                    resp.read()
                    error = f"HTTP {resp.status_code}: {error_message(resp.text)}"
                    if resp.status_code >= 500 or resp.status_code == 429:
                        failure = error
                        retry_after = retry_after_seconds(resp.headers.get("retry-after"))
                    raise StreamError(error)
                for line in resp.iter_lines():
                    interrupted = _first(ctx.checkpoint() for ctx in ctxs)
                    if interrupted:
                        break
                    try:
                        obj = sse.decode_data_line(line)
                    except sse.StreamFault as e:
                        raise StreamError(str(e)) from None
                    if obj is None:
                        continue  # SSE comments, event names and keep-alives
                    if obj == sse.DONE:
                        done = True
                        break
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for choice in obj.get("choices") or []:
                        i = choice.get("index", 0)
                        if not isinstance(i, int) or not 0 <= i < n:
                            raise StreamError(f"choice index {i!r} outside the {n} asked for")
                        choices[i].add(choice, ctxs[i])
        except StreamError as e:
            error = str(e)
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}"
            # The endpoint's fault: it cannot be reached, broke the connection, or sent nothing in
            # time. A timeout after text came is the case's own (a long answer), not the endpoint's.
            timed_out_with_text = isinstance(e, httpx.TimeoutException) and any(ch.started for ch in choices)
            if isinstance(e, httpx.TransportError) and not timed_out_with_text:
                failure = f"{type(e).__name__}: {reason(e)}"
        ended = time.perf_counter()  # the last byte read (or the failure)
        if not done and not interrupted:
            # interrupt() cut the stream while it waited for the server: a stop, not a failure.
            why = _first(ctx.checkpoint() for ctx in ctxs) if self._cut else None
            if why:
                interrupted, error, failure = why, "", ""
        results = []
        for job, ch in zip(jobs, choices):
            res = ch.result()
            res.error, res.interrupted = error, interrupted
            res.endpoint = completions_url(base)
            if self.counter is not None:  # the prompt's ids as the model's template renders them
                res.prompt = self.counter.rendered_prompt(job.system_prompt, job.question_prompt)
            if usage and n == 1:
                res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                res.gen_tokens = int(usage.get("completion_tokens") or 0)
            elif self.counter is not None:
                res.prompt_tokens = self.counter.prompt_tokens(job.system_prompt, job.question_prompt)
                res.gen_tokens = self.counter.output_tokens(res.output)
            elif usage:
                # Usage of n choices is one total: the prompt is known, each choice's share is not.
                res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                res.tokens_known = False
            else:
                res.tokens_known = False
            # Per token when the count is known; with n choices and one usage total it is not.
            res.latency = ch.clock.finish(res.gen_tokens if res.tokens_known else None, ended)
            if not res.error and not res.interrupted:
                if not done:
                    res.error = "stream ended without [DONE]"
                elif ch.finish is None:
                    res.error = "stream ended without a finish reason"
            results.append(res)
        return _Attempt(results, failure, retry_after)


def _unsent(jobs: list[GenerationJob], interrupted: str, error: str) -> list[GenerationResult]:
    """The results of a request no endpoint answered: stopped (a stop, a switch, or a pool that
    gave up, `error` saying why), with no text, so nothing of a failed attempt is graded."""
    return [GenerationResult(thinking=job.think, interrupted=interrupted, error=error) for job in jobs]


def _first(values):
    return next((v for v in values if v), None)


class _Choice:
    """What one choice of a stream has said so far."""

    def __init__(self, think: bool, clock: LatencyClock):
        self.think = think
        self.clock = clock
        self.out: list[str] = []
        self.in_think = self.saw_think = self.started = False
        self.finish = None

    def add(self, choice: dict, ctx: CaseContext) -> None:
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        content = delta.get("content")
        if reasoning or content:
            self.clock.arrival()  # first thing: the text's own handling must not delay the mark
        if (reasoning or content) and not self.started:
            self.started = True
            ctx.started(0)
        if reasoning:
            if not self.in_think:
                self.in_think = self.saw_think = True
                self.out.append(THINK_OPEN)
                ctx.text(THINK_OPEN, True)
            self.out.append(reasoning)
            ctx.text(reasoning, True)
        if content:
            if self.in_think:
                self.in_think = False
                self.out.append(THINK_CLOSE)
                ctx.text(THINK_CLOSE, True)
            self.out.append(content)
            ctx.text(content, False)
        if reasoning or content:
            ctx.token()  # live progress only: a chunk may hold several tokens
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]

    def result(self) -> GenerationResult:
        res = GenerationResult(thinking=self.think)
        # A block left open stays balanced in the output; think_close says it never closed.
        res.output = "".join(self.out) + (THINK_CLOSE if self.in_think else "")
        if self.saw_think:
            res.think_close = "unclosed" if self.in_think else "natural"
        return res
