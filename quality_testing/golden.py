"""Golden outputs: greedy 64-token continuations of fixed prompts, stored as token ids.

    python -m quality_testing.golden            # check: exit 1 and show the first divergence
    python -m quality_testing.golden --write    # regenerate golden/*.json from the engine

Each prompt in GOLDEN_PROMPTS (chat messages rendered with the GGUF's template, or raw
text) is tokenized (special tokens parsed) and given BOS by `model.prompt_ids`, prefilled into a fresh session and continued
for exactly N_TOKENS tokens by greedy decoding with the end-of-generation ids masked
(`argmax_ignoring_eos`), so every continuation has the same length however soon the model
would stop. The engine runs on the CPU with its default packed weights: the fast path.

golden/<id>.json: {"id", "prompt" (text or messages), "prompt_ids", "tokens" (the N_TOKENS
continuation ids), "text" (their detokenization, for reading diffs), "n_tokens",
"gguf_sha256", "weights", "device"}.

A change that alters a continuation must regenerate the files in the same commit, with the
logit comparison (compare_frontier_logits) showing why. It does not judge whether the
text is good, only that it did not change.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from ds4eval.atomicfile import write_text_atomic
from quality_testing import refset as rs

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
N_TOKENS = 64
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


@dataclass(frozen=True)
class GoldenMismatch:
    id: str
    message: str


def continuation(model: Any, prompt_ids: list[int], n: int = N_TOKENS) -> list[int]:
    from engine import SamplingParams, generate

    session = model.new_session()
    session.sync(prompt_ids)
    return [int(t) for t in generate(session, SamplingParams(temperature=0.0, argmax_ignoring_eos=True), n)]


def golden_record(model: Any, gid: str, prompt: str | list[dict], gguf_sha256: str) -> dict:
    ids = model.prompt_ids(model.tokenize(rs.prompt_text(prompt, model.render_chat), special=True))
    tokens = continuation(model, ids)
    return {"id": gid, "prompt": prompt, "prompt_ids": ids, "tokens": tokens, "text": model.detokenize(tokens),
            "n_tokens": N_TOKENS, "gguf_sha256": gguf_sha256, "weights": WEIGHTS, "device": DEVICE}


def write_golden(model: Any, gguf_sha256: str, directory: Path = GOLDEN_DIR) -> list[Path]:
    directory.mkdir(exist_ok=True)
    out = []
    for gid, prompt in GOLDEN_PROMPTS.items():
        rec = golden_record(model, gid, prompt, gguf_sha256)
        path = directory / f"{gid}.json"
        write_text_atomic(path, json.dumps(rec, ensure_ascii=False, indent=1) + "\n")
        out.append(path)
    return out


def load_golden(directory: Path = GOLDEN_DIR) -> list[dict]:
    recs = []
    for path in sorted(directory.glob("*.json")):
        rec = json.loads(path.read_text(encoding="utf-8"))
        if rec.get("id") != path.stem or not isinstance(rec.get("tokens"), list):
            raise rs.RefSetError(f"{path}: not a golden record (id must be the file stem, tokens a list)")
        recs.append(rec)
    return recs


def diff_tokens(model: Any, want: list[int], got: list[int]) -> str:
    """Where two continuations part, with a little decoded text either side."""
    i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return (f"diverges at token {i}: expected {want[i:i + 1]} {model.detokenize(want[i:i + 8])!r}, "
            f"got {got[i:i + 1]} {model.detokenize(got[i:i + 8])!r} after {model.detokenize(want[max(0, i - 8):i])!r}")


def check_golden(model: Any, gguf_sha256: str, directory: Path = GOLDEN_DIR) -> list[GoldenMismatch]:
    """Mismatches between the stored continuations and what the engine produces now."""
    recs = load_golden(directory)
    if {r["id"] for r in recs} != set(GOLDEN_PROMPTS):
        return [GoldenMismatch("*", f"golden files {sorted(r['id'] for r in recs)} do not match the prompt set "
                                    f"{sorted(GOLDEN_PROMPTS)}; run python -m quality_testing.golden --write")]
    out = []
    for rec in recs:
        if rec["gguf_sha256"] != gguf_sha256:
            out.append(GoldenMismatch(rec["id"], "made from another GGUF"))
            continue
        if rec["prompt"] != GOLDEN_PROMPTS[rec["id"]]:
            out.append(GoldenMismatch(rec["id"], "prompt differs from GOLDEN_PROMPTS"))
            continue
        ids = model.prompt_ids(model.tokenize(rs.prompt_text(rec["prompt"], model.render_chat), special=True))
        if ids != rec["prompt_ids"]:
            out.append(GoldenMismatch(rec["id"], "the prompt now renders or tokenizes to different ids"))
            continue
        got = continuation(model, ids, rec["n_tokens"])
        if got != rec["tokens"]:
            out.append(GoldenMismatch(rec["id"], diff_tokens(model, rec["tokens"], got)))
    return out


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
        bad = check_golden(m, sha, Path(directory))
    except (rs.RefSetError, OSError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except Exception as e:  # ModelLoadError and the like: one line, no traceback
        click.echo(f"error: {type(e).__name__}: {e}", err=True)
        sys.exit(2)
    for b in bad:
        click.echo(f"FAIL {b.id}: {b.message}")
    click.echo(f"{len(GOLDEN_PROMPTS) - len(bad)}/{len(GOLDEN_PROMPTS)} golden continuations reproduced")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
