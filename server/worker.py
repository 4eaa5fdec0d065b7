"""The inference worker: the thread that owns the engine and runs one of the two loops.

The per-job work of the serial loop is `server.serial.SerialLoop` (prefix reuse, the disk
cache plan, token decoding, the steps of several requests' jobs interleaved). Which job goes next is the ledger's (`server.jobs.JobLedger`):
the jobs of one client request (its choices or prompts) are submitted together
(`submit_request`) and take turns with other requests' jobs, in both loops. `check` is the
per-request ceiling on work (`server.jobs.WorkLimits`), for the APIs to answer before queueing.

The worker thread is an `engine.threads.EngineThread`: the one the model was loaded on
(`ds4-server` loads it there), so that torch keeps a single OpenMP pool and its fast waits
(engine/threads.py says why). The worker's loop is a task that owns that thread from
`start()` to `stop()`.

With `n_slots > 1` the thread runs `server.batching.BatchedLoop` instead of `SerialLoop`:
several resident sessions decode together (see that module). Both loops take their jobs
from the same ledger and report to it; neither imports the other, nor this module.

It does not parse HTTP, render prompts or know any API's field names; the job, event and
token-decoding types live in `server.jobs`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, Callable, Sequence

from engine.threads import EngineThread
from server.batching import BatchedLoop
from server.jobs import (NO_OBSERVER, CoalescingSink, Event, GenerationRequest, Job, JobLedger, JobObserver,
                         JobStats, OverLimit, ServingLoad, WorkLimits, default_engine, over_limit)
from server.kvstore import KVStore
from server.serial import DEFAULT_MAX_LIVE, SerialLoop
from server.steplog import StepLogWriter

log = logging.getLogger("ds4.server.worker")


def _log_loop_failure(loop: Future) -> None:
    if not loop.cancelled() and loop.exception() is not None:
        e = loop.exception()
        log.error("the inference loop failed: %s: %s", type(e).__name__, e, exc_info=e)


class InferenceWorker:
    """One thread owns the engine: sessions stepped one at a time (serial), or a batch of slots."""

    def __init__(self, model: Any, engine: Any = None, *,
                 history: int = 256, kv: KVStore | None = None, n_slots: int = 1, interleave: int = DEFAULT_MAX_LIVE,
                 clock: Callable[[], float] = time.monotonic, engine_thread: EngineThread | None = None,
                 observer: JobObserver = NO_OBSERVER, stream_interval: float = 0.0,
                 limits: WorkLimits = WorkLimits(), step_log: StepLogWriter | None = None) -> None:
        """`engine` provides the engine's types (`SamplingParams`, `Sampler`, `Cancelled`; default:
        the `engine` package). `engine_thread` is the thread the model was loaded on (see
        `engine.threads`); the worker's loop runs there. Without one the worker starts its own
        and ends it in `stop()`. `observer` watches every job (`server.jobs.JobObserver`).
        `stream_interval` > 0 wraps each job's sink in a `server.jobs.CoalescingSink`. `limits`
        is the most work one request may ask for (`check`). `interleave` is how many jobs of
        different requests the serial loop keeps in progress at once (`server.serial`). `step_log`
        gets a line per step of the batched loop (`server.steplog`; it needs `n_slots` > 1) and is
        closed by `stop()`."""
        if step_log is not None and n_slots < 2:
            raise ValueError("a step log records the batched loop's steps: it needs n_slots >= 2")
        self.step_log = step_log
        self.model = model
        self.limits = limits
        self.stream_interval = stream_interval
        self.engine = engine if engine is not None else default_engine()
        self.kv = kv
        self.jobs = JobLedger(history, observer)
        self._owns_thread = engine_thread is None
        self.engine_thread = engine_thread or EngineThread("ds4-inference")
        self._loop: Future | None = None
        self.batched: BatchedLoop | None = None
        self.serving: SerialLoop | BatchedLoop
        if n_slots > 1:
            # Its KV pool is allocated by torch: on the engine thread, like all torch work.
            self.batched = self.engine_thread.call(BatchedLoop, model, self.engine, self.jobs, kv, n_slots,
                                                   clock=clock, step_log=step_log)
            self.serving = self.batched
        else:
            self.serving = SerialLoop(model, self.engine, self.jobs, kv, max_live=interleave)

    @property
    def finished(self) -> deque[JobStats]:
        """Stats of the most recent jobs, newest last (for logs, tests and health)."""
        return self.jobs.finished

    # lifecycle

    def start(self) -> None:
        if self._loop is not None:
            return
        if self._owns_thread and self.engine_thread.closed:
            self.engine_thread = EngineThread("ds4-inference")
        self._loop = self.engine_thread.submit(self.serving.run)
        self._loop.add_done_callback(_log_loop_failure)

    def cancel_all(self) -> None:
        """Cancel the running and the queued jobs (any thread); the loop goes on serving what
        comes later. Their handlers answer as for a shutdown."""
        self.serving.cancel_all()
        self.jobs.cancel_queued()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel running jobs, drop queued ones, and join the thread.

        The thread stores the live session(s) in the disk cache before it ends, so the
        default timeout is longer with a cache.
        """
        if self._loop is None:
            return
        if timeout is None:
            timeout = 10.0 if self.kv is None else 120.0
        self.cancel_all()
        self.jobs.request_stop()
        try:
            self._loop.result(timeout)
        except FuturesTimeout:
            log.warning("the inference thread did not end within %.0fs", timeout)
        except Exception:
            pass  # logged by _log_loop_failure when the loop ended
        self._loop = None
        if self.step_log is not None:
            self.step_log.close()
        if self._owns_thread:
            self.engine_thread.close(timeout=1.0)

    # submission

    def check(self, requests: Sequence[GenerationRequest]) -> OverLimit | None:
        """Why the jobs of one client request ask for more work than `limits` allows, or None."""
        return over_limit(requests, self.model.n_ctx, self.limits)

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Job:
        return self.submit_request([request], [sink])[0]

    def submit_request(self, requests: Sequence[GenerationRequest],
                       sinks: Sequence[Callable[[Event], None]]) -> list[Job]:
        """Queue the jobs of one client request (its choices or prompts, in order): the loop
        shares its time between requests (`server.jobs.JobLedger`)."""
        if self.stream_interval > 0:
            sinks = [CoalescingSink(sink, self.stream_interval) for sink in sinks]
        return self.jobs.submit_request(requests, sinks)

    @property
    def queue_depth(self) -> int:
        return self.jobs.depth

    @property
    def busy(self) -> bool:
        return self.serving.busy

    def load(self) -> ServingLoad:
        """What the loop holds now (any thread; the figures are read without stopping it)."""
        resident = self.serving.resident_tokens()
        return ServingLoad(running=self.serving.n_active, waiting=self.queue_depth, kv_tokens=sum(resident),
                           kv_capacity_tokens=len(resident) * self.model.n_ctx, slots=len(resident))

    def wait_finished(self, job_id: int, timeout: float) -> JobStats | None:
        """Block until the job with this id has left the worker (tests and shutdown)."""
        return self.jobs.wait_finished(job_id, timeout)
