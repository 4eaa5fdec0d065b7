"""Batched sessions for ds4-server (`--batched-session N`): routing and the batched worker loop.

`route(slots, prompt_text, ids, now)` is pure: it picks the resident session (slot) for a
request, among the slots that serve no request right now (an active request is never
evicted), in this order:
  prefix    the slot whose rendered text (prompt plus reply) shares the longest prefix with
            the request's rendered prompt, when the tokens it lets the request keep are at
            least `MIN_REUSE_TOKENS` (every prompt of a chat template shares a few header
            tokens: that alone is not worth displacing a conversation);
  empty     a slot that holds nothing;
  idle      the least recently used slot idle for over `IDLE_EVICT_S` (an hour);
  shortest  the slot with the shortest cache (the least work thrown away).
The text, not only the token prefix, decides, because a reply as sampled need not be
tokenized the way the next turn's rendered prompt is; the tokens reused are still the
common token prefix (that is what the engine keeps).

`BatchedLoop` runs on the inference worker's thread in place of its one-job-at-a-time loop,
taking jobs from the same `server.jobs.JobLedger` and recording them there. It owns an
`engine.batch.BatchScheduler` of N sessions (whose memory is checked when it is built:
`CapacityError` with the figures) and, per job:
  1. takes it from the ledger when a slot is free, in the ledger's fair order
     (`server.jobs.next_turn`: the request with the fewest jobs in slots first, so the n
     choices of one request fill the slots only while no other request waits, and a request
     that arrives meanwhile gets the next slot that frees; a choice that would copy the prompt
     another slot is still prefilling waits until the part they share is cached there,
     without holding up other requests),
     routes it and logs the decision (slot, reused tokens, evicted tokens, reason);
  2. a request for prompt log-probs is scored in the slot's session (emptied first) one
     prefill chunk per step (`server.scoring.iter_score_prompt`, on this thread, before the
     slot joins the scheduler's batch): a step runs one chunk at most, a scoring chunk or the
     scheduler's prefill chunk (`BatchScheduler.step(prefill=False)`), which take turns while
     both wait, and the decoding rows step as usual beside it. The chunks are those of
     `score_prompt` in one piece, so are the numbers. Between two chunks the job is like a
     prefilling one: `decoding_rows` may park it (it then only skips its turns), the step
     charges count its chunk, a cancelled job stops there (the slot keeps the chunks done,
     matching no known text) and it is never evicted for a newcomer (only decoding jobs are);
     its `PromptScored` goes out after the last chunk, and the prefill below then has only the
     frontier token left;
  3. with the disk KV cache: stores the slot's session (reason evict) before it is
     replaced, when the policy wants it (`server.kvplan.save_resident`; before any scoring),
     then the restore step of the prefill plan (`server.kvplan.plan_prefill`) brings the
     longest checkpoint of the prompt from disk into the slot. Both happen on this thread
     before the job's first `GenRequest` is submitted, and this thread is the only one that
     runs forward passes, so a slot joins the batch only once its restore has completed:
     there is no moment when a half-restored session is decoded;
  4. prefills through the scheduler, in the plan's stages, which end at the checkpoints the
     save policy wants (cold / continued): each stage is a `GenRequest` of the prompt up to
     that point and one throw-away token, after which the slot's session holds exactly
     the checkpoint's tokens and is stored; the next stage reuses them. The scheduler
     interleaves these chunks with the other slots' decode steps;
  5. generates with the request's own `TokenDecoder` (`server.jobs`): `GenRequest.choose`
     picks each token (greedy inside tool-call structure, else the request's sampler) and
     `on_token` feeds the stop matcher, the splitter and the event stream. A stop sequence
     or a cancelled job ends only that request (`GenRequest.cancel`).
Between steps it decides which jobs take the next one (`decoding_rows`, pure), decoding,
prefilling or scoring alike: those whose request has had within `BATCH_QUANTUM_S` of the least loop time
so far. Each step's time is charged to the requests of its rows (`server.jobs.JobLedger.charge`)
by what each row evaluated (`step_charges`, pure): the decoding rows share what a decoding step
lately takes, the row whose chunk ran (a prefill's or a scored prompt's) has the rest. The others
are parked: their GenRequest ends at the step (cancelled), the slot keeps their session, whose cache
(and, decoding, frontier logits) are their prompt and output so far, and a later GenRequest of
exactly those ids resumes them without recomputing anything; a parked prefill resumes at its next
chunk, the chunks of an uninterrupted one, so outputs do not change (a parked scoring job, which
has no GenRequest, only skips its turns). A newcomer therefore decodes alone,
at one row's speed, until it has had about as much time as the requests it found running, and a
long prompt's prefill or scoring waits between its chunks meanwhile. A newcomer (a request with no job in
progress) that finds every slot busy takes one (`_evict_for_newcomer`): the decoding job of the
most served request is parked, its session copied out with its logits
(`engine.session.Session.copy_from`) and the slot freed, one slot for each newcomer that waits,
in the same step; the evicted job goes back into a free slot that no newcomer takes (the one
`route` picks for it), before the ledger's other jobs, copied in, and resumes unchanged (a steady stream of newcomers
can hold it out meanwhile). The jobs out of their slots hold at most `n_slots` contexts' worth of
tokens together (their sessions are the memory this costs: at most as much as the slots').
On the stop sentinel it cancels what runs, lets the scheduler wind down, and stores every
slot's session (reason shutdown) before it returns. With a step log (`--step-log`,
`server.steplog`) the scheduler's record of each step is written with what the loop held then:
its jobs, those waiting, those admitted since the step before, and those parked.

It does not parse HTTP, render prompts, or decode rows itself (the engine's scheduler does).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

import torch

from engine.errors import Cancelled
from engine.session import common_prefix
from server import kvstore_policy as policy
from server.jobs import (Failed, Job, JobLedger, PromptReady, TokenDecoder, decode_budget, sampling_params,
                         written_tokens)
from server.kvplan import Resident, Stage, plan_prefill, save_resident, user_boundary_tokens
from server.kvstore import KVStore
from server.scoring import PromptScored, iter_score_prompt
from server.steplog import LoopState, StepLogWriter

log = logging.getLogger("ds4.server.batching")

IDLE_EVICT_S = 3600.0
MIN_REUSE_TOKENS = 32
PREFIX, EMPTY, IDLE, SHORTEST = "prefix", "empty", "idle", "shortest"


# --- routing (pure) ------------------------------------------------------------------------

@dataclass(frozen=True)
class SlotView:
    """What routing knows of one slot."""
    text: str
    """Rendered text the slot's session holds ("" when unknown or empty)."""
    tokens: Sequence[int]
    active: bool
    last_used: float


@dataclass(frozen=True)
class Route:
    slot: int
    reused: int
    """Tokens of the slot's cache that the request keeps."""
    evicted: int
    """Tokens of the slot's cache that the request drops."""
    reason: str


def shares_prompt(a: Sequence[int], ids: Sequence[int]) -> bool:
    """Whether a prefix held for `a` is worth copying for prompt `ids`: at least
    `MIN_REUSE_TOKENS` tokens in common and at least half of `ids` (the `n` choices of one
    request, or clients that send one prompt several times; not a shared template header)."""
    shared = common_prefix(a, ids)
    return shared >= MIN_REUSE_TOKENS and 2 * shared >= len(ids)


def common_text(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def route(slots: Sequence[SlotView], prompt_text: str, ids: Sequence[int], now: float, *,
          idle_after: float = IDLE_EVICT_S, min_reuse: int = MIN_REUSE_TOKENS) -> Route | None:
    """The slot for a request (see the module docstring), or None when every slot is active."""
    free = [i for i, s in enumerate(slots) if not s.active]
    if not free:
        return None

    def decision(i: int, reason: str) -> Route:
        kept = common_prefix(slots[i].tokens, ids)
        return Route(i, kept, len(slots[i].tokens) - kept, reason)

    shared = {i: (common_text(slots[i].text, prompt_text), common_prefix(slots[i].tokens, ids)) for i in free}
    reusing = [i for i in free if shared[i][1] >= min_reuse and shared[i][0] > 0]
    if reusing:
        return decision(max(reusing, key=lambda i: (shared[i][0], shared[i][1], slots[i].last_used)), PREFIX)
    empty = [i for i in free if not slots[i].tokens]
    if empty:
        return decision(empty[0], EMPTY)
    idle = [i for i in free if now - slots[i].last_used > idle_after]
    if idle:
        return decision(min(idle, key=lambda i: slots[i].last_used), IDLE)
    return decision(min(free, key=lambda i: (len(slots[i].tokens), slots[i].last_used)), SHORTEST)


# --- which rows decode (pure) -------------------------------------------------------------------

BATCH_QUANTUM_S = 0.05
"""How far ahead of the least served request a request may be and still decode in the same step."""


def decoding_rows(served: Sequence[float], quantum: float = BATCH_QUANTUM_S) -> list[bool]:
    """Which of the decoding jobs take the next step, given the loop time each one's request has
    had (`server.jobs.JobLedger.served`): those within `quantum` of the least served. A newcomer
    (served 0) thus decodes alone, at one row's speed, until it has had about as much time as the
    requests already in the batch, which wait meanwhile with their caches kept; requests that
    have had about as much time decode together (a step's time is shared among its rows, so they
    stay level)."""
    if not served:
        return []
    floor = min(served) + quantum
    return [s <= floor for s in served]


def step_charges(seconds: float, advanced: Sequence[int], decode_step_s: float | None) -> list[float]:
    """How one batched step's time is charged to its rows, given the tokens each row evaluated
    (`advanced`: 1 for a decoding row, more for the row whose prefill chunk ran, 0 for a row that
    evaluated nothing, e.g. one that was parked or ended). Without a chunk the decoding rows share
    the time equally. With one, the decoding rows share what a step of decoding alone has lately
    taken (`decode_step_s`, at most the whole time) and the chunk's row has the rest: a chunk costs
    many decoding steps, and a newcomer that decodes beside another request's long prefill must not
    pay for it. A step in which no row evaluated anything is shared by all its rows."""
    n = len(advanced)
    if not any(advanced):
        return [seconds / n] * n if n else []
    decoding = [i for i, a in enumerate(advanced) if a == 1]
    chunk = [i for i, a in enumerate(advanced) if a > 1]
    out = [0.0] * n
    decode_s = seconds if not chunk else min(seconds, decode_step_s or 0.0) if decoding else 0.0
    for i in decoding:
        out[i] = decode_s / len(decoding)
    for i in chunk:
        out[i] = (seconds - decode_s) / len(chunk)
    return out


# --- the loop ------------------------------------------------------------------------------

class _Chooser:
    """A batched job's token chooser (`choose`, guarded) that also tells the scheduler which of a
    device row's greedy ids it takes (engine.device_sampling.ColumnChooser): its sampler's, while
    the job's decoder draws with that sampler alone.  The scheduler then launches the next step
    on that id before the host has it, and keeps that step only where the chosen token is that id
    (engine.batch), so a wrong answer costs a step's time, never a token."""

    def __init__(self, choose: Callable[[Any], int], run: "_Running", sampler: Any):
        self._choose, self._run, self._sampler = choose, run, sampler

    def __call__(self, logits: Any) -> int:
        return self._choose(logits)

    def greedy_column(self, logits: Any) -> int | None:
        run = self._run
        if run.error is not None or not run.budget or not run.decoder.follows_sampler:
            return None
        return logits.greedy_column(self._sampler)


class _Running:
    """One job in one slot: its scoring or its stages, its decoder and the GenRequest in the scheduler."""

    def __init__(self, job: Job, slot: int, ids: list[int], decoder: TokenDecoder, boundary: Any,
                 kept_on_disk: int) -> None:
        self.job = job
        self.slot = slot
        self.ids = ids
        """The prompt ids, then those of the prefill plan (`BatchedLoop._prefill`)."""
        self.decoder = decoder
        self.boundary = boundary
        """`user_boundary_tokens` of the prompt, for the plan."""
        self.kept_on_disk = kept_on_disk
        """Tokens of the prompt that the slot's disk checkpoint already held when the job started."""
        self.stages: list[Stage] = []
        self.n_restored = 0
        self.scoring: Generator[None, None, PromptScored] | None = None
        """The prompt's scoring while it lasts (`server.scoring.iter_score_prompt`), one chunk a step."""
        self.scored: PromptScored | None = None
        """Its result, from the step that ran the last chunk until the loop emits it."""
        self.gen: Any = None
        self.first = True  # the next GenRequest is the job's first (its reuse is the cached count)
        self.ready = False  # PromptReady sent
        self.final = False
        self.error: BaseException | None = None
        self.n_on_disk = 0
        self.n_saved = 0
        self.budget = 0
        """Tokens it may generate (set when its decoding starts)."""
        self.output: list[int] = []
        """Tokens generated by the GenRequests of its decoding before the current one."""
        self.parking = False
        """Asked to leave the batch at the next step (its GenRequest then ends cancelled)."""
        self.parked = False
        """Out of the batch, its slot's session holding its prompt and output with their logits (or,
        scoring or prefilling, the chunks done)."""
        self.evicting = False
        """Parking to give its slot to a newcomer: its session is then copied out (`BatchedLoop.evicted`)."""
        self.decode_calls: tuple[Any, Any, Any, Any] = (None, None, None, None)
        """(choose, on_token, cancel, params) of its decoding GenRequests."""

    @property
    def decoding(self) -> bool:
        """In its decoding GenRequest (or parked out of it), past its prompt."""
        return self.final and self.ready


@dataclass
class _SlotInfo(Resident):
    last_used: float = -math.inf
    running: _Running | None = None


class BatchedLoop:
    """N resident sessions served by the worker's thread through `engine.batch.BatchScheduler`."""

    def __init__(self, model: Any, engine: Any, jobs: JobLedger, kv: KVStore | None, n_slots: int, *,
                 clock: Callable[[], float] = time.monotonic, check_memory: bool = True,
                 step_log: StepLogWriter | None = None) -> None:
        """`engine` provides `SamplingParams` and `Sampler` (the `engine` package); `jobs` is the
        ledger the worker fills. The scheduler is `engine.batch`'s: batching needs the real engine.
        `step_log` gets a line for every scheduler step (`server.steplog`)."""
        from engine.batch import BatchScheduler

        self.model = model
        self.engine = engine
        self.jobs = jobs
        self.kv = kv
        self.clock = clock
        self.step_log = step_log
        self.scheduler = BatchScheduler(self.model, n_slots, check_memory=check_memory,
                                        observer=self._log_step if step_log is not None else None)
        self._admitted = 0
        """Jobs that took a slot since the last step (for the step log)."""
        self.info = [_SlotInfo() for _ in range(n_slots)]
        self.routes: deque[tuple[int, Route]] = deque(maxlen=256)
        """(job id, decision) of recent routing decisions, newest last."""
        self.quantum = BATCH_QUANTUM_S
        """`decoding_rows`'s quantum: how far ahead of the least served a request still decodes."""
        self.parks = 0
        """Times a decoding job left the batch to let less served requests go first (`decoding_rows`)."""
        self.evicted: list[tuple[_Running, Any]] = []
        """Jobs parked out of their slot for a newcomer, each with the session that holds its
        prompt, output and logits (at most `n_slots` contexts' worth of tokens in all), oldest first."""
        self.evictions = 0
        """Times a job left its slot that way."""
        self.decode_step_s: float | None = None
        """What a step that ran no prefill chunk has lately taken (`step_charges`)."""
        self._next_score = 0
        """The slot from which `_scoring_turn` looks for the next scoring job (round-robin)."""
        self._scored_last = False
        """Whether the latest step's chunk was a scoring one (scoring and prefills take turns)."""
        self._lock = threading.Lock()

    @property
    def n_slots(self) -> int:
        return len(self.info)

    @property
    def n_active(self) -> int:
        """Jobs taken from the ledger and not ended: in slots, or evicted from one."""
        return sum(1 for s in self.info if s.running is not None) + len(self.evicted)

    @property
    def busy(self) -> bool:
        return self.n_active > 0

    def session(self, i: int) -> Any:
        return self.scheduler.session(i)

    def resident_tokens(self) -> list[int]:
        """Tokens in each slot's KV cache (any thread: a moment's reading)."""
        return [len(self.session(i).tokens) for i in range(self.n_slots)]

    def cancel_all(self) -> None:
        """Cancel every running job (any thread; the loop winds them down); queued ones are the
        ledger's (`JobLedger.cancel_queued`)."""
        with self._lock:
            jobs = [s.running.job for s in self.info if s.running is not None]
            jobs += [run.job for run, _ in self.evicted]
        for job in jobs:
            job.cancel()

    # -- the thread --

    def run(self) -> None:
        stopping = False
        while True:
            idle = self.n_active == 0 and not self.scheduler.busy
            if stopping and idle and self.jobs.depth == 0:
                break
            if idle and not stopping:
                self.jobs.wait_for_work()
            if not stopping and self.jobs.take_stop():
                stopping = True
                self.cancel_all()
            self._admit_waiting(stopping)
            if not stopping:
                self._evict_for_newcomer()
            self._arrange_rows()
            scoring = self._scoring_turn()
            if self.scheduler.busy or scoring is not None:
                stepping = [s.running for s in self.info if s.running is not None and not s.running.parked]
                before = [len(self.session(run.slot).tokens) for run in stepping]
                t0 = time.monotonic()
                if scoring is not None:
                    self._score_chunk(scoring)
                try:
                    self.scheduler.step(prefill=scoring is None)  # one chunk a step, whichever it is
                except Exception as e:  # a failed forward pass: the slots' sessions are suspect
                    log.exception("batched step failed")
                    self._fail_all(e)
                    continue
                seconds = time.monotonic() - t0
                self._charge(stepping, before, seconds)
                self.jobs.observer.batch_step(self.n_active, seconds)
            self._collect()
        for i in range(self.n_slots):
            self._save_slot(i, policy.SHUTDOWN, None)

    def _charge(self, stepping: list[_Running], before: list[int], seconds: float) -> None:
        """Charge a step's time to the requests of its rows (`step_charges`), and keep the
        estimate of a decoding step's time current (from the steps that ran no prefill chunk)."""
        advanced = [max(0, len(self.session(run.slot).tokens) - n) for run, n in zip(stepping, before)]
        if advanced and max(advanced) == 1:
            self.decode_step_s = seconds if self.decode_step_s is None else 0.8 * self.decode_step_s + 0.2 * seconds
        for run, share in zip(stepping, step_charges(seconds, advanced, self.decode_step_s)):
            self.jobs.charge(run.job, share)

    def _log_step(self, record: Any) -> None:
        """The scheduler's observer with a step log: the step's line, with what the loop held."""
        runs = [s.running for s in self.info if s.running is not None]
        state = LoopState(jobs=self.n_active, waiting=self.jobs.depth, admitted=self._admitted,
                          parked=sum(1 for run in runs if run.parked))
        self._admitted = 0
        self.step_log.write(record, state)

    def _arrange_rows(self) -> None:
        """Park and resume jobs so that the next step serves those `decoding_rows` picks, whether
        they decode, prefill or score: a parked job's GenRequest ends (cancelled) at the step, its
        slot keeping the session; resumed, a new GenRequest of the same ids finds the session
        holding them (with their logits, when decoding) and goes on without recomputing anything.
        A prefill parked between chunks resumes at the next chunk (`Session.start_prefill` keeps
        what is cached), so its chunks, and its numbers, are those of an uninterrupted one. A
        scoring job is always between two chunks here: parking it only skips its turn."""
        runs = [s.running for s in self.info if s.running is not None
                and (s.running.gen is not None or s.running.scoring is not None)
                and not s.running.evicting and not s.running.job.is_cancelled() and not s.running.decoder.done]
        if len(runs) < 2 and not any(run.parked for run in runs):
            return
        rows = decoding_rows([self.jobs.served(run.job) for run in runs], self.quantum)
        for run, go in zip(runs, rows):
            if run.scoring is not None:
                if not go and not run.parked:
                    self.parks += 1
                run.parked = not go
            elif go and run.parked:
                run.parked = False
                self._resume(run)
            elif not go and not run.parked and not run.parking and not run.gen.done:
                run.parking = True

    def _scoring_turn(self) -> _Running | None:
        """The scoring job whose next chunk this step runs, if any: a step runs one chunk at most,
        a scoring one or the scheduler's prefill (`BatchScheduler.prefilling`), which take turns
        while both wait; the scoring jobs take theirs in slot order."""
        n = self.n_slots
        order = [self.info[(self._next_score + k) % n].running for k in range(n)]
        waiting = [run for run in order if run is not None and run.scoring is not None and run.scored is None
                   and not run.parked and not run.job.is_cancelled() and run.error is None]
        if not waiting or (self._scored_last and self.scheduler.prefilling):
            self._scored_last = False
            return None
        run = waiting[0]
        self._next_score, self._scored_last = (run.slot + 1) % n, True
        return run

    def _score_chunk(self, run: _Running) -> None:
        """Run one chunk of a job's scoring; its result, cancellation or failure is taken up
        after the step (`_after_scoring`), so that no exception of one job aborts the step."""
        assert run.scoring is not None
        try:
            next(run.scoring)
        except StopIteration as done:
            run.scored = done.value
        except Cancelled:
            pass  # only raised once the job is cancelled: `_after_scoring` ends it
        except Exception as e:
            log.exception("job %d: scoring failed", run.job.id)
            run.error = e

    def _admit_waiting(self, stopping: bool) -> None:
        """Give free slots to queued jobs, in the ledger's fair order: a request with fewer jobs
        in slots goes first, so a request of n choices holds every slot only while nobody else
        waits, and a newcomer gets the next slot that frees."""
        self._drop_cancelled_evicted()
        if stopping:
            while (job := self.jobs.take_next()) is not None:
                job.cancel()
                self.jobs.finish_cancelled(job)
                self.jobs.record(job)
            return
        while any(s.running is None for s in self.info):
            # A newcomer first, then a job evicted for one earlier, then the ledger's next.
            job = self.jobs.take_next(self._newcomer)
            if job is None and self.evicted:
                self._return_evicted()
                continue
            if job is None:
                job = self.jobs.take_next(self._can_start)
            if job is None:
                return
            if job.is_cancelled():
                self.jobs.finish_cancelled(job)
                self.jobs.record(job)
                continue
            req = job.request
            decision = route(self._slot_views(), req.prompt_text, req.prompt_ids, self.clock())
            assert decision is not None  # a slot is free
            self.routes.append((job.id, decision))
            log.info("route job %d -> slot %d: reused %d tokens, evicted %d tokens (%s)", job.id,
                     decision.slot, decision.reused, decision.evicted, decision.reason)
            try:
                self._start(job, decision.slot)
                self._admitted += 1
            except Exception as e:
                self._reset_slot(decision.slot)
                if job.is_cancelled():  # e.g. cancelled while its checkpoint was being restored
                    self.jobs.finish_cancelled(job)
                    self.jobs.record(job)
                    continue
                log.exception("job %d failed to start", job.id)
                self._fail(job, e)

    def _requests_in_progress(self) -> set[int]:
        return ({s.running.job.stats.request_id for s in self.info if s.running is not None}
                | {run.job.stats.request_id for run, _ in self.evicted})

    def _newcomer(self, job: Job) -> bool:
        """A job of a request that has none in progress (and that may start: `_can_start`)."""
        return job.stats.request_id not in self._requests_in_progress() and self._can_start(job)

    def _evict_for_newcomer(self) -> None:
        """For each newcomer that waits beyond the free slots and the slots already being given
        up, park the decoding job of the most served request (beyond the quantum) to give its
        slot away; its session is copied out once the step has parked it (`_advance`). Several
        newcomers that arrive together thus get their slots after one step, not one step each.
        The copies out hold at most `n_slots` contexts' worth of tokens together (the memory of
        the slots themselves), so a victim whose tokens do not fit stays."""
        giving = [s.running for s in self.info if s.running is not None and s.running.evicting]
        wanted = (self.jobs.waiting_requests(self._newcomer) - sum(1 for s in self.info if s.running is None)
                  - len(giving))
        if wanted <= 0:
            return
        room = (self.n_slots * self.model.n_ctx - sum(len(spare.tokens) for _, spare in self.evicted)
                - sum(len(self.session(run.slot).tokens) for run in giving))
        runs = [s.running for s in self.info if s.running is not None and s.running.decoding
                and not s.running.evicting and not s.running.job.is_cancelled()]
        served = {id(run): self.jobs.served(run.job) for run in runs}
        for victim in sorted((run for run in runs if served[id(run)] > self.quantum), key=lambda run: -served[id(run)]):
            size = len(self.session(victim.slot).tokens)
            if wanted == 0 or size > room:
                continue
            wanted, room = wanted - 1, room - size
            victim.evicting = True
            if victim.parked:  # already out of the batch: its session can go at once
                self._evict(victim)
            else:
                victim.parking = True  # a job already parking is copied out once it has parked

    def _evict(self, run: _Running) -> None:
        """Copy a parked job's session out of its slot and free the slot."""
        i = run.slot
        spare = self.model.new_session()
        spare.copy_from(self.session(i))
        run.evicting = False
        with self._lock:
            self.evicted.append((run, spare))
            self.info[i] = _SlotInfo(last_used=self.clock())  # the slot's tokens match no known text now
        self.evictions += 1
        log.info("job %d: parked out of slot %d for a newcomer (%d tokens kept)", run.job.id, i, len(spare.tokens))

    def _slot_views(self) -> list[SlotView]:
        return [SlotView(self._slot_text(i), self.session(i).tokens, s.running is not None, s.last_used)
                for i, s in enumerate(self.info)]

    def _return_evicted(self) -> None:
        """Put the oldest evicted job back into the free slot `route` picks for it (so that a
        kept conversation is not overwritten while an empty, idle or shorter slot is free), its
        session copied in, and resume it. With one free slot, whatever it holds is replaced: an
        evicted job that returns can displace a finished conversation that a later turn would
        have reused."""
        with self._lock:
            run, spare = self.evicted.pop(0)
        decision = route(self._slot_views(), run.job.request.prompt_text, spare.tokens, self.clock())
        assert decision is not None  # called with a slot free
        i = decision.slot
        log.info("job %d: back in slot %d (%s)", run.job.id, i, decision.reason)
        self._save_slot(i, policy.EVICT, list(spare.tokens))
        self.session(i).copy_from(spare)
        run.slot = run.job.stats.slot = i
        self.info[i] = _SlotInfo(last_used=self.clock(), running=run)  # known text again when it ends
        run.parked = False
        self._resume(run)

    def _drop_cancelled_evicted(self) -> None:
        for run, spare in [e for e in self.evicted if e[0].job.is_cancelled()]:
            with self._lock:
                self.evicted.remove((run, spare))
            self.jobs.finish_cancelled(run.job)
            self.jobs.record(run.job)

    def _can_start(self, job: Job) -> bool:
        """A cancelled job can always leave the queue; another waits while a running job is
        still prefilling the part of a prompt it shares (`_prefilling_shared_prompt`)."""
        return job.is_cancelled() or not self._prefilling_shared_prompt(job.request.prompt_ids)

    def _prefilling_shared_prompt(self, ids: Sequence[int]) -> bool:
        """Whether a running job is still prefilling the part of a prompt that shares most of
        `ids` (`shares_prompt`): the job then waits until that part is cached and copies it
        (`_copy_shared`) instead of computing the same positions a second time, not for the rest
        of that prefill."""
        return any(s.running is not None and not s.running.ready and shares_prompt(s.running.ids, ids)
                   and len(self.session(i).tokens) < min(common_prefix(s.running.ids, ids), len(ids) - 1)
                   for i, s in enumerate(self.info))

    def _copy_shared(self, i: int, ids: list[int], kept: int) -> int:
        """Copy into slot i the longest prefix of `ids` that another slot's session holds and
        slot i's does not (at most all but the last prompt token, whose logits the prefill
        must produce); the tokens slot i now holds in common with `ids`."""
        best, donor = kept, None
        for j in range(self.n_slots):
            if j == i:
                continue
            # A slot in the middle of its prefill holds the chunks done: they are valid keys and values.
            shared = min(common_prefix(self.session(j).tokens, ids), len(ids) - 1)
            if shared > best:
                best, donor = shared, j
        if donor is None or not shares_prompt(ids[:best], ids):
            return kept
        self.session(i).copy_prefix_from(self.session(donor), best)
        log.info("slot %d: copied %d prompt tokens from slot %d", i, best, donor)
        return best

    def _slot_text(self, i: int) -> str:
        info = self.info[i]
        if info.prompt_text is None:
            return ""
        return info.prompt_text + self.model.detokenize_prompt(list(self.session(i).tokens[info.n_prompt:]))

    def _save_slot(self, i: int, reason: str, next_ids: list[int] | None) -> None:
        save_resident(self.kv, self.model, self.session(i), self.info[i], reason, next_ids, label=f"slot {i}")

    def _start(self, job: Job, i: int) -> None:
        req = job.request
        model = self.model
        info = self.info[i]
        session = self.session(i)
        ids = list(req.prompt_ids)
        boundary = user_boundary_tokens(self.kv, model, req.prompt_text, req.user_boundary, ids)
        self.jobs.start(job, i)

        # 1. the slot's current session goes to disk before it is replaced
        self._save_slot(i, policy.EVICT, ids)
        kept = common_prefix(session.tokens, ids)
        info.running = run = _Running(job, i, ids, TokenDecoder(model, job), boundary, min(info.on_disk, kept))
        info.prompt_text, info.on_disk = None, 0
        if req.prompt_logprobs is not None:
            # 2. scored one chunk per step (`_scoring_turn`); the slot's content goes now, not at
            #    the first chunk, so that the step charges count that chunk's tokens. The plan's
            #    prefill then has only the frontier token left (`_after_scoring`).
            session.reset()
            run.scoring = iter_score_prompt(model, session, ids, req.prompt_logprobs, job.is_cancelled)
            return
        self._copy_shared(i, ids, kept)  # a scored prompt is computed in full anyway
        self._prefill(run)

    def _prefill(self, run: _Running) -> None:
        """3. the plan (`server.kvplan`): its restore step brings the prompt's longest checkpoint
        back before the slot joins the batch; its stages are the checkpoints to leave on disk."""
        job = run.job
        plan = plan_prefill(self.kv, self.model, self.session(run.slot), job.request.prompt_text, run.ids,
                            run.boundary)
        run.ids, run.stages, run.n_restored = plan.ids, list(plan.stages), plan.n_restored
        run.n_on_disk = max(plan.n_restored, run.kept_on_disk)
        job.stats.n_prompt = len(run.ids)
        self._submit_next(run)

    def _submit_next(self, run: _Running) -> None:
        from engine.batch import GenRequest

        job = run.job

        def guard(fn: Callable[..., Any]) -> Callable[..., Any]:
            # An exception inside a callback would abort the whole batched step: keep it to
            # this job, which then stops at its next cancel check.
            def call(*args: Any) -> Any:
                try:
                    return fn(*args)
                except Exception as e:
                    if run.error is None:
                        run.error = e
                    return 0
            return call

        def cancel() -> bool:
            return job.is_cancelled() or run.error is not None or run.decoder.done or run.parking

        if run.stages:
            stage = run.stages[0]
            run.gen = GenRequest(ids=run.ids[:stage.n_tokens], max_tokens=1, choose=lambda _logits: 0,
                                 cancel=cancel, slot=run.slot)
        else:
            req = job.request
            run.final = True
            params = sampling_params(self.engine.SamplingParams, req.sampling)
            sampler = self.engine.Sampler(params, self.model.eos_ids)
            budget = run.budget = decode_budget(self.model, req, len(run.ids))

            def choose(logits: torch.Tensor) -> int:
                if not run.ready:
                    run.ready = True
                    job.emit(PromptReady(len(run.ids), job.stats.n_cached, job.stats.n_written))
                if budget == 0:
                    return 0
                return run.decoder.choose(logits, sampler)

            def on_token(token: int) -> None:
                if budget > 0:
                    run.decoder.accept(token)

            run.decode_calls = (_Chooser(guard(choose), run, sampler), guard(on_token), cancel, params)
            run.gen = GenRequest(ids=list(run.ids), params=params, max_tokens=max(1, budget),
                                 on_token=run.decode_calls[1], choose=run.decode_calls[0], cancel=cancel, slot=run.slot)
        self.scheduler.submit(run.gen)
        if run.first and run.gen.slot is not None:
            run.first = False
            # A scored prompt was computed in full: what the slot kept came from the scoring.
            scored = job.request.prompt_logprobs is not None
            job.stats.n_cached = 0 if scored else max(run.n_restored, int(run.gen.reused))

    def _resume(self, run: _Running) -> None:
        """Put a parked job back in the batch: its prefill stage again (it continues where it
        stopped), or a GenRequest of its prompt and output so far."""
        from engine.batch import GenRequest

        if not run.final:
            self._submit_next(run)
            return
        choose, on_token, cancel, params = run.decode_calls
        run.gen = GenRequest(ids=list(run.ids) + run.output, params=params,
                             max_tokens=max(1, run.budget - len(run.output)), on_token=on_token, choose=choose,
                             cancel=cancel, slot=run.slot)
        self.scheduler.submit(run.gen)

    def _collect(self) -> None:
        for i, info in enumerate(self.info):
            run = info.running
            if run is not None and run.scoring is not None:
                after = self._after_scoring
            elif run is not None and run.gen is not None and run.gen.done:
                after = self._advance
            else:
                continue
            try:
                after(i, run)
            except Exception as e:  # e.g. a failing splitter at finish: only this job fails
                log.exception("job %d failed", run.job.id)
                self.info[i].running = None
                self._reset_slot(i)
                self._fail(run.job, e)

    def _after_scoring(self, i: int, run: _Running) -> None:
        """Between two steps of a job's scoring: end it when it failed or was cancelled (its slot
        holds the chunks done, which match no known text); once scored, emit the `PromptScored`
        and go on to the prefill plan."""
        job = run.job
        if run.error is not None:
            self._end(i)
            self._reset_slot(i)
            self._fail(job, run.error)
        elif job.is_cancelled():
            self._end(i, keep_text=False)
            self.jobs.finish_cancelled(job)
            self.jobs.record(job)
        elif run.scored is not None:
            job.emit(run.scored)
            run.scoring = run.scored = None
            run.parked = False
            self._prefill(run)

    def _advance(self, i: int, run: _Running) -> None:
        """A job's GenRequest is done: store its checkpoint and go on, or finish the job."""
        gen, job = run.gen, run.job
        if run.parked:
            if job.is_cancelled():  # decoding, its session holds its prompt and output: their text is known
                self._end(i, keep_text=run.decoding)
                self.jobs.finish_cancelled(job)
                self.jobs.record(job)
            return
        if run.error is not None or gen.finish == "error":
            self._end(i)
            self._reset_slot(i)
            self._fail(job, run.error or RuntimeError(gen.error or "engine error"))
        elif run.parking and gen.finish == "cancelled" and not job.is_cancelled() and not run.decoder.done:
            # Parked between steps: every token it chose was evaluated, its logits are the frontier
            # (or, in its prefill, the chunks done are cached).
            run.output += gen.output
            run.parking, run.parked = False, True
            self.parks += 1
            if run.evicting:
                self._evict(run)
        elif gen.finish == "cancelled" and job.is_cancelled() and not run.decoder.done:
            # An interrupted prefill leaves tokens that match no known text.
            self._end(i, keep_text=run.final and run.ready)
            self.jobs.finish_cancelled(job)
            self.jobs.record(job)
        elif not run.final:
            stage = run.stages.pop(0)
            entry = self.kv.store(stage.prefix_text, self.session(i), stage.reason) if self.kv is not None else None
            if entry is not None:
                run.n_saved += 1
                run.n_on_disk = stage.n_tokens
                job.stats.n_written = written_tokens(run.n_on_disk, job.stats.n_cached, run.n_saved)
            self._submit_next(run)
        else:
            if not run.ready:  # announce the prompt even when no token was chosen
                job.emit(PromptReady(len(run.ids), job.stats.n_cached, job.stats.n_written))
            run.decoder.finish("length")
            self._end(i)
            self.jobs.record(job)

    def _end(self, i: int, keep_text: bool = True) -> None:
        info = self.info[i]
        run = info.running
        info.running = None
        info.last_used = self.clock()
        if run is not None and keep_text:
            info.prompt_text, info.n_prompt, info.on_disk = run.job.request.prompt_text, len(run.ids), run.n_on_disk
        else:
            info.forget()

    def _reset_slot(self, i: int) -> None:
        """Empty a slot whose session state may be half-updated (its cache memory is kept)."""
        self.session(i).reset()
        self.info[i] = _SlotInfo(last_used=self.clock())

    def _fail(self, job: Job, error: BaseException) -> None:
        job.stats.status = "failed"
        job.emit(Failed(f"inference failed: {type(error).__name__}"))
        self.jobs.record(job)

    def _fail_all(self, error: BaseException) -> None:
        self.scheduler.abandon_all()
        for i, info in enumerate(self.info):
            if info.running is not None:
                job = info.running.job
                info.running = None
                self._reset_slot(i)
                self._fail(job, error)
