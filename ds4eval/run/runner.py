"""The evaluation runner: a thread-safe object that runs cases through a backend, emits events
and obeys controls.

Contract
- `Runner(config, cases, backend, listeners)`; `run()` blocks until every case finished or
  `stop()` was called (call it from a worker thread when a UI owns the main thread).
- Events (dataclasses below) go to every listener's `on_event(event)`, from worker threads and
  never under the runner's lock: listeners must be thread-safe and quick. Per case the order is
  StatusChanged(PREFILL), Progress/TextDelta..., StatusChanged(THINKING), TextDelta/Progress...,
  CaseFinished.
- Controls, callable from any thread: `pause()`, `resume()` (the per-case clocks stop while
  paused), `stop()` (running cases end STOPPED at the next token boundary; pending ones stay
  PENDING; a backend's optional `interrupt()` is called to wake cases blocked between
  tokens), `run_next(i)` (case i runs next; if the slots are busy, one running case is
  interrupted, marked SWITCHED and queued again right after i), `rerun(i)` (a finished case
  is queued again). With `keep_alive=True`, `run()` waits for more work after the queue
  drains until `stop()`, so a UI can keep re-running cases.
- `snapshot()` returns copies of every case's state for display; `job(state)` is the
  GenerationJob a case runs with.
- With `config.repeats` K > 1 every case runs K times (states index each (case, repeat); the
  repeats of a case are adjacent in the queue), repeat r with seed `config.seed + r` when a seed
  is set. `repeats=` runs each given case once at the given repeat index (retries).
- A backend sees one case through a `CaseContext` (progress, text, token boundaries); the
  contexts and the runner share one `_RunControl` (the run's lock, pause clock, stop flag and
  listeners) and touch nothing else of each other.
- `outcome(case, result)` (pure) settles each ended generation: its status, and its output
  extracted and graded exactly once with the pure extractors (`ds4eval.cases.grade`); a
  SWITCHED case is not graded, as it runs again. Each finished case (PASSED, FAILED, SKIPPED,
  STOPPED, ERROR) is appended to the trace, if one is configured, with the run's provenance
  (`ds4eval.run.provenance`) and concurrency (`effective_concurrency`), the case's content
  hash, rendered-prompt hash and repeat index, the endpoint that served it when the backend
  names one (`GenerationResult.endpoint`), and the latency figures its backend measured
  (`GenerationResult.latency`, `ds4eval.run.latency`; unknown for a case that was running
  while the run was paused, as they would measure the pause); `run()` first writes the
  trace's run header (every selected case's number, source and id, and K; a shard's run adds
  the `shard_header` fields it is given, ds4eval.run.shards). `trace_sink` replaces the trace
  file as the receiver of those blocks.
It does not parse flags, render anything, or know how a backend talks to a model.
"""

from __future__ import annotations

import collections
import copy
import enum
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

from ds4eval.cases import grade
from ds4eval.cases import prompts
from ds4eval.cases.case import Case, case_hash
from ds4eval.config import EvalConfig
from ds4eval.run.latency import Latency
from ds4eval.run.provenance import RenderedPrompt, run_provenance
from ds4eval.run.trace import RunHeader, TraceRecord, TraceWriter


class Status(str, enum.Enum):
    PENDING = "PENDING"
    PREFILL = "PREFILL"
    THINKING = "THINKING"
    PASSED = "PASSED"
    FAILED = "FAILED"
    SKIPPED = "SKIPPED"
    STOPPED = "STOPPED"
    SWITCHED = "SWITCHED"
    ERROR = "ERROR"

    @property
    def running(self) -> bool:
        return self in (Status.PREFILL, Status.THINKING)

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({Status.PASSED, Status.FAILED, Status.SKIPPED, Status.STOPPED, Status.ERROR})


@dataclass
class CaseState:
    """Live and final state of one case; the runner owns it, listeners get copies."""

    index: int
    number: int
    case: Case
    status: Status = Status.PENDING
    picked: str | None = None
    prompt_tokens: int = 0
    gen_tokens: int = 0
    elapsed_s: float = 0.0
    think_close: str = "none"
    thinking: bool = False
    error: str = ""
    output: str = ""
    system_prompt: str = ""
    question_prompt: str = ""
    runs: int = 0
    repeat: int = 0          # which of --repeats K this is (0 .. K-1)
    prompt: RenderedPrompt | None = None
    tokens_known: bool = True
    latency: Latency = Latency()  # None figures: not measured, or the run was paused meanwhile
    endpoint: str = ""       # the endpoint that served it, when the backend names one ("": the run's)


# ---------------------------------------------------------------- events

@dataclass(frozen=True)
class RunStarted:
    total: int
    backend: str
    model: str
    n_ctx: int | None


@dataclass(frozen=True)
class StatusChanged:
    index: int
    status: Status


@dataclass(frozen=True)
class TextDelta:
    index: int
    text: str
    thinking: bool


@dataclass(frozen=True)
class Progress:
    """Token counts of the running case: prefill (done/total) and generated tokens."""
    index: int
    prompt_tokens: int
    prefill_done: int
    gen_tokens: int
    elapsed_s: float


@dataclass(frozen=True)
class CaseFinished:
    state: CaseState


@dataclass(frozen=True)
class Paused:
    paused: bool


@dataclass(frozen=True)
class RunFinished:
    states: tuple[CaseState, ...]
    wall_s: float
    stopped: bool


class TraceSink(Protocol):
    """Where a run's trace blocks go: a `TraceWriter` on config.trace by default, or what the
    caller gives as `trace_sink` (e.g. a Ray task's link to the driver, ds4eval.run.raycluster)."""

    def write_header(self, header: RunHeader) -> None: ...
    def write(self, rec: TraceRecord) -> None: ...
    def close(self) -> None: ...


class Listener(Protocol):
    def on_event(self, event: object) -> None: ...


# ---------------------------------------------------------------- backend seam

@dataclass(frozen=True)
class GenerationJob:
    """What a backend needs to run one case."""
    index: int
    case: Case
    system_prompt: str
    question_prompt: str
    max_tokens: int          # --tokens capped by the case's max_tokens; backends also cap by context
    temperature: float
    top_p: float
    min_p: float
    seed: int | None
    think: bool
    think_soft_reserve: int
    think_hard_reserve: int


@dataclass
class GenerationResult:
    output: str = ""
    prompt_tokens: int = 0
    gen_tokens: int = 0
    think_close: str = "none"   # none | natural | soft | hard | unclosed
    thinking: bool = False      # whether thinking mode was on for this case
    interrupted: str | None = None   # None, "stop" or "switch"
    skipped: str = ""           # reason the case could not run (e.g. prompt exceeds context)
    error: str = ""
    prompt: RenderedPrompt | None = None  # the ids fed to the model, when the backend tokenizes
    tokens_known: bool = True   # False: the backend could not count tokens (counts are 0)
    latency: Latency = Latency()  # TTFT, ITL, end to end, as the backend measured them (run.latency)
    endpoint: str = ""          # the endpoint that served it ("": the run's own, see provenance)


class CaseContext(Protocol):
    """Given to a backend for one case: report progress, stream text, obey controls."""

    def prefill(self, done: int, total: int) -> None: ...
    def started(self, prompt_tokens: int) -> None: ...
    def text(self, delta: str, thinking: bool) -> None: ...
    def token(self, n: int = 1) -> None: ...
    def checkpoint(self) -> str | None: ...


class Backend(Protocol):
    """`run_group(jobs, ctxs) -> results`, optional: several repeats of one case (same prompt,
    their own seeds) in one go, e.g. one request with the OpenAI `n`; the runner then hands it
    the queued repeats of a case together."""

    name: str
    model_name: str
    n_ctx: int | None
    max_concurrency: int

    def run_case(self, job: GenerationJob, ctx: CaseContext) -> GenerationResult: ...


# ---------------------------------------------------------------- outcomes

def outcome(case: Case, res: GenerationResult) -> tuple[Status, str | None]:
    """The status one generation ends in and the answer picked from its output, which is
    extracted and graded exactly once.

    What stopped the generation decides first, in this order: a switch (SWITCHED, not graded:
    the case runs again), a stop (STOPPED), a skip (SKIPPED), an error (ERROR); only an output
    that ran to its end gets a verdict (PASSED or FAILED). STOPPED, SKIPPED and ERROR still get
    the picked answer, to show what the model had committed to so far.
    """
    if res.interrupted == "switch":
        return Status.SWITCHED, None
    verdict = grade.grade_output(case.answer_kind, case.answer, res.output, case.aliases, case.nchoices)
    if res.interrupted == "stop":
        return Status.STOPPED, verdict.picked
    if res.skipped:
        return Status.SKIPPED, verdict.picked
    if res.error:
        return Status.ERROR, verdict.picked
    return (Status.PASSED if verdict.passed else Status.FAILED), verdict.picked


def effective_concurrency(config: EvalConfig, backend: Backend) -> int:
    """Cases a run has in flight at once: --concurrency (server backends) or --parallel (the
    engine's batched sessions), capped by what the backend takes."""
    wanted = max(config.concurrency, config.parallel or 1)
    return max(1, min(wanted, backend.max_concurrency))


# ---------------------------------------------------------------- the runner

class _RunControl:
    """What every thread of one run shares: its lock, the pause clock, the stop flag and the
    listeners.

    `lock` (re-entrant, with `cond` on it) is the run's one lock. It guards the flags here and,
    for the runner and its case contexts, the queue, the running cases and every CaseState, so
    that `snapshot()` never copies a case half-updated and a control never races a worker that
    is picking its next case. `emit` takes no lock and is called with it released: a listener
    may hold a lock of its own while another thread (a UI) calls `snapshot()`, and the two
    must not wait on each other.
    """

    def __init__(self, listeners: Sequence[Listener]):
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.listeners = list(listeners)
        self._paused = False
        self._pause_started = 0.0
        self._paused_s = 0.0
        self._stopped = False

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopped(self) -> bool:
        return self._stopped

    def pause(self) -> None:
        with self.cond:
            if not self._paused:
                self._paused = True
                self._pause_started = time.monotonic()

    def resume(self) -> None:
        with self.cond:
            if self._paused:
                self._paused = False
                self._paused_s += time.monotonic() - self._pause_started
                self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self._stopped = True
            self.cond.notify_all()

    def paused_total(self) -> float:
        """Seconds this run has spent paused so far, a pause in progress included."""
        with self.lock:
            return self._paused_s + (time.monotonic() - self._pause_started if self._paused else 0.0)

    def token_boundary(self, interrupt: Callable[[], str | None]) -> str | None:
        """A running case's token boundary: wait while the run is paused, until it resumes, stops
        or the case is interrupted; then "stop" when the run is stopping, else `interrupt()` (the
        case's own interrupt, None to go on). `interrupt` is called under the lock, which is
        where `Runner.run_next` sets it."""
        with self.cond:
            while self._paused and not self._stopped and interrupt() is None:
                self.cond.wait(0.2)
            if self._stopped:
                return "stop"
            return interrupt()

    def emit(self, event: object) -> None:
        # A copy: a listener added meanwhile gets the next event, not half of this one.
        for listener in list(self.listeners):
            listener.on_event(event)


class _Ctx:
    """CaseContext implementation bound to one running case.

    While a case runs, the worker running it is the only writer of its state. A status goes
    under the run's lock together with the fields a snapshot must see agree with it, and so does
    the growing output; the token counters are single stores of an int, which a snapshot may
    see a token late, and stay off the lock on the per-token path.
    """

    def __init__(self, control: _RunControl, state: CaseState):
        self.control, self.state = control, state
        self.interrupt: str | None = None   # "switch", set under the run's lock by Runner.run_next
        self._clock_start = time.monotonic()
        self._paused_s_at_start = control.paused_total()

    def elapsed(self) -> float:
        """Seconds this case has run, the run's pauses since it started left out."""
        paused = self.control.paused_total() - self._paused_s_at_start
        return time.monotonic() - self._clock_start - paused

    def was_paused(self) -> bool:
        """Whether the run was paused at some time while this case ran."""
        return self.control.paused_total() != self._paused_s_at_start

    def prefill(self, done: int, total: int) -> None:
        self.state.prompt_tokens = total
        self.control.emit(Progress(self.state.index, total, done, self.state.gen_tokens, self.elapsed()))

    def started(self, prompt_tokens: int) -> None:
        with self.control.lock:
            self.state.prompt_tokens = prompt_tokens
            self.state.status = Status.THINKING
        self.control.emit(StatusChanged(self.state.index, Status.THINKING))

    def text(self, delta: str, thinking: bool) -> None:
        if delta:
            with self.control.lock:
                self.state.output += delta
            self.control.emit(TextDelta(self.state.index, delta, thinking))

    def token(self, n: int = 1) -> None:
        self.state.gen_tokens += n
        self.control.emit(Progress(self.state.index, self.state.prompt_tokens, self.state.prompt_tokens,
                                   self.state.gen_tokens, self.elapsed()))

    def checkpoint(self) -> str | None:
        return self.control.token_boundary(lambda: self.interrupt)


class Runner:
    """Runs cases through a backend; see the module docstring for the contract."""

    def __init__(self, config: EvalConfig, cases: Sequence[Case], backend: Backend,
                 listeners: Sequence[Listener] = (), *, numbers: Sequence[int] | None = None,
                 repeats: Sequence[int] | None = None, keep_alive: bool = False,
                 shard_header: Mapping[str, object] | None = None, trace_sink: TraceSink | None = None):
        self.config = config
        self.shard_header = dict(shard_header or {})  # RunHeader's shard fields (ds4eval.run.shards)
        self.backend = backend
        self.keep_alive = keep_alive
        nums = list(numbers) if numbers is not None else list(range(1, len(cases) + 1))
        if len(nums) != len(cases) or (repeats is not None and len(repeats) != len(cases)):
            raise ValueError("numbers and repeats must match cases")
        # Each entry runs once at its given repeat index, or (by default) config.repeats times;
        # the repeats of a case stay adjacent so that --parallel decodes them together.
        todo = ([(c, n, r) for c, n, r in zip(cases, nums, repeats)] if repeats is not None else
                [(c, n, r) for c, n in zip(cases, nums) for r in range(config.repeats)])
        self.states = [CaseState(index=i, number=n, case=c, repeat=r) for i, (c, n, r) in enumerate(todo)]
        self._control = _RunControl(listeners)
        self._lock, self._cond = self._control.lock, self._control.cond
        self._queue: collections.deque[int] = collections.deque(range(len(self.states)))
        self._running: dict[int, _Ctx] = {}
        self._trace = trace_sink or (TraceWriter(config.trace) if config.trace else None)
        self.wall_s = 0.0
        self._provenance: dict[str, str] | None = None

    @property
    def listeners(self) -> list[Listener]:
        """The live list of listeners: one appended before `run()` gets every event."""
        return self._control.listeners

    # ------------------------------------------------------------ controls

    def pause(self) -> None:
        self._control.pause()
        self._control.emit(Paused(True))

    def resume(self) -> None:
        self._control.resume()
        self._control.emit(Paused(False))

    @property
    def paused(self) -> bool:
        return self._control.paused

    def stop(self) -> None:
        self._control.stop()
        interrupt = getattr(self.backend, "interrupt", None)
        if interrupt is not None:  # optional: wakes a backend blocked between tokens (a silent server)
            interrupt()

    def run_next(self, index: int) -> bool:
        """Run case `index` as soon as possible. Returns False if it is already running."""
        with self._cond:
            st = self.states[index]
            if st.status.running or index in self._running:
                return False
            if index in self._queue:
                self._queue.remove(index)
            self._reset(st)
            self._queue.appendleft(index)
            if len(self._running) >= self._slots():
                victim = min(self._running)  # deterministic choice: the lowest running index
                self._running[victim].interrupt = "switch"
            self._cond.notify_all()
        return True

    def rerun(self, index: int) -> bool:
        """Queue a finished (or stopped) case to run again next. False if it is not finished."""
        with self._cond:
            st = self.states[index]
            if not st.status.finished:
                return False
            self._reset(st)
            self._queue.appendleft(index)
            self._cond.notify_all()
        self._control.emit(StatusChanged(index, Status.PENDING))
        return True

    def snapshot(self) -> list[CaseState]:
        with self._lock:
            return [copy.copy(s) for s in self.states]

    # ------------------------------------------------------------ running

    def run(self) -> list[CaseState]:
        start = time.monotonic()
        if self._trace:
            # Every selected case, before any of them starts: a killed run can then be retried
            # in full, cases that never started included.
            cases = tuple(dict.fromkeys((st.number, st.case.source, st.case.id) for st in self.states))
            self._trace.write_header(RunHeader(self.config.suite, cases, self.config.repeats, **self.shard_header))
        self._control.emit(RunStarted(len(self.states), self.backend.name, self.backend.model_name,
                                      self.backend.n_ctx))
        workers = [threading.Thread(target=self._worker, name=f"ds4eval-worker-{i}", daemon=True)
                   for i in range(self._slots())]
        try:
            if len(workers) == 1:
                self._worker()
            else:
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
        finally:
            if self._trace:
                self._trace.close()
        self.wall_s = time.monotonic() - start - self._control.paused_total()
        states = self.snapshot()
        self._control.emit(RunFinished(tuple(states), self.wall_s, self._control.stopped))
        return states

    def _slots(self) -> int:
        return effective_concurrency(self.config, self.backend)

    def _worker(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._control.stopped:
                        return
                    if self._queue and not self._control.paused:
                        index = self._queue.popleft()
                        break
                    if not self._queue and not self._running and not self.keep_alive:
                        self._cond.notify_all()
                        return
                    self._cond.wait(0.2)
                group = self._take_group(index)
                ctxs = []
                for i in group:
                    state = self.states[i]
                    ctxs.append(_Ctx(self._control, state))
                    self._running[i] = ctxs[-1]
                    state.status = Status.PREFILL
                    state.runs += 1
            for i in group:
                self._control.emit(StatusChanged(i, Status.PREFILL))
            try:
                if len(group) == 1:
                    self._run_one(self.states[index], ctxs[0])
                else:
                    self._run_group([self.states[i] for i in group], ctxs)
            finally:
                with self._cond:
                    for i, ctx in zip(group, ctxs):
                        # Only our own entry: a case switched out is back in the queue, and
                        # another worker may already have taken it up again.
                        if self._running.get(i) is ctx:
                            del self._running[i]
                    self._cond.notify_all()

    def _take_group(self, index: int) -> list[int]:
        """`index` and, for a backend that can run several samples of one prompt in one request
        (`run_group`, e.g. a server's `n`), the other queued repeats of the same case."""
        if self.config.repeats <= 1 or getattr(self.backend, "run_group", None) is None:
            return [index]
        st, group = self.states[index], [index]
        for j in list(self._queue):
            if len(group) >= self.config.repeats:
                break
            other = self.states[j]
            if other.case is st.case and other.number == st.number:
                group.append(j)
                self._queue.remove(j)
        return group

    def job(self, state: CaseState) -> GenerationJob:
        """What the backend is given to run `state`'s case: its prompts, its token budget
        (--tokens capped by the case's max_tokens) and the sampling settings of its repeat."""
        c, cfg = state.case, self.config
        budget = min(cfg.tokens, c.max_tokens) if c.max_tokens else cfg.tokens
        return GenerationJob(
            index=state.index, case=c, system_prompt=prompts.system_prompt(),
            question_prompt=prompts.question_prompt(c), max_tokens=budget,
            temperature=cfg.temperature, top_p=cfg.top_p, min_p=cfg.min_p, seed=self.seed(state),
            think=cfg.think, think_soft_reserve=cfg.think_soft_reserve,
            think_hard_reserve=cfg.think_hard_reserve)

    def _start(self, state: CaseState) -> GenerationJob:
        job = self.job(state)
        with self._lock:
            state.system_prompt, state.question_prompt = job.system_prompt, job.question_prompt
            state.output = ""
            state.gen_tokens = 0
        return job

    @staticmethod
    def _failed(state: CaseState, e: Exception) -> GenerationResult:
        return GenerationResult(output=state.output, prompt_tokens=state.prompt_tokens,
                                gen_tokens=state.gen_tokens, error=f"{type(e).__name__}: {e}")

    def _run_one(self, state: CaseState, ctx: _Ctx) -> None:
        job = self._start(state)
        try:
            res = self.backend.run_case(job, ctx)
        except Exception as e:  # a backend failure ends this case, never the run
            res = self._failed(state, e)
        self._finish(state, ctx, res)

    def _run_group(self, states: list[CaseState], ctxs: list[_Ctx]) -> None:
        jobs = [self._start(st) for st in states]
        try:
            results = self.backend.run_group(jobs, ctxs)
        except Exception as e:  # as in _run_one: every repeat of the group ends ERROR
            results = [self._failed(st, e) for st in states]
        for st, ctx, res in zip(states, ctxs, results):
            self._finish(st, ctx, res)

    def _finish(self, state: CaseState, ctx: _Ctx, res: GenerationResult) -> None:
        elapsed = ctx.elapsed()
        # Graded before taking the lock: `outcome` is pure and reads only this worker's result
        # and the (frozen) case, and extracting from a long output should not hold up the other
        # workers' tokens or a snapshot.
        status, picked = outcome(state.case, res)
        with self._lock:
            state.output = res.output
            state.prompt_tokens = res.prompt_tokens
            state.gen_tokens = res.gen_tokens
            state.tokens_known = res.tokens_known
            state.think_close = res.think_close
            state.thinking = res.thinking
            state.elapsed_s = elapsed
            state.error = res.error or res.skipped
            state.prompt = res.prompt
            state.endpoint = res.endpoint
            # A pause stops the case's clock but not the server's or the stream's: its latency
            # figures would measure the pause, so they are dropped as unknown.
            state.latency = Latency() if ctx.was_paused() else res.latency
            state.status, state.picked = status, picked
            if status is Status.SWITCHED:
                # Back into the queue right after the case that asked to run now.
                pos = 1 if self._queue else 0
                self._queue.insert(pos, state.index)
            final = copy.copy(state)
        self._control.emit(StatusChanged(state.index, final.status))
        if final.status is Status.SWITCHED:
            return
        if self._trace:
            self._trace.write(self.trace_record(final))
        self._control.emit(CaseFinished(final))

    def trace_record(self, st: CaseState) -> TraceRecord:
        cfg = self.config
        return TraceRecord(
            index=st.number, source=st.case.source, id=st.case.id, status=st.status.value,
            picked=st.picked, expected=st.case.answer, answer_kind=st.case.answer_kind,
            aliases=list(st.case.aliases), nchoices=st.case.nchoices, domain=st.case.domain,
            suite=cfg.suite, model=self.backend.model_name, backend=self.backend.name,
            prompt_tokens=st.prompt_tokens, gen_tokens=st.gen_tokens, elapsed_s=st.elapsed_s,
            ttft_s=st.latency.ttft_s, itl_s=st.latency.itl_s, itl_max_s=st.latency.itl_max_s,
            itl_per=st.latency.itl_per, e2e_s=st.latency.e2e_s,
            temperature=cfg.temperature, top_p=cfg.top_p, min_p=cfg.min_p, seed=self.seed(st),
            repeat=st.repeat, thinking=st.thinking, think_close=st.think_close, error=st.error,
            system_prompt=st.system_prompt, question_prompt=st.question_prompt, model_output=st.output,
            **self.provenance_fields(st))

    def seed(self, st: CaseState) -> int | None:
        """The seed of one repeat: the run's seed plus the repeat index (None stays None)."""
        return None if self.config.seed is None else self.config.seed + st.repeat

    def provenance(self) -> dict[str, str]:
        """The run's provenance (ds4eval.run.provenance.run_provenance), computed once."""
        if self._provenance is None:
            # Outside the lock: the first run on a model file hashes it (cached afterwards).
            found = run_provenance(self.backend, model_file=self.config.model_file, api_key=self.config.api_key)
            with self._lock:
                self._provenance = self._provenance or found
        return dict(self._provenance)

    def provenance_fields(self, st: CaseState) -> dict:
        """The provenance fields of one case's trace record."""
        prompt = st.prompt
        served = {"endpoint": st.endpoint} if st.endpoint else {}
        return {**self.provenance(), **served, "case_hash": case_hash(st.case), "max_tokens": self.job(st).max_tokens,
                "concurrency": self._slots(),
                "prompt_sha256": prompt.sha256 if prompt else "",
                "rendered_prompt": prompt.text if prompt else "",
                "rendered_token_ends": prompt.ends_field if prompt else ""}

    # ------------------------------------------------------------ internals

    def _reset(self, st: CaseState) -> None:
        st.status = Status.PENDING
        st.picked = None
        st.error = ""
        st.output = ""
        st.gen_tokens = 0
        st.think_close = "none"
        st.tokens_known = True
        st.latency = Latency()
        st.endpoint = ""
