"""`ds4-eval` commands that talk to a backend: run, retry and probe.

A run shows the live terminal UI (`ds4eval.run.tui`) when stdin and stdout are terminals and
--plain is not given; otherwise it prints one line per finished case. Both end with the same
report. Exit statuses of run and retry: 0 when every selected case was graded (PASSED or
FAILED); 3 when any case ended ERROR, SKIPPED or STOPPED or was not run (--allow-errors turns 3
into 0), also when the server does not answer the probe before the first case or several
endpoints differ, and when every endpoint stopped answering mid-run for --endpoint-wait seconds
(the run stops by itself, its cases not yet answered end STOPPED for `retry`; no signal stopped
it, so not 130); 1 when the run
itself failed; 130 when SIGINT, SIGTERM or SIGHUP stopped it (the running cases end STOPPED at the
next token boundary, every thread is joined and the backend closed before the report). Probe
exits 0 once its table is printed and 1 when the server cannot be reached. The runner, backends
and reports live in the library; this module wires them together and never changes a config:
a retry derives its run settings with `RetryConfig.run_settings`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading

import click

from ds4eval.atomicfile import write_text_atomic
from ds4eval.cases import case as cs
from ds4eval.cli import flags
from ds4eval.cli.case_commands import available_cases, load_selected, shard_part
from ds4eval.cli.command import Command
from ds4eval.cli.inputs import UsageFailure, check_destination, file_size, modified, read_bytes, read_trace, write_report
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


def _run_plain(cfg: EvalConfig, selected: list[cs.Case], backend, numbers, repeats,
               shard_header) -> tuple[list, float, bool, str]:
    """Run without the terminal UI; a signal stops the run at the next token boundary."""
    from ds4eval.run.runner import Runner

    listener = report.PlainListener(len(selected) * (cfg.repeats if repeats is None else 1),
                                    of=max(numbers) if numbers else None)
    runner = Runner(cfg, selected, backend, [listener], numbers=numbers, repeats=repeats,
                    shard_header=shard_header)
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
              repeats: list[int] | None = None, report_whole_trace: bool = False,
              shard_header: dict | None = None) -> int:
    """Run the cases; with --report, the report covers the records this run appends to the trace
    (the whole trace with `report_whole_trace`, as a retry completes the run it retries).
    `shard_header` holds the run header's shard fields when the cases are one shard's."""
    from ds4eval.run.backends import BackendUnavailable, create_backend
    from ds4eval.run.endpoints import EndpointListError

    if cfg.trace and trace.being_written(cfg.trace):
        raise UsageFailure(str(trace.TraceBusy(cfg.trace)))
    report_offset = 0 if report_whole_trace or not cfg.report else file_size(cfg.trace)

    notes = _Notes()
    try:
        backend = create_backend(cfg, note=notes.note)
    except BackendUnavailable as e:  # the server did not answer the probe: nothing can run
        for line in str(e).splitlines():
            click.echo(f"ds4-eval: error: {line}", err=True)
        return EXIT_NOT_GRADED
    except EndpointListError as e:
        raise UsageFailure(str(e)) from None
    except Exception as e:  # model loading and connection set-up report one line
        raise UsageFailure(f"cannot start the {cfg.backend} backend: {type(e).__name__}: {e}") from None
    from ds4eval.run import tui

    try:
        if not cfg.plain and tui.terminal_ui_available():
            # The live terminal UI owns the terminal until the user quits; it restores the terminal
            # and prints the finished cases' lines before the report below. Notes wait until then.
            with notes.held():
                outcome = tui.run_with_ui(cfg, selected, backend, numbers, repeats=repeats, shard_header=shard_header)
            states, wall_s, interrupted, failed = outcome.states, outcome.wall_s, outcome.interrupted, outcome.error
        else:
            states, wall_s, interrupted, failed = _run_plain(cfg, selected, backend, numbers, repeats, shard_header)
    finally:
        if hasattr(backend, "close"):
            backend.close()  # joins the engine's own thread, on every way out
    info = {"suite": cfg.suite, "backend": backend.name, "model": backend.model_name,
            "settings": _settings(cfg, backend.n_ctx, effective_concurrency(cfg, backend)),
            "provenance": run_provenance(backend, model_file=cfg.model_file, api_key=cfg.api_key)}
    endpoints = _endpoint_rows(backend)
    if endpoints:
        info["endpoints"] = endpoints
    status = _finish(cfg, states, wall_s, interrupted, failed, info, report_offset)
    if cfg.step_log:
        _write_step_log(cfg.step_log, backend.step_log)
    return status


def _write_step_log(path: str, log) -> None:
    """--step-log, after the run's report: the steps' summary on stderr and their lines in `path`."""
    from ds4eval.run.steplog import render_steps, summarize_steps

    summary = summarize_steps(log.records)
    click.echo(render_steps(summary) if summary else "engine steps: none", err=True)
    try:
        log.write(path)
    except OSError as e:  # named by the path given, not the temporary file beside it
        raise UsageFailure(f"cannot write the step log {path}: {e.strerror or e}") from None


def _settings(cfg: EvalConfig, n_ctx: int | None, concurrency: int) -> dict:
    return {"tokens": cfg.tokens, "temperature": cfg.temperature, "top_p": cfg.top_p, "min_p": cfg.min_p,
            "seed": cfg.seed, "think": cfg.think, "ctx": n_ctx, "parallel": cfg.parallel, "concurrency": concurrency}


def _finish(cfg: EvalConfig, states: list, wall_s: float, interrupted: bool, failed: str, info: dict,
            report_offset: int) -> int:
    """The report, summary and exit status of a finished run (in one process or on Ray)."""
    summary = report.build_summary(states, wall_s, info)
    click.echo(report.render_report(summary))
    if cfg.summary:
        try:
            write_text_atomic(cfg.summary, json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
        except OSError as e:  # named by the path given, not the temporary file beside it
            raise UsageFailure(f"cannot write the summary {cfg.summary}: {e.strerror or e}") from None
    if cfg.report:
        _write_run_report(cfg, report_offset)
    if failed:
        click.echo(f"ds4-eval: error: the run failed: {failed}", err=True)
        return 1
    code = run_exit_status(summary["totals"], interrupted, cfg.allow_errors)
    if code == EXIT_NOT_GRADED:
        click.echo(_not_graded_line(summary["totals"]), err=True)
    return code


class _Notes:
    """The `ds4-eval: note:` lines of a run on stderr, held back while the terminal UI owns the
    screen (a line written then would tear it) and printed once it is restored."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: list[str] | None = None

    def note(self, line: str) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append(line)
                return
        click.echo(f"ds4-eval: note: {line}", err=True)

    @contextlib.contextmanager
    def held(self):
        with self._lock:
            self._held = []
        try:
            yield
        finally:
            with self._lock:
                lines, self._held = self._held, None
            for line in lines:
                click.echo(f"ds4-eval: note: {line}", err=True)


def _endpoint_rows(backend) -> list[dict]:
    """The summary's per-endpoint lines: with several endpoints, or when one failed; else none, so
    a run against one healthy server reports as it always has."""
    stats = backend.endpoint_stats() if hasattr(backend, "endpoint_stats") else []
    if len(stats) < 2 and not any(s.failures for s in stats):
        return []
    return [{"url": s.url, "requests": s.requests, "failures": s.failures, "removals": s.removals,
             "out_of_rotation": s.out_of_rotation} for s in stats]


def _write_run_report(cfg: EvalConfig, offset: int) -> None:
    """The report of the records the run appended to its trace from `offset` on."""
    from ds4eval.reports import formats as reports

    data = read_bytes(cfg.trace) if os.path.exists(cfg.trace) else b""
    parsed = trace.parse_trace_bytes(data[offset:])
    fmt = reports.report_format(cfg.report)
    write_report(cfg.report, reports.render_run(parsed.records, fmt, cfg.trace, modified(cfg.trace)))


def run_ray(cfg: EvalConfig, selected: list[cs.Case]) -> int:
    """The run spread over a Ray cluster (ds4eval.run.raycluster), reported as a run in one process is."""
    from ds4eval.run import raycluster
    from ds4eval.run.provenance import RUN_FIELDS

    report_offset = 0 if not cfg.report else file_size(cfg.trace)
    try:
        outcome = raycluster.run_on_ray(cfg, selected, lambda line: click.echo(line, err=True))
    except raycluster.RayUnavailable as e:
        raise UsageFailure(str(e)) from None
    for line in outcome.failures:
        click.echo(f"ds4-eval: ray: {line}", err=True)
    first = outcome.merged.records[0] if outcome.merged and outcome.merged.records else None
    concurrency = max(cfg.concurrency, cfg.parallel or 1)
    info = {"suite": cfg.suite, "backend": first.backend if first else cfg.backend,
            "model": first.model if first else "",
            "settings": _settings(cfg, cfg.ctx, concurrency),
            "provenance": {k: getattr(first, k, "") for k in RUN_FIELDS} if first else {},
            "ray": {"address": cfg.ray or "local", "shards": outcome.shards, "failures": outcome.failures}}
    return _finish(cfg, outcome.states, outcome.wall_s, outcome.interrupted, "", info, report_offset)


def check_outputs(cfg: EvalConfig) -> None:
    """UsageFailure before any case runs when --trace, --summary or --report could not be written."""
    check_destination(cfg.trace, "trace")
    check_destination(cfg.summary, "summary")
    check_destination(cfg.report, "report")
    check_destination(cfg.step_log, "step log")


def run(cfg: EvalConfig) -> int:
    """The selected cases (or --shard's part of them, continuing a trace that already holds that
    shard) in this process, or spread over Ray with --ray."""
    check_outputs(cfg)
    selected = load_selected(cfg)
    if cfg.ray is not None:
        return run_ray(cfg, selected)
    part = shard_part(cfg, selected)
    if part is None:
        return run_cases(cfg, selected)
    click.echo(f"ds4-eval: shard {part.shard}: {len(part.cases)} of the {part.selected} selected cases", err=True)
    todo = shard_unfinished(cfg.trace, part)
    if todo is None:
        return run_cases(cfg, part.cases, part.numbers, shard_header=part.header_fields())
    # The trace already holds this shard of this selection (a preempted or failed array task run
    # again): continue it as a retry would, without running finished cases again.
    click.echo(f"ds4-eval: shard {part.shard}: {cfg.trace} already holds it; {len(todo)} of "
               f"{len(part.cases) * cfg.repeats} case runs left", err=True)
    if not todo:
        return 0
    by_key = {(c.source, c.id): (c, n) for c, n in zip(part.cases, part.numbers)}
    return run_cases(cfg, [by_key[(s, i)][0] for s, i, _ in todo], [by_key[(s, i)][1] for s, i, _ in todo],
                     [r for _, _, r in todo], report_whole_trace=True, shard_header=part.header_fields())


def shard_unfinished(path: str | None, part) -> list[tuple[str, str, int]] | None:
    """The (source, id, repeat) of `part` that the trace at `path` has not finished graded, when
    it holds a run of the same shard of the same selection; None when it holds none."""
    if not path or not os.path.exists(path):
        return None
    parsed = read_trace(path)
    runs = [r for r in parsed.runs if r.shard == str(part.shard) and r.selection == part.selection]
    if not runs:
        return None
    mine = {(c.source, c.id) for c in part.cases}
    records = [r for r in parsed.records if (r.source, r.id) in mine]
    return [key for key in regrade.incomplete(records, runs) if key[:2] in mine]


def retry(cfg: RetryConfig) -> int:
    path = cfg.trace_file
    check_outputs(cfg.run_settings(cfg.run.repeats))
    if trace.being_written(path):  # its incomplete cases may still be running
        raise UsageFailure(str(trace.TraceBusy(path)))
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
    # A shard's retry writes the shard's header again, so that the shards still merge.
    shard_header = next((run.shard_fields() for run in parsed.runs if run.shard), None)
    # The trace's own repeat count: what a retry writes and reports belongs to that run.
    settings = cfg.run_settings(max([run.repeats for run in parsed.runs] + [r + 1 for _, _, r in todo]))
    what = "incomplete case(s)" if settings.repeats == 1 else f"incomplete repeat(s) of {settings.repeats}"
    click.echo(f"retrying {len(todo)} {what} from {path}")
    return run_cases(settings, [known[(s, i)] for s, i, _ in todo], [numbers[(s, i)] for s, i, _ in todo],
                     [r for _, _, r in todo], report_whole_trace=True, shard_header=shard_header)


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
