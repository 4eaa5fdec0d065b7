"""Golden outputs: greedy 64-token continuations of fixed prompts, with each step's top tokens.

    python -m quality_testing.golden            # check: exit 1 and show each prompt's first failing step
    python -m quality_testing.golden --write    # regenerate golden/*.json from the engine

Recording (`--write`).  Each prompt in GOLDEN_PROMPTS (chat messages rendered with the GGUF's
template, or raw text) is tokenized (special tokens parsed) and given BOS by
`model.prompt_ids`, prefilled into a fresh session and continued for exactly N_TOKENS tokens by
greedy decoding with the end-of-generation ids masked (`argmax_ignoring_eos`, the choice
`engine.generate` makes), so every continuation has the same length however soon the model
would stop.  Before each token is chosen, the session's float32 logits row gives the step's
log-probabilities (log_softmax, computed in float64); the TOP_K most likely tokens that greedy
decoding could choose (end-of-generation ids excluded, so the chosen token comes first) are
stored with their log-probabilities rounded to LOGPROB_DIGITS significant digits (at most 5e-5
off below 100 nats).  The engine runs on the CPU with its default packed weights.

Checking is teacher-forced: the prompt is prefilled, and at each step the engine's
log-probabilities are judged against the stored step (`judge_step`), then the *stored* token is
fed, whatever the engine would have chosen, so all N_TOKENS steps are judged even after a
near-tie went the other way.  A prompt passes when
  (a) at every step the engine's greedy token (end-of-generation masked) is the stored one, or,
      where the stored top-2 log-prob gap is below TIE_MARGIN, the stored runner-up;
  (b) at every step, over the stored TOP_K tokens, max |engine log-prob - stored| <=
      LOGPROB_BOUND;
  (c) the mean over its steps of that per-step maximum is <= MEAN_LOGPROB_BOUND (`summarize`).
A failing prompt gives one `GoldenMismatch`, naming its first failing step with the decoded text
around it, the gap and the delta; the other prompts still run.

The bounds are keyed to what the engine promises, not to one machine's bits.  Another CPU takes
another kernel path (engine.kernels: another instruction set, another order of summing a group's
products, or the torch path's float16 weights), so its logits differ in low bits.  The int4 kernels round activations
to bfloat16, which turns such a difference into log-prob differences of a few hundredths of a
nat (the size of the float32 path's distance from the packed one), and at a near-tie into
another greedy token.
The constants come from measurements on the embedded model (quality_testing/README.md, "Golden
outputs"): the engine's own paths against a recording of the packed kernel, and kernels broken
on purpose.
  - TIE_MARGIN (0.2 nats): rounding-size differences move the stored top-2 gap by about 0.1
    nats at the 99th percentile of steps (0.22 at most), torch's int4 kernel (a former fallback) by 0.17 (0.29 at
    most), and flipped tokens only at gaps below 0.08; a flip at a larger gap means the
    distribution moved.  Only the stored top two are accepted: a near-tie does not excuse a
    third token.
  - LOGPROB_BOUND (0.5 nats): one step's largest top-K move is at most 0.29 nats under
    rounding-size differences and 0.23 with torch's int4 kernel; a kernel that drops inputs
    moves single steps by up to 0.9-1.8.
  - MEAN_LOGPROB_BOUND (0.12 nats): averaged over a prompt's steps, rounding-size differences
    give at most 0.052 and torch's int4 kernel 0.084, while every int4 matmul 1% off gives
    0.13-0.17 on every prompt and a dropped input group up to 0.59.  An error smaller than
    torch's own kernel's (a mid-depth layer 1% off, all 0.3% off) cannot be told from another CPU here
    and passes; the frontier comparison and gate_kld judge the logits more finely.
A record without per-step tops (format version 1, token ids only) is refused: regenerate with
`--write`.

golden/<id>.json (format version FORMAT_VERSION, one field a line and one step of "top" a
line): {"version", "id", "prompt" (text or messages), "prompt_ids", "tokens" (the N_TOKENS
continuation ids), "text" (their detokenization, for reading), "n_tokens", "top_k",
"masked_ids" (the end-of-generation ids excluded from the choice), "gguf_sha256", "weights",
"device", "recorded_on" (machine, CPU model and the kernel paths the engine names: for reading
only, never compared), "top" (per step, [id, log-prob] pairs, best first; the first id is that
step's token)}.

A change that moves the logits past the bounds must regenerate the files in the same commit,
with the logit comparison (compare_frontier_logits) showing why.  `judge_step`, `summarize`,
`validate_record`, `top_entries`, `format_record` and `summary_line` are pure; the rest is the
I/O shell around the engine.  It does not judge whether the text is good, only that the engine's
distribution along the stored continuation did not move beyond another CPU's rounding.
"""
from __future__ import annotations

import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, Iterator, Sequence

import click
import numpy as np

from ds4eval.atomicfile import write_text_atomic
from quality_testing import refset as rs

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
FORMAT_VERSION = 2
N_TOKENS = 64
TOP_K = 8
LOGPROB_DIGITS = 6
TIE_MARGIN = 0.2  # nats: below this stored top-2 gap, the runner-up may win (see the docstring)
LOGPROB_BOUND = 0.5  # nats: largest |Δ log-prob| allowed on any stored top-K token at any step
MEAN_LOGPROB_BOUND = 0.12  # nats: largest mean over a prompt's steps of the step's largest |Δ log-prob|
CONTEXT_TOKENS = 8  # decoded tokens shown either side of a failing step
WEIGHTS = "packed"
DEVICE = "cpu"

GOLDEN_PROMPTS: dict[str, str | list[dict]] = {
    "chat_capital": [{"role": "user", "content": "What is the capital of Italy? Answer in one sentence."}],
    "chat_recipe": [{"role": "system", "content": "You are a friendly cook."},
                    {"role": "user", "content": "How do I boil an egg so the yolk stays soft?"}],
    "raw_history": "The first bridge across the river was built of wood, and for a hundred years",
    "code_c": "/* Return the greatest common divisor of a and b. */\nint gcd(int a, int b) {\n",
    "raw_spanish": "Cuando llegamos al puerto, el sol ya se estaba poniendo y",
}


class GoldenFormatError(rs.RefSetError):
    """A golden file is malformed, in an older format, or inconsistent with itself."""


@dataclass(frozen=True)
class GoldenMismatch:
    id: str
    message: str
    step: int | None = None  # the first step failing (a) or (b); None where none did


@dataclass(frozen=True)
class StepVerdict:
    """How the engine's distribution at one step compares with the stored step."""
    stored: int  # the stored greedy token
    chosen: int  # the engine's greedy token now (end-of-generation masked)
    runner_up: int  # the stored second-best token
    gap: float  # stored top-1 minus top-2 log-prob, nats
    near_tie: bool  # gap < tie_margin: the runner-up may win
    argmax_ok: bool
    max_delta: float  # max |engine - stored| log-prob over the stored top-K (nan if the engine gave nan)
    worst: int  # the token of max_delta
    worst_stored: float
    worst_engine: float
    delta_ok: bool

    @property
    def ok(self) -> bool:
        return self.argmax_ok and self.delta_ok

    @property
    def forgiven(self) -> bool:
        """A near-tie that went to the runner-up: accepted, and counted."""
        return self.argmax_ok and self.chosen != self.stored


@dataclass(frozen=True)
class PromptResult:
    """One prompt's steps, judged."""
    id: str
    steps: int
    near_ties: int
    forgiven: int
    failed: int  # steps failing (a) or (b)
    max_delta: float  # the largest step's max |Δ log-prob| (nan where the engine gave nan)
    worst_step: int | None  # that step
    mean_delta: float  # the mean over the steps of their max |Δ log-prob|
    mean_ok: bool
    first_failure: int | None  # index of the first step failing (a) or (b)
    verdicts: tuple[StepVerdict, ...]

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.mean_ok


@dataclass(frozen=True)
class GoldenReport:
    mismatches: tuple[GoldenMismatch, ...]
    prompts: tuple[PromptResult, ...]  # every prompt whose steps were judged, failing or not

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def steps(self) -> int:
        return sum(p.steps for p in self.prompts)

    @property
    def near_ties(self) -> int:
        return sum(p.near_ties for p in self.prompts)

    @property
    def forgiven(self) -> int:
        return sum(p.forgiven for p in self.prompts)

    @property
    def max_delta(self) -> float:
        return _nan_max(p.max_delta for p in self.prompts)

    @property
    def max_mean_delta(self) -> float:
        return _nan_max(p.mean_delta for p in self.prompts)


def _nan_max(values: Iterable[float]) -> float:
    """max that lets a nan through (an engine that gave nan must not look clean)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


# ---- pure judgement -------------------------------------------------------------------------

def round_sig(x: float, digits: int = LOGPROB_DIGITS) -> float:
    return float(f"{x:.{digits}g}")


def top_entries(logprobs: np.ndarray, masked: Collection[int], chosen: int, k: int = TOP_K) -> list[list]:
    """The k most likely tokens greedy decoding could choose, as [id, rounded log-prob] pairs,
    best first, with `chosen` (the engine's own pick) first even where an exact tie would let
    the sort put another id there."""
    lp = np.asarray(logprobs, dtype=np.float64)
    ranked = lp.copy()
    ranked[list(masked)] = -np.inf
    ids = [int(i) for i in np.argsort(-ranked, kind="stable")[:k]]
    if ids[0] != chosen:
        ids = [chosen] + [i for i in ids if i != chosen][: k - 1]
    return [[i, round_sig(float(lp[i]))] for i in ids]


def judge_step(top: Sequence[Sequence], logprobs: Any, masked: Collection[int] = (),
               tie_margin: float = TIE_MARGIN, bound: float = LOGPROB_BOUND) -> StepVerdict:
    """Judge the engine's log-probs (indexable by token id, every id of the vocabulary) at one
    step against the stored step `top` ([id, log-prob] pairs, best first, the stored token
    first).  `masked` ids are excluded from the engine's greedy choice, as in recording."""
    lp = np.asarray(logprobs, dtype=np.float64)
    ranked = lp.copy()
    if masked:
        ranked[list(masked)] = -np.inf
    chosen = int(np.argmax(ranked))  # the lowest id on an exact tie, as the engine's sampler
    (stored, first), (runner_up, second) = (int(top[0][0]), float(top[0][1])), (int(top[1][0]), float(top[1][1]))
    gap = first - second
    near_tie = gap < tie_margin
    argmax_ok = chosen == stored or (near_tie and chosen == runner_up)
    deltas = [(abs(float(lp[int(i)]) - float(s)), int(i), float(s)) for i, s in top]
    nan = next((d for d in deltas if math.isnan(d[0])), None)
    max_delta, worst, worst_stored = nan or max(deltas)
    return StepVerdict(stored=stored, chosen=chosen, runner_up=runner_up, gap=gap, near_tie=near_tie,
                       argmax_ok=argmax_ok, max_delta=max_delta, worst=worst, worst_stored=worst_stored,
                       worst_engine=float(lp[worst]), delta_ok=max_delta <= bound)


def summarize(gid: str, verdicts: Sequence[StepVerdict], mean_bound: float = MEAN_LOGPROB_BOUND) -> PromptResult:
    """A prompt's verdicts, with (c): the mean of the steps' max |Δ log-prob| within mean_bound."""
    first = next((i for i, v in enumerate(verdicts) if not v.ok), None)
    deltas = [v.max_delta for v in verdicts]
    mean = math.fsum(deltas) / len(deltas) if deltas else 0.0
    worst = None
    if deltas:
        worst = next((i for i, d in enumerate(deltas) if math.isnan(d)), None)
        worst = int(np.argmax(deltas)) if worst is None else worst
    return PromptResult(
        id=gid, steps=len(verdicts), near_ties=sum(v.near_tie for v in verdicts),
        forgiven=sum(v.forgiven for v in verdicts), failed=sum(not v.ok for v in verdicts),
        max_delta=_nan_max(deltas), worst_step=worst, mean_delta=mean, mean_ok=mean <= mean_bound,
        first_failure=first, verdicts=tuple(verdicts))


def validate_record(rec: Any, where: str) -> None:
    """Raise GoldenFormatError unless `rec` is a complete record of the current format."""
    if not isinstance(rec, dict) or not isinstance(rec.get("tokens"), list):
        raise GoldenFormatError(f"{where}: not a golden record (tokens must be a list)")
    if rec.get("version") != FORMAT_VERSION or "top" not in rec:
        raise GoldenFormatError(f"{where}: golden record of an older format (token ids without per-step "
                                f"log-probs, version {rec.get('version', 1)}); regenerate with "
                                "python -m quality_testing.golden --write")
    tokens, top = rec["tokens"], rec["top"]
    if not (len(tokens) == rec.get("n_tokens") == len(top)):
        raise GoldenFormatError(f"{where}: tokens, top and n_tokens disagree in length")
    for i, (tok, step) in enumerate(zip(tokens, top)):
        if (not isinstance(step, list) or len(step) < 2
                or not all(isinstance(e, list) and len(e) == 2 for e in step)):
            raise GoldenFormatError(f"{where}: step {i} needs at least two [id, log-prob] pairs")
        if step[0][0] != tok:
            raise GoldenFormatError(f"{where}: step {i} stores token {tok} but its best entry is {step[0][0]}")


def format_record(rec: dict) -> str:
    """The record as JSON, one field a line and one step of `top` a line, so that a diff of two
    recordings shows the steps that moved."""
    lines = []
    for key, value in rec.items():
        if key == "top":
            steps = ",\n".join("  " + json.dumps(step) for step in value)
            lines.append(f' "top": [\n{steps}\n ]')
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


# ---- the engine side ------------------------------------------------------------------------

def log_probs(logits: Any) -> np.ndarray:
    """The log-probabilities of a session's float32 logits row (computed in float64)."""
    import torch

    return torch.log_softmax(logits.detach().cpu().double(), dim=-1).numpy()


def render_ids(model: Any, prompt: str | list[dict]) -> list[int]:
    return model.prompt_ids(model.tokenize(rs.prompt_text(prompt, model.render_chat), special=True))


def record_steps(model: Any, prompt_ids: list[int], n: int = N_TOKENS) -> tuple[list[int], list[list[list]]]:
    """Greedy continuation (end-of-generation masked, the same choice as `engine.generate`)
    and each step's top entries."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, argmax_ignoring_eos=True)
    session = model.new_session()
    session.sync(prompt_ids)
    tokens, top = [], []
    for i in range(n):
        lp = log_probs(session.logits)
        token = int(session.sample(params))
        tokens.append(token)
        top.append(top_entries(lp, model.eos_ids, token))
        if i + 1 < n:
            session.eval(token)
    return tokens, top


def teacher_forced(model: Any, prompt_ids: list[int], tokens: list[int]) -> Iterator[np.ndarray]:
    """The engine's log-probs before each stored token, feeding the stored tokens."""
    session = model.new_session()
    session.sync(prompt_ids)
    for i, token in enumerate(tokens):
        yield log_probs(session.logits)
        if i + 1 < len(tokens):
            session.eval(token)


def recorded_on(model: Any) -> dict:
    """Where a recording was made, for reading only: the engine's kernel paths where it names
    them, else the machine and the CPU's model."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((v.strip() for k, _, v in (line.partition(":") for line in f) if k.strip() == "model name"), "")
    except OSError:
        pass
    out: dict[str, Any] = {"machine": platform.machine(), "cpu": cpu}
    net = getattr(model, "net", None)
    for key in ("kernel_path", "attention_path"):
        value = getattr(net, key, None)
        if isinstance(value, str):
            out[key] = value
    return out


def golden_record(model: Any, gid: str, prompt: str | list[dict], gguf_sha256: str) -> dict:
    ids = render_ids(model, prompt)
    tokens, top = record_steps(model, ids)
    return {"version": FORMAT_VERSION, "id": gid, "prompt": prompt, "prompt_ids": ids, "tokens": tokens,
            "text": model.detokenize(tokens), "n_tokens": N_TOKENS, "top_k": TOP_K,
            "masked_ids": sorted(int(i) for i in model.eos_ids), "gguf_sha256": gguf_sha256,
            "weights": WEIGHTS, "device": DEVICE, "recorded_on": recorded_on(model), "top": top}


def write_golden(model: Any, gguf_sha256: str, directory: Path = GOLDEN_DIR) -> list[Path]:
    directory.mkdir(exist_ok=True)
    out = []
    for gid, prompt in GOLDEN_PROMPTS.items():
        path = directory / f"{gid}.json"
        write_text_atomic(path, format_record(golden_record(model, gid, prompt, gguf_sha256)))
        out.append(path)
    return out


def load_golden(directory: Path = GOLDEN_DIR) -> list[dict]:
    recs = []
    for path in sorted(directory.glob("*.json")):
        rec = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rec, dict) or rec.get("id") != path.stem or not isinstance(rec.get("tokens"), list):
            raise GoldenFormatError(f"{path}: not a golden record (id must be the file stem, tokens a list)")
        validate_record(rec, str(path))
        recs.append(rec)
    return recs


def describe_step(model: Any, rec: dict, i: int, v: StepVerdict) -> str:
    """One step's verdict in words, with the stored text either side of it."""
    before = (rec["prompt_ids"] + rec["tokens"][:i])[-CONTEXT_TOKENS:]
    after = rec["tokens"][i:i + CONTEXT_TOKENS]

    def tok(t: int) -> str:
        return f"{t} {model.detokenize([t])!r}"

    why = []
    if not v.argmax_ok:
        if v.near_tie:
            why.append(f"the engine now chooses {tok(v.chosen)}, neither of the stored top two {tok(v.stored)} and "
                       f"{tok(v.runner_up)} (a near-tie: gap {v.gap:.3g} nats < TIE_MARGIN {TIE_MARGIN})")
        else:
            why.append(f"the engine now chooses {tok(v.chosen)} where {tok(v.stored)} was stored "
                       f"(stored top-2 gap {v.gap:.3g} nats >= TIE_MARGIN {TIE_MARGIN})")
    over = "> LOGPROB_BOUND" if not v.delta_ok else "<= LOGPROB_BOUND"
    why.append(f"|Δlogprob| {v.max_delta:.3g} {over} {LOGPROB_BOUND} for {tok(v.worst)} "
               f"(stored {v.worst_stored:.6g}, engine {v.worst_engine:.6g})")
    return (f"step {i}: {'; '.join(why)}; after {model.detokenize(before)!r}, "
            f"stored continuation {model.detokenize(after)!r}")


def describe_failure(model: Any, rec: dict, result: PromptResult) -> str:
    """Why a prompt failed: its first failing step, else (the mean alone) its worst step."""
    tail = (f"{result.failed} of {result.steps} steps fail; mean |Δlogprob| {result.mean_delta:.3g} "
            f"({'<=' if result.mean_ok else '>'} MEAN_LOGPROB_BOUND {MEAN_LOGPROB_BOUND}), "
            f"max {result.max_delta:.3g}")
    if result.first_failure is not None:
        i = result.first_failure
        return f"fails at {describe_step(model, rec, i, result.verdicts[i])}; {tail}"
    i = result.worst_step
    assert i is not None
    return (f"fails on average, no single step past the bounds ({tail}); worst "
            f"{describe_step(model, rec, i, result.verdicts[i])}")


def check_golden(model: Any, gguf_sha256: str, directory: Path = GOLDEN_DIR) -> GoldenReport:
    """Judge the engine, teacher-forced, against every stored continuation."""
    recs = load_golden(directory)
    if {r["id"] for r in recs} != set(GOLDEN_PROMPTS):
        return GoldenReport((GoldenMismatch("*", f"golden files {sorted(r['id'] for r in recs)} do not match the "
                                                 f"prompt set {sorted(GOLDEN_PROMPTS)}; run python -m "
                                                 "quality_testing.golden --write"),), ())
    bad, results = [], []
    for rec in recs:
        if rec["gguf_sha256"] != gguf_sha256:
            bad.append(GoldenMismatch(rec["id"], "made from another GGUF"))
            continue
        if rec["prompt"] != GOLDEN_PROMPTS[rec["id"]]:
            bad.append(GoldenMismatch(rec["id"], "prompt differs from GOLDEN_PROMPTS"))
            continue
        ids = render_ids(model, rec["prompt"])
        if ids != rec["prompt_ids"]:
            bad.append(GoldenMismatch(rec["id"], "the prompt now renders or tokenizes to different ids"))
            continue
        masked = frozenset(model.eos_ids)
        verdicts = [judge_step(step, lp, masked) for step, lp in zip(rec["top"], teacher_forced(model, ids, rec["tokens"]))]
        result = summarize(rec["id"], verdicts)
        results.append(result)
        if not result.ok:
            bad.append(GoldenMismatch(rec["id"], describe_failure(model, rec, result), result.first_failure))
    return GoldenReport(tuple(bad), tuple(results))


def summary_line(report: GoldenReport, n_prompts: int = len(GOLDEN_PROMPTS)) -> str:
    failed = {b.id for b in report.mismatches}
    passed = 0 if "*" in failed else n_prompts - len(failed)
    s = "" if report.forgiven == 1 else "s"
    return (f"{passed}/{n_prompts} golden continuations reproduced ({report.steps} steps; {report.forgiven} near-tie "
            f"step{s} forgiven, of {report.near_ties} within TIE_MARGIN; max |Δlogprob| {report.max_delta:.2g}, "
            f"largest prompt mean {report.max_mean_delta:.2g})")


@click.command()
@click.option("--write", is_flag=True, help="Regenerate the golden files instead of checking them.")
@click.option("--model", default=None, help="GGUF file (default: the embedded model).")
@click.option("--dir", "directory", default=str(GOLDEN_DIR), show_default=True, help="Golden files folder.")
def main(write: bool, model: str | None, directory: str) -> None:
    """Check (or with --write regenerate) the golden greedy continuations."""
    from engine import default_model_path, load_model

    try:
        path = model or default_model_path()
        m = load_model(path, device=DEVICE, weights=WEIGHTS)
        sha = rs.sha256_file(path)
        if write:
            for p in write_golden(m, sha, Path(directory)):
                click.echo(p)
            return
        report = check_golden(m, sha, Path(directory))
    except (rs.RefSetError, OSError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except Exception as e:  # ModelLoadError and the like: one line, no traceback
        click.echo(f"error: {type(e).__name__}: {e}", err=True)
        sys.exit(2)
    for b in report.mismatches:
        click.echo(f"FAIL {b.id}: {b.message}")
    if report.mismatches:
        click.echo(f"recorded on {load_recorded_on(Path(directory))}; checked on {recorded_on(m)}")
    click.echo(summary_line(report))
    sys.exit(1 if report.mismatches else 0)


def load_recorded_on(directory: Path) -> Any:
    """The recording machine(s) named by the files, for a failure's note (never compared)."""
    seen = []
    for path in sorted(directory.glob("*.json")):
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get("recorded_on")
        except (OSError, ValueError, AttributeError):
            continue
        if value is not None and value not in seen:
            seen.append(value)
    return seen[0] if len(seen) == 1 else seen


if __name__ == "__main__":
    main()
