"""`ds4-eval` commands that read traces already written: regrade, report, compare.

Each handler takes its config (`ds4eval.config`), prints on stdout (warnings about skipped trace
blocks on stderr) and returns the exit status: 0, or for compare the verdict's status (1 for a
regression). Input it cannot use raises `UsageFailure` (exit status 2). Regrading, comparing and
rendering live in `ds4eval.verdict` and `ds4eval.reports`; this module only wires files to them.
"""

from __future__ import annotations

import click

from ds4eval.cases import case as cs
from ds4eval.cli import flags
from ds4eval.cli.case_commands import available_cases
from ds4eval.cli.command import Command
from ds4eval.cli.inputs import UsageFailure, modified, read_text, read_trace, write_report
from ds4eval.config import CompareConfig, RegradeConfig, ReportConfig
from ds4eval.verdict import regrade as rg


def regrade(cfg: RegradeConfig) -> int:
    parsed = read_trace(cfg.trace_file)
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
    parsed = read_trace(path)
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

    with cmp.collector_paused():
        base_text, new_text = read_text(cfg.base), read_text(cfg.new)
        try:
            base = cmp.read_run(base_text, cfg.base)
            new = cmp.read_run(new_text, cfg.new)
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
    return click.argument("trace_file", metavar="TRACE", type=click.Path(dir_okay=False))


REGRADE = Command("regrade", "Grade a trace's outputs again with today's extractors.", RegradeConfig, regrade,
                  (_trace_argument(), flags.data_dir),
                  details="Prints the new totals and every case whose verdict changed; the trace is not modified.")
REPORT = Command("report", "Render the report of an existing trace.", ReportConfig, report,
                 (_trace_argument(),
                  flags.report("Write the report here: HTML, or markdown if FILE ends in .md "
                               "(default: markdown on stdout).")))
COMPARE = Command("compare", "Compare two traces (or summaries) case by case.", CompareConfig, compare,
                  (click.argument("base", metavar="BASE", type=click.Path(dir_okay=False)),
                   click.argument("new", metavar="NEW", type=click.Path(dir_okay=False)),
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
