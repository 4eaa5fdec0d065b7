"""`ds4`: one-shot generation from a GGUF model, streamed to stdout.

    ds4 -p "Name three primary colors."            # chat-rendered, embedded model
    ds4 --raw -p "def fib(n):" --tokens 64 --temp 0

Text goes to stdout as it is generated; the timing line (prefill and generation tokens/s)
goes to stderr so the output stays pipeable.  Errors are one line on stderr, exit code 1.
The command only parses flags into `GenerateConfig` and calls `run`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import click


@dataclass(frozen=True)
class GenerateConfig:
    prompt: str
    model: str | None = None  # None: $DS4_MODEL or the embedded model
    ctx: int | None = None  # None: the model's training context
    tokens: int = 256  # generation limit
    temp: float = 0.7
    top_k: int = 0
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    system: str | None = None
    raw: bool = False  # send the prompt as-is, without the chat template
    device: str = "cpu"
    weights: str = "packed"


def run(cfg: GenerateConfig, out=sys.stdout, err=sys.stderr) -> int:
    from engine import SamplingParams, generate, load_model

    model = load_model(cfg.model, ctx=cfg.ctx, device=cfg.device, weights=cfg.weights)
    if cfg.raw:
        ids = model.prompt_ids(model.tokenize(cfg.prompt, special=False))
    else:
        messages = ([{"role": "system", "content": cfg.system}] if cfg.system else []) + [
            {"role": "user", "content": cfg.prompt}]
        # Prompt text: a control-token spelling in --prompt or --system stays text.
        ids = model.prompt_ids(model.tokenize_prompt(model.render_prompt(messages)))
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= model.n_ctx:
        raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {model.n_ctx}")
    params = SamplingParams(temperature=cfg.temp, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p, seed=cfg.seed)
    session = model.new_session()
    t0 = time.perf_counter()
    session.sync(ids)
    t1 = time.perf_counter()
    stream = model.text_stream()
    n = 0
    for token in generate(session, params, min(cfg.tokens, model.n_ctx - len(ids))):
        n += 1
        if token in model.eos_ids:
            break
        out.write(stream.push(token))
        out.flush()
    out.write(stream.flush() + "\n")
    t2 = time.perf_counter()
    err.write(f"prefill: {len(ids)} tokens, {len(ids) / (t1 - t0):.1f} tokens/s | "
              f"generation: {n} tokens, {n / max(t2 - t1, 1e-9):.1f} tokens/s | load {model.load_seconds:.2f} s\n")
    return 0


def version_lines() -> tuple[str, bool]:
    """The package's version, torch's, and the CPU kernels the engine would run here and why
    (engine.kernels; building them on first use); False when the path asked for by
    $DS4_CPU_KERNELS cannot run here."""
    import importlib.metadata

    import torch

    from engine import kernels

    try:
        version = importlib.metadata.version("ds4eval")
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed)"
    try:
        chosen = kernels.cpu_kernels()
        cpu, name, ok = chosen.describe(), chosen.name, True
    except kernels.KernelsUnavailable as e:
        cpu, name, ok = f"unavailable: {e}", None, False
    others = [p for p in kernels.host_paths() if p != name]
    return (f"ds4 {version}, torch {torch.__version__}\nCPU kernels: {cpu}\n"
            f"other paths this CPU runs ({kernels.ENV_VAR}=...): {', '.join(others)}"), ok


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        text, ok = version_lines()
        click.echo(text)
        ctx.exit(0 if ok else 1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the version and the CPU kernels this machine runs, then exit.")
@click.option("-p", "--prompt", required=True, help="Prompt text (a user message unless --raw).")
@click.option("-m", "--model", default=None, help="GGUF file (default: $DS4_MODEL or the embedded SmolLM2-135M).")
@click.option("--ctx", type=int, default=None, help="Context size in tokens (default: the model's).")
@click.option("-n", "--tokens", type=click.IntRange(min=1), default=256, show_default=True, help="Max tokens to generate.")
@click.option("--temp", type=click.FloatRange(min=0.0), default=0.7, show_default=True, help="Temperature; 0 is greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=0.95, show_default=True)
@click.option("--min-p", type=click.FloatRange(min=0.0, max=1.0), default=0.05, show_default=True)
@click.option("--seed", type=int, default=None, help="Random seed for reproducible sampling.")
@click.option("--system", default=None, help="System prompt.")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--weights", type=click.Choice(["packed", "float32"]), default="packed", show_default=True,
              help="packed: fast quantized kernels; float32: exact dequantized reference path.")
def main(**kw) -> None:
    """Generate text from a GGUF model."""
    from engine import ModelLoadError

    try:
        sys.exit(run(GenerateConfig(**kw)))
    except (ModelLoadError, ValueError) as e:
        click.echo(f"ds4: error: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("", err=True)
        sys.exit(130)
