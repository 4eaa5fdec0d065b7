"""Several choices of one request: one job per choice, their events merged by choice index.

A request with `n` > 1, or with several prompts (legacy completions), asks for several
independent generations. Each is its own `GenerationRequest` (`fan_out` makes the n copies
of one, seed + i for choice i, so a seeded request gives each choice its own reproducible
stream) and its own job; they are submitted together, in choice order:
- the one-session loop serves them one after another (taking turns with other requests'
  jobs), and a choice that directly follows another of its prompt reuses the prompt's KV
  prefix from the session (prefix cache);
- the batched loop (`--batched-session N`) spreads them over the slots that no other
  request waits for and decodes them as one batch; the first choice prefills the prompt and the others copy its keys and
  values into their slots (`server.batching`).
The order of choices is prompt-major, as OpenAI and vLLM return them: choice
`p * n + i` is sample i of prompt p.

- `submit_choices(worker, gens, loop)`: submit the jobs as one request of the worker's fair
  schedule (its choices take turns with other requests' jobs, `server.jobs.JobLedger`); the
  returned queue receives `ChoiceEvent(index, event)` from the worker thread. A request that
  asks for more work than the worker's limits (`InferenceWorker.check`: choices x max_tokens,
  prompts x prompt length when scored) is refused with a 400 before anything is queued
  (`check_work`, which the one-job APIs call too).
- `choice_events(queue, n, keepalive)`: those events in arrival order with `None` keepalive
  ticks until the first text, ending once every choice has finished or failed.
- `collect_choices(queue, n)`: the whole output of every choice, or the first `Failed`.
- `total_usage(usages, n)`: completion tokens of all choices; prompt (and cached) tokens of
  each prompt once, as OpenAI counts them.

It knows no API's field names (the API modules build the answers) and runs no inference.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from server.errors import ApiError
from server.jobs import Event, Failed, Finished, GenerationRequest, Job, TextDelta, TokenLogprob, Usage
from server.scoring import PromptScored
from server.sse import job_events

SEED_MODULUS = 2**63


@dataclass(frozen=True)
class ChoiceEvent:
    index: int
    event: Event | PromptScored


@dataclass
class ChoiceOutput:
    """Everything one choice produced, for a JSON answer."""
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt: PromptScored | None = None
    finished: Finished | None = None


def fan_out(gen: GenerationRequest, n: int) -> list[GenerationRequest]:
    """n copies of one request; with a seed, copy i samples from seed + i."""
    if n == 1:
        return [gen]
    seed = gen.sampling.seed
    return [gen if seed is None else
            dataclasses.replace(gen, sampling=dataclasses.replace(gen.sampling, seed=(seed + i) % SEED_MODULUS))
            for i in range(n)]


def check_work(worker: Any, gens: Sequence[GenerationRequest], param: str) -> None:
    """Raise the 400 for a request whose jobs ask for more work than the worker's limits
    (`InferenceWorker.check`); `param` names the field to blame for too many tokens to generate
    (the scored prompts are always `prompt`)."""
    refused = worker.check(gens)
    if refused is not None:
        raise ApiError(400, refused.message, param="prompt" if refused.scored else param, code="request_too_large")


def submit_choices(worker: Any, gens: Sequence[GenerationRequest],
                   loop: asyncio.AbstractEventLoop) -> tuple[list[Job], asyncio.Queue[ChoiceEvent]]:
    check_work(worker, gens, "n")
    queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()

    def sink(index: int) -> Any:
        return lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ChoiceEvent(index, ev))

    return worker.submit_request(gens, [sink(i) for i in range(len(gens))]), queue


def choice_events(queue: asyncio.Queue[ChoiceEvent], n: int,
                  keepalive_sec: float) -> AsyncIterator[ChoiceEvent | None]:
    return job_events(queue, keepalive_sec, streams=n, event_of=lambda item: item.event)


async def collect_choices(queue: asyncio.Queue[ChoiceEvent], n: int) -> list[ChoiceOutput] | Failed:
    outputs = [ChoiceOutput() for _ in range(n)]
    left = n
    while left:
        item = await queue.get()
        out, event = outputs[item.index], item.event
        if isinstance(event, TextDelta):
            out.text += event.text
            out.logprobs.extend(event.logprobs)
        elif isinstance(event, PromptScored):
            out.prompt = event
        elif isinstance(event, Finished):
            out.finished = event
            left -= 1
        elif isinstance(event, Failed):
            return event
    return outputs


def total_usage(usages: Sequence[Usage], n: int) -> Usage:
    """`usages` in choice order, `n` choices per prompt."""
    firsts = usages[::n]
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in firsts),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in firsts),
                 cache_written_tokens=sum(u.cache_written_tokens for u in firsts))
