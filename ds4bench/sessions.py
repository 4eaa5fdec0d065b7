"""`ds4-bench sessions`: decode speed of N sessions decoding together, in-process.

What is measured: for every context size C and session count N (default N = 1, 2, 4, 8,
16 and C = 128, 1024, 4096), N resident sessions each hold C tokens of their own seeded
prompt (draws from the vocabulary's ordinary tokens, as in `ds4-bench engine`, one seed per
session so that no two share a prefix). Then K decode steps (default 32) run through
`engine.batch.decode_batch`, one forward pass for all N rows per step, each row fed the
greedy token of its own logits. aggregate tokens/s = N * K / seconds; per-session
tokens/s = K / seconds (what each user sees). After a measurement every session is
truncated back to C tokens, so all N and repetitions start from the same state; the
sessions of the largest N are prefilled once per context and the smaller N use the first
ones. Each N first runs a few untimed steps (one-off costs of a new batch shape).
Repetitions interleave the N values (N = 1, 2, ..., then again) so that slow phases of a
shared machine hit all alike; the summary reports the median [min, max]. The model is loaded
and decoded on the calling thread (one OpenMP pool, see engine.threads) with a fixed thread
count, torch's or `--threads`, so that every cell runs with the same one; the engine thread's
load-following count is left out on purpose.  A pool as large as the machine spin-waits for
a descheduled thread when another process keeps a core busy, so on a shared machine give
`--threads` the cores that are free.

Memory: a cell (N, C) runs only when `engine.batch.capacity_need(model, N, C + K)` (the
engine's own accounting of KV and working buffers beyond the resident weights) plus a 10%
margin fits the memory available on the device when the context is prepared; otherwise it
is reported as skipped, in the table and in the CSV, with both figures.

CSV columns (one row per measurement, or one per skipped cell):
  model, device, threads, kv_dtype (the KV cache's element type, e.g. float16), attention
  (the decode-attention path), n_ctx (what the model was loaded with), ctx (tokens per session
  before decoding), n_sessions, decode_tokens, repeat (empty when skipped), seconds,
  aggregate_tokens_per_s, per_session_tokens_per_s, need_mib (capacity_need without the
  margin), available_mib, status ("ok" or "skipped: memory").

It does not parse flags beyond its click command, start servers or measure prefill speed
(`ds4-bench engine` does).
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import click
from tabulate import tabulate

from ds4bench.csvfile import write_csv
from ds4bench.engine_bench import BenchConfigError, DEVICES, Vocab, benchmark_ids, ordinary_ids, parse_lengths
from ds4bench.errors import RunFailure, UsageFailure
from ds4bench.inputs import check_csv_dir, model_file

DEFAULT_SESSIONS = (1, 2, 4, 8, 16)
DEFAULT_CONTEXTS = (128, 1024, 4096)
DEFAULT_DECODE_TOKENS = 32
MEMORY_MARGIN = 0.10
WARMUP_STEPS = 2  # untimed decode steps per N and context before the measurements
TARGET_RATIO = 3.0  # aggregate tokens/s of N=8 over N=1
TARGET_N = 8
CSV_COLUMNS = ("model", "device", "threads", "kv_dtype", "attention", "n_ctx", "ctx", "n_sessions", "decode_tokens", "repeat", "seconds",
               "aggregate_tokens_per_s", "per_session_tokens_per_s", "need_mib", "available_mib", "status")
MIB = 2 ** 20


@dataclass(frozen=True)
class SessionsBenchConfig:
    """Settings of one `ds4-bench sessions` run; each field is one command-line flag."""

    model: str | None = None  # GGUF path; None: the embedded model
    device: str = "cpu"
    sessions: tuple[int, ...] = DEFAULT_SESSIONS  # --sessions: values of N
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS  # --contexts: tokens each session holds before decoding
    decode_tokens: int = DEFAULT_DECODE_TOKENS  # --decode-tokens: K, decode steps per measurement
    repeats: int = 3
    threads: int | None = None  # --threads: torch.set_num_threads; None leaves torch's default
    kv_type: str | None = None  # --kv-type: f32, f16 or bf16; None: the engine's default
    csv: str | None = None
    seed: int = 0  # seed of session 0's prompt; session i uses seed + i

    @property
    def load_ctx(self) -> int:
        return max(self.contexts) + self.decode_tokens

    def validate(self) -> None:
        if self.device not in DEVICES:
            raise BenchConfigError(f"--device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        if not self.sessions or any(n < 1 for n in self.sessions):
            raise BenchConfigError(f"--sessions must be positive counts, not {list(self.sessions)}")
        if not self.contexts or any(c < 1 for c in self.contexts):
            raise BenchConfigError(f"--contexts must be positive token counts, not {list(self.contexts)}")
        if self.decode_tokens < 1:
            raise BenchConfigError(f"--decode-tokens must be at least 1, not {self.decode_tokens}")
        if self.repeats < 1:
            raise BenchConfigError(f"--repeats must be at least 1, not {self.repeats}")
        if self.threads is not None and self.threads < 1:
            raise BenchConfigError(f"--threads must be at least 1, not {self.threads}")


# ---------------------------------------------------------------- planning (pure)

@dataclass(frozen=True)
class Cell:
    ctx: int
    n_sessions: int
    need_bytes: int  # capacity_need, without the margin
    available_bytes: int

    @property
    def fits(self) -> bool:
        return self.need_bytes * (1 + MEMORY_MARGIN) <= self.available_bytes


def plan_cells(ctx: int, sessions: Sequence[int], decode_tokens: int, need: Callable[[int, int], int],
               available: int) -> list[Cell]:
    """The cells of one context, in ascending N; `need(n, tokens)` is the engine's capacity_need."""
    return [Cell(ctx, n, int(need(n, ctx + decode_tokens)), int(available)) for n in sorted(set(sessions))]


# ---------------------------------------------------------------- measuring

@dataclass(frozen=True)
class Measurement:
    ctx: int
    n_sessions: int
    decode_tokens: int
    repeat: int
    seconds: float

    @property
    def aggregate(self) -> float:
        return self.n_sessions * self.decode_tokens / self.seconds

    @property
    def per_session(self) -> float:
        return self.decode_tokens / self.seconds


def model_vocab(model: Any) -> Vocab:
    types = model.metadata.get("tokenizer.ggml.token_type")
    exclude = [model.bos_id, model.eos_id, *model.eos_ids]
    return Vocab(ordinary_ids(types, model.n_vocab, exclude), model.bos_id, bool(model.add_bos),
                 frozenset(model.eos_ids))


def _greedy(logits: Any) -> int:
    return int(logits.argmax())


def measure_batch(sessions: Sequence[Any], first: Sequence[int], ctx: int, k: int,
                  decode: Callable[[list, list], None], clock: Callable[[], float] = time.perf_counter) -> float:
    """K batched decode steps over `sessions` (each holding ctx tokens); seconds; sessions back at ctx."""
    rows, tokens = list(sessions), list(first)
    t0 = clock()
    for step in range(k):
        decode(rows, tokens)
        if step + 1 < k:
            tokens = [_greedy(s.logits) for s in rows]
    elapsed = clock() - t0
    for s in rows:
        s.truncate(ctx)
    return elapsed


@dataclass
class SessionsBenchResult:
    model: str
    device: str
    threads: int
    kv_dtype: str
    attention: str
    n_ctx: int
    measurements: list[Measurement]
    cells: list[Cell]


def run_sessions_bench(cfg: SessionsBenchConfig, model: Any, report: Callable[[str], None] = lambda _l: None,
                       clock: Callable[[], float] = time.perf_counter) -> SessionsBenchResult:
    """Every context in ascending order: plan its cells, prefill the sessions, measure the cells that fit."""
    import torch

    from engine.batch import available_bytes, capacity_need, decode_batch

    cfg.validate()
    vocab = model_vocab(model)
    measurements: list[Measurement] = []
    cells: list[Cell] = []
    for ctx in sorted(set(cfg.contexts)):
        gc.collect()
        plan = plan_cells(ctx, cfg.sessions, cfg.decode_tokens, lambda n, c: capacity_need(model, n, c),
                          available_bytes(model.device))
        cells.extend(plan)
        for cell in plan:
            if not cell.fits:
                report(f"ctx {ctx} N={cell.n_sessions}: skipped, needs {cell.need_bytes / MIB:.0f} MiB "
                       f"+{MEMORY_MARGIN:.0%}, {cell.available_bytes / MIB:.0f} MiB available")
        runnable = [c.n_sessions for c in plan if c.fits]
        if not runnable:
            continue
        t0 = clock()
        sessions, first = model.new_sessions(max(runnable)), []
        for i, s in enumerate(sessions):
            s.sync(benchmark_ids(vocab, ctx, cfg.seed + i))
            first.append(_greedy(s.logits))
        report(f"ctx {ctx}: prefilled {len(sessions)} sessions in {clock() - t0:.1f} s")
        with torch.inference_mode():
            for n in runnable:  # untimed: first calls of a batch shape pay one-off set-up costs
                measure_batch(sessions[:n], first[:n], ctx, WARMUP_STEPS, decode_batch, clock)
        for repeat in range(cfg.repeats):
            for n in runnable:
                with torch.inference_mode():
                    seconds = measure_batch(sessions[:n], first[:n], ctx, cfg.decode_tokens, decode_batch, clock)
                m = Measurement(ctx, n, cfg.decode_tokens, repeat, seconds)
                measurements.append(m)
                report(f"[{repeat}] ctx {ctx:>6} N={n:<3} {m.aggregate:9.1f} tok/s aggregate, "
                       f"{m.per_session:8.1f} per session")
        del sessions
    return SessionsBenchResult(os.path.basename(model.path), str(model.device), torch.get_num_threads(),
                               str(model.kv_dtype).removeprefix("torch."), model.net.attention_path,
                               model.n_ctx, measurements, cells)


# ---------------------------------------------------------------- summary (pure)

def _median_range(values: Sequence[float]) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.1f}"
    return f"{med:.1f} [{min(values):.1f}, {max(values):.1f}]"


def aggregate_medians(measurements: Sequence[Measurement]) -> dict[tuple[int, int], float]:
    groups: dict[tuple[int, int], list[float]] = {}
    for m in measurements:
        groups.setdefault((m.ctx, m.n_sessions), []).append(m.aggregate)
    return {k: statistics.median(v) for k, v in groups.items()}


def render_table(result: SessionsBenchResult) -> str:
    """One row per cell: aggregate and per-session tokens/s, the ratio to N=1 of the same context."""
    medians = aggregate_medians(result.measurements)
    by_cell: dict[tuple[int, int], list[Measurement]] = {}
    for m in result.measurements:
        by_cell.setdefault((m.ctx, m.n_sessions), []).append(m)
    body = []
    for cell in result.cells:
        key = (cell.ctx, cell.n_sessions)
        ms = by_cell.get(key)
        if not cell.fits or not ms:
            body.append([cell.ctx, cell.n_sessions,
                         f"skipped: needs {cell.need_bytes / MIB:.0f} MiB +{MEMORY_MARGIN:.0%}, "
                         f"{cell.available_bytes / MIB:.0f} MiB available", "", ""])
            continue
        base = medians.get((cell.ctx, 1))
        ratio = f"{medians[key] / base:.2f}x" if base else "-"
        body.append([cell.ctx, cell.n_sessions, _median_range([m.aggregate for m in ms]),
                     _median_range([m.per_session for m in ms]), ratio])
    headers = ["ctx", "N", "aggregate tok/s median [min, max]", "per-session tok/s", "aggregate vs N=1"]
    return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)


def target_lines(result: SessionsBenchResult) -> list[str]:
    """Per context: aggregate N=8 / N=1 against the target (only where both were measured)."""
    medians = aggregate_medians(result.measurements)
    lines = []
    for ctx in sorted({c.ctx for c in result.cells}):
        one, eight = medians.get((ctx, 1)), medians.get((ctx, TARGET_N))
        if one and eight:
            ratio = eight / one
            verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
            lines.append(f"{verdict}  ctx {ctx}: aggregate N={TARGET_N} / N=1 = {ratio:.2f}x "
                         f"(target >= {TARGET_RATIO:g}x)")
    return lines


def csv_rows(result: SessionsBenchResult) -> list[dict[str, object]]:
    common = {"model": result.model, "device": result.device, "threads": result.threads,
              "kv_dtype": result.kv_dtype, "attention": result.attention, "n_ctx": result.n_ctx}
    rows: list[dict[str, object]] = []
    by_cell: dict[tuple[int, int], list[Measurement]] = {}
    for m in result.measurements:
        by_cell.setdefault((m.ctx, m.n_sessions), []).append(m)
    for cell in result.cells:
        mem = {"ctx": cell.ctx, "n_sessions": cell.n_sessions, "need_mib": f"{cell.need_bytes / MIB:.1f}",
               "available_mib": f"{cell.available_bytes / MIB:.1f}"}
        ms = by_cell.get((cell.ctx, cell.n_sessions), [])
        if not ms:
            rows.append({**common, **mem, "status": "skipped: memory"})
        for m in ms:
            rows.append({**common, **mem, "decode_tokens": m.decode_tokens, "repeat": m.repeat,
                         "seconds": f"{m.seconds:.9f}", "aggregate_tokens_per_s": f"{m.aggregate:.3f}",
                         "per_session_tokens_per_s": f"{m.per_session:.3f}", "status": "ok"})
    return rows


# ---------------------------------------------------------------- command

def _counts(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        return parse_lengths(value)
    except BenchConfigError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


@click.command("sessions")
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option("--sessions", "sessions", callback=_counts, default=",".join(map(str, DEFAULT_SESSIONS)),
              show_default=True, help="Session counts N to measure.")
@click.option("--contexts", callback=_counts, default=",".join(map(str, DEFAULT_CONTEXTS)), show_default=True,
              help="Tokens each session holds before decoding.")
@click.option("--decode-tokens", type=int, default=DEFAULT_DECODE_TOKENS, show_default=True,
              help="Decode steps per measurement.")
@click.option("--repeats", type=int, default=3, show_default=True,
              help="Repetitions; the table shows median [min, max].")
@click.option("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own).")
@click.option("--kv-type", type=click.Choice(["f32", "f16", "bf16"]), default=None,
              help="KV cache element type (default: the engine's, f16 on CPU and bf16 on CUDA).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write one row per measurement or skipped cell (columns: ds4bench/sessions.py).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the session prompts.")
def sessions_command(model: str | None, device: str, sessions: tuple[int, ...], contexts: tuple[int, ...],
                     decode_tokens: int, repeats: int, threads: int | None, kv_type: str | None,
                     csv_path: str | None, seed: int) -> int:
    """Aggregate and per-session decode tokens/s of N sessions decoding together."""
    from engine import ModelLoadError, load_model

    cfg = SessionsBenchConfig(model=model, device=device, sessions=sessions, contexts=contexts,
                              decode_tokens=decode_tokens, repeats=repeats, threads=threads, kv_type=kv_type,
                              csv=csv_path, seed=seed)
    try:
        cfg.validate()
    except BenchConfigError as e:
        raise UsageFailure(str(e)) from None
    path = model_file(cfg.model)
    check_csv_dir(cfg.csv)
    if cfg.threads is not None:
        import torch

        torch.set_num_threads(cfg.threads)
    try:
        loaded = load_model(path, ctx=cfg.load_ctx, device=cfg.device, kv_type=cfg.kv_type)
    except ModelLoadError as e:
        raise UsageFailure(str(e)) from None
    click.echo(f"{os.path.basename(path)} on {cfg.device}: N {','.join(map(str, cfg.sessions))} x ctx "
               f"{','.join(map(str, cfg.contexts))}, {cfg.decode_tokens} decode steps, {cfg.repeats} repeats; "
               f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}", err=True)
    try:
        result = run_sessions_bench(cfg, loaded, report=lambda line: click.echo(line, err=True))
    except (ValueError, RuntimeError) as e:
        raise RunFailure(f"{type(e).__name__}: {e}") from None
    click.echo(f"{result.model}, {result.device}, {result.threads} threads, KV cache {result.kv_dtype}, "
               f"decode attention: {result.attention}, {cfg.decode_tokens} decode steps, load average after {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    click.echo(render_table(result))
    lines = target_lines(result)
    if lines:
        click.echo()
        for line in lines:
            click.echo(line)
    if cfg.csv:
        rows = csv_rows(result)
        try:
            write_csv(cfg.csv, CSV_COLUMNS, rows)
        except OSError as e:
            raise RunFailure(f"cannot write {cfg.csv}: {e.strerror or e}") from None
        click.echo(f"wrote {len(rows)} rows to {cfg.csv}", err=True)
    return 0
