"""Configuration of ds4-server: one dataclass, one field per command-line flag.

`ServerConfig` is plain data. `server.cli` fills it from flags; `server.app.create_app`
and `server.worker.InferenceWorker` read it. The tool-calling flags (`--tool-syntax`,
`--tool-memory-max-ids`, `--disable-exact-tool-replay`) live in the embedded
`server.tools.ToolsConfig` record, one field each; the disk KV cache flags (`--kv-disk-dir`,
`--kv-cache-budget-mb`, `--kv-min-free-mb`) in the embedded `server.kvstore.KVStoreConfig` record.

The security rules that concern flags alone are checked here: a bind address that is not
loopback needs `--api-key` (or `--insecure-no-auth`), and `--cors '*'` needs an API key.
The API key is kept out of the record's repr. It does not load models, bind sockets or touch
the file system (`--chdir` is applied by the CLI before
anything else runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.guard import LOOPBACK_HOSTS, is_loopback, normalize_host
from server.apibase import DEFAULT_MAX_TOKENS, RequestDefaults
from server.jobs import DEFAULT_MAX_REQUEST_SCORED_TOKENS, DEFAULT_MAX_REQUEST_TOKENS, WorkLimits
from server.kvstore import KVStoreConfig
from server.serial import DEFAULT_MAX_LIVE
from server.tools import ToolsConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None
    """GGUF file to serve; None serves the embedded model."""
    ctx: int | None = None
    """Context size in tokens; None uses the model's training context."""
    host: str = "127.0.0.1"
    """Bind address. Loopback by default; 0.0.0.0 opens the server to the network."""
    port: int = 8000
    """TCP port to listen on."""
    cors: tuple[str, ...] = ()
    """--cors ORIGIN (repeatable): origins whose pages may call the server (Access-Control-Allow-*
    headers, OPTIONS preflights). `*` (also a bare --cors) allows any origin and needs an API key."""
    chdir: str | None = None
    """Directory that relative paths (such as --model) are resolved from."""
    device: str = "cpu"
    """Torch device the engine runs on (cpu, cuda, cuda:1, ...)."""
    keepalive_sec: float = 5.0
    """Interval of `: prefill` SSE comments while a streamed request waits for its first token."""
    stream_interval_ms: float = 25.0
    """Text generated within this many milliseconds of the last piece passed to the HTTP loop
    waits and goes out with the next token (server.jobs.CoalescingSink); 0: every token at once.
    Each piece handed over costs the engine thread time (the HTTP loop takes the GIL and a
    core), so fewer pieces keep a fast model's stream near the engine's own speed."""
    max_body_mb: float = 64.0
    """Largest accepted request body in MiB; larger bodies get 413."""
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    """Tokens generated for a request that sets no limit (Chat Completions, Completions, Responses),
    never more than the room left in the context; 0: the room left."""
    log_level: str = "info"
    """Logging level for the server and uvicorn."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """Tool-call syntax (None: detected from the model) and exact replay memory bounds."""
    kv: KVStoreConfig = field(default_factory=KVStoreConfig)
    """Disk KV cache directory (None: no disk cache) and its size budget."""
    batched_session: int = 1
    """Resident engine sessions decoded together (1: one job at a time; a request's choices and
    prompts take turns with other requests' jobs either way)."""
    step_log: str | None = None
    """--step-log FILE: with --batched-session N (N >= 2), a JSON line per step of the batched loop
    written there as the server runs (server.steplog): its time, rows, prefill tokens, and the
    jobs admitted, waiting and parked."""
    interleave: int = DEFAULT_MAX_LIVE
    """--interleave: jobs of different requests in progress at once in the serial loop (each in a
    session of its own, their tokens interleaved fairly, `server.serial`); 1: one job at a time."""
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    """--max-request-tokens: tokens one request may ask to generate over all its choices
    (choices x max_tokens, each at most the room its prompt leaves in the context); beyond it: 400."""
    max_request_scored_tokens: int = DEFAULT_MAX_REQUEST_SCORED_TOKENS
    """--max-request-scored-tokens: prompt tokens one request may ask to score (prompts x prompt
    length, `echo` with `logprobs`); beyond it: 400."""
    threads: int | None = None
    """--threads: CPU threads of the engine's kernels; None uses the cores that other processes leave
    free, re-read every half second (engine/threads.py)."""
    kv_type: str | None = None
    """KV cache element type: f32, f16 or bf16; None: the engine's default (f16 on CPU, bf16 on CUDA)."""
    batch_invariant: bool = False
    """--batch-invariant: every token through one row's decoding step (engine.invariant), so that
    an answer does not depend on the other requests, prefill chunks or cached prefixes, at the
    cost of the batch's parallelism."""
    warmup: bool = True
    """Meet the device's first uses (CUDA graph captures, kernel compiles) for every batch size up
    to `batched_session` before listening (engine.warmup), not in the first requests; --no-warmup
    leaves them there."""
    header_timeout_sec: float = 10.0
    """Seconds a connection has to send complete request headers (from its opening, or from the
    first byte of a later request on it); slower ones get 408, idle ones are closed."""
    body_timeout_sec: float = 60.0
    """Seconds a JSON request body has to arrive in full once its headers are in; slower: 408."""
    max_connections: int = 512
    """Open HTTP connections at most; a connection beyond them is answered 503 at once and closed."""
    api_key: str | None = field(default=None, repr=False)
    """--api-key (or DS4_API_KEY): required as `Authorization: Bearer` or `x-api-key` on every path
    but /health. None: no key (only allowed on loopback binds without --insecure-no-auth)."""
    insecure_no_auth: bool = False
    """Allow a bind address that is not loopback without an API key."""
    allowed_hosts: tuple[str, ...] = ()
    """--allowed-host NAME (repeatable): Host header names accepted besides localhost, 127.0.0.1
    and ::1. The Host check is on for loopback binds, and for other binds once a name is given."""
    verbose_paths: bool = False
    """Show absolute local paths in /v1/models and /health (default: file names only)."""

    def __post_init__(self) -> None:
        if self.keepalive_sec <= 0:
            raise ValueError(f"keepalive_sec must be positive, got {self.keepalive_sec}")
        if not 0 <= self.stream_interval_ms <= 1000:
            raise ValueError(f"stream_interval_ms must be in 0..1000, got {self.stream_interval_ms}")
        if self.interleave < 1:
            raise ValueError(f"interleave must be at least 1, got {self.interleave}")
        if self.max_body_mb <= 0:
            raise ValueError(f"max_body_mb must be positive, got {self.max_body_mb}")
        self.request_defaults  # validates its fields
        if self.ctx is not None and self.ctx < 16:
            raise ValueError(f"ctx must be at least 16 tokens, got {self.ctx}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.kv.budget_mb < 1:
            raise ValueError(f"kv_cache_budget_mb must be at least 1, got {self.kv.budget_mb}")
        self.work_limits  # validates its fields
        if self.batched_session < 1:
            raise ValueError(f"batched_session must be at least 1, got {self.batched_session}")
        if self.step_log is not None and self.batched_session < 2:
            raise ValueError("--step-log records the batched loop's steps: it needs --batched-session N, N >= 2")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.header_timeout_sec <= 0 or self.body_timeout_sec <= 0:
            raise ValueError("header_timeout_sec and body_timeout_sec must be positive, got "
                             f"{self.header_timeout_sec} and {self.body_timeout_sec}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if self.api_key is not None and (not self.api_key.strip() or self.api_key != self.api_key.strip()):
            raise ValueError("the API key must not be empty or begin or end with spaces")
        if self.api_key is None and not self.insecure_no_auth and not is_loopback(self.host):
            raise ValueError(f"--host {self.host} accepts connections from other machines: give --api-key KEY "
                             "(or DS4_API_KEY), or --insecure-no-auth to serve without one")
        for origin in self.cors:
            if origin != "*" and ("://" not in origin or origin.rstrip("/").count("/") > 2):
                raise ValueError(f"--cors {origin!r}: give an origin such as http://localhost:3000 (or '*')")
        if "*" in self.cors and self.api_key is None:
            raise ValueError("--cors '*' lets every web page call the server: it needs --api-key; "
                             "or name the origins (--cors http://localhost:3000)")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def request_defaults(self) -> RequestDefaults:
        return RequestDefaults(max_tokens=self.max_tokens_default)

    @property
    def work_limits(self) -> WorkLimits:
        return WorkLimits(generated_tokens=self.max_request_tokens, scored_tokens=self.max_request_scored_tokens)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def host_allow_list(self) -> frozenset[str] | None:
        """Host header names accepted, or None when Host is not checked (a non-loopback bind
        without --allowed-host)."""
        if not self.allowed_hosts and not is_loopback(self.host):
            return None
        return frozenset(normalize_host(h) for h in (*LOOPBACK_HOSTS, *self.allowed_hosts))

    @property
    def cors_origins(self) -> tuple[str, ...]:
        return tuple(o if o == "*" else o.rstrip("/") for o in self.cors)
