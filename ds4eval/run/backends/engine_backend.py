"""Engine backend: runs cases in-process through the `engine` package's public API.

Contract
- `EngineBackend(model, engine=None, parallel=None, engine_thread=None, *, own_thread=False,
  step_log=None)` wraps a model (`engine.protocols.ModelLike`, load_model's result) and takes
  the engine's types from `engine`, any object satisfying `engine.protocols.EngineAPI`
  (default: the `engine` package; tests pass a fake); `EngineBackend.load(config)` loads one.
  With a `step_log` (ds4eval.run.steplog, --step-log) the batched scheduler hands it a record
  of each step.
- Threads: every engine call, from loading the model to the last token, runs on one
  `engine.threads.EngineThread` (torch's OpenMP pool is per calling thread, and two pools on
  the same cores make every kernel wait passively; engine/threads.py says why).  The runner's
  worker threads only render, tokenize and wait.
- Serial (parallel None, the default): one session is reused across cases so the shared
  system-prompt prefix is prefilled once; each case's generation loop runs on the engine
  thread while the runner's worker waits for it.
- Batched (`--parallel N`, any N >= 1): a `SchedulerThread` loop on the engine thread drives
  the engine's `BatchScheduler` of N slots; the runner's N worker threads each submit their
  case as `GenRequest`s and get its tokens back through `on_token` into a per-case queue,
  so N cases decode together in one forward pass per step. The engine thread hands a case's
  tokens over in batches (`_BatchedCase.take`): the first at once, then at most one batch per
  `HANDOVER_S` and the rest when the request ends, so that N workers do not each wake, take
  the interpreter's lock and emit events for every token of every step, which on a short
  step (a GPU's, or a small model's) costs more host time than the step itself (measured
  with `ds4-bench product --streams N`: the ds4-eval-xN path against the engine's own N rows).
  Every case starts from a fresh
  session (its slot is emptied first): with the packed int4 kernels a reused prefix moves the
  prefill chunk boundaries, which can move logits slightly, so reuse would make a case's
  trace depend on which case ran before it in the same slot. With fresh sessions
  `--parallel 4` gives the same greedy traces as `--parallel 1` (batched rows equal single
  rows up to the matmul kernels' blocking; engine.batch states the tolerance), and a
  case's output does not depend on the order or the selection of cases.
- Budget: min(job.max_tokens, n_ctx - prompt tokens), counting injected think-close tokens;
  the session never holds more than n_ctx tokens. A prompt that leaves no room is SKIPPED.
- Thinking: on when the job asks for it and the model has a single-token `</think>`. If the
  model is still thinking when few budget tokens remain it first gets a nudge to conclude
  (think_close "soft"), then the block is closed for it and the answer requested ("hard").
  The recorded output starts with `<think>` when the prompt opened the block, so extraction
  sees exactly what the model's reply contains. Both paths take the same decisions
  (`injection_due`, `ThinkText`). Batched, the decision is taken on the engine thread as
  each token arrives: when an injection is due before the next token, the request ends
  (cancelled, its last token already evaluated) and the case continues in the same slot
  with a new request whose ids are the history plus the injected ids, so the slot prefills
  only the injected ids. The scheduler therefore needs no support for injection; the
  injected ids are evaluated as one prefill chunk rather than token by token as serially.
- Provenance: `provenance()` reports the model file, chat template hash, BOS/EOS handling,
  device and KV cache type; each result carries the rendered prompt's token hash and texts.
- Latency (`ds4eval.run.latency`): the clock starts when the runner hands the case over, each
  sampled token is an arrival (marked on the engine thread as it is sampled), and the case
  ends after its last token; so TTFT is rendering, any wait for a batch slot and prefill, and
  the gaps are decode steps (with an injected think-close evaluated inside one of them).
- Pause, stop and switch: the serial loop calls `ctx.checkpoint()` before every token; the
  batched path calls it from the requests' cancel hook on the engine thread, so a pause
  holds the whole batch and stop/switch end the request before its next token.
It does not grade, write traces or talk HTTP.
"""

from __future__ import annotations

import math
import queue
import time
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from ds4eval.cases import prompts
from ds4eval.cases.extract import THINK_CLOSE, THINK_OPEN
from ds4eval.config import EvalConfig
from ds4eval.run.latency import LatencyClock
from ds4eval.run.provenance import RenderedPrompt, text_sha256, token_pieces
from ds4eval.run.runner import CaseContext, GenerationJob, GenerationResult
from ds4eval.run.steplog import StepLog
from engine.protocols import EngineAPI, ModelLike
from engine.threads import EngineThread


def model_supports_thinking(model) -> bool:
    """True when `</think>` is one special token (the template can then toggle thinking)."""
    try:
        return len(model.tokenize(THINK_CLOSE, special=True)) == 1 and \
            len(model.tokenize(THINK_OPEN, special=True)) == 1
    except Exception:
        return False


# ---------------------------------------------------------------- shared decisions (pure)

def injection_due(in_think: bool, close_kind: str, left: int, soft_reserve: int, hard_reserve: int,
                  n_soft: int, n_hard: int) -> str | None:
    """Which think-close text to inject before the next token: "hard", "soft" or None.

    `left` is the budget not yet spent; n_soft / n_hard are the token counts of the nudge
    and of the hard close. An injection that would not fit is not made (the model samples).
    """
    if in_think and left <= hard_reserve:
        return "hard" if n_hard < left else None
    if in_think and close_kind == "none" and left <= soft_reserve and n_soft + hard_reserve < left:
        return "soft"
    return None


@dataclass
class ThinkText:
    """The reply text so far and whether the model is inside a thinking block."""

    think: bool
    out: list[str] = field(default_factory=list)
    in_think: bool = False
    close_kind: str = "none"
    tail: str = ""  # last few characters, so a marker split across pieces is still seen

    def emit(self, piece: str) -> bool | None:
        """Append a piece; returns its 'thinking' flag for display, None for an empty piece."""
        if not piece:
            return None
        was = self.in_think
        self.out.append(piece)
        if self.think:
            window = self.tail + piece
            if not self.in_think:
                j = window.rfind(THINK_OPEN)
                if j >= 0 and THINK_CLOSE not in window[j:]:
                    self.in_think = True
            elif THINK_CLOSE in window:
                self.in_think = False
                if self.close_kind == "none":
                    self.close_kind = "natural"
            self.tail = window[-len(THINK_CLOSE):]
        return was or self.in_think


@dataclass
class _Plan:
    """What a case needs before generating: prompt, budget, reserves, injected token counts."""

    ids: list[int]
    text: str
    think: bool
    budget: int
    soft_reserve: int
    hard_reserve: int
    n_soft: int
    n_hard: int


# ---------------------------------------------------------------- batched path

HANDOVER_S = 0.02
"""Longest a batched case's generated tokens wait on the engine thread before its worker gets
them (progress and text shown at 50 Hz at most; latency is marked where each token is made)."""

@dataclass
class _Segment:
    """One GenRequest of a case; the engine thread owns it until its 'end' message."""

    case: "_BatchedCase"
    request: Any = None
    stop: bool = False  # an injection is due: end before the next token
    interrupt: str | None = None  # "stop" / "switch" from ctx.checkpoint()


class _BatchedCase:
    """Per-case state shared by its worker thread and the engine thread (handed over, never shared)."""

    def __init__(self, plan: _Plan, ctx: CaseContext, model: Any, text: ThinkText):
        self.plan, self.ctx, self.model, self.text = plan, ctx, model, text
        self.stream = model.text_stream()
        self.events: queue.Queue = queue.Queue()
        self.slot: int | None = None
        self.used = 0
        self.sampled = 0
        self.history = list(plan.ids)
        # Engine thread only: tokens made since the last hand-over and their text, as runs of
        # (text, thinking flag) with one flag each; and when the last hand-over went.
        self._n_pending = 0
        self._runs: list[tuple[str, bool]] = []
        self._handed_at = -math.inf

    def take(self, piece: str, flag: bool | None, now: float) -> None:
        """Engine thread: one generated token and its text (flag None: no text), handed to the
        worker with those before it once `HANDOVER_S` has passed since the last hand-over."""
        self._n_pending += 1
        if flag is not None:
            if self._runs and self._runs[-1][1] == flag:
                self._runs[-1] = (self._runs[-1][0] + piece, flag)
            else:
                self._runs.append((piece, flag))
        if now - self._handed_at >= HANDOVER_S:
            self.hand_over(now)

    def hand_over(self, now: float) -> None:
        """Engine thread: what `take` holds goes to the worker now (before a segment's end)."""
        if self._n_pending:
            self.events.put(("tokens", self._n_pending, self._runs))
            self._n_pending, self._runs, self._handed_at = 0, [], now

    def due(self) -> str | None:
        p = self.plan
        return injection_due(self.text.in_think, self.text.close_kind, p.budget - self.used, p.soft_reserve,
                             p.hard_reserve, p.n_soft, p.n_hard)


class SchedulerThread:
    """A BatchScheduler's loop, run on the engine thread; cases reach it through `submit` and `release`."""

    def __init__(self, engine: EngineAPI, model: ModelLike, n_slots: int, n_ctx: int,
                 engine_thread: EngineThread, observer: Callable[[Any], None] | None = None):
        self.engine, self.model, self.observer = engine, model, observer
        # Raises engine.CapacityError (with the figures) when n_slots sessions do not fit.
        self.scheduler = engine_thread.call(engine.BatchScheduler, model, n_slots, ctx=n_ctx, observer=observer)
        self.owner: list[_BatchedCase | None] = [None] * n_slots
        self.inbox: queue.Queue = queue.Queue()
        self.active: list[_Segment] = []
        self.waiting: list[_Segment] = []
        self._loop_done = engine_thread.submit(self._loop)

    def submit(self, seg: _Segment) -> None:
        self.inbox.put(("submit", seg))

    def release(self, case: _BatchedCase) -> None:
        self.inbox.put(("release", case))

    def close(self) -> None:
        self.inbox.put(("close", None))
        try:
            self._loop_done.result(timeout=30)
        except FuturesTimeout:
            pass

    # --- engine thread ---
    def _take(self, msg: tuple[str, Any]) -> bool:
        """Apply one message; False when it asks the thread to end."""
        kind, obj = msg
        if kind == "submit":
            self.waiting.append(obj)
        elif kind == "release":
            self.owner = [None if o is obj else o for o in self.owner]
        return kind != "close"

    def _loop(self) -> None:
        while True:
            # Block only when nothing decodes; otherwise pick up what arrived and step on.
            try:
                msgs = [self.inbox.get(block=not self.active)]
            except queue.Empty:
                msgs = []
            while True:
                try:
                    msgs.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            if not all(self._take(m) for m in msgs):
                return
            self._start_waiting()
            if not self.active:
                continue
            try:
                self.scheduler.step()
            except Exception as e:  # an engine failure ends the cases in flight, never the thread
                for seg in self.active:
                    seg.case.hand_over(time.monotonic())
                    seg.case.events.put(("failed", f"{type(e).__name__}: {e}"))
                self._reset_after_failure()
                continue
            still = []
            for seg in self.active:
                if seg.request.done:
                    seg.case.hand_over(time.monotonic())
                    seg.case.events.put(("end", seg))
                else:
                    still.append(seg)
            self.active = still

    def _reset_after_failure(self) -> None:
        # The scheduler's state is unknown after a failed step: start again with empty slots.
        # Cases in flight got "failed" and release their slots as usual.
        n = len(self.scheduler.slots)
        self.scheduler = self.engine.BatchScheduler(self.model, n, ctx=self.model.n_ctx, check_memory=False,
                                                    observer=self.observer)
        self.active = []

    def _start_waiting(self) -> None:
        rest = []
        for seg in self.waiting:
            case = seg.case
            if case.slot is None:
                free = [i for i, o in enumerate(self.owner) if o is None]
                if not free:
                    rest.append(seg)
                    continue
                case.slot = free[0]
                self.owner[case.slot] = case
                # A fresh session: the case's prefill starts at position 0 (see the module docstring).
                self.scheduler.slots[case.slot].session.truncate(0)
            seg.request.slot = case.slot
            self.scheduler.submit(seg.request)
            self.active.append(seg)
        self.waiting = rest


# ---------------------------------------------------------------- the backend

class EngineBackend:
    name = "engine"

    def __init__(self, model: ModelLike, engine: EngineAPI | None = None, parallel: int | None = None,
                 engine_thread: EngineThread | None = None, *, own_thread: bool = False,
                 step_log: StepLog | None = None):
        """`engine` provides SamplingParams and Cancelled (default: the `engine` package);
        `parallel` N uses its BatchScheduler, GenRequest and Sampler too.  All engine work runs
        on `engine_thread` (the thread the model was loaded on, see `load`); without one the
        backend starts its own and closes it in `close()`, and `own_thread=True` hands it a
        given one to close the same way.  `step_log` collects the batched scheduler's steps
        (--step-log)."""
        if engine is None:
            import engine
        self.engine = engine
        self.model = model
        self.model_name = model.name
        self.n_ctx = model.n_ctx
        self.supports_thinking = model_supports_thinking(model)
        self.parallel = parallel
        self.max_concurrency = 1 if parallel is None else parallel
        self._owns_thread = engine_thread is None or own_thread
        self.engine_thread = engine_thread or EngineThread("ds4eval-engine")
        self._session = None
        self.step_log = step_log
        self._scheduler = (SchedulerThread(engine, model, parallel, model.n_ctx, self.engine_thread,
                                           observer=step_log.add if step_log is not None else None)
                           if parallel is not None else None)

    @classmethod
    def load(cls, config: EvalConfig, note: Callable[[str], None] = lambda line: None) -> "EngineBackend":
        """The model of `config` loaded on an engine thread of its own and, unless `config.warmup`
        is off, warmed up for the run's batches (`Model.warm_up`; `note` gets its line where it
        ran: on CUDA)."""
        import engine

        thread = EngineThread("ds4eval-engine", threads=config.threads)
        try:
            model = thread.call(engine.load_model, config.model, ctx=config.ctx, device=config.device,
                                kv_type=config.kv_type, batch_invariant=config.batch_invariant)
            if config.warmup:
                done = thread.call(model.warm_up, config.parallel or 1)
                if done.plan is not None:
                    note(done.describe())
            backend = cls(model, engine, parallel=config.parallel, engine_thread=thread, own_thread=True,
                          step_log=StepLog() if config.step_log else None)
        except BaseException:
            thread.close()
            raise
        return backend

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
        if self._owns_thread:
            self.engine_thread.close(timeout=30)

    def provenance(self) -> dict[str, str]:
        """What this backend knows about how it runs the model (see ds4eval.run.provenance): the
        model file, the chat template's hash, BOS/EOS handling, device (with the engine's CPU
        kernel path, e.g. "cpu:avx2") and KV cache type."""
        m = self.model
        meta = getattr(m, "metadata", None)
        template = meta.get("tokenizer.chat_template") if meta is not None else None
        eos = ",".join(str(i) for i in sorted(m.eos_ids))
        return {"model_path": str(getattr(m, "path", "") or ""),
                "chat_template_sha256": text_sha256(str(template)) if template else ("" if meta is None else "none"),
                "bos_eos": f"add_bos={'yes' if getattr(m, 'add_bos', False) else 'no'} bos={m.bos_id} eos={eos}",
                "device": ":".join(x for x in (str(getattr(m, "device", "") or ""),
                                                getattr(m, "cpu_kernel_path", None) or "") if x),
                "kv_type": str(getattr(m, "kv_dtype", "") or "").removeprefix("torch."),
                "gen_tokens_eos": "yes"}  # every sampled token is counted, the EOS that ends a reply too

    def render(self, job: GenerationJob, think: bool) -> str:
        messages = [{"role": "system", "content": job.system_prompt},
                    {"role": "user", "content": job.question_prompt}]
        extra = {"enable_thinking": think} if self.supports_thinking else {}
        # Prompt text: a control-token spelling inside a benchmark question stays text.
        return self.model.render_prompt(messages, add_generation_prompt=True, **extra)

    def prompt_ids(self, text: str) -> list[int]:
        return self.model.prompt_ids(self.model.tokenize_prompt(text))

    def _plan(self, job: GenerationJob) -> tuple[_Plan, GenerationResult]:
        think = job.think and self.supports_thinking
        text = self.render(job, think)
        ids = self.prompt_ids(text)
        budget = min(job.max_tokens, self.n_ctx - len(ids))
        res = GenerationResult(prompt_tokens=len(ids), thinking=think)
        res.prompt = RenderedPrompt.of(ids, token_pieces(self.model, ids))
        n_soft = len(self.model.tokenize(prompts.THINK_SOFT_NUDGE, special=True))
        n_hard = len(self.model.tokenize(prompts.THINK_HARD_CLOSE, special=True))
        plan = _Plan(ids, text, think, budget, min(job.think_soft_reserve, max(budget, 0) // 4),
                     min(job.think_hard_reserve, max(budget, 0) // 8), n_soft, n_hard)
        if budget <= 0:
            res.skipped = f"prompt has {len(ids)} tokens, context is {self.n_ctx}: no room to answer"
        return plan, res

    def _params(self, job: GenerationJob):
        return self.engine.SamplingParams(temperature=job.temperature, top_p=job.top_p, min_p=job.min_p,
                                       seed=job.seed)

    @staticmethod
    def _open_think(plan: _Plan, text: ThinkText) -> str:
        """When the prompt opened a thinking block, the reply starts inside it; returns the text to show."""
        if plan.think and plan.text.rstrip().endswith(THINK_OPEN):
            text.in_think = True
            text.out.append(THINK_OPEN + "\n")
            return text.out[-1]
        return ""

    @staticmethod
    def _finish(res: GenerationResult, plan: _Plan, text: ThinkText, sampled: int,
                clock: LatencyClock) -> GenerationResult:
        close_kind = "unclosed" if text.in_think else text.close_kind
        res.output = "".join(text.out)
        res.gen_tokens = sampled
        res.latency = clock.finish(sampled)
        res.think_close = close_kind if plan.think else "none"
        return res

    def run_case(self, job: GenerationJob, ctx: CaseContext) -> GenerationResult:
        clock = LatencyClock()  # the case handed over: TTFT counts rendering, a wait for a slot and prefill
        plan, res = self._plan(job)
        if res.skipped:
            return res
        if self._scheduler is not None:
            return self._run_batched(job, ctx, plan, res, clock)
        return self.engine_thread.call(self._run_serial, job, ctx, plan, res, clock)

    # --- serial ---
    def _run_serial(self, job: GenerationJob, ctx: CaseContext, plan: _Plan, res: GenerationResult,
                    clock: LatencyClock) -> GenerationResult:
        if self._session is None:
            self._session = self.model.new_session()
        session = self._session
        n_prompt = len(plan.ids)
        ctx.prefill(0, n_prompt)
        try:
            session.sync(plan.ids, progress=ctx.prefill, cancel=lambda: ctx.checkpoint() is not None)
        except self.engine.Cancelled:
            res.interrupted = ctx.checkpoint() or "stop"
            return res
        ctx.started(n_prompt)

        params = self._params(job)
        stream = self.model.text_stream()
        text = ThinkText(plan.think)
        opened = self._open_think(plan, text)
        if opened:
            ctx.text(opened, True)
        used = sampled = 0  # budget spent (sampled plus injected tokens); sampled tokens

        def emit(piece: str) -> None:
            flag = text.emit(piece)
            if flag is not None:
                ctx.text(piece, flag)

        def inject(s: str) -> int:
            toks = self.model.tokenize(s, special=True)
            for t in toks:
                session.eval(t)
                emit(stream.push(t))
            return len(toks)

        while used < plan.budget:
            why = ctx.checkpoint()
            if why:
                res.interrupted = why
                break
            due = injection_due(text.in_think, text.close_kind, plan.budget - used, plan.soft_reserve,
                                plan.hard_reserve, plan.n_soft, plan.n_hard)
            if due is not None:
                used += inject(prompts.THINK_HARD_CLOSE if due == "hard" else prompts.THINK_SOFT_NUDGE)
                text.close_kind = due
                if due == "hard":
                    text.in_think = False
                continue
            tok = session.sample(params)
            clock.arrival()
            used += 1
            sampled += 1
            ctx.token()
            if tok in self.model.eos_ids:
                break
            emit(stream.push(tok))
            if used < plan.budget:
                session.eval(tok)
        emit(stream.flush())
        return self._finish(res, plan, text, sampled, clock)

    # --- batched ---
    def _run_batched(self, job: GenerationJob, ctx: CaseContext, plan: _Plan, res: GenerationResult,
                     clock: LatencyClock) -> GenerationResult:
        scheduler = self._scheduler
        params = self._params(job)
        sampler = self.engine.Sampler(params, self.model.eos_ids)  # one random stream across the case's requests
        text = ThinkText(plan.think)
        case = _BatchedCase(plan, ctx, self.model, text)
        eos = self.model.eos_ids

        def segment() -> _Segment:
            seg = _Segment(case)

            def on_token(tok: int) -> None:  # engine thread
                clock.arrival()  # marked where the token is made, not when the worker reads it
                case.used += 1
                case.sampled += 1
                if tok in eos:
                    case.take("", None, time.monotonic())
                    return
                case.history.append(tok)
                piece = case.stream.push(tok)
                case.take(piece, text.emit(piece), time.monotonic())
                if case.used < plan.budget and case.due() is not None:
                    seg.stop = True

            def cancel() -> bool:  # engine thread, before each prefill chunk and each token
                if seg.stop or seg.interrupt:
                    return True
                why = ctx.checkpoint()  # blocks while paused: the whole batch waits
                if why:
                    seg.interrupt = why
                    return True
                return False

            seg.request = self.engine.GenRequest(ids=list(case.history), params=params, max_tokens=plan.budget - case.used,
                                         on_token=on_token, cancel=cancel, choose=sampler)
            return seg

        def inject(s: str) -> int:
            toks = self.model.tokenize(s, special=True)
            for t in toks:
                case.history.append(t)
                piece = case.stream.push(t)
                flag = text.emit(piece)
                if flag is not None:
                    ctx.text(piece, flag)
            return len(toks)

        ctx.prefill(0, len(plan.ids))
        opened = self._open_think(plan, text)  # shown once the first token arrived, after ctx.started
        started = False
        try:
            while case.used < plan.budget:
                due = case.due()
                if due is not None:
                    case.used += inject(prompts.THINK_HARD_CLOSE if due == "hard" else prompts.THINK_SOFT_NUDGE)
                    text.close_kind = due
                    if due == "hard":
                        text.in_think = False
                    continue
                scheduler.submit(segment())
                while True:
                    kind, *rest = case.events.get()
                    if kind == "tokens":
                        if not started:
                            started = True
                            ctx.started(len(plan.ids))
                            if opened:
                                ctx.text(opened, True)
                        n, runs = rest
                        ctx.token(n)
                        for piece, flag in runs:
                            ctx.text(piece, flag)
                    elif kind == "failed":
                        res.error = rest[0]
                        return self._finish(res, plan, text, case.sampled, clock)
                    else:
                        seg = rest[0]
                        break
                req = seg.request
                if req.finish == "error":
                    res.error = req.error or "generation failed"
                    break
                if seg.interrupt:
                    res.interrupted = seg.interrupt
                    break
                if req.finish != "cancelled" or not seg.stop:
                    break  # end of generation, budget or context reached
        finally:
            scheduler.release(case)
        piece = case.stream.flush()
        flag = text.emit(piece)
        if flag is not None:
            ctx.text(piece, flag)
        return self._finish(res, plan, text, case.sampled, clock)
