"""`ds4-eval determinism`: whether a stack's answers depend on the batch, the cache or the run.

`prompts` (what is sent), `targets` (the endpoint or the in-process engine), `conditions` (the
registry of conditions and their requests), `analysis` (pure: distinct completions, where they
part, near-tie or real, the verdicts and the result file), `measure` (one run end to end).
"""
