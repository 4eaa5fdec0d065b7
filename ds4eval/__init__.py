"""ds4eval — the `ds4-eval` regression harness (and `ds4-bench` in `ds4eval.bench`).

Pipeline: suite manifest + data dir -> `suites.load_suite` -> `cases.Case` -> `prompts` -> backend
(`backends.engine_backend` in-process, or `backends.openai_backend` over HTTP) driven by
`runner.Runner` (events + controls) -> `extract` -> `grade` -> `trace` block (with `provenance`)
-> `report` / JSON summary. Everything that differs between answer kinds (extractor, key
parser, comparison, prompt instruction) is one record per kind in `answerkinds`. `regrade`
re-enters at extraction from a trace alone; `compare` (statistics in `stats`, rendering in
`compare_report`) sets two traces or summaries side by side. `cli` only maps flags onto
`config.EvalConfig`.

This package imports `engine` only inside the engine backend and never reaches into `server`.
"""
