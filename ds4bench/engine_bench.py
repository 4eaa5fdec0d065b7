"""`ds4-bench engine`: load time, prefill and decode speed, optionally against llama.cpp or transformers.

What is measured, per engine and repetition, on one fixed token sequence (both engines get
the same ids):
  load     seconds from nothing to a model ready for its first token (the engine's
           constructor: file mapping, weight conversion, tokenizer, context allocation)
  prefill  a fresh context fed the first N ids; tokens/s = N / seconds (default N = 512
           and 2048); loading is never included
  decode   after a fresh context of C ids (default C = 16 and 2048), K greedy tokens
           (default 128) with the end-of-generation ids masked so that every run makes
           exactly K tokens; tokens/s = K / seconds, the context's prefill excluded
  decode_batch  only with `batch_sizes`, for each N: N sequences decoded together, each
           row holding C = `batch_context` ids (default 128; row i the benchmark sequence
           of seed `seed + 1 + i`), prefilled untimed, then K greedy steps of all rows at
           once (end-of-generation ids masked per row); tokens/s = N * K / seconds, the
           aggregate rate of the batch
When a decode context length is also a prefill length, decoding continues from that timed
prefill instead of repeating it. The batches come after the other steps of a repetition.

Before the timed repetitions each engine runs `warmup` (default 1) untimed ones, the same
steps with nothing recorded: the first repetition of a process pays one-off costs (CUDA
context and library handles, kernel compilation, graph capture, page faults) that are not
the engine's steady speed.

Side by side (`compare`), the engines alternate within every repetition (ds4, llama.cpp,
ds4, llama.cpp, ...) so that the slow phases of a shared machine hit both alike. llama.cpp is
llama-cpp-python in process, or with `llama_bench` its own `llama-bench` and
`llama-batched-bench` binaries (a CUDA build on a GPU machine), which time themselves
(`SelfTimedRunner`, ds4bench.llama_bench): one invocation per repetition, their own
untimed warm-up, no load figure, and batched decoding through llama-batched-bench. The
summary gives each metric's median with min and max over the repetitions, and the ratio
ds4 / other of the medians (for load, of seconds: below 1 means ds4 loads faster; for
the rest, of tokens/s: above 1 means ds4 is faster). The other engine is llama.cpp on the
same GGUF, or transformers on a random bfloat16 model of the GGUF's shape (static cache,
compiled decode step: `ds4bench.runners.TransformersRunner`), the comparison for GPUs;
its load figure includes building the model and compiling.

The token sequence: draws seeded by `seed` from the vocabulary's ordinary tokens (GGUF
token type NORMAL, never BOS, EOS or control tokens), prefixed with BOS when the model
wants one. It is meaningless text on purpose: the speed of a transformer does not depend
on which ids it sees, and fixed ids make runs comparable.

CSV columns (one row per measurement):
  engine        "ds4", "llama.cpp" or "transformers"
  model         the GGUF file name
  device        "cpu" or "cuda"
  weights       ds4's weight format ("packed" or "float32"); "gguf" for llama.cpp
  threads       CPU threads the engine computes with
  ctx           context size the model was loaded with
  metric        "load", "prefill", "decode" or "decode_batch"
  n_prompt      prompt length (prefill), context length before decoding (decode, decode_batch:
                per row), 0 (load)
  n_decode      tokens generated (decode; decode_batch: per row), else 0
  batch         rows decoded together (decode_batch), else 1
  repeat        repetition index, from 0
  seconds       wall-clock seconds of the measured step
  tokens_per_s  n_prompt / seconds (prefill), n_decode / seconds (decode), batch * n_decode /
                seconds (decode_batch), empty (load)

With a memory bandwidth (`bandwidth`, GB/s) `bandwidth_lines` states each decode figure as a
share of the tokens/s that streaming a step's weights allows (ds4bench.readbytes counts them:
for a mixture of experts only the routed ones).

It does not load models (see `ds4bench.runners`), parse flags (see `ds4bench.cli`)
or write files (see `ds4bench.csvfile`).
"""
from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

from tabulate import tabulate

OURS = "ds4"
LLAMA_CPP = "llama.cpp"
TRANSFORMERS = "transformers"
COMPARE_ENGINES = (LLAMA_CPP, TRANSFORMERS)
DEVICES = ("cpu", "cuda")
WEIGHT_FORMATS = ("packed", "float32")
LLAMA_FLASH_ATTN = ("on", "off", "auto")
# engine.kernels.PATHS, named here so that this module imports no torch (a test holds them equal)
CPU_KERNEL_PATHS = ("amx", "avx512", "avx2", "portable", "torch")

DEFAULT_PROMPT_LENGTHS = (512, 2048)
DEFAULT_DECODE_CONTEXTS = (16, 2048)
DEFAULT_DECODE_TOKENS = 128
# --quick: the same shape of run in a few seconds, for smoke tests.
QUICK_PROMPT_LENGTHS = (32, 128)
QUICK_DECODE_CONTEXTS = (8, 128)
QUICK_DECODE_TOKENS = 16

TOKEN_TYPE_NORMAL = 1  # GGUF tokenizer.ggml.token_type value of ordinary vocabulary

CSV_COLUMNS = ("engine", "model", "device", "weights", "threads", "ctx", "metric", "n_prompt", "n_decode",
               "batch", "repeat", "seconds", "tokens_per_s")

# The first speed bar, side by side with llama.cpp on the same machine and GGUF.
BAR_DECODE_RATIO = 0.7
BAR_PREFILL_RATIO = 1.0
BAR_LOAD_SECONDS = 3.0


class BenchConfigError(ValueError):
    """The benchmark settings are inconsistent; the message says which and why."""


@dataclass(frozen=True)
class EngineBenchConfig:
    """Settings of one `ds4-bench engine` run; each field is one command-line flag."""

    model: str | None = None  # GGUF path; None: the embedded model
    ctx: int | None = None  # context to load with; None: just enough for the longest step
    device: str = "cpu"  # ds4's device; llama.cpp offloads to the GPU too when built for it
    weights: str = "packed"  # ds4 weight format: "packed" (int4 kernels) or "float32"
    cpu_kernels: str | None = None  # ds4's CPU kernel path (engine.kernels); None: the engine's choice
    batch_invariant: bool = False  # --batch-invariant: ds4 loaded in its batch-invariant mode (engine.invariant)
    repeats: int = 3  # repetitions of every measurement; the summary reports median, min, max
    warmup: int = 1  # untimed repetitions per engine before the timed ones
    csv: str | None = None  # write one row per measurement here (atomically)
    compare: str | None = None  # "llama.cpp" / "transformers": measure that engine on the same shape too
    llama_bench: str | None = None  # --llama-bench: llama.cpp through this llama-bench binary, not the binding
    llama_flash_attn: str | None = None  # --llama-flash-attn on|off|auto: passed to the binaries as -fa
    transformers_compile: bool = True  # --transformers-compile/--transformers-eager: its decode step compiled
    threads: int | None = None  # llama.cpp n_threads; None: torch.get_num_threads(), as ds4 uses
    llama_extra_buffers: bool = False  # --llama-extra-buffers: ggml's repacked/AMX weight layouts on
    prompt_lengths: tuple[int, ...] | None = None  # prefill lengths; None: 512, 2048 (or --quick's)
    decode_contexts: tuple[int, ...] | None = None  # contexts to decode after; None: 16, 2048
    decode_tokens: int | None = None  # tokens per decode measurement; None: 128 (or --quick's)
    batch_sizes: tuple[int, ...] = ()  # rows decoded together, one measurement each; (): none
    batch_context: int = 128  # ids each batch row holds before its timed steps
    quick: bool = False  # short default lengths for smoke tests; explicit lengths still win
    seed: int = 0  # seed of the benchmark token sequence
    bandwidth: float | None = None  # --bandwidth GB/s: each decode figure as a share of the weight-streaming bound

    @property
    def prefill_lengths(self) -> tuple[int, ...]:
        if self.prompt_lengths is not None:
            return tuple(self.prompt_lengths)
        return QUICK_PROMPT_LENGTHS if self.quick else DEFAULT_PROMPT_LENGTHS

    @property
    def context_lengths(self) -> tuple[int, ...]:
        if self.decode_contexts is not None:
            return tuple(self.decode_contexts)
        return QUICK_DECODE_CONTEXTS if self.quick else DEFAULT_DECODE_CONTEXTS

    @property
    def n_decode(self) -> int:
        if self.decode_tokens is not None:
            return self.decode_tokens
        return QUICK_DECODE_TOKENS if self.quick else DEFAULT_DECODE_TOKENS

    @property
    def required_ctx(self) -> int:
        longest_decode = max(self.context_lengths) + self.n_decode if self.context_lengths else 0
        batch = self.batch_context + self.n_decode if self.batch_sizes else 0
        return max(max(self.prefill_lengths, default=0), longest_decode, batch)

    @property
    def load_ctx(self) -> int:
        return self.ctx if self.ctx is not None else self.required_ctx

    @property
    def sequence_length(self) -> int:
        return max((*self.prefill_lengths, *self.context_lengths), default=0)

    def validate(self) -> None:
        if self.device not in DEVICES:
            raise BenchConfigError(f"--device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise BenchConfigError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}, not {self.weights!r}")
        if self.cpu_kernels is not None and self.cpu_kernels not in CPU_KERNEL_PATHS:
            raise BenchConfigError(f"--cpu-kernels must be one of {', '.join(CPU_KERNEL_PATHS)}, "
                                   f"not {self.cpu_kernels!r}")
        if self.compare is not None and self.compare not in COMPARE_ENGINES:
            raise BenchConfigError(f"--compare supports {', '.join(COMPARE_ENGINES)}, not {self.compare!r}")
        if self.repeats < 1:
            raise BenchConfigError(f"--repeats must be at least 1, not {self.repeats}")
        if self.warmup < 0:
            raise BenchConfigError(f"--warmup must be 0 or more, not {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise BenchConfigError(f"--threads must be at least 1, not {self.threads}")
        if not self.prefill_lengths and not self.context_lengths:
            raise BenchConfigError("nothing to measure: give --prompt-lengths or --decode-contexts")
        for flag, values in (("--prompt-lengths", self.prefill_lengths), ("--decode-contexts", self.context_lengths),
                             ("--batch-sizes", self.batch_sizes)):
            if any(v < 1 for v in values):
                raise BenchConfigError(f"{flag} must be positive counts, not {list(values)}")
        if self.n_decode < 1:
            raise BenchConfigError(f"--decode-tokens must be at least 1, not {self.n_decode}")
        if self.batch_context < 1:
            raise BenchConfigError(f"--batch-context must be at least 1, not {self.batch_context}")
        if self.llama_bench is not None and self.compare != LLAMA_CPP:
            raise BenchConfigError("--llama-bench needs --compare llama.cpp")
        if self.llama_flash_attn is not None:
            if self.llama_bench is None:
                raise BenchConfigError("--llama-flash-attn applies to --llama-bench only")
            if self.llama_flash_attn not in LLAMA_FLASH_ATTN:
                raise BenchConfigError(f"--llama-flash-attn must be one of {', '.join(LLAMA_FLASH_ATTN)}, "
                                       f"not {self.llama_flash_attn!r}")
        if self.batch_sizes and self.compare == LLAMA_CPP and self.llama_bench is None:
            raise BenchConfigError("--batch-sizes cannot be measured with --compare llama.cpp: "
                                   "llama-cpp-python decodes one sequence at a time (--llama-bench measures "
                                   "them with llama.cpp's llama-batched-bench)")
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise BenchConfigError(f"--bandwidth must be positive GB/s, not {self.bandwidth}")
        if self.ctx is not None and self.ctx < self.required_ctx:
            raise BenchConfigError(f"--ctx {self.ctx} is too small: the longest step needs {self.required_ctx} "
                                   f"tokens (prompt or context + decode tokens)")


def parse_lengths(text: str) -> tuple[int, ...]:
    """"512,2048" -> (512, 2048); an empty string -> (); anything else raises BenchConfigError."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise BenchConfigError(f"expected comma-separated token counts such as 512,2048, not {text!r}") from None


# ---------------------------------------------------------------- the token sequence

@dataclass(frozen=True)
class Vocab:
    """What the benchmark needs to know of a vocabulary to draw its token sequence."""

    ordinary: tuple[int, ...]  # ids safe to feed: ordinary text pieces
    bos_id: int | None
    add_bos: bool
    eos_ids: frozenset[int]  # masked when decoding, so runs never stop early


def ordinary_ids(token_types: Sequence[int] | None, n_vocab: int, exclude: Iterable[int | None]) -> tuple[int, ...]:
    """Ids of NORMAL tokens (all ids when the GGUF has no token types), minus `exclude`."""
    skip = {i for i in exclude if i is not None}
    if token_types is None:
        candidates: Iterable[int] = range(n_vocab)
    else:
        candidates = (i for i, t in enumerate(token_types[:n_vocab]) if int(t) == TOKEN_TYPE_NORMAL)
    ids = tuple(i for i in candidates if i not in skip)
    if not ids:
        raise BenchConfigError("the vocabulary has no ordinary tokens to build a benchmark prompt from")
    return ids


def benchmark_ids(vocab: Vocab, n: int, seed: int) -> list[int]:
    """The first n ids of the benchmark sequence: BOS if wanted, then seeded ordinary ids."""
    rng = random.Random(seed)
    head = [vocab.bos_id] if vocab.add_bos and vocab.bos_id is not None else []
    return (head + [rng.choice(vocab.ordinary) for _ in range(n)])[:n]


def batch_rows(vocab: Vocab, n_rows: int, length: int, seed: int) -> list[list[int]]:
    """The rows of a batch measurement: row i is the benchmark sequence of seed `seed + 1 + i`."""
    return [benchmark_ids(vocab, length, seed + 1 + i) for i in range(n_rows)]


# ---------------------------------------------------------------- measuring

class Runner(Protocol):
    """One engine under measurement. Between load() and close() it holds one model."""

    engine: str  # CSV "engine" value
    device: str
    weights: str
    threads: int
    ctx: int
    model_name: str

    def kernels(self) -> str: ...  # which kernels it computes with on this machine, one line

    def load(self) -> None: ...

    def vocab(self) -> Vocab: ...  # after load(); only the first runner of a run is asked

    def prefill(self, ids: Sequence[int]) -> None: ...  # fresh context holding exactly ids

    def decode(self, n: int, banned: frozenset[int]) -> list[int]: ...  # n greedy tokens, banned ids masked

    # Only with `batch_sizes` (llama.cpp has neither; the config refuses that pairing).
    def prefill_batch(self, rows: Sequence[Sequence[int]]) -> None: ...  # fresh contexts, row i holding rows[i]

    def decode_batch(self, n: int, banned: frozenset[int]) -> list[list[int]]: ...  # n greedy steps of every row

    def close(self) -> None: ...


class SelfTimedRunner(Protocol):
    """An engine that times itself (llama.cpp's benchmark binaries): asked for a whole
    repetition's measurements, its warm-up its own."""

    engine: str
    times_itself: bool  # True
    device: str
    threads: int

    def kernels(self) -> str: ...

    def measure(self, cfg: "EngineBenchConfig", repeat: int) -> list["Measurement"]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Measurement:
    engine: str
    model: str
    device: str
    weights: str
    threads: int
    ctx: int
    metric: str  # "load" | "prefill" | "decode" | "decode_batch"
    n_prompt: int
    n_decode: int
    repeat: int
    seconds: float
    batch: int = 1  # rows decoded together (decode_batch)

    @property
    def tokens(self) -> int:
        if self.metric in ("decode", "decode_batch"):
            return self.batch * self.n_decode
        return self.n_prompt if self.metric == "prefill" else 0

    @property
    def tokens_per_s(self) -> float | None:
        if self.metric == "load" or self.seconds <= 0:
            return None
        return self.tokens / self.seconds

    def csv_row(self) -> dict[str, object]:
        tps = self.tokens_per_s
        return {"engine": self.engine, "model": self.model, "device": self.device, "weights": self.weights,
                "threads": self.threads, "ctx": self.ctx, "metric": self.metric, "n_prompt": self.n_prompt,
                "n_decode": self.n_decode, "batch": self.batch, "repeat": self.repeat,
                "seconds": f"{self.seconds:.9f}",
                "tokens_per_s": "" if tps is None else f"{tps:.3f}"}


@dataclass(frozen=True)
class Step:
    """Prefill `length` ids into a fresh context; time it as a prefill and/or decode after it."""

    length: int
    timed_prefill: bool
    decode_after: bool


def plan_steps(cfg: EngineBenchConfig) -> list[Step]:
    prefill, contexts = set(cfg.prefill_lengths), set(cfg.context_lengths)
    return [Step(n, n in prefill, n in contexts) for n in sorted(prefill | contexts)]


def metric_label(metric: str, n_prompt: int, n_decode: int, batch: int = 1) -> str:
    """How tables and progress lines name a measurement, e.g. "decode 128 after 16", "decode x64 after 128"."""
    if metric == "prefill":
        return f"prefill {n_prompt}"
    if metric == "decode":
        return f"decode {n_decode} after {n_prompt}"
    if metric == "decode_batch":
        return f"decode x{batch} after {n_prompt}"
    return metric


def describe_plan(cfg: EngineBenchConfig) -> str:
    """One line saying what a run will measure, e.g. for a progress header."""
    parts = []
    for step in plan_steps(cfg):
        done = [f"prefill {step.length}"] if step.timed_prefill else []
        if step.decode_after:
            done.append(f"decode {cfg.n_decode} after {step.length}")
        parts.append(" + ".join(done))
    parts += [f"decode {cfg.n_decode} x{n} after {cfg.batch_context}" for n in cfg.batch_sizes]
    warm = f"{cfg.warmup} untimed + " if cfg.warmup else ""
    return f"{warm}{cfg.repeats} x (load, {', '.join(parts)}), ctx {cfg.load_ctx}"


IdsFor = Callable[["Runner"], tuple[list[int], Vocab]]  # the benchmark ids and vocabulary, fixed per run


def measure_engine(runner: Runner, cfg: EngineBenchConfig, repeat: int, ids_for: IdsFor,
                   clock: Callable[[], float] = time.perf_counter) -> Iterable[Measurement]:
    """One repetition on one engine: load, then every step of the plan; the model is closed after."""
    def record(metric: str, n_prompt: int, n_decode: int, seconds: float, batch: int = 1) -> Measurement:
        return Measurement(runner.engine, runner.model_name, runner.device, runner.weights, runner.threads,
                           runner.ctx, metric, n_prompt, n_decode, repeat, seconds, batch)

    try:
        t0 = clock()
        runner.load()
        yield record("load", 0, 0, clock() - t0)
        ids, vocab = ids_for(runner)
        for step in plan_steps(cfg):
            t0 = clock()
            runner.prefill(ids[: step.length])
            elapsed = clock() - t0
            if step.timed_prefill:
                yield record("prefill", step.length, 0, elapsed)
            if step.decode_after:
                t0 = clock()
                runner.decode(cfg.n_decode, vocab.eos_ids)
                yield record("decode", step.length, cfg.n_decode, clock() - t0)
        for n in cfg.batch_sizes:
            runner.prefill_batch(batch_rows(vocab, n, cfg.batch_context, cfg.seed))
            t0 = clock()
            runner.decode_batch(cfg.n_decode, vocab.eos_ids)
            yield record("decode_batch", cfg.batch_context, cfg.n_decode, clock() - t0, n)
    finally:
        runner.close()


def repetition(runner: Runner | SelfTimedRunner, cfg: EngineBenchConfig, repeat: int, ids_for: IdsFor,
               clock: Callable[[], float] = time.perf_counter) -> Iterable[Measurement]:
    """One repetition on one engine, timed here or (a SelfTimedRunner) by the engine itself."""
    if getattr(runner, "times_itself", False):
        return runner.measure(cfg, repeat)
    return measure_engine(runner, cfg, repeat, ids_for, clock)


def run_engine_bench(cfg: EngineBenchConfig, runners: Sequence[Runner | SelfTimedRunner],
                     clock: Callable[[], float] = time.perf_counter,
                     report: Callable[[Measurement], None] | None = None) -> list[Measurement]:
    """All repetitions, the engines interleaved within each; the first runner supplies the vocabulary."""
    cfg.validate()
    if not runners:
        raise BenchConfigError("no engine to measure")
    fixed: list[tuple[list[int], Vocab]] = []

    def ids_for(runner: Runner) -> tuple[list[int], Vocab]:
        if not fixed:
            vocab = runner.vocab()
            fixed.append((benchmark_ids(vocab, cfg.sequence_length, cfg.seed), vocab))
        return fixed[0]

    for _ in range(cfg.warmup):  # untimed: one-off costs of a fresh process stay out of the figures
        for runner in runners:
            if not getattr(runner, "times_itself", False):  # those warm up inside every run
                for _m in measure_engine(runner, cfg, -1, ids_for, clock):
                    pass
    out: list[Measurement] = []
    for repeat in range(cfg.repeats):
        for runner in runners:
            for m in repetition(runner, cfg, repeat, ids_for, clock):
                out.append(m)
                if report is not None:
                    report(m)
    return out


def progress_line(m: Measurement) -> str:
    tps = m.tokens_per_s
    speed = f" {tps:9.1f} tok/s" if tps is not None else ""
    what = metric_label(m.metric, m.n_prompt, m.n_decode, m.batch)
    return f"[{m.repeat}] {m.engine:<9} {what:<22} {m.seconds:8.3f} s{speed}"


# ---------------------------------------------------------------- summary

@dataclass(frozen=True)
class Stat:
    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Stat":
        return cls(statistics.median(values), min(values), max(values), len(values))


@dataclass(frozen=True)
class SummaryRow:
    metric: str
    n_prompt: int
    n_decode: int
    unit: str  # "s" for load, "tok/s" otherwise
    stats: dict[str, Stat]  # engine -> statistics of its values
    ratio: float | None  # ds4 median / compared engine's median, when both exist
    batch: int = 1

    @property
    def label(self) -> str:
        return metric_label(self.metric, self.n_prompt, self.n_decode, self.batch)


def metric_value(m: Measurement) -> float:
    """The number a summary aggregates: seconds for load, tokens/s otherwise."""
    tps = m.tokens_per_s
    return m.seconds if m.metric == "load" or tps is None else tps


_METRIC_ORDER = {"load": 0, "prefill": 1, "decode": 2, "decode_batch": 3}


def engines_of(measurements: Sequence[Measurement]) -> list[str]:
    return list(dict.fromkeys(m.engine for m in measurements))


def summarize(measurements: Sequence[Measurement], other: str | None = None) -> list[SummaryRow]:
    """Per (metric, n_prompt, n_decode, batch): each engine's median/min/max and ds4/other of the medians."""
    groups: dict[tuple[str, int, int, int], dict[str, list[float]]] = {}
    for m in measurements:
        key = (m.metric, m.n_prompt, m.n_decode, m.batch)
        groups.setdefault(key, {}).setdefault(m.engine, []).append(metric_value(m))
    rows = []
    ordered = sorted(groups.items(), key=lambda kv: (_METRIC_ORDER.get(kv[0][0], 9), kv[0][1:]))
    for (metric, n_prompt, n_decode, batch), per_engine in ordered:
        stats = {engine: Stat.of(values) for engine, values in per_engine.items()}
        ratio = None
        if other is not None and OURS in stats and other in stats and stats[other].median > 0:
            ratio = stats[OURS].median / stats[other].median
        rows.append(SummaryRow(metric, n_prompt, n_decode, "s" if metric == "load" else "tok/s", stats, ratio, batch))
    return rows


def _cell(stat: Stat | None, unit: str) -> str:
    if stat is None:
        return "-"
    fmt = "{:.3f}" if unit == "s" else "{:.1f}"
    if stat.n == 1:
        return fmt.format(stat.median)
    return f"{fmt.format(stat.median)} [{fmt.format(stat.lo)}, {fmt.format(stat.hi)}]"


def render_table(rows: Sequence[SummaryRow], engines: Sequence[str], other: str | None = None) -> str:
    """A text table: one row per metric, each engine's 'median [min, max]', and the ratio column."""
    headers = ["metric", "unit", *(f"{e} median [min, max]" for e in engines)]
    if other is not None:
        headers.append(f"{OURS}/{other}")
    body = []
    for row in rows:
        line = [row.label, row.unit, *(_cell(row.stats.get(e), row.unit) for e in engines)]
        if other is not None:
            line.append("-" if row.ratio is None else f"{row.ratio:.2f}x")
        body.append(line)
    return tabulate(body, headers=headers, tablefmt="simple", disable_numparse=True)


@dataclass(frozen=True)
class BarCheck:
    what: str  # e.g. "decode 128 after 16"
    value: float
    target: str  # e.g. ">= 0.70x llama.cpp"
    ok: bool

    def line(self) -> str:
        shown = f"{self.value:.3f} s" if self.target.endswith(" s") else f"{self.value:.2f}x"
        return f"{'PASS' if self.ok else 'FAIL'}  {self.what}: {shown} (bar {self.target})"


def check_bar(rows: Sequence[SummaryRow], other: str | None, *, embedded: bool = True) -> list[BarCheck]:
    """The first speed bar: decode >= 0.7x and prefill >= 1.0x llama.cpp, and ds4 loading the
    embedded model (`embedded`) in under 3 s. Against transformers there is no bar, only ratios;
    another model's load time is shown without one (a larger file takes longer to map), and
    batched decoding has none either."""
    checks = []
    for row in rows:
        if row.metric == "load" and OURS in row.stats:
            if embedded:
                med = row.stats[OURS].median
                checks.append(BarCheck(f"{OURS} load", med, f"< {BAR_LOAD_SECONDS:g} s", med < BAR_LOAD_SECONDS))
        elif other == LLAMA_CPP and row.ratio is not None and row.metric in ("prefill", "decode"):
            target = BAR_PREFILL_RATIO if row.metric == "prefill" else BAR_DECODE_RATIO
            checks.append(BarCheck(row.label, row.ratio, f">= {target:.2f}x {other}", row.ratio >= target))
    return checks


def bandwidth_lines(rows: Sequence[SummaryRow], engines: Sequence[str], bound: Callable[[int], float],
                    bandwidth: float) -> list[str]:
    """Each decode row's medians as shares of `bound(batch)`, the tokens/s that streaming the
    weights a step reads at `bandwidth` GB/s allows (ds4bench.readbytes)."""
    out = []
    for row in rows:
        if row.metric not in ("decode", "decode_batch"):
            continue
        limit = bound(row.batch)
        shares = ", ".join(f"{e} {row.stats[e].median / limit:.0%}" for e in engines if e in row.stats)
        out.append(f"{row.label}: weight-read bound {limit:.1f} tok/s at {bandwidth:g} GB/s; {shares}")
    return out


def csv_rows(measurements: Sequence[Measurement]) -> list[dict[str, object]]:
    return [m.csv_row() for m in measurements]


def model_label(path: str) -> str:
    return os.path.basename(path)
