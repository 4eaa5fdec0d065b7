"""Grading: compare an extracted answer with a case's key and aliases.

Contract
- `parse_key(kind, key)` reads an answer key into its comparable form and raises ValueError
  for a key that kind cannot express (used to reject malformed cases).
- `is_correct(kind, picked, answer, aliases, nchoices)` decides one verdict; `grade_output`
  extracts and grades raw model output in one call and returns a `Verdict`.
- Every per-kind rule is a record in `ds4eval.cases.answerkinds`; these functions look the kind up
  and raise ValueError for a kind the registry does not hold.
- Pure functions: no I/O, no model.

The equivalence each kind grades by is listed in `answerkinds`.
It does not extract answers itself beyond delegating to the kind's extractor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ds4eval.cases import answerkinds


def parse_key(kind: str, key: str):
    """Comparable form of an answer key; ValueError if `key` is not valid for `kind`."""
    return answerkinds.lookup(kind).key(key)


def is_correct(kind: str, picked: str | None, answer: str, aliases: Iterable[str] = (),
               nchoices: int = 0) -> bool:
    """True when `picked` (an extractor's output) matches the key or one of the aliases."""
    if picked is None:
        return False
    return answerkinds.lookup(kind).is_correct(picked, [answer, *aliases], nchoices)


@dataclass(frozen=True)
class Verdict:
    picked: str | None
    passed: bool


def grade_output(kind: str, answer: str, output: str, aliases: Iterable[str] = (),
                 nchoices: int = 0) -> Verdict:
    """Extract from raw model output and grade it."""
    picked = answerkinds.extract(kind, output, nchoices)
    return Verdict(picked, is_correct(kind, picked, answer, aliases, nchoices))
