"""Backends that run one evaluation case: `engine` (in-process) and `openai` (HTTP).

Each implements the `ds4eval.runner.Backend` protocol: `run_case(job, ctx) -> GenerationResult`,
reporting progress and text through `ctx` and calling `ctx.checkpoint()` between tokens so
that pause, stop and switch take effect at a token boundary. `create_backend(config)` builds
the configured one. Backends never grade and never write traces.
"""

from __future__ import annotations

from ds4eval.config import EvalConfig


def create_backend(config: EvalConfig):
    if config.backend == "engine":
        from ds4eval.backends.engine_backend import EngineBackend

        return EngineBackend.load(config)
    if config.backend == "openai":
        from ds4eval.backends.openai_backend import OpenAIBackend

        return OpenAIBackend(config)
    raise ValueError(f"unknown backend {config.backend!r}")
