"""`ds4-bench kld`: KL divergence of a candidate stack from a reference stack over a text corpus.

    ds4-bench kld --save-base BASE.npz [--stack engine] [-m GGUF] [--weights float32] [--kv-type f32]
                  [--corpus FILE] [--passes N] [--ctx 512] [--top-k 32]
    ds4-bench kld --base BASE.npz [--stack engine|openai|llamacpp] [-m GGUF] [--weights packed] [--kv-type f16]
                  [--url URL] [--tokenizer GGUF] [--tie-gap 0.1] [--csv FILE] [--json FILE]

The corpus (default: `ds4bench/corpus/kld_corpus.txt`, this project's own text: English
prose, Python and C code, French, German, Spanish and Chinese paragraphs, tables of numbers;
`--passes N` repeats its tokens N times, for longer runs) is tokenized without special
tokens and cut into windows of `--ctx` tokens, each starting with BOS where the model adds
one (`make_windows`); a window of n tokens scores its n - 1 next-token distributions.
`--tokens N` keeps only the first N corpus tokens (after the passes), for quick runs.

Before any scoring the stack is asked what the run will send (`LogprobStack.fit_top_k` on the
first window's first tokens): an OpenAI-compatible server that cannot score token-id prompts
stops the run with one line; one that returns fewer log-probs per token than asked has the
base's `--top-k` lowered to its limit (with a note), or, as a candidate, is asked for its
limit, the base's tokens outside its list counting as unknown (with a note).

`--save-base` runs the reference stack and writes the base file (format: kldfile). `--base`
reads it, refuses (exit 2, one line) a base made from another corpus, context size or
tokenizer, or whose windows the candidate tokenizes differently, runs the candidate stack
over the stored windows and reports (statistics defined in kldstats): mean KL with its 95%
interval, median, 99th and 99.9th percentile and max KL, the same-top-token rate with its
interval, both perplexities and their ratio with its interval, RMS Δp, argmax flips split
into near-ties and real flips, the first position whose top token differs, and the speed.
Stacks: kldstacks.STACKS (engine, openai).

CSV columns (`--csv`, one row per window): model, stack, weights, kv_type, device, ctx, k,
window, positions, kl_mean, kl_max, same_top, ppl_base, ppl_cand.  `--json` writes the
configuration, the base's header, the summary, the per-window rows and the timing; with
`--save-base` both hold the base run's positions, perplexity and speed.
It does not judge the figures (quality_testing.gate_kld does, for the release gate).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib import resources
from typing import Any, Callable, Sequence

import click
import numpy as np
from tabulate import tabulate

from ds4bench.csvfile import write_csv
from ds4bench.errors import RunFailure, UsageFailure
from ds4bench.kldfile import BaseData, BaseFileError, check_compatible, read_base, tokens_sha256, write_base
from ds4bench.kldstacks import STACKS, LogprobStack, StackError
from ds4bench.kldstats import DEFAULT_TIE_GAP, KLDSummary, Scores, concat_scores, summarize, window_rows
from ds4eval.atomicfile import write_text_atomic

DEFAULT_CTX = 512
DEFAULT_K = 32
CORPUS_NAME = "kld_corpus.txt"
CSV_COLUMNS = ("model", "stack", "weights", "kv_type", "device", "ctx", "k", "window", "positions", "kl_mean",
               "kl_max", "same_top", "ppl_base", "ppl_cand")


class KLDConfigError(ValueError):
    """A setting that cannot be run; the message says which."""


@dataclass(frozen=True)
class KLDConfig:
    """One `ds4-bench kld` run; each field is one command-line flag."""

    save_base: str | None = None  # --save-base: run the reference stack, write this file
    base: str | None = None  # --base: compare the candidate stack with this file
    stack: str = "engine"  # --stack: a name in kldstacks.STACKS
    model: str | None = None  # -m/--model: GGUF for the engine stack (default: the embedded model)
    weights: str = "packed"  # --weights: engine weight format
    kv_type: str | None = None  # --kv-type: engine KV cache type (default: the engine's)
    device: str = "cpu"
    url: str | None = None  # --url: base URL of an OpenAI-compatible server (openai stack)
    served_model: str | None = None  # --served-model: `model` of its requests
    api_key: str | None = None
    tokenizer: str | None = None  # --tokenizer: GGUF whose tokenizer the server uses (openai stack)
    corpus: str | None = None  # --corpus: UTF-8 text file; None: the shipped corpus
    passes: int = 1  # --passes: the corpus tokens, repeated
    tokens: int | None = None  # --tokens: keep the first N corpus tokens
    ctx: int = DEFAULT_CTX  # --ctx: tokens per window, BOS included
    k: int = DEFAULT_K  # --top-k: base log-probs kept per position
    tie_gap: float = DEFAULT_TIE_GAP  # --tie-gap: base top-2 gap (nats) below which a flip is a near-tie
    threads: int | None = None  # --threads: engine threads (default: the cores other processes leave free)
    csv: str | None = None
    json_path: str | None = None
    no_probe: bool = False  # --no-probe: skip the openai stack's capability probe (echo with log-probs)

    def validate(self) -> None:
        if (self.save_base is None) == (self.base is None):
            raise KLDConfigError("give exactly one of --save-base FILE and --base FILE")
        if self.stack not in STACKS:
            raise KLDConfigError(f"--stack must be one of {', '.join(STACKS)}, not {self.stack!r}")
        if self.ctx < 2:
            raise KLDConfigError(f"--ctx must be at least 2, not {self.ctx}")
        if self.k < 2:
            raise KLDConfigError(f"--top-k must be at least 2, not {self.k}")
        if self.passes < 1:
            raise KLDConfigError(f"--passes must be at least 1, not {self.passes}")
        if self.tokens is not None and self.tokens < 2:
            raise KLDConfigError(f"--tokens must be at least 2, not {self.tokens}")
        if self.threads is not None and self.threads < 1:
            raise KLDConfigError(f"--threads must be at least 1, not {self.threads}")
        if self.stack == "llamacpp" and (self.weights != "packed" or self.kv_type is not None):
            raise KLDConfigError("--weights and --kv-type set the engine stack; llama.cpp computes with the GGUF as it is")
        if self.tie_gap < 0:
            raise KLDConfigError(f"--tie-gap must be >= 0, not {self.tie_gap}")
        for flag, path in (("--save-base", self.save_base), ("--csv", self.csv), ("--json", self.json_path)):
            if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise KLDConfigError(f"{flag} {path}: its directory does not exist")


# ---------------------------------------------------------------- corpus and windows (pure)

def corpus_text(path: str | None) -> tuple[str, str]:
    """(name, text) of the corpus file, or of the shipped one."""
    if path is None:
        return CORPUS_NAME, resources.files("ds4bench").joinpath("corpus", CORPUS_NAME).read_text(encoding="utf-8")
    try:
        with open(path, encoding="utf-8") as f:
            return os.path.basename(path), f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise KLDConfigError(f"--corpus {path}: {getattr(e, 'strerror', None) or e}") from None


def corpus_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def make_windows(ids: Sequence[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    """Consecutive windows of `ctx` tokens: BOS (when given) then ctx - 1 corpus tokens, or ctx
    corpus tokens without BOS.  A last window that would score no position is dropped."""
    body = ctx - 1 if bos_id is not None else ctx
    prefix = [] if bos_id is None else [int(bos_id)]
    out = []
    for start in range(0, len(ids), body):
        w = prefix + [int(t) for t in ids[start: start + body]]
        if len(w) >= 2:
            out.append(w)
    return out


def corpus_ids(stack: LogprobStack, text: str, passes: int, limit: int | None) -> list[int] | None:
    ids = stack.tokenize(text)
    if ids is None:
        return None
    ids = list(ids) * passes
    return ids[:limit] if limit is not None else ids


# ---------------------------------------------------------------- running

@dataclass(frozen=True)
class Timing:
    seconds: float
    positions: int

    @property
    def tokens_per_s(self) -> float:
        return self.positions / self.seconds if self.seconds > 0 else float("nan")


def score_windows(stack: LogprobStack, windows: list[list[int]], k: int, probes: Sequence[np.ndarray] | None,
                  report: Callable[[str], None] = lambda _l: None,
                  clock: Callable[[], float] = time.perf_counter) -> tuple[Scores, Timing]:
    t0, parts, done = clock(), [], 0
    last = t0
    for i, w in enumerate(windows):
        parts.append(stack.score(w, k, None if probes is None else probes[i]))
        done += len(w) - 1
        now = clock()
        if now - last >= 5.0 or i + 1 == len(windows):
            report(f"window {i + 1}/{len(windows)}: {done} positions, {done / (now - t0):.0f} tok/s")
            last = now
    return concat_scores(parts), Timing(clock() - t0, done)


def split_rows(rows: np.ndarray, lengths: Sequence[int]) -> list[np.ndarray]:
    """Per-position rows cut back into windows of the given numbers of positions."""
    out, start = [], 0
    for n in lengths:
        out.append(rows[start: start + n])
        start += n
    return out


def probes_of(base: BaseData) -> list[np.ndarray]:
    return split_rows(base.scores.top_ids, base.window_lengths)


def make_base(cfg: KLDConfig, stack: LogprobStack, report: Callable[[str], None] = lambda _l: None,
              clock: Callable[[], float] = time.perf_counter) -> tuple[BaseData, Timing]:
    name, text = corpus_text(cfg.corpus)
    ids = corpus_ids(stack, text, cfg.passes, cfg.tokens)
    if ids is None:
        raise KLDConfigError(f"stack {cfg.stack} cannot tokenize the corpus (pass --tokenizer GGUF)")
    windows = make_windows(ids, cfg.ctx, stack.bos_id)
    if not windows:
        raise KLDConfigError("the corpus gives no window to score")
    k = stack.fit_top_k(windows[0], cfg.k)
    if k < cfg.k:
        if k < 2:
            raise StackError(f"the stack returns {k} log-prob per token; a base needs at least 2 (--top-k)")
        report(f"note: --top-k {cfg.k} lowered to {k}, the most log-probs per token the stack returns")
    report(f"base: {len(ids)} corpus tokens in {len(windows)} windows of up to {cfg.ctx}")
    scores, timing = score_windows(stack, windows, k, None, report, clock)
    header = {"corpus": {"name": name, "sha256": corpus_sha256(text), "passes": cfg.passes, "tokens": cfg.tokens},
              "tokenizer_sha256": stack.tokenizer_sha256, "ctx": cfg.ctx, "stack": stack.describe(),
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    assert cfg.save_base is not None
    return write_base(cfg.save_base, header, windows, scores), timing


def check_candidate(cfg: KLDConfig, base: BaseData, stack: LogprobStack) -> list[str]:
    """Every reason this candidate cannot be compared with `base`, plus notes (prefixed "note: ")."""
    _, text = corpus_text(cfg.corpus)
    want_tokens = base.header.get("corpus", {}).get("tokens")
    problems = check_compatible(base.header, corpus_sha256=corpus_sha256(text), passes=cfg.passes, ctx=cfg.ctx,
                                tokenizer_sha256=stack.tokenizer_sha256)
    if cfg.tokens != want_tokens:
        problems.append(f"the base was made with --tokens {want_tokens}, not {cfg.tokens}")
    if problems:
        return problems
    ids = corpus_ids(stack, text, cfg.passes, cfg.tokens)
    if ids is None:
        return ["note: the candidate has no tokenizer; it scores the base's stored windows unchecked"]
    windows = make_windows(ids, cfg.ctx, stack.bos_id)
    flat = np.asarray([t for w in windows for t in w], dtype=np.int32)
    if tokens_sha256(flat) != base.header.get("tokens_sha256"):
        return ["the candidate tokenizes the corpus into other windows than the base's"]
    return []


@dataclass
class KLDResult:
    summary: KLDSummary
    windows: list[dict[str, Any]]
    timing: Timing
    base_header: dict[str, Any]
    stack: dict[str, Any]


def compare_with_base(cfg: KLDConfig, base: BaseData, stack: LogprobStack,
                      report: Callable[[str], None] = lambda _l: None,
                      clock: Callable[[], float] = time.perf_counter) -> KLDResult:
    windows = base.windows
    k = int(base.header["k"])
    fitted = stack.fit_top_k(windows[0], k)
    if fitted < k:
        report(f"note: the stack returns at most {fitted} of the base's {k} log-probs per token; base tokens "
               f"outside its list count as unknown (the rest bucket)")
    report(f"candidate: {len(base.scores)} positions in {len(windows)} windows")
    cand, timing = score_windows(stack, windows, fitted, probes_of(base), report, clock)
    summary, kl = summarize(base.scores, cand, base.window_lengths, cfg.tie_gap)
    return KLDResult(summary, window_rows(kl, base.scores, cand, base.window_lengths), timing, base.header,
                     stack.describe())


# ---------------------------------------------------------------- rendering (pure)

def _g(x: float) -> str:
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def render_summary(result: KLDResult) -> str:
    s = result.summary
    base = result.base_header.get("stack", {})
    ff = s.first_flip
    first = "none" if ff is None else (f"position {ff.position} (window {ff.window}, after token {ff.offset}): "
                                       f"base {ff.base_top} -> candidate {ff.cand_top}, base gap {ff.base_gap:.3f}")
    rows = [
        ["positions", f"{s.positions} in {s.windows} windows"],
        ["KL mean [95%]", f"{_g(s.kl_mean.value)} [{_g(s.kl_mean.low)}, {_g(s.kl_mean.high)}]"],
        ["KL median / p99 / p99.9 / max", " / ".join(_g(v) for v in (s.kl_median, s.kl_p99, s.kl_p999, s.kl_max))],
        ["same top token [95%]", f"{s.same_top.value:.4f} [{s.same_top.low:.4f}, {s.same_top.high:.4f}]"],
        ["perplexity base / candidate", f"{s.ppl_base:.4f} / {s.ppl_cand:.4f}"],
        ["perplexity ratio [95%]", f"{s.ppl_ratio.value:.5f} [{s.ppl_ratio.low:.5f}, {s.ppl_ratio.high:.5f}]"],
        ["RMS Δp (next token)", _g(s.rms_dp)],
        ["argmax flips", f"{s.flips}: {s.near_ties} near-ties (base top-2 gap < {s.tie_gap:g} nats), "
                         f"{s.real_flips} real"],
        ["first differing top token", first],
        ["base mass outside top-K (mean)", _g(s.base_rest_mean)],
        ["base top-K known to candidate", f"{s.known_share:.4f}"],
        ["candidate speed", f"{result.timing.positions} positions in {result.timing.seconds:.1f} s, "
                            f"{result.timing.tokens_per_s:.0f} tok/s"],
    ]
    title = f"candidate {_stack_label(result.stack)} vs base {_stack_label(base)}"
    return title + "\n" + tabulate(rows, tablefmt="simple", disable_numparse=True)


def _stack_label(d: dict[str, Any]) -> str:
    if d.get("kind") == "engine":
        return f"engine {d.get('model')} weights={d.get('weights')} kv={d.get('kv_type')} {d.get('device')}"
    return f"{d.get('kind')} {d.get('url') or ''} {d.get('model') or ''}".strip()


def csv_rows(cfg: KLDConfig, result: KLDResult) -> list[dict[str, object]]:
    st = result.stack
    common = {"model": st.get("model"), "stack": st.get("kind"), "weights": st.get("weights"),
              "kv_type": st.get("kv_type"), "device": st.get("device"), "ctx": cfg.ctx, "k": result.base_header["k"]}
    return [{**common, **{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()}}
            for row in result.windows]


def result_json(cfg: KLDConfig, result: KLDResult) -> dict[str, Any]:
    conf = asdict(cfg)
    conf.pop("api_key", None)
    return {"config": conf, "base": result.base_header, "candidate": result.stack, "summary": asdict(result.summary),
            "windows": result.windows, "seconds": result.timing.seconds, "positions": result.timing.positions,
            "tokens_per_s": result.timing.tokens_per_s}


# ---------------------------------------------------------------- command

@click.command("kld")
@click.option("--save-base", type=click.Path(dir_okay=False), default=None,
              help="Run the reference stack over the corpus and write its top-K log-probs here.")
@click.option("--base", type=click.Path(dir_okay=False), default=None,
              help="Compare the candidate stack with this base file.")
@click.option("--stack", type=click.Choice(sorted(STACKS)), default="engine", show_default=True)
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF file of the engine and llamacpp stacks (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--weights", type=click.Choice(["packed", "float32"]), default="packed", show_default=True)
@click.option("--kv-type", type=click.Choice(["f32", "f16", "bf16"]), default=None,
              help="KV cache element type (default: the engine's).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--url", default=None, help="Base URL of an OpenAI-compatible server (--stack openai).")
@click.option("--served-model", default=None, help="`model` of the requests (--stack openai).")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="Bearer token (also $OPENAI_API_KEY).")
@click.option("--tokenizer", type=click.Path(dir_okay=False), default=None,
              help="GGUF whose tokenizer the server uses: tokenizes the corpus and maps token texts to ids.")
@click.option("--corpus", type=click.Path(dir_okay=False), default=None, help="UTF-8 text (default: the shipped corpus).")
@click.option("--passes", type=int, default=1, show_default=True, help="Repeat the corpus tokens this many times.")
@click.option("--tokens", type=int, default=None, help="Keep only the first N corpus tokens.")
@click.option("--ctx", type=int, default=DEFAULT_CTX, show_default=True, help="Tokens per window, BOS included.")
@click.option("--top-k", "k", type=int, default=DEFAULT_K, show_default=True, help="Base log-probs kept per position.")
@click.option("--tie-gap", type=float, default=DEFAULT_TIE_GAP, show_default=True,
              help="A flip whose base top-2 log-prob gap is below this (nats) is a near-tie.")
@click.option("--threads", type=int, default=None,
              help="Engine threads (default: the cores that other processes leave free).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="One row per window.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Config, summary, windows.")
@click.option("--no-probe", is_flag=True, help="--stack openai: skip the capability probe (echo with log-probs).")
def kld_command(save_base: str | None, base: str | None, stack: str, model: str | None, weights: str,
                kv_type: str | None, device: str, url: str | None, served_model: str | None, api_key: str | None,
                tokenizer: str | None, corpus: str | None, passes: int, tokens: int | None, ctx: int, k: int,
                tie_gap: float, threads: int | None, csv_path: str | None, json_path: str | None,
                no_probe: bool) -> int:
    """KL divergence of a candidate stack from a stored reference over a text corpus."""
    from engine import ModelLoadError

    cfg = KLDConfig(save_base=save_base, base=base, stack=stack, model=model, weights=weights, kv_type=kv_type,
                    device=device, url=url, served_model=served_model, api_key=api_key, tokenizer=tokenizer,
                    corpus=corpus, passes=passes, tokens=tokens, ctx=ctx, k=k, tie_gap=tie_gap, threads=threads,
                    csv=csv_path, json_path=json_path, no_probe=no_probe)
    report = lambda line: click.echo(line, err=True)  # noqa: E731
    try:
        cfg.validate()
        corpus_text(cfg.corpus)
        base_data = read_base(cfg.base) if cfg.base else None
        st = STACKS[cfg.stack](cfg)
    except (KLDConfigError, BaseFileError, StackError, ModelLoadError) as e:
        raise UsageFailure(str(e)) from None
    try:
        if base_data is None:
            try:
                data, timing = make_base(cfg, st, report)
            except KLDConfigError as e:
                raise UsageFailure(str(e)) from None
            ppl = float(np.exp(-np.mean(data.scores.target_logprobs, dtype=np.float64)))
            click.echo(f"wrote {cfg.save_base}: {len(data.scores)} positions in {len(data.window_starts) - 1} windows, "
                       f"K {data.header['k']}, perplexity {ppl:.4f}, {timing.seconds:.1f} s "
                       f"({timing.tokens_per_s:.0f} tok/s)")
            if cfg.json_path:
                write_text_atomic(cfg.json_path, json.dumps({"config": {**asdict(cfg), "api_key": None},
                                                             "base": data.header, "perplexity": ppl,
                                                             "seconds": timing.seconds,
                                                             "tokens_per_s": timing.tokens_per_s}, indent=1) + "\n")
            return 0
        problems = check_candidate(cfg, base_data, st)
        errors = [p for p in problems if not p.startswith("note: ")]
        if errors:
            raise UsageFailure(f"{cfg.base}: " + "; ".join(errors))
        for p in problems:
            report(p)
        result = compare_with_base(cfg, base_data, st, report)
    except StackError as e:
        raise RunFailure(str(e)) from None
    except OSError as e:
        raise RunFailure(f"cannot write the output: {e.strerror or e}") from None
    finally:
        st.close()
    click.echo(render_summary(result))
    try:
        if cfg.csv:
            write_csv(cfg.csv, CSV_COLUMNS, csv_rows(cfg, result))
        if cfg.json_path:
            write_text_atomic(cfg.json_path, json.dumps(result_json(cfg, result), indent=1) + "\n")
    except OSError as e:
        raise RunFailure(f"cannot write the output: {e.strerror or e}") from None
    return 0
