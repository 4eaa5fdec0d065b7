"""When the disk KV cache saves a checkpoint, which text it is keyed by, and what it evicts.

Pure functions over token counts, texts and index records: no files, no engine, no clock
(the caller passes `now`). `server.kvstore` does the I/O; `server.kvplan` decides when to
call these, as follows.

Save reasons
  cold       after the first prefill of a long prompt: the prompt trimmed by `TRIM_TOKENS`
             trailing tokens and aligned down to `ALIGN_TOKENS`, or the last user-turn
             boundary of the chat template when the caller knows one (`cold_save_point`).
  continued  during a long prefill, at absolute frontiers that are multiples of
             `CONTINUED_INTERVAL` (10240 tokens, itself a multiple of the alignment), so
             that a prompt that keeps growing finds a checkpoint near its end
             (`continued_save_points`).
  evict      the live session is about to be replaced by a prompt that shares little of it
             (`evict_save_wanted`).
  shutdown   the live session at a clean exit (same test as evict).

How the inference loops use them, per job (prompt text T, ids = model.prompt_ids(T)); steps 2
and 3 are `server.kvplan.plan_prefill`, steps 1 and 4 `server.kvplan.save_resident`:
  1. reuse = common prefix of the live session and ids. If `evict_save_wanted(...)`, store
     the live session (reason evict) before touching it.
  2. hit = store.lookup(T, longer_than=reuse); on a hit: session.load_payload(hit.payload)
     and ids = hit.tokens + model.tokenize_prompt(T[len(hit.prefix_text):]).
  3. points = plan_prefill_saves(restored or reused, len(ids), user_boundary): prefill in
     stages, `session.sync(ids[:p.n_tokens])` then store the session at each point (the
     prefill is the same work split at those frontiers), then `session.sync(ids)`.
     The text of a point comes from `prefix_text_at`, which may move it down a few
     tokens to where text and tokens split cleanly, or drop it.
  4. on clean exit, `evict_save_wanted(...)` again (n_common = 0) with reason shutdown.

Eviction: `eviction_score` = (effective_hits + 1) * tokens / file_size, times
`ANCHOR_BONUS` for cold/evict/shutdown entries; hits decay with a 6-hour half-life and
count as zero below 0.01. `select_victims` removes the lowest scores first (ties: least
recently used first) until the directory fits the budget, never touching protected keys
(the entry just written, the entry just restored). Free space works the same way before a
write: `space_deficit` says how many bytes the filesystem lacks for the new entry plus the
minimum that must stay free, and `victims_for_space` picks entries in the same order until
their files cover it, or None when they cannot (the save is skipped, nothing is deleted).

It does not read or write files, talk to the engine, or know any HTTP API.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

COLD = "cold"
CONTINUED = "continued"
EVICT = "evict"
SHUTDOWN = "shutdown"
REASONS = (COLD, CONTINUED, EVICT, SHUTDOWN)
ANCHOR_REASONS = frozenset({COLD, EVICT, SHUTDOWN})

TRIM_TOKENS = 32  # the last tokens of a prompt (generation prompt, final user words) rarely recur
ALIGN_TOKENS = 2048
CONTINUED_INTERVAL = 5 * ALIGN_TOKENS  # "about every 10K tokens", on the alignment grid
MIN_SAVE_TOKENS = ALIGN_TOKENS  # below this a prefill is cheap enough that a disk read does not pay
EVICT_MIN_GAIN = ALIGN_TOKENS // 4  # an evict/shutdown write must add at least this many tokens to the disk

HALF_LIFE_S = 6 * 3600.0
MIN_EFFECTIVE_HITS = 0.01
ANCHOR_BONUS = 2.0
SIZE_MARGIN = 0.01  # an entry must fit in 99% of the budget to be written


@dataclass(frozen=True)
class SavePolicy:
    """Token thresholds of the save points (the defaults are the server's; tests shrink them)."""
    trim: int = TRIM_TOKENS
    align: int = ALIGN_TOKENS
    interval: int = CONTINUED_INTERVAL
    min_tokens: int = MIN_SAVE_TOKENS
    min_gain: int = EVICT_MIN_GAIN

    def __post_init__(self) -> None:
        if min(self.align, self.interval, self.min_tokens, self.min_gain) < 1 or self.trim < 0:
            raise ValueError(f"save policy thresholds must be positive: {self}")


DEFAULT_POLICY = SavePolicy()


@dataclass(frozen=True)
class SavePoint:
    n_tokens: int
    reason: str


def align_down(n: int, align: int = ALIGN_TOKENS) -> int:
    return (n // align) * align


def cold_save_point(n_prompt: int, user_boundary: int | None = None,
                    p: SavePolicy = DEFAULT_POLICY) -> int | None:
    """Token count of the cold checkpoint for a freshly prefilled prompt, or None.

    `user_boundary` is the token count before the last user turn of the chat template (the
    part every later turn of the conversation repeats); it wins when it is at least
    `p.min_tokens` and not past the prompt. Otherwise the prompt minus `p.trim` tokens,
    aligned down to `p.align`. None when the point would be shorter than `p.min_tokens`.
    """
    if user_boundary is not None and p.min_tokens <= user_boundary <= n_prompt:
        return user_boundary
    point = align_down(n_prompt - p.trim, p.align)
    return point if point >= p.min_tokens else None


def continued_save_points(start: int, n_prompt: int, p: SavePolicy = DEFAULT_POLICY) -> list[int]:
    """Absolute multiples of `p.interval` inside a prefill that runs from `start` to `n_prompt`.

    Only frontiers strictly after `start` (what is already cached needs no checkpoint) and
    at most `n_prompt - p.trim` (the trailing tokens are not worth keeping).
    """
    last = n_prompt - p.trim
    first = (start // p.interval + 1) * p.interval
    return list(range(first, last + 1, p.interval)) if first <= last else []


def plan_prefill_saves(reused: int, n_prompt: int, user_boundary: int | None = None,
                       p: SavePolicy = DEFAULT_POLICY) -> list[SavePoint]:
    """Checkpoints to take while prefilling tokens `reused..n_prompt`, ascending.

    A cold point is taken only when the prefill itself is long (at least `p.min_tokens` new
    tokens: a prompt served mostly from cache already has its checkpoint) and when it lies
    beyond what was reused. A continued point closer than `p.align` tokens to the cold point
    would store nearly the same checkpoint twice: only the cold one is kept.
    """
    if n_prompt - reused < p.min_tokens:
        return []
    cold = cold_save_point(n_prompt, user_boundary, p)
    if cold is not None and cold <= reused:
        cold = None
    points = {n: CONTINUED for n in continued_save_points(reused, n_prompt, p)
              if cold is None or abs(n - cold) >= p.align}
    if cold is not None:
        points[cold] = COLD
    return [SavePoint(n, points[n]) for n in sorted(points)]


def evict_save_wanted(n_live: int, n_common: int, n_saved: int, p: SavePolicy = DEFAULT_POLICY) -> bool:
    """Whether to store the live session before it is replaced (or at shutdown).

    n_live: tokens in the live session; n_common: how many of them the next prompt keeps
    (0 at shutdown); n_saved: the longest prefix of the live session already on disk.
    Worth a write when the session is long (`p.min_tokens`), the disk lacks at least
    `p.min_gain` of its tokens, and the next prompt drops at least `p.min_gain` of them
    (otherwise they stay in memory).
    """
    return n_live >= p.min_tokens and n_live - n_saved >= p.min_gain and n_live - n_common >= p.min_gain


def prefix_text_at(text: str, ids: Sequence[int], n: int, *,
                   detokenize: Callable[[Sequence[int]], str],
                   prompt_ids: Callable[[str], list[int]],
                   tokenize_suffix: Callable[[str], list[int]] | None = None,
                   bos_id: int | None = None, exact: bool = True,
                   max_back: int = 16) -> tuple[int, str] | None:
    """(n', prefix) with n' <= n, `prefix` a prefix of `text` whose tokens are exactly ids[:n'].

    A checkpoint keyed by `prefix` restores ids[:n'], so the text must tokenize to those
    very ids (`prompt_ids(prefix) == ids[:n']`). With `tokenize_suffix`, the rest of the
    text must also tokenize to the rest of the ids, so that a later request restoring the
    checkpoint sees the same tokens as this one. A token boundary inside a merge or a
    multi-byte character fails these checks; the point then moves down, at most `max_back`
    tokens, and None is returned when no clean boundary is found.
    `bos_id`: a leading BOS id that the model adds and the text does not spell.
    `exact=False` drops the `prompt_ids` check: for a session holding generated tokens,
    which need not be how the tokenizer would split the same text, the checkpoint keeps the
    tokens the model actually saw.
    """
    spelled = bos_id is not None and bool(ids) and ids[0] == bos_id and text.startswith(detokenize([bos_id]))
    skip = 1 if ids and bos_id is not None and ids[0] == bos_id and not spelled else 0
    for cut in range(min(n, len(ids)), max(skip, n - max_back), -1):
        prefix = detokenize(list(ids[skip:cut]))
        if not prefix or not text.startswith(prefix):
            continue
        if exact and list(prompt_ids(prefix)) != list(ids[:cut]):
            continue
        if tokenize_suffix is not None and list(tokenize_suffix(text[len(prefix):])) != list(ids[cut:]):
            continue
        return cut, prefix
    return None


def tokens_at_text_offset(text: str, offset: int, ids: Sequence[int],
                          prompt_ids: Callable[[str], list[int]]) -> int | None:
    """Token count of `text[:offset]` when it tokenizes to a prefix of `ids`, else None.

    Turns a character position the chat template knows (say, where the last user turn
    starts) into the `user_boundary` that `cold_save_point` takes.
    """
    if not 0 < offset <= len(text):
        return None
    head = list(prompt_ids(text[:offset]))
    return len(head) if head == list(ids[:len(head)]) else None


# --- eviction -------------------------------------------------------------------------

@dataclass(frozen=True)
class EntryStats:
    """What eviction needs to know of one stored entry."""
    key: str
    reason: str
    n_tokens: int
    file_size: int
    hits: int
    last_used: float


def effective_hits(hits: int, last_used: float, now: float, half_life: float = HALF_LIFE_S) -> float:
    age = max(0.0, now - last_used)
    value = hits * 0.5 ** (age / half_life)
    return 0.0 if value < MIN_EFFECTIVE_HITS else value


def eviction_score(e: EntryStats, now: float) -> float:
    """Higher is more worth keeping: tokens saved per byte of disk, weighted by recent use."""
    score = (effective_hits(e.hits, e.last_used, now) + 1.0) * e.n_tokens / max(1, e.file_size)
    return score * ANCHOR_BONUS if e.reason in ANCHOR_REASONS else score


def eviction_order(entries: Iterable[EntryStats], now: float) -> list[EntryStats]:
    """Entries from first to last to evict: lowest score, then least recently used."""
    return sorted(entries, key=lambda e: (eviction_score(e, now), e.last_used, e.key))


def select_victims(entries: Iterable[EntryStats], budget_bytes: int, now: float,
                   protected: Iterable[str] = ()) -> list[str]:
    """Keys to delete so that the remaining entries fit in `budget_bytes`.

    Protected keys are never chosen; if they alone exceed the budget, the result leaves the
    directory over budget rather than delete them.
    """
    entries = list(entries)
    keep = set(protected)
    total = sum(e.file_size for e in entries)
    victims: list[str] = []
    for e in eviction_order((e for e in entries if e.key not in keep), now):
        if total <= budget_bytes:
            break
        victims.append(e.key)
        total -= e.file_size
    return victims


def space_deficit(free_bytes: int, min_free_bytes: int, incoming_bytes: int) -> int:
    """Bytes to free before writing `incoming_bytes` so that `min_free_bytes` stay free on the
    filesystem (0: it fits as things are)."""
    return max(0, min_free_bytes + incoming_bytes - free_bytes)


def victims_for_space(entries: Iterable[EntryStats], need_bytes: int, now: float,
                      protected: Iterable[str] = ()) -> list[str] | None:
    """Keys to delete, in eviction order, that free at least `need_bytes` of their files.

    [] when nothing needs freeing; None when all unprotected entries together are too small:
    then nothing should be deleted (the save that needed the room is skipped instead).
    """
    if need_bytes <= 0:
        return []
    keep = set(protected)
    victims: list[str] = []
    freed = 0
    for e in eviction_order((e for e in entries if e.key not in keep), now):
        victims.append(e.key)
        freed += e.file_size
        if freed >= need_bytes:
            return victims
    return None


def fits_budget(file_size: int, budget_bytes: int) -> bool:
    """Whether an entry of this size may be written at all (with a 1% margin)."""
    return file_size <= budget_bytes * (1.0 - SIZE_MARGIN)
