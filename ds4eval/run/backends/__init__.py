"""Backends that run one evaluation case: `engine` (in-process) and `openai` (HTTP).

Each implements the `ds4eval.run.runner.Backend` protocol: `run_case(job, ctx) -> GenerationResult`,
reporting progress and text through `ctx` and calling `ctx.checkpoint()` between tokens so
that pause, stop and switch take effect at a token boundary; a backend that can block between
tokens (waiting on a server) also has `interrupt()`, which the runner's stop calls.
`create_backend(config, note=)` builds the configured one; for a server it first sends one
probe request (`GET /v1/models`), so an unreachable server stops the run with one line
(`BackendUnavailable`) before the first case, and then, unless `config.no_probe`, the
capability probe of the features the run needs (`run.probe`): a required feature the
server ignores or rejects stops the run the same way, and the rest come back through `note`.
Backends never grade and never write traces.
"""

from __future__ import annotations

from ds4eval.config import EvalConfig


class BackendUnavailable(RuntimeError):
    """The backend cannot run any case (a server that does not answer); the message is one line."""


def create_backend(config: EvalConfig, note=lambda line: None):
    if config.backend == "engine":
        from ds4eval.run.backends.engine_backend import EngineBackend

        return EngineBackend.load(config)
    if config.backend == "openai":
        from ds4eval.run.backends.openai_backend import OpenAIBackend

        backend = OpenAIBackend(config)
        try:
            backend.probe()
            if not config.no_probe:
                from ds4eval.run import probe as endpoint_probe
                from ds4eval.run.backends.openai_backend import capability_needs

                for line in endpoint_probe.probe_or_stop(config.url, capability_needs(config),
                                                         backend.request_model, config.api_key):
                    note(line)
        except Exception as e:
            backend.close()
            raise BackendUnavailable(str(e)) from None
        return backend
    raise ValueError(f"unknown backend {config.backend!r}")
