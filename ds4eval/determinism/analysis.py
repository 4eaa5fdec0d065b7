"""Does a stack give the same completion every time? The pure analysis behind `ds4-eval determinism`.

Contract
- A `Completion` is what one request returned for one prompt: its text and, where the stack
  returned log-probabilities, the generated tokens with the top-2 gap (logprob of the first
  choice minus that of the second, in nats) at each of them.
- A `Group` is every completion of one prompt under one condition; its first completion is
  the reference the others are measured against (the prompt's first `alone` run, or for
  conditions with a prompt of their own their own first run).
- `analyze(group, margin) -> Outcome`: the number of distinct completions, and where they part
  from the reference: the first unit (token where every completion has tokens, else word)
  at which some completion differs, both sides' units there, and the reference's top-2 gap at
  that unit. A divergence whose gap is at most `margin` is a near-tie (two tokens the model
  rates almost equally, where the last bits of a kernel decide); above it, a real one; with
  no log-probabilities, unknown.
- `summarize(outcomes) -> list[ConditionVerdict]`: per condition, invariant (every prompt one
  distinct completion) or varies, with the counts by class; `Result` bundles them with the
  stack and settings, and `Result.to_json()` / `read_result(text)` are exact inverses, the
  file `ds4-eval compare --noise` reads (`FORMAT`, version `VERSION`).
- `explain_flips(result, flipped, compared)`: how many of a comparison's flipped cases the
  stack's own non-determinism explains: by case where the determinism run measured the same
  cases (a flip on a case whose output varied is explained, on one that held steady is not),
  else by rate (the share of prompts that varied, times the cases compared, with the exact
  binomial 95% upper bound).
It sends no request and renders nothing (`ds4eval.determinism.conditions`,
`ds4eval.reports.determinism`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from ds4eval.verdict.repeats import word_split

FORMAT = "ds4eval-determinism"
VERSION = 1
DEFAULT_MARGIN = 0.25
"""Nats: a divergence whose top-2 gap at the parting token is at most this is a near-tie.
Serving stacks commonly produce bfloat16 logits, whose spacing at the magnitudes of a small
model's top logits (16 to 64) is 0.0625 to 0.25: every divergence measured on the engine's
CUDA path had a gap of 0, 0.0625, 0.125 or 0.25, one rounding step of one logit. A larger gap
is a choice the model made, not rounding; float32 stacks may pass a smaller --margin."""
CLASSES = ("near-tie", "real", "unknown")


class DeterminismInputError(ValueError):
    """A determinism result file that cannot be read; the message is one line."""


@dataclass(frozen=True)
class Completion:
    label: str
    """What produced it: "alone 2", "mixed C=4 round 1", "stream", "n=2 choice 1"..."""
    text: str
    tokens: tuple[str, ...] | None = None
    """The generated tokens as the stack reported them; None where it gave no log-probabilities."""
    gaps: tuple[float | None, ...] = ()
    """The top-2 gap (nats) at each token; None where fewer than two alternatives came back."""
    finish: str = ""
    error: str = ""
    """Why the request failed ("" for a completion); a failed request is left out of the counts."""

    def units(self, by_token: bool) -> tuple[str, ...]:
        return tuple(self.tokens or ()) if by_token else tuple(word_split(self.text))

    def truncated(self, n_tokens: int) -> "Completion":
        """The first n_tokens tokens: a longer budget must not change the tokens before it."""
        if self.tokens is None or len(self.tokens) <= n_tokens:
            return self
        return Completion(self.label, "".join(self.tokens[:n_tokens]), self.tokens[:n_tokens],
                          self.gaps[:n_tokens], "length", self.error)


@dataclass(frozen=True)
class Prompt:
    key: str
    """Unique in a run: "source/id" for a suite case, the prompt's own name otherwise."""
    system: str
    user: str


@dataclass(frozen=True)
class Group:
    prompt: str
    """Prompt.key."""
    condition: str
    """"alone", "mixed C=4", "prefix", "shape"."""
    completions: tuple[Completion, ...]


@dataclass(frozen=True)
class Divergence:
    index: int
    """The first unit (token or word, see Outcome.unit) where a completion parts from the reference."""
    reference: str
    """The reference's unit there ("" where the reference ended first)."""
    other: str
    other_label: str
    gap: float | None
    """The reference's top-2 gap at that token (nats); None without log-probabilities."""
    klass: str
    """near-tie, real or unknown."""


@dataclass(frozen=True)
class Outcome:
    prompt: str
    condition: str
    completions: int
    """Completions that came back (failed requests excluded)."""
    distinct: int
    unit: str
    """"token" where every completion came with tokens, else "word"."""
    divergence: Divergence | None
    errors: tuple[str, ...] = ()

    @property
    def invariant(self) -> bool:
        return self.distinct <= 1


def first_difference(a: Sequence[str], b: Sequence[str]) -> int | None:
    """The first index where a and b differ (one ending first counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(gap: float | None, margin: float) -> str:
    if gap is None:
        return "unknown"
    return "near-tie" if gap <= margin else "real"


def analyze(group: Group, margin: float = DEFAULT_MARGIN) -> Outcome:
    done = [c for c in group.completions if not c.error]
    errors = tuple(f"{c.label}: {c.error}" for c in group.completions if c.error)
    by_token = bool(done) and all(c.tokens is not None for c in done)
    unit = "token" if by_token else "word"
    if not done:
        return Outcome(group.prompt, group.condition, 0, 0, unit, None, errors)
    seqs = [c.units(by_token) for c in done]
    distinct = len(set(seqs))
    divergence = None
    if distinct > 1:
        ref = done[0]
        parts = [(first_difference(seqs[0], s), k) for k, s in enumerate(seqs[1:], 1)]
        index, k = min((i, k) for i, k in parts if i is not None)
        other = done[k]
        gap = None
        if by_token and index < len(ref.gaps):
            gap = ref.gaps[index]  # None where the stack gave fewer than two alternatives: unknown
        elif by_token and index < len(other.gaps):
            gap = other.gaps[index]  # the reference ended there; the other side's own gap is the one
        divergence = Divergence(index, _at(seqs[0], index), _at(seqs[k], index), other.label, gap,
                                classify(gap, margin) if by_token else "unknown")
    return Outcome(group.prompt, group.condition, len(done), distinct, unit, divergence, errors)


def _at(units: Sequence[str], i: int) -> str:
    return units[i] if i < len(units) else ""


@dataclass(frozen=True)
class ConditionVerdict:
    condition: str
    prompts: int
    """Prompts with at least one completion under the condition."""
    varying: int
    near_tie: int
    real: int
    unknown: int
    max_distinct: int
    failed: int
    """Requests that failed under the condition (they are not in the counts)."""

    @property
    def invariant(self) -> bool:
        return self.varying == 0 and self.failed == 0 and self.prompts > 0

    @property
    def verdict(self) -> str:
        if self.prompts == 0 or self.failed:
            return "incomplete"
        return "invariant" if self.varying == 0 else "varies"


def summarize(outcomes: Iterable[Outcome]) -> list[ConditionVerdict]:
    """One verdict per condition, in the order the conditions first appear."""
    by_condition: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_condition.setdefault(o.condition, []).append(o)
    verdicts = []
    for name, group in by_condition.items():
        varying = [o for o in group if not o.invariant]
        klass = [o.divergence.klass for o in varying if o.divergence is not None]
        verdicts.append(ConditionVerdict(
            name, sum(1 for o in group if o.completions), len(varying), klass.count("near-tie"),
            klass.count("real"), klass.count("unknown"), max((o.distinct for o in group), default=0),
            sum(len(o.errors) for o in group)))
    return verdicts


@dataclass(frozen=True)
class Result:
    """One determinism run: what was measured, how, and what came out."""

    stack: dict[str, str]
    """What ran: backend, URL or model file, served model name..."""
    settings: dict[str, object]
    """prompts, repeats, concurrency levels, max_tokens, temperature, seed, margin, conditions."""
    outcomes: tuple[Outcome, ...]
    notes: tuple[str, ...] = ()
    """Conditions skipped and why, units compared by word, and similar remarks."""
    elapsed_s: float = 0.0
    verdicts: tuple[ConditionVerdict, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.verdicts:
            object.__setattr__(self, "verdicts", tuple(summarize(self.outcomes)))

    @property
    def invariant(self) -> bool:
        return bool(self.verdicts) and all(v.invariant for v in self.verdicts)

    def varying_prompts(self, conditions: Iterable[str] | None = None) -> set[str]:
        """Prompts whose completion varied under any of `conditions` (all when None)."""
        wanted = None if conditions is None else set(conditions)
        return {o.prompt for o in self.outcomes
                if not o.invariant and (wanted is None or o.condition in wanted)}

    def to_json(self) -> str:
        data = {"format": FORMAT, "version": VERSION, "stack": self.stack, "settings": self.settings,
                "elapsed_s": round(self.elapsed_s, 3), "notes": list(self.notes),
                "invariant": self.invariant,
                "conditions": [{**asdict(v), "verdict": v.verdict} for v in self.verdicts],
                "outcomes": [asdict(o) for o in self.outcomes]}
        return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def read_result(text: str, label: str = "determinism result") -> Result:
    """The Result a `to_json` wrote; DeterminismInputError for anything else."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DeterminismInputError(f"{label}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DeterminismInputError(f"{label}: not a ds4-eval determinism result (no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise DeterminismInputError(f"{label}: determinism format version {data.get('version')!r}, "
                                    f"this ds4-eval reads {VERSION}")
    try:
        outcomes = tuple(_outcome(o) for o in data["outcomes"])
        verdicts = tuple(ConditionVerdict(**{k: v for k, v in c.items() if k != "verdict"})
                         for c in data["conditions"])
        return Result(dict(data["stack"]), dict(data["settings"]), outcomes, tuple(data.get("notes", ())),
                      float(data.get("elapsed_s", 0.0)), verdicts)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # AttributeError: a list item not an object
        raise DeterminismInputError(f"{label}: malformed determinism result ({type(e).__name__}: {e})") from None


def _outcome(o: dict) -> Outcome:
    div = o.get("divergence")
    return Outcome(o["prompt"], o["condition"], int(o["completions"]), int(o["distinct"]), o["unit"],
                   None if div is None else Divergence(**div), tuple(o.get("errors", ())))


@dataclass(frozen=True)
class NoiseExplanation:
    flips: int
    """Flipped cases of the comparison."""
    compared: int
    """Cases the comparison judged."""
    method: str
    """"by case" (the determinism run measured these cases) or "by rate"."""
    explained: int
    """By case: flips on cases whose output varied on this stack. By rate: the expected number of
    cases whose output the stack's noise changes, capped at the flips."""
    upper: int
    """By case: as `explained`. By rate: the exact binomial 95% upper bound, capped at the flips."""
    measured: int
    """By case: the flipped cases the determinism run measured (the others are not judged)."""
    varying_share: float
    """The share of measured prompts whose completion varied under any condition."""

    @property
    def unexplained(self) -> int:
        return self.flips - self.upper


def explain_flips(noise: Result, flipped: Sequence[str], compared: Sequence[str]) -> NoiseExplanation:
    """How many of `flipped` (case names "source/id", a subset of `compared`) the stack's own
    non-determinism in `noise` explains (module docstring)."""
    measured_prompts = {o.prompt for o in noise.outcomes if o.completions}
    varying = noise.varying_prompts()
    share = len(varying) / len(measured_prompts) if measured_prompts else 0.0
    measured_flips = [f for f in flipped if f in measured_prompts]
    if set(compared) & measured_prompts:
        explained = sum(1 for f in measured_flips if f in varying)
        return NoiseExplanation(len(flipped), len(compared), "by case", explained, explained,
                                len(measured_flips), share)
    expected = share * len(compared)
    upper = binomial_upper(len(compared), share)
    return NoiseExplanation(len(flipped), len(compared), "by rate", min(len(flipped), math.floor(expected + 0.5)),
                            min(len(flipped), upper), 0, share)


def binomial_upper(n: int, p: float, level: float = 0.95) -> int:
    """The smallest k with P(Binomial(n, p) <= k) >= level (exact; n of a few thousands)."""
    if n <= 0 or p <= 0.0:
        return 0
    if p >= 1.0:
        return n
    total, k = 0.0, 0
    log_p, log_q = math.log(p), math.log1p(-p)
    while k <= n:
        total += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                          + k * log_p + (n - k) * log_q)
        if total >= level:
            return k
        k += 1
    return n
