"""`ds4-eval` command line: parses flags into an EvalConfig and calls the library.

Modes (at most one): run a suite (default), --list-cases, --validate-cases,
--self-test-extractors, --grade-file, --regrade, --retry-incomplete, --data-pull, --probe (the
capability table of the server at --url; exit 1 when it cannot be reached), --compare
(exit status 1 for a regression, 2 for input it cannot compare), --report-from (a report of an
existing trace). --report FILE writes the report of a run (rendered from the trace it wrote),
of --compare or of --report-from (`ds4eval.reports.formats`).
A run shows the live terminal UI (`ds4eval.run.tui`) when stdin and stdout are terminals and
--plain is not given; otherwise it prints one line per finished case. Both end with the same
report. Errors are one line on stderr with exit status 2 (bad input) or 1 (a check failed); no
traceback. A run exits 0 when every selected case was graded (PASSED or FAILED), 3 when any
case ended ERROR, SKIPPED or STOPPED or was not run (also when the server does not answer the
probe before the first case; --allow-errors turns 3 into 0), and 130 when SIGINT, SIGTERM or
SIGHUP stopped it (the running cases end STOPPED at the next token boundary, every thread is
joined and the backend closed before the report). Files are written atomically. The run itself, grading and formats live in the
library modules; this module only wires them together.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from datetime import datetime
from pathlib import Path

import click

from ds4eval.atomicfile import write_text_atomic
from ds4eval.cases import answerkinds
from ds4eval.cases import case as cs
from ds4eval.cases import grade
from ds4eval.cases import manifest
from ds4eval.cases import selftest
from ds4eval.cases.suites import DataMissing, load_suite
from ds4eval.config import ALLOWED_DIFFS, COMPARE_FORMATS, KV_TYPES
from ds4eval.config import BACKENDS, DEFAULT_TOKENS, ConfigError, EvalConfig
from ds4eval.run import summary as report
from ds4eval.run import trace
from ds4eval.run.provenance import run_provenance
from ds4eval.run.stopsignals import EXIT_INTERRUPTED, StopSignals
from ds4eval.verdict import regrade


class UsageFailure(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


# ---------------------------------------------------------------- modes

def cmd_self_test() -> int:
    failures = selftest.run_self_test()
    total = len(selftest.SELF_TEST_CASES)
    for c, v in failures:
        click.echo(f"FAIL {c.kind} {c.name!r}: output={c.output!r} want picked={c.picked!r} "
                   f"passed={c.passed} got picked={v.picked!r} passed={v.passed}")
    click.echo(f"{total - len(failures)}/{total} extractor self-tests passed "
               f"(kinds: {', '.join(sorted(selftest.covered_kinds()))})")
    return 1 if failures else 0


def grade_lines(text: str, name: str = "input") -> list[dict]:
    """Grade every JSON line of a --grade-file input; raise UsageFailure on a bad line."""
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageFailure(f"{name}:{n}: invalid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise UsageFailure(f"{name}:{n}: not a JSON object")
        kind, answer, output = obj.get("answer_kind"), obj.get("answer"), obj.get("output")
        aliases, nchoices = obj.get("aliases", []), obj.get("nchoices", 0)
        if kind not in answerkinds.NAMES:
            raise UsageFailure(f"{name}:{n}: answer_kind must be one of {', '.join(answerkinds.NAMES)}")
        takes_choices = answerkinds.lookup(kind).takes_choices
        if not isinstance(answer, str) or not isinstance(output, str):
            raise UsageFailure(f"{name}:{n}: 'answer' and 'output' must be strings")
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise UsageFailure(f"{name}:{n}: 'aliases' must be a list of strings")
        if takes_choices and (not isinstance(nchoices, int) or not 1 <= nchoices <= cs.MAX_CHOICES):
            raise UsageFailure(f"{name}:{n}: a choice line needs 'nchoices' between 1 and {cs.MAX_CHOICES}")
        try:
            grade.parse_key(kind, answer)
        except ValueError as e:
            raise UsageFailure(f"{name}:{n}: answer {answer!r}: {e}") from None
        v = grade.grade_output(kind, answer, output, aliases, nchoices if takes_choices else 0)
        out.append({**obj, "picked": v.picked, "passed": v.passed})
    return out


def cmd_grade_file(path: str) -> int:
    text = _read(path)
    for row in grade_lines(text, path):
        click.echo(json.dumps(row, ensure_ascii=False))
    return 0


def available_cases(data_dir: Path) -> dict[tuple[str, str], cs.Case]:
    """Every case this installation can see: the sanity suite plus present data files."""
    found: dict[tuple[str, str], cs.Case] = {}
    paths = [cs.COMMITTED_SUITE_FILE["sanity"]] + [data_dir / f for f in dict.fromkeys(cs.SUITE_DATA_FILE.values())]
    for p in paths:
        if p.is_file():
            for c in cs.load_file(p).cases:
                found.setdefault(c.key, c)
    return found


def cmd_regrade(path: str, data_dir: Path) -> int:
    parsed = _read_trace(path)
    known = available_cases(data_dir)
    rep = regrade.regrade(parsed.records, lambda s, i: known.get((s, i)))
    for p in parsed.problems + rep.problems:
        click.echo(f"warning: {p}", err=True)
    click.echo(rep.summary_line())
    for c in rep.changed:
        old_picked = "-" if c.old_picked is None else repr(c.old_picked)
        new_picked = "-" if c.new_picked is None else repr(c.new_picked)
        click.echo(f"changed: #{c.index} {c.source}/{c.id}: {c.old_status} -> {c.new_status} "
                   f"(picked {old_picked} -> {new_picked}, expected {c.expected!r})")
    return 0


def cmd_list(cfg: EvalConfig) -> int:
    selected = load_selected(cfg)
    rows = [[i, c.source, c.id, c.domain, c.answer_kind, c.max_tokens or "", c.title[:50]]
            for i, c in enumerate(selected, 1)]
    from tabulate import tabulate

    click.echo(tabulate(rows, headers=["#", "source", "id", "domain", "kind", "max_tokens", "title"]))
    click.echo(f"{len(selected)} cases in suite {cfg.suite}")
    return 0


def cmd_validate(cfg: EvalConfig) -> int:
    rep = manifest.validate_all(cs.resolve_data_dir(cfg.data_dir))
    for line in rep.lines():
        click.echo(line)
    click.echo("all cases valid" if rep.ok else "validation FAILED")
    return 0 if rep.ok else 1


def cmd_data_pull(cfg: EvalConfig) -> int:
    from ds4eval.cases import datapull

    data_dir = cs.resolve_data_dir(cfg.data_dir)
    try:
        written = datapull.pull(cfg.data_url, data_dir)
    except datapull.PullError as e:
        raise UsageFailure(str(e)) from None
    for path, n in written:
        click.echo(f"wrote {path} ({n} cases)")
    return 0


def load_selected(cfg: EvalConfig) -> list[cs.Case]:
    data_dir = cs.resolve_data_dir(cfg.data_dir)
    try:
        suite_cases = load_suite(cfg.suite, data_dir)
    except (DataMissing, cs.CaseError, ValueError) as e:
        raise UsageFailure(str(e)) from None
    selected = cs.select_cases(suite_cases, ids=cfg.case_ids, domains=cfg.domains, sources=cfg.sources)
    if not selected:
        raise UsageFailure(f"no case of suite {cfg.suite!r} matches the filters")
    return selected


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

    report_offset = 0 if report_whole_trace or not cfg.report else _file_size(cfg.trace)

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
                         "parallel": cfg.parallel}}
    info["provenance"] = run_provenance(backend)
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


def cmd_retry(cfg: EvalConfig) -> int:
    path = cfg.retry_incomplete
    parsed = _read_trace(path)
    for p in parsed.problems:
        click.echo(f"warning: {path}: {p}", err=True)
    todo = regrade.incomplete(parsed.records, parsed.runs)
    if not todo:
        click.echo("nothing to retry: every case in the trace finished PASSED or FAILED")
        return 0
    known = available_cases(cs.resolve_data_dir(cfg.data_dir))
    missing = list(dict.fromkeys(f"{s}/{i}" for s, i, _ in todo if (s, i) not in known))
    if missing:
        raise UsageFailure(f"cases not found in the data: {', '.join(missing)}")
    numbers = regrade.case_numbers(parsed.records, parsed.runs)
    if cfg.trace is None:
        cfg.trace = path
    # The trace's own repeat count: what a retry writes and reports belongs to that run.
    cfg.repeats = max([run.repeats for run in parsed.runs] + [r + 1 for _, _, r in todo])
    what = "incomplete case(s)" if cfg.repeats == 1 else f"incomplete repeat(s) of {cfg.repeats}"
    click.echo(f"retrying {len(todo)} {what} from {path}")
    return run_cases(cfg, [known[(s, i)] for s, i, _ in todo], [numbers[(s, i)] for s, i, _ in todo],
                     [r for _, _, r in todo], report_whole_trace=True)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except OSError as e:
        raise UsageFailure(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageFailure(f"{path} is not UTF-8 text") from None


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageFailure(f"cannot read {path}: {e.strerror}") from None


def _read_trace(path: str) -> trace.ParsedTrace:
    # Bytes, not text: a write torn inside a UTF-8 character spoils only its own block.
    parsed = trace.parse_trace_bytes(_read_bytes(path))
    if not parsed.records and not parsed.runs and parsed.problems:
        raise UsageFailure(f"{path}: not a ds4-eval trace ({parsed.problems[0]})")
    return parsed


def cmd_compare(cfg: EvalConfig) -> int:
    from ds4eval.verdict import compare as cmp
    from ds4eval.reports import formats as reports

    base_path, new_path = cfg.compare
    with cmp.collector_paused():
        base_text, new_text = _read(base_path), _read(new_path)
        try:
            base = cmp.read_run(base_text, base_path)
            new = cmp.read_run(new_text, new_path)
            result = cmp.compare(base, new, alpha=cfg.alpha, strict=cfg.strict, allow=cfg.allow_diff)
        except cmp.CompareInputError as e:
            raise UsageFailure(str(e)) from None
        formats = {cfg.compare_format} | ({reports.report_format(cfg.report)} if cfg.report else set())
        # Only the HTML page shows outputs, so only it needs the traces read a second time, as records.
        records = (reports.trace_records(base_text), reports.trace_records(new_text)) if "html" in formats \
            else ([], [])
        written = (_modified(base_path), _modified(new_path))
        click.echo(reports.render_comparison(result, cfg.compare_format, *records, written), nl=False)
        if cfg.report:
            _write_report(cfg.report, reports.render_comparison(result, reports.report_format(cfg.report),
                                                                *records, written))
    return result.exit_status


# ---------------------------------------------------------------- reports

def _file_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def _modified(path: str) -> str:
    """When a file was last written, local time; empty when unknown."""
    try:
        return datetime.fromtimestamp(os.stat(path).st_mtime).astimezone().strftime("%Y-%m-%d %H:%M:%S %z")
    except OSError:
        return ""


def _write_report(path: str, text: str) -> None:
    try:
        write_text_atomic(path, text)
    except OSError as e:
        raise UsageFailure(f"cannot write the report {path}: {e.strerror or e}") from None


def _write_run_report(cfg: EvalConfig, offset: int) -> None:
    """The report of the records the run appended to its trace from `offset` on."""
    from ds4eval.reports import formats as reports

    data = _read_bytes(cfg.trace) if os.path.exists(cfg.trace) else b""
    parsed = trace.parse_trace_bytes(data[offset:])
    fmt = reports.report_format(cfg.report)
    _write_report(cfg.report, reports.render_run(parsed.records, fmt, cfg.trace, _modified(cfg.trace)))


def cmd_report_from(cfg: EvalConfig) -> int:
    from ds4eval.reports import formats as reports

    path = cfg.report_from
    parsed = _read_trace(path)
    for p in parsed.problems:
        click.echo(f"warning: {path}: {p}", err=True)
    if not parsed.records:
        raise UsageFailure(f"{path}: no case blocks to report")
    fmt = reports.report_format(cfg.report) if cfg.report else "markdown"
    text = reports.render_run(parsed.records, fmt, path, _modified(path))
    if cfg.report:
        _write_report(cfg.report, text)
    else:
        click.echo(text, nl=False)
    return 0


def cmd_probe(cfg: EvalConfig) -> int:
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


def dispatch(cfg: EvalConfig) -> int:
    cfg.validate()
    if cfg.compare:
        return cmd_compare(cfg)
    if cfg.probe:
        return cmd_probe(cfg)
    data_dir = cs.resolve_data_dir(cfg.data_dir)
    if cfg.self_test_extractors:
        return cmd_self_test()
    if cfg.grade_file:
        return cmd_grade_file(cfg.grade_file)
    if cfg.regrade:
        return cmd_regrade(cfg.regrade, data_dir)
    if cfg.validate_cases:
        return cmd_validate(cfg)
    if cfg.data_pull:
        return cmd_data_pull(cfg)
    if cfg.list_cases:
        return cmd_list(cfg)
    if cfg.retry_incomplete:
        return cmd_retry(cfg)
    if cfg.report_from:
        return cmd_report_from(cfg)
    return run_cases(cfg, load_selected(cfg))


# ---------------------------------------------------------------- flags

@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--suite", default="sanity", show_default=True, type=click.Choice(cs.KNOWN_SUITES))
@click.option("--case-id", "case_ids", multiple=True, help="Run only this case id (repeatable).")
@click.option("--domain", "domains", multiple=True, help="Run only this domain (repeatable).")
@click.option("--source", "sources", multiple=True, help="Run only this source (repeatable).")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Case data directory.")
@click.option("--backend", default="engine", show_default=True, type=click.Choice(BACKENDS))
@click.option("-m", "--model", help="GGUF file for the engine backend (default: embedded model).")
@click.option("--ctx", type=int, help="Context size.")
@click.option("--device", default="cpu", show_default=True, help="Engine device.")
@click.option("--url", help="Server base URL for --backend openai.")
@click.option("--api-key", envvar="DS4EVAL_API_KEY", help="Bearer token for the server.")
@click.option("--served-model", "--api-model", "served_model", help="Model name sent to the server.")
@click.option("--concurrency", type=int, default=1, show_default=True, help="Cases in flight (server).")
@click.option("--parallel", type=int, default=None,
              help="Engine backend: decode N cases together (batched), each from a fresh session.")
@click.option("--threads", type=int, default=None,
              help="Engine backend: CPU threads (default: the cores other processes leave free).")
@click.option("--request-timeout", "request_timeout_s", type=float, default=600.0, show_default=True)
@click.option("--request-extra", metavar="JSON",
              help='Object merged into every request body (openai), e.g. \'{"repeat_penalty": 1.0}\'.')
@click.option("--chat-template-kwargs", metavar="JSON",
              help="Object sent as chat_template_kwargs (openai), e.g. '{\"enable_thinking\": false}'.")
@click.option("--tokenizer", type=click.Path(dir_okay=False),
              help="GGUF whose tokenizer counts tokens when the server sends no usage (openai).")
@click.option("-n", "--tokens", type=int, default=DEFAULT_TOKENS, show_default=True,
              help="Generation budget per case.")
@click.option("--temp", "temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int)
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Run every case K times (seeds seed, seed+1, ...); reports flaky cases and pass@k.")
@click.option("--nothink", is_flag=True, help="Disable thinking mode.")
@click.option("--plain", is_flag=True, help="Line-per-case output and a final report.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="Append a trace here.")
@click.option("--summary", type=click.Path(dir_okay=False), help="Write the JSON summary here.")
@click.option("--allow-errors", is_flag=True,
              help="Exit 0 even when cases ended ERROR/SKIPPED/STOPPED or did not run (else 3).")
@click.option("--list-cases", is_flag=True)
@click.option("--validate-cases", is_flag=True)
@click.option("--self-test-extractors", is_flag=True)
@click.option("--grade-file", type=click.Path(dir_okay=False))
@click.option("--regrade", type=click.Path(dir_okay=False))
@click.option("--retry-incomplete", type=click.Path(dir_okay=False))
@click.option("--data-pull", is_flag=True, help="Fetch the upstream case tables into the data dir.")
@click.option("--probe", is_flag=True, help="Print what the server at --url does with each request feature.")
@click.option("--no-probe", is_flag=True, help="Skip the capability probe before a run against a server.")
@click.option("--data-url", default=EvalConfig.data_url, show_default=True,
              help="Base URL --data-pull fetches from.")
@click.option("--kv-type", type=click.Choice(KV_TYPES), default=None,
              help="Engine KV cache type (default: f16 on CPU, bf16 on CUDA).")
@click.option("--compare", nargs=2, type=click.Path(dir_okay=False), metavar="BASE NEW", default=None,
              help="Compare two traces (or summaries) case by case; exit 1 on a regression.")
@click.option("--alpha", type=float, default=0.05, show_default=True,
              help="--compare: McNemar p below which a drop is a significant regression.")
@click.option("--strict", is_flag=True, help="--compare: any pass->fail flip is a regression.")
@click.option("--format", "compare_format", type=click.Choice(COMPARE_FORMATS), default="text",
              show_default=True, help="--compare output (html: the report page, see --report).")
@click.option("--allow-diff", "allow_diff", multiple=True, type=click.Choice(ALLOWED_DIFFS),
              help="--compare: keep cases whose model, prompt or sampling differs (the change under test).")
@click.option("--report", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write the report of the run (needs --trace), of --compare or of --report-from: "
                   "HTML, or markdown if FILE ends in .md.")
@click.option("--report-from", type=click.Path(dir_okay=False), metavar="TRACE",
              help="Report on an existing trace: to --report FILE, else markdown on stdout.")
def main(case_ids, domains, sources, nothink, trace_path, **kw) -> None:
    """ds4-eval: run evaluation suites, grade outputs, regrade traces."""
    cfg = EvalConfig(case_ids=tuple(case_ids), domains=tuple(domains), sources=tuple(sources),
                     think=not nothink, trace=trace_path, **kw)
    try:
        code = dispatch(cfg)
    except KeyboardInterrupt:  # Ctrl+C before the run started (e.g. while the model loads)
        click.echo("ds4-eval: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except (UsageFailure, ConfigError) as e:
        click.echo(f"ds4-eval: error: {e}", err=True)
        sys.exit(2)
    except OSError as e:
        click.echo(f"ds4-eval: error: {e}", err=True)
        sys.exit(2)
    sys.exit(code)


if __name__ == "__main__":
    main()
