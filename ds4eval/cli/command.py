"""One `ds4-eval` subcommand as plain data: its name, flags, config type and handler.

A command module declares its commands as `Command` records; `ds4eval.cli.app` gathers them into
the registry and builds the click tree from it. A handler takes the command's config, already
validated, and returns the exit status; it raises `UsageFailure` (or `ConfigError`) for bad
input. Nothing here parses flags or runs a command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ds4eval.config import CommandConfig


@dataclass(frozen=True)
class Command:
    name: str
    """The words after `ds4-eval`: "run", or "data pull" for a verb of the `data` group."""
    summary: str
    """The one line `ds4-eval --help` shows for it."""
    config_type: type[CommandConfig]
    handler: Callable[[Any], int]
    """Carries out the command for one config of `config_type`; returns the exit status."""
    flags: tuple[Callable, ...]
    """Click decorators (options and arguments), in --help order; each fills one config field."""
    details: str = ""
    """More for `ds4-eval <name> --help`: inputs, exit statuses."""
    build: Callable[..., CommandConfig] | None = None
    """From the parsed flags (keyword arguments) to the config; by default `config_type(**flags)`."""

    def config(self, flags: dict[str, Any]) -> CommandConfig:
        return (self.build or self.config_type)(**flags)

    @property
    def help(self) -> str:
        return f"{self.summary}\n\n{self.details}" if self.details else self.summary
