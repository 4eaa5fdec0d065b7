"""llama.cpp's own benchmark binaries as the compared engine of `ds4-bench engine`.

On a GPU machine llama.cpp is built from source for CUDA (its `llama-bench` and
`llama-batched-bench` targets), not installed as llama-cpp-python. `LlamaBenchRunner` runs
those binaries once per repetition of `ds4-bench engine --compare llama.cpp --llama-bench
PATH`, so the repetitions stay interleaved with ds4's, and turns their reports into the same
`Measurement`s:

- prefill: `llama-bench -p L1,L2 -n 0 -r 1 -o json`; one record per length, `samples_ns` the
  timed run (llama-bench runs each test once untimed first);
- decode after C: `llama-bench -p 0 -n K -d C1,C2 -r 1 -o json`; `n_depth` ids are in the
  context (filled untimed) before the K timed tokens, as ds4's "decode K after C";
- batched decode (`--batch-sizes`): `llama-batched-bench -npp C -ntg K -npl N1,N2
  --output-format jsonl` from the same folder as llama-bench, each row's C ids prefilled
  untimed and K steps of all rows timed (`t_tg`); tokens/s = N * K / t_tg, as ds4's.

Both get `-t threads`, `-ngl 99` on CUDA (0 on CPU) and `-fa VALUE` when `flash_attn` is set;
llama.cpp draws its own token ids (the speed does not depend on them). There is no load
figure: the binaries do not time loading. The tokens llama.cpp reads are its own, random.
`build_*_command` and `parse_*` are pure; `LlamaBenchRunner` is the thin process shell.
It does not build llama.cpp (docs/bench.md has the recipe).
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from typing import Callable, Sequence

from ds4bench.engine_bench import LLAMA_CPP, EngineBenchConfig, Measurement

BATCHED_BENCH = "llama-batched-bench"
GPU_LAYERS = {"cuda": "99", "cpu": "0"}
TIMEOUT_S = 3600


class LlamaBenchError(RuntimeError):
    """A llama.cpp benchmark binary is missing, failed, or printed something unreadable."""


@dataclass(frozen=True)
class BenchRecord:
    """One test of a llama.cpp report: prompt, generated and context tokens, rows, seconds."""

    n_prompt: int
    n_gen: int
    n_depth: int
    seconds: float
    rows: int = 1


def common_flags(threads: int, device: str, flash_attn: str | None) -> list[str]:
    flags = ["-t", str(threads), "-ngl", GPU_LAYERS[device]]
    return flags + (["-fa", flash_attn] if flash_attn else [])


def build_prefill_command(binary: str, model: str, lengths: Sequence[int], flags: Sequence[str]) -> list[str]:
    return [binary, "-m", model, "-p", ",".join(map(str, lengths)), "-n", "0", "-r", "1", "-o", "json", *flags]


def build_decode_command(binary: str, model: str, n_decode: int, contexts: Sequence[int],
                         flags: Sequence[str]) -> list[str]:
    return [binary, "-m", model, "-p", "0", "-n", str(n_decode), "-d", ",".join(map(str, contexts)), "-r", "1",
            "-o", "json", *flags]


def build_batched_command(binary: str, model: str, context: int, n_decode: int, rows: Sequence[int],
                          flags: Sequence[str]) -> list[str]:
    """llama-batched-bench over every row count; its context holds the largest batch whole."""
    n_kv = max(rows) * (context + n_decode)
    return [binary, "-m", model, "-c", str(n_kv), "-b", "2048", "-ub", "512", "-npp", str(context),
            "-ntg", str(n_decode), "-npl", ",".join(map(str, rows)), "--output-format", "jsonl", *flags]


def parse_llama_bench(text: str) -> list[BenchRecord]:
    """llama-bench's `-o json` report (a JSON array) -> one record per test, seconds of its first sample."""
    start = text.find("[")
    try:
        tests = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as e:
        raise LlamaBenchError(f"llama-bench printed no JSON report ({e.msg})") from None
    if not isinstance(tests, list):
        raise LlamaBenchError("llama-bench printed no JSON report")
    out = []
    for t in tests:
        try:
            samples = t["samples_ns"]
            out.append(BenchRecord(int(t["n_prompt"]), int(t["n_gen"]), int(t.get("n_depth", 0)), samples[0] / 1e9))
        except (KeyError, IndexError, TypeError, ValueError):
            raise LlamaBenchError(f"unexpected llama-bench test record: {str(t)[:200]}") from None
    return out


def parse_batched_bench(text: str) -> list[BenchRecord]:
    """llama-batched-bench's `--output-format jsonl` lines -> one record per row count (its
    log lines, which are not JSON objects, are skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
            out.append(BenchRecord(int(r["pp"]), int(r["tg"]), int(r["pp"]), float(r["t_tg"]), int(r["pl"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise LlamaBenchError(f"unexpected llama-batched-bench line: {line[:200]}") from None
    return out


def pick(records: Sequence[BenchRecord], what: str, wanted: Sequence[tuple[int, int, int, int]]) -> list[BenchRecord]:
    """The records of `wanted` (n_prompt, n_gen, n_depth, rows) tuples, in that order; a missing
    one is an error naming it (a binary too old for `-d`, or a batch that did not fit)."""
    by_key = {(r.n_prompt, r.n_gen, r.n_depth, r.rows): r for r in records}
    missing = [w for w in wanted if w not in by_key]
    if missing:
        raise LlamaBenchError(f"{what} reported no result for (prompt, generated, depth, rows) {missing}")
    return [by_key[w] for w in wanted]


Run = Callable[[list[str]], str]  # a command -> its standard output; raises LlamaBenchError on failure


def run_process(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except OSError as e:
        raise LlamaBenchError(f"cannot run {cmd[0]}: {e.strerror or e}") from None
    except subprocess.TimeoutExpired:
        raise LlamaBenchError(f"{os.path.basename(cmd[0])} ran past {TIMEOUT_S} s") from None
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise LlamaBenchError(f"{os.path.basename(cmd[0])} exited with status {done.returncode}: {tail}")
    return done.stdout


def executable(path: str) -> str:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise LlamaBenchError(f"not an executable file: {path}")
    return path


class LlamaBenchRunner:
    """llama.cpp through its benchmark binaries; it times itself (`times_itself`): engine_bench
    asks it for a repetition's measurements instead of timing its steps."""

    engine = LLAMA_CPP
    weights = "gguf"
    times_itself = True

    def __init__(self, path: str, *, binary: str, ctx: int, threads: int, device: str = "cpu",
                 flash_attn: str | None = None, batched: bool = False, run: Run = run_process):
        self.binary = executable(binary)
        self.batched_binary = executable(os.path.join(os.path.dirname(binary), BATCHED_BENCH)) if batched else None
        self.path, self.ctx, self.threads, self.device = path, ctx, threads, device
        self.model_name = os.path.basename(path)
        self.flags = common_flags(threads, device, flash_attn)
        self._run = run

    def kernels(self) -> str:
        extra = f" and {self.batched_binary}" if self.batched_binary else ""
        return f"{self.binary}{extra} ({' '.join(self.flags)})"

    def measure(self, cfg: EngineBenchConfig, repeat: int) -> list[Measurement]:
        """One repetition of cfg's plan: prefills, decodes after each context, batches."""
        def record(metric: str, r: BenchRecord, n_prompt: int, n_decode: int) -> Measurement:
            return Measurement(self.engine, self.model_name, self.device, self.weights, self.threads, self.ctx,
                               metric, n_prompt, n_decode, repeat, r.seconds, r.rows)

        out = []
        if cfg.prefill_lengths:
            text = self._run(build_prefill_command(self.binary, self.path, cfg.prefill_lengths, self.flags))
            wanted = [(n, 0, 0, 1) for n in cfg.prefill_lengths]
            out += [record("prefill", r, r.n_prompt, 0) for r in pick(parse_llama_bench(text), "llama-bench", wanted)]
        if cfg.context_lengths:
            text = self._run(build_decode_command(self.binary, self.path, cfg.n_decode, cfg.context_lengths,
                                                  self.flags))
            wanted = [(0, cfg.n_decode, c, 1) for c in cfg.context_lengths]
            out += [record("decode", r, r.n_depth, r.n_gen) for r in pick(parse_llama_bench(text), "llama-bench",
                                                                           wanted)]
        if cfg.batch_sizes:
            if self.batched_binary is None:
                raise LlamaBenchError("batched decoding needs llama-batched-bench (runner made without it)")
            text = self._run(build_batched_command(self.batched_binary, self.path, cfg.batch_context, cfg.n_decode,
                                                   cfg.batch_sizes, self.flags))
            wanted = [(cfg.batch_context, cfg.n_decode, cfg.batch_context, n) for n in cfg.batch_sizes]
            out += [record("decode_batch", r, r.n_prompt, r.n_gen)
                    for r in pick(parse_batched_bench(text), BATCHED_BENCH, wanted)]
        return out

    def close(self) -> None:
        """Nothing is held between repetitions (each runs its own processes)."""
