"""What the inference loops do with the disk KV cache around one session: plan and save.

One planner for a prefill, run by both loops:
  plan_prefill(store, model, session, text, ids, user_boundary) -> PrefillPlan
      1. the restore step: when a checkpoint on disk is longer than what the session already
         shares with `ids`, it is loaded into the session (a payload the engine refuses is
         deleted and the session emptied) and the prompt becomes its tokens plus the tokens
         of the rest of the text;
      2. the stages: the checkpoints of `kvstore_policy.plan_prefill_saves` that split text
         and tokens cleanly (`kvstore_policy.prefix_text_at`), ascending, each beyond the
         previous one and beyond what the session already holds.
  `run_prefill` runs a plan (`session.sync` to each stage, store it, then sync the whole
  prompt); the batched loop turns each stage into a scheduler request that ends at the stage
  and stores the slot's session when it is done. `prefill_with_cache` is plan and run in one
  call. The serial loop runs the same as steps, `iter_prefill`: a generator that does one
  restore, one prefill chunk (`iter_sync`, the chunks `session.sync` runs) or one checkpoint
  store per step and returns the outcome, so that other requests' steps come between them.

One way to save a resident session (reasons evict and shutdown):
  save_resident(store, model, session, resident, reason, next_ids=None, label=...)
      stores the session when `kvstore_policy.evict_save_wanted` says so (`save_session`),
      and keeps `resident.on_disk` current; the cache never fails a request, so errors are
      logged, not raised.
  `Resident` is what the loop knows of the session: the prompt text it was synced to, that
  prompt's token count and the longest prefix of it on disk.

It does not read or write cache files (`server.kvstore` does), decide thresholds
(`server.kvstore_policy` does), schedule forward passes or know anything of HTTP.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

from engine.errors import Cancelled
from engine.session import common_prefix
from server import kvstore_policy as policy
from server.jobs import run_to_end
from server.kvstore import SUFFIX, Entry, KVStore
from server.prompting import prompt_ids

log = logging.getLogger("ds4.server.kvstore")


def text_split(model: Any) -> dict[str, Any]:
    """The model callables `kvstore_policy.prefix_text_at` needs (detokenize, prompt_ids, bos_id)."""
    return dict(detokenize=model.detokenize_prompt, prompt_ids=lambda text: prompt_ids(model, text),
                bos_id=model.bos_id if getattr(model, "add_bos", False) else None)


def user_boundary_tokens(store: KVStore | None, model: Any, text: str, offset: int | None,
                         ids: list[int]) -> int | None:
    """The token count where the last user turn starts (`offset` in characters), for the cold
    checkpoint; None without a store, without an offset, or when it does not split cleanly."""
    if store is None or offset is None:
        return None
    return policy.tokens_at_text_offset(text, offset, ids, lambda head: prompt_ids(model, head))


# --- the prefill plan -------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefillPlan:
    """`ids`: the token ids the session holds once the prefill is done (restored tokens, then
    the suffix); `n_restored`: tokens the restore step loaded from disk (0: none); `base`:
    tokens of `ids` the session holds before the prefill (restored or kept); `stages`: the
    checkpoints to store on the way, ascending."""
    ids: list[int]
    n_restored: int = 0
    base: int = 0
    stages: tuple[Stage, ...] = ()


@dataclass(frozen=True)
class Stage:
    """Prefill `ids[:n_tokens]`, then store the session under `prefix_text` (reason)."""
    n_tokens: int
    prefix_text: str
    reason: str


def restore_checkpoint(store: KVStore, model: Any, session: Any, text: str, ids: list[int]) -> tuple[list[int], int]:
    """The restore step: (ids, n_restored) after loading the longest useful checkpoint, if any."""
    hit = store.lookup(text, longer_than=common_prefix(session.tokens, ids))
    if hit is None:
        return ids, 0
    try:
        session.load_payload(hit.payload)
    except ValueError as e:  # the header matched but the engine refuses it: never again
        log.warning("kv cache: cannot restore %s%s: %s", hit.key, SUFFIX, e)
        store.remove(hit.key)
        session.truncate(0)
        return ids, 0
    return list(hit.tokens) + model.tokenize_prompt(text[len(hit.prefix_text):]), hit.n_tokens


def plan_stages(store: KVStore, model: Any, text: str, ids: list[int], base: int,
                user_boundary: int | None) -> tuple[Stage, ...]:
    """The checkpoints a prefill of `ids` from `base` should leave on disk, ascending."""
    stages: list[Stage] = []
    last = base
    split = text_split(model)
    for point in policy.plan_prefill_saves(base, len(ids), user_boundary, store.save_policy):
        found = policy.prefix_text_at(text, ids, point.n_tokens,
                                      tokenize_suffix=model.tokenize_prompt, **split)
        if found is None or found[0] <= last:
            continue
        stages.append(Stage(found[0], found[1], point.reason))
        last = found[0]
    return tuple(stages)


def plan_prefill(store: KVStore | None, model: Any, session: Any, text: str, ids: list[int],
                 user_boundary: int | None = None) -> PrefillPlan:
    """Restore what the disk offers for the prompt `text` (tokenized as `ids`) into `session`
    and plan the checkpoint stages of the rest (see the module docstring)."""
    ids = list(ids)
    if store is None:
        return PrefillPlan(ids, 0, common_prefix(session.tokens, ids))
    ids, n_restored = restore_checkpoint(store, model, session, text, ids)
    base = max(n_restored, common_prefix(session.tokens, ids))
    return PrefillPlan(ids, n_restored, base, plan_stages(store, model, text, ids, base, user_boundary))


@dataclass
class PrefillOutcome:
    """`ids`: the token ids now in the session (restored tokens, then the suffix's tokens);
    `n_restored`: tokens restored from a disk checkpoint (0: none); `n_reused`: tokens not
    recomputed (restored from disk or kept from the live session); `n_written`: tokens
    written to disk checkpoints during this prefill; `n_on_disk`: the longest prefix of `ids`
    known to be on disk (for `evict_save_wanted`); `saved`: the entries stored."""
    ids: list[int]
    n_restored: int = 0
    n_reused: int = 0
    n_written: int = 0
    n_on_disk: int = 0
    saved: list[Entry] = field(default_factory=list)


def iter_sync(session: Any, ids: list[int], progress: Callable[[int, int], None] | None = None,
              cancel: Callable[[], bool] | None = None) -> Generator[None, None, int]:
    """`session.sync(ids, progress, cancel)` one prefill chunk at a time: it yields between
    chunks (never before the first nor after the last) and returns the tokens reused. The chunks
    are the ones `sync` runs, so the cache and the frontier logits are bitwise the same however
    long the caller waits between them (each session's state is its own)."""
    job = session.start_prefill(ids)
    first = True
    while not job.done:
        if not first:
            yield
        first = False
        if cancel is not None and cancel():
            raise Cancelled(f"cancelled after {job.evaluated} of {job.total} prefill tokens")
        job.step(cancel)
        if progress is not None:
            progress(job.evaluated, job.total)
    return int(job.reused)


def iter_run_prefill(plan: PrefillPlan, store: KVStore, session: Any, *,
                     progress: Callable[[int, int], None] | None = None,
                     cancel: Callable[[], bool] | None = None) -> Generator[None, None, PrefillOutcome]:
    """Run a plan one prefill chunk at a time (`iter_sync`): each stage, its checkpoint, then the
    whole prompt; it yields between chunks and between a checkpoint's store and the next chunk.

    `progress(done, total)` counts over the whole prefill (from `plan.base`); `cancel` is
    polled before every chunk and passed into it, so `engine.Cancelled` propagates with the
    session valid."""
    ids = plan.ids
    out = PrefillOutcome(ids=ids, n_restored=plan.n_restored, n_on_disk=plan.n_restored)
    total = len(ids) - plan.base
    first_reuse: int | None = None

    def sync_to(n: int) -> Generator[None, None, None]:
        nonlocal first_reuse
        offset = max(0, common_prefix(session.tokens, ids) - plan.base)
        hook = None if progress is None else (lambda done, _n: progress(offset + done, total))
        reused = yield from iter_sync(session, ids[:n], progress=hook, cancel=cancel)
        if first_reuse is None:
            first_reuse = reused

    for stage in plan.stages:
        yield from sync_to(stage.n_tokens)
        entry = store.store(stage.prefix_text, session, stage.reason)
        if entry is not None:
            out.saved.append(entry)
            out.n_written += entry.n_tokens
            out.n_on_disk = stage.n_tokens
        yield
    yield from sync_to(len(ids))
    out.n_reused = int(first_reuse or 0)
    return out


def run_prefill(plan: PrefillPlan, store: KVStore, session: Any, *,
                progress: Callable[[int, int], None] | None = None,
                cancel: Callable[[], bool] | None = None) -> PrefillOutcome:
    """`iter_run_prefill` at once."""
    return run_to_end(iter_run_prefill(plan, store, session, progress=progress, cancel=cancel))


def iter_prefill(store: KVStore | None, model: Any, session: Any, text: str, ids: list[int], *,
                 user_boundary: int | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 cancel: Callable[[], bool] | None = None) -> Generator[None, None, PrefillOutcome]:
    """`prefill_with_cache` one step at a time for a loop that interleaves other work: the
    restore step and every prefill chunk are steps of their own (it yields between them). Without
    a store this is `iter_sync`."""
    if store is None:
        reused = yield from iter_sync(session, list(ids), progress=progress, cancel=cancel)
        return PrefillOutcome(ids=list(ids), n_reused=reused)
    plan = plan_prefill(store, model, session, text, ids, user_boundary)
    if plan.n_restored:
        yield
    return (yield from iter_run_prefill(plan, store, session, progress=progress, cancel=cancel))


def prefill_with_cache(store: KVStore | None, model: Any, session: Any, text: str, ids: list[int], *,
                       user_boundary: int | None = None,
                       progress: Callable[[int, int], None] | None = None,
                       cancel: Callable[[], bool] | None = None) -> PrefillOutcome:
    """Bring `session` to the prompt `text` (tokenized as `ids`), using and filling the disk
    cache: `plan_prefill` then `run_prefill`. Without a store this is `session.sync(ids)`."""
    return run_to_end(iter_prefill(store, model, session, text, ids, user_boundary=user_boundary,
                                   progress=progress, cancel=cancel))


# --- saving a resident session ----------------------------------------------------------------

@dataclass
class Resident:
    """What a loop knows of a resident session, for the disk cache."""
    prompt_text: str | None = None
    """The prompt the session was last synced to (None: unknown, e.g. an interrupted prefill)."""
    n_prompt: int = 0
    on_disk: int = 0
    """The longest prefix of the session known to be on disk."""

    def forget(self) -> None:
        self.prompt_text, self.n_prompt, self.on_disk = None, 0, 0


def save_session(store: KVStore | None, model: Any, session: Any, prompt_text: str, n_prompt: int,
                 reason: str, *, n_common: int = 0, n_saved: int = 0) -> Entry | None:
    """Store a session before it is replaced (`evict`) or at exit (`shutdown`).

    The session holds the `n_prompt` tokens of `prompt_text` and then generated tokens; its
    text is the prompt text plus their decoding. Skipped unless
    `kvstore_policy.evict_save_wanted(len(session.tokens), n_common, n_saved)`. The session
    may be truncated by a few tokens to end on a whole character; it is being replaced or
    dropped anyway.
    """
    if store is None or not policy.evict_save_wanted(len(session.tokens), n_common, n_saved, store.save_policy):
        return None
    tokens = list(session.tokens)
    text = prompt_text + model.detokenize_prompt(tokens[n_prompt:])
    found = policy.prefix_text_at(text, tokens, len(tokens), exact=False, **text_split(model))
    if found is None:
        return None
    cut, prefix = found
    if cut < len(tokens):
        session.truncate(cut)
    return store.store(prefix, session, reason)


def save_resident(store: KVStore | None, model: Any, session: Any, resident: Resident, reason: str,
                  next_ids: list[int] | None = None, label: str = "the live session") -> None:
    """Store a resident session before `next_ids` replace it (evict) or at exit (`next_ids`
    None); `label` names it in the log. Never raises: the cache never fails a request."""
    if store is None or resident.prompt_text is None:
        return
    n_common = common_prefix(session.tokens, next_ids) if next_ids is not None else 0
    try:
        entry = save_session(store, model, session, resident.prompt_text, resident.n_prompt, reason,
                             n_common=n_common, n_saved=resident.on_disk)
    except Exception:
        log.exception("kv cache: cannot save %s (%s)", label, reason)
        return
    if entry is not None:
        resident.on_disk = entry.n_tokens
        log.info("kv cache: saved %s (%s, %d tokens)", label, reason, entry.n_tokens)
