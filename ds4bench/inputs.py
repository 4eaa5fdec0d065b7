"""Input checks that several `ds4-bench` subcommands share, each failing as one `UsageFailure` line.

- `model_file(model)`: the GGUF a subcommand loads, `model` when given, else the embedded model;
  it must be a file.
- `check_csv_dir(csv)`: the directory of a `--csv` file must exist, so that a long measurement
  does not fail only when it writes its rows.
They load nothing and write nothing.
"""

from __future__ import annotations

import os

from ds4bench.errors import UsageFailure


def model_file(model: str | None) -> str:
    from engine import ModelLoadError, default_model_path

    try:
        path = model if model is not None else default_model_path()
    except ModelLoadError as e:
        raise UsageFailure(str(e)) from None
    if not os.path.isfile(path):
        raise UsageFailure(f"model file not found: {path}")
    return path


def check_csv_dir(csv: str | None) -> None:
    if csv and not os.path.isdir(os.path.dirname(os.path.abspath(csv))):
        raise UsageFailure(f"--csv {csv}: its directory does not exist")
