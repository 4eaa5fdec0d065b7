"""The conditions of a determinism run, each a way a stack might change an answer it should not.

Contract
- `CONDITIONS` is the registry, by the name `--conditions` takes; each kind's `run(ctx)`
  sends its requests through `ctx.target` and returns one `analysis.Group` per prompt and
  named condition. Every request is the prompt's own greedy request (temperature and seed of
  the run), `max_tokens` tokens, unless the condition varies that.
  - `alone`: each prompt by itself, `repeats` times, prompts in turn (run-to-run; whatever the
    stack caches between requests stays, as it would for a user). Its first completion of
    each prompt is the reference the mixed and shape conditions compare with.
  - `mixed`: for each C of `concurrency`, `mixed_rounds` rounds; in each round the prompts are
    shuffled (fixed seed) and sent in groups of C + 1, staggered, so each prompt decodes while
    C others of different lengths are in flight at other positions (batch composition).
    Conditions "mixed C=1", "mixed C=4"...; prompts short of a full group are padded with
    others as companions, whose completions are not counted twice.
  - `prefix`: the prompt behind a long shared context (`prompts.PREFIX_TEXT`) after a salt no
    earlier request used: first cold, then after a sibling request (same context, another
    question, one token) has left the context in the cache, then once more with the whole
    prompt cached. The cold completion is the group's reference.
  - `shape`: the request's form, each its own condition: "stream" (streamed against whole),
    "n=2" (two choices of one request against one; greedy runs only), "max_tokens" (half the
    budget must give the reference's first half; needs the stack's tokens).
  A kind the target cannot run (streaming on the in-process engine) or a variant the settings
  rule out is skipped with a note, never counted as invariant.
- `RunContext.reference` maps each prompt to its first `alone` completion; conditions that
  need it run after `alone` (the registry's order).
It judges nothing (`analysis`) and prints only through `ctx.progress`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ds4eval.config import DeterminismConfig
from ds4eval.determinism.analysis import Completion, Group, Prompt
from ds4eval.determinism.prompts import salted_system
from ds4eval.determinism.targets import Request, Target


_DEFAULTS = DeterminismConfig()


@dataclass(frozen=True)
class Plan:
    """What the conditions send; the defaults are the command's (`DeterminismConfig`)."""

    repeats: int = _DEFAULTS.repeats
    concurrency: tuple[int, ...] = _DEFAULTS.concurrency
    mixed_rounds: int = _DEFAULTS.mixed_rounds
    max_tokens: int = _DEFAULTS.max_tokens
    temperature: float = _DEFAULTS.temperature
    seed: int = _DEFAULTS.seed
    stagger_s: float = 0.05
    """Seconds between the starts of a mixed group's requests (the engine: scheduler steps instead)."""
    salt: str = "0"
    """Makes the prefix condition's context new to the stack (a fresh one per run)."""


@dataclass
class RunContext:
    target: Target
    prompts: Sequence[Prompt]
    plan: Plan
    progress: Callable[[str], None] = lambda line: None
    reference: dict[str, Completion] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def request(self, prompt: Prompt, label: str, **changes) -> Request:
        fields = dict(system=prompt.system, user=prompt.user, max_tokens=self.plan.max_tokens,
                      temperature=self.plan.temperature, seed=self.plan.seed)
        fields.update(changes)
        return Request(label, **fields)

    def alone(self, request: Request) -> list[Completion]:
        return self.target.generate([request])[0]


def run_alone(ctx: RunContext) -> list[Group]:
    done: dict[str, list[Completion]] = {p.key: [] for p in ctx.prompts}
    for r in range(ctx.plan.repeats):
        for p in ctx.prompts:
            done[p.key] += ctx.alone(ctx.request(p, f"alone {r}"))
        ctx.progress(f"alone: repeat {r + 1}/{ctx.plan.repeats}")
    for p in ctx.prompts:
        ctx.reference[p.key] = next((c for c in done[p.key] if not c.error), done[p.key][0])
    return [Group(p.key, "alone", tuple(done[p.key])) for p in ctx.prompts]


def mixed_groups(n_prompts: int, c: int, round_seed: int) -> list[tuple[list[int], int]]:
    """Groups of C + 1 prompt indices covering every prompt once in a shuffled order: each
    (members, counted) lists the group's prompts, of which the first `counted` are recorded and
    the rest are companions borrowed to fill a short last group."""
    order = list(range(n_prompts))
    random.Random(round_seed).shuffle(order)
    size = c + 1
    groups = []
    for start in range(0, n_prompts, size):
        members = order[start:start + size]
        counted = len(members)
        pool = [i for i in order if i not in members]
        while len(members) < size:
            members.append(pool[(len(members) - counted) % len(pool)] if pool else members[0])
        groups.append((members, counted))
    return groups


def run_mixed(ctx: RunContext) -> list[Group]:
    groups = []
    for c in ctx.plan.concurrency:
        name = f"mixed C={c}"
        done: dict[str, list[Completion]] = {p.key: [] for p in ctx.prompts}
        for r in range(ctx.plan.mixed_rounds):
            for members, counted in mixed_groups(len(ctx.prompts), c, ctx.plan.seed * 1_000_003 + c * 101 + r):
                reqs = [ctx.request(ctx.prompts[i], f"{name} round {r}") for i in members]
                results = ctx.target.generate(reqs, ctx.plan.stagger_s)
                for i, comps in list(zip(members, results))[:counted]:
                    done[ctx.prompts[i].key] += comps
            ctx.progress(f"{name}: round {r + 1}/{ctx.plan.mixed_rounds}")
        groups += [Group(p.key, name, (ctx.reference[p.key], *done[p.key])) for p in ctx.prompts]
    return groups


def run_prefix(ctx: RunContext) -> list[Group]:
    groups = []
    n = len(ctx.prompts)
    for k, p in enumerate(ctx.prompts):
        system = salted_system(p, f"{ctx.plan.salt}-{k}")
        sibling = ctx.prompts[(k + 1) % n] if n > 1 else p
        cold = ctx.alone(ctx.request(p, "prefix cold", system=system))
        ctx.alone(ctx.request(sibling, "prefix sibling", system=system,
                              user=sibling.user if sibling is not p else p.user + " Be brief.", max_tokens=1))
        warm = ctx.alone(ctx.request(p, "prefix warm (context cached)", system=system))
        full = ctx.alone(ctx.request(p, "prefix warm (prompt cached)", system=system))
        groups.append(Group(p.key, "prefix", (*cold, *warm, *full)))
    ctx.progress(f"prefix: {n} prompts")
    return groups


def run_shape(ctx: RunContext) -> list[Group]:
    groups: list[Group] = []
    target, plan = ctx.target, ctx.plan
    with_tokens = all(c.tokens is not None for c in ctx.reference.values() if not c.error)
    if target.supports_stream:
        for p in ctx.prompts:
            got = ctx.alone(ctx.request(p, "stream", stream=True))
            groups.append(Group(p.key, "stream", (ctx.reference[p.key], *got)))
        ctx.progress("shape: stream")
    else:
        ctx.notes.append("stream: not applicable to the in-process engine (no HTTP stream)")
    if plan.temperature > 0:
        ctx.notes.append("n=2: skipped, the run samples (two choices of one sampled request differ by design)")
    elif target.supports_n:
        for p in ctx.prompts:
            got = ctx.alone(ctx.request(p, "n=2", n=2))
            groups.append(Group(p.key, "n=2", (ctx.reference[p.key], *got)))
        ctx.progress("shape: n=2")
    half = max(1, plan.max_tokens // 2)
    if not with_tokens:
        ctx.notes.append("max_tokens: skipped, the stack returned no tokens to cut the reference at")
    else:
        for p in ctx.prompts:
            got = ctx.alone(ctx.request(p, f"max_tokens={half}", max_tokens=half))
            groups.append(Group(p.key, "max_tokens", (ctx.reference[p.key].truncated(half), *got)))
        ctx.progress("shape: max_tokens")
    return groups


@dataclass(frozen=True)
class ConditionKind:
    name: str
    run: Callable[[RunContext], list[Group]]
    summary: str


CONDITIONS: dict[str, ConditionKind] = {k.name: k for k in (
    ConditionKind("alone", run_alone, "each prompt by itself, repeated (run to run)"),
    ConditionKind("mixed", run_mixed, "sent while C other requests are in flight (batch composition)"),
    ConditionKind("prefix", run_prefix, "a long shared context cold, then cached (prefix cache)"),
    ConditionKind("shape", run_shape, "streamed, n=2, a smaller max_tokens (request form)"),
)}
"""Every condition kind, in the order a run measures them (alone first: it makes the references)."""


def run_conditions(ctx: RunContext, names: Sequence[str]) -> list[Group]:
    """The groups of the named kinds (alone always runs first: the others compare with it)."""
    wanted = ["alone", *(n for n in CONDITIONS if n in names and n != "alone")]
    groups: list[Group] = []
    for name in wanted:
        groups += CONDITIONS[name].run(ctx)
    return groups
