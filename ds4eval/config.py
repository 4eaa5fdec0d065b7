"""EvalConfig: every setting of `ds4-eval`, one field per command-line flag.

Contract: a plain dataclass with defaults and `validate()`, which raises `ConfigError` with a
one-line message for inconsistent settings. `cli` builds it from flags; library callers (the
terminal UI, tests) build it directly. It performs no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

BACKENDS = ("engine", "openai")
KV_TYPES = ("f32", "f16", "bf16")
COMPARE_FORMATS = ("text", "markdown", "json", "html")
ALLOWED_DIFFS = ("model", "prompt", "sampling")
DEFAULT_TOKENS = 16000
# Pinned upstream revision that --data-pull fetches (see ds4eval/cases/datapull.py).
DEFAULT_DATA_URL = "https://raw.githubusercontent.com/antirez/ds4/8d57664"


class ConfigError(ValueError):
    pass


@dataclass
class EvalConfig:
    # --- what to run
    suite: str = "sanity"
    """Suite name: sanity (committed), core, hard or hard-smoke (read from the data dir)."""
    case_ids: tuple[str, ...] = ()
    """--case-id: run only these ids (repeatable)."""
    domains: tuple[str, ...] = ()
    """--domain: run only these domains (repeatable, case-insensitive)."""
    sources: tuple[str, ...] = ()
    """--source: run only these sources (repeatable, case-insensitive)."""
    data_dir: str | None = None
    """--data-dir: where core.jsonl / hard.jsonl live (else $DS4EVAL_DATA, else per-user)."""

    # --- backend
    backend: str = "engine"
    """engine (in-process) or openai (any OpenAI-compatible HTTP server)."""
    model: str | None = None
    """-m/--model: GGUF path for the engine backend (default: the embedded model)."""
    ctx: int | None = None
    """--ctx: context size (engine: session size; openai: optional limit used for budgets)."""
    device: str = "cpu"
    """--device for the engine backend."""
    url: str | None = None
    """--url: base URL of the server (openai backend), e.g. http://127.0.0.1:8000."""
    api_key: str | None = None
    """--api-key: bearer token for the server (also read from $DS4EVAL_API_KEY)."""
    served_model: str | None = None
    """--served-model: model name sent in requests (openai backend)."""
    concurrency: int = 1
    """--concurrency: cases sent at once to a server backend."""
    parallel: int | None = None
    """--parallel N: the engine backend decodes N cases together (batched sessions), each from a
    fresh session; None runs one case at a time, reusing one session across cases."""
    threads: int | None = None
    """--threads N: CPU threads of the engine backend's kernels; None uses the cores that other
    processes leave free, re-read every half second (engine/threads.py)."""
    request_timeout_s: float = 600.0
    """--request-timeout: seconds without any stream data before a request fails."""
    kv_type: str | None = None
    """--kv-type: the engine's KV cache element type, f32, f16 or bf16 (engine.load_model's
    kv_type); None: the engine's default (f16 on CPU, bf16 on CUDA)."""
    request_extra: str | None = None
    """--request-extra JSON: an object merged into every request body of the openai backend
    (its keys win over ds4-eval's own), e.g. '{"repeat_penalty": 1.0}' for llama.cpp."""
    chat_template_kwargs: str | None = None
    """--chat-template-kwargs JSON: an object sent as the request's `chat_template_kwargs`
    (openai backend; merged over `enable_thinking` that --nothink sets)."""
    tokenizer: str | None = None
    """--tokenizer GGUF: count tokens with this model's tokenizer when a server sends no usage
    (openai backend); without it such counts are reported as unknown."""

    # --- generation
    tokens: int = DEFAULT_TOKENS
    """-n/--tokens: generation budget per case (also capped by case max_tokens and context)."""
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repeats: int = 1
    """--repeats K: run every case K times, repeat r with seed `seed + r` (with --temp 0 the
    repeats check determinism); the report classes each case stable pass, stable fail or flaky."""
    think: bool = True
    """Thinking mode where the model supports it; --nothink turns it off."""
    think_soft_reserve: int = 1024
    """When thinking and this many budget tokens are left, nudge the model to conclude."""
    think_hard_reserve: int = 256
    """When still thinking with this many left, close the thinking block and ask for the answer."""

    no_probe: bool = False
    """--no-probe: skip the capability probe before a run against a server (one cheap request
    per request feature the run needs; see ds4eval.run.probe)."""

    # --- output
    plain: bool = False
    """--plain: one line per finished case and a final report (no terminal UI)."""
    trace: str | None = None
    """--trace FILE: append one block per finished case."""
    summary: str | None = None
    """--summary FILE: write the JSON summary of the run."""
    allow_errors: bool = False
    """--allow-errors: exit 0 even when cases ended ERROR, SKIPPED or STOPPED or were not run
    (otherwise such a run exits 3)."""

    # --- modes that do not run a suite
    list_cases: bool = False
    validate_cases: bool = False
    self_test_extractors: bool = False
    grade_file: str | None = None
    regrade: str | None = None
    retry_incomplete: str | None = None
    data_pull: bool = False
    data_url: str = DEFAULT_DATA_URL
    """--data-url: base URL that --data-pull fetches the C case tables from."""
    probe: bool = False
    """--probe: print what the server at --url does with each request feature, and exit."""

    # --- --compare BASE NEW (ds4eval.verdict.compare)
    compare: tuple[str, str] | None = None
    """--compare BASE NEW: two traces (or summaries) to compare case by case."""
    alpha: float = 0.05
    """--alpha: McNemar p-value below which a drop in passes is a significant regression."""
    strict: bool = False
    """--strict: any pass->fail flip (or a lost pass) fails the comparison."""
    compare_format: str = "text"
    """--format: text, markdown, json or html (the page `--report FILE.html` writes)."""
    allow_diff: tuple[str, ...] = ()
    """--allow-diff model|prompt|sampling: differences that are the change under test, so
    the cases they touch stay in the verdict (by default they are excluded with a warning)."""

    # --- reports (ds4eval.reports.formats)
    report: str | None = None
    """--report FILE: write the report of the run, of --compare or of --report-from there; HTML
    (one self-contained page), or markdown when FILE ends in .md. A run needs --trace: its
    report is rendered from the records it wrote to the trace."""
    report_from: str | None = None
    """--report-from TRACE: render the report of an existing trace (to --report FILE, else
    markdown on stdout) without running anything."""

    def request_extra_fields(self) -> dict:
        """--request-extra parsed (empty when not given); ConfigError when it is not an object."""
        return _json_object("--request-extra", self.request_extra)

    def template_kwargs(self) -> dict:
        """--chat-template-kwargs parsed (empty when not given)."""
        return _json_object("--chat-template-kwargs", self.chat_template_kwargs)

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}")
        if self.backend == "openai" and not self.url:
            raise ConfigError("--backend openai needs --url")
        if self.url is not None and not _looks_like_http_url(self.url):
            raise ConfigError(f"--url must be an http:// or https:// URL with a host, e.g. "
                              f"http://127.0.0.1:8000 (got {self.url!r})")
        self.request_extra_fields()
        self.template_kwargs()
        if self.backend == "engine":
            given = [flag for flag, value in (("--request-extra", self.request_extra),
                                              ("--chat-template-kwargs", self.chat_template_kwargs),
                                              ("--tokenizer", self.tokenizer)) if value is not None]
            if given:
                raise ConfigError(f"{given[0]} applies to the openai backend (the engine counts its own "
                                  f"tokens and renders its own template)")
        if self.tokens <= 0:
            raise ConfigError("--tokens must be positive")
        if self.ctx is not None and self.ctx <= 0:
            raise ConfigError("--ctx must be positive")
        if self.concurrency < 1:
            raise ConfigError("--concurrency must be at least 1")
        if self.backend == "engine" and self.concurrency != 1:
            raise ConfigError("--concurrency applies to server backends; the engine runs one case at a time")
        if self.parallel is not None and self.parallel < 1:
            raise ConfigError("--parallel must be at least 1")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("--threads must be at least 1")
        if self.parallel is not None and self.backend != "engine":
            raise ConfigError("--parallel applies to the engine backend; servers take --concurrency")
        if self.repeats < 1:
            raise ConfigError("--repeats must be at least 1")
        if self.temperature < 0:
            raise ConfigError("--temp must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            raise ConfigError("--min-p must be in [0, 1)")
        if self.think_hard_reserve < 0 or self.think_soft_reserve < self.think_hard_reserve:
            raise ConfigError("think reserves must satisfy 0 <= hard <= soft")
        modes = [self.list_cases, self.validate_cases, self.self_test_extractors, bool(self.grade_file),
                 bool(self.regrade), bool(self.retry_incomplete), self.data_pull, bool(self.report_from), self.probe]
        if sum(modes) > 1:
            raise ConfigError("give at most one of --list-cases, --validate-cases, --self-test-extractors, "
                              "--grade-file, --regrade, --retry-incomplete, --data-pull, --report-from, --probe")
        if self.probe and not self.url:
            raise ConfigError("--probe needs --url")
        if self.probe and self.no_probe:
            raise ConfigError("--probe and --no-probe contradict each other")
        if self.compare is not None and sum(modes):
            raise ConfigError("--compare runs alone: it takes no other mode")
        if self.kv_type is not None and self.kv_type not in KV_TYPES:
            raise ConfigError(f"--kv-type must be one of {', '.join(KV_TYPES)}")
        if self.kv_type is not None and self.backend != "engine":
            raise ConfigError("--kv-type applies to the engine backend")
        if not 0 < self.alpha < 1:
            raise ConfigError("--alpha must be in (0, 1)")
        if self.compare_format not in COMPARE_FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(COMPARE_FORMATS)}")
        if set(self.allow_diff) - set(ALLOWED_DIFFS):
            raise ConfigError(f"--allow-diff takes {', '.join(ALLOWED_DIFFS)}")
        self._validate_report()

    def _validate_report(self) -> None:
        if self.report is None:
            return
        if not self.report:
            raise ConfigError("--report needs a file name")
        if self.list_cases or self.validate_cases or self.self_test_extractors or self.grade_file \
                or self.regrade or self.data_pull or self.probe:
            raise ConfigError("--report applies to a run, --compare or --report-from")
        if not (self.compare or self.report_from or self.trace or self.retry_incomplete):
            raise ConfigError("--report needs --trace FILE for a run: the report is rendered from the records "
                              "the run writes to its trace")


def _json_object(flag: str, raw: str | None) -> dict:
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: invalid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, e.g. '{{\"repeat_penalty\": 1.0}}'")
    return value


def _looks_like_http_url(url: str) -> bool:
    scheme, sep, rest = url.partition("://")
    host = rest.split("/", 1)[0]
    return bool(sep) and scheme.lower() in ("http", "https") and bool(host) and not host.startswith(":")
