"""The serial inference loop: one forward pass at a time, the steps of several requests' jobs interleaved fairly.

HTTP handlers run concurrently on the event loop; inference does not. Each request is
turned into a `GenerationRequest` (already rendered and tokenized, API-independent) and
submitted as a `Job` to the worker's `server.jobs.JobLedger`. One worker thread takes jobs
in the ledger's order and, for each (`SerialLoop`):

1. brings the session to the prompt ids (prefix reuse, disk cache restore, chunked
   prefill; the progress hook emits `PrefillProgress`, the cancel hook is checked at every
   chunk boundary); a request for prompt log-probs is first scored from an empty session
   (`server.scoring`, which emits `PromptScored`), and the prefill then evaluates only its
   last token; every chunk of either is a step of its own (below),
2. decodes token by token: sample, stop on EOS / stop sequence / token limit / context
   end, turn tokens into UTF-8-safe text, hold back possible stop-sequence prefixes,
3. emits `TextDelta` events and finally one `Finished` (or `Failed`) event.

Output splitting happens here too, when the request brings a splitter factory
(`GenerationRequest.new_splitter`, see `server.prompting.OutputSplitter`): every emitted
piece of text is fed to it in this thread, its events ride on the `TextDelta`, and its
final result on `Finished.output`. That keeps its state current token by token, which
sampling needs: while `splitter.in_structure` is True (inside tool-call syntax, outside
argument values) the next token is the argmax, otherwise it is drawn with the request's
sampling parameters. A request's decoding constraint (`GenerationRequest.new_constraint`,
see `server.constraints`) forces tokens or masks the logits before that choice.

Events reach the handler through the `sink` callable given at submission (the route
wraps `loop.call_soon_threadsafe`), so the worker never touches the event loop.

Cancellation: `Job.cancel()` may be called from any thread (disconnects do it). A queued
job is skipped; a running job stops at the next prefill chunk or decode step (its own: a
parked job stops at its next turn) and the worker records how long that took
(`JobStats.cancel_latency_s`).

Fair scheduling, at token granularity: a request of several choices or prompts is several
jobs, and the ledger hands out one job at a time (`server.jobs.next_turn`). The loop keeps up to
`max_live` jobs in progress at once, at most one per request, each in a session of its own, and
interleaves their steps: a step is a job's start (its session is found or made and its decoding
constraint built), a disk-cache restore or checkpoint, one prefill or scoring chunk (the
engine's `prefill_chunk` tokens, `server.kvplan.iter_prefill`, `server.scoring.iter_score_prompt`:
the chunks an uninterrupted prefill runs, so the numbers do not change), or one generated token.
Which job steps next is `server.jobs.next_step`'s: the
one whose request has had the least loop time so far (each step is timed and charged to its
request, `JobLedger.charge`). A request that arrives while a 128-choice request runs therefore
starts at the next step boundary (at most one prefill chunk away, however long the prompt in
progress) and has the loop to itself until it has had as much time as that request; requests
that have had as much alternate step by step. A job that waits between
steps (parked) keeps its session and KV cache, so its output is what it would be alone. The
sessions are made when needed (a KV cache grows with its tokens) and all but one idle session
are dropped as jobs end.

An idle session is kept between jobs so that a prompt sharing a prefix with the previous one
(multi-turn chat, agents) reuses its KV cache (a new job takes the idle session with the
longest common prefix); the reused count is published by the APIs as
cached tokens.

Disk KV cache (`kv`, a `server.kvstore.KVStore`, or None): before a job replaces the live
session (or drops it), the worker stores it (reason evict) when the policy wants it
(`server.kvplan.save_resident`); the prefill runs the plan of `server.kvplan` (restore the
longest checkpoint on disk, then prefill in stages that store cold / continued checkpoints); when the thread receives its stop
sentinel it stores its sessions (reason shutdown) before it returns, so a clean exit
of the server keeps the last conversation. Cached tokens then count what was restored from
disk too, and `Usage.cache_written_tokens` the prompt tokens newly covered by a checkpoint.
All of it runs on the worker thread, the only one that touches sessions.

It runs on the worker's engine thread (`server.worker.InferenceWorker` owns it) and depends
on `server.jobs` and `server.kvplan`, not on the batched loop (`server.batching`). It does
not parse HTTP, render prompts or know any API's field names.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from engine.session import common_prefix
from server import kvstore_policy
from server.jobs import (Failed, Job, JobCancelled, JobLedger, PrefillProgress, PromptReady, StepTurn, TokenDecoder,
                         decode_budget, next_step, sampling_params, written_tokens)
from server.kvplan import Resident, iter_prefill, save_resident, user_boundary_tokens
from server.kvstore import KVStore
from server.scoring import iter_score_prompt

# Job records are the worker's report, whichever loop served the job.
log = logging.getLogger("ds4.server.worker")

DEFAULT_MAX_LIVE = 8
"""Jobs in progress at once (each in its own session): beyond it a newcomer waits for one to end."""


@dataclass(eq=False)
class _Pooled:
    """One session of the loop and what the disk cache knows of it."""
    session: Any
    resident: Resident = field(default_factory=Resident)
    last_used: float = 0.0
    busy: bool = False


@dataclass(eq=False)
class _Live:
    """A job in progress: its session (from its first step on) and the steps it has left."""
    job: Job
    steps: Iterator[None] = field(default_factory=lambda: iter(()))
    last_step: int = 0
    pooled: _Pooled | None = None
    step_started: float = 0.0
    """When its latest step began (a prefill chunk's time excludes other jobs' steps before it)."""


class SerialLoop:
    """Sessions served one step at a time, the steps of up to `max_live` jobs interleaved in the
    ledger's fair order (runs on the worker's thread)."""

    def __init__(self, model: Any, engine: Any, jobs: JobLedger, kv: KVStore | None, *,
                 max_live: int = DEFAULT_MAX_LIVE) -> None:
        """`engine` provides `SamplingParams` and `Cancelled` (the `engine` package or a fake)."""
        if max_live < 1:
            raise ValueError(f"max_live must be at least 1, got {max_live}")
        self.model = model
        self.engine = engine
        self.jobs = jobs
        self.kv = kv
        self.max_live = max_live
        self._pool: list[_Pooled] = []
        self._live: list[_Live] = []
        self._ticks = 0
        self._lock = threading.Lock()  # guards the lists for readers on other threads

    @property
    def busy(self) -> bool:
        return bool(self._live)

    @property
    def n_active(self) -> int:
        return len(self._live)

    def resident_tokens(self) -> list[int]:
        """Tokens in each session's KV cache (any thread: a moment's reading)."""
        with self._lock:
            return [len(p.session.tokens) for p in self._pool] or [0]

    def cancel_all(self) -> None:
        """Cancel the jobs in progress (any thread); queued ones are the ledger's."""
        with self._lock:
            jobs = [live.job for live in self._live]
        for job in jobs:
            job.cancel()

    def run(self) -> None:
        stopping = False
        while True:
            if not self._live and not stopping:
                self.jobs.wait_for_work()
            if not stopping and self.jobs.take_stop():
                stopping = True
                self.cancel_all()
            self._admit(stopping)
            if not self._live:
                if stopping:
                    break
                continue
            self._step(self._pick())
        for pooled in self._pool:
            self._save(pooled, kvstore_policy.SHUTDOWN)

    # -- admission --

    def _admit(self, stopping: bool) -> None:
        """Start queued jobs while fewer than `max_live` are in progress, one per request, in
        the ledger's order (on the stop request, every queued job ends cancelled instead)."""
        while stopping or len(self._live) < self.max_live:
            job = self.jobs.take_next(None if stopping else self._can_start)
            if job is None:
                return
            if stopping:
                job.cancel()
            if job.is_cancelled():
                self.jobs.finish_cancelled(job)
                self.jobs.record(job)
                continue
            self.jobs.start(job)
            live = _Live(job, last_step=self._tick())
            live.steps = self._steps(live)
            with self._lock:
                self._live.append(live)

    def _can_start(self, job: Job) -> bool:
        """A cancelled job may always leave the queue; another waits while a job of its request
        is in progress (a request's choices run one after another, sharing the prompt's prefix)."""
        return job.is_cancelled() or all(live.job.stats.request_id != job.stats.request_id for live in self._live)

    def _session_for(self, job: Job) -> _Pooled:
        """The idle session that shares the longest prefix with the job's prompt (most recent
        first); a new one when none is idle (a job's first step: making a session's cache takes
        milliseconds, charged to the job that needs it)."""
        ids = list(job.request.prompt_ids)
        idle = [p for p in self._pool if not p.busy]
        if idle:
            pooled = max(idle, key=lambda p: (common_prefix(p.session.tokens, ids), p.last_used))
        else:
            pooled = _Pooled(self.model.new_session())
            with self._lock:
                self._pool.append(pooled)
        pooled.busy = True
        return pooled

    # -- steps --

    def _tick(self) -> int:
        self._ticks += 1
        return self._ticks

    def _pick(self) -> _Live:
        turns = [StepTurn(self.jobs.served(live.job), live.last_step) for live in self._live]
        chosen = next_step(turns)
        assert chosen is not None  # called with jobs in progress
        return self._live[chosen]

    def _step(self, live: _Live) -> None:
        """One step of one job, timed and charged to its request; the job ends when its steps do."""
        job = live.job
        live.last_step = self._tick()
        t0 = live.step_started = time.monotonic()
        try:
            if job.is_cancelled():
                raise JobCancelled
            next(live.steps)
            return
        except StopIteration:
            pass
        except (JobCancelled, self.engine.Cancelled):
            self.jobs.finish_cancelled(job)
        except Exception as e:  # the worker must survive anything one request does
            if job.is_cancelled():
                self.jobs.finish_cancelled(job)
            else:
                log.exception("job %d failed", job.id)
                job.stats.status = "failed"
                job.emit(Failed(f"inference failed: {type(e).__name__}"))
                if live.pooled is not None:  # the session may be half-updated: it is not reused
                    live.pooled.resident.forget()
                    live.pooled.session = None
        finally:
            self.jobs.charge(job, time.monotonic() - t0)
        self._end(live)

    def _end(self, live: _Live) -> None:
        """The job has left the loop: record it, free its session and keep at most one idle one."""
        pooled = live.pooled
        if pooled is not None:
            pooled.busy, pooled.last_used = False, time.monotonic()
        with self._lock:
            self._live.remove(live)
            if pooled is not None and pooled.session is None:
                self._pool.remove(pooled)
            idle = sorted((p for p in self._pool if not p.busy), key=lambda p: p.last_used)
            dropped = idle[:-1]
            for p in dropped:
                self._pool.remove(p)
        for p in dropped:
            self._save(p, kvstore_policy.EVICT)
        self.jobs.record(live.job)

    def _save(self, pooled: _Pooled, reason: str, next_ids: list[int] | None = None) -> None:
        """Store a session in the disk cache before it is replaced or dropped (evict) or at exit."""
        save_resident(self.kv, self.model, pooled.session, pooled.resident, reason, next_ids)

    def _progress_hook(self, live: _Live) -> Callable[[int, int], None]:
        job = live.job
        last_report = time.monotonic()

        def progress(done: int, total: int) -> None:
            nonlocal last_report
            now = time.monotonic()
            # A chunk starts after the previous report or with the job's step, whichever is later.
            chunk_s = now - max(last_report, live.step_started)
            job.stats.longest_prefill_chunk_s = max(job.stats.longest_prefill_chunk_s, chunk_s)
            last_report = now
            job.emit(PrefillProgress(done, total))
        return progress

    def _steps(self, live: _Live) -> Iterator[None]:
        """The job's work, one step per iteration: its start (its session and decoding
        constraint), the prefill (one step per chunk, `server.kvplan.iter_prefill`; a scored
        prompt's chunks first, `server.scoring.iter_score_prompt`), then one token each; it emits
        the job's events as it goes."""
        job = live.job
        req = job.request
        model = self.model
        pooled = live.pooled = self._session_for(job)
        session = pooled.session
        resident = pooled.resident
        ids = list(req.prompt_ids)
        # Built before anything else of the job: a large grammar's compilation is a step of its own.
        decoder = TokenDecoder(model, job)
        yield

        # 1. prefill: save what the new prompt drops, restore from disk, prefill the rest
        self._save(pooled, kvstore_policy.EVICT, ids)
        kept_on_disk = min(resident.on_disk, common_prefix(session.tokens, ids))
        boundary = user_boundary_tokens(self.kv, model, req.prompt_text, req.user_boundary, ids)
        resident.prompt_text = None  # until the prefill completes, the session matches no text
        if req.prompt_logprobs is not None:
            job.emit((yield from iter_score_prompt(model, session, ids, req.prompt_logprobs, job.is_cancelled)))
            yield
        out = yield from iter_prefill(self.kv, model, session, req.prompt_text, ids, user_boundary=boundary,
                                      progress=self._progress_hook(live), cancel=job.is_cancelled)
        ids = out.ids
        resident.prompt_text, resident.n_prompt = req.prompt_text, len(ids)
        resident.on_disk = max(out.n_on_disk, kept_on_disk)
        job.stats.n_prompt = len(ids)
        # A scored prompt was computed in full: what the session kept came from the scoring.
        job.stats.n_cached = 0 if req.prompt_logprobs is not None else int(out.n_reused)
        job.stats.n_written = written_tokens(out.n_on_disk, out.n_reused, len(out.saved or ()))
        if job.is_cancelled():
            raise JobCancelled
        job.emit(PromptReady(len(ids), job.stats.n_cached, job.stats.n_written))

        # 2. decode (the first token is chosen from the prefill's logits, in the prefill's last step)
        params = sampling_params(self.engine.SamplingParams, req.sampling)
        # A constraint hands the sampler a masked row: draw from that row, not the session's.
        sample: Callable[[Any], int] = (self.engine.Sampler(params, model.eos_ids) if decoder.constraint is not None
                                        else lambda _logits: session.sample(params))
        pending: int | None = None
        for _ in range(decode_budget(model, req, len(ids))):
            if job.is_cancelled():
                raise JobCancelled
            if pending is not None:
                # Evaluated lazily so the last sampled token costs no forward pass.
                session.eval(pending)
            token = decoder.choose(session.raw_logits, sample)
            if not decoder.accept(token):
                break
            pending = token
            yield
        decoder.finish("length")
