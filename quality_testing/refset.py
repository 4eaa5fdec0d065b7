"""The reference set: manifest rows, prompt files, reference-logit files and the GGUF's identity.

manifest.tsv (tab-separated, UTF-8; lines starting with '#' are comments; the first other
line is the header naming these columns in this order):
  id              case name, [a-z0-9_]+, also the reference file's stem (references/<id>.npz)
  prompt          file under prompts/: `.txt` is the prompt text itself (one final newline is
                  dropped, because editors add one), `.json` is a list of chat messages rendered
                  with the GGUF's chat template and a generation prompt
  kind            short | long | chat | code
  positions       comma-separated token positions whose next-token logits are compared;
                  negative counts from the end (-1 is the frontier: the last prompt token)
  max_kl          largest KL(reference || engine), in nats, allowed at any compared position
  min_top1        smallest fraction of the case's positions whose argmax must agree
  max_abs_dlogit  largest |engine - reference| logit allowed at any position
  max_dp_top      largest |Δp| of the reference's top token allowed at any position
  n_tokens        prompt length in tokens when the reference was rendered
  reference       the implementation and version that made the reference, e.g.
                  "transformers-4.57.1/float32"
  gguf_sha256     SHA-256 of the GGUF the reference was computed from
The thresholds bound the engine's default (packed) weights; the float32 path is far inside them.

references/<id>.npz (numpy, compressed) holds:
  ids        int32 [n_tokens]          the prompt's token ids the logits belong to
  positions  int32 [P]                 resolved positions, ascending
  logits     float16 [P, n_vocab]      reference logits at those positions (float16 rounding is
                                       about 0.01 at |logit| near 20, far below the packed path's error)
  meta       0-d str                   JSON: {"gguf_sha256", "reference", "prompt_sha256"}

`sha256_file`, `resolve_positions`, `parse_manifest`/`format_manifest`, `read_manifest` (the
cases, checking that the ids asked for exist) and `prompt_text` are pure or read only what they
are given; `write_reference` writes atomically. It does not run
any model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ds4eval.atomicfile import atomic_path
ROOT = Path(__file__).resolve().parent
MANIFEST = ROOT / "manifest.tsv"
PROMPTS = ROOT / "prompts"
REFERENCES = ROOT / "references"
KINDS = ("short", "long", "chat", "code")
COLUMNS = ("id", "prompt", "kind", "positions", "max_kl", "min_top1", "max_abs_dlogit", "max_dp_top",
           "n_tokens", "reference", "gguf_sha256")
MANIFEST_PREAMBLE = (
    "# Reference logits for the frontier comparisons; format: quality_testing/refset.py.\n"
    "# Regenerate with `python -m quality_testing.render_references` (rewrites references/ and\n"
    "# the n_tokens, reference and gguf_sha256 columns); thresholds are edited by hand.\n"
)


class RefSetError(ValueError):
    """The manifest, a prompt or a reference file is malformed or does not belong to this GGUF."""


@dataclass(frozen=True)
class RefCase:
    id: str
    prompt: str
    kind: str
    positions: str
    max_kl: float
    min_top1: float
    max_abs_dlogit: float
    max_dp_top: float
    n_tokens: int = 0
    reference: str = ""
    gguf_sha256: str = ""

    @property
    def reference_file(self) -> str:
        return f"{self.id}.npz"


def parse_manifest(text: str) -> list[RefCase]:
    rows = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.startswith("#")]
    if not rows:
        raise RefSetError("manifest has no header")
    header = tuple(rows[0][1].split("\t"))
    if header != COLUMNS:
        raise RefSetError(f"manifest header must be {'/'.join(COLUMNS)}, got {'/'.join(header)}")
    out: list[RefCase] = []
    seen: set[str] = set()
    for n, line in rows[1:]:
        cells = line.split("\t")
        if len(cells) != len(COLUMNS):
            raise RefSetError(f"manifest line {n}: {len(cells)} columns, expected {len(COLUMNS)}")
        raw = dict(zip(COLUMNS, cells))
        try:
            case = RefCase(
                id=raw["id"], prompt=raw["prompt"], kind=raw["kind"], positions=raw["positions"],
                max_kl=float(raw["max_kl"]), min_top1=float(raw["min_top1"]),
                max_abs_dlogit=float(raw["max_abs_dlogit"]), max_dp_top=float(raw["max_dp_top"]),
                n_tokens=int(raw["n_tokens"] or 0), reference=raw["reference"], gguf_sha256=raw["gguf_sha256"],
            )
        except ValueError as e:
            raise RefSetError(f"manifest line {n}: {e}") from None
        if not re.fullmatch(r"[a-z0-9_]+", case.id):
            raise RefSetError(f"manifest line {n}: id {case.id!r} must match [a-z0-9_]+")
        if case.id in seen:
            raise RefSetError(f"manifest line {n}: duplicate id {case.id!r}")
        if case.kind not in KINDS:
            raise RefSetError(f"manifest line {n}: kind {case.kind!r} is not one of {', '.join(KINDS)}")
        if not case.prompt.endswith((".txt", ".json")) or "/" in case.prompt:
            raise RefSetError(f"manifest line {n}: prompt {case.prompt!r} must be a .txt or .json file in prompts/")
        parse_positions(case.positions)  # reject bad specs early
        seen.add(case.id)
        out.append(case)
    return out


def read_manifest(path: Path, only: Sequence[str] = ()) -> list[RefCase]:
    """Every case of the manifest file at `path`; RefSetError naming the ids of `only` it lacks."""
    cases = parse_manifest(path.read_text(encoding="utf-8"))
    unknown = sorted(set(only) - {c.id for c in cases})
    if unknown:
        raise RefSetError(f"no such case(s) in the manifest: {', '.join(unknown)}")
    return cases


def format_manifest(cases: Sequence[RefCase]) -> str:
    lines = [MANIFEST_PREAMBLE.rstrip("\n"), "\t".join(COLUMNS)]
    for c in cases:
        cells = [str(getattr(c, name)) for name in COLUMNS]
        if any("\t" in x or "\n" in x for x in cells):
            raise RefSetError(f"case {c.id!r}: a cell contains a tab or newline")
        lines.append("\t".join(cells))
    return "\n".join(lines) + "\n"


def parse_positions(spec: str) -> list[int]:
    try:
        out = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise RefSetError(f"positions {spec!r} must be comma-separated integers") from None
    if not out:
        raise RefSetError("positions must name at least one position")
    return out


def resolve_positions(spec: str, n_tokens: int) -> list[int]:
    """Absolute, ascending, distinct positions in [0, n_tokens); negative counts from the end."""
    out = set()
    for p in parse_positions(spec):
        q = p + n_tokens if p < 0 else p
        if not 0 <= q < n_tokens:
            raise RefSetError(f"position {p} is outside a prompt of {n_tokens} tokens")
        out.add(q)
    return sorted(out)


def read_prompt_file(name: str, prompts_dir: Path = PROMPTS) -> str | list[dict]:
    """The raw text of a .txt prompt, or the message list of a .json one."""
    path = prompts_dir / name
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RefSetError(f"cannot read prompt {path}: {e.strerror}") from None
    if name.endswith(".json"):
        try:
            messages = json.loads(text)
        except json.JSONDecodeError as e:
            raise RefSetError(f"{path}: invalid JSON: {e.msg}") from None
        if not (isinstance(messages, list) and messages
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in messages)):
            raise RefSetError(f"{path}: expected a list of {{role, content}} messages")
        return messages
    return text[:-1] if text.endswith("\n") else text


def prompt_text(source: str | list[dict], render_chat: Callable[[list[dict]], str]) -> str:
    """The prompt string a case feeds the tokenizer (chat messages go through the template)."""
    return render_chat(source) if isinstance(source, list) else source


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Reference:
    ids: np.ndarray  # int32 [n_tokens]
    positions: np.ndarray  # int32 [P]
    logits: np.ndarray  # float16 [P, n_vocab]
    gguf_sha256: str
    reference: str
    prompt_sha256: str


def write_reference(path: Path, ref: Reference) -> None:
    meta = json.dumps({"gguf_sha256": ref.gguf_sha256, "reference": ref.reference,
                       "prompt_sha256": ref.prompt_sha256}, sort_keys=True)
    with atomic_path(path) as tmp:  # keeps the .npz suffix, so numpy does not append one
        np.savez_compressed(tmp, ids=ref.ids.astype(np.int32), positions=ref.positions.astype(np.int32),
                            logits=ref.logits.astype(np.float16), meta=np.array(meta))


def read_reference(path: Path) -> Reference:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            ref = Reference(ids=z["ids"], positions=z["positions"], logits=z["logits"], **meta)
    except FileNotFoundError:
        raise RefSetError(f"reference {path} is missing (run python -m quality_testing.render_references)") from None
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise RefSetError(f"reference {path} is unreadable: {e}") from None
    if ref.logits.shape[0] != ref.positions.shape[0]:
        raise RefSetError(f"reference {path}: {ref.logits.shape[0]} logit rows for {ref.positions.shape[0]} positions")
    return ref


def check_reference(case: RefCase, ref: Reference, gguf_sha256: str) -> None:
    """Refuse a reference that belongs to another checkpoint or another manifest row."""
    if case.gguf_sha256 != gguf_sha256:
        raise RefSetError(f"case {case.id}: the manifest's references were made from GGUF {case.gguf_sha256[:12] or '?'}…, "
                          f"not this model ({gguf_sha256[:12]}…); re-render them for this checkpoint")
    if ref.gguf_sha256 != gguf_sha256:
        raise RefSetError(f"case {case.id}: {case.reference_file} was made from GGUF {ref.gguf_sha256[:12]}…, "
                          f"not this model ({gguf_sha256[:12]}…)")
    if len(ref.ids) != case.n_tokens:
        raise RefSetError(f"case {case.id}: reference has {len(ref.ids)} tokens, manifest says {case.n_tokens}")
    want = resolve_positions(case.positions, len(ref.ids))
    if [int(p) for p in ref.positions] != want:
        raise RefSetError(f"case {case.id}: reference positions {ref.positions.tolist()} differ from the manifest's "
                          f"{want}; re-render")


def with_render(case: RefCase, **changes) -> RefCase:
    return dataclasses.replace(case, **changes)
