"""Batched sessions: several resident sessions decoding together.

- `decode_batch(sessions, tokens)` evaluates one token for each of N sessions in one forward
  pass (the network's `forward_rows`; `start_decode_batch` splits it into starting the step
  and waiting for it, so that on CUDA the host works while the GPU computes): the weights are read once for all rows, and each row
  attends to its own session's cache at its own length (on CPU all rows of a layer in one
  call of the compiled kernel; sessions made together by `Model.new_sessions` share a KV
  pool).  On CPU each row's logits are bitwise equal to decoding it alone; on CUDA the step
  replays a captured graph (engine.cuda_graphs; eagerly, pooled rows attend in one masked
  batch) and agrees with single-row decoding to the GPU kernels' rounding, and each row's
  logits stay on the device (`Session.raw_logits`) with only greedy ids copied back.
- `BatchScheduler` keeps `n_slots` sessions and a queue of `GenRequest`s.  Each `step()` runs
  at most one prefill chunk (round-robin over slots that are prefilling, so a long prompt
  never stalls decoding for more than one chunk) and then one batched decode step for every
  slot that is generating.  A slot whose prompt has only its last token left to evaluate (as
  the server's copy of a shared prompt leaves it, or a chunk that stopped one short) joins that
  step as a row instead of running it as a chunk of its own, the one-token frontier step a
  chunk would have run alone: slots filled together start in one step, not one a step, and
  then finish together, where a ramp of steps of fewer rows (whose changing rows also drop the
  step launched ahead, below) would lead and end the batch.  Its first token is chosen in the
  step after.  `step(prefill=False)` runs no chunk, for a caller that runs a
  chunk of its own work in that step (the server scores prompts in slots that hold no
  request); `prefilling` says whether a chunk waits.  It is single-threaded: callers drive
  `step()` from the thread that owns the model (the server's worker, a benchmark loop).
  With `run_ahead` (CUDA graph decoding), when every row of a step takes the same greedy
  column of its logits (engine.device_sampling), the step after it is launched too, its
  tokens taken by the GPU from the first step's greedy ids, so the host's work between steps
  (choosing tokens, callbacks, streaming, the next step's table) overlaps the GPU's instead of
  leaving it idle.  The next step takes it only where it is that very step: the same
  sessions in the same order, each one position on, the tokens the greedy ids it evaluated;
  anything else (a row finished, cancelled or joined, a token not the greedy one) drops it
  unused, its keys and values lying past the caches' valid lengths.  A taken step is the same
  graph replay at the same positions as the step it replaces, so the logits are bitwise the
  same.  On by default (`RUN_AHEAD`): the embedded model's greedy batches decode 3-4% faster
  with it on an H100 (1 to 16 rows), and nothing changes on the CPU, where no step is launched
  ahead.
- `BatchScheduler(observer=...)` hands each `step()`'s `StepRecord` to the observer: its wall
  time on the scheduler's thread, the rows it decoded, the tokens of the prefill chunk it ran,
  whether its decoding step was one launched ahead, and the CUDA graph captures it waited for
  (ds4-eval's and ds4-server's `--step-log`, each line `StepRecord.fields`), so a batched run's
  time can be told apart step by step.
- `check_capacity(model, n_sessions, ctx)` refuses configurations whose memory need (weights
  + KV + working buffers, from the model's own accounting, with a 10% margin) exceeds what
  the device has available, with the figures in the message.
It does not choose slots by rendered text (the server does) nor know about HTTP.
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from engine import threads
from engine.device_sampling import greedy_column
from engine.errors import Cancelled
from engine.kvcache import KVCache
from engine.sampling import Sampler, SamplingParams
from engine.session import Prefill, Session, common_prefix

if TYPE_CHECKING:
    from engine.model import Model


class CapacityError(Exception):
    """The requested sessions do not fit in the device's memory."""


RUN_AHEAD = True
"""`BatchScheduler`'s default for `run_ahead` (see the module docstring)."""


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field ("MemAvailable", "SwapFree", ...) in bytes; None where the file or
    the field is missing (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = meminfo_bytes("MemAvailable")
    if available is not None:
        return available
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError):  # unknown here: no size is refused for want of memory
        return sys.maxsize


def capacity_need(model: "Model", n_sessions: int, ctx: int) -> int:
    """Bytes still to allocate for n sessions of ctx tokens (weights are already resident)."""
    return model.memory_bytes(n_sessions, ctx) - model.weight_bytes


def check_capacity(model: "Model", n_sessions: int, ctx: int, margin: float = 0.10) -> None:
    need = capacity_need(model, n_sessions, ctx)
    avail = available_bytes(model.device)
    if need * (1 + margin) > avail:
        raise CapacityError(
            f"{n_sessions} sessions of {ctx} tokens need {need / 2**20:.0f} MiB "
            f"(+{margin:.0%} margin) beyond the {model.weight_bytes / 2**20:.0f} MiB of weights; "
            f"{avail / 2**20:.0f} MiB is available on {model.device}")


def decode_batch(sessions: list[Session], tokens: list[int]) -> None:
    """Append tokens[i] to sessions[i] for all i in one forward pass and refresh their logits."""
    start_decode_batch(sessions, tokens)()


def start_decode_batch(sessions: list[Session], tokens: list[int]) -> Callable[[], None]:
    """`decode_batch` in two halves: the step starts, and the returned call waits for it and
    appends the tokens.  Under a captured CUDA graph the GPU computes the step meanwhile, so the
    caller's work in between (the tokens' text, streaming them) costs no step time; elsewhere
    the step is done before this returns.  The sessions must not be used in between."""
    if len(sessions) != len(tokens) or len({id(s) for s in sessions}) != len(sessions):
        raise ValueError("decode_batch needs one token for each of distinct sessions")
    if not sessions:
        return lambda: None
    if len(sessions) == 1:
        sessions[0].eval(tokens[0])
        return lambda: None
    model = sessions[0].model
    for s in sessions:
        s.check_fits(s.n_past + 1)
    threads.before_forward()
    finish_step = model.net.decode_started(tokens, [s.cache for s in sessions], model.eos_ids)

    def finish() -> None:
        step = finish_step()
        for i, (s, t) in enumerate(zip(sessions, tokens)):
            s.append_decoded(t, step.row(i))  # on CUDA the row stays on the device until read
    return finish


@dataclass
class GenRequest:
    """One generation: prompt ids in, sampled ids out (filled in by the scheduler)."""

    ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 128
    on_token: Callable[[int], None] | None = None  # called on the scheduler's thread
    cancel: Callable[[], bool] | None = None
    slot: int | None = None  # preferred slot; None: the scheduler picks
    # Picks each token from the logits instead of a Sampler(params) (e.g. greedy inside tool
    # syntax). It gets `Session.raw_logits`: a host tensor, or on CUDA a device row whose
    # `host()` copies it, so that only a chooser that needs the whole row pays for the copy.
    # A chooser that says which greedy id it takes (engine.device_sampling.ColumnChooser) lets
    # the scheduler run ahead as a Sampler does.
    choose: Callable[[Any], int] | None = None
    # Results.
    output: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    reused: int = 0
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass(frozen=True)
class StepRecord:
    """What one `BatchScheduler.step()` did (see the module docstring)."""

    started: float  # time.perf_counter() as the step began
    seconds: float  # its wall time on the scheduler's thread
    decoding: int  # rows its decoding step evaluated (0: none)
    prefill_tokens: int  # tokens of the prefill chunk it ran (0: none)
    adopted: bool  # its decoding step was the one launched ahead of it (run-ahead)
    capture_seconds: float  # CUDA graphs captured during it (engine.cuda_graphs), seconds

    def fields(self, t0: float) -> dict[str, Any]:
        """The record as a step log writes it (ds4-eval's and ds4-server's `--step-log`): `t`
        (seconds from `t0`, the log's first step), `ms` (its wall time), `decoding`,
        `prefill_tokens`, `adopted` and `capture_ms`."""
        return {"t": round(self.started - t0, 6), "ms": round(self.seconds * 1e3, 4), "decoding": self.decoding,
                "prefill_tokens": self.prefill_tokens, "adopted": self.adopted,
                "capture_ms": round(self.capture_seconds * 1e3, 3)}


@dataclass
class _Slot:
    session: Session
    request: GenRequest | None = None
    prefill: Prefill | None = None
    sampler: Callable[[Any], int] | None = None
    last_used: float = 0.0

    @property
    def chunk_waits(self) -> bool:
        """Whether its request's prompt needs a prefill chunk: more than its last token is left
        (that one alone joins the decoding step)."""
        return self.request is not None and self.prefill is not None and self.prefill.last_token is None


@dataclass
class _Launched:
    """A batched step launched before the host knew its tokens: row i evaluates, at position
    positions[i] + 1 of caches[i], the greedy id in `column` that `after` (the step launched at
    positions[i]) gave it."""

    sessions: list[Session]
    caches: list[KVCache]
    positions: list[int]
    column: int
    after: Any  # the network's pending step (engine.cuda_graphs.PendingStep)
    step: Any

    def takes(self, sessions: list[Session], tokens: list[int]) -> bool:
        """Whether this step is the one `sessions` would now run with `tokens`: the same sessions
        in the same order, each cache one past where `after` evaluated (that step done and
        nothing else changed since), and each token the greedy id this step took."""
        if len(sessions) != len(self.sessions) or any(a is not b for a, b in zip(sessions, self.sessions)):
            return False
        if any(s.cache is not c or c.n != p + 1 for s, c, p in zip(sessions, self.caches, self.positions)):
            return False
        ids = self.after.result().ids  # settled: its step was waited for
        return all(t == row[self.column] for t, row in zip(tokens, ids))


def _finisher(sessions: list[Session], tokens: list[int], step: Any) -> Callable[[], None]:
    """The call that waits for a launched step and advances its sessions by their tokens."""
    def finish() -> None:
        out = step.result()
        for i, (s, t) in enumerate(zip(sessions, tokens)):
            s.cache.n += 1
            s.append_decoded(t, out.row(i))
    return finish


class BatchScheduler:
    """`n_slots` sessions serving `GenRequest`s (see the module docstring).

    Between steps callers use `session(i)` (a slot's session) and `abandon_all()` (drop every
    request after a failure), never the slots or the queue themselves."""

    def __init__(self, model: "Model", n_slots: int, ctx: int | None = None, check_memory: bool = True,
                 run_ahead: bool | None = None, observer: Callable[[StepRecord], None] | None = None):
        if n_slots < 1:
            raise ValueError("n_slots must be >= 1")
        ctx = model.n_ctx if ctx is None else ctx
        if check_memory:
            check_capacity(model, n_slots, ctx)
        self.model = model
        self.slots = [_Slot(s) for s in model.new_sessions(n_slots)]
        self.queue: deque[GenRequest] = deque()
        self._next_prefill = 0
        self.run_ahead = RUN_AHEAD if run_ahead is None else run_ahead
        self._launched: _Launched | None = None  # the step launched ahead of the host, if any
        self.adopted = 0  # decoding steps that were launched ahead and then taken
        self.observer = observer  # called with each step's StepRecord, on the scheduler's thread

    # --- admission ---
    def submit(self, req: GenRequest) -> None:
        req.submitted_at = time.perf_counter()
        self.queue.append(req)
        self._admit()

    def pick_slot(self, req: GenRequest) -> int | None:
        """An idle slot: the preferred one, else the longest cached token prefix, else the LRU."""
        idle = [i for i, s in enumerate(self.slots) if s.request is None]
        if not idle:
            return None
        if req.slot is not None:
            return req.slot if req.slot in idle else None

        def score(i: int) -> tuple[int, float]:
            return common_prefix(self.slots[i].session.tokens, req.ids), -self.slots[i].last_used

        return max(idle, key=score)

    def _admit(self) -> None:
        waiting = deque()
        while self.queue:
            req = self.queue.popleft()
            i = self.pick_slot(req)
            if i is None:
                waiting.append(req)
                continue
            slot = self.slots[i]
            slot.request = req
            try:
                slot.prefill = slot.session.start_prefill(req.ids)
            except ValueError as e:
                self._finish(slot, "error", str(e))
                continue
            req.reused = slot.prefill.reused
            slot.sampler = req.choose or Sampler(req.params, self.model.eos_ids)
        self.queue = waiting

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(s.request is not None for s in self.slots)

    @property
    def prefilling(self) -> bool:
        """Whether a slot's request is still prefilling (the next `step()` would run a chunk);
        one with only its prompt's last token left joins the decoding step instead."""
        return any(s.chunk_waits for s in self.slots)

    # --- what callers may see and do between steps ---
    @property
    def n_slots(self) -> int:
        return len(self.slots)

    def session(self, i: int) -> Session:
        """The session of slot i. Between steps a caller may read it, and restore into or reset
        it while no request occupies the slot (the server restores disk checkpoints this way)."""
        return self.slots[i].session

    def abandon_all(self) -> list[GenRequest]:
        """Detach every running and queued request, e.g. after a failed step left the sessions
        suspect: their slots are emptied and those slots' sessions reset (cache memory kept).
        The requests are returned as they are, without finish fields; the caller reports them."""
        abandoned: list[GenRequest] = []
        for slot in self.slots:
            if slot.request is not None:
                abandoned.append(slot.request)
                slot.request, slot.prefill, slot.sampler = None, None, None
                slot.session.reset()
        abandoned.extend(self.queue)
        self.queue.clear()
        self._launched = None
        return abandoned

    # --- the loop ---
    def _finish(self, slot: _Slot, reason: str, error: str | None = None) -> None:
        req = slot.request
        req.finish, req.error, req.finished_at = reason, error, time.perf_counter()
        slot.request, slot.prefill, slot.sampler = None, None, None
        slot.last_used = req.finished_at

    def _prefill_one_chunk(self) -> int | None:
        """The next prefilling slot's next chunk: the tokens it evaluated (0 where its request was
        cancelled instead), None where no slot is prefilling."""
        n = len(self.slots)
        for k in range(n):
            i = (self._next_prefill + k) % n
            slot = self.slots[i]
            if not slot.chunk_waits:
                continue
            if slot.request.cancel is not None and slot.request.cancel():
                self._finish(slot, "cancelled")
                return 0
            tokens = 0
            if not slot.prefill.done:
                try:
                    tokens = slot.prefill.step(slot.request.cancel)
                except Cancelled:
                    self._finish(slot, "cancelled")
                    return 0
            if slot.prefill.done:
                slot.prefill = None
            self._next_prefill = (i + 1) % n
            return tokens
        return None

    def _decode(self) -> int:
        """Each generating slot's next token; the step that evaluates them is started before the
        tokens go to their requests (`on_token`, finishing), which runs while the GPU computes
        it (engine.batch.start_decode_batch), each request's events in the order they had.
        Slots with only their prompt's last token left join the step as rows evaluating it.
        Returns the rows that step evaluates (0: no step)."""
        rows, tokens, columns, taken, joining = [], [], [], [], []
        for slot in self.slots:
            req = slot.request
            if req is None or slot.chunk_waits:
                continue
            if req.cancel is not None and req.cancel():
                self._finish(slot, "cancelled")
                continue
            if slot.prefill is not None:
                rows.append(slot.session)
                tokens.append(slot.prefill.last_token)
                columns.append(None)  # no logits yet to say which greedy id its sampler takes
                joining.append(slot)
                continue
            # The row where it lies: on CUDA a device row, copied to the host only if asked.
            logits = slot.session.raw_logits
            token = slot.sampler(logits)
            if req.first_token_at is None:
                req.first_token_at = time.perf_counter()
            req.output.append(token)
            finish = None
            if token in self.model.eos_ids and not req.params.argmax_ignoring_eos:
                finish = "stop"
            elif len(req.output) >= req.max_tokens or slot.session.n_past >= self.model.n_ctx:
                finish = "length"
            else:
                rows.append(slot.session)
                tokens.append(token)
                columns.append(greedy_column(logits, slot.sampler))
            taken.append((slot, req, token, finish))
        wait = self._start(rows, tokens, columns) if rows else None
        try:
            for slot, req, token, finish in taken:
                if req.on_token is not None:
                    req.on_token(token)
                if finish is not None:
                    self._finish(slot, finish)
        finally:  # even where a callback raised: the sessions hold the step they started
            if wait is not None:
                wait()
                for slot in joining:
                    slot.prefill.joined()
                    slot.prefill = None
        return len(rows)

    def _start(self, rows: list[Session], tokens: list[int], columns: list[int | None]) -> Callable[[], None]:
        """Start the step of `rows` evaluating `tokens` (the one launched ahead where it is that
        step) and, where every row's sampler takes the same greedy column, launch the step after
        it too; the returned call waits for the first and advances the rows."""
        launched, self._launched = self._launched, None  # one not taken now is dropped unused
        # Rows on the host (CPU) or sampled otherwise have no column: nothing to launch ahead.
        column = columns[0] if all(c == columns[0] for c in columns) else None
        if launched is not None and launched.takes(rows, tokens):
            step = launched.step
            self.adopted += 1
        else:
            step = self._launch(rows, tokens) if self.run_ahead and column is not None else None
            if step is None:  # the usual step
                return start_decode_batch(rows, tokens)
        if column is not None:
            caches = [s.cache for s in rows]
            ahead = self.model.net.decode_launch(None, caches, self.model.eos_ids, ahead=1, after=step,
                                                 column=column)
            if ahead is not None:
                self._launched = _Launched(rows, caches, [c.n for c in caches], column, step, ahead)
        return _finisher(rows, tokens, step)

    def _launch(self, rows: list[Session], tokens: list[int]) -> Any:
        """The step of `rows` evaluating `tokens` launched with its greedy ids kept on the
        device for a step after it (the network's pending step), or None where no captured
        graph takes these caches."""
        for s in rows:
            s.check_fits(s.n_past + 1)
        threads.before_forward()
        return self.model.net.decode_launch(tokens, [s.cache for s in rows], self.model.eos_ids)

    def step(self, prefill: bool = True) -> bool:
        """One prefill chunk (if any, and if `prefill`) and one batched decode step; False when idle."""
        observed = self.observer is not None
        if observed:
            started, adopted, captured = time.perf_counter(), self.adopted, self._capture_seconds()
        self._admit()
        chunk = self._prefill_one_chunk() if prefill else None
        rows = self._decode()
        self._admit()
        if observed:
            self.observer(StepRecord(started, time.perf_counter() - started, rows, chunk or 0,
                                     self.adopted > adopted, self._capture_seconds() - captured))
        return chunk is not None or rows > 0 or self.busy

    def _capture_seconds(self) -> float:
        graphs = self.model.net.decode_graphs
        return graphs.capture_seconds if graphs is not None else 0.0

    def run(self) -> None:
        while self.step():
            pass


__all__ = ["BatchScheduler", "CapacityError", "GenRequest", "StepRecord", "check_capacity", "decode_batch"]
