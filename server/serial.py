"""The one-session (serial) inference loop: one job at a time, in the ledger's fair order.

HTTP handlers run concurrently on the event loop; inference does not. Each request is
turned into a `GenerationRequest` (already rendered and tokenized, API-independent) and
submitted as a `Job` to the worker's `server.jobs.JobLedger`. One worker thread takes jobs
in the ledger's order and, for each (`SerialLoop`):

1. brings the session to the prompt ids (prefix reuse, disk cache restore, chunked
   prefill; the progress hook emits `PrefillProgress`, the cancel hook is checked at every
   chunk boundary); a request for prompt log-probs is first scored from an empty session
   (`server.scoring`, which emits `PromptScored`), and the prefill then evaluates only its
   last token,
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
job is skipped; a running job stops at the next prefill chunk or decode step and the
worker records how long that took (`JobStats.cancel_latency_s`).

Fair scheduling: a request of several choices or prompts is several jobs, and the ledger
hands out one job at a time, the next from the request that has waited longest without
service (`server.jobs.next_turn`). A request that arrives while a 128-choice request runs
therefore waits for the choice in progress, not for all of them. The unit of work is one
choice or one prompt: a job is never interrupted to serve another. The price is prefix reuse:
a choice that follows another request's job prefills its prompt again (or restores it from
the disk cache).

The session is kept between jobs so that a prompt sharing a prefix with the previous one
(multi-turn chat, agents) reuses its KV cache; the reused count is published by the APIs as
cached tokens.

Disk KV cache (`kv`, a `server.kvstore.KVStore`, or None): before a job replaces the live
session, the worker stores it (reason evict) when the policy wants it
(`server.kvplan.save_resident`); the prefill runs the plan of `server.kvplan` (restore the
longest checkpoint on disk, then prefill in stages that store cold / continued checkpoints); when the thread receives its stop
sentinel it stores the live session (reason shutdown) before it returns, so a clean exit
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
from typing import Any, Callable

from engine.session import common_prefix
from server import kvstore_policy
from server.jobs import (Failed, Job, JobCancelled, JobLedger, PrefillProgress, PromptReady, TokenDecoder,
                         decode_budget, sampling_params, written_tokens)
from server.kvplan import Resident, prefill_with_cache, save_resident, user_boundary_tokens
from server.kvstore import KVStore
from server.scoring import score_prompt

# Job records are the worker's report, whichever loop served the job.
log = logging.getLogger("ds4.server.worker")


class SerialLoop:
    """One session, one job at a time in the ledger's fair order (runs on the worker's thread)."""

    def __init__(self, model: Any, engine: Any, jobs: JobLedger, kv: KVStore | None) -> None:
        """`engine` provides `SamplingParams` and `Cancelled` (the `engine` package or a fake)."""
        self.model = model
        self.engine = engine
        self.jobs = jobs
        self.kv = kv
        self._session: Any = None
        self._live = Resident()  # what the live session holds, for the disk cache
        self._current: Job | None = None
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def n_active(self) -> int:
        return 1 if self._current is not None else 0

    def resident_tokens(self) -> list[int]:
        """Tokens in each resident session's KV cache (any thread: a moment's reading)."""
        session = self._session
        return [len(session.tokens) if session is not None else 0]

    def cancel_all(self) -> None:
        """Cancel the running job (any thread); queued ones are the ledger's."""
        with self._lock:
            if self._current is not None:
                self._current.cancel()

    def run(self) -> None:
        while True:
            job = self.jobs.take()
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
                self.jobs.record(job)

    def _acquire_session(self) -> Any:
        if self._session is None:
            self._session = self.model.new_session()
            self._live.forget()
        return self._session

    def _save_live(self, reason: str, next_ids: list[int] | None = None) -> None:
        """Store the live session in the disk cache before it is replaced (evict) or at exit."""
        if self._session is not None:
            save_resident(self.kv, self.model, self._session, self._live, reason, next_ids)

    def _serve(self, job: Job) -> None:
        if job.is_cancelled():
            self.jobs.finish_cancelled(job)
            return
        self.jobs.start(job)
        try:
            self._generate(job)
        except (JobCancelled, self.engine.Cancelled):
            self.jobs.finish_cancelled(job)
        except Exception as e:  # the worker must survive anything one request does
            if job.is_cancelled():
                self.jobs.finish_cancelled(job)
                return
            log.exception("job %d failed", job.id)
            job.stats.status = "failed"
            # The session may be half-updated; a fresh one is always consistent.
            self._session = None
            self._live.forget()
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
        session = self._acquire_session()
        ids = list(req.prompt_ids)

        # 1. prefill: save what the new prompt drops, restore from disk, prefill the rest
        self._save_live(kvstore_policy.EVICT, ids)
        kept_on_disk = min(self._live.on_disk, common_prefix(session.tokens, ids))
        boundary = user_boundary_tokens(self.kv, model, req.prompt_text, req.user_boundary, ids)
        self._live.prompt_text = None  # until the prefill completes, the session matches no text
        if req.prompt_logprobs is not None:
            job.emit(score_prompt(model, session, ids, req.prompt_logprobs, job.is_cancelled))
        out = prefill_with_cache(self.kv, model, session, req.prompt_text, ids, user_boundary=boundary,
                                 progress=self._progress_hook(job), cancel=job.is_cancelled)
        ids = out.ids
        self._live.prompt_text, self._live.n_prompt = req.prompt_text, len(ids)
        self._live.on_disk = max(out.n_on_disk, kept_on_disk)
        job.stats.n_prompt = len(ids)
        # A scored prompt was computed in full: what the session kept came from the scoring.
        job.stats.n_cached = 0 if req.prompt_logprobs is not None else int(out.n_reused)
        job.stats.n_written = written_tokens(out.n_on_disk, out.n_reused, len(out.saved or ()))
        if job.is_cancelled():
            raise JobCancelled
        job.emit(PromptReady(len(ids), job.stats.n_cached, job.stats.n_written))

        # 2. decode
        params = sampling_params(self.engine.SamplingParams, req.sampling)
        decoder = TokenDecoder(model, job)
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
        decoder.finish("length")
