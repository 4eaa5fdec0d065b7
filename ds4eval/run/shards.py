"""Shards of a run: which selected cases `ds4-eval run --shard I/N` runs, and where I and N come from.

Contract
- A case belongs to shard `assign(source, case_id, N)`: the first 8 bytes of the SHA-256 of
  "source/id", modulo N. The rule looks at nothing but the case's own identity, so adding or
  removing cases from a suite never moves another case between shards, the repeats of a case stay
  together, and every machine computes the same split without talking to the others. Shard sizes
  are therefore balanced only on average (binomially), not exactly.
- Shard indices are 0-based: `--shard 0/4` ... `--shard 3/4`.
- `shard_from_env(environ)` reads a scheduler's array-job variables (SHARD_ENV lists them, in the
  order they are tried): Slurm's SLURM_ARRAY_TASK_ID with SLURM_ARRAY_TASK_MIN, _STEP and _COUNT,
  or Kubernetes' JOB_COMPLETION_INDEX of an Indexed Job with DS4EVAL_SHARD_COUNT (a Job does not
  expose `.spec.completions` to its pods, so the manifest passes it).
- `part(selected, shard, repeats, filters)` is what one shard runs: its cases with the numbers
  they have in the whole selection, and the run header fields that tie it to the other shards.
- `selection_digest(cases, repeats)` names a run's whole selection (every case's identity and
  content hash, in run order, and the repeat count). Every shard of one run records the same
  digest, which is how a merge knows that the shards belong together.
Nothing here reads files, selects cases by flags or runs anything.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ds4eval.cases.case import Case, case_hash


class ShardError(ValueError):
    """A shard specification or environment that does not name one shard; the message is one line."""


@dataclass(frozen=True, order=True)
class Shard:
    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ShardError(f"shard {self.index}/{self.count}: the index must be in 0..count-1")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def holds(self, source: str, case_id: str) -> bool:
        return assign(source, case_id, self.count) == self.index


_SPEC = re.compile(r"(\d+)/(\d+)")


def parse_shard(text: str) -> Shard:
    """`I/N` as written on the command line (or in a run header)."""
    m = _SPEC.fullmatch(text.strip())
    if m is None:
        raise ShardError(f"--shard wants I/N (0-based, e.g. 0/4) or auto, not {text!r}")
    return Shard(int(m[1]), int(m[2]))


def resolve(spec: str | None, environ: Mapping[str, str]) -> Shard | None:
    """The shard `--shard SPEC` names: None without one, `environ`'s array job for "auto"."""
    if spec is None:
        return None
    return shard_from_env(environ) if spec == "auto" else parse_shard(spec)


def assign(source: str, case_id: str, count: int) -> int:
    """The shard (0-based, of `count`) that case source/id belongs to."""
    digest = hashlib.sha256(f"{source}/{case_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % count


def select(items: Iterable, shard: Shard, key=lambda c: (c.source, c.id)) -> list:
    """The items (cases, by default) that belong to `shard`, in their given order."""
    return [item for item in items if assign(*key(item), shard.count) == shard.index]


SHARD_ENV = (
    ("Slurm array job", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"),
    ("Kubernetes Indexed Job", "JOB_COMPLETION_INDEX", "DS4EVAL_SHARD_COUNT"),
)
"""(scheduler, index variable, count variable), tried in this order by `--shard auto`."""


def _int_var(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ShardError(f"--shard auto: {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ShardError(f"--shard auto: {name}={raw!r} is not a whole number") from None


def shard_from_env(env: Mapping[str, str]) -> Shard:
    """The shard a scheduler's array-job variables name (see SHARD_ENV)."""
    if env.get("SLURM_ARRAY_TASK_ID"):
        task = _int_var(env, "SLURM_ARRAY_TASK_ID")
        first = _int_var(env, "SLURM_ARRAY_TASK_MIN", 0)
        step = _int_var(env, "SLURM_ARRAY_TASK_STEP", 1)
        count = _int_var(env, "SLURM_ARRAY_TASK_COUNT")
        if step < 1 or (task - first) % step:
            raise ShardError(f"--shard auto: Slurm task {task} is not on the array's grid "
                             f"(min {first}, step {step}); use --array=0-{count - 1} or --shard I/N")
        return _checked((task - first) // step, count, "Slurm array")
    if env.get("JOB_COMPLETION_INDEX"):
        index = _int_var(env, "JOB_COMPLETION_INDEX")
        count = _int_var(env, "DS4EVAL_SHARD_COUNT")
        return _checked(index, count, "Kubernetes Indexed Job")
    names = ", ".join(f"{index} ({what})" for what, index, _ in SHARD_ENV)
    raise ShardError(f"--shard auto: no array-job index in the environment (looked for {names})")


def _checked(index: int, count: int, what: str) -> Shard:
    try:
        return Shard(index, count)
    except ShardError:
        raise ShardError(f"--shard auto: the {what} gives shard {index} of {count}, "
                         f"which is out of range") from None


def selection_digest(cases: Iterable[tuple[str, str, str]], repeats: int) -> str:
    """SHA-256 over (source, id, case hash) of every selected case in run order, and the repeats."""
    h = hashlib.sha256(f"repeats {repeats}\n".encode())
    for source, case_id, content in cases:
        h.update(f"{source}\t{case_id}\t{content}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class ShardPart:
    """What shard `shard` of a selection runs, and what its run header says of the whole."""

    shard: Shard
    cases: list[Case]
    numbers: list[int]  # each case's number in the whole selection (1-based, run order)
    selection: str      # selection_digest of the whole selection
    selected: int       # cases in the whole selection
    filters: str        # the selection flags, as JSON

    def header_fields(self) -> dict:
        """The shard fields of `ds4eval.run.trace.RunHeader`."""
        return {"shard": str(self.shard), "selection": self.selection, "selected": self.selected,
                "filters": self.filters}


def filters_json(case_ids: Sequence[str], domains: Sequence[str], sources: Sequence[str]) -> str:
    return json.dumps({"case_ids": list(case_ids), "domains": list(domains), "sources": list(sources)},
                      sort_keys=True, ensure_ascii=False)


def part(selected: Sequence[Case], shard: Shard, repeats: int, filters: str) -> ShardPart:
    """The cases of `selected` (the whole selection, in run order) that `shard` runs."""
    mine = [(n, c) for n, c in enumerate(selected, 1) if shard.holds(c.source, c.id)]
    digest = selection_digest(((c.source, c.id, case_hash(c)) for c in selected), repeats)
    return ShardPart(shard, [c for _, c in mine], [n for n, _ in mine], digest, len(selected), filters)
