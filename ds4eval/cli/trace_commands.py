"""`ds4-eval` commands that read traces already written: merge, regrade, report, compare.

Each handler takes its config (`ds4eval.config`), prints on stdout (warnings about skipped trace
blocks on stderr) and returns the exit status: 0, or for compare the verdict's status (1 for a
regression; for merge 3 when the merged run has cases that did not finish graded). Input it
cannot use raises `UsageFailure` (exit status 2). Wherever one trace is read, a set of shard
traces may stand for it (`ds4eval.cli.tracesets`). Merging, regrading, comparing and rendering
live in `ds4eval.run.merge`, `ds4eval.verdict` and `ds4eval.reports`; this module only wires
files to them.
"""

from __future__ import annotations

import click

from ds4eval.cases import case as cs
from ds4eval.cli import flags
from ds4eval.cli.case_commands import available_cases
from ds4eval.cli.command import Command
from ds4eval.cli.inputs import UsageFailure, check_destination, modified, read_text, write_report
from ds4eval.cli.tracesets import expand, merge_files, read_trace_set
from ds4eval.config import CompareConfig, MergeConfig, RegradeConfig, ReportConfig
from ds4eval.verdict import regrade as rg

EXIT_NOT_GRADED = 3  # as for a run: some selected case did not finish PASSED or FAILED


def merge(cfg: MergeConfig) -> int:
    from ds4eval.atomicfile import write_text_atomic

    check_destination(cfg.output, "merged trace")
    paths = list(dict.fromkeys(p for spec in cfg.traces for p in expand(spec)))
    merged = merge_files(paths, cfg.data_dir)
    for p in merged.problems:
        click.echo(f"warning: {p}", err=True)
    try:
        write_text_atomic(cfg.output, merged.text())
    except OSError as e:
        raise UsageFailure(f"cannot write the merged trace {cfg.output}: {e.strerror or e}") from None
    graded = len(merged.header.cases) * merged.header.repeats - len(merged.unfinished)
    click.echo(f"merged {merged.shards} shard(s), {len(paths)} file(s): {len(merged.header.cases)} cases, "
               f"{graded} of {len(merged.header.cases) * merged.header.repeats} graded -> {cfg.output}")
    if not merged.unfinished:
        return 0
    for line in merged.unfinished:
        click.echo(f"not graded: {line}")
    click.echo(f"ds4-eval: {len(merged.unfinished)} not graded: `ds4-eval retry {cfg.output}` runs them "
               f"(exit status {EXIT_NOT_GRADED})", err=True)
    return EXIT_NOT_GRADED


def regrade(cfg: RegradeConfig) -> int:
    parsed = read_trace_set(cfg.trace_file, cfg.data_dir)
    known = available_cases(cs.resolve_data_dir(cfg.data_dir))
    rep = rg.regrade(parsed.records, lambda s, i: known.get((s, i)))
    for p in parsed.problems + rep.problems:
        click.echo(f"warning: {p}", err=True)
    click.echo(rep.summary_line())
    for c in rep.changed:
        old_picked = "-" if c.old_picked is None else repr(c.old_picked)
        new_picked = "-" if c.new_picked is None else repr(c.new_picked)
        click.echo(f"changed: #{c.index} {c.source}/{c.id}: {c.old_status} -> {c.new_status} "
                   f"(picked {old_picked} -> {new_picked}, expected {c.expected!r})")
    return 0


def report(cfg: ReportConfig) -> int:
    from ds4eval.reports import formats as reports

    path = cfg.trace_file
    parsed = read_trace_set(path)
    for p in parsed.problems:
        click.echo(f"warning: {path}: {p}", err=True)
    if not parsed.records:
        raise UsageFailure(f"{path}: no case blocks to report")
    fmt = reports.report_format(cfg.report) if cfg.report else "markdown"
    text = reports.render_run(parsed.records, fmt, path, modified(path))
    if cfg.report:
        write_report(cfg.report, text)
    else:
        click.echo(text, nl=False)
    return 0


def compare(cfg: CompareConfig) -> int:
    from ds4eval.reports import formats as reports
    from ds4eval.verdict import compare as cmp

    def read_side(spec: str):
        paths = expand(spec)
        if len(paths) == 1:
            return cmp.read_run(read_text(paths[0]), spec)
        return cmp.trace_run(read_trace_set(spec), spec)

    with cmp.collector_paused():
        try:
            base, new = read_side(cfg.base), read_side(cfg.new)
            result = cmp.compare(base, new, alpha=cfg.alpha, strict=cfg.strict, allow=cfg.allow_diff,
                                 power=cfg.power,
                                 equivalence=None if cfg.equivalence is None else cfg.equivalence / 100)
        except cmp.CompareInputError as e:
            raise UsageFailure(str(e)) from None
        written = (modified(cfg.base), modified(cfg.new))
        noise = read_noise(cfg.noise, result) if cfg.noise else None
        click.echo(reports.render_comparison(result, cfg.format, written, noise), nl=False)
        if cfg.report:
            write_report(cfg.report, reports.render_comparison(result, reports.report_format(cfg.report), written,
                                                               noise))
    return result.exit_status


def read_noise(path: str, result):
    """The determinism result at `path` with its explanation of the comparison's flips."""
    from ds4eval.determinism import analysis

    try:
        noise = analysis.read_result(read_text(path), path)
    except analysis.DeterminismInputError as e:
        raise UsageFailure(str(e)) from None
    return analysis.explain_flips(noise, [f.name for f in result.flips], result.judged()), noise


def _trace_argument():
    # A directory or a glob pattern names a set of shard traces (ds4eval.cli.tracesets).
    return click.argument("trace_file", metavar="TRACE")


MERGE = Command("merge", "Merge the shard traces of one run into its whole trace.", MergeConfig, merge,
                (click.argument("traces", metavar="SHARD_TRACES...", nargs=-1, required=True),
                 click.option("-o", "--output", required=True, metavar="RUN.trace", help="The merged trace."),
                 flags.data_dir),
                details="The traces must be the shards of one run (ds4-eval run --shard I/N): same shard count, "
                        "suite, selection, model, template and sampling; every shard once; no case twice. A set "
                        "that is not is refused with one line per problem and nothing is written (exit status "
                        "2). Exit status 0 when every case is graded, 3 when some are not (retry the merged "
                        "trace).")


REGRADE = Command("regrade", "Grade a trace's outputs again with today's extractors.", RegradeConfig, regrade,
                  (_trace_argument(), flags.data_dir),
                  details="Prints the new totals and every case whose verdict changed; the trace is not modified.")
REPORT = Command("report", "Render the report of an existing trace.", ReportConfig, report,
                 (_trace_argument(),
                  flags.report("Write the report here: HTML, or markdown if FILE ends in .md "
                               "(default: markdown on stdout).")))
COMPARE = Command("compare", "Compare two traces (or summaries) case by case.", CompareConfig, compare,
                  (click.argument("base", metavar="BASE"),
                   click.argument("new", metavar="NEW"),
                   *flags.COMPARE,
                   flags.report("Also write the comparison here: HTML, or markdown if FILE ends in .md."),
                   click.option("--power", type=float, default=0.8, show_default=True,
                                help="Power of the stated detectable drop (the drop this comparison would "
                                     "have caught with this chance)."),
                   click.option("--equivalence", type=float, metavar="POINTS",
                                help="Also test that the pass rate moved less than POINTS either way (TOST); "
                                     "exit 1 unless it is shown."),
                   click.option("--noise", type=click.Path(dir_okay=False), metavar="FILE",
                                help="A `ds4-eval determinism -o` result of the stack: say how many flips "
                                     "its own variation explains.")),
                  details="Exit status 0 when NEW holds up, 1 for a regression (with --equivalence also when "
                          "equivalence is not shown), 2 for input it cannot compare.")
