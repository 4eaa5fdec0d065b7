"""Settings of every `ds4-eval` command: one frozen dataclass per subcommand, one field per flag.

`EvalConfig` holds the settings of a run: what the runner, the backends and the terminal UI read.
The other commands (retry, merge, compare, plan, reference record, gate, regrade, grade, report, probe,
data pull, selftest, list, validate) each have their own small config; `RetryConfig` carries a run's settings inside it.

Contract: every config is an immutable dataclass with defaults (positional inputs excepted) and
`validate()`, which raises `ConfigError` with a one-line message for inconsistent settings; the
messages name the flags the user typed. `ds4eval.cli` builds them from flags; library callers
(the terminal UI, tests, ds4-bench) build `EvalConfig` directly. Nothing here does I/O, parses a
command line or knows which flag spelling built a config.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from ds4eval.run.shards import ShardError, parse_shard

BACKENDS = ("engine", "openai")
KV_TYPES = ("f32", "f16", "bf16")
COMPARE_FORMATS = ("text", "markdown", "json", "html")
PLAN_FORMATS = ("text", "json")
GATE_ALLOWED_DIFFS = ("model", "kv_type")  # ds4eval.verdict.references.ALLOWED_DIFFS
ALLOWED_DIFFS = ("model", "prompt", "sampling")
DEFAULT_TOKENS = 16000
# Pinned upstream revision that `ds4-eval data pull` fetches (see ds4eval/cases/datapull.py).
DEFAULT_DATA_URL = "https://raw.githubusercontent.com/antirez/ds4/8d57664"

UNFLAGGED_RUN_FIELDS = ("think_soft_reserve", "think_hard_reserve")
"""EvalConfig fields no flag sets: library callers tune them; a command-line run keeps the defaults."""
RETRY_FROM_TRACE = ("case_ids", "domains", "sources", "shard", "repeats")
RUN_ONLY_FIELDS = ("ray", "ray_shards")
"""EvalConfig fields only `ds4-eval run` sets: a retry runs in one process."""
"""EvalConfig fields a retry takes from the trace it retries, so `ds4-eval retry` has no flags for them."""


class ConfigError(ValueError):
    """Settings that contradict each other or are out of range; the message is one line."""


@dataclass(frozen=True)
class CommandConfig:
    """What every command's config offers the command line: `validate()`."""

    def validate(self) -> None:
        """Raise ConfigError for inconsistent settings (a config with nothing to check accepts all)."""


@dataclass(frozen=True)
class EvalConfig(CommandConfig):
    """`ds4-eval run`: the settings of one run of a suite."""

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
    shard: str | None = None
    """--shard I/N: run only the selected cases of shard I (0-based) of N (ds4eval.run.shards);
    "auto" reads I and N from a Slurm array job's or a Kubernetes Indexed Job's variables."""

    # --- backend
    backend: str = "engine"
    """engine (in-process) or openai (any OpenAI-compatible HTTP server)."""
    model: str | None = None
    """-m/--model: GGUF path for the engine backend (default: the embedded model)."""
    ctx: int | None = None
    """--ctx: context size (engine: session size; openai: optional limit used for budgets)."""
    device: str = "cpu"
    """--device for the engine backend."""
    urls: tuple[str, ...] = ()
    """--url: base URL of a server (openai backend), e.g. http://127.0.0.1:8000; repeatable, the
    cases then go to whichever endpoint has the fewest in flight (ds4eval.run.endpoints)."""
    url_file: str | None = None
    """--url-file FILE: more base URLs, one a line (`#` comments and blank lines ignored); read
    when the backend starts, after the --url ones."""
    allow_mixed_endpoints: bool = False
    """--allow-mixed-endpoints: run on endpoints whose served model, chat template or capability
    findings differ (by default the run refuses them, one line per difference)."""
    endpoint_wait_s: float = 60.0
    """--endpoint-wait SECONDS: with every endpoint out of rotation, how long to re-probe them
    before the run stops (its cases not yet graded end STOPPED, for `ds4-eval retry`)."""
    api_key: str | None = None
    """--api-key: bearer token for the server (also read from $DS4EVAL_API_KEY)."""
    served_model: str | None = None
    """--served-model: model name sent in requests (openai backend)."""
    concurrency: int = 1
    """--concurrency: cases in flight at once to server backends, all endpoints together."""
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
    batch_invariant: bool = False
    """--batch-invariant: the engine runs every token through one row's decoding step
    (engine.invariant): answers that do not depend on the batch, prefill chunks or cached
    prefixes on any device, at the cost of the batch's parallelism."""
    warmup: bool = True
    """The engine backend meets its device's first uses (CUDA graph captures, kernel compiles) for
    the run's batch sizes before the first case (engine.warmup), so that no case's time holds
    them; --no-warmup leaves them to the cases that meet them."""
    request_extra: str | None = None
    """--request-extra JSON: an object merged into every request body of the openai backend
    (its keys win over ds4-eval's own), e.g. '{"repeat_penalty": 1.0}' for llama.cpp."""
    chat_template_kwargs: str | None = None
    """--chat-template-kwargs JSON: an object sent as the request's `chat_template_kwargs`
    (openai backend; merged over `enable_thinking` that --nothink sets)."""
    tokenizer: str | None = None
    """--tokenizer GGUF: count tokens with this model's tokenizer when a server sends no usage
    (openai backend); without it such counts are reported as unknown."""
    model_file: str | None = None
    """--model-file GGUF: the model file the server runs (openai backend), hashed into the trace's
    model_sha256 so that runs of the same file on different stacks compare as one model."""
    no_probe: bool = False
    """--no-probe: skip the capability probe before a run against a server (one cheap request
    per request feature the run needs; see ds4eval.run.probe)."""
    ray: str | None = None
    """--ray [ADDRESS]: spread the run over a Ray cluster, one task a shard (ds4eval.run.raycluster);
    "" (the flag alone) lets Ray choose: $RAY_ADDRESS, a cluster started on this machine, or a
    new local one. None runs in this process."""
    ray_shards: int | None = None
    """--ray-shards N: the number of shards (default: one per GPU, or per task's CPUs, of the cluster)."""

    # --- generation
    tokens: int = DEFAULT_TOKENS
    """-n/--tokens: generation budget per case (also capped by case max_tokens and context)."""
    temperature: float = 0.0
    """--temp."""
    top_p: float = 1.0
    """--top-p."""
    min_p: float = 0.0
    """--min-p."""
    seed: int | None = None
    """--seed: the sampler's seed (repeat r uses seed + r)."""
    repeats: int = 1
    """--repeats K: run every case K times, repeat r with seed `seed + r` (with --temp 0 the
    repeats check determinism); the report classes each case stable pass, stable fail or flaky."""
    think: bool = True
    """Thinking mode where the model supports it; --nothink turns it off."""
    think_soft_reserve: int = 1024
    """When thinking and this many budget tokens are left, nudge the model to conclude (no flag)."""
    think_hard_reserve: int = 256
    """When still thinking with this many left, close the thinking block and ask for the answer
    (no flag)."""

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
    report: str | None = None
    """--report FILE: write the report of the run there; HTML (one self-contained page), or
    markdown when FILE ends in .md. It is rendered from the records the run wrote to --trace."""
    step_log: str | None = None
    """--step-log FILE: with --parallel, write the engine's batched steps there when the run
    ends, one JSON line a step (ds4eval.run.steplog), and their summary on stderr."""

    def request_extra_fields(self) -> dict:
        """--request-extra parsed (empty when not given); ConfigError when it is not an object."""
        return _json_object("--request-extra", self.request_extra)

    def template_kwargs(self) -> dict:
        """--chat-template-kwargs parsed (empty when not given)."""
        return _json_object("--chat-template-kwargs", self.chat_template_kwargs)

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}")
        check_shard(self.shard)
        if self.backend == "openai" and not self.urls and not self.url_file:
            raise ConfigError("--backend openai needs --url")
        for url in self.urls:
            check_url(url)
        if self.url_file is not None and not self.url_file:
            raise ConfigError("--url-file needs a file name")
        if self.endpoint_wait_s < 0:
            raise ConfigError("--endpoint-wait must be at least 0")
        self.request_extra_fields()
        self.template_kwargs()
        if self.backend == "engine":
            given = [flag for flag, value in (("--request-extra", self.request_extra),
                                              ("--chat-template-kwargs", self.chat_template_kwargs),
                                              ("--tokenizer", self.tokenizer),
                                              ("--model-file", self.model_file)) if value is not None]
            if given:
                raise ConfigError(f"{given[0]} applies to the openai backend (the engine counts its own "
                                  f"tokens and renders its own template)")
        if self.model_file is not None and not os.path.isfile(self.model_file):
            raise ConfigError(f"--model-file {self.model_file}: no such file")
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
        if self.step_log is not None and (self.parallel is None or self.ray is not None):
            raise ConfigError("--step-log records the engine's batched steps in this process: it needs "
                              "--parallel, without --ray")
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
        if self.kv_type is not None and self.kv_type not in KV_TYPES:
            raise ConfigError(f"--kv-type must be one of {', '.join(KV_TYPES)}")
        if self.kv_type is not None and self.backend != "engine":
            raise ConfigError("--kv-type applies to the engine backend")
        if self.batch_invariant and self.backend != "engine":
            raise ConfigError("--batch-invariant applies to the engine backend (a server sets its own: "
                              "ds4-server --batch-invariant)")
        if self.ray is not None:
            if not self.trace:
                raise ConfigError("--ray needs --trace FILE: the shards' traces are merged into it")
            if self.shard is not None:
                raise ConfigError("--ray makes its own shards; --shard is for runs that a scheduler starts")
        if self.ray_shards is not None and (self.ray is None or self.ray_shards < 1):
            raise ConfigError("--ray-shards takes a positive count, with --ray")
        check_report_file(self.report)
        if self.report is not None and not self.trace:
            raise ConfigError("--report needs --trace FILE for a run: the report is rendered from the records "
                              "the run writes to its trace")


@dataclass(frozen=True)
class RetryConfig(CommandConfig):
    """`ds4-eval retry TRACE`: run again the cases and repeats of TRACE that did not finish graded."""

    trace_file: str
    """TRACE: the trace to complete; the retried cases append to it unless `run.trace` names another."""
    run: EvalConfig = EvalConfig()
    """The run flags. The case selection and the repeat count (RETRY_FROM_TRACE) come from TRACE."""

    def run_settings(self, repeats: int) -> EvalConfig:
        """The settings the retried cases run with: TRACE's repeat count, and TRACE as the trace
        to append to unless --trace names another."""
        return replace(self.run, trace=self.trace_file if self.run.trace is None else self.run.trace,
                       repeats=repeats)

    def validate(self) -> None:
        self.run_settings(self.run.repeats).validate()


@dataclass(frozen=True)
class ListConfig(CommandConfig):
    """`ds4-eval list`: the cases a run with the same selection flags would run."""

    suite: str = "sanity"
    """--suite."""
    case_ids: tuple[str, ...] = ()
    """--case-id (repeatable)."""
    domains: tuple[str, ...] = ()
    """--domain (repeatable)."""
    sources: tuple[str, ...] = ()
    """--source (repeatable)."""
    data_dir: str | None = None
    """--data-dir."""
    shard: str | None = None
    """--shard I/N or auto: list only that shard's cases."""

    def validate(self) -> None:
        check_shard(self.shard)


@dataclass(frozen=True)
class ValidateConfig(CommandConfig):
    """`ds4-eval validate`: check every case file against its committed manifest."""

    data_dir: str | None = None
    """--data-dir."""


@dataclass(frozen=True)
class SelfTestConfig(CommandConfig):
    """`ds4-eval selftest`: the extractors' self-tests; it takes no settings."""


@dataclass(frozen=True)
class GradeConfig(CommandConfig):
    """`ds4-eval grade FILE`: grade outputs made elsewhere, one JSON object per line."""

    file: str
    """FILE: JSON lines with answer_kind, answer, output (and aliases, nchoices)."""


@dataclass(frozen=True)
class RegradeConfig(CommandConfig):
    """`ds4-eval regrade TRACE`: grade a trace's outputs again with today's extractors."""

    trace_file: str
    """TRACE: the trace to regrade (or a set of shard traces: a directory or a glob pattern)."""
    data_dir: str | None = None
    """--data-dir: where the data cases the trace names live."""


@dataclass(frozen=True)
class MergeConfig(CommandConfig):
    """`ds4-eval merge SHARD_TRACES... -o RUN.trace` (ds4eval.run.merge)."""

    traces: tuple[str, ...]
    """SHARD_TRACES: the shard traces of one run (files, directories of *.trace files, or glob patterns)."""
    output: str = ""
    """-o/--output RUN.trace: the merged trace (written atomically, only when the set is one run)."""
    data_dir: str | None = None
    """--data-dir: the case data, to name the cases of a missing shard."""

    def validate(self) -> None:
        if not self.traces:
            raise ConfigError("merge needs the shard traces to merge")
        if not self.output:
            raise ConfigError("merge needs -o RUN.trace")


@dataclass(frozen=True)
class ReportConfig(CommandConfig):
    """`ds4-eval report TRACE`: the report of an existing trace."""

    trace_file: str
    """TRACE: the trace to report on (or a set of shard traces: a directory or a glob pattern)."""
    report: str | None = None
    """--report FILE: write the report there (HTML, or markdown when FILE ends in .md); without
    it the report is printed as markdown."""

    def validate(self) -> None:
        check_report_file(self.report)


@dataclass(frozen=True)
class CompareConfig(CommandConfig):
    """`ds4-eval compare BASE NEW` (ds4eval.verdict.compare)."""

    base: str
    """BASE: the trace (or summary, or a set of shard traces) compared against."""
    new: str
    """NEW: the trace (or summary, or a set of shard traces) under test."""
    alpha: float = 0.05
    """--alpha: McNemar p-value below which a drop in passes is a significant regression."""
    strict: bool = False
    """--strict: any pass->fail flip (or a lost pass) fails the comparison."""
    format: str = "text"
    """--format: text, markdown, json or html (the page `--report FILE.html` writes)."""
    allow_diff: tuple[str, ...] = ()
    """--allow-diff model|prompt|sampling: differences that are the change under test, so
    the cases they touch stay in the verdict (by default they are excluded with a warning)."""
    report: str | None = None
    """--report FILE: also write the comparison there (HTML, or markdown when FILE ends in .md)."""
    power: float = 0.8
    """--power: the power the stated detectable drop is for (the drop this comparison would
    have found as a significant regression with this chance)."""
    equivalence: float | None = None
    """--equivalence POINTS: also test (TOST) that the pass rate moved by less than this many
    points either way; the comparison then exits 1 unless equivalence is shown."""
    noise: str | None = None
    """--noise FILE: a determinism result of the stack (`ds4-eval determinism -o`); the report says
    how many of the flips the stack's own variation explains."""

    def validate(self) -> None:
        check_alpha(self.alpha)
        if self.format not in COMPARE_FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(COMPARE_FORMATS)}")
        if set(self.allow_diff) - set(ALLOWED_DIFFS):
            raise ConfigError(f"--allow-diff takes {', '.join(ALLOWED_DIFFS)}")
        check_report_file(self.report)
        if self.noise is not None and not self.noise:
            raise ConfigError("--noise needs a file name")
        check_power(self.power)
        if self.equivalence is not None:
            check_points("--equivalence", self.equivalence)


@dataclass(frozen=True)
class PlanConfig(CommandConfig):
    """`ds4-eval plan [TRACE]` (ds4eval.verdict.plan): cases needed and detectable drops."""

    trace_file: str | None = None
    """TRACE: a baseline run (ideally with --repeats) to take the pass rate and discordance from."""
    pass_rate: float | None = None
    """--pass-rate P: BASE's pass rate as a share (0.34), instead of or over TRACE's."""
    discordance: float | None = None
    """--discordance D: the share of cases two runs of the same system disagree on (0 for
    greedy decoding), instead of or over TRACE's estimate."""
    alpha: float = 0.05
    """--alpha: the comparison's significance level (two-sided exact test)."""
    power: float = 0.8
    """--power: the chance of detecting the drop that the case count is planned for."""
    drop: float = 5.0
    """--drop POINTS: the smallest drop of the pass rate that matters, in percentage points."""
    cases: int | None = None
    """--cases N: the suite size the detectable drop is computed for (default: TRACE's cases)."""
    repeats: int | None = None
    """--repeats K: also plan a comparison of K repeats a side (default: TRACE's repeats)."""
    format: str = "text"
    """--format: text or json."""

    def validate(self) -> None:
        if self.trace_file is None and self.pass_rate is None:
            raise ConfigError("plan needs a baseline: a TRACE, or --pass-rate P with --discordance D")
        if self.trace_file is None and self.discordance is None:
            raise ConfigError("--pass-rate needs --discordance D (0 for greedy runs of one model file)")
        if self.pass_rate is not None and not 0 < self.pass_rate < 1:
            raise ConfigError("--pass-rate must be a share in (0, 1), e.g. 0.34")
        if self.discordance is not None and not 0 <= self.discordance < 1:
            raise ConfigError("--discordance must be a share in [0, 1), e.g. 0.2")
        check_alpha(self.alpha)
        check_power(self.power)
        check_points("--drop", self.drop)
        if self.cases is not None and self.cases < 1:
            raise ConfigError("--cases must be at least 1")
        if self.repeats is not None and self.repeats < 1:
            raise ConfigError("--repeats must be at least 1")
        if self.format not in PLAN_FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(PLAN_FORMATS)}")


@dataclass(frozen=True)
class ReferenceRecordConfig(CommandConfig):
    """`ds4-eval reference record RUN.trace [...]` (ds4eval.verdict.references)."""

    traces: tuple[str, ...]
    """RUN.trace ...: the runs the reference is recorded from (each repeat of a trace is one run)."""
    output: str | None = None
    """-o FILE: write a new reference file holding this reference only."""
    into: str | None = None
    """--into FILE: add this reference to FILE, replacing one recorded under the same key."""
    model: str | None = None
    """--model GGUF: the model file the runs used, to record its quantization (default: the
    embedded model when its SHA-256 is the runs')."""

    def validate(self) -> None:
        if not self.traces:
            raise ConfigError("reference record needs at least one trace")
        if (self.output is None) == (self.into is None):
            raise ConfigError("give one of -o FILE (a new reference file) or --into FILE (add to one)")
        for flag, value in (("-o", self.output), ("--into", self.into)):
            if value is not None and not value:
                raise ConfigError(f"{flag} needs a file name")


@dataclass(frozen=True)
class GateConfig(CommandConfig):
    """`ds4-eval gate RUN.trace --references FILE` (ds4eval.verdict.gate)."""

    trace_file: str
    """RUN.trace: the run under test."""
    references: str
    """--references FILE: the reference file to find the run's reference in."""
    alpha: float = 0.01
    """--alpha: the chance that an unchanged system fails the gate (family-wise, over sources)."""
    power: float = 0.8
    """--power: the power the stated detectable drop is for."""
    model: str | None = None
    """--model GGUF: the run's model file, to read its quantization (default: the embedded
    model when its SHA-256 is the run's)."""
    allow_diff: tuple[str, ...] = ()
    """--allow-diff model|kv_type: judge the run against the reference of another model file
    (name, SHA-256, quantization) or KV cache type: the difference is the change under test."""
    format: str = "text"
    """--format: text or json."""

    def validate(self) -> None:
        if set(self.allow_diff) - set(GATE_ALLOWED_DIFFS):
            raise ConfigError(f"--allow-diff takes {', '.join(GATE_ALLOWED_DIFFS)}")
        if not self.references:
            raise ConfigError("--references needs a file name")
        check_alpha(self.alpha)
        check_power(self.power)
        if self.format not in PLAN_FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(PLAN_FORMATS)}")


@dataclass(frozen=True)
class ProbeConfig(CommandConfig):
    """`ds4-eval probe`: what the server at --url does with each request feature."""

    url: str
    """--url: the server's base URL."""
    served_model: str | None = None
    """--served-model: model name sent in the probe requests."""
    api_key: str | None = None
    """--api-key: bearer token for the server (also read from $DS4EVAL_API_KEY)."""

    def validate(self) -> None:
        check_url(self.url)


@dataclass(frozen=True)
class DataPullConfig(CommandConfig):
    """`ds4-eval data pull`: fetch the upstream case tables into the data dir."""

    data_url: str = DEFAULT_DATA_URL
    """--data-url: base URL the C case tables are fetched from."""
    data_dir: str | None = None
    """--data-dir: where the case files are written."""


DETERMINISM_CONDITIONS = ("alone", "mixed", "prefix", "shape")
DETERMINISM_FORMATS = ("text", "markdown", "json")


@dataclass(frozen=True)
class DeterminismConfig(CommandConfig):
    """`ds4-eval determinism`: does the stack give the same completion under every condition
    (ds4eval.determinism)?"""

    # --- the stack
    backend: str = "engine"
    """--backend: engine (in-process, the engine's batch scheduler) or openai (any endpoint)."""
    model: str | None = None
    """-m/--model: GGUF file for the engine backend (default: the embedded model)."""
    ctx: int | None = None
    """--ctx: the engine's context size."""
    device: str = "cpu"
    """--device for the engine backend."""
    threads: int | None = None
    """--threads: the engine's CPU threads."""
    kv_type: str | None = None
    """--kv-type: the engine's KV cache type."""
    batch_invariant: bool = False
    """--batch-invariant: the engine's batch-invariant mode (engine.invariant)."""
    slots: int | None = None
    """--slots: the engine's batched sessions (default: the largest --concurrency + 1)."""
    url: str | None = None
    """--url: the endpoint's base URL (openai backend)."""
    api_key: str | None = None
    """--api-key (also $DS4EVAL_API_KEY)."""
    served_model: str | None = None
    """--served-model: the model name sent (default: the first of /v1/models)."""
    request_timeout_s: float = 600.0
    """--request-timeout: seconds a request may take."""

    # --- the prompts
    suite: str | None = None
    """--suite: measure this suite's cases as `run` sends them (default: the project's own prompts)."""
    data_dir: str | None = None
    """--data-dir: where the suite's case files live."""
    prompts: int = 20
    """--prompts N: how many prompts (the first N)."""

    # --- the conditions
    conditions: tuple[str, ...] = DETERMINISM_CONDITIONS
    """--condition: the kinds to measure (repeatable; alone always runs, the others compare with it)."""
    repeats: int = 5
    """--repeats R: runs of each prompt alone."""
    concurrency: tuple[int, ...] = (1, 4, 8)
    """--concurrency C: other requests in flight in the mixed condition (repeatable)."""
    mixed_rounds: int = 1
    """--mixed-rounds: rounds of the mixed condition at each C, each with new companions."""
    max_tokens: int = 48
    """--max-tokens: tokens per completion."""
    temperature: float = 0.0
    """--temp: 0 is greedy; above 0 every request carries --seed."""
    seed: int = 0
    """--seed: the seed every request carries."""
    margin: float = 0.25
    """--margin NATS: a divergence whose top-2 gap is at most this is a near-tie."""

    # --- the verdict and its outputs
    expect: str | None = None
    """--expect invariant: exit 1 unless every condition is invariant."""
    format: str = "text"
    """--format: text, markdown or json on stdout."""
    output: str | None = None
    """-o/--output FILE: also write the JSON result there (what `compare --noise` reads)."""
    report: str | None = None
    """--report FILE: also write the report: HTML, or markdown when FILE ends in .md."""

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}")
        if self.backend == "openai" and not self.url:
            raise ConfigError("--backend openai needs --url")
        if self.backend == "engine" and self.url:
            raise ConfigError("--url is for --backend openai")
        check_url(self.url)
        if self.kv_type is not None and self.kv_type not in KV_TYPES:
            raise ConfigError(f"--kv-type must be one of {', '.join(KV_TYPES)}")
        if self.batch_invariant and self.backend != "engine":
            raise ConfigError("--batch-invariant applies to the engine backend")
        for flag, value, low in (("--prompts", self.prompts, 1), ("--repeats", self.repeats, 1),
                                 ("--mixed-rounds", self.mixed_rounds, 1), ("--max-tokens", self.max_tokens, 2)):
            if value < low:
                raise ConfigError(f"{flag} must be at least {low}")
        if self.slots is not None and self.slots < 1:
            raise ConfigError("--slots must be at least 1")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ConfigError("--concurrency must be at least 1")
        unknown = set(self.conditions) - set(DETERMINISM_CONDITIONS)
        if unknown or not self.conditions:
            raise ConfigError(f"--condition takes {', '.join(DETERMINISM_CONDITIONS)}")
        if self.temperature < 0:
            raise ConfigError("--temp must be at least 0")
        if self.margin < 0:
            raise ConfigError("--margin must be at least 0")
        if self.expect not in (None, "invariant"):
            raise ConfigError("--expect takes invariant")
        if self.format not in DETERMINISM_FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(DETERMINISM_FORMATS)}")
        if self.output is not None and not self.output:
            raise ConfigError("--output needs a file name")
        check_report_file(self.report)

    @property
    def engine_slots(self) -> int:
        """The engine's sessions: enough for the widest mixed group and a request beside it."""
        return self.slots or max(self.concurrency) + 1


def check_shard(shard: str | None) -> None:
    """ConfigError unless `shard` is None, "auto" or I/N with 0 <= I < N (auto is resolved at run time)."""
    if shard is not None and shard != "auto":
        try:
            parse_shard(shard)
        except ShardError as e:
            raise ConfigError(str(e)) from None


def check_url(url: str | None) -> None:
    """ConfigError unless `url` is None or an http(s) URL with a host."""
    if url is not None and not _looks_like_http_url(url):
        raise ConfigError(f"--url must be an http:// or https:// URL with a host, e.g. "
                          f"http://127.0.0.1:8000 (got {url!r})")


def check_alpha(alpha: float) -> None:
    """ConfigError unless `alpha` is a significance level strictly between 0 and 1."""
    if not 0 < alpha < 1:
        raise ConfigError("--alpha must be in (0, 1)")


def check_power(power: float) -> None:
    """ConfigError unless `power` is a probability strictly between 0 and 1."""
    if not 0 < power < 1:
        raise ConfigError("--power must be in (0, 1), e.g. 0.8")


def check_points(flag: str, points: float) -> None:
    """ConfigError unless `points` is a pass-rate change in percentage points, in (0, 100)."""
    if not 0 < points < 100:
        raise ConfigError(f"{flag} is in percentage points and must be in (0, 100), e.g. 5")


def check_report_file(report: str | None) -> None:
    """ConfigError when --report was given an empty file name."""
    if report is not None and not report:
        raise ConfigError("--report needs a file name")


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
