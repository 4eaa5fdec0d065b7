"""Loading one suite's cases for a run, checked against the suite's manifest.

Contract
- `load_suite(suite, data_dir)` returns the suite's well-formed cases in file order. The
  committed sanity suite is read from the repository; a benchmark suite is read from the data
  directory and refused (`CaseError`) unless it matches its manifest exactly, so that a
  regression run compares like with like. A data file that is absent raises `DataMissing`.
- It sits above both `cases` (records, parsing, where files live) and `manifest` (pins and
  their comparison), which therefore need not import each other in both directions.

It does not fetch data, rewrite manifests or select cases by filter (`cases.select_cases`).
"""

from __future__ import annotations

from pathlib import Path

from ds4eval.cases import manifest
from ds4eval.cases.case import COMMITTED_SUITE_FILE, Case, CaseError, load_file, suite_file


class DataMissing(FileNotFoundError):
    """A suite's data file is absent from the data directory."""


def load_suite(suite: str, data_dir: Path) -> list[Case]:
    """All well-formed cases of `suite` in file order; raise on a missing file or a bad line."""
    path = suite_file(suite, data_dir)
    if not path.is_file():
        raise DataMissing(
            f"suite {suite!r} needs {path} (set --data-dir or DS4EVAL_DATA, or run ds4-eval data pull)")
    parsed = load_file(path)
    if parsed.problems:
        lineno, msg = parsed.problems[0]
        raise CaseError(f"{path}:{lineno}: {msg} (ds4-eval validate lists every problem)")
    if suite not in COMMITTED_SUITE_FILE:
        check = manifest.compare(manifest.load_manifest(suite), parsed)
        if not check.ok:
            raise CaseError(
                f"data in {path} does not match the {suite} manifest ({len(check.missing)} missing, "
                f"{len(check.extra)} extra, {len(check.altered)} altered); see ds4-eval validate")
    return [c for c in parsed.cases if suite in c.suites]
