"""The two failures every `ds4-bench` subcommand reports: bad input (exit 2) and a failed run (exit 1).

`ds4bench.cli` turns them into one line on stderr; subcommands raise them. It holds no
logic, so that subcommand modules need not import the command group.
"""


class UsageFailure(Exception):
    """Bad input from the user: one line, exit status 2."""


class RunFailure(Exception):
    """The run itself failed (a model that does not load, an unwritable file): one line, exit 1."""
