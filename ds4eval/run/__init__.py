"""Running a suite: the runner and its backends, the terminal UI, the trace and summary a run
writes, and the clients that talk to OpenAI-compatible servers (probe, SSE, HTTP errors).

It judges answers through `ds4eval.cases` and never compares runs (that is `ds4eval.verdict`).
"""
