"""`ds4-server`: parse flags into a `ServerConfig`, load the model, print a banner, serve.

    ds4-server                          # embedded model on http://127.0.0.1:8000
    ds4-server --model m.gguf --ctx 4096 --host 0.0.0.0 --port 9000 --api-key "$KEY"
    ds4-server --cors http://localhost:3000 --kv-disk-dir ~/.cache/ds4-kv --batched-session 4

The socket is bound before the model loads (a port in use fails at once) and listens once the
model is warmed up for up to `--batched-session` rows (on CUDA: its graphs captured, engine.warmup)
and the app is built; "listening on" is printed then (`--port 0` prints the port the system chose).
Bad flags, a port in use and model loading failures end with a one-line error and exit status
1 or 2; no traceback. The server itself lives in `server.app`, the connection limits in
`server.edge`.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

import click

from server.apibase import DEFAULT_MAX_TOKENS
from server.config import LOG_LEVELS, ServerConfig
from server.heap import limit_arenas
from server.kvstore import DEFAULT_BUDGET_MB, DEFAULT_MIN_FREE_MB, KVStoreConfig, claim_directory
from server.prompting import model_syntax
from server.steplog import StepLogError, check_step_log_path
from server.tools import SYNTAXES, ToolsConfig


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):,.1f} MiB"


TOOL_FLAGS = ("tool_syntax", "tool_memory_max_ids", "disable_exact_tool_replay")
KV_FLAGS = {"kv_disk_dir": "directory", "kv_cache_budget_mb": "budget_mb",
            "kv_min_free_mb": "min_free_mb"}  # flag -> KVStoreConfig field


def config_from_flags(**flags: object) -> ServerConfig:
    try:
        tools = ToolsConfig(**{k: flags.pop(k) for k in TOOL_FLAGS if k in flags})  # type: ignore[arg-type]
        kv = KVStoreConfig(**{field: flags.pop(flag) for flag, field in KV_FLAGS.items()  # type: ignore[arg-type]
                              if flag in flags})
        return ServerConfig(**flags, tools=tools, kv=kv)  # type: ignore[arg-type]
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def access_line(config: ServerConfig) -> str:
    key = "API key required (except /health)" if config.api_key is not None else "no API key"
    hosts = config.host_allow_list
    checked = f"Host must be one of {', '.join(sorted(hosts))}" if hosts is not None else "any Host"
    return f"ds4-server: access: {key}; {checked}"


def banner(model: object, config: ServerConfig, port: int | None = None, warmed: object = None) -> str:
    """The start-up lines; `warmed`: `Model.warm_up`'s report, shown where it ran (CUDA)."""
    n_ctx = model.n_ctx  # type: ignore[attr-defined]
    weights = int(getattr(model, "weight_bytes", 0))
    try:
        total = int(model.memory_bytes(config.batched_session, n_ctx))  # type: ignore[attr-defined]
    except Exception:
        total = weights + int(getattr(model, "kv_bytes_per_token", 0)) * n_ctx * config.batched_session
    host = f"[{config.host}]" if ":" in config.host else config.host
    lines = [
        f"ds4-server: model {model.name} ({getattr(model, 'path', '')})",  # type: ignore[attr-defined]
        f"ds4-server: device {config.device}, context {n_ctx} tokens"
        + (f", CPU threads {config.threads}" if config.threads is not None else ", CPU threads auto")
        + (f", decode attention: {model.net.attention_path}" if hasattr(model, "net") else ""),  # type: ignore[attr-defined]
        *([f"ds4-server: CPU kernels {model.net.kernel_path}"]  # type: ignore[attr-defined]
          if getattr(getattr(model, "net", None), "cpu_kernels", None) is not None else []),
        f"ds4-server: tool syntax {model_syntax(model, config.tools.tool_syntax).name}, exact tool replay "
        + ("off" if config.tools.disable_exact_tool_replay else f"on (up to {config.tools.tool_memory_max_ids} ids)"),
        f"ds4-server: memory {_mib(total)} (weights {_mib(weights)}, KV cache {_mib(total - weights)}"
        + (f" {str(model.kv_dtype).removeprefix('torch.')})" if hasattr(model, "kv_dtype") else ")"),  # type: ignore[attr-defined]
        f"ds4-server: batched sessions {config.batched_session}, disk KV cache "
        + (f"{config.kv.directory} (budget {config.kv.budget_mb} MiB)" if config.kv.directory else "off"),
        *([f"ds4-server: {warmed.describe()}"]  # type: ignore[attr-defined]
          if warmed is not None and warmed.plan is not None else []),  # type: ignore[attr-defined]
        access_line(config),
        f"ds4-server: listening on http://{host}:{config.port if port is None else port}"
        + (f" (CORS: {', '.join(config.cors_origins)})" if config.cors else ""),
    ]
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        lines.append(f"ds4-server: note: bound to {config.host}, reachable from other machines")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "-m", default=None, help="GGUF model file (default: the embedded model).")
@click.option("--ctx", type=int, default=None, help="Context size in tokens (default: the model's).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Bind address; 0.0.0.0 listens on all interfaces.")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port.")
@click.option("--cors", multiple=True, is_flag=False, flag_value="*", default=(), metavar="ORIGIN",
              help="Let web pages of ORIGIN (e.g. http://localhost:3000; repeatable) call the server: "
                   "Access-Control-Allow-* headers and preflights. A bare --cors or '*' means any origin "
                   "and needs --api-key.")
@click.option("--api-key", envvar="DS4_API_KEY", default=None, show_envvar=True,
              help="Require this key as 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every path "
                   "but /health. Needed when --host is not a loopback address.")
@click.option("--insecure-no-auth", is_flag=True, default=False,
              help="Serve a non-loopback --host without an API key.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, default=(), metavar="NAME",
              help="Accept this Host header name besides localhost, 127.0.0.1 and ::1 (repeatable); "
                   "other names get 403.")
@click.option("--max-connections", type=int, default=ServerConfig.max_connections, show_default=True,
              help="Open HTTP connections at most; one beyond them is answered 503 and closed.")
@click.option("--header-timeout-sec", type=float, default=ServerConfig.header_timeout_sec, show_default=True,
              help="Seconds a connection has to send its request headers (slower: 408).")
@click.option("--body-timeout-sec", type=float, default=ServerConfig.body_timeout_sec, show_default=True,
              help="Seconds a request body has to arrive in full (slower: 408).")
@click.option("--verbose-paths", is_flag=True, default=False,
              help="Show absolute local paths in /v1/models and /health (default: file names).")
@click.option("--chdir", type=click.Path(file_okay=False), default=None,
              help="Resolve relative paths from this directory.")
@click.option("--device", default="cpu", show_default=True, help="Torch device: cpu, cuda, cuda:1 ...")
@click.option("--keepalive-sec", type=float, default=5.0, show_default=True,
              help="Seconds between ': prefill' SSE comments while waiting for the first token.")
@click.option("--stream-interval-ms", type=float, default=ServerConfig.stream_interval_ms, show_default=True,
              help="Text made within this many ms of the last piece sent waits for the next token "
                   "(fewer wakeups of the HTTP loop for fast models); 0: every token at once.")
@click.option("--max-body-mb", type=float, default=64.0, show_default=True,
              help="Largest request body in MiB (larger: HTTP 413).")
@click.option("--max-tokens-default", type=int, default=DEFAULT_MAX_TOKENS, show_default=True,
              help="Tokens generated for a request that sets no max_tokens / max_completion_tokens / "
                   "max_output_tokens, at most the room left in the context; 0: the room left.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
@click.option("--tool-syntax", type=click.Choice(sorted(SYNTAXES)), default=None,
              help="Tool-call syntax of the model (default: detected from its chat template and name).")
@click.option("--tool-memory-max-ids", type=int, default=ToolsConfig.tool_memory_max_ids, show_default=True,
              help="Tool-call ids whose exact generated text is kept for replay.")
@click.option("--disable-exact-tool-replay", is_flag=True, default=False,
              help="Re-render earlier tool calls canonically instead of replaying the exact text.")
@click.option("--kv-disk-dir", type=click.Path(file_okay=False), default=None,
              help="Directory of the disk KV cache (prefix checkpoints kept across restarts); off when unset. "
                   "One server per directory: a second one refuses to start.")
@click.option("--kv-cache-budget-mb", type=int, default=DEFAULT_BUDGET_MB, show_default=True,
              help="Size budget of the disk KV cache in MiB; the least useful entries are evicted beyond it.")
@click.option("--kv-min-free-mb", type=int, default=DEFAULT_MIN_FREE_MB, show_default=True,
              help="Free space in MiB that the disk KV cache leaves on its filesystem: entries are evicted "
                   "to keep it, and a save that cannot keep it is skipped.")
@click.option("--batched-session", type=int, default=1, show_default=True,
              help="Resident sessions decoded together in one batch; requests beyond them wait for a slot.")
@click.option("--step-log", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="With --batched-session N: write a JSON line per step of the batched loop to FILE as the "
                   "server runs (its time, rows, prefill tokens; the jobs admitted, waiting and parked).")
@click.option("--interleave", type=int, default=ServerConfig.interleave, show_default=True,
              help="Without --batched-session: jobs of different requests in progress at once, each in a "
                   "session of its own, their tokens interleaved fairly; 1: one job at a time.")
@click.option("--max-request-tokens", type=int, default=ServerConfig.max_request_tokens, show_default=True,
              help="Tokens one request may ask to generate over all its choices (n x max_tokens); "
                   "beyond it: HTTP 400 before it is queued.")
@click.option("--max-request-scored-tokens", type=int, default=ServerConfig.max_request_scored_tokens,
              show_default=True,
              help="Prompt tokens one request may ask to score (prompts x prompt length, echo with "
                   "logprobs); beyond it: HTTP 400 before it is queued.")
@click.option("--threads", type=int, default=None,
              help="CPU threads of the engine's kernels (default: the cores that other processes leave "
                   "free, re-read every half second).")
@click.option("--kv-type", type=click.Choice(["f32", "f16", "bf16"]), default=None,
              help="KV cache element type (default: f16 on CPU, bf16 on CUDA). f32 doubles the cache's "
                   "memory and slows long-context decoding, for logits free of the cache's rounding.")
@click.option("--batch-invariant", is_flag=True, default=False,
              help="Run every token through one row's decoding step, so that answers do not depend on "
                   "other requests, prefill chunks or cached prefixes (CUDA needs it; it costs the batch's "
                   "parallelism: docs/measurements.md, Determinism).")
@click.option("--no-warmup", "warmup", is_flag=True, flag_value=False, default=True,
              help="Leave CUDA graph captures and kernel compiles to the first requests that meet them "
                   "(default: met for every batch size before the server listens).")
def main(**flags: object) -> None:
    """Serve the engine over OpenAI, Anthropic and Responses HTTP APIs."""
    config = config_from_flags(**flags)
    # Before any thread exists: each one that allocates would otherwise get an arena of its own.
    limit_arenas()
    if config.chdir is not None:
        try:
            os.chdir(config.chdir)
        except OSError as e:
            raise click.ClickException(f"--chdir {config.chdir}: {e.strerror}") from None
    logging.basicConfig(level=logging.DEBUG if config.log_level == "trace" else config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from server.edge import bind_listener, ensure_fd_budget

    try:
        ensure_fd_budget(config.max_connections)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    # Bound before the model loads, so that a port in use fails in a second, not after loading.
    try:
        sock = bind_listener(config.host, config.port)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
    try:
        _serve(config, sock)
    finally:
        sock.close()


def _serve(config: ServerConfig, sock: socket.socket) -> None:
    from engine import ModelLoadError, load_model
    from engine.batch import CapacityError
    from engine.threads import EngineThread
    from server.app import create_app
    from server.edge import DrainingServer, EdgeLimits, listen, uvicorn_config

    # Claimed before the model loads, so that a second server on the directory fails in a
    # second; held while the server runs (the store shares this process's claim).
    kv_claim = None
    if config.kv.directory is not None:
        try:
            os.makedirs(config.kv.directory, mode=0o700, exist_ok=True)
            kv_claim = claim_directory(config.kv.directory)
        except OSError as e:
            raise click.ClickException(f"--kv-disk-dir {config.kv.directory}: {e.strerror or e}") from None
    if config.step_log is not None:  # a bad path fails now, not after the model has loaded
        try:
            check_step_log_path(config.step_log)
        except StepLogError as e:
            raise click.ClickException(str(e)) from None
    # Every torch call of the server, from loading the model on, runs on this one thread.
    engine_thread = EngineThread("ds4-inference", threads=config.threads)
    model_path = os.path.abspath(config.model) if config.model else None
    try:
        model = engine_thread.call(load_model, model_path, ctx=config.ctx, device=config.device,
                                   kv_type=config.kv_type, batch_invariant=config.batch_invariant)
    except (ModelLoadError, OSError, ValueError) as e:
        raise click.ClickException(f"cannot load model: {e}") from None
    # The grammars' vocabulary (about 0.6 s of Python for 49k tokens), built now rather than by
    # the first requests with a schema or forced tool calls, which would hold the interpreter
    # lock meanwhile and stall every other request.
    from server.constraints import grammar_tokenizer
    try:
        grammar_tokenizer(model)
    except Exception as e:  # the first request that needs it then meets the same error, as before
        logging.getLogger("ds4.server").warning("grammar vocabulary not built: %s: %s", type(e).__name__, e)
    try:
        warmed = engine_thread.call(model.warm_up, config.batched_session) if config.warmup else None
    except (RuntimeError, ValueError) as e:  # e.g. the device's memory: the first requests would fail alike
        raise click.ClickException(f"cannot warm the model up (--no-warmup skips it): {e}") from None
    try:
        app = create_app(model, config, engine_thread=engine_thread)
    except CapacityError as e:
        raise click.ClickException(f"--batched-session {config.batched_session}: {e}") from None
    except StepLogError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"--kv-disk-dir {config.kv.directory}: {e}") from None
    try:
        listen(sock)
    except OSError as e:  # another process bound the same port meanwhile and listens on it
        raise click.ClickException(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
    click.echo(banner(model, config, port=sock.getsockname()[1], warmed=warmed), err=True)
    limits = EdgeLimits(header_timeout_s=config.header_timeout_sec, max_connections=config.max_connections)
    try:
        # The work in flight is cancelled as the exit begins: its requests are answered 503.
        DrainingServer(uvicorn_config(app, limits, log_level=config.log_level),
                       on_exit=app.state.worker.cancel_all).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on; the shutdown was clean
        pass
    finally:
        engine_thread.close(timeout=5)
        if kv_claim is not None:
            kv_claim.release()


if __name__ == "__main__":
    sys.exit(main())
