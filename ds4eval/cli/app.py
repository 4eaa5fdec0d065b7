"""The `ds4-eval` click tree, built from the registry of subcommands, and its one error policy.

`COMMANDS` maps each subcommand's name to its `Command` (config type, handler, flags); the click
group and the `data` group are generated from it, so a new command is one record in a command
module and one entry here. A command line in the old single-command form (`ds4eval.cli.legacy`)
is routed to the old flags and translated onto the same registry, so each mode has one handler.
`execute` is the single way a command runs: build the config, validate it, call the handler.
Errors, click's own included, are one line `ds4-eval: error: ...` on stderr with exit status 2;
never a traceback.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import click

from ds4eval.cli import (case_commands, determinism_commands, flags, legacy, run_commands, trace_commands,
                         verdict_commands)
from ds4eval.cli.command import Command
from ds4eval.cli.inputs import UsageFailure
from ds4eval.config import CommandConfig, ConfigError
from ds4eval.run.stopsignals import EXIT_INTERRUPTED

EXIT_USAGE = 2

COMMANDS: dict[str, Command] = {c.name: c for c in (
    run_commands.RUN, run_commands.RETRY, trace_commands.MERGE, trace_commands.COMPARE, verdict_commands.PLAN,
    verdict_commands.REFERENCE_RECORD, verdict_commands.GATE, trace_commands.REGRADE, trace_commands.REPORT,
    case_commands.GRADE, case_commands.LIST, case_commands.VALIDATE, case_commands.SELFTEST, run_commands.PROBE,
    determinism_commands.DETERMINISM, case_commands.DATA_PULL)}
"""Every subcommand by name, in the order `ds4-eval --help` lists them."""
GROUPS = {"data": "Case data: `data pull` fetches the upstream case tables.",
          "reference": "References: `reference record` keeps runs' pass counts."}
"""The one-line help of each group of verbs (the first word of a two-word command name)."""


def execute(make: Callable[[], tuple[str, CommandConfig]]) -> int:
    """Build a command's config with `make`, validate it and run its handler; the exit status."""
    try:
        name, config = make()
        config.validate()
        return COMMANDS[name].handler(config)
    except KeyboardInterrupt:  # Ctrl+C before the run started (e.g. while the model loads)
        click.echo("ds4-eval: interrupted", err=True)
        return EXIT_INTERRUPTED
    except (UsageFailure, ConfigError, OSError) as e:
        click.echo(f"ds4-eval: error: {e}", err=True)
        return EXIT_USAGE


class EvalGroup(click.Group):
    """The ds4-eval group: subcommands in registry order, the old form routed to its own command,
    and every error on one line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def main(self, args: list[str] | None = None, prog_name: str | None = None, **extra: Any) -> Any:
        args = sys.argv[1:] if args is None else list(args)
        entry = LEGACY if legacy.is_legacy(args) else super()
        try:
            code = entry.main(args, prog_name, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:  # `ds4-eval data`: the group's help, as click gives it
            e.show()
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"ds4-eval: error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(EXIT_USAGE)
        except click.exceptions.Abort:
            click.echo("ds4-eval: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        sys.exit(code if isinstance(code, int) else 0)


def _click_command(command: Command) -> click.Command:
    def callback(**parsed: Any) -> int:
        return execute(lambda: (command.name, command.config(parsed)))

    return click.command(command.name.split()[-1], help=command.help, short_help=command.summary)(
        flags.with_flags(callback, command.flags))


def _build_main() -> EvalGroup:
    @click.group("ds4-eval", cls=EvalGroup, context_settings={"help_option_names": list(legacy.HELP_FLAGS)})
    def main() -> None:
        """ds4-eval: run evaluation suites, grade outputs, regrade and compare traces.

        A bare `ds4-eval` runs the sanity suite; the old single-command flags (`ds4-eval --suite
        sanity`, `--compare A B`, `--list-cases`, ...) still work as aliases of these commands.
        """

    for command in COMMANDS.values():
        *group_path, _ = command.name.split()
        parent: click.Group = main
        for word in group_path:
            if word not in parent.commands:
                parent.add_command(click.Group(word, help=GROUPS[word], short_help=GROUPS[word]))
            parent = parent.commands[word]
        parent.add_command(_click_command(command))
    return main


LEGACY = legacy.command(execute)
main = _build_main()
