"""The stacks a determinism run talks to: any OpenAI-compatible endpoint, or the in-process engine.

Contract
- A target runs a *group* of `Request`s together: `generate(requests, stagger_s)` starts them
  in the order given, `stagger_s` apart, so that each joins the others while they are in
  flight, and returns, for each request, its `n` completions (`analysis.Completion`; a failed
  request gives completions with `error` set, never an exception). One request alone is the
  serial case. Completions carry the generated tokens and each token's top-2 gap where the
  stack reports log-probabilities.
- `HttpTarget(url, ...)`: the model is --served-model, else the first id the server lists
  (`ds4eval.run.probe.first_model`); a server it cannot reach raises ConnectionError with one
  line. POST /v1/chat/completions with `logprobs` and `top_logprobs: 2`,
  streaming or not as the request asks, `n` as asked, temperature and seed. `check_logprobs()`
  sends one short request first: a stack that refuses or ignores log-probabilities is then
  measured by words, and the notes say so. Requests in a group run on their own threads.
- `EngineTarget(model, slots, ...)`: the engine's own batching (`engine.batch.BatchScheduler`,
  the one ds4-server's batched sessions use) on one engine thread. A group's requests are
  submitted `stagger_steps` scheduler steps apart; the scheduler reuses the longest cached
  prefix of its slots as the server does, so the prefix condition measures the engine's
  cache. Streaming is an HTTP matter: `supports_stream` is False here.
- `describe()` says what ran (the result's `stack`). `close()` releases the client or thread.
It does not choose prompts or conditions and judges nothing (`conditions`, `analysis`).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from ds4eval.determinism.analysis import Completion
from ds4eval.run.capabilities import api_root
from ds4eval.run.probe import ProbeUnreachable, first_model
from ds4eval.run.provenance import token_pieces
from ds4eval.run.sse import DONE, StreamFault, decode_data_line

TOP_LOGPROBS = 2


@dataclass(frozen=True)
class Request:
    label: str
    system: str
    user: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = 0
    n: int = 1
    stream: bool = False

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]


class Target(Protocol):
    supports_stream: bool
    supports_n: bool

    def generate(self, requests: Sequence[Request], stagger_s: float = 0.0) -> list[list[Completion]]: ...

    def describe(self) -> dict[str, str]: ...

    def close(self) -> None: ...


def top2_gap(alternatives: Sequence[float]) -> float | None:
    """The first choice's logprob minus the second's; None with fewer than two."""
    if len(alternatives) < 2:
        return None
    first, second = sorted(alternatives, reverse=True)[:2]
    return float(first - second)


def failed(request: Request, reason: str) -> list[Completion]:
    return [Completion(_choice_label(request, i), "", None, (), "", reason) for i in range(request.n)]


def _choice_label(request: Request, i: int) -> str:
    return request.label if request.n == 1 else f"{request.label} choice {i}"


# ---------------------------------------------------------------- OpenAI-compatible HTTP


class _Choice:
    """One choice's text and tokens as they arrive (whole, or chunk by chunk)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.tokens: list[str] = []
        self.gaps: list[float | None] = []
        self.finish = ""
        self.saw_logprobs = False
        self.arrived = False

    def add(self, content: Any, logprobs: Any, finish: Any) -> None:
        self.arrived = True
        if isinstance(content, str):
            self.text.append(content)
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        if isinstance(entries, list):
            self.saw_logprobs = True
            for e in entries:
                self.tokens.append(str(e.get("token", "")))
                alts = [a.get("logprob") for a in e.get("top_logprobs") or () if isinstance(a, dict)]
                self.gaps.append(top2_gap([float(a) for a in alts if isinstance(a, (int, float))]))
        if finish:
            self.finish = str(finish)

    def completion(self, label: str, want_tokens: bool, index: int, asked: int) -> Completion:
        if not self.arrived:  # a stack that ignores `n` answers with fewer choices
            return Completion(label, "", None, (), "", f"the answer has no choice {index} ({asked} asked for)")
        tokens = tuple(self.tokens) if want_tokens and self.saw_logprobs else None
        return Completion(label, "".join(self.text), tokens, tuple(self.gaps) if tokens is not None else (),
                          self.finish)


class HttpTarget:
    supports_stream = True
    supports_n = True

    def __init__(self, url: str, *, api_key: str | None = None, served_model: str | None = None,
                 timeout_s: float = 600.0, transport: Any = None):
        import httpx

        self.url = api_root(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                   transport=transport, limits=httpx.Limits(max_connections=64))
        try:
            self.served_model = served_model or first_model(self.client, self.url, time.monotonic() + 30) \
                or "default"
        except ProbeUnreachable as e:
            self.client.close()
            raise ConnectionError(str(e)) from None
        self.logprobs = True

    def describe(self) -> dict[str, str]:
        return {"backend": "openai", "url": self.url, "served_model": self.served_model}

    def check_logprobs(self) -> str | None:
        """Send one short request with log-probabilities; None when they came back, else why not
        (and every later request goes without them)."""
        probe = Request("probe", "You are a helpful assistant.", "Say hello.", max_tokens=2)
        body = self._body(probe)
        try:
            r = self.client.post("/v1/chat/completions", json=body)
        except Exception as e:
            if _is_transport_error(e):
                raise ConnectionError(f"cannot reach the server at {self.url}: {e}") from None
            raise
        if r.status_code >= 400:
            self.logprobs = False
            again = self.client.post("/v1/chat/completions", json=self._body(probe))
            if again.status_code >= 400:
                raise ConnectionError(f"the server at {self.url}: a plain chat request failed with HTTP "
                                      f"{again.status_code}: {again.text[:160]}")
            return f"the endpoint refused log-probabilities (HTTP {r.status_code}): completions compared by word"
        choices = r.json().get("choices") or [{}]
        if not isinstance((choices[0].get("logprobs") or {}).get("content"), list):
            self.logprobs = False
            return "the endpoint returned no log-probabilities: completions compared by word, gaps unknown"
        return None

    def _body(self, request: Request) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.served_model, "messages": request.messages(),
                                "max_tokens": request.max_tokens, "temperature": request.temperature,
                                "stream": request.stream}
        if request.seed is not None:
            body["seed"] = request.seed
        if request.n != 1:
            body["n"] = request.n
        if self.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = TOP_LOGPROBS
        return body

    def generate(self, requests: Sequence[Request], stagger_s: float = 0.0) -> list[list[Completion]]:
        if len(requests) == 1:
            return [self._one(requests[0])]
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            futures = []
            for k, req in enumerate(requests):
                if k and stagger_s > 0:
                    time.sleep(stagger_s)
                futures.append(pool.submit(self._one, req))
            return [f.result() for f in futures]

    def _one(self, request: Request) -> list[Completion]:
        try:
            return self._stream(request) if request.stream else self._whole(request)
        except Exception as e:
            if _is_transport_error(e) or isinstance(e, (StreamFault, ValueError, KeyError, TypeError)):
                return failed(request, f"{type(e).__name__}: {str(e)[:160]}")
            raise

    def _whole(self, request: Request) -> list[Completion]:
        r = self.client.post("/v1/chat/completions", json=self._body(request))
        if r.status_code >= 400:
            return failed(request, f"HTTP {r.status_code}: {r.text[:160]}")
        choices = {i: _Choice() for i in range(request.n)}
        for c in r.json().get("choices") or ():
            msg = c.get("message") or {}
            choice = choices.setdefault(int(c.get("index", 0)), _Choice())
            choice.add((msg.get("reasoning_content") or "") + (msg.get("content") or ""), c.get("logprobs"),
                       c.get("finish_reason"))
        return [choices[i].completion(_choice_label(request, i), self.logprobs, i, request.n) for i in sorted(choices)]

    def _stream(self, request: Request) -> list[Completion]:
        choices = {i: _Choice() for i in range(request.n)}
        with self.client.stream("POST", "/v1/chat/completions", json=self._body(request)) as r:
            if r.status_code >= 400:
                return failed(request, f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:160]}")
            for line in r.iter_lines():
                obj = decode_data_line(line)
                if obj is None:
                    continue
                if obj == DONE:
                    break
                for c in obj.get("choices") or ():
                    delta = c.get("delta") or {}
                    choice = choices.setdefault(int(c.get("index", 0)), _Choice())
                    choice.add((delta.get("reasoning_content") or "") + (delta.get("content") or ""),
                               c.get("logprobs"), c.get("finish_reason"))
        return [choices[i].completion(_choice_label(request, i), self.logprobs, i, request.n) for i in sorted(choices)]

    def close(self) -> None:
        self.client.close()


def _is_transport_error(e: BaseException) -> bool:
    import httpx

    return isinstance(e, (httpx.TransportError, httpx.StreamError, OSError, json.JSONDecodeError))


# ---------------------------------------------------------------- the in-process engine


class EngineTarget:
    supports_stream = False
    supports_n = True

    def __init__(self, model: Any, slots: int, engine_thread: Any, *, stagger_steps: int = 3,
                 own_thread: bool = False):
        """`model` was loaded on `engine_thread`, where every engine call runs; `slots` is the
        scheduler's session count (the most requests that decode together)."""
        from engine.batch import BatchScheduler

        self.model, self.thread, self.stagger_steps = model, engine_thread, stagger_steps
        self._owns_thread = own_thread
        self.scheduler = engine_thread.call(BatchScheduler, model, slots)
        self._lock = threading.Lock()

    @classmethod
    def load(cls, model_path: str | None, slots: int, *, ctx: int | None = None, device: str = "cpu",
             kv_type: str | None = None, threads: int | None = None,
             batch_invariant: bool = False) -> "EngineTarget":
        import engine
        from engine.threads import EngineThread

        thread = EngineThread("ds4eval-determinism", threads=threads)
        try:
            model = thread.call(engine.load_model, model_path, ctx=ctx, device=device, kv_type=kv_type,
                                batch_invariant=batch_invariant)
            return cls(model, slots, thread, own_thread=True)
        except BaseException:
            thread.close()
            raise

    def describe(self) -> dict[str, str]:
        m = self.model
        device = ":".join(x for x in (str(getattr(m, "device", "") or ""),
                                      getattr(m, "cpu_kernel_path", None) or "") if x)
        return {"backend": "engine", "model": str(getattr(m, "path", "") or m.name), "device": device,
                "kv_type": str(getattr(m, "kv_dtype", "") or "").removeprefix("torch."),
                "slots": str(self.scheduler.n_slots)}

    def prompt_ids(self, request: Request) -> list[int]:
        text = self.model.render_prompt(request.messages(), add_generation_prompt=True)
        return self.model.prompt_ids(self.model.tokenize_prompt(text))

    def generate(self, requests: Sequence[Request], stagger_s: float = 0.0) -> list[list[Completion]]:
        with self._lock:
            return self.thread.call(self._run_group, list(requests))

    def _run_group(self, requests: list[Request]) -> list[list[Completion]]:
        import torch

        from engine.batch import GenRequest
        from engine.sampling import Sampler, SamplingParams

        pending: list[tuple[int, Request, int, GenRequest, list[float | None]]] = []
        for j, req in enumerate(requests):
            ids = self.prompt_ids(req)
            for i in range(req.n):
                params = SamplingParams(temperature=req.temperature, seed=None if req.seed is None else req.seed + i)
                sampler = Sampler(params, self.model.eos_ids)
                gaps: list[float | None] = []

                def choose(logits: Any, sampler=sampler, gaps=gaps) -> int:
                    row = logits.host() if hasattr(logits, "host") else logits
                    top = torch.topk(row.float().reshape(-1), 2).values
                    gaps.append(float(top[0] - top[1]))
                    return sampler(logits)

                pending.append((j, req, i, GenRequest(ids=list(ids), params=params, max_tokens=req.max_tokens,
                                                   choose=choose), gaps))
        steps = 0
        for k, (_, _, _, gen, _) in enumerate(pending):
            while steps < k * self.stagger_steps and self.scheduler.step():
                steps += 1
            self.scheduler.submit(gen)
        self.scheduler.run()
        out: list[list[Completion]] = [[] for _ in requests]
        for j, req, i, gen, gaps in pending:
            label = _choice_label(req, i)
            if gen.finish == "error":
                comp = Completion(label, "", None, (), "error", gen.error or "engine error")
            else:
                eos = self.model.eos_ids
                ids = [t for t in gen.output if t not in eos]
                pieces = token_pieces(self.model, ids)
                comp = Completion(label, "".join(pieces), tuple(pieces), tuple(gaps[:len(ids)]), gen.finish or "")
            out[j].append(comp)
        return out

    def close(self) -> None:
        if self._owns_thread:
            self.thread.close(timeout=30)

