"""Find out from the outside whether a server counts the end-of-sequence token in its usage.

Contract
- `measure_eos_counting(endpoint, model, api_key) -> str`: "yes" when the server's
  `usage.completion_tokens` includes the end-of-sequence token that ended a reply, "no" when it
  counts only the reply's text tokens, "" when the measurement does not settle it (the server
  cannot be reached, sends no usage, never ends a reply by itself, or answers the same request
  differently). Asked once per process for each (endpoint, model, key): a run's provenance is
  read more than once.
- The measurement needs no tokenizer. A short greedy chat request that ends by itself reports
  C completion tokens; the same request is then sent with `max_tokens: C`. A server that counts
  the end-of-sequence token spent C-1 of them on text, so the capped request still fits its
  reply and ends with finish reason "stop"; a server that does not count it used all C on text,
  so the capped request runs out of budget just before the end-of-sequence token: "length".
  The uncapped request is sent until two answers agree (some servers, llama.cpp's among them,
  answer a prompt's first request differently from later ones, which reuse its cached prefix),
  and the capped answer must repeat that text, else the outcome is "".
- `judge_counting(free, capped)` is that decision, pure; `Answer` is what it reads of a reply.
It sends nothing but chat requests to the endpoint given and decides nothing about a run: the
provenance records the outcome and `compare` acts on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import httpx

from ds4eval.run.capabilities import api_root

YES, NO, UNKNOWN = "yes", "no", ""
# Short, and one that small instruction-tuned models end by themselves well within the budget.
PROMPT = "Answer in a few words: what colour is the sky on a clear day?"
FREE_BUDGET = 64
# Two agreeing uncapped answers are wanted; a server that still disagrees by the third is not settled.
MAX_FREE_REQUESTS = 3
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Answer:
    """What the judge reads of one chat reply: its text, finish reason and completion token count."""

    text: str
    finish: str
    completion_tokens: int | None


def judge_counting(free: Answer, capped: Answer) -> str:
    """The counting rule shown by an uncapped reply that ended by itself and the same request
    capped at its completion token count (see the module docstring)."""
    if free.finish != "stop" or free.completion_tokens is None:
        return UNKNOWN
    if free.completion_tokens == 0:
        return NO  # ended by the end-of-sequence token, and counted nothing
    if capped.text != free.text:
        return UNKNOWN
    return {"stop": YES, "length": NO}.get(capped.finish, UNKNOWN)


def answer_of(doc: Any) -> Answer | None:
    """The `Answer` of a chat completion's JSON, None when it is not one."""
    try:
        choice = doc["choices"][0]
        text = choice["message"].get("content") or ""
        finish = choice.get("finish_reason") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    usage = doc.get("usage") if isinstance(doc.get("usage"), dict) else {}
    count = usage.get("completion_tokens")
    return Answer(str(text), str(finish), count if isinstance(count, int) and not isinstance(count, bool) else None)


@functools.lru_cache(maxsize=None)
def measure_eos_counting(endpoint: str, model: str, api_key: str | None = None) -> str:
    """The server's counting rule, measured (see the module docstring); "" when unsettled."""
    url = api_root(endpoint) + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(headers=headers, timeout=REQUEST_TIMEOUT_S) as client:

        def ask(budget: int) -> Answer | None:
            body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": budget,
                    "stream": False, **({"model": model} if model else {})}
            try:
                resp = client.post(url, json=body)
                return answer_of(resp.json()) if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        previous = None
        for _ in range(MAX_FREE_REQUESTS):
            free = ask(FREE_BUDGET)
            if free is None or free.finish != "stop" or free.completion_tokens is None:
                return UNKNOWN
            if free == previous:
                break
            previous = free
        else:
            return UNKNOWN
        if free.completion_tokens == 0:
            return judge_counting(free, free)
        capped = ask(free.completion_tokens)
        return UNKNOWN if capped is None else judge_counting(free, capped)
