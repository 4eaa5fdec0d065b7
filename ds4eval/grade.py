"""Grading: compare an extracted answer with a case's key and aliases.

Contract
- `parse_key(kind, key)` reads an answer key into its comparable form and raises ValueError
  for a key that kind cannot express (used to reject malformed cases).
- `is_correct(kind, picked, answer, aliases, nchoices)` decides one verdict; `grade_output`
  extracts and grades raw model output in one call and returns a `Verdict`.
- Pure functions: no I/O, no model.

Equivalences:
- choice: the letter, case-insensitive.
- integer: numeric value (leading zeros and thousands separators do not matter).
- rational: exact value, so 25/2, 12.5 and \\frac{25}{2} are the same answer. Values are never
  compared as string suffixes ("25" must not match "5").
- exact_text: text after `extract.normalize_text` (case, spacing, LaTeX wrappers).
- ordered_sequence: same number of elements, each equal after normalisation, in order; an
  alias may list another accepted order.
- line_set: the model names at least one line and every named line is in the accepted set;
  "0" means the function is safe.
It does not extract answers itself beyond delegating to `extract`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from ds4eval import extract as ex


def parse_key(kind: str, key: str):
    """Comparable form of an answer key; ValueError if `key` is not valid for `kind`."""
    key = key.strip()
    if kind == "choice":
        if not re.fullmatch(r"[A-Za-z]", key):
            raise ValueError("expected a single letter")
        return key.upper()
    if kind == "integer":
        if not re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)", key):
            raise ValueError("expected an integer")
        return int(key.replace(",", ""))
    if kind == "rational":
        if not re.fullmatch(r"-?\d+(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?|\\d?frac\{-?\d+\}\{-?\d+\}", key):
            raise ValueError("expected p/q, a decimal or \\frac{p}{q}")
        q = ex.parse_rational(key)
        if q is None:
            raise ValueError("zero denominator")
        return q
    if kind == "exact_text":
        norm = ex.normalize_text(key)
        if not norm:
            raise ValueError("empty after normalisation")
        return norm
    if kind == "ordered_sequence":
        items = ex.split_sequence(key)
        if not items:
            raise ValueError("no elements")
        return tuple(items)
    if kind == "line_set":
        return ex.parse_line_spec(key)
    raise ValueError(f"unknown answer kind {kind!r}")


def is_correct(kind: str, picked: str | None, answer: str, aliases: Iterable[str] = (),
               nchoices: int = 0) -> bool:
    """True when `picked` (an extractor's output) matches the key or one of the aliases."""
    if picked is None:
        return False
    keys = [answer, *aliases]
    if kind == "choice":
        if nchoices and not "A" <= picked.upper() <= chr(64 + nchoices):
            return False
        return any(picked.upper() == parse_key(kind, k) for k in keys)
    if kind == "integer":
        try:
            value = parse_key(kind, picked)
        except ValueError:
            return False
        return any(value == parse_key(kind, k) for k in keys)
    if kind == "rational":
        value = ex.parse_rational(picked)
        return value is not None and any(value == parse_key(kind, k) for k in keys)
    if kind == "exact_text":
        value = ex.normalize_text(picked)
        return any(value == parse_key(kind, k) for k in keys)
    if kind == "ordered_sequence":
        value = tuple(ex.split_sequence(picked))
        return any(value == parse_key(kind, k) for k in keys)
    if kind == "line_set":
        try:
            named = ex.parse_line_spec(picked)
        except ValueError:
            return False
        if not named:
            return False
        accepted: set[int] = set()
        for k in keys:
            accepted |= parse_key(kind, k)
        return named <= accepted
    raise ValueError(f"unknown answer kind {kind!r}")


@dataclass(frozen=True)
class Verdict:
    picked: str | None
    passed: bool


def grade_output(kind: str, answer: str, output: str, aliases: Iterable[str] = (),
                 nchoices: int = 0) -> Verdict:
    """Extract from raw model output and grade it."""
    picked = ex.extract(kind, output, nchoices)
    return Verdict(picked, is_correct(kind, picked, answer, aliases, nchoices))

