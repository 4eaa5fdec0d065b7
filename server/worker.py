"""Job queue and the inference worker that owns the engine.

HTTP handlers run concurrently on the event loop; inference does not. Each request is
turned into a `GenerationRequest` (already rendered and tokenized, API-independent) and
submitted as a `Job`. One worker thread takes jobs in FIFO order and, for each:

1. syncs the session to the prompt ids (prefix reuse, chunked prefill; the progress hook
   emits `PrefillProgress`, the cancel hook is checked at every chunk boundary),
2. decodes token by token: sample, stop on EOS / stop sequence / token limit / context
   end, turn tokens into UTF-8-safe text, hold back possible stop-sequence prefixes,
3. emits `TextDelta` events and finally one `Finished` (or `Failed`) event.

Output splitting happens here too, when the request brings a splitter factory
(`GenerationRequest.new_splitter`, see `server.prompting.OutputSplitter`): every emitted
piece of text is fed to it in this thread, its events ride on the `TextDelta`, and its
final result on `Finished.output`. That keeps its state current token by token, which
sampling needs: while `splitter.in_structure` is True (inside tool-call syntax, outside
argument values) the next token is the argmax, otherwise it is drawn with the request's
sampling parameters.

Events reach the handler through the `sink` callable given at submission (the route
wraps `loop.call_soon_threadsafe`), so the worker never touches the event loop.

Cancellation: `Job.cancel()` may be called from any thread (disconnects do it). A queued
job is skipped; a running job stops at the next prefill chunk or decode step and the
worker records how long that took (`JobStats.cancel_latency_s`).

The session is kept between jobs so that a prompt sharing a prefix with the previous one
(multi-turn chat, agents) reuses its KV cache; `sync` reports the reused count, which the
APIs publish as cached tokens. The single-session `_acquire_session` is the seam where a
disk KV cache lookup and batched session slots plug in.

It does not parse HTTP, render prompts or know any API's field names.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from server.stops import StopMatcher

log = logging.getLogger("ds4.server.worker")


# --- requests and events -------------------------------------------------------------

@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    """Decode greedily for exactly max_tokens tokens, never stopping at EOS."""


@dataclass(frozen=True)
class GenerationRequest:
    """One API-independent unit of inference work."""
    prompt_text: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingSpec = SamplingSpec()
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None
    """None: no logprobs; k >= 0: the sampled token's logprob plus the k most likely."""
    new_splitter: Callable[[], Any] | None = field(default=None, compare=False, repr=False)
    """Builds the output splitter of this generation (None: text only). The object has
    `feed(text) -> list`, `in_structure` (bool) and `finish(engine_reason) -> output`."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class PrefillProgress:
    done: int
    total: int


@dataclass(frozen=True)
class PromptReady:
    """The prompt is in the KV cache; `n_cached` of its tokens were reused, not recomputed."""
    n_prompt: int
    n_cached: int


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    events: tuple[Any, ...] = ()
    """The splitter's events for `text` (empty without a splitter)."""


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    """'stop' (EOS or stop sequence), 'length' (token limit or context end) or 'cancelled'."""
    usage: Usage
    stop_sequence: str | None = None
    output: Any = None
    """The splitter's final result (None without a splitter, or when cancelled)."""


@dataclass(frozen=True)
class Failed:
    message: str


Event = PrefillProgress | PromptReady | TextDelta | Finished | Failed


@dataclass
class JobStats:
    job_id: int
    n_prompt: int = 0
    n_cached: int = 0
    n_generated: int = 0
    n_greedy: int = 0
    """Tokens taken by argmax because the splitter was inside tool-call structure."""
    status: str = "queued"
    queued_at: float = 0.0
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    cancel_requested_at: float | None = None
    cancel_latency_s: float | None = None
    """Time from `Job.cancel()` to the worker abandoning the job (only for running jobs)."""
    longest_prefill_chunk_s: float = 0.0
    """Longest gap between prefill progress reports: the engine's cancel granularity."""


class Job:
    """A queued request plus its cancel flag and event sink. Thread-safe to cancel."""

    def __init__(self, job_id: int, request: GenerationRequest, sink: Callable[[Event], None]) -> None:
        self.id = job_id
        self.request = request
        self._sink = sink
        self._cancel = threading.Event()
        self.stats = JobStats(job_id=self.id, queued_at=time.monotonic(),
                              n_prompt=len(request.prompt_ids))

    def cancel(self) -> None:
        if not self._cancel.is_set():
            self.stats.cancel_requested_at = time.monotonic()
            self._cancel.set()

    def is_cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, event: Event) -> None:
        try:
            self._sink(event)
        except RuntimeError:
            # The handler's event loop is gone (server shutting down): nobody listens.
            self.cancel()


# --- the worker -----------------------------------------------------------------------

@dataclass(frozen=True)
class EngineTypes:
    """The engine classes the worker needs besides the model object itself."""
    sampling_params: type
    cancelled: type[BaseException]


def default_engine_types() -> EngineTypes:
    from engine import Cancelled, SamplingParams
    return EngineTypes(sampling_params=SamplingParams, cancelled=Cancelled)


class _JobCancelled(Exception):
    pass


class InferenceWorker:
    """One thread, one engine session, jobs served first in, first out."""

    def __init__(self, model: Any, engine_types: EngineTypes | None = None, *,
                 history: int = 256) -> None:
        self.model = model
        self.types = engine_types or default_engine_types()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._job_ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._session: Any = None
        self._current: Job | None = None
        self._lock = threading.Lock()
        self.finished: deque[JobStats] = deque(maxlen=history)
        """Stats of the most recent jobs, newest last (for logs, tests and health)."""
        self._finished_cv = threading.Condition()

    # lifecycle

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="ds4-inference", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job, drop queued ones, and join the thread."""
        if self._thread is None:
            return
        with self._lock:
            if self._current is not None:
                self._current.cancel()
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                break
            if pending is not None:
                pending.cancel()
                self._finish_cancelled(pending)
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    # submission

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Job:
        job = Job(next(self._job_ids), request, sink)
        self._queue.put(job)
        return job

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None

    def wait_finished(self, job_id: int, timeout: float) -> JobStats | None:
        """Block until the job with this id has left the worker (tests and shutdown)."""
        deadline = time.monotonic() + timeout
        with self._finished_cv:
            while True:
                for stats in self.finished:
                    if stats.job_id == job_id:
                        return stats
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._finished_cv.wait(left)

    # the thread

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._current = job
            try:
                self._serve(job)
            finally:
                with self._lock:
                    self._current = None
                self._record(job)

    def _record(self, job: Job) -> None:
        stats = job.stats
        stats.finished_at = time.monotonic()
        if stats.status == "cancelled" and stats.cancel_requested_at is not None and stats.started_at:
            stats.cancel_latency_s = max(0.0, stats.finished_at - stats.cancel_requested_at)
        with self._finished_cv:
            self.finished.append(stats)
            self._finished_cv.notify_all()
        total = stats.finished_at - stats.queued_at
        extra = (f" cancel_latency={stats.cancel_latency_s * 1000:.0f}ms"
                 if stats.cancel_latency_s is not None else "")
        if stats.n_greedy:
            extra += f" greedy_in_tool_syntax={stats.n_greedy}"
        log.info("job %d %s: prompt=%d cached=%d generated=%d time=%.2fs%s", stats.job_id,
                 stats.status, stats.n_prompt, stats.n_cached, stats.n_generated, total, extra)

    def _finish_cancelled(self, job: Job) -> None:
        job.stats.status = "cancelled"
        job.emit(Finished("cancelled", Usage(job.stats.n_prompt, job.stats.n_generated,
                                             job.stats.n_cached)))

    def _acquire_session(self, job: Job) -> Any:
        if self._session is None:
            self._session = self.model.new_session()
        return self._session

    def _serve(self, job: Job) -> None:
        if job.is_cancelled():
            self._finish_cancelled(job)
            return
        job.stats.started_at = time.monotonic()
        job.stats.status = "running"
        try:
            self._generate(job)
        except (_JobCancelled, self.types.cancelled):
            self._finish_cancelled(job)
        except Exception as e:  # the worker must survive anything one request does
            if job.is_cancelled():
                self._finish_cancelled(job)
                return
            log.exception("job %d failed", job.id)
            job.stats.status = "failed"
            # The session may be half-updated; a fresh one is always consistent.
            self._session = None
            job.emit(Failed(f"inference failed: {type(e).__name__}"))

    def _generate(self, job: Job) -> None:
        req = job.request
        model = self.model
        session = self._acquire_session(job)

        # 1. prefill
        last_report = time.monotonic()

        def progress(done: int, total: int) -> None:
            nonlocal last_report
            now = time.monotonic()
            job.stats.longest_prefill_chunk_s = max(job.stats.longest_prefill_chunk_s, now - last_report)
            last_report = now
            job.emit(PrefillProgress(done, total))

        reused = session.sync(list(req.prompt_ids), progress=progress, cancel=job.is_cancelled)
        job.stats.n_cached = int(reused)
        if job.is_cancelled():
            raise _JobCancelled
        job.emit(PromptReady(len(req.prompt_ids), job.stats.n_cached))

        # 2. decode
        sp = req.sampling
        params = self.types.sampling_params(
            temperature=0.0 if sp.ignore_eos else sp.temperature,
            top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p, seed=sp.seed,
            argmax_ignoring_eos=sp.ignore_eos)
        eos_ids = frozenset(getattr(model, "eos_ids", ()) or {model.eos_id})
        room = model.n_ctx - len(req.prompt_ids)
        budget = max(0, min(req.max_tokens, room))
        stream = model.text_stream()
        stops = StopMatcher(req.stop)
        splitter = req.new_splitter() if req.new_splitter is not None else None
        finish = "length"
        pending: int | None = None
        n_gen = 0
        for _ in range(budget):
            if job.is_cancelled():
                raise _JobCancelled
            if pending is not None:
                # Evaluated lazily so the last sampled token costs no forward pass.
                session.eval(pending)
            logprob = self._logprob_entry(session, req.top_logprobs) if req.top_logprobs is not None else None
            if splitter is not None and splitter.in_structure and not sp.ignore_eos:
                token = int(torch.argmax(session.logits))
                job.stats.n_greedy += 1
            else:
                token = int(session.sample(params))
            n_gen += 1
            job.stats.n_generated = n_gen
            if job.stats.first_token_at is None:
                job.stats.first_token_at = time.monotonic()
            if token in eos_ids and not sp.ignore_eos:
                finish = "stop"
                break
            text = stops.push(stream.push(token))
            lps: tuple[TokenLogprob, ...] = ()
            if logprob is not None:
                lps = (logprob(token),)
            if text or lps:
                events = tuple(splitter.feed(text)) if splitter is not None and text else ()
                job.emit(TextDelta(text, lps, events))
            if stops.matched is not None:
                finish = "stop"
                break
            pending = token
        if stops.matched is None:
            tail = stops.push(stream.flush())
            tail += stops.flush()
            if stops.matched is not None:
                finish = "stop"
            if tail:
                job.emit(TextDelta(tail, (), tuple(splitter.feed(tail)) if splitter is not None else ()))
        output = splitter.finish(finish) if splitter is not None else None
        job.stats.status = "done"
        job.emit(Finished(finish, Usage(len(req.prompt_ids), n_gen, job.stats.n_cached),
                          stop_sequence=stops.matched, output=output))

    def _logprob_entry(self, session: Any, k: int) -> Callable[[int], TokenLogprob]:
        """Log-probabilities of the raw next-token distribution, before sampler filters."""
        logp = torch.log_softmax(session.logits.float(), dim=-1)
        top: tuple[tuple[int, str, float], ...] = ()
        if k > 0:
            values, ids = torch.topk(logp, k)
            top = tuple((int(i), self.model.detokenize([int(i)]), float(v))
                        for v, i in zip(values.tolist(), ids.tolist()))

        def entry(token: int) -> TokenLogprob:
            return TokenLogprob(token, self.model.detokenize([token]), float(logp[token]), top)
        return entry
