"""`ds4-eval` commands that talk to a backend: run, retry and probe.

A run shows the live terminal UI (`ds4eval.run.tui`) when stdin and stdout are terminals and
--plain is not given; otherwise it prints one line per finished case. Both end with the same
report. Exit statuses of run and retry: 0 when every selected case was graded (PASSED or
FAILED); 3 when any case ended ERROR, SKIPPED or STOPPED or was not run, also when the server
does not answer the probe before the first case (--allow-errors turns 3 into 0); 1 when the run
itself failed; 130 when SIGINT, SIGTERM or SIGHUP stopped it (the running cases end STOPPED at the
next token boundary, every thread is joined and the backend closed before the report). Probe
exits 0 once its table is printed and 1 when the server cannot be reached. The runner, backends
and reports live in the library; this module wires them together and never changes a config:
a retry derives its run settings with `RetryConfig.run_settings`.
"""

from __future__ import annotations

import json
import os
import threading

import click

from ds4eval.atomicfile import write_text_atomic
from ds4eval.cases import case as cs
from ds4eval.cli import flags
from ds4eval.cli.case_commands import available_cases, load_selected
from ds4eval.cli.command import Command
from ds4eval.cli.inputs import UsageFailure, file_size, modified, read_bytes, read_trace, write_report
from ds4eval.config import EvalConfig, ProbeConfig, RetryConfig
from ds4eval.run import summary as report
from ds4eval.run import trace
from ds4eval.run.provenance import run_provenance
from ds4eval.run.runner import effective_concurrency
from ds4eval.run.stopsignals import EXIT_INTERRUPTED, StopSignals
from ds4eval.verdict import regrade

EXIT_NOT_GRADED = 3  # the run finished, but some selected case was not graded (see run_exit_status)


def run_exit_status(totals: dict, interrupted: bool, allow_errors: bool) -> int:
    """0 when every selected case was graded, 3 when any ended ERROR, SKIPPED or STOPPED or
    never ran (0 with --allow-errors), 130 when a signal interrupted the run."""
    if interrupted:
        return EXIT_INTERRUPTED
    ungraded = totals["cases"] - totals["passed"] - totals["failed"]
    return EXIT_NOT_GRADED if ungraded and not allow_errors else 0


def _not_graded_line(totals: dict) -> str:
    parts = [f"{totals[k]} {k}" for k in ("error", "skipped", "stopped") if totals[k]]
    if totals["pending"]:
        parts.append(f"{totals['pending']} not run")
    return (f"ds4-eval: {totals['cases'] - totals['passed'] - totals['failed']} of {totals['cases']} "
            f"cases were not graded ({', '.join(parts)}): exit status {EXIT_NOT_GRADED} "
            f"(--allow-errors exits 0)")


def _run_plain(cfg: EvalConfig, selected: list[cs.Case], backend, numbers, repeats) -> tuple[list, float, bool, str]:
    """Run without the terminal UI; a signal stops the run at the next token boundary."""
    from ds4eval.run.runner import Runner

    listener = report.PlainListener(len(selected) * (cfg.repeats if repeats is None else 1))
    runner = Runner(cfg, selected, backend, [listener], numbers=numbers, repeats=repeats)
    result: dict = {}
    done = threading.Event()

    def work() -> None:
        try:
            result["states"] = runner.run()
        except Exception as e:  # reported as one line after the report of what did run
            result["error"] = f"{type(e).__name__}: {e}"
        finally:
            done.set()

    worker = threading.Thread(target=work, name="ds4eval-runner", daemon=True)
    with StopSignals() as signals:
        worker.start()
        stopping = False
        # Wait on an event, never in Thread.join with a signal pending (see ds4eval.run.stopsignals).
        while not done.wait(0.2):
            if signals.fired is not None and not stopping:
                stopping = True
                click.echo("stopping at the next token boundary...", err=True)
                runner.stop()
        worker.join()
    states = result.get("states") or runner.snapshot()
    return states, runner.wall_s, signals.fired is not None, result.get("error", "")


def run_cases(cfg: EvalConfig, selected: list[cs.Case], numbers: list[int] | None = None,
              repeats: list[int] | None = None, report_whole_trace: bool = False) -> int:
    """Run the cases; with --report, the report covers the records this run appends to the trace
    (the whole trace with `report_whole_trace`, as a retry completes the run it retries)."""
    from ds4eval.run.backends import BackendUnavailable, create_backend

    report_offset = 0 if report_whole_trace or not cfg.report else file_size(cfg.trace)

    try:
        backend = create_backend(cfg, note=lambda line: click.echo(f"ds4-eval: note: {line}", err=True))
    except BackendUnavailable as e:  # the server did not answer the probe: nothing can run
        click.echo(f"ds4-eval: error: {e}", err=True)
        return EXIT_NOT_GRADED
    except Exception as e:  # model loading and connection set-up report one line
        raise UsageFailure(f"cannot start the {cfg.backend} backend: {type(e).__name__}: {e}") from None
    from ds4eval.run import tui

    try:
        if not cfg.plain and tui.terminal_ui_available():
            # The live terminal UI owns the terminal until the user quits; it restores the terminal
            # and prints the finished cases' lines before the report below.
            outcome = tui.run_with_ui(cfg, selected, backend, numbers, repeats=repeats)
            states, wall_s, interrupted, failed = outcome.states, outcome.wall_s, outcome.interrupted, outcome.error
        else:
            states, wall_s, interrupted, failed = _run_plain(cfg, selected, backend, numbers, repeats)
    finally:
        if hasattr(backend, "close"):
            backend.close()  # joins the engine's own thread, on every way out
    info = {"suite": cfg.suite, "backend": backend.name, "model": backend.model_name,
            "settings": {"tokens": cfg.tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
                         "min_p": cfg.min_p, "seed": cfg.seed, "think": cfg.think, "ctx": backend.n_ctx,
                         "parallel": cfg.parallel, "concurrency": effective_concurrency(cfg, backend)}}
    info["provenance"] = run_provenance(backend, model_file=cfg.model_file, api_key=cfg.api_key)
    summary = report.build_summary(states, wall_s, info)
    click.echo(report.render_report(summary))
    if cfg.summary:
        write_text_atomic(cfg.summary, json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    if cfg.report:
        _write_run_report(cfg, report_offset)
    if failed:
        click.echo(f"ds4-eval: error: the run failed: {failed}", err=True)
        return 1
    code = run_exit_status(summary["totals"], interrupted, cfg.allow_errors)
    if code == EXIT_NOT_GRADED:
        click.echo(_not_graded_line(summary["totals"]), err=True)
    return code


def _write_run_report(cfg: EvalConfig, offset: int) -> None:
    """The report of the records the run appended to its trace from `offset` on."""
    from ds4eval.reports import formats as reports

    data = read_bytes(cfg.trace) if os.path.exists(cfg.trace) else b""
    parsed = trace.parse_trace_bytes(data[offset:])
    fmt = reports.report_format(cfg.report)
    write_report(cfg.report, reports.render_run(parsed.records, fmt, cfg.trace, modified(cfg.trace)))


def run(cfg: EvalConfig) -> int:
    return run_cases(cfg, load_selected(cfg))


def retry(cfg: RetryConfig) -> int:
    path = cfg.trace_file
    parsed = read_trace(path)
    for p in parsed.problems:
        click.echo(f"warning: {path}: {p}", err=True)
    todo = regrade.incomplete(parsed.records, parsed.runs)
    if not todo:
        click.echo("nothing to retry: every case in the trace finished PASSED or FAILED")
        return 0
    known = available_cases(cs.resolve_data_dir(cfg.run.data_dir))
    missing = list(dict.fromkeys(f"{s}/{i}" for s, i, _ in todo if (s, i) not in known))
    if missing:
        raise UsageFailure(f"cases not found in the data: {', '.join(missing)}")
    numbers = regrade.case_numbers(parsed.records, parsed.runs)
    # The trace's own repeat count: what a retry writes and reports belongs to that run.
    settings = cfg.run_settings(max([run.repeats for run in parsed.runs] + [r + 1 for _, _, r in todo]))
    what = "incomplete case(s)" if settings.repeats == 1 else f"incomplete repeat(s) of {settings.repeats}"
    click.echo(f"retrying {len(todo)} {what} from {path}")
    return run_cases(settings, [known[(s, i)] for s, i, _ in todo], [numbers[(s, i)] for s, i, _ in todo],
                     [r for _, _, r in todo], report_whole_trace=True)


def probe(cfg: ProbeConfig) -> int:
    """The capability table of the server at --url: exit 0 once printed, 1 when it cannot be reached."""
    from ds4eval.run import capabilities
    from ds4eval.run import probe as endpoint_probe

    try:
        result = endpoint_probe.run_probe(cfg.url, list(capabilities.FEATURES), cfg.served_model, cfg.api_key,
                                          budget_s=endpoint_probe.TABLE_BUDGET_S)
    except endpoint_probe.ProbeUnreachable as e:
        click.echo(f"ds4-eval: error: {e}", err=True)
        return 1
    click.echo(f"{result.url}, model {result.model or '(none named)'}: {len(result.findings)} features probed "
               f"in {result.seconds:.1f} s")
    click.echo(capabilities.render_table(result.findings))
    return 0


RUN_DETAILS = ("Exit status 0 when every selected case was graded, 3 when any was not (--allow-errors: 0), "
               "1 when the run failed, 130 when a signal stopped it.")

RUN = Command("run", "Run a suite (by default sanity, on the embedded model).", EvalConfig, run,
              flags.RUN, details=RUN_DETAILS)
RETRY = Command("retry", "Run again the cases of a trace that did not finish.", RetryConfig,
                retry, (click.argument("trace_file", metavar="TRACE", type=click.Path(dir_okay=False)),
                        *flags.RETRY),
                details="The retried cases are appended to TRACE (or to --trace), with the trace's own case "
                        "numbers, repeats and seeds. " + RUN_DETAILS,
                build=lambda trace_file, **run: RetryConfig(trace_file, EvalConfig(**run)))
PROBE = Command("probe", "What the server at --url does with each request feature.", ProbeConfig, probe,
                (click.option("--url", required=True, help="Server base URL."), flags.served_model, flags.api_key),
                details="Exit status 1 when the server cannot be reached.")
