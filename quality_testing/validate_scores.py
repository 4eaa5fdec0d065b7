"""Scorer coverage: can every case of every suite be scored, and is every answer kind self-tested?

    python -m quality_testing.validate_scores [--data-dir DIR]

Checks, in order:
  1. the extractor self-test table passes (`ds4eval.cases.selftest.run_self_test`);
  2. every answer kind used by any suite whose cases are available has self-test rows
     (`ds4eval.cases.selftest.covered_kinds`);
  3. every case file parses without problems (`ds4eval.cases.case.parse_cases`), and every case
     has a scorer: its kind is in the `ds4eval.cases.answerkinds` registry and its key and aliases
     parse with `ds4eval.cases.grade.parse_key`;
  4. the sanity suite's keys grade as correct when fed back as the model output, both bare
     ("B") and on an answer line ("Answer: B"), and for cases with options a wrong letter
     does not.
Suites whose data files are absent (benchmark suites outside the repository) are listed as
skipped, not failed. Only case ids are printed, never question or answer text.
`check_scores` is pure (cases in, report out); `main` reads the files.
It does not run a model or judge the quality of answers.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import click

from ds4eval.cases import answerkinds
from ds4eval.cases import case as cs
from ds4eval.cases import grade
from ds4eval.cases import selftest

SANITY = "sanity"


@dataclass
class ScoreReport:
    suites_checked: dict[str, int] = field(default_factory=dict)  # suite -> cases
    suites_skipped: dict[str, str] = field(default_factory=dict)  # suite -> why
    kinds_used: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _scorer_problem(case: cs.Case) -> str | None:
    try:
        answerkinds.extract(case.answer_kind, "", case.nchoices)
    except ValueError as e:
        return f"no extractor: {e}"
    for key in (case.answer, *case.aliases):
        try:
            grade.parse_key(case.answer_kind, key)
        except ValueError as e:
            return f"key does not parse as {case.answer_kind}: {e}"
    return None


def _wrong_letter(case: cs.Case) -> str | None:
    accepted = {k.strip().upper() for k in (case.answer, *case.aliases)}
    return next((chr(65 + i) for i in range(case.nchoices) if chr(65 + i) not in accepted), None)


def verbatim_problems(case: cs.Case) -> list[str]:
    """Does the case's own key, given as the model's output, grade as correct (and a wrong letter not)?"""
    out = []
    for output in (case.answer, f"Answer: {case.answer}"):
        v = grade.grade_output(case.answer_kind, case.answer, output, case.aliases, case.nchoices)
        if not v.passed:
            form = "bare key" if output == case.answer else "answer line"
            out.append(f"{case.id}: its key as {form} grades as wrong (extracted {v.picked!r})")
    if answerkinds.lookup(case.answer_kind).takes_choices:
        wrong = _wrong_letter(case)
        if wrong and grade.grade_output(case.answer_kind, case.answer, f"Answer: {wrong}", case.aliases, case.nchoices).passed:
            out.append(f"{case.id}: a wrong letter grades as correct")
    return out


def check_scores(parsed: Mapping[str, cs.ParsedFile | None], suite_of_file: Mapping[str, Sequence[str]],
                 self_test_failures: Sequence[tuple[selftest.SelfTestCase, grade.Verdict]], covered: frozenset[str]) -> ScoreReport:
    """parsed: file label -> parsed file (None when absent); suite_of_file: file label -> suites it feeds."""
    rep = ScoreReport()
    for row, verdict in self_test_failures:
        rep.problems.append(f"self-test row {row.name!r} ({row.kind}) fails: extracted {verdict.picked!r}")
    for label, pf in parsed.items():
        suites = suite_of_file[label]
        if pf is None:
            for s in suites:
                rep.suites_skipped[s] = f"{label} is not in the data directory"
            continue
        for lineno, msg in pf.problems:
            rep.problems.append(f"{label}:{lineno}: {msg}")
        for s in suites:
            members = [c for c in pf.cases if s in c.suites]
            rep.suites_checked[s] = len(members)
            if not members:
                rep.problems.append(f"suite {s}: no cases in {label}")
        for c in pf.cases:
            rep.kinds_used.add(c.answer_kind)
            why = _scorer_problem(c)
            if why:
                rep.problems.append(f"{label}: case {c.id}: {why}")
            if SANITY in c.suites:
                rep.problems.extend(verbatim_problems(c))
    for kind in sorted(rep.kinds_used - covered):
        rep.problems.append(f"answer kind {kind!r} is used by a suite but has no extractor self-test rows")
    return rep


def load_inputs(data_dir: Path) -> tuple[dict[str, cs.ParsedFile | None], dict[str, list[str]]]:
    """Each distinct case file once, with the suites that read it."""
    files: dict[Path, list[str]] = {}
    for suite in cs.KNOWN_SUITES:
        files.setdefault(cs.suite_file(suite, data_dir), []).append(suite)
    parsed, suites = {}, {}
    for path, names in files.items():
        label = path.name if path.parent != cs.SUITES_DIR / SANITY else f"suites/{SANITY}/{path.name}"
        parsed[label] = cs.load_file(path) if path.is_file() else None
        suites[label] = names
    return parsed, suites


@click.command()
@click.option("--data-dir", default=None, help="Benchmark data directory (default: $DS4EVAL_DATA, then the per-user one).")
def main(data_dir: str | None) -> None:
    """Check scorer coverage of every suite; exit 1 on any gap."""
    try:
        parsed, suites = load_inputs(cs.resolve_data_dir(data_dir))
    except OSError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    rep = check_scores(parsed, suites, selftest.run_self_test(), selftest.covered_kinds())
    for s, n in rep.suites_checked.items():
        click.echo(f"suite {s:<11} {n:4d} cases checked")
    for s, why in rep.suites_skipped.items():
        click.echo(f"suite {s:<11} skipped: {why}")
    click.echo(f"answer kinds used: {', '.join(sorted(rep.kinds_used)) or '-'}; "
               f"self-tested: {', '.join(sorted(selftest.covered_kinds()))}")
    for p in rep.problems:
        click.echo(f"FAIL {p}")
    click.echo("scorer coverage ok" if rep.ok else f"{len(rep.problems)} problem(s)")
    sys.exit(0 if rep.ok else 1)


if __name__ == "__main__":
    main()
