"""Evaluation cases: the `Case` record, parsing of case files, hashing and selection.

Contract
- A case file is JSON Lines, one case object per line (format: `suites/README.md`).
  `parse_case(obj)` turns one decoded object into a `Case` or raises `CaseError`
  naming what is wrong; `parse_cases(text)` does a whole file and collects every
  problem instead of stopping at the first.
- `case_hash(case)` is the canonical content hash that suite manifests pin: SHA-256
  over a canonical JSON encoding of every content field (suite membership excluded,
  because the manifest itself records membership).
- `resolve_data_dir()` picks the data directory: explicit value, then the
  `DS4EVAL_DATA` environment variable, then the per-user default.
- `suite_file(suite, data_dir)` says which file holds a suite's cases.
- `select_cases()` filters a list of cases by suite, id, domain and source.

It does not fetch data (see `datapull`), compare against manifests (see `manifest`), load a
suite checked against its manifest (see `suites`), or know anything about prompts; keys are
read through the answer-kind registry (`answerkinds`, `grade`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ds4eval.cases import answerkinds
from ds4eval.cases import grade

MAX_CHOICES = 10
KNOWN_SUITES = ("sanity", "core", "hard", "hard-smoke")

# Where each suite's cases live: committed suites ship their jsonl in suites/<name>/,
# benchmark suites are read from the data directory (their answer keys stay out of the repo).
REPO_ROOT = Path(__file__).resolve().parents[2]
SUITES_DIR = REPO_ROOT / "suites"
SUITE_DATA_FILE = {"core": "core.jsonl", "hard": "hard.jsonl", "hard-smoke": "hard.jsonl"}
COMMITTED_SUITE_FILE = {"sanity": SUITES_DIR / "sanity" / "cases.jsonl"}


class CaseError(ValueError):
    """A case object that is not well formed; the message names the field."""


@dataclass(frozen=True)
class Case:
    """One evaluation item. Option i of `choices` is letter chr(65 + i)."""

    source: str
    id: str
    domain: str
    title: str
    question: str
    choices: tuple[str, ...]
    answer: str
    aliases: tuple[str, ...]
    answer_kind: str
    suites: tuple[str, ...]
    max_tokens: int | None = None

    @property
    def key(self) -> tuple[str, str]:
        """(source, id): unique across all suites."""
        return (self.source, self.id)

    @property
    def nchoices(self) -> int:
        return len(self.choices)

    def to_json(self) -> dict:
        out = {
            "source": self.source, "id": self.id, "domain": self.domain, "title": self.title,
            "question": self.question, "choices": list(self.choices), "answer": self.answer,
            "aliases": list(self.aliases), "answer_kind": self.answer_kind,
            "suites": list(self.suites),
        }
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        return out


_REQUIRED_STR = ("source", "id", "question", "answer", "answer_kind")
_OPTIONAL_STR = ("domain", "title")


def parse_case(obj: object) -> Case:
    """Validate one decoded JSON object and build a `Case`; raise `CaseError` if malformed."""
    if not isinstance(obj, dict):
        raise CaseError("not a JSON object")
    known = {f.name for f in dataclasses.fields(Case)}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise CaseError(f"unknown field(s): {', '.join(unknown)}")
    for name in _REQUIRED_STR:
        v = obj.get(name)
        if not isinstance(v, str) or not v.strip():
            raise CaseError(f"field {name!r} must be a non-empty string")
    for name in _OPTIONAL_STR:
        if not isinstance(obj.get(name, ""), str):
            raise CaseError(f"field {name!r} must be a string")
    kind = obj["answer_kind"]
    if kind not in answerkinds.NAMES:
        raise CaseError(f"answer_kind {kind!r} is not one of {', '.join(answerkinds.NAMES)}")
    choices = obj.get("choices", [])
    aliases = obj.get("aliases", [])
    suites = obj.get("suites", [])
    for name, seq in (("choices", choices), ("aliases", aliases), ("suites", suites)):
        if not isinstance(seq, list) or not all(isinstance(s, str) and s.strip() for s in seq):
            raise CaseError(f"field {name!r} must be a list of non-empty strings")
    if len(set(suites)) != len(suites):
        raise CaseError("field 'suites' lists a suite twice")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens <= 0):
        raise CaseError("field 'max_tokens' must be a positive integer")
    answer = obj["answer"]
    if answerkinds.lookup(kind).takes_choices:
        if not 2 <= len(choices) <= MAX_CHOICES:
            raise CaseError(f"a choice case needs 2..{MAX_CHOICES} choices, has {len(choices)}")
        if len(answer) != 1 or not "A" <= answer <= chr(64 + len(choices)):
            raise CaseError(f"choice answer {answer!r} is not a letter A..{chr(64 + len(choices))}")
    elif choices:
        raise CaseError(f"a {kind} case must not have choices")
    _check_answer_shape(kind, answer)
    for a in aliases:
        _check_answer_shape(kind, a, what="alias")
    return Case(
        source=obj["source"], id=obj["id"], domain=obj.get("domain", ""), title=obj.get("title", ""),
        question=obj["question"], choices=tuple(choices), answer=answer, aliases=tuple(aliases),
        answer_kind=kind, suites=tuple(suites), max_tokens=max_tokens,
    )


def _check_answer_shape(kind: str, answer: str, what: str = "answer") -> None:
    # The answer grammar lives in one place (the grader), so a key it cannot read is malformed.
    try:
        grade.parse_key(kind, answer)
    except ValueError as e:
        raise CaseError(f"{what} {answer!r} is not a valid {kind} key: {e}") from None


@dataclass
class ParsedFile:
    """Result of parsing one case file: good cases plus (line number, message) problems."""

    cases: list[Case] = field(default_factory=list)
    problems: list[tuple[int, str]] = field(default_factory=list)


def parse_cases(text: str) -> ParsedFile:
    """Parse JSON Lines text; blank lines are ignored, duplicates and bad lines reported."""
    out = ParsedFile()
    seen: set[tuple[str, str]] = set()
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            out.problems.append((lineno, f"invalid JSON: {e.msg}"))
            continue
        try:
            case = parse_case(obj)
        except CaseError as e:
            ident = obj.get("id") if isinstance(obj, dict) else None
            out.problems.append((lineno, f"case {ident!r}: {e}" if ident else str(e)))
            continue
        if case.key in seen:
            out.problems.append((lineno, f"case {case.id!r}: duplicate id in source {case.source!r}"))
            continue
        seen.add(case.key)
        out.cases.append(case)
    return out


def canonical_content(case: Case) -> str:
    """The exact string whose SHA-256 is the case hash (see module docstring)."""
    obj = case.to_json()
    del obj["suites"]
    obj.setdefault("max_tokens", None)
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def case_hash(case: Case) -> str:
    return "sha256:" + hashlib.sha256(canonical_content(case).encode("utf-8")).hexdigest()


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "ds4eval" / "data"


def resolve_data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """--data-dir, else $DS4EVAL_DATA, else the per-user default (which may not exist yet)."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get("DS4EVAL_DATA")
    if env:
        return Path(env).expanduser()
    return default_data_dir()


def suite_file(suite: str, data_dir: Path) -> Path:
    if suite in COMMITTED_SUITE_FILE:
        return COMMITTED_SUITE_FILE[suite]
    if suite in SUITE_DATA_FILE:
        return data_dir / SUITE_DATA_FILE[suite]
    raise ValueError(f"unknown suite {suite!r} (known: {', '.join(KNOWN_SUITES)})")


def load_file(path: Path) -> ParsedFile:
    return parse_cases(path.read_text(encoding="utf-8"))


def select_cases(cases: Sequence[Case], *, ids: Iterable[str] = (), domains: Iterable[str] = (),
                 sources: Iterable[str] = ()) -> list[Case]:
    """Keep cases matching every given filter; within a filter any value matches (case-insensitive
    for domain and source, exact for id)."""
    ids, domains, sources = set(ids), {d.lower() for d in domains}, {s.lower() for s in sources}
    return [c for c in cases
            if (not ids or c.id in ids)
            and (not domains or c.domain.lower() in domains)
            and (not sources or c.source.lower() in sources)]
