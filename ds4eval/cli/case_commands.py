"""`ds4-eval` commands about cases and grading that run no model: list, validate, selftest, grade,
data pull; and the case lookups the run commands share (`load_selected`, `shard_part`,
`available_cases`).

Each handler takes its config (`ds4eval.config`), prints its result on stdout and returns the
exit status: 0, or 1 when a check it makes fails (validate, selftest). Bad input raises
`UsageFailure`. The cases, grading and data fetching themselves live in `ds4eval.cases`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ds4eval.cases import answerkinds
from ds4eval.cases import case as cs
from ds4eval.cases import grade, manifest, selftest
from ds4eval.cases.suites import DataMissing, load_suite
from ds4eval.cli import flags
from ds4eval.run import shards
from ds4eval.cli.command import Command
from ds4eval.cli.inputs import UsageFailure, read_text
from ds4eval.config import DataPullConfig, EvalConfig, GradeConfig, ListConfig, SelfTestConfig, ValidateConfig


def load_selected(cfg: EvalConfig | ListConfig) -> list[cs.Case]:
    """The cases of the suite that the selection flags pick; UsageFailure when none does."""
    data_dir = cs.resolve_data_dir(cfg.data_dir)
    try:
        suite_cases = load_suite(cfg.suite, data_dir)
    except (DataMissing, cs.CaseError, ValueError) as e:
        raise UsageFailure(str(e)) from None
    selected = cs.select_cases(suite_cases, ids=cfg.case_ids, domains=cfg.domains, sources=cfg.sources)
    if not selected:
        raise UsageFailure(f"no case of suite {cfg.suite!r} matches the filters")
    return selected


def shard_part(cfg: EvalConfig | ListConfig, selected: list[cs.Case]) -> shards.ShardPart | None:
    """The part of `selected` that --shard names (None without --shard); UsageFailure when
    --shard auto finds no array job in the environment."""
    try:
        shard = shards.resolve(cfg.shard, os.environ)
    except shards.ShardError as e:
        raise UsageFailure(str(e)) from None
    if shard is None:
        return None
    return shards.part(selected, shard, getattr(cfg, "repeats", 1),
                       shards.filters_json(cfg.case_ids, cfg.domains, cfg.sources))


def available_cases(data_dir: Path) -> dict[tuple[str, str], cs.Case]:
    """Every case this installation can see: the sanity suite plus present data files."""
    found: dict[tuple[str, str], cs.Case] = {}
    paths = [cs.COMMITTED_SUITE_FILE["sanity"]] + [data_dir / f for f in dict.fromkeys(cs.SUITE_DATA_FILE.values())]
    for p in paths:
        if p.is_file():
            for c in cs.load_file(p).cases:
                found.setdefault(c.key, c)
    return found


def list_cases(cfg: ListConfig) -> int:
    from tabulate import tabulate

    selected = load_selected(cfg)
    part = shard_part(cfg, selected)
    numbered = list(enumerate(selected, 1)) if part is None else list(zip(part.numbers, part.cases))
    rows = [[i, c.source, c.id, c.domain, c.answer_kind, c.max_tokens or "", c.title[:50]] for i, c in numbered]
    click.echo(tabulate(rows, headers=["#", "source", "id", "domain", "kind", "max_tokens", "title"]))
    if part is None:
        click.echo(f"{len(selected)} cases in suite {cfg.suite}")
    else:
        click.echo(f"{len(part.cases)} of the {len(selected)} cases of suite {cfg.suite} in shard {part.shard}")
    return 0


def validate_cases(cfg: ValidateConfig) -> int:
    rep = manifest.validate_all(cs.resolve_data_dir(cfg.data_dir))
    for line in rep.lines():
        click.echo(line)
    click.echo("all cases valid" if rep.ok else "validation FAILED")
    return 0 if rep.ok else 1


def self_test(cfg: SelfTestConfig) -> int:
    failures = selftest.run_self_test()
    total = len(selftest.SELF_TEST_CASES)
    for c, v in failures:
        click.echo(f"FAIL {c.kind} {c.name!r}: output={c.output!r} want picked={c.picked!r} "
                   f"passed={c.passed} got picked={v.picked!r} passed={v.passed}")
    click.echo(f"{total - len(failures)}/{total} extractor self-tests passed "
               f"(kinds: {', '.join(sorted(selftest.covered_kinds()))})")
    return 1 if failures else 0


def grade_lines(text: str, name: str = "input") -> list[dict]:
    """Grade every JSON line of a `grade` input; raise UsageFailure on a bad line."""
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageFailure(f"{name}:{n}: invalid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise UsageFailure(f"{name}:{n}: not a JSON object")
        kind, answer, output = obj.get("answer_kind"), obj.get("answer"), obj.get("output")
        aliases, nchoices = obj.get("aliases", []), obj.get("nchoices", 0)
        if kind not in answerkinds.NAMES:
            raise UsageFailure(f"{name}:{n}: answer_kind must be one of {', '.join(answerkinds.NAMES)}")
        takes_choices = answerkinds.lookup(kind).takes_choices
        if not isinstance(answer, str) or not isinstance(output, str):
            raise UsageFailure(f"{name}:{n}: 'answer' and 'output' must be strings")
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise UsageFailure(f"{name}:{n}: 'aliases' must be a list of strings")
        if takes_choices and (not isinstance(nchoices, int) or not 1 <= nchoices <= cs.MAX_CHOICES):
            raise UsageFailure(f"{name}:{n}: a choice line needs 'nchoices' between 1 and {cs.MAX_CHOICES}")
        try:
            grade.parse_key(kind, answer)
        except ValueError as e:
            raise UsageFailure(f"{name}:{n}: answer {answer!r}: {e}") from None
        v = grade.grade_output(kind, answer, output, aliases, nchoices if takes_choices else 0)
        out.append({**obj, "picked": v.picked, "passed": v.passed})
    return out


def grade_file(cfg: GradeConfig) -> int:
    for row in grade_lines(read_text(cfg.file), cfg.file):
        click.echo(json.dumps(row, ensure_ascii=False))
    return 0


def data_pull(cfg: DataPullConfig) -> int:
    from ds4eval.cases import datapull

    try:
        written = datapull.pull(cfg.data_url, cs.resolve_data_dir(cfg.data_dir))
    except datapull.PullError as e:
        raise UsageFailure(str(e)) from None
    for path, n in written:
        click.echo(f"wrote {path} ({n} cases)")
    return 0


LIST = Command("list", "List the cases a run with the same selection flags would run.", ListConfig, list_cases,
               flags.CASE_SELECTION)
VALIDATE = Command("validate", "Check every case file against its committed manifest.", ValidateConfig,
                   validate_cases, (flags.data_dir,), details="Exit status 1 when a case file does not match.")
SELFTEST = Command("selftest", "Run the answer extractors' self-tests.", SelfTestConfig, self_test, (),
                   details="Exit status 1 when a self-test fails.")
GRADE = Command("grade", "Grade outputs made elsewhere (JSON lines).", GradeConfig,
                grade_file, (click.argument("file", metavar="FILE", type=click.Path(dir_okay=False)),),
                details="FILE holds one JSON object per line with answer_kind, answer and output (and aliases, "
                        "nchoices); each is printed back with picked and passed added.")
DATA_PULL = Command("data pull", "Fetch the upstream case tables into the data dir.", DataPullConfig, data_pull,
                    (flags.data_url, flags.data_dir))
