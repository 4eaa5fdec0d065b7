"""Backends that run one evaluation case: `engine` (in-process) and `openai` (HTTP).

Each implements the `ds4eval.run.runner.Backend` protocol: `run_case(job, ctx) -> GenerationResult`,
reporting progress and text through `ctx` and calling `ctx.checkpoint()` between tokens so
that pause, stop and switch take effect at a token boundary; a backend that can block between
tokens (waiting on a server) also has `interrupt()`, which the runner's stop calls.
`create_backend(config, note=)` builds the configured one (the engine's warm-up line goes to
`note`); for servers it first probes every
endpoint (`GET /v1/models`, then, unless `config.no_probe`, the capability probe of the features
the run needs, `run.probe`), so a server that does not answer, a required feature it ignores or
rejects, or endpoints that differ stop the run before the first case (`BackendUnavailable`, one
line per reason), and the rest come back through `note`, which the backend keeps for what it
reports during the run (an endpoint taken out of rotation or back). An unreadable --url-file
raises `EndpointListError`.
Backends never grade and never write traces.
"""

from __future__ import annotations

from ds4eval.config import EvalConfig


class BackendUnavailable(RuntimeError):
    """The backend cannot run any case (a server that does not answer); the message is one line."""


def create_backend(config: EvalConfig, note=lambda line: None):
    if config.backend == "engine":
        from ds4eval.run.backends.engine_backend import EngineBackend

        return EngineBackend.load(config, note=note)
    if config.backend == "openai":
        from ds4eval.run.backends.openai_backend import OpenAIBackend, capability_needs
        from ds4eval.run.endpoints import configured_urls

        backend = OpenAIBackend(config, urls=configured_urls(config.urls, config.url_file), note=note)
        try:
            for line in backend.probe(capability_needs(config)):
                note(line)
        except Exception as e:
            backend.close()
            raise BackendUnavailable(str(e)) from None
        return backend
    raise ValueError(f"unknown backend {config.backend!r}")
