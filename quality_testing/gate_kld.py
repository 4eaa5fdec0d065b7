"""Release gate: corpus KL divergence of the packed fast path from the float32 path; exit 1 past a bound.

    python -m quality_testing.gate_kld [-m GGUF] [--tokens N] [--ctx 512] [--cpu-kernels PATH]

Runs `ds4-bench kld`'s library in one process, on one engine thread (engine.threads): the embedded model (or -m) with
`weights="float32"` (the exact reference path, float32 cache) is the base, the default packed
path (int4 kernels, float16 cache; on the CPU kernel path `--cpu-kernels`, default the engine's
choice, see engine.kernels) the candidate, over the first `--tokens` tokens of the
shipped corpus (default 2048) in windows of `--ctx`.  The base lives in memory only; `run_gate` is
`float_base` then `judge_candidate`, which callers may also run apart, one base for several
candidates (the per-path tests judge every kernel path against one float32 base).  The
bounds (`BOUNDS`) were set from measured values with headroom (quality_testing/README.md gives
both); `judge` is pure and lists every bound crossed.
It does not write base files (ds4-bench kld --save-base does) nor compare other stacks.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import click

from ds4bench import kld
from engine import kernels
from ds4bench.kldstacks import EngineStack
from ds4bench.kldstats import KLDSummary, Scores, summarize, window_rows

DEFAULT_TOKENS = 2048


@dataclass(frozen=True)
class Bounds:
    max_kl_mean: float
    max_kl_p999: float
    min_same_top: float
    max_ppl_ratio_dev: float  # |ratio - 1|
    max_real_flips_share: float  # real flips / positions


# Measured (CPU, float16 cache, 2,044 positions, avx512 path): mean KL 4.2e-5, p99.9 5.8e-4,
# same top 0.997, perplexity ratio 1.0001, no real flips; on 1,022 positions avx512 3.8e-5,
# avx2 3.7e-5, portable 3.7e-5, torch (float16 weights) 1.3e-6.  The mean KL bound is the engine's
# promise for every CPU path (2e-4, about five times the compiled paths'); the others are about
# ten times the measured values, so that a kernel whose rounding moves slightly does not fail
# the gate, while a broken one (KL of 0.01 and more, a few percent of flipped tokens) does.
BOUNDS = Bounds(max_kl_mean=2e-4, max_kl_p999=5e-3, min_same_top=0.98, max_ppl_ratio_dev=0.002,
                max_real_flips_share=0.005)


def judge(s: KLDSummary, b: Bounds = BOUNDS) -> list[str]:
    out = []
    if s.kl_mean.value > b.max_kl_mean:
        out.append(f"mean KL {s.kl_mean.value:.3g} > {b.max_kl_mean:g}")
    if s.kl_p999 > b.max_kl_p999:
        out.append(f"p99.9 KL {s.kl_p999:.3g} > {b.max_kl_p999:g}")
    if s.same_top.value < b.min_same_top:
        out.append(f"same-top rate {s.same_top.value:.4f} < {b.min_same_top:g}")
    if abs(s.ppl_ratio.value - 1) > b.max_ppl_ratio_dev:
        out.append(f"perplexity ratio {s.ppl_ratio.value:.5f} is more than {b.max_ppl_ratio_dev:g} from 1")
    if s.real_flips > b.max_real_flips_share * s.positions:
        out.append(f"{s.real_flips} real argmax flips in {s.positions} positions > {b.max_real_flips_share:.1%}")
    return out


@dataclass(frozen=True)
class FloatBase:
    """The float32 path's scores over the corpus windows of a model: what every packed candidate
    of that model, at that context size, is judged against."""
    model_path: str | None
    ctx: int
    windows: list[list[int]]
    scores: Scores
    header: dict[str, Any]

    @property
    def lengths(self) -> list[int]:
        return [len(w) - 1 for w in self.windows]


def run_gate(model_path: str | None, tokens: int, ctx: int, report=lambda _l: None,
             cpu_kernels: str | None = None) -> tuple[kld.KLDResult, list[str]]:
    """The gate: the float32 base and the packed candidate, both on the `cpu_kernels` path."""
    return judge_candidate(float_base(model_path, tokens, ctx, report, cpu_kernels), report, cpu_kernels)


def float_base(model_path: str | None, tokens: int, ctx: int, report=lambda _l: None,
               cpu_kernels: str | None = None) -> FloatBase:
    """The float32 path scored over the first `tokens` corpus tokens, on one engine thread.  It
    depends on the kernel path only through rounding, so one base may judge several candidates."""
    from engine.threads import EngineThread

    with EngineThread("ds4-gate-kld") as thread:
        return thread.call(_float_base, model_path, tokens, ctx, report, cpu_kernels)


def judge_candidate(base: FloatBase, report=lambda _l: None,
                    cpu_kernels: str | None = None) -> tuple[kld.KLDResult, list[str]]:
    """`base`'s model on the packed path of `cpu_kernels`, scored over its windows and judged; one engine thread."""
    from engine.threads import EngineThread

    with EngineThread("ds4-gate-kld") as thread:
        return thread.call(_judge_candidate, base, report, cpu_kernels)


def _stack(model_path: str | None, ctx: int, weights: str, cpu_kernels: str | None) -> EngineStack:
    from engine import load_model

    return EngineStack(load_model(model_path, ctx=ctx, weights=weights, cpu_kernels=cpu_kernels), weights, None)


def _float_base(model_path: str | None, tokens: int, ctx: int, report, cpu_kernels: str | None) -> FloatBase:
    """Loaded and run on the calling engine thread."""
    _, text = kld.corpus_text(None)
    stack = _stack(model_path, ctx, "float32", cpu_kernels)
    ids = kld.corpus_ids(stack, text, 1, tokens)
    windows = kld.make_windows(ids, ctx, stack.bos_id)
    t0 = time.perf_counter()
    scores, _ = kld.score_windows(stack, windows, kld.DEFAULT_K, None, report)
    report(f"base (float32 path): {len(scores)} positions in {time.perf_counter() - t0:.1f} s")
    return FloatBase(model_path, ctx, windows, scores, {"stack": stack.describe(), "k": kld.DEFAULT_K})


def _judge_candidate(base: FloatBase, report, cpu_kernels: str | None) -> tuple[kld.KLDResult, list[str]]:
    """Loaded and run on the calling engine thread."""
    stack = _stack(base.model_path, base.ctx, "packed", cpu_kernels)
    lengths = base.lengths
    probes = kld.split_rows(base.scores.top_ids, lengths)
    cand, timing = kld.score_windows(stack, base.windows, kld.DEFAULT_K, probes, report)
    summary, kl = summarize(base.scores, cand, lengths)
    result = kld.KLDResult(summary, window_rows(kl, base.scores, cand, lengths), timing, base.header,
                           stack.describe())
    return result, judge(summary)


@click.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help="GGUF (default: the embedded model).")
@click.option("--tokens", type=int, default=DEFAULT_TOKENS, show_default=True, help="Corpus tokens scored.")
@click.option("--ctx", type=int, default=kld.DEFAULT_CTX, show_default=True, help="Tokens per window.")
@click.option("--cpu-kernels", type=click.Choice(kernels.PATHS), default=None,
              help="CPU kernel path of the packed side (default: $DS4_CPU_KERNELS, else the best this CPU runs).")
def main(model: str | None, tokens: int, ctx: int, cpu_kernels: str | None) -> None:
    try:
        result, failures = run_gate(model, tokens, ctx, report=lambda line: click.echo(line, err=True),
                                    cpu_kernels=cpu_kernels)
    except Exception as e:  # ModelLoadError (a path this CPU cannot run) and the like: one line
        click.echo(f"error: {type(e).__name__}: {e}", err=True)
        sys.exit(2)
    click.echo(kld.render_summary(result))
    b = BOUNDS
    click.echo(f"bounds: mean KL <= {b.max_kl_mean:g}, p99.9 KL <= {b.max_kl_p999:g}, same top >= {b.min_same_top:g}, "
               f"|ppl ratio - 1| <= {b.max_ppl_ratio_dev:g}, real flips <= {b.max_real_flips_share:.1%}")
    for f in failures:
        click.echo(f"FAIL  {f}")
    if not failures:
        click.echo("PASS  corpus KLD of the packed path within bounds")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
