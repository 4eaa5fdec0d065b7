"""Job queue and the inference worker that owns the engine.

HTTP handlers run concurrently on the event loop; inference does not. Each request is
turned into a `GenerationRequest` (already rendered and tokenized, API-independent) and
submitted as a `Job`. One worker thread takes jobs in FIFO order and, for each:

1. brings the session to the prompt ids (prefix reuse, disk cache restore, chunked
   prefill; the progress hook emits `PrefillProgress`, the cancel hook is checked at every
   chunk boundary),
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
(multi-turn chat, agents) reuses its KV cache; the reused count is published by the APIs as
cached tokens.

Disk KV cache (`kv`, a `server.kvstore.KVStore`, or None): before a job replaces the live
session, the worker stores it (reason evict) when the policy wants it; the prefill goes
through `server.kvstore.prefill_with_cache`, which restores the longest checkpoint on disk
and stores cold / continued checkpoints on the way; when the thread receives its stop
sentinel it stores the live session (reason shutdown) before it returns, so a clean exit
of the server keeps the last conversation. Cached tokens then count what was restored from
disk too, and `Usage.cache_written_tokens` the prompt tokens newly covered by a checkpoint.
All of it runs on the worker thread, the only one that touches sessions.

The worker thread is an `engine.threads.EngineThread`: the one the model was loaded on
(`ds4-server` loads it there), so that torch keeps a single OpenMP pool and its fast waits
(engine/threads.py says why). The worker's loop is a task that owns that thread from
`start()` to `stop()`.

With `n_slots > 1` the thread runs `server.batching.BatchedLoop` instead of one job at a
time: several resident sessions decode together (see that module).

It does not parse HTTP, render prompts or know any API's field names.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.threads import EngineThread
from server import kvstore_policy
from server.kvstore import KVStore, prefill_with_cache, save_session
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
    user_boundary: int | None = None
    """Character offset in `prompt_text` where the last user turn starts (disk cache checkpoint)."""
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
    """Prompt tokens not recomputed: kept from a resident session or restored from disk."""
    cache_written_tokens: int = 0
    """Prompt tokens newly stored in a disk checkpoint by this request."""

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
    n_written: int = 0


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
    n_written: int = 0
    """Prompt tokens newly covered by a disk checkpoint."""
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
    slot: int | None = None
    """The resident session that served the job (batched mode)."""

    def usage(self) -> Usage:
        return Usage(self.n_prompt, self.n_generated, self.n_cached, self.n_written)


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


def sampling_params(types: EngineTypes, sp: SamplingSpec) -> Any:
    """The engine's sampling parameters for a request (ignore_eos: greedy, EOS masked)."""
    return types.sampling_params(temperature=0.0 if sp.ignore_eos else sp.temperature,
                                 top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p, seed=sp.seed,
                                 argmax_ignoring_eos=sp.ignore_eos)


def decode_budget(model: Any, req: GenerationRequest, n_prompt: int) -> int:
    return max(0, min(req.max_tokens, model.n_ctx - n_prompt))


def common_prefix(a: Any, b: Any) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TokenDecoder:
    """What happens to each generated token of one job, whoever runs the forward passes.

    `choose(logits, sample)` picks the next token: the argmax while the splitter is inside
    tool-call structure, else `sample(logits)`; it records the logprob entry when asked for.
    `accept(token)` turns it into text (UTF-8 safe, stop sequences held back), feeds the
    splitter and emits a `TextDelta`; it returns False once the generation is over (EOS or
    a stop sequence). `finish(reason)` flushes and emits `Finished`. Used by the one-session
    loop below and by the batched loop (`server.batching`), on the worker thread only.
    """

    def __init__(self, model: Any, job: Job) -> None:
        req = job.request
        self.model = model
        self.job = job
        self.ignore_eos = req.sampling.ignore_eos
        self.eos_ids = frozenset(getattr(model, "eos_ids", ()) or {model.eos_id})
        self.stream = model.text_stream()
        self.stops = StopMatcher(req.stop)
        self.splitter = req.new_splitter() if req.new_splitter is not None else None
        self.top_logprobs = req.top_logprobs
        self.reason: str | None = None
        """Set once the generation ended by itself: 'stop' (EOS or stop sequence)."""
        self._logprob: Callable[[int], TokenLogprob] | None = None

    @property
    def done(self) -> bool:
        return self.reason is not None

    def choose(self, logits: torch.Tensor, sample: Callable[[torch.Tensor], int]) -> int:
        if self.top_logprobs is not None:
            self._logprob = logprob_entry(self.model, logits, self.top_logprobs)
        if self.splitter is not None and self.splitter.in_structure and not self.ignore_eos:
            self.job.stats.n_greedy += 1
            return int(torch.argmax(logits))
        return int(sample(logits))

    def accept(self, token: int) -> bool:
        stats = self.job.stats
        stats.n_generated += 1
        if stats.first_token_at is None:
            stats.first_token_at = time.monotonic()
        if token in self.eos_ids and not self.ignore_eos:
            self.reason = "stop"
            return False
        text = self.stops.push(self.stream.push(token))
        lps = (self._logprob(token),) if self._logprob is not None else ()
        if text or lps:
            events = tuple(self.splitter.feed(text)) if self.splitter is not None and text else ()
            self.job.emit(TextDelta(text, lps, events))
        if self.stops.matched is not None:
            self.reason = "stop"
            return False
        return True

    def finish(self, reason: str) -> None:
        """Emit the held-back tail and `Finished`; `reason` is 'length' unless the job stopped itself."""
        finish = self.reason or reason
        if self.stops.matched is None:
            tail = self.stops.push(self.stream.flush())
            tail += self.stops.flush()
            if self.stops.matched is not None:
                finish = "stop"
            if tail:
                self.job.emit(TextDelta(tail, (), tuple(self.splitter.feed(tail)) if self.splitter is not None else ()))
        output = self.splitter.finish(finish) if self.splitter is not None else None
        self.job.stats.status = "done"
        self.job.emit(Finished(finish, self.job.stats.usage(), stop_sequence=self.stops.matched, output=output))


def logprob_entry(model: Any, logits: torch.Tensor, k: int) -> Callable[[int], TokenLogprob]:
    """Log-probabilities of the raw next-token distribution, before sampler filters."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, str, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(logp, k)
        top = tuple((int(i), model.detokenize([int(i)]), float(v))
                    for v, i in zip(values.tolist(), ids.tolist()))

    def entry(token: int) -> TokenLogprob:
        return TokenLogprob(token, model.detokenize([token]), float(logp[token]), top)
    return entry


def written_tokens(n_on_disk: int, n_reused: int, n_saved: int) -> int:
    """Prompt tokens that a prefill newly put on disk (checkpoints overlap: count the frontier)."""
    return max(0, n_on_disk - n_reused) if n_saved else 0


def _log_loop_failure(loop: Future) -> None:
    if not loop.cancelled() and loop.exception() is not None:
        e = loop.exception()
        log.error("the inference loop failed: %s: %s", type(e).__name__, e, exc_info=e)


class InferenceWorker:
    """One thread owns the engine: one session served first in, first out, or a batch of slots."""

    def __init__(self, model: Any, engine_types: EngineTypes | None = None, *,
                 history: int = 256, kv: KVStore | None = None, n_slots: int = 1,
                 clock: Callable[[], float] = time.monotonic, engine_thread: EngineThread | None = None) -> None:
        """`engine_thread` is the thread the model was loaded on (see `engine.threads`); the
        worker's loop runs there. Without one the worker starts its own and ends it in `stop()`."""
        self.model = model
        self.types = engine_types or default_engine_types()
        self.kv = kv
        self._owns_thread = engine_thread is None
        self.engine_thread = engine_thread or EngineThread("ds4-inference")
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._job_ids = itertools.count(1)
        self._loop: Future | None = None
        self._session: Any = None
        # What the live session holds, for the disk cache: the prompt text it was synced to
        # (None: unknown, e.g. a prefill was interrupted), that prompt's token count, and the
        # longest prefix of it known to be on disk.
        self._live_text: str | None = None
        self._live_n_prompt = 0
        self._live_on_disk = 0
        self._current: Job | None = None
        self._lock = threading.Lock()
        self.finished: deque[JobStats] = deque(maxlen=history)
        """Stats of the most recent jobs, newest last (for logs, tests and health)."""
        self._finished_cv = threading.Condition()
        self.batched = None
        if n_slots > 1:
            from server.batching import BatchedLoop  # needs the engine's scheduler
            # Its KV pool is allocated by torch: on the engine thread, like all torch work.
            self.batched = self.engine_thread.call(BatchedLoop, self, n_slots, clock=clock)

    # lifecycle

    def start(self) -> None:
        if self._loop is not None:
            return
        if self._owns_thread and self.engine_thread.closed:
            self.engine_thread = EngineThread("ds4-inference")
        self._loop = self.engine_thread.submit(self._run)
        self._loop.add_done_callback(_log_loop_failure)

    def stop(self, timeout: float | None = None) -> None:
        """Cancel running jobs, drop queued ones, and join the thread.

        The thread stores the live session(s) in the disk cache before it ends, so the
        default timeout is longer with a cache.
        """
        if self._loop is None:
            return
        if timeout is None:
            timeout = 10.0 if self.kv is None else 120.0
        with self._lock:
            if self._current is not None:
                self._current.cancel()
        if self.batched is not None:
            self.batched.cancel_all()
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                break
            if pending is not None:
                pending.cancel()
                self._finish_cancelled(pending)
        self._queue.put(None)
        try:
            self._loop.result(timeout)
        except FuturesTimeout:
            log.warning("the inference thread did not end within %.0fs", timeout)
        except Exception:
            pass  # logged by _log_loop_failure when the loop ended
        self._loop = None
        if self._owns_thread:
            self.engine_thread.close(timeout=1.0)

    # submission

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Job:
        job = Job(next(self._job_ids), request, sink)
        self._queue.put(job)
        return job

    @property
    def queue_depth(self) -> int:
        n = self._queue.qsize()
        return n + (self.batched.n_waiting if self.batched is not None else 0)

    @property
    def busy(self) -> bool:
        if self.batched is not None:
            return self.batched.n_active > 0
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
        if self.batched is not None:
            self.batched.run()
            return
        while True:
            job = self._queue.get()
            if job is None:
                self._save_live(kvstore_policy.SHUTDOWN)
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
        if stats.n_written:
            extra += f" written_to_disk={stats.n_written}"
        if stats.slot is not None:
            extra += f" slot={stats.slot}"
        log.info("job %d %s: prompt=%d cached=%d generated=%d time=%.2fs%s", stats.job_id,
                 stats.status, stats.n_prompt, stats.n_cached, stats.n_generated, total, extra)

    def _finish_cancelled(self, job: Job) -> None:
        job.stats.status = "cancelled"
        job.emit(Finished("cancelled", job.stats.usage()))

    def _acquire_session(self, job: Job) -> Any:
        if self._session is None:
            self._session = self.model.new_session()
            self._live_text, self._live_n_prompt, self._live_on_disk = None, 0, 0
        return self._session

    def _save_live(self, reason: str, next_ids: list[int] | None = None) -> None:
        """Store the live session in the disk cache before it is replaced (evict) or at exit."""
        if self.kv is None or self._session is None or self._live_text is None:
            return
        n_common = common_prefix(self._session.tokens, next_ids) if next_ids is not None else 0
        try:
            entry = save_session(self.kv, self.model, self._session, self._live_text, self._live_n_prompt,
                                 reason, n_common=n_common, n_saved=self._live_on_disk)
        except Exception:  # the cache never fails a request
            log.exception("kv cache: cannot save the live session (%s)", reason)
            return
        if entry is not None:
            self._live_on_disk = entry.n_tokens
            log.info("kv cache: saved the live session (%s, %d tokens)", reason, entry.n_tokens)

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
            self._live_text, self._live_n_prompt, self._live_on_disk = None, 0, 0
            job.emit(Failed(f"inference failed: {type(e).__name__}"))

    def _progress_hook(self, job: Job) -> Callable[[int, int], None]:
        last_report = time.monotonic()

        def progress(done: int, total: int) -> None:
            nonlocal last_report
            now = time.monotonic()
            job.stats.longest_prefill_chunk_s = max(job.stats.longest_prefill_chunk_s, now - last_report)
            last_report = now
            job.emit(PrefillProgress(done, total))
        return progress

    def _generate(self, job: Job) -> None:
        req = job.request
        model = self.model
        session = self._acquire_session(job)
        ids = list(req.prompt_ids)

        # 1. prefill: save what the new prompt drops, restore from disk, prefill the rest
        self._save_live(kvstore_policy.EVICT, ids)
        kept_on_disk = min(self._live_on_disk, common_prefix(session.tokens, ids))
        boundary = None
        if self.kv is not None and req.user_boundary is not None:
            boundary = kvstore_policy.tokens_at_text_offset(req.prompt_text, req.user_boundary, ids,
                                                            model.prompt_ids)
        self._live_text = None  # until the prefill completes, the session matches no text
        out = prefill_with_cache(self.kv, model, session, req.prompt_text, ids, user_boundary=boundary,
                                 progress=self._progress_hook(job), cancel=job.is_cancelled)
        ids = out.ids
        self._live_text, self._live_n_prompt = req.prompt_text, len(ids)
        self._live_on_disk = max(out.n_on_disk, kept_on_disk)
        job.stats.n_prompt = len(ids)
        job.stats.n_cached = int(out.n_reused)
        job.stats.n_written = written_tokens(out.n_on_disk, out.n_reused, len(out.saved or ()))
        if job.is_cancelled():
            raise _JobCancelled
        job.emit(PromptReady(len(ids), job.stats.n_cached, job.stats.n_written))

        # 2. decode
        params = sampling_params(self.types, req.sampling)
        decoder = TokenDecoder(model, job)
        pending: int | None = None
        for _ in range(decode_budget(model, req, len(ids))):
            if job.is_cancelled():
                raise _JobCancelled
            if pending is not None:
                # Evaluated lazily so the last sampled token costs no forward pass.
                session.eval(pending)
            token = decoder.choose(session.logits, lambda _logits: session.sample(params))
            if not decoder.accept(token):
                break
            pending = token
        decoder.finish("length")
