"""Answer kinds: one record per kind, in one registry.

Contract
- `KINDS` maps each kind's name to its `AnswerKind` record, in the order error messages list
  them; `NAMES` is that order. `lookup(name)` returns a record or raises ValueError
  ("unknown answer kind ...").
- A record holds everything that differs between kinds: how to extract the answer from
  model output, how to read an answer key, how a picked answer is compared with the keys,
  the instruction the prompt gives, and whether the kind's cases carry options.
- Adding a kind is one record here plus its rows in `ds4eval.cases.selftest` (and a sanity case);
  `extract`, `grade`, `cases`, `prompts` and the command line learn nothing of its name.
- Pure: no I/O, no model.

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

It does not decide which output a case produced (backends) or build whole prompts
(`prompts`); the extraction rules themselves live in `extract`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from ds4eval.cases import extract as ex


def _any_equal(value: Any, keys: Iterator[Any]) -> bool:
    # Keys are read lazily, so a malformed alias after a matching key is never parsed.
    return any(value == k for k in keys)


@dataclass(frozen=True)
class AnswerKind:
    """One answer kind.

    extract(output, nchoices): the answer the output commits to, normalised, or None.
    parse_key(key): comparable form of a stripped answer key; ValueError if the kind cannot
      express it.
    read_picked(picked, nchoices): comparable form of an extracted answer, or None when it
      cannot match any key.
    accepts(value, keys): whether the picked value matches the parsed keys (an iterator,
      answer first, then aliases).
    instruction: the prompt's answer-format instruction; for a kind with options, `{first}`
      and `{last}` stand for the first and last option letter.
    takes_choices: cases of this kind list options, and `nchoices` matters.
    """

    name: str
    extract: Callable[[str, int], str | None]
    parse_key: Callable[[str], Any]
    read_picked: Callable[[str, int], Any]
    instruction: str
    accepts: Callable[[Any, Iterator[Any]], bool] = _any_equal
    takes_choices: bool = False

    def key(self, key: str) -> Any:
        """Comparable form of an answer key as written in a case (surrounding space ignored)."""
        return self.parse_key(key.strip())

    def is_correct(self, picked: str, keys: Iterable[str], nchoices: int = 0) -> bool:
        value = self.read_picked(picked, nchoices)
        if value is None:
            return False
        return self.accepts(value, (self.key(k) for k in keys))

    def prompt_instruction(self, nchoices: int = 0) -> str:
        if self.takes_choices:
            return self.instruction.format(first="A", last=chr(64 + nchoices))
        return self.instruction


def _ignoring_choices(read: Callable[[str], Any]) -> Callable[[str, int], Any]:
    """A (text, nchoices) function for a kind whose cases have no options."""
    return lambda text, nchoices: read(text)


def _key_parser(convert: Callable[[str], Any], empty: str = "", form: str | None = None,
                not_form: str = "") -> Callable[[str], Any]:
    """Key parser: ValueError(not_form) unless the key fully matches `form` (when given), then
    convert(key), ValueError(empty) when that comes out None or an empty text or tuple."""
    def parse(key: str) -> Any:
        if form is not None and not re.fullmatch(form, key):
            raise ValueError(not_form)
        value = convert(key)
        if value is None or (isinstance(value, (str, tuple)) and not value):
            raise ValueError(empty)
        return value
    return parse


def _parsed_or_none(parse: Callable[[str], Any]) -> Callable[[str, int], Any]:
    """read_picked that reads the picked text like a key; a text that is no key matches nothing."""
    def read(picked: str, nchoices: int) -> Any:
        try:
            return parse(picked.strip())
        except ValueError:
            return None
    return read


def _choice_picked(picked: str, nchoices: int) -> str | None:
    # A letter beyond the case's options is no answer, whatever the keys say.
    if nchoices and not "A" <= picked.upper() <= chr(64 + nchoices):
        return None
    return picked.upper()


def _within_accepted(named: frozenset[int], keys: Iterator[frozenset[int]]) -> bool:
    # Every key and alias adds accepted lines, so all of them are read.
    accepted: set[int] = set()
    for k in keys:
        accepted |= k
    return named <= accepted


_LINE_SPEC = _parsed_or_none(ex.parse_line_spec)
_INTEGER_KEY = _key_parser(lambda key: int(key.replace(",", "")),
                           form=r"-?(?:\d{1,3}(?:,\d{3})+|\d+)", not_form="expected an integer")

KINDS: dict[str, AnswerKind] = {k.name: k for k in (
    AnswerKind(
        "choice", ex.extract_choice,
        parse_key=_key_parser(str.upper, form=r"[A-Za-z]", not_form="expected a single letter"),
        read_picked=_choice_picked, takes_choices=True,
        instruction="Pick the single best option. End your reply with the line \"Answer: X\", where "
                    "X is the letter of the option ({first}-{last})."),
    AnswerKind(
        "integer", _ignoring_choices(ex.extract_integer), _INTEGER_KEY, _parsed_or_none(_INTEGER_KEY),
        "End your reply with the line \"Answer: N\", where N is the final integer."),
    AnswerKind(
        "rational", _ignoring_choices(ex.extract_rational),
        _key_parser(ex.parse_rational, "zero denominator", not_form="expected p/q, a decimal or \\frac{p}{q}",
                    form=r"-?\d+(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?|\\d?frac\{-?\d+\}\{-?\d+\}"),
        _ignoring_choices(ex.parse_rational),
        "Give the exact value. End your reply with the line \"Answer: p/q\" (a fraction in lowest "
        "terms, or an integer)."),
    AnswerKind(
        "exact_text", _ignoring_choices(ex.extract_exact_text),
        _key_parser(ex.normalize_text, "empty after normalisation"), _ignoring_choices(ex.normalize_text),
        "End your reply with the line \"Answer: ...\" giving only the final answer."),
    AnswerKind(
        "ordered_sequence", _ignoring_choices(ex.extract_ordered_sequence),
        _key_parser(lambda key: tuple(ex.split_sequence(key)), "no elements"),
        _ignoring_choices(lambda picked: tuple(ex.split_sequence(picked))),
        "End your reply with the line \"Answer: ...\" giving the answers in the order asked, "
        "separated by commas."),
    AnswerKind(
        "line_set", _ignoring_choices(ex.extract_line_set), ex.parse_line_spec,
        read_picked=lambda picked, nchoices: _LINE_SPEC(picked, nchoices) or None,  # no line: no answer
        accepts=_within_accepted,
        instruction="End your reply with the line \"Answer: ...\" giving the line number (or a few "
                    "comma-separated line numbers) of the problem, or \"Answer: 0\" if the code is "
                    "safe."),
)}
NAMES: tuple[str, ...] = tuple(KINDS)


def lookup(name: str) -> AnswerKind:
    """The record of kind `name`; ValueError for a name the registry does not hold."""
    try:
        return KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown answer kind {name!r}") from None


def extract(kind: str, output: str, nchoices: int = 0) -> str | None:
    """The answer `output` commits to under answer kind `kind`; ValueError on an unknown kind."""
    return lookup(kind).extract(output, nchoices)
