"""Jobs: what the APIs submit, what they hear back, and the ledger both inference loops share.

- Requests: `GenerationRequest` (already rendered and tokenized, API-independent) with its
  `SamplingSpec`; `sampling_params(engine.SamplingParams, spec)` turns the spec into the
  engine's sampling parameters, `decode_budget(model, request, n_prompt)` bounds the tokens to generate.
  `run_to_end(steps)` runs a generator of steps (an interruptible prefill or scoring) at once.
- Events, in order: `PrefillProgress`*, `server.scoring.PromptScored` (only when the request
  asks for prompt log-probs), `PromptReady`, `TextDelta`*, then one `Finished` (or `Failed`);
  `Usage` rides on `Finished`.
- `Job`: a request plus its cancel flag (thread-safe) and event sink; `JobStats` what the
  loop measured, queue times included (`job_line` is its line in the request log).
- `TokenDecoder`: what happens to each generated token of one job (the decoding constraint,
  greedy inside tool-call structure, UTF-8-safe text, stop sequences, splitter events),
  whoever runs the forward passes.
- `JobLedger`: the submitted jobs grouped by client request (`submit_request`: a request's
  choices or prompts), the stop request, and the history of finished jobs (`start`, `record`,
  `wait_finished`). The serial loop (`server.serial`) and the batched loop (`server.batching`)
  take jobs from it and report to it; neither knows the other.
- Fair scheduling: the ledger hands out one job at a time from the request `next_turn` picks
  (pure: fewest jobs running, then longest without service), so a request of many jobs shares
  the loop with the requests that arrive while it runs instead of holding it first in, first out.
  Within a loop, the jobs in progress take steps in the order `next_step` gives (pure: the
  request with the least loop time so far first, `JobLedger.charge` and `served`), so a newcomer's
  first step comes at the next step boundary.
- `WorkLimits` and `over_limit(requests, n_ctx, limits)`: the per-request ceiling on total work
  (choices x max_tokens; prompts x prompt length when scored) that the APIs answer with a 400
  before anything is queued.
- `JobObserver`: the one seam through which a job's life is watched (started, each token,
  finished, each batched step), e.g. by `server.metrics.ServerMetrics`; the ledger, its jobs
  and the `TokenDecoder` call it on the worker thread. `NO_OBSERVER` watches nothing.
  `ServingLoad` is what the loop holds at one moment (running, waiting, KV cache tokens).
- `CoalescingSink(sink, interval)`: a job's sink that merges text deltas coming within
  `interval` seconds of the last one it passed on into the next event, so that a fast
  model wakes the HTTP loop (which shares the process, its GIL and the engine's cores)
  at most about once per interval; the first delta and every other event go out at once.
- `default_engine()`: the `engine` package, the object that provides `SamplingParams`,
  `Sampler`, `Cancelled`, `BatchScheduler` and `GenRequest` unless a test injects another.

It does not run forward passes, touch sessions, parse HTTP or know any API's field names.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Protocol, Sequence, TypeVar

import torch

from engine.device_sampling import host_row
from engine.sampling import apply_logit_bias, greedy_id

from server.constraints import apply_mask
from server.stops import StopMatcher

# Job records are the worker's report, whichever loop served the job.
log = logging.getLogger("ds4.server.worker")

T = TypeVar("T")


def default_engine() -> Any:
    """The engine package: `SamplingParams`, `Sampler`, `Cancelled`, `BatchScheduler`, `GenRequest`."""
    import engine
    return engine


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
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs applied to the logits before any choice (`engine.sampling.apply_logit_bias`)."""


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
    prompt_logprobs: int | None = None
    """None: the prompt is only prefilled; k >= 0: every prompt token is scored first
    (`server.scoring`), with the k most likely tokens at each position."""
    new_splitter: Callable[[], Any] | None = field(default=None, compare=False, repr=False)
    """Builds the output splitter of this generation (None: text only). The object has
    `feed(text) -> list`, `in_structure` (bool) and `finish(engine_reason) -> output`."""
    new_constraint: Callable[[Any, Any], Any] | None = field(default=None, compare=False, repr=False)
    """Builds the decoding constraint of this generation from (model, splitter) (None: none);
    see `server.constraints.DecodingConstraint`."""


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
    end_logprob: TokenLogprob | None = None
    """With logprobs asked for, the entry of the end-of-sequence token that ended the
    generation: it produced no text (so no `TextDelta` carries it) but counts as a completion
    token, and prompt scoring (legacy completions) lists it."""


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
    n_constrained: int = 0
    """Tokens forced or chosen under a mask by the request's decoding constraint."""
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
    last_token_at: float | None = None
    finish_reason: str | None = None
    """'stop' or 'length' once the generation ended (None: cancelled or failed)."""
    request_id: int = 0
    """The client request the job belongs to (`JobLedger.submit_request`): its choices and
    prompts share one id."""
    request_jobs: int = 1
    """Jobs of that request."""
    request_queue_s: float | None = None
    """Set on the first job of its request to start: seconds from the request's arrival to
    that start (the request's queue time)."""

    def usage(self) -> Usage:
        return Usage(self.n_prompt, self.n_generated, self.n_cached, self.n_written)


class JobObserver(Protocol):
    """Watches jobs from the worker thread; each call must be quick (it runs between forward
    passes) and must not raise."""

    def job_started(self, stats: JobStats) -> None:
        """The loop took the job and begins its prefill."""

    def token(self, stats: JobStats, now: float) -> None:
        """A token was generated at `now`; `stats.last_token_at` is still the previous one's
        time (None for the first token), `stats.n_generated` already counts this one."""

    def job_finished(self, stats: JobStats) -> None:
        """The job left the loop (done, cancelled or failed); `stats` are final."""

    def batch_step(self, busy_slots: int, seconds: float) -> None:
        """The batched loop ran one step, of `seconds` on the worker thread, with this many
        slots serving a job."""


class _NoObserver:
    def job_started(self, stats: JobStats) -> None:
        pass

    def token(self, stats: JobStats, now: float) -> None:
        pass

    def job_finished(self, stats: JobStats) -> None:
        pass

    def batch_step(self, busy_slots: int, seconds: float) -> None:
        pass


NO_OBSERVER: JobObserver = _NoObserver()


@dataclass(frozen=True)
class ServingLoad:
    """What the inference loop holds at one moment."""
    running: int
    """Jobs taken by the loop and not finished."""
    waiting: int
    """Jobs submitted and not yet started."""
    kv_tokens: int
    """Tokens held in the KV caches of the resident sessions (serving or kept for reuse)."""
    kv_capacity_tokens: int
    """Tokens the resident sessions can hold together (context size times sessions)."""
    slots: int
    """Resident sessions (1 in the serial loop)."""


class Job:
    """A queued request plus its cancel flag and event sink. Thread-safe to cancel."""

    def __init__(self, job_id: int, request: GenerationRequest, sink: Callable[[Event], None],
                 observer: JobObserver = NO_OBSERVER) -> None:
        self.id = job_id
        self.request = request
        self.observer = observer
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


def joined_events(earlier: tuple[Any, ...], later: tuple[Any, ...]) -> tuple[Any, ...]:
    """Splitter events of two deltas in order, the seam joined where both sides are events of
    one type that can be merged (`a.merge(b)`: content or reasoning text)."""
    if earlier and later and type(earlier[-1]) is type(later[0]) and hasattr(earlier[-1], "merge"):
        return earlier[:-1] + (earlier[-1].merge(later[0]),) + later[1:]
    return earlier + later


def merged_deltas(deltas: Sequence[TextDelta]) -> TextDelta:
    """One delta for consecutive ones: their texts and log-probs in order, their splitter events
    with each seam joined (`joined_events`)."""
    if len(deltas) == 1:
        return deltas[0]
    events: tuple[Any, ...] = ()
    for d in deltas:
        events = joined_events(events, d.events)
    return TextDelta("".join(d.text for d in deltas), tuple(lp for d in deltas for lp in d.logprobs), events)


class CoalescingSink:
    """Passes a job's events on to `sink`, merging text deltas that come too fast.

    A `TextDelta` within `interval` seconds (by `clock`) of the last event passed on is
    held; the deltas held go out as one (`merged_deltas`) with the next delta that comes
    `interval` or more after the last event passed on, or just before any other event
    (`Finished`, `Failed`), so a held text waits at most until the next token, and nothing is
    reordered or lost. The merging is done when the deltas go out, not as each one comes,
    because a batched step hands every row's token to its sink. Called on the worker thread
    only.
    """

    def __init__(self, sink: Callable[[Event], None], interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sink = sink
        self.interval = interval
        self.clock = clock
        self._held: list[TextDelta] = []
        self._last_sent = float("-inf")

    def __call__(self, event: Event) -> None:
        if not isinstance(event, TextDelta):
            self._flush()
            self.sink(event)
            return
        now = self.clock()
        self._held.append(event)
        if now - self._last_sent < self.interval:
            return
        self._last_sent = now
        self._pass_held()

    def _flush(self) -> None:
        if self._held:
            self._last_sent = self.clock()
            self._pass_held()

    def _pass_held(self) -> None:
        held, self._held = self._held, []
        self.sink(merged_deltas(held))


class JobCancelled(Exception):
    """Raised inside a loop to abandon the job it serves (the job was cancelled)."""


# --- per-token work ---------------------------------------------------------------------

def sampling_params(params_type: Callable[..., Any], sp: SamplingSpec) -> Any:
    """The engine's `SamplingParams` (`params_type`) for a request (ignore_eos: greedy, EOS masked)."""
    return params_type(temperature=0.0 if sp.ignore_eos else sp.temperature,
                       top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p, seed=sp.seed,
                       argmax_ignoring_eos=sp.ignore_eos, logit_bias=sp.logit_bias)


def decode_budget(model: Any, req: GenerationRequest, n_prompt: int) -> int:
    return max(0, min(req.max_tokens, model.n_ctx - n_prompt))


def run_to_end(steps: Generator[Any, Any, T]) -> T:
    """Run a generator of steps (a prefill, a prompt's scoring) without stopping between them;
    its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def written_tokens(n_on_disk: int, n_reused: int, n_saved: int) -> int:
    """Prompt tokens that a prefill newly put on disk (checkpoints overlap: count the frontier)."""
    return max(0, n_on_disk - n_reused) if n_saved else 0


class TokenDecoder:
    """What happens to each generated token of one job, whoever runs the forward passes.

    `choose(logits, sample)` picks the next token: the token the decoding constraint forces,
    if any; else, with the constraint's mask applied to the logits, the argmax (of the logits
    with the request's logit bias) while the splitter is inside tool-call structure, else
    `sample(masked logits)`, whose sampler applies the bias (so `sample` must
    draw from the row it is given); it records the logprob entry (of the raw logits) when
    asked for. `accept(token)` turns it into text (UTF-8 safe, stop sequences held back),
    feeds the splitter and emits a `TextDelta`; it returns False once the generation is over
    (EOS, a stop sequence, or the constraint complete). `finish(reason)` flushes and emits `Finished`. Used by both inference
    loops, on the worker thread only.
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
        self.constraint = req.new_constraint(model, self.splitter) if req.new_constraint is not None else None
        self.top_logprobs = req.top_logprobs
        self.logit_bias = req.sampling.logit_bias
        self.reason: str | None = None
        """Set once the generation ended by itself: 'stop' (EOS or stop sequence)."""
        self.generated: list[int] = []
        """The accepted tokens whose text was produced (EOS that ends the generation excluded)."""
        self._logprob: Callable[[int], TokenLogprob] | None = None
        self.end_logprob: TokenLogprob | None = None
        """The logprob entry of the EOS that ended the generation (see `Finished.end_logprob`)."""

    @property
    def done(self) -> bool:
        return self.reason is not None

    def choose(self, logits: Any, sample: Callable[[Any], int]) -> int:
        """`logits` is the session's frontier row where it lies (`Session.raw_logits`: a host
        tensor, or on CUDA a device row that `host()` copies); it is copied only for
        logprobs or a token mask, so plain sampling on CUDA moves no row to the host."""
        if self.top_logprobs is not None:
            self._logprob = logprob_entry(self.model, host_row(logits), self.top_logprobs)
        step = self.constraint.decide() if self.constraint is not None else None
        if step is not None:
            self.job.stats.n_constrained += 1
            if step.forced is not None:
                return step.forced
            if step.allowed is not None:
                logits = apply_mask(host_row(logits), step.allowed)
        if self.splitter is not None and self.splitter.in_structure and not self.ignore_eos:
            self.job.stats.n_greedy += 1
            if self.logit_bias:  # the request's bans and forced tokens hold here too
                logits = apply_logit_bias(host_row(logits), self.logit_bias)
            return greedy_id(logits)
        return int(sample(logits))

    @property
    def follows_sampler(self) -> bool:
        """Whether `choose` now draws with its `sample` alone: no constraint to apply and no tool
        call in progress (inside one it takes the argmax)."""
        return self.constraint is None and not (self.splitter is not None and self.splitter.in_structure)

    def accept(self, token: int) -> bool:
        stats = self.job.stats
        stats.n_generated += 1
        now = time.monotonic()
        self.job.observer.token(stats, now)
        stats.last_token_at = now
        if stats.first_token_at is None:
            stats.first_token_at = now
        if token in self.eos_ids and not self.ignore_eos:
            self.reason = "stop"
            if self._logprob is not None:
                self.end_logprob = self._logprob(token)
            return False
        self.generated.append(token)
        if self.constraint is not None:
            self.constraint.advance(token)
        text = self.stops.push(self.stream.push(token))
        lps = (self._logprob(token),) if self._logprob is not None else ()
        if text or lps:
            events = tuple(self.splitter.feed(text)) if self.splitter is not None and text else ()
            self.job.emit(TextDelta(text, lps, events))
        if self.stops.matched is not None or (self.constraint is not None and self.constraint.complete):
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
        # The prompt text of what was generated, for the exact replay of tool calls: control
        # spellings that the model wrote as text stay text when the turn comes back. Past a stop
        # sequence the text was cut, and the tokens no longer match it.
        generated = self.model.detokenize_prompt(self.generated) if self.stops.matched is None else None
        output = self.splitter.finish(finish, generated) if self.splitter is not None else None
        self.job.stats.status = "done"
        self.job.stats.finish_reason = finish
        self.job.emit(Finished(finish, self.job.stats.usage(), stop_sequence=self.stops.matched, output=output,
                               end_logprob=self.end_logprob))


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


# --- the per-request ceiling on work ---------------------------------------------------------

DEFAULT_MAX_REQUEST_TOKENS = 1 << 20
"""Tokens one request may ask to generate over all its choices (choices x max_tokens): 128
choices of 8,192 tokens, twice `MAX_CHOICES` x the server's default max_tokens."""
DEFAULT_MAX_REQUEST_SCORED_TOKENS = 1 << 20
"""Prompt tokens one request may ask to score (prompts x prompt length, `echo` with `logprobs`)."""


@dataclass(frozen=True)
class WorkLimits:
    """The most work one client request may ask for; beyond it the request is refused before
    it is queued, whatever the scheduling would make of it."""
    generated_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    scored_tokens: int = DEFAULT_MAX_REQUEST_SCORED_TOKENS

    def __post_init__(self) -> None:
        if self.generated_tokens < 1 or self.scored_tokens < 1:
            raise ValueError("the per-request work limits must be at least 1 token, got "
                             f"{self.generated_tokens} and {self.scored_tokens}")


@dataclass(frozen=True)
class OverLimit:
    message: str
    """Names the limit, its flag and the request's figure."""
    scored: bool
    """The scored prompt tokens are over their limit (else the tokens to generate are)."""


def over_limit(requests: Sequence[GenerationRequest], n_ctx: int, limits: WorkLimits) -> OverLimit | None:
    """Why the jobs of one client request exceed `limits`, or None. A choice counts the tokens it may generate: its
    max_tokens, at most the room its prompt leaves in the context."""
    budgets = [max(0, min(r.max_tokens, n_ctx - len(r.prompt_ids))) for r in requests]
    total = sum(budgets)
    if total > limits.generated_tokens:
        shape = f" ({len(budgets)} choices x up to {max(budgets):,} tokens each)" if len(budgets) > 1 else ""
        return OverLimit(f"this request may generate {total:,} tokens{shape}; the server allows at most "
                         f"{limits.generated_tokens:,} per request (--max-request-tokens): ask for fewer choices "
                         "or a smaller token limit", False)
    scored = [len(r.prompt_ids) for r in requests if r.prompt_logprobs is not None]
    if sum(scored) > limits.scored_tokens:
        return OverLimit(f"this request scores {sum(scored):,} prompt tokens ({len(scored)} prompts of up to "
                         f"{max(scored):,} tokens); the server allows at most {limits.scored_tokens:,} per request "
                         "(--max-request-scored-tokens): send fewer prompts per request", True)
    return None


# --- the ledger ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestTurn:
    """What fair scheduling knows of one request that has jobs queued."""
    request_id: int
    running: int
    """Its jobs taken by the loop and not yet recorded."""
    since: int
    """Ledger tick of its arrival, or of the end of its latest job: when it last stopped being served."""


def next_turn(turns: Sequence[RequestTurn]) -> int | None:
    """The request whose next job goes first: fewest jobs running, then the longest without
    service (`since`). A request that arrives while another one's job runs therefore goes before
    that request's next job; a request of many jobs gets the free slots that nobody else waits for."""
    if not turns:
        return None
    return min(turns, key=lambda t: (t.running, t.since, t.request_id)).request_id


@dataclass(frozen=True)
class StepTurn:
    """What step-level scheduling knows of one job in progress."""
    served_s: float
    """Loop time its request has had so far, over all its jobs (`JobLedger.charge`)."""
    last_step: int
    """Loop tick of the job's latest step (lower: longer ago)."""


def next_step(turns: Sequence[StepTurn]) -> int | None:
    """The index of the job whose step goes next: the one whose request has had the least loop
    time (least attained service), then the one that waited longest. A request that arrives
    while others run therefore has the loop to itself until it has had as much time as the
    least served of them, and requests that have had the same then alternate step by step: a
    newcomer waits for at most the step in progress, never for another request's choice."""
    if not turns:
        return None
    return min(range(len(turns)), key=lambda i: (turns[i].served_s, turns[i].last_step))


class _Request:
    """The ledger's book on one request: its queued jobs (in order) and how many run."""

    def __init__(self, request_id: int, jobs: Sequence[Job], since: int, arrived: float) -> None:
        self.id = request_id
        self.queued: deque[Job] = deque(jobs)
        self.size = len(jobs)
        self.running = 0
        self.since = since
        self.arrived = arrived
        self.queue_s: float | None = None
        """From arrival to the start of its first job (None until then)."""
        self.left = len(jobs)
        """Jobs not yet recorded nor dropped from the queue."""
        self.served_s = 0.0
        """Loop time charged to its jobs (`JobLedger.charge`)."""

    def turn(self) -> RequestTurn:
        return RequestTurn(self.id, self.running, self.since)


class JobLedger:
    """Submitted jobs grouped by request, the stop request, and the stats of finished jobs.

    Fair scheduling lives here: `take` and `take_next` hand out the next job of the request
    `next_turn` picks, one job (one choice, one prompt) at a time, so a request of many jobs
    shares the loop with the requests that arrive while it runs; within a request, jobs go in
    submission order. The ledger counts a job as running from the moment it is taken until
    `record`.

    `submit`, `submit_request`, `request_stop` and `cancel_queued` may be called from any
    thread; `take`, `take_next`, `wait_for_work`, `take_stop`, `start`, `finish_cancelled` and
    `record` are for the loop that serves the jobs. `observer` hears of every job it starts and
    records, and of every token of its jobs.
    """

    def __init__(self, history: int = 256, observer: JobObserver = NO_OBSERVER) -> None:
        self.observer = observer
        self._ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._ticks = itertools.count()
        self._requests: dict[int, _Request] = {}
        self._depth = 0
        self._stop = False
        self._cv = threading.Condition()
        self.finished: deque[JobStats] = deque(maxlen=history)
        """Stats of the most recent jobs, newest last (for logs, tests and health)."""
        self._finished_cv = threading.Condition()

    @property
    def depth(self) -> int:
        """Jobs submitted and not yet taken by the loop."""
        return self._depth

    def take_stop(self) -> bool:
        """Whether the stop was requested since the loop last took it (taking it clears it, so
        a loop started again later runs; like a sentinel in a queue)."""
        with self._cv:
            stop, self._stop = self._stop, False
            return stop

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Job:
        return self.submit_request([request], [sink])[0]

    def submit_request(self, requests: Sequence[GenerationRequest],
                       sinks: Sequence[Callable[[Event], None]]) -> list[Job]:
        """Queue the jobs of one client request (its choices or prompts, in order) as one
        party of the fair schedule."""
        request_id = next(self._request_ids)
        jobs = [Job(next(self._ids), r, s, self.observer) for r, s in zip(requests, sinks, strict=True)]
        if not jobs:
            return jobs
        for job in jobs:
            job.stats.request_id, job.stats.request_jobs = request_id, len(jobs)
        with self._cv:
            self._requests[request_id] = _Request(request_id, jobs, next(self._ticks), time.monotonic())
            self._depth += len(jobs)
            self._cv.notify_all()
        return jobs

    def request_stop(self) -> None:
        """Ask the loop to end once it has taken what is queued."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def cancel_queued(self) -> None:
        """Cancel every job not yet taken and tell its handler (they are not recorded)."""
        with self._cv:
            dropped = [job for r in self._requests.values() for job in r.queued]
            for r in list(self._requests.values()):
                r.left -= len(r.queued)
                r.queued.clear()
                if r.running == 0:
                    del self._requests[r.id]
            self._depth = 0
        for job in dropped:
            job.cancel()
            self.finish_cancelled(job)

    def wait_for_work(self) -> None:
        """Block until a job is queued or the stop was requested."""
        with self._cv:
            self._cv.wait_for(lambda: self._depth > 0 or self._stop)

    def take(self) -> Job | None:
        """The next job (see `next_turn`), waiting for one; None once the stop was requested
        and nothing is queued (the stop is then taken, see `take_stop`)."""
        with self._cv:
            self._cv.wait_for(lambda: self._depth > 0 or self._stop)
            job = self._take_locked(None)
            if job is None:
                self._stop = False
            return job

    def take_next(self, can_start: Callable[[Job], bool] | None = None) -> Job | None:
        """The next job that `can_start` admits (a request whose next job it refuses waits,
        the others go on), or None; never waits."""
        with self._cv:
            return self._take_locked(can_start)

    def has_waiting(self, can_start: Callable[[Job], bool]) -> bool:
        """Whether a queued job that `can_start` admits is first in line of its request."""
        with self._cv:
            return any(r.queued and can_start(r.queued[0]) for r in self._requests.values())

    def waiting_requests(self, can_start: Callable[[Job], bool]) -> int:
        """How many requests have a queued job that `can_start` admits first in line."""
        with self._cv:
            return sum(1 for r in self._requests.values() if r.queued and can_start(r.queued[0]))

    def _take_locked(self, can_start: Callable[[Job], bool] | None) -> Job | None:
        turns = [r.turn() for r in self._requests.values()
                 if r.queued and (can_start is None or can_start(r.queued[0]))]
        chosen = next_turn(turns)
        if chosen is None:
            return None
        r = self._requests[chosen]
        job = r.queued.popleft()
        r.running += 1
        self._depth -= 1
        return job

    def start(self, job: Job, slot: int | None = None) -> None:
        """The loop begins serving the job (in resident session `slot`, batched mode)."""
        stats = job.stats
        stats.started_at = time.monotonic()
        stats.status = "running"
        stats.slot = slot
        with self._cv:
            r = self._requests.get(stats.request_id)
            if r is not None and r.queue_s is None:
                r.queue_s = stats.request_queue_s = max(0.0, stats.started_at - r.arrived)
        self.observer.job_started(stats)

    def charge(self, job: Job, seconds: float) -> None:
        """Add `seconds` of the loop's time to the job's request (step-level fairness)."""
        with self._cv:
            r = self._requests.get(job.stats.request_id)
            if r is not None:
                r.served_s += seconds

    def served(self, job: Job) -> float:
        """Loop time charged to the job's request so far (0 once the request has ended)."""
        with self._cv:
            r = self._requests.get(job.stats.request_id)
            return r.served_s if r is not None else 0.0

    def finish_cancelled(self, job: Job) -> None:
        job.stats.status = "cancelled"
        job.emit(Finished("cancelled", job.stats.usage()))

    def record(self, job: Job) -> None:
        """The job has left the loop: keep its stats, wake `wait_finished`, log one line (and
        one for its request once the last of several jobs has left)."""
        stats = job.stats
        stats.finished_at = time.monotonic()
        if stats.status == "cancelled" and stats.cancel_requested_at is not None and stats.started_at:
            stats.cancel_latency_s = max(0.0, stats.finished_at - stats.cancel_requested_at)
        ended: _Request | None = None
        with self._cv:
            r = self._requests.get(stats.request_id)
            if r is not None:
                r.running -= 1
                r.left -= 1
                r.since = next(self._ticks)
                if r.left <= 0:
                    ended = self._requests.pop(r.id)
        self.observer.job_finished(stats)
        with self._finished_cv:
            self.finished.append(stats)
            self._finished_cv.notify_all()
        log.info("job %d %s: %s", stats.job_id, stats.status, job_line(stats))
        if ended is not None and ended.size > 1:
            queued = f"{ended.queue_s:.2f}s" if ended.queue_s is not None else "never started"
            log.info("request %d ended: jobs=%d queued=%s time=%.2fs", ended.id, ended.size, queued,
                     stats.finished_at - ended.arrived)

    def wait_finished(self, job_id: int, timeout: float) -> JobStats | None:
        """Block until the job with this id has been recorded (tests and shutdown)."""
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


def job_line(stats: JobStats) -> str:
    """The figures of one finished job, as the request log shows them."""
    total = (stats.finished_at or stats.queued_at) - stats.queued_at
    queued = (stats.started_at or stats.finished_at or stats.queued_at) - stats.queued_at
    extra = (f" cancel_latency={stats.cancel_latency_s * 1000:.0f}ms"
             if stats.cancel_latency_s is not None else "")
    if stats.n_greedy:
        extra += f" greedy_in_tool_syntax={stats.n_greedy}"
    if stats.n_constrained:
        extra += f" constrained={stats.n_constrained}"
    if stats.n_written:
        extra += f" written_to_disk={stats.n_written}"
    if stats.slot is not None:
        extra += f" slot={stats.slot}"
    if stats.request_jobs > 1:
        extra += f" request={stats.request_id}"
    return (f"prompt={stats.n_prompt} cached={stats.n_cached} generated={stats.n_generated} "
            f"queued={queued:.2f}s time={total:.2f}s{extra}")
