"""Prompt scoring: the log-probability of every prompt token, and its legacy-completions form.

Contract:
- `score_prompt(model, session, ids, k, cancel)` leaves `session` holding `ids[:-1]` and
  returns a `PromptScored`: for each prompt token after the first, its log-probability given
  the tokens before it (teacher forcing over the raw model distribution, before any sampler
  filter) and the `k` most likely tokens at that position. It runs the engine's prefill path
  one chunk at a time (`Session.iter_extend_logits`) and reduces each chunk at once, so it
  never holds more than one chunk of vocab-wide rows. The session's earlier content is
  dropped: cached positions carry no logits, so nothing can be reused. The caller then syncs
  the full prompt as usual, which evaluates only the frontier token (the same one-row step
  as every other request, so a generation after scoring matches one without).
  `iter_score_prompt` is the same as steps, one chunk each (a generator that returns the
  `PromptScored`), for a loop that interleaves other requests' work between them.
- `PromptScored` is the event a loop emits before `PromptReady` for a request with
  `prompt_logprobs` set.
- `legacy_logprobs(...)` renders prompt and generated entries as the `logprobs` object of a
  `/v1/completions` choice (`tokens`, `token_logprobs`, `top_logprobs` as a list of dicts,
  `text_offset`); the first prompt token has a null log-prob and null top entry, as other
  OpenAI-compatible servers return it. With `token_ids` the tokens are named `token_id:N`
  (a vLLM extension clients use when token texts are ambiguous).

It does not decide which requests are scored (the APIs do), touch the disk cache, or run
the decode loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

import torch

from engine.logprobs import score_rows
from server.jobs import TokenLogprob, run_to_end


@dataclass(frozen=True)
class PromptScored:
    first_token: int
    """The prompt's first token: nothing precedes it, so it has no log-prob."""
    first_text: str
    entries: tuple[TokenLogprob, ...]
    """One per prompt token after the first, in order."""


def chunk_entries(model: Any, logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprob]:
    """Entries for one chunk: row i of `logits` is the distribution that `targets[i]` was drawn from."""
    # engine.logprobs is also the corpus KLD's reduction: a client scoring through the server
    # gets the in-process engine's log-probs to the last bit.
    scored = score_rows(logits, targets, k)
    chosen = scored.target_logprobs.tolist()
    tops = [tuple((int(i), model.detokenize([int(i)]), float(v)) for v, i in zip(vs, is_))
            for vs, is_ in zip(scored.top_logprobs.tolist(), scored.top_ids.tolist())]  # () per row when k is 0
    return [TokenLogprob(int(t), model.detokenize([int(t)]), float(lp), top)
            for t, lp, top in zip(targets, chosen, tops)]


def iter_score_prompt(model: Any, session: Any, ids: Sequence[int], k: int,
                      cancel: Callable[[], bool] | None = None) -> Generator[None, None, PromptScored]:
    """`score_prompt` one prefill chunk at a time: it yields between chunks and returns the
    `PromptScored`. The chunks are `score_prompt`'s, so are the numbers."""
    ids = [int(t) for t in ids]
    session.reset()
    entries: list[TokenLogprob] = []
    inputs = ids[:-1]
    if inputs:
        for start, logits in session.iter_extend_logits(inputs, cancel):
            rows = logits.shape[0]
            entries.extend(chunk_entries(model, logits, ids[start + 1: start + 1 + rows], k))
            if start + rows < len(inputs):
                yield  # before the next chunk is computed
    return PromptScored(ids[0], model.detokenize([ids[0]]), tuple(entries))


def score_prompt(model: Any, session: Any, ids: Sequence[int], k: int,
                 cancel: Callable[[], bool] | None = None) -> PromptScored:
    return run_to_end(iter_score_prompt(model, session, ids, k, cancel))


# --- the legacy completions form --------------------------------------------------------------

def token_name(token_id: int, text: str, token_ids: bool) -> str:
    return f"token_id:{token_id}" if token_ids else text


def legacy_logprobs(prompt: PromptScored | None, generated: Sequence[TokenLogprob],
                    generated_offset: int, token_ids: bool = False) -> dict[str, Any]:
    """The `logprobs` object of a completions choice: the prompt's tokens first (when scored,
    offsets from 0), then the generated ones (offsets from `generated_offset`, the length of
    the echoed text)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []

    def add(entries: Sequence[TokenLogprob], pos: int) -> None:
        for e in entries:
            name = token_name(e.token_id, e.text, token_ids)
            tokens.append(name)
            token_logprobs.append(e.logprob)
            top = {token_name(i, t, token_ids): lp for i, t, lp in e.top}
            top[name] = e.logprob  # the chosen token is always listed, as OpenAI does
            top_logprobs.append(top)
            offsets.append(pos)
            pos += len(e.text)

    if prompt is not None:
        tokens.append(token_name(prompt.first_token, prompt.first_text, token_ids))
        token_logprobs.append(None)
        top_logprobs.append(None)
        offsets.append(0)
        add(prompt.entries, len(prompt.first_text))
    add(generated, generated_offset)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}
