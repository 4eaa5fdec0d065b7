"""Atomic CSV output for benchmark results.

`write_csv(path, columns, rows)` writes every row (a mapping from column name to value;
missing keys become empty cells, unknown keys are an error) to a temporary file in the
target's directory and renames it into place, so a reader never sees a half-written file
and an interrupted run leaves the previous file untouched.
It does not choose columns or format numbers; each benchmark documents its own columns.
"""
from __future__ import annotations

import csv
import os
from typing import Iterable, Mapping, Sequence

from ds4eval.atomicfile import atomic_open


def write_csv(path: str | os.PathLike, columns: Sequence[str], rows: Iterable[Mapping[str, object]]) -> None:
    with atomic_open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="raise", lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
