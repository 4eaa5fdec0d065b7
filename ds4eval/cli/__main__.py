"""`python -m ds4eval.cli`: the `ds4-eval` command."""

from ds4eval.cli import main

main()
