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
- `probe()` (called once before the first case) GETs `{base}/v1/models`: a server that cannot
  be reached or refuses the API key raises `ProbeError` with one line; the first model id it
  lists becomes `model_name` (shown in the report and traces) and the request's `model` unless
  `--served-model` is given. A server without `/v1/models` (404) is still usable.
- `capability_needs(config)`: the request features a run relies on (streaming usage always,
  `n` with --repeats, `seed` with --temp > 0 and --seed, `ignore_eos` when --request-extra
  sends it), which `create_backend` probes before the first case (`ds4eval.run.probe`).
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
It does not retry failed requests and never reaches into server internals.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx

from ds4eval.cases.extract import THINK_CLOSE, THINK_OPEN
from ds4eval.config import EvalConfig
from ds4eval.run import sse
from ds4eval.run.capabilities import Need, served_model_ids
from ds4eval.run.httperrors import error_message, reason
from ds4eval.run.latency import LatencyClock
from ds4eval.run.runner import CaseContext, GenerationJob, GenerationResult


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


class OpenAIBackend:
    name = "openai"

    def __init__(self, config: EvalConfig, transport: httpx.BaseTransport | None = None):
        self.config = config
        self.url = completions_url(config.url or "")
        self.model_name = config.served_model or "default"
        self.request_model = config.served_model or "default"
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
        """What this backend knows about the run (see ds4eval.run.provenance): the endpoint and the
        model name it sends; the server's model file and template are not visible from here."""
        return {"endpoint": self.url, "served_model": self.model_name}
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

    def probe(self) -> list[str]:
        """One GET of the model list before any case; returns the served model ids."""
        base = self.config.url or ""
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
            ids = served_model_ids(resp.json())
        except ValueError:
            return []
        if ids and not self.config.served_model:
            self.model_name = self.request_model = ids[0]
        return ids

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
        """One streaming request whose choice i belongs to jobs[i] and ctxs[i]."""
        n = len(jobs)
        started = time.perf_counter()  # the request goes out next: every choice's clock starts here
        choices = [_Choice(job.think, LatencyClock(started)) for job in jobs]
        done = False
        usage = None
        error, interrupted = "", None
        for ctx in ctxs:
            ctx.prefill(0, 0)
        try:
            with self._client.stream("POST", self.url, json=body) as resp, self._live_response(resp):
                if resp.status_code >= 400:
                    resp.read()
                    raise StreamError(f"HTTP {resp.status_code}: {error_message(resp.text)}")
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
        ended = time.perf_counter()  # the last byte read (or the failure)
        if not done and not interrupted:
            # interrupt() cut the stream while it waited for the server: a stop, not a failure.
            why = _first(ctx.checkpoint() for ctx in ctxs) if self._cut else None
            if why:
                interrupted, error = why, ""
        results = []
        for job, ch in zip(jobs, choices):
            res = ch.result()
            res.error, res.interrupted = error, interrupted
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
        return results


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
