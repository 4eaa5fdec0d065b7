"""`python -m engine` is the `ds4` command."""
from engine.cli import main

main()
