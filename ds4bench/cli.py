"""`ds4-bench` command line: a click group, one subcommand per benchmark (eight in all).

  ds4-bench engine [-m GGUF] [--compare llama.cpp|transformers] [--llama-bench PATH] [--batch-sizes 1,64] ...
  ds4-bench sessions [-m GGUF] [--sessions 1,8] [--contexts 128,1024] ...
  ds4-bench serve --url URL [--concurrency 1,8] ...
  ds4-bench kvcache [-m GGUF] [--prompt-tokens N] ...
  ds4-bench product [-m GGUF] [--rounds 3] [--streams 8] [--json FILE]
  ds4-bench kld --save-base BASE.npz | --base BASE.npz [--stack engine|openai|llamacpp] [--weights ...] ...
  ds4-bench random-gguf OUT.gguf --like MODEL.gguf [--qtype Q4_1] [--seed N]
  ds4-bench shards --ray ADDRESS [--suite sanity] [--rounds 3] [--threads N] [--json FILE]

`engine` and `random-gguf` are defined here (library: engine_bench, runners, random_gguf);
`sessions`, `serve`, `kvcache`, `product`, `kld` and `shards` are defined next to their library in the module
of the same name and registered on the group here. Every subcommand that loads a model takes
it as `-m`/`--model`, as ds4, ds4-server and ds4-eval do. Each subcommand only fills its
config object and calls the library. Errors, including bad flags, are one line on stderr
("ds4-bench: error: ...") with exit status 2 for bad input and 1 for a failed run; never a
traceback. Progress goes to stderr, the summary table to stdout, CSV files are written
atomically.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import click

from ds4bench import engine_bench as eb
from ds4bench import random_gguf, readbytes
from ds4bench.csvfile import write_csv
from ds4bench.errors import RunFailure, UsageFailure
from ds4bench.inputs import check_csv_dir, model_file
from ds4bench.kld import kld_command
from ds4bench.kvcache import kvcache_command
from ds4bench.product import product_command
from ds4bench.serve import serve_command
from ds4bench.sessions import sessions_command
from ds4bench.shards import shards_command


class OneLineErrors(click.Group):
    """A click group whose errors, click's own included, are one line without a traceback."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.exceptions.Abort:
            click.echo("ds4-bench: interrupted", err=True)
            sys.exit(130)
        except click.ClickException as e:
            click.echo(f"ds4-bench: error: {e.format_message()}", err=True)
            sys.exit(2)
        except UsageFailure as e:
            click.echo(f"ds4-bench: error: {e}", err=True)
            sys.exit(2)
        except RunFailure as e:
            click.echo(f"ds4-bench: error: {e}", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Speed benchmarks of the ds4 engine."""


def _lengths(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return eb.parse_lengths(value)
    except eb.BenchConfigError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


@main.command("engine")
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--ctx", type=int, default=None, help="Context size to load with (default: what the longest step needs).")
@click.option("--device", type=click.Choice(eb.DEVICES), default="cpu", show_default=True)
@click.option("--weights", type=click.Choice(eb.WEIGHT_FORMATS), default="packed", show_default=True,
              help="ds4 weight format.")
@click.option("--cpu-kernels", type=click.Choice(eb.CPU_KERNEL_PATHS), default=None,
              help="ds4's CPU kernel path (default: $DS4_CPU_KERNELS, else the best this CPU runs); "
                   "e.g. avx2 on an AVX512 host.")
@click.option("--batch-invariant", is_flag=True, default=False,
              help="Load ds4 in its batch-invariant mode (every token through one row's step), to measure "
                   "what the mode costs.")
@click.option("--repeats", type=int, default=3, show_default=True,
              help="Repetitions; the summary shows median [min, max].")
@click.option("--warmup", type=int, default=1, show_default=True,
              help="Untimed repetitions per engine before the timed ones.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write one row per measurement (columns: see ds4bench/engine_bench.py).")
@click.option("--compare", type=click.Choice(eb.COMPARE_ENGINES), default=None,
              help="Measure llama-cpp-python on the same GGUF, or transformers on a random bfloat16 model "
                   "of its shape, interleaved, and print ratios.")
@click.option("--llama-bench", "llama_bench", type=click.Path(dir_okay=False), default=None,
              help="With --compare llama.cpp: run llama.cpp's own llama-bench binary (e.g. a CUDA build), and "
                   "llama-batched-bench from the same folder for --batch-sizes, instead of llama-cpp-python.")
@click.option("--llama-flash-attn", type=click.Choice(eb.LLAMA_FLASH_ATTN), default=None,
              help="With --llama-bench: pass -fa VALUE to the binaries (default: their own default).")
@click.option("--transformers-compile/--transformers-eager", default=True, show_default=True,
              help="With --compare transformers: its one-token step under torch.compile, or eager.")
@click.option("--threads", type=int, default=None, help="llama.cpp threads (default: torch.get_num_threads()).")
@click.option("--llama-extra-buffers", is_flag=True,
              help="Load llama.cpp with ggml's extra buffer types (repacked and AMX weights); off by default "
                   "because llama-cpp-python 0.3.36 built for an AMX CPU crashes with them on Q4_1 files.")
@click.option("--prompt-lengths", callback=_lengths, default=None, help="Prefill lengths, e.g. 512,2048.")
@click.option("--decode-contexts", callback=_lengths, default=None,
              help="Context lengths to decode after, e.g. 16,2048.")
@click.option("--decode-tokens", type=int, default=None, help="Tokens per decode measurement (default 128).")
@click.option("--batch-sizes", callback=_lengths, default="",
              help="Also decode this many sequences at once, e.g. 1,8,64: --decode-tokens steps of all rows, "
                   "aggregate tokens/s (ds4, transformers, and llama.cpp through --llama-bench).")
@click.option("--batch-context", type=int, default=128, show_default=True,
              help="Ids each batch row holds before its timed steps.")
@click.option("--quick", is_flag=True, help="Short default lengths, for smoke tests.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the benchmark token sequence.")
@click.option("--bandwidth", type=float, default=None,
              help="Memory bandwidth in GB/s (e.g. 4800 for an H200): show each decode figure as a share of the "
                   "tokens/s that reading a step's weights (only the routed experts of MoE models) allows.")
def engine_command(model: str | None, ctx: int | None, device: str, weights: str, cpu_kernels: str | None,
                   batch_invariant: bool, repeats: int, warmup: int,
                   csv_path: str | None, compare: str | None, llama_bench: str | None,
                   llama_flash_attn: str | None, transformers_compile: bool, threads: int | None,
                   llama_extra_buffers: bool,
                   prompt_lengths: tuple[int, ...] | None, decode_contexts: tuple[int, ...] | None,
                   decode_tokens: int | None, batch_sizes: tuple[int, ...], batch_context: int, quick: bool,
                   seed: int, bandwidth: float | None) -> int:
    """Load time, prefill and decode tokens/s (and batched decode with --batch-sizes), optionally side by
    side with llama.cpp or transformers."""
    cfg = eb.EngineBenchConfig(model=model, ctx=ctx, device=device, weights=weights, cpu_kernels=cpu_kernels,
                               batch_invariant=batch_invariant, repeats=repeats, warmup=warmup,
                               csv=csv_path, compare=compare, llama_bench=llama_bench,
                               llama_flash_attn=llama_flash_attn, transformers_compile=transformers_compile,
                               threads=threads, llama_extra_buffers=llama_extra_buffers,
                               prompt_lengths=prompt_lengths,
                               decode_contexts=decode_contexts, decode_tokens=decode_tokens,
                               batch_sizes=batch_sizes, batch_context=batch_context, quick=quick, seed=seed,
                               bandwidth=bandwidth)
    return run_engine(cfg)


def _is_embedded(path: str) -> bool:
    """Whether `path` is the embedded model's file (False where that model is not installed)."""
    from engine import ModelLoadError, default_model_path

    try:
        return os.path.samefile(path, default_model_path())
    except (OSError, ModelLoadError):
        return False


def run_engine(cfg: eb.EngineBenchConfig) -> int:
    from engine import ModelLoadError

    from ds4bench.llama_bench import LlamaBenchError, LlamaBenchRunner
    from ds4bench.runners import (Ds4Runner, LlamaCppMissing, LlamaCppRunner, TransformersRunner,
                                  TransformersUnavailable, default_threads)

    try:
        cfg.validate()
        path = model_file(cfg.model)
        check_csv_dir(cfg.csv)
        runners: list[eb.Runner | eb.SelfTimedRunner] = [
            Ds4Runner(path, ctx=cfg.load_ctx, device=cfg.device, weights=cfg.weights, cpu_kernels=cfg.cpu_kernels,
                      batch_invariant=cfg.batch_invariant)]
        threads = cfg.threads if cfg.threads is not None else default_threads()
        if cfg.llama_bench is not None:
            runners.append(LlamaBenchRunner(path, binary=cfg.llama_bench, ctx=cfg.load_ctx, threads=threads,
                                            device=cfg.device, flash_attn=cfg.llama_flash_attn,
                                            batched=bool(cfg.batch_sizes)))
        elif cfg.compare == eb.LLAMA_CPP:
            runners.append(LlamaCppRunner(path, ctx=cfg.load_ctx, threads=threads, device=cfg.device,
                                          extra_buffers=cfg.llama_extra_buffers))
        elif cfg.compare == eb.TRANSFORMERS:
            runners.append(TransformersRunner(path, ctx=cfg.load_ctx, device=cfg.device,
                                              compile=cfg.transformers_compile, seed=cfg.seed))
    except (eb.BenchConfigError, LlamaCppMissing, LlamaBenchError, TransformersUnavailable, ModelLoadError) as e:
        raise UsageFailure(str(e)) from None

    click.echo(f"{eb.model_label(path)}: {eb.describe_plan(cfg)}; engines {', '.join(r.engine for r in runners)}",
               err=True)
    try:
        for n in sorted({1, *cfg.batch_sizes}):
            click.echo(readbytes.describe(readbytes.from_gguf(path, n)), err=True)
    except readbytes.Unreadable:
        pass  # loading the model says what is wrong with the file, in the engine's words
    for r in runners:
        try:
            click.echo(f"{r.engine} kernels: {r.kernels()}", err=True)
        except ModelLoadError as e:  # a --cpu-kernels path this machine cannot run
            raise UsageFailure(str(e)) from None
    try:
        measurements = eb.run_engine_bench(cfg, runners, report=lambda m: click.echo(eb.progress_line(m), err=True))
    except ModelLoadError as e:
        raise RunFailure(str(e)) from None
    except (ValueError, RuntimeError) as e:  # e.g. llama.cpp failing to load or decode the same file
        raise RunFailure(f"{type(e).__name__}: {e}") from None

    engines = eb.engines_of(measurements)
    rows = eb.summarize(measurements, cfg.compare)
    click.echo(eb.render_table(rows, engines, cfg.compare))
    if cfg.bandwidth is not None:
        click.echo()
        for line in eb.bandwidth_lines(rows, engines, lambda n: readbytes.bound_tokens_per_s(
                readbytes.from_gguf(path, n), cfg.bandwidth), cfg.bandwidth):
            click.echo(line)
    checks = eb.check_bar(rows, cfg.compare, embedded=_is_embedded(path))
    if checks:
        click.echo()
        for check in checks:
            click.echo(check.line())
    if cfg.csv:
        try:
            write_csv(cfg.csv, eb.CSV_COLUMNS, eb.csv_rows(measurements))
        except OSError as e:
            raise RunFailure(f"cannot write {cfg.csv}: {e.strerror or e}") from None
        click.echo(f"wrote {len(measurements)} rows to {cfg.csv}", err=True)
    return 0


@main.command("random-gguf")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--like", "like", required=True, type=click.Path(dir_okay=False),
              help="Copy architecture, shapes and tokenizer from this GGUF.")
@click.option("--qtype", type=click.Choice(random_gguf.WRITABLE_QTYPES), default=None,
              help="Type of the layer matrices (default: the most common one in --like).")
@click.option("--seed", type=int, default=0, show_default=True)
def random_gguf_command(out: str, like: str, qtype: str | None, seed: int) -> int:
    """Write a GGUF shaped like --like, with random weights (for speed tests only)."""
    try:
        spec = random_gguf.write_like(out, like, qtype, seed)
    except random_gguf.RandomGGUFError as e:
        raise UsageFailure(str(e)) from None
    except OSError as e:
        raise RunFailure(f"cannot write {out}: {e.strerror or e}") from None
    click.echo(f"wrote {out}: {spec.arch}, {spec.n_layer} layers, n_embd {spec.n_embd}, layer matrices {spec.qtype}, "
               f"embedding {spec.embed_qtype}, seed {spec.seed}", err=True)
    return 0


main.add_command(kvcache_command)
main.add_command(sessions_command)
main.add_command(serve_command)
main.add_command(product_command)
main.add_command(kld_command)
main.add_command(shards_command)


if __name__ == "__main__":
    main()
