"""Shard traces on the command line: `ds4-eval merge`, and a set of shard traces wherever a
command reads one trace (compare, report, regrade).

A TRACE argument names one trace file, a directory (its `*.trace` files are the set), or a glob
pattern that the shell did not expand (`'shards/*.trace'`). One file is read as it always was;
several are merged in memory with the checks of `ds4eval.run.merge`, and a set that is not one
run is refused with one line per problem (`UsageFailure`, exit status 2), so that no command
ever reads half a run as a whole one. Merging, checking and naming missing cases are pure and
live in `ds4eval.run.merge` and `ds4eval.run.shards`; this module finds the files, reads them and
rebuilds a selection from the case data when a missing shard's cases are to be named.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable

import click

from ds4eval.cases import case as cs
from ds4eval.cases.suites import DataMissing, load_suite
from ds4eval.cli.inputs import UsageFailure, read_trace
from ds4eval.run import merge as mg
from ds4eval.run import shards
from ds4eval.run.trace import ParsedTrace, RunHeader

_GLOB_CHARS = "*?["


def expand(spec: str) -> list[str]:
    """The files a TRACE argument names, in sorted order (one file: itself)."""
    if os.path.isdir(spec):
        found = sorted(glob.glob(os.path.join(glob.escape(spec), "*.trace")))
        if not found:
            raise UsageFailure(f"{spec}: a directory without *.trace files")
        return found
    if not os.path.exists(spec) and any(ch in spec for ch in _GLOB_CHARS):
        found = sorted(p for p in glob.glob(spec) if os.path.isfile(p))
        if not found:
            raise UsageFailure(f"{spec}: no file matches")
        return found
    return [spec]


def missing_namer(data_dir: str | None) -> Callable[[RunHeader, list[int]], list[str] | None]:
    """Names the cases of missing shards by selecting the run's cases again from the case data;
    None when the data is not here or no longer makes the selection the shards recorded."""

    def name(header: RunHeader, missing: list[int]) -> list[str] | None:
        try:
            filters = json.loads(header.filters or "{}")
            selected = cs.select_cases(load_suite(header.suite, cs.resolve_data_dir(data_dir)),
                                       ids=filters.get("case_ids", ()), domains=filters.get("domains", ()),
                                       sources=filters.get("sources", ()))
        except (DataMissing, cs.CaseError, ValueError, OSError, AttributeError):
            return None
        digest = shards.selection_digest(((c.source, c.id, cs.case_hash(c)) for c in selected), header.repeats)
        if digest != header.selection:
            return None
        count, wanted = shards.parse_shard(header.shard).count, set(missing)
        return [f"#{n} {c.source}/{c.id}" for n, c in enumerate(selected, 1)
                if shards.assign(c.source, c.id, count) in wanted]

    return name


def merge_files(paths: list[str], data_dir: str | None = None) -> mg.Merged:
    """The merged run of these shard traces; UsageFailure (after one stderr line per problem)
    when they are not one run."""
    traces = [mg.ShardTrace(p, read_trace(p)) for p in paths]
    try:
        return mg.merge(traces, missing_namer(data_dir))
    except mg.MergeRefused as e:
        for p in e.problems:
            click.echo(f"ds4-eval: {p}", err=True)
        raise UsageFailure(f"refused to merge {len(paths)} trace(s): {len(e.problems)} problem(s) above") from None


def read_trace_set(spec: str, data_dir: str | None = None) -> ParsedTrace:
    """One trace, or the merged run of the shard traces `spec` names (see the module docstring)."""
    paths = expand(spec)
    if len(paths) == 1:
        return read_trace(paths[0])
    return mg.as_parsed(merge_files(paths, data_dir))
