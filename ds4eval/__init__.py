"""ds4eval — the `ds4-eval` regression harness (`ds4-bench` lives in the `ds4bench` package).

Layout, by concern:
  cases/    what is asked and how an answer is judged: `case` (the Case record), `manifest`,
            `suites`, `datapull`, `answerkinds` (one record per answer kind), `prompts`,
            `extract`, `grade` and the extractors' `selftest`. Pure, apart from reading data.
  run/      running a suite: `runner` (events and controls), `backends` (in-process engine or an
            OpenAI-compatible server), `tui`, `trace` and `provenance` (what a run writes),
            `summary` (totals and the `--plain` lines), and talking to servers: `capabilities`,
            `probe`, `sse`, `httperrors`, `tokencount`, `stopsignals`.
  verdict/  what two runs or K repeats say: `compare`, `stats`, `repeats`, `regrade`.
  reports/  rendering traces and comparisons: `run` and `comparison` (tables), `html`,
            `formats` (which renderer writes which file) and `screenshot`.
  cli, config, atomicfile: the command line, its settings, and the file-writing helper.

Pipeline: manifest + data dir -> `cases.suites.load_suite` -> `Case` -> `cases.prompts` -> backend
driven by `run.runner.Runner` -> `cases.extract` -> `cases.grade` -> `run.trace` block (with
`run.provenance`) -> `run.summary`. `verdict.regrade` re-enters at extraction from a trace alone;
`verdict.compare` sets two traces or summaries side by side; `reports` renders either.

This package imports `engine` only inside the engine backend and never reaches into `server`.
"""
