"""The single-command form of `ds4-eval` that predates the subcommands, kept as an alias.

`ds4-eval --suite sanity`, `ds4-eval --compare A B --format markdown`, `ds4-eval --list-cases`, a
bare `ds4-eval` and every other old spelling are parsed by `FLAGS` (all the old flags on one
command) and translated by `translate()` onto the subcommand and config that now do that job; the
subcommand's handler then runs exactly as if it had been typed. The old checks come along: every
invocation validates the run flags, two modes at once are refused with the old message, and
--report is refused where the mode writes no report. Nothing here carries out a mode, and nothing
is printed that the subcommand would not print.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import click

from ds4eval.cli import flags
from ds4eval.config import (CommandConfig, CompareConfig, ConfigError, DataPullConfig, EvalConfig, GradeConfig,
                            ListConfig, ProbeConfig, RegradeConfig, ReportConfig, RetryConfig, SelfTestConfig,
                            ValidateConfig, check_alpha, check_report_file)

HELP_FLAGS = ("-h", "--help")


def is_legacy(args: list[str]) -> bool:
    """True when a command line is in the old form: no arguments, or a flag (not help) first."""
    return not args or (args[0].startswith("-") and args[0] not in HELP_FLAGS)


# Each old mode flag (by parameter name, in the order the old conflict message names them), with
# the subcommand it became and how that subcommand's config is built from the flag's value, the
# run flags and the other old flags.
ModeBuilder = Callable[[Any, EvalConfig, dict], CommandConfig]
MODES: dict[str, tuple[str, ModeBuilder]] = {
    "list_cases": ("list", lambda _, run, old: ListConfig(run.suite, run.case_ids, run.domains, run.sources,
                                                         run.data_dir, run.shard)),
    "validate_cases": ("validate", lambda _, run, old: ValidateConfig(run.data_dir)),
    "self_test_extractors": ("selftest", lambda _, run, old: SelfTestConfig()),
    "grade_file": ("grade", lambda path, run, old: GradeConfig(path)),
    "regrade": ("regrade", lambda path, run, old: RegradeConfig(path, run.data_dir)),
    "retry_incomplete": ("retry", lambda path, run, old: RetryConfig(path, run)),
    "data_pull": ("data pull", lambda _, run, old: DataPullConfig(old["data_url"], run.data_dir)),
    "report_from": ("report", lambda path, run, old: ReportConfig(path, run.report)),
    "probe": ("probe", lambda _, run, old: ProbeConfig(run.urls[0], run.served_model, run.api_key)),
}
REPORTING = ("run", "retry", "compare", "report")
"""The subcommands that write --report; every other mode refuses it."""
_NOT_RUN_FLAGS = (*MODES, "compare", "data_url", "alpha", "strict", "format", "allow_diff")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def translate(old: dict[str, Any]) -> tuple[str, CommandConfig]:
    """The subcommand and config that do what the old flags asked; ConfigError with the old
    message for combinations the old form refused. Pure."""
    run = EvalConfig(**{k: v for k, v in old.items() if k not in _NOT_RUN_FLAGS})
    # Every mode took the run flags and checked them; --report is judged below, by mode.
    replace(run, report=None).validate()
    given = [name for name in MODES if old[name]]
    if len(given) > 1:
        raise ConfigError(f"give at most one of {', '.join(map(_flag, MODES))}")
    if old["probe"] and not run.urls:
        raise ConfigError("--probe needs --url")
    if old["probe"] and len(run.urls) > 1:
        raise ConfigError("--probe takes one --url")
    if old["probe"] and run.no_probe:
        raise ConfigError("--probe and --no-probe contradict each other")
    if old["compare"] is not None and given:
        raise ConfigError("--compare runs alone: it takes no other mode")
    check_alpha(old["alpha"])
    if old["compare"] is not None:
        name, config = "compare", CompareConfig(*old["compare"], alpha=old["alpha"], strict=old["strict"],
                                                format=old["format"], allow_diff=old["allow_diff"],
                                                report=run.report)
    elif given:
        name, build = MODES[given[0]]
        config = build(old[given[0]], run, old)
    else:
        name, config = "run", run
    check_report_file(run.report)
    if run.report is not None and name not in REPORTING:
        raise ConfigError("--report applies to a run, --compare or --report-from")
    return name, config


MODE_FLAGS = (
    click.option("--list-cases", is_flag=True),
    click.option("--validate-cases", is_flag=True),
    click.option("--self-test-extractors", is_flag=True),
    click.option("--grade-file", type=click.Path(dir_okay=False)),
    click.option("--regrade", type=click.Path(dir_okay=False)),
    click.option("--retry-incomplete", type=click.Path(dir_okay=False)),
    click.option("--data-pull", is_flag=True, help="Fetch the upstream case tables into the data dir."),
    click.option("--probe", is_flag=True, help="Print what the server at --url does with each request feature."),
    click.option("--compare", nargs=2, type=click.Path(dir_okay=False), metavar="BASE NEW", default=None,
                 help="Compare two traces (or summaries) case by case; exit 1 on a regression."),
    click.option("--report-from", type=click.Path(dir_okay=False), metavar="TRACE",
                 help="Report on an existing trace: to --report FILE, else markdown on stdout."),
)
"""The old flags that chose a mode; the subcommands' names replace them."""
FLAGS = (*flags.CASE_SELECTION, *flags.BACKEND, *flags.SAMPLING, flags.repeats, flags.plain, flags.trace,
         flags.summary, flags.allow_errors, flags.step_log, flags.ray, flags.ray_shards, *MODE_FLAGS, flags.data_url,
         *flags.COMPARE,
         flags.report("Write the report of the run (needs --trace), of --compare or of --report-from: "
                      "HTML, or markdown if FILE ends in .md."))
"""Every old flag, on one command."""


def command(execute: Callable[[Callable[[], tuple[str, CommandConfig]]], int]) -> click.Command:
    """The old single command: each invocation is translated and handed to `execute`."""

    def callback(**old: Any) -> int:
        return execute(lambda: translate(old))

    return click.command("ds4-eval", context_settings={"help_option_names": list(HELP_FLAGS)},
                         help="ds4-eval in its single-command form, the old spelling of the subcommands.")(
        flags.with_flags(callback, FLAGS))
