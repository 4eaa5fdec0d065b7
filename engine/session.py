"""A session: one sequence of tokens and its KV cache, with prefix reuse.

`sync(ids)` makes the cache hold exactly `ids`: it keeps the longest common prefix of what
is cached, drops the rest and prefills the new suffix in chunks of `prefill_chunk` tokens.
After sync, eval or load_payload, `logits` holds the next-token distribution at the frontier
(float32 on CPU).  On CUDA the forward pass leaves it on the device (`raw_logits`, an
`engine.device_sampling.DeviceLogits` whose greedy ids are already on the host); it is
copied to the host the first time `logits` is read, and samplers given `raw_logits` never
copy it.
When the whole of `ids` is already cached but its frontier logits are not (for example after
a truncation), the last token is evaluated again, so the reuse count is then len(ids) - 1.
The frontier token of a sync is always evaluated by the one-row decode step (the rest in
prefill chunks), the same computation as that re-evaluation and as `load_payload`'s, so a
repeated request or a restored cache gives bitwise the same logits, hence the same greedy
continuation, as the first time.

Run-ahead (CUDA graph decoding, greedy samplers): when `sample` or `choose` picks a token
from a device row, the session also launches that token's step and the step of its greedy
successor, whose token the GPU takes from the first step's ids without the host, and returns
without waiting.  `eval` of the same token then only waits for a step already under way, so
the host's work between tokens (detokenizing, stop checks, streaming) overlaps the GPU's
instead of adding to it.  The launched steps are the same graph replays at the same
positions as `eval` would run, so the logits are bitwise the same.  What the caller sees
never runs ahead: `tokens`, the cache's length and `logits` change only on `eval`; steps
launched ahead store keys and values past the cache's valid length, and any other change
(another token, truncate, sync, a restore, a batched step) drops them unused: later work on
the same stream overwrites what they stored.  A step ahead of an end-of-generation token or
of the context's end is never launched.

Cancellation is cooperative: `cancel()` is polled before each prefill chunk and between the
layers of a chunk's forward pass; when it returns True `Cancelled` is raised with the session
valid at the last complete chunk (keys and values a cancelled chunk wrote lie beyond the
cache's valid length and are overwritten later), so cancelling takes a fraction of a chunk.

Bounded caches (a ring on a family's windowed layers, engine.kvcache): such a cache can
continue at a position only while its ring still holds the window before it.  `sync` then
reuses the common prefix only where it can (`KVCache.reusable`), else prefills from the start,
as llama.cpp does with its sliding-window cache; a `truncate` (or `copy_prefix_from`) to a
position whose window was overwritten is honoured lazily: the next evaluation first
recomputes the kept tokens from the start (`_recompute_lost`), so logits are never computed
from overwritten keys.  A payload holds what continuing at its end, or one token before (as
`load_payload` does), reads: a ring's layers only their last `window` positions
(`KVCache.held_state`); a restored session reusing a shorter prefix recomputes.

Payload format (`save_payload`, little-endian), for the server's disk cache:
  b"DS4KV\\0" | u16 version | u8 dtype code (0 f32, 1 f16, 2 bf16) | u8 pad
  | u32 n_layer | u32 n_head_kv | u32 head_dim | u32 n_tokens | i32 tokens[n_tokens]
then, version 1 (a layout without a ring; older payloads of any layout):
  | K [n_layer, n_head_kv, n_tokens, head_dim] | V (same shape)
version 2 (a layout with a ring, engine.kvcache.Ring):
  | u32 window | u32 n_ring | u32 ring layer indices[n_ring]
  | per part: [n_layer - n_ring, n_head_kv, n_tokens, head_dim] (the other layers, in order),
    then [n_ring, n_head_kv, min(n_tokens, window), head_dim] (the ring's, their last positions)
so the rows take (n_tokens x (n_layer - n_ring) + min(n_tokens, window) x n_ring) x L bytes,
L one layer's bytes at one position (`CacheLayout.held_bytes`), where version 1 took
n_tokens x n_layer x L.  For Gemma 3 270M (18 layers, 15 of them a ring of window 512, L = 1
KiB in float16) the rows of 32K tokens take 103.5 MiB, not 576 MiB.  Version 1 payloads still
load, into either layout (a ring takes their last `window` positions); a version 2 payload
loads only into a cache with the same ring.
The three shape fields and the rows are the cache's row layout
(engine.kvcache.CacheLayout: heads and width, one array per part): keys and values as above,
or for a latent cache (engine.models.deepseek2) heads 1, width kv_lora_rank + rope dim and one
array of latent rows, so an entry takes that cache's smaller bytes per token.
`common_prefix(a, b)` is the engine's one longest-common-prefix count, for every caller that
compares token sequences.  `extend_logits(ids)` returns the logits after every appended token
(scoring a text, e.g. corpus KL divergence), where `sync` keeps only the frontier's;
`iter_extend_logits(ids)` yields them one prefill chunk at a time, for callers that reduce
each chunk (prompt log-probs) and must not hold vocab x prompt-length floats at once.  A decoding step run outside the session (a batch of sessions,
engine.batch) uses the public `check_fits(n)` and `append_decoded(token, logits)`.
It does not know about text, chat templates or sampling policy (see engine.sampling).
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np
import torch

from engine import threads
from engine.device_sampling import DeviceLogits, greedy_column, host_row
from engine.errors import Cancelled
from engine.kvcache import HeldRows
from engine.sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    from engine.cuda_graphs import PendingStep
    from engine.kvcache import KVCache
    from engine.model import Model


PAYLOAD_MAGIC = b"DS4KV\0"
PAYLOAD_VERSION = 1  # every position of every layer: layouts without a ring
PAYLOAD_VERSION_HELD = 2  # a ring's layers only their last `window` positions
_HEADER = struct.Struct("<6sHBxIIII")
_RING_HEAD = struct.Struct("<II")  # window, ring layer count (their indices follow)
_DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Prefill:
    """The rest of a sync, one chunk per `step()`, so a scheduler can interleave other work."""

    def __init__(self, session: "Session", ids: list[int], reused: int):
        self.session = session
        self.ids = ids
        self.reused = reused
        self.total = len(ids) - reused if len(session.tokens) < len(ids) else 0
        self.evaluated = 0

    @property
    def done(self) -> bool:
        return self.evaluated >= self.total

    @property
    def last_token(self) -> int | None:
        """The prompt's last token where it is all that is left to evaluate, else None.  A caller
        that evaluates it itself, as a row of a batched decoding step (engine.batch), records
        that with `joined()`: it is the one-token frontier step `step()` would run alone."""
        return self.ids[-1] if self.total - self.evaluated == 1 else None

    def joined(self) -> None:
        """The last token was evaluated by the caller's step: its key, value and logits are the
        session's (`Session.append_decoded`); the prefill is done."""
        if self.last_token is None:
            raise RuntimeError("joined() with more than the last token left to evaluate")
        self.evaluated += 1

    def step(self, cancel: Callable[[], bool] | None = None) -> int:
        """Evaluate the next chunk; returns how many tokens it held.  Raises Cancelled mid-chunk."""
        start = self.reused + self.evaluated
        part = self.ids[start: start + self.session.model.prefill_chunk]
        if part:
            self.session._run(part, cancel, frontier=start + len(part) == len(self.ids))
            self.evaluated += len(part)
        return len(part)


RUN_AHEAD = 2  # decoding steps a greedy session keeps launched past its frontier


class _Ahead:
    """A step launched past the frontier: it evaluates `token` (None until the step before it
    is adopted) at the frontier's position plus its place in the list."""

    __slots__ = ("token", "column", "step")

    def __init__(self, token: int | None, column: int, step: "PendingStep"):
        self.token = token
        self.column = column  # which greedy id of the step before it is its token
        self.step = step


class Session:
    def __init__(self, model: "Model", cache: "KVCache | None" = None):
        self.model = model
        self.cache = model.net.new_cache(model.n_ctx, model.kv_dtype) if cache is None else cache
        self.tokens: list[int] = []
        self._logits: torch.Tensor | DeviceLogits | None = None
        self._sampler: Sampler | None = None
        self._ahead: list[_Ahead] = []  # steps launched past the frontier, oldest first

    def reset(self) -> None:
        """Forget everything; the cache's memory is kept for reuse."""
        self._ahead.clear()
        self.tokens = []
        self.cache.n = 0
        self._logits = None
        self._sampler = None

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def logits(self) -> torch.Tensor:
        return host_row(self.raw_logits)

    @property
    def raw_logits(self) -> torch.Tensor | DeviceLogits:
        """The frontier logits where the forward pass left them (see the module docstring)."""
        if self._logits is None:
            raise RuntimeError("no logits: the session is empty or was truncated; sync or eval first")
        return self._logits

    def truncate(self, n: int) -> None:
        if n < len(self.tokens):
            self._ahead.clear()
            self.tokens = self.tokens[:n]
            self.cache.n = n
            self._logits = None

    def copy_prefix_from(self, other: "Session", n: int) -> None:
        """Hold the first n tokens of `other` (a session of the same model) with their keys and
        values copied, as if they had been prefilled here: one prompt prefilled once serves
        several sessions. There are no frontier logits afterwards (as after `truncate`); the
        next `sync` evaluates what follows."""
        if other.model is not self.model:
            raise ValueError("the sessions belong to different models")
        if not 0 <= n <= len(other.tokens):
            raise ValueError(f"cannot copy {n} tokens of a session that holds {len(other.tokens)}")
        self.check_fits(n)
        self._ahead.clear()
        self.cache.copy_prefix(other.cache, n)
        self.tokens = list(other.tokens[:n])
        self._logits = None
        self._sampler = None

    def copy_from(self, other: "Session") -> None:
        """Become a copy of `other` (a session of the same model): its tokens, keys and values,
        and its frontier logits, copied to the host so that they outlive the device buffers of
        later steps. The next token is then chosen exactly as `other` would have chosen it, with
        nothing evaluated again (a server parks a generation this way and resumes it later)."""
        logits = host_row(other.raw_logits).clone()
        self.copy_prefix_from(other, len(other.tokens))
        self._logits = logits

    def check_fits(self, n: int) -> None:
        """Raise ValueError unless n tokens fit this session's context."""
        if n > self.cache.n_ctx:
            raise ValueError(f"{n} tokens do not fit the context of {self.cache.n_ctx}")

    def append_decoded(self, token: int, logits: torch.Tensor) -> None:
        """Record `token` as evaluated, with the next-token `logits` its step produced: for a
        caller that ran the decode step itself and already stored the token's keys and values
        in this session's cache (engine.batch.decode_batch)."""
        self._ahead.clear()
        self.tokens.append(int(token))
        self._logits = logits

    def _run(self, ids: list[int], cancel: Callable[[], bool] | None = None, frontier: bool = True) -> None:
        """Evaluate `ids` after the cached tokens.  With `frontier` the last token runs as a
        one-row decode step and sets `logits`; without, no logits are computed (an inner chunk)."""
        net, device = self.model.net, self.model.device
        self._ahead.clear()
        self._recompute_lost()
        threads.before_forward()
        body = ids[:-1] if frontier else ids
        if body:
            net.forward(torch.tensor(body, dtype=torch.long, device=device), len(self.tokens), self.cache,
                        logits="none", cancel=cancel)
            self.tokens.extend(body)
            self._logits = None
        if frontier:
            self._logits = net.decode_frontier(ids[-1], self.cache, self.model.eos_ids, cancel)
            self.tokens.append(ids[-1])

    def _recompute_lost(self, at: int | None = None) -> None:
        """Make the cache able to continue at `at` (default: the frontier): where a bounded
        cache's ring overwrote the window before it (after a truncation), every cached token is
        evaluated again from the start, in prefill chunks, without logits (see the module
        docstring).  The frontier logits, if any, stay: the keys recomputed are the same."""
        at = len(self.tokens) if at is None else at
        if self.cache.reusable(at) == at:
            return
        redo, self.tokens = self.tokens, []
        self.cache.n = 0
        net, device, step = self.model.net, self.model.device, self.model.prefill_chunk
        for start in range(0, len(redo), step):
            part = redo[start: start + step]
            threads.before_forward()
            net.forward(torch.tensor(part, dtype=torch.long, device=device), len(self.tokens), self.cache,
                        logits="none")
            self.tokens.extend(part)

    def extend_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Append `ids` after the cached tokens and return the logits after each of them: float32
        [len(ids), n_vocab] on the CPU, row i the next-token distribution after ids[i] (teacher
        forcing, for scoring a text position by position).  Runs the prefill path in chunks of
        `prefill_chunk` rows.  It leaves `logits` unset, so that a later sync evaluates its
        frontier through the one-row decode step and stays bitwise reproducible."""
        rows = [chunk for _, chunk in self.iter_extend_logits(ids)]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def iter_extend_logits(self, ids: Sequence[int],
                           cancel: Callable[[], bool] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """`extend_logits` one prefill chunk at a time: yields (offset into `ids`, float32
        [chunk, n_vocab] on the CPU), so a caller that reduces each chunk (log-probs of the next
        token, a top-k) never holds more than one chunk's rows.  The chunk's tokens are cached
        before it is yielded; stopping early leaves the session valid at that point.  `cancel`
        is polled before each chunk and between its layers (raises Cancelled)."""
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("extend_logits needs at least one token")
        self.check_fits(len(self.tokens) + len(ids))
        net, device, step = self.model.net, self.model.device, self.model.prefill_chunk
        self._ahead.clear()
        self._logits = None
        self._recompute_lost()
        for start in range(0, len(ids), step):
            if cancel is not None and cancel():
                raise Cancelled(f"cancelled after {start} of {len(ids)} scored tokens")
            part = ids[start: start + step]
            threads.before_forward()
            out = net.forward(torch.tensor(part, dtype=torch.long, device=device), len(self.tokens), self.cache,
                              logits="all", cancel=cancel)
            self.tokens.extend(part)
            yield start, out.float().cpu()

    def start_prefill(self, ids: list[int]) -> "Prefill":
        """Truncate to the common prefix with `ids` and return the remaining prefill as steps."""
        ids = list(ids)
        if not ids:
            raise ValueError("sync needs at least one token")
        self.check_fits(len(ids))
        keep = common_prefix(self.tokens, ids)
        if keep == len(ids) and keep == len(self.tokens) and self._logits is not None:
            return Prefill(self, ids, keep)
        keep = min(keep, len(ids) - 1)  # always evaluate at least the last token for fresh logits
        keep = self.cache.reusable(keep)  # a ring that overwrote the window before it: from scratch
        self.truncate(keep)
        return Prefill(self, ids, keep)

    def sync(self, ids: list[int], progress: Callable[[int, int], None] | None = None,
             cancel: Callable[[], bool] | None = None) -> int:
        job = self.start_prefill(ids)
        while not job.done:
            if cancel is not None and cancel():
                raise Cancelled(f"cancelled after {job.evaluated} of {job.total} prefill tokens")
            job.step(cancel)
            if progress is not None:
                progress(job.evaluated, job.total)
        return job.reused

    def eval(self, token: int) -> None:
        self.check_fits(len(self.tokens) + 1)
        token = int(token)
        if self._ahead and self._ahead[0].token == token:
            self._adopt()
        else:
            self._run([token])

    def sample(self, params: SamplingParams) -> int:
        """Sample the next token; the same params object continues one random stream."""
        if self._sampler is None or self._sampler.params is not params:
            self._sampler = Sampler(params, self.model.eos_ids)
        return self.choose(self._sampler)

    def choose(self, sampler: Sampler) -> int:
        """`sampler`'s token for the frontier.  Where the frontier is a device row and the
        sampler greedy, the steps of that token and of its greedy successor are launched before
        this returns (run-ahead, see the module docstring)."""
        logits = self.raw_logits
        token = sampler(logits)
        column = greedy_column(logits, sampler)
        if column is None or (token in self.model.eos_ids and not sampler.params.argmax_ignoring_eos):
            self._ahead.clear()  # the caller samples, or stops here
        else:
            self._run_ahead(token, column)
        return token

    def _run_ahead(self, token: int, column: int) -> None:
        ahead = self._ahead
        if ahead and (ahead[0].token != token or ahead[0].column != column):
            ahead.clear()
        while len(ahead) < RUN_AHEAD:  # the network declines a step past the context's end
            known, after = (None, ahead[-1].step) if ahead else (token, None)
            step = self.model.net.decode_ahead(known, self.cache, self.model.eos_ids, len(ahead), after, column)
            if step is None:
                return
            ahead.append(_Ahead(known, column, step))

    def _adopt(self) -> None:
        """The oldest step launched ahead becomes the frontier (its key and value are stored)."""
        done = self._ahead.pop(0)
        logits = done.step.result().row(0)
        self.cache.n += 1
        self.tokens.append(done.token)
        self._logits = logits
        if self._ahead:  # the next step evaluates the greedy id this one produced
            self._ahead[0].token = logits.greedy_no_eos if done.column else logits.greedy

    def save_payload(self) -> bytes:
        if self.tokens:  # load_payload continues one token before the end (see the module docstring)
            self._recompute_lost(len(self.tokens) - 1)
        held = self.cache.held_state()
        ring = self.cache.layout.ring
        version = PAYLOAD_VERSION if ring is None else PAYLOAD_VERSION_HELD
        header = _HEADER.pack(PAYLOAD_MAGIC, version, _DTYPE_CODES[held.full[0].dtype], self.model.config.n_layer,
                              self.cache.layout.heads, self.cache.layout.width, len(self.tokens))
        tok = np.asarray(self.tokens, dtype="<i4").tobytes()
        ring_head = b"" if ring is None else \
            _RING_HEAD.pack(ring.window, len(ring.layers)) + np.asarray(ring.layers, dtype="<u4").tobytes()
        rows = [t for i, full in enumerate(held.full) for t in (full, *held.ring[i:i + 1])]
        return b"".join([header, tok, ring_head, *map(_raw, rows)])

    def load_payload(self, data: bytes) -> None:
        """Hold the tokens and keys and values of `save_payload`'s `data` (either format
        version), with the frontier logits evaluated again.  A payload that is malformed or
        does not fit this model's cache raises ValueError and changes nothing."""
        if len(data) < _HEADER.size:
            raise ValueError("KV payload is truncated")
        magic, version, code, n_layer, n_kv, hd, n = _HEADER.unpack_from(data)
        form = _PAYLOAD_FORMS.get(version)
        if magic != PAYLOAD_MAGIC or form is None or code not in _DTYPES:
            raise ValueError("not a KV payload of this engine version")
        lay = self.cache.layout
        if (n_layer, n_kv, hd) != (self.model.config.n_layer, lay.heads, lay.width):
            raise ValueError("KV payload was made by a model of another shape")
        self.check_fits(n)
        off = _HEADER.size + 4 * n
        if len(data) < off:
            raise ValueError("KV payload length does not match its header")
        restore = form(memoryview(data)[off:], _DTYPES[code], n, self.cache)
        self._ahead.clear()
        tokens = np.frombuffer(data, dtype="<i4", count=n, offset=_HEADER.size).tolist()
        restore()
        self.tokens = tokens
        self._logits = None
        if tokens:  # recompute frontier logits from the last token
            last = tokens[-1]
            self.truncate(n - 1)
            self.eval(last)


def _raw(t: torch.Tensor) -> bytes:
    # Reinterpret as bytes so bfloat16 (no numpy dtype) round-trips too.
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _arrays(rows: memoryview, dtype: torch.dtype, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Consecutive arrays of `shapes` filling `rows` exactly (ValueError otherwise)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = [int(np.prod(shape)) * elem for shape in shapes]
    if len(rows) != sum(sizes):
        raise ValueError("KV payload length does not match its header")
    out, off = [], 0
    for shape, size in zip(shapes, sizes):
        out.append(torch.frombuffer(bytearray(rows[off: off + size]), dtype=torch.uint8).view(dtype).view(shape))
        off += size
    return out


def _full_form(rows: memoryview, dtype: torch.dtype, n: int, cache: "KVCache") -> Callable[[], None]:
    """Version 1: every layer's n positions, per part; a ring takes their last `window`."""
    lay = cache.layout
    parts = _arrays(rows, dtype, [(cache.n_layer, lay.heads, n, lay.width)] * lay.parts)
    return lambda: cache.restore(*parts)


def _held_form(rows: memoryview, dtype: torch.dtype, n: int, cache: "KVCache") -> Callable[[], None]:
    """Version 2: the ring named after the tokens, then per part the other layers' n positions
    and the ring's layers' last min(n, window)."""
    lay, ring = cache.layout, cache.layout.ring
    if len(rows) < _RING_HEAD.size:
        raise ValueError("KV payload length does not match its header")
    window, n_ring = _RING_HEAD.unpack_from(rows)
    end = _RING_HEAD.size + 4 * n_ring
    if len(rows) < end:
        raise ValueError("KV payload length does not match its header")
    layers = tuple(np.frombuffer(rows, dtype="<u4", count=n_ring, offset=_RING_HEAD.size).tolist())
    if ring is None:
        raise ValueError("KV payload holds only the window of its sliding-window layers; "
                         "this model's cache keeps every position")
    if (window, layers) != (ring.window, ring.layers):
        raise ValueError(f"KV payload's ring (window {window}, layers {list(layers)}) is not this model's "
                         f"(window {ring.window}, layers {list(ring.layers)})")
    full = (cache.n_layer - lay.n_ring, lay.heads, n, lay.width)
    ringed = (lay.n_ring, lay.heads, lay.held_positions(n), lay.width)
    arrays = _arrays(rows[end:], dtype, [full, ringed] * lay.parts)
    held = HeldRows(n, tuple(arrays[0::2]), tuple(arrays[1::2]))
    return lambda: cache.restore_held(held)


_PAYLOAD_FORMS = {PAYLOAD_VERSION: _full_form, PAYLOAD_VERSION_HELD: _held_form}
