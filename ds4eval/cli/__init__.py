"""`ds4-eval` command line: one subcommand per job, each filling its own config (`ds4eval.config`).

  ds4-eval run [--suite S] [--case-id ID] [--backend engine|openai] [-m GGUF] [--url URL] [-n N] ...
  ds4-eval retry TRACE [run flags]          run again the cases of TRACE not finished PASSED or FAILED
  ds4-eval compare BASE NEW [--alpha P] [--strict] [--format text|markdown|json|html] [--allow-diff D] [--report FILE]
  ds4-eval regrade TRACE [--data-dir DIR]   grade a trace's outputs again
  ds4-eval report TRACE [--report FILE]     the report of an existing trace (markdown on stdout without --report)
  ds4-eval grade FILE                       grade outputs made elsewhere (JSON lines)
  ds4-eval list [--suite S] [--case-id ID] [--domain D] [--source S] [--data-dir DIR]
  ds4-eval validate [--data-dir DIR]        check the case files against their manifests
  ds4-eval selftest                         the answer extractors' self-tests
  ds4-eval probe --url URL [--served-model M] [--api-key K]
  ds4-eval data pull [--data-url URL] [--data-dir DIR]

`ds4-eval --help` lists them; `ds4-eval <command> --help` shows a command's flags. A subcommand
refuses another's flags. The old single-command form is kept as an alias, with the same output
and exit statuses: a bare `ds4-eval` (the sanity suite), `ds4-eval --suite sanity ...` (run),
--retry-incomplete TRACE (retry), --compare BASE NEW (compare), --regrade, --report-from TRACE
[--report FILE] (report), --grade-file (grade), --list-cases, --validate-cases,
--self-test-extractors (selftest), --probe, --data-pull (data pull); at most one of them at once.

Exit statuses: run and retry 0 when every selected case was graded (PASSED or FAILED), 3 when any
case ended ERROR, SKIPPED or STOPPED or was not run, also when the server does not answer the
probe before the first case (--allow-errors turns 3 into 0), 1 when the run failed, 130 when
SIGINT, SIGTERM or SIGHUP stopped it (the running cases end STOPPED at the next token boundary,
every thread is joined and the backend closed before the report); compare 1 for a regression;
validate and selftest 1 when a check fails; probe 1 when the server cannot be reached. Errors are
one line `ds4-eval: error: ...` on stderr with exit status 2 for bad input; never a traceback.
Files are written atomically. --report FILE writes the report of a run (rendered from the trace
it wrote), of compare or of report (`ds4eval.reports.formats`).

Layout: `app` (the registry and click tree, the error policy), `run_commands` (run, retry,
probe), `trace_commands` (compare, regrade, report), `case_commands` (grade, list, validate,
selftest, data pull), `flags` (every flag, defined once), `legacy` (the old form's translation),
`inputs` (reading inputs, writing reports). The work itself lives in the library modules.
"""

from ds4eval.cli.app import main

__all__ = ["main"]
