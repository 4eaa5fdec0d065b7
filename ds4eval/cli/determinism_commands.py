"""`ds4-eval determinism`: is the stack's answer the same alone, in a batch, from a cache, in any form?

The handler builds the target (the in-process engine, or the endpoint at --url), picks the
prompts (the project's own, or a suite's cases), runs the conditions (`ds4eval.determinism`)
with progress lines on stderr, prints the report on stdout and writes the JSON result
(--output) and the report file (--report) atomically. Exit status: 0 when measured (and, with
`--expect invariant`, invariant), 1 when `--expect invariant` is not met, 2 for bad input or
an endpoint it cannot reach, 3 when requests failed (the result is incomplete).
"""

from __future__ import annotations

import secrets

import click

from ds4eval.atomicfile import write_text_atomic
from ds4eval.cases import case as cs
from ds4eval.cases.suites import DataMissing, load_suite
from ds4eval.cli import flags
from ds4eval.cli.command import Command
from ds4eval.cli.inputs import UsageFailure, check_destination, write_report
from ds4eval.config import DETERMINISM_CONDITIONS, DETERMINISM_FORMATS, KV_TYPES, DeterminismConfig
from ds4eval.determinism import prompts as own
from ds4eval.determinism.analysis import Prompt, Result
from ds4eval.determinism.conditions import Plan

EXIT_NOT_INVARIANT = 1
EXIT_INCOMPLETE = 3


def select_prompts(cfg: DeterminismConfig) -> list[Prompt]:
    if cfg.suite is None:
        if cfg.prompts > len(own.OWN_PROMPTS):
            raise UsageFailure(f"--prompts {cfg.prompts}: the project's own set has {len(own.OWN_PROMPTS)} "
                               f"prompts (use --suite for more)")
        return own.own_prompts(cfg.prompts)
    try:
        cases = load_suite(cfg.suite, cs.resolve_data_dir(cfg.data_dir))
    except (DataMissing, cs.CaseError, ValueError) as e:
        raise UsageFailure(str(e)) from None
    return own.suite_prompts(cases, cfg.prompts)


def open_target(cfg: DeterminismConfig):
    """The target and the notes its setup left (a stack without log-probabilities)."""
    if cfg.backend == "openai":
        from ds4eval.determinism.targets import HttpTarget

        try:
            target = HttpTarget(cfg.url, api_key=cfg.api_key, served_model=cfg.served_model,
                                timeout_s=cfg.request_timeout_s)
        except ConnectionError as e:
            raise UsageFailure(str(e)) from None
        try:
            note = target.check_logprobs()
        except ConnectionError as e:
            target.close()
            raise UsageFailure(str(e)) from None
        return target, [note] if note else []
    from ds4eval.determinism.targets import EngineTarget
    from engine.batch import CapacityError
    from engine.model import ModelLoadError

    try:
        return EngineTarget.load(cfg.model, cfg.engine_slots, ctx=cfg.ctx, device=cfg.device, kv_type=cfg.kv_type,
                                 threads=cfg.threads, batch_invariant=cfg.batch_invariant), []
    except (ModelLoadError, CapacityError) as e:
        raise UsageFailure(str(e)) from None


def exit_status(result: Result, expect: str | None) -> int:
    if any(v.failed for v in result.verdicts):
        return EXIT_INCOMPLETE
    if expect == "invariant" and not result.invariant:
        return EXIT_NOT_INVARIANT
    return 0


def determinism(cfg: DeterminismConfig) -> int:
    from ds4eval.determinism.measure import measure
    from ds4eval.reports import determinism as report
    from ds4eval.reports.formats import report_format

    selected = select_prompts(cfg)
    # A measurement takes minutes: a destination that cannot be written is found before it.
    check_destination(cfg.output, "result")
    check_destination(cfg.report, "report")
    plan = Plan(repeats=cfg.repeats, concurrency=tuple(cfg.concurrency), mixed_rounds=cfg.mixed_rounds,
                max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=cfg.seed, salt=secrets.token_hex(4))
    target, notes = open_target(cfg)
    try:
        stack = target.describe()
        click.echo(f"determinism: {len(selected)} prompts, conditions {', '.join(cfg.conditions)}, "
                   f"{stack.get('url') or stack.get('model')}", err=True)
        result = measure(target, selected, plan, cfg.conditions, cfg.margin,
                         progress=lambda line: click.echo(f"  {line}", err=True), notes=notes)
    finally:
        target.close()
    click.echo(report.render(result, cfg.format), nl=False)
    if cfg.output:
        try:
            write_text_atomic(cfg.output, result.to_json())
        except OSError as e:
            raise UsageFailure(f"cannot write {cfg.output}: {e.strerror or e}") from None
    if cfg.report:
        write_report(cfg.report, report.render(result, report_format(cfg.report)))
    return exit_status(result, cfg.expect)


DETERMINISM = Command(
    "determinism", "Whether the stack's answers depend on batch, cache or run.",
    DeterminismConfig, determinism,
    (click.option("--backend", default="engine", show_default=True, type=click.Choice(("engine", "openai"))),
     flags.model, flags.ctx, flags.device, flags.threads,
     click.option("--kv-type", type=click.Choice(KV_TYPES), default=None, help="Engine KV cache type."),
     flags.batch_invariant,
     click.option("--slots", type=int, help="Engine batched sessions (default: largest --concurrency + 1)."),
     flags.url, flags.api_key, flags.served_model, flags.request_timeout_s,
     click.option("--suite", type=click.Choice(cs.KNOWN_SUITES), default=None,
                  help="Measure this suite's cases (default: the project's own prompts)."),
     flags.data_dir,
     click.option("--prompts", type=int, default=20, show_default=True, help="How many prompts (the first N)."),
     click.option("--condition", "conditions", multiple=True, type=click.Choice(DETERMINISM_CONDITIONS),
                  default=DETERMINISM_CONDITIONS, show_default=True, help="Condition kinds to measure (repeatable)."),
     click.option("--repeats", type=int, default=5, show_default=True, help="Runs of each prompt alone."),
     click.option("--concurrency", type=int, multiple=True, default=(1, 4, 8), show_default=True,
                  help="Other requests in flight in the mixed condition (repeatable)."),
     click.option("--mixed-rounds", type=int, default=1, show_default=True,
                  help="Rounds of the mixed condition at each concurrency."),
     click.option("--max-tokens", type=int, default=48, show_default=True, help="Tokens per completion."),
     click.option("--temp", "temperature", type=float, default=0.0, show_default=True),
     click.option("--seed", type=int, default=0, show_default=True, help="The seed every request carries."),
     click.option("--margin", type=float, default=0.25, show_default=True, metavar="NATS",
                  help="A divergence whose top-2 gap is at most this is a near-tie."),
     click.option("--expect", type=click.Choice(("invariant",)), help="Exit 1 unless every condition is invariant."),
     click.option("--format", "format", type=click.Choice(DETERMINISM_FORMATS), default="text", show_default=True),
     click.option("-o", "--output", type=click.Path(dir_okay=False), help="Also write the JSON result here."),
     flags.report("Also write the report here: HTML, or markdown if FILE ends in .md.")),
    details="Exit status 0 when measured (with --expect invariant: and invariant), 1 when --expect invariant "
            "is not met, 3 when requests failed, 2 for bad input.")
