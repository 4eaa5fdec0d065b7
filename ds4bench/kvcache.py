"""`ds4-bench kvcache`: time to first token of a long prompt, cold versus restored after a restart.

The scenario is an agent resending a long prompt after `ds4-server` restarted. Everything
goes through the real server, over HTTP, like any client:
  1. start `ds4-server --kv-disk-dir DIR` (an empty directory) as a subprocess and wait
     for `/health`;
  2. size the prompt: a long system message of seeded pseudo-sentences plus a short
     question, grown until `/v1/messages/count_tokens` says it has about `prompt_tokens`
     tokens (not timed);
  3. cold: send it as a streaming chat completion (greedy, a few tokens) and time the first
     chunk that carries generated output (content, reasoning, a tool call, or the finish);
     the server prefills everything and writes its checkpoints as it goes;
  4. stop the server cleanly (SIGINT, as Ctrl-C does): it stores the live session and exits;
  5. unless `page_cache`, drop the checkpoint files from the page cache
     (`posix_fadvise(DONTNEED)`, Linux) so that the restored run reads them from disk;
  6. start the server again on the same directory and send the same request: the server
     restores the longest checkpoint and prefills only the rest. Its usage reports the
     cached tokens; its greedy output must equal the cold one.
The bar: cold / restored time to first token >= 5x.

CSV columns (one row per repetition):
  model, repeat, n_prompt (tokens, from the server's usage), n_cached (tokens the restored
  request did not recompute, `prompt_tokens_details.cached_tokens`), n_written (checkpoint
  tokens the cold request wrote, from `/health`), file_bytes (checkpoint files after the
  restart), start_s (first server start to healthy), stop_s (clean shutdown, including
  the shutdown save), restart_s (second start to healthy), cold_ttft_s, restored_ttft_s,
  ratio (cold / restored), same_output (1 when both replies are identical).

It does not import the server: it starts `ds4-server` as a command and speaks its public
HTTP API only. It does not parse flags beyond its own click command.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import click
from tabulate import tabulate

from ds4bench.csvfile import write_csv
from ds4bench.errors import RunFailure, UsageFailure

DEFAULT_PROMPT_TOKENS = 4096
BAR_RATIO = 5.0
REPLY_TOKENS = 8
CSV_COLUMNS = ("model", "repeat", "n_prompt", "n_cached", "n_written", "file_bytes", "start_s", "stop_s",
               "restart_s", "cold_ttft_s", "restored_ttft_s", "ratio", "same_output")
QUESTION = "Following the rules above, what should be checked first?"
_WORDS = ("request", "server", "cache", "token", "model", "answer", "check", "record", "value", "field", "always",
          "never", "before", "after", "each", "every", "output", "input", "report", "error", "return", "keep",
          "write", "read", "file", "line", "name", "number", "list", "order", "first", "last", "short", "long",
          "careful", "exact", "tool", "call", "result", "user")


class KVCacheBenchError(ValueError):
    """The benchmark settings cannot be used, or the server misbehaved; the message says why."""


@dataclass(frozen=True)
class KVCacheBenchConfig:
    """Settings of one `ds4-bench kvcache` run; each field is one command-line flag."""

    model: str | None = None  # GGUF path given to ds4-server --model; None: the embedded model
    ctx: int | None = None  # ds4-server --ctx; None: the model's own
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS  # approximate prompt length
    repeats: int = 1  # repetitions (each with an empty cache directory); the summary reports medians
    directory: str | None = None  # cache directory (empty or new); None: a temporary one, removed afterwards
    budget_mb: int = 4096  # ds4-server --kv-cache-budget-mb
    page_cache: bool = False  # keep checkpoint files in the page cache across the restart
    csv: str | None = None  # write one row per repetition here
    seed: int = 0  # seed of the prompt text
    server: str | None = None  # server command (split on spaces); None: this Python's `-m server.cli`
    startup_timeout_s: float = 300.0  # how long a server may take to load and answer /health

    def validate(self) -> None:
        if self.prompt_tokens < 64:
            raise KVCacheBenchError(f"--prompt-tokens must be at least 64, not {self.prompt_tokens}")
        if self.repeats < 1:
            raise KVCacheBenchError(f"--repeats must be at least 1, not {self.repeats}")
        if self.budget_mb < 1:
            raise KVCacheBenchError(f"--budget-mb must be at least 1, not {self.budget_mb}")
        if self.ctx is not None and self.ctx < self.prompt_tokens + 64:
            raise KVCacheBenchError(f"--ctx {self.ctx} is too small for a {self.prompt_tokens}-token prompt")
        if self.model is not None and not os.path.isfile(self.model):
            raise KVCacheBenchError(f"model file not found: {self.model}")
        if self.directory is not None and os.path.isdir(self.directory) and any(
                n.endswith(".kv") for n in os.listdir(self.directory)):
            raise KVCacheBenchError(f"--dir {self.directory} already holds .kv files; give an empty or new "
                                    "directory (the benchmark clears its checkpoints between repetitions)")

    def server_command(self) -> list[str]:
        return self.server.split() if self.server else [sys.executable, "-m", "server.cli"]


@dataclass(frozen=True)
class Repetition:
    repeat: int
    n_prompt: int
    n_cached: int
    n_written: int
    file_bytes: int
    start_s: float
    stop_s: float
    restart_s: float
    cold_ttft_s: float
    restored_ttft_s: float
    same_output: bool

    @property
    def ratio(self) -> float:
        return self.cold_ttft_s / self.restored_ttft_s if self.restored_ttft_s > 0 else float("inf")


@dataclass(frozen=True)
class KVCacheBenchResult:
    model: str
    repetitions: tuple[Repetition, ...] = field(default_factory=tuple)

    @property
    def cold_ttft_s(self) -> float:
        return statistics.median(r.cold_ttft_s for r in self.repetitions)

    @property
    def restored_ttft_s(self) -> float:
        return statistics.median(r.restored_ttft_s for r in self.repetitions)

    @property
    def ratio(self) -> float:
        return self.cold_ttft_s / self.restored_ttft_s if self.restored_ttft_s > 0 else float("inf")

    @property
    def bar_met(self) -> bool:
        return self.ratio >= BAR_RATIO and all(r.same_output and r.n_cached > 0 for r in self.repetitions)

    def csv_rows(self) -> list[dict[str, object]]:
        return [{"model": self.model, "repeat": r.repeat, "n_prompt": r.n_prompt, "n_cached": r.n_cached,
                 "n_written": r.n_written, "file_bytes": r.file_bytes, "start_s": f"{r.start_s:.3f}",
                 "stop_s": f"{r.stop_s:.3f}", "restart_s": f"{r.restart_s:.3f}",
                 "cold_ttft_s": f"{r.cold_ttft_s:.6f}", "restored_ttft_s": f"{r.restored_ttft_s:.6f}",
                 "ratio": f"{r.ratio:.3f}", "same_output": int(r.same_output)}
                for r in self.repetitions]


# --- the prompt (pure) -------------------------------------------------------------------------

def system_text(n_words: int, seed: int) -> str:
    """Seeded pseudo-sentences of about `n_words` words, one numbered rule per line."""
    rng = random.Random(seed)
    lines, words, i = [], 0, 1
    while words < n_words:
        k = rng.randint(8, 16)
        lines.append(f"Rule {i}: " + " ".join(rng.choice(_WORDS) for _ in range(k)) + ".")
        words += k + 2
        i += 1
    return "\n".join(lines)


def size_prompt(count: Callable[[str], int], n_tokens: int, seed: int,
                tolerance: float = 0.05) -> tuple[str, int]:
    """(system text, token count) of a prompt with n_tokens to n_tokens * (1 + tolerance) tokens.

    `count(system)` is the token count of the whole rendered request with that system text.
    The word count is rescaled by the measured tokens per word until it lands in the window;
    when it never does, the shortest prompt tried that is long enough is returned.
    """
    n_words = max(8, n_tokens // 2)
    best: tuple[str, int] | None = None
    for _ in range(24):
        if n_words > 4 * n_tokens:  # no tokenizer packs four words into one token: the count is broken
            break
        system = system_text(n_words, seed)
        n = count(system)
        if n >= n_tokens and (best is None or n < best[1]):
            best = (system, n)
        if n_tokens <= n <= n_tokens * (1 + tolerance):
            return system, n
        # At most 4x per step: a counter that does not grow with the text must not blow up memory.
        scale = min(4.0, n_tokens * (1 + tolerance / 2) / max(1, n))
        n_words = max(8, int(n_words * scale) + (1 if n < n_tokens else -1))
    if best is None:
        raise KVCacheBenchError(f"could not build a prompt of {n_tokens} tokens")
    return best


def chat_body(system: str, max_tokens: int = REPLY_TOKENS) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def parse_sse_lines(lines: Sequence[str]) -> list[dict]:
    """The JSON objects of `data:` lines up to `[DONE]` (comments and blank lines skipped)."""
    out = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        out.append(json.loads(data))
    return out


def _is_output(chunk: dict) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") \
                or choice.get("finish_reason"):
            return True
    return False


# --- the server process ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `ds4-server` subprocess on a free loopback port; its log goes to a file."""

    def __init__(self, cfg: KVCacheBenchConfig, directory: str, log_path: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = cfg.server_command() + ["--port", str(self.port), "--kv-disk-dir", directory,
                                      "--kv-cache-budget-mb", str(cfg.budget_mb), "--log-level", "warning"]
        if cfg.model is not None:
            cmd += ["--model", os.path.abspath(cfg.model)]
        if cfg.ctx is not None:
            cmd += ["--ctx", str(cfg.ctx)]
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log_tail(self, n: int = 5) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def wait_healthy(self, timeout: float) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise KVCacheBenchError(f"ds4-server exited with status {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.base + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise KVCacheBenchError(f"ds4-server did not answer /health within {timeout:.0f} s")

    def stop(self, timeout: float = 180.0) -> float:
        """SIGINT (a clean shutdown that stores the live session), then wait; seconds taken."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise KVCacheBenchError(f"ds4-server did not stop within {timeout:.0f} s") from None
        self._log.close()
        return time.perf_counter() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def count_tokens(base: str, system: str) -> int:
    import httpx

    body = {"system": system, "messages": [{"role": "user", "content": QUESTION}]}
    r = httpx.post(base + "/v1/messages/count_tokens", json=body, timeout=60.0)
    if r.status_code != 200:
        raise KVCacheBenchError(f"count_tokens answered {r.status_code}: {r.text[:200]}")
    return int(r.json()["input_tokens"])


def timed_request(base: str, system: str) -> tuple[float, str, dict]:
    """(time to the first output chunk, reply text, usage) of one streamed chat completion."""
    import httpx

    t0 = time.perf_counter()
    ttft: float | None = None
    lines: list[str] = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=chat_body(system), timeout=600.0) as r:
        if r.status_code != 200:
            raise KVCacheBenchError(f"chat completion answered {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            lines.append(line)
            if ttft is None and line.startswith("data:") and line[5:].strip() != "[DONE]" \
                    and _is_output(json.loads(line[5:])):
                ttft = time.perf_counter() - t0
    chunks = parse_sse_lines(lines)
    if ttft is None or not chunks or "usage" not in chunks[-1] or chunks[-1]["usage"] is None:
        raise KVCacheBenchError("the stream ended without output or usage")
    text = "".join((c.get("delta") or {}).get("content") or "" for ch in chunks for c in ch.get("choices") or [])
    return ttft, text, chunks[-1]["usage"]


def _health_kv(base: str) -> dict:
    import httpx

    kv = httpx.get(base + "/health", timeout=10.0).json().get("kv_cache")
    if kv is None:
        raise KVCacheBenchError("the server reports no disk KV cache (/health kv_cache is null)")
    return kv


def _drop_page_cache(directory: str) -> None:
    if not hasattr(os, "posix_fadvise"):
        return
    for name in os.listdir(directory):
        if name.endswith(".kv"):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _kv_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory) if n.endswith(".kv"))


# --- one repetition ----------------------------------------------------------------------------

def run_repetition(cfg: KVCacheBenchConfig, directory: str, repeat: int,
                   report: Callable[[str], None] = lambda _line: None) -> Repetition:
    for name in os.listdir(directory):
        if name.endswith(".kv"):
            os.unlink(os.path.join(directory, name))
    log_path = os.path.join(directory, f"server-{repeat}.log")

    # 1-3. a fresh server, an empty cache, the cold request
    server = ServerProcess(cfg, directory, log_path)
    try:
        start_s = server.wait_healthy(cfg.startup_timeout_s)
        system, n = size_prompt(lambda s: count_tokens(server.base, s), cfg.prompt_tokens, cfg.seed)
        cold_s, cold_text, cold_usage = timed_request(server.base, system)
        n_written = int(_health_kv(server.base).get("tokens_written", 0))
    except BaseException:
        server.kill()
        raise
    report(f"repeat {repeat}: cold {cold_usage['prompt_tokens']} tokens, first token after {cold_s:.3f} s "
           f"(server up in {start_s:.1f} s; {n_written} tokens written to the cache)")

    # 4-5. a clean stop, then the checkpoints leave the page cache
    stop_s = server.stop()
    if server.proc.returncode not in (0, -signal.SIGINT, 128 + signal.SIGINT, 1):
        raise KVCacheBenchError(f"ds4-server stopped with status {server.proc.returncode}: {server.log_tail()}")
    if not cfg.page_cache:
        _drop_page_cache(directory)

    # 6. the restart and the same request
    server = ServerProcess(cfg, directory, log_path)
    try:
        restart_s = server.wait_healthy(cfg.startup_timeout_s)
        warm_s, warm_text, warm_usage = timed_request(server.base, system)
    finally:
        server.stop()
    n_cached = int((warm_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    report(f"repeat {repeat}: restored {n_cached} of {warm_usage['prompt_tokens']} tokens, first token after "
           f"{warm_s:.3f} s ({cold_s / warm_s:.1f}x faster)")
    return Repetition(repeat, int(cold_usage["prompt_tokens"]), n_cached, n_written, _kv_bytes(directory),
                      start_s, stop_s, restart_s, cold_s, warm_s, warm_text == cold_text)


def run_kvcache_bench(cfg: KVCacheBenchConfig, report: Callable[[str], None] = lambda _line: None
                      ) -> KVCacheBenchResult:
    """Run every repetition; raises KVCacheBenchError for bad settings or a failing server."""
    cfg.validate()
    directory = cfg.directory or tempfile.mkdtemp(prefix="ds4-kvbench-")
    os.makedirs(directory, exist_ok=True)
    try:
        reps = [run_repetition(cfg, directory, r, report) for r in range(cfg.repeats)]
        label = os.path.basename(cfg.model) if cfg.model else "embedded model"
        return KVCacheBenchResult(label, tuple(reps))
    finally:
        if cfg.directory is None:
            shutil.rmtree(directory, ignore_errors=True)


# --- output ------------------------------------------------------------------------------------

def render_summary(result: KVCacheBenchResult) -> str:
    reps = result.repetitions
    med = statistics.median
    rows = [
        ["prompt tokens", str(reps[0].n_prompt)],
        ["restored (cached) tokens", str(reps[0].n_cached)],
        ["checkpoint files", f"{reps[0].file_bytes / (1 << 20):.1f} MiB"],
        ["server start", f"{med([r.start_s for r in reps]):.2f} s"],
        ["cold: time to first token", f"{result.cold_ttft_s:.3f} s"],
        ["clean stop (with shutdown save)", f"{med([r.stop_s for r in reps]):.2f} s"],
        ["restart", f"{med([r.restart_s for r in reps]):.2f} s"],
        ["restored: time to first token", f"{result.restored_ttft_s:.3f} s"],
        ["cold / restored", f"{result.ratio:.2f}x"],
        ["same greedy reply", "yes" if all(r.same_output for r in reps) else "NO"],
    ]
    head = f"{result.model}, {len(reps)} repetition(s), medians"
    return head + "\n" + tabulate(rows, tablefmt="simple", disable_numparse=True)


def bar_line(result: KVCacheBenchResult) -> str:
    return (f"{'PASS' if result.bar_met else 'FAIL'}  restored time to first token: {result.ratio:.2f}x faster "
            f"than cold (bar >= {BAR_RATIO:g}x, same reply)")


# --- command line ------------------------------------------------------------------------------

@click.command("kvcache")
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF file for ds4-server (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--ctx", type=int, default=None, help="ds4-server --ctx (default: the model's).")
@click.option("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, show_default=True,
              help="Approximate prompt length in tokens.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Repetitions; the summary shows medians.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Cache directory, empty or new (default: a temporary one, removed afterwards).")
@click.option("--budget-mb", type=int, default=4096, show_default=True, help="ds4-server --kv-cache-budget-mb.")
@click.option("--page-cache", is_flag=True, help="Let the restarted server read checkpoints from the page cache.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write one row per repetition (columns: see ds4bench/kvcache.py).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompt text.")
@click.option("--server", "server_cmd", default=None,
              help="Server command, e.g. 'ds4-server' (default: this Python's '-m server.cli').")
def kvcache_command(model: str | None, ctx: int | None, prompt_tokens: int, repeats: int, directory: str | None,
                    budget_mb: int, page_cache: bool, csv_path: str | None, seed: int, server_cmd: str | None) -> int:
    """Time to first token of a long prompt through ds4-server: cold versus restored after a restart."""
    cfg = KVCacheBenchConfig(model=model, ctx=ctx, prompt_tokens=prompt_tokens, repeats=repeats,
                             directory=directory, budget_mb=budget_mb, page_cache=page_cache, csv=csv_path,
                             seed=seed, server=server_cmd)
    try:
        cfg.validate()
        if cfg.csv and not os.path.isdir(os.path.dirname(os.path.abspath(cfg.csv))):
            raise KVCacheBenchError(f"--csv {cfg.csv}: its directory does not exist")
    except KVCacheBenchError as e:
        raise UsageFailure(str(e)) from None
    try:
        result = run_kvcache_bench(cfg, report=lambda line: click.echo(line, err=True))
    except KVCacheBenchError as e:
        raise RunFailure(str(e)) from None
    except OSError as e:
        raise RunFailure(f"{type(e).__name__}: {e}") from None
    click.echo(render_summary(result))
    click.echo()
    click.echo(bar_line(result))
    if cfg.csv:
        try:
            write_csv(cfg.csv, CSV_COLUMNS, result.csv_rows())
        except OSError as e:
            raise RunFailure(f"cannot write {cfg.csv}: {e.strerror or e}") from None
        click.echo(f"wrote {len(result.repetitions)} rows to {cfg.csv}", err=True)
    return 0
