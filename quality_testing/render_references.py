"""Render the reference logits of every manifest case with transformers (float32) on the same GGUF.

    python -m quality_testing.render_references [--model PATH] [--only ID ...] [--new-checkpoint]

For each case: the prompt is rendered (chat messages through the GGUF's template, as the
engine renders them) and tokenized by the engine; transformers' tokenizer must produce the
same ids, else the case is refused (the comparison would then measure tokenization, not
logits). transformers' logits at the case's positions are stored as float16 in
references/<id>.npz, and the manifest row gets the prompt length, the reference's name and
version and the GGUF's sha256.

A manifest whose references were made from another GGUF is refused unless
`--new-checkpoint` is given, and then every case is re-rendered, so the set never mixes
checkpoints. Thresholds are left as they are. Files are written atomically; the manifest
last. It does not compare anything (see compare_frontier_logits).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from quality_testing import hfref
from quality_testing import refset as rs


@dataclass(frozen=True)
class RenderConfig:
    """One render run; each field is one command-line flag."""

    model: str | None = None  # GGUF path; None: the embedded model
    manifest: str = str(rs.MANIFEST)  # manifest to read and update
    only: tuple[str, ...] = ()  # case ids to render; empty: all
    new_checkpoint: bool = False  # allow replacing references made from another GGUF


def render(cfg: RenderConfig, echo=click.echo) -> list[rs.RefCase]:
    from engine import default_model_path, load_model

    path = cfg.model or default_model_path()
    manifest_path = Path(cfg.manifest)
    cases = rs.read_manifest(manifest_path, cfg.only)
    sha = rs.sha256_file(path)
    foreign = sorted({c.gguf_sha256 for c in cases if c.gguf_sha256 and c.gguf_sha256 != sha})
    if foreign and not cfg.new_checkpoint:
        raise rs.RefSetError(f"the manifest's references come from another GGUF ({', '.join(s[:12] for s in foreign)}…), "
                             f"not {sha[:12]}…; pass --new-checkpoint to re-render them all for this one")
    if cfg.new_checkpoint and cfg.only:
        raise rs.RefSetError("--new-checkpoint re-renders every case; it cannot be combined with --only")
    model = load_model(path, weights="float32")
    echo(f"loading transformers reference for {path} …")
    hf, tok = hfref.load_reference(path)
    name = hfref.reference_name()
    prompts_dir = manifest_path.parent / "prompts"
    refs_dir = manifest_path.parent / "references"
    refs_dir.mkdir(exist_ok=True)
    out: list[rs.RefCase] = []
    for case in cases:
        if cfg.only and case.id not in cfg.only:
            out.append(case)
            continue
        t0 = time.perf_counter()
        text = rs.prompt_text(rs.read_prompt_file(case.prompt, prompts_dir), model.render_chat)
        ids = model.prompt_ids(model.tokenize(text, special=True))
        ref_ids = hfref.reference_ids(tok, text)
        if model.add_bos and model.bos_id is not None and ref_ids[:1] != [model.bos_id]:
            ref_ids = [model.bos_id] + ref_ids
        if ids != ref_ids:
            first = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
            raise rs.RefSetError(f"case {case.id}: engine and transformers tokenize the prompt differently "
                                 f"(first difference at token {first})")
        if len(ids) > model.n_ctx:
            raise rs.RefSetError(f"case {case.id}: {len(ids)} tokens exceed the model's context of {model.n_ctx}")
        positions = rs.resolve_positions(case.positions, len(ids))
        logits = hfref.reference_logits(hf, ids, positions)
        ref = rs.Reference(ids=np.asarray(ids, dtype=np.int32), positions=np.asarray(positions, dtype=np.int32),
                           logits=logits.astype(np.float16), gguf_sha256=sha, reference=name,
                           prompt_sha256=rs.sha256_text(text))
        rs.write_reference(refs_dir / case.reference_file, ref)
        out.append(rs.with_render(case, n_tokens=len(ids), reference=name, gguf_sha256=sha))
        echo(f"{case.id:<16} {len(ids):5d} tokens  positions {positions}  {time.perf_counter() - t0:5.1f} s")
    tmp = manifest_path.with_name(manifest_path.name + ".tmp.write")
    tmp.write_text(rs.format_manifest(out), encoding="utf-8")
    tmp.replace(manifest_path)
    total = sum(p.stat().st_size for p in refs_dir.glob("*.npz"))
    echo(f"wrote {len(out)} manifest rows; references take {total / 1e6:.2f} MB")
    return out


@click.command()
@click.option("--model", default=None, help="GGUF file (default: the embedded model).")
@click.option("--manifest", default=str(rs.MANIFEST), show_default=True, help="Manifest to read and update.")
@click.option("--only", multiple=True, help="Render only this case id (repeatable).")
@click.option("--new-checkpoint", is_flag=True, help="Replace references made from another GGUF (renders all).")
def main(model, manifest, only, new_checkpoint) -> None:
    """Render reference logits with transformers (float32) into quality_testing/references/."""
    cfg = RenderConfig(model=model, manifest=manifest, only=tuple(only), new_checkpoint=new_checkpoint)
    try:
        render(cfg)
    except (rs.RefSetError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except Exception as e:  # ModelLoadError and transformers' own errors: one line, no traceback
        click.echo(f"error: {type(e).__name__}: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
