"""`ds4-bench random-gguf`: a GGUF shaped like a real model, with random weights.

For benchmarking where the real weights cannot travel (a GPU machine): `spec_like(path)`
reads a GGUF's hyper-parameters and tensor types (not its weights) and returns an
`engine.synthetic.RandomModelSpec` with the same architecture, layer count, widths, head
layout, context length, RoPE base, tied or separate output matrix and tokenizer metadata;
`write_like(out, like, ...)` writes the random model through `engine.synthetic`.

Tensor types: every layer matrix gets one type, `qtype` when given, else the one most
common among the real model's layer matrices; the embedding keeps the real model's type
when the writer supports it, else takes `qtype`. Q4_0/Q4_1/Q8_0/F16/BF16/F32 weights are
quantized from Gaussian noise; Q4_K/Q6_K are random blocks with small scales.
It does not reproduce mixed per-tensor types (Q4_K_M's Q6_K tensors become the common
type), RoPE frequency-factor tensors or RoPE scaling keys, and the output is not a usable
language model: it is for speed, never for quality.
"""
from __future__ import annotations

import os
from collections import Counter

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, LlamaFileType

from engine import ModelConfig, UnsupportedModel
from engine.synthetic import RandomModelSpec, write_random_gguf

# What engine.synthetic can write.
WRITABLE_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
EMBEDDING = "token_embd.weight"


class RandomGGUFError(ValueError):
    """The reference GGUF cannot be imitated; the message says why."""


def _scalar_metadata(reader: GGUFReader) -> tuple[dict, int | None]:
    """Scalar metadata and the vocabulary's length; arrays are not decoded (slow, and unused here)."""
    meta = {k: f.contents() for k, f in reader.fields.items() if f.types and f.types[0] != GGUFValueType.ARRAY}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return meta, (len(tokens.data) if tokens is not None else None)


def dominant_qtype(tensor_types: dict[str, str]) -> str:
    """The most common type among 2-D layer matrices (ties: the first seen)."""
    layer = [t for name, t in tensor_types.items() if name.startswith("blk.")]
    if not layer:
        raise RandomGGUFError("the model has no layer matrices")
    return Counter(layer).most_common(1)[0][0]


def spec_from(meta: dict, n_tokens: int | None, matrix_types: dict[str, str], has_output: bool, like: str,
              qtype: str | None, seed: int) -> RandomModelSpec:
    """Pure part of spec_like: scalar metadata, vocabulary length and 2-D tensor types -> a spec."""
    vocab_key = f"{meta.get('general.architecture')}.vocab_size"
    if n_tokens is not None and vocab_key not in meta:
        meta = {**meta, vocab_key: n_tokens}
    try:
        cfg = ModelConfig.from_metadata(meta)
    except UnsupportedModel as e:
        raise RandomGGUFError(str(e)) from None
    layer_type = qtype or dominant_qtype(matrix_types)
    if layer_type not in WRITABLE_QTYPES:
        raise RandomGGUFError(f"the model's layer matrices are {layer_type}, which cannot be written at random; "
                              f"pass --qtype (one of {', '.join(WRITABLE_QTYPES)})")
    embed_type = matrix_types.get(EMBEDDING, layer_type)
    if embed_type not in WRITABLE_QTYPES:
        embed_type = layer_type
    extra = {}
    file_type = "ALL_F32" if layer_type == "F32" else f"MOSTLY_{layer_type}"
    if file_type in LlamaFileType.__members__:
        extra["general.file_type"] = int(LlamaFileType[file_type])
    return RandomModelSpec(
        arch=cfg.arch, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_ff=cfg.n_ff, n_head=cfg.n_head,
        n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, n_ctx=cfg.n_ctx_train, qtype=layer_type,
        embed_qtype=embed_type, tied_output=not has_output, rope_base=cfg.rope_base, seed=seed,
        tokenizer_from=like, name=f"random {meta.get('general.name') or os.path.basename(like)}",
        extra_metadata=extra,
    )


def spec_like(like: str, qtype: str | None = None, seed: int = 0) -> RandomModelSpec:
    if not os.path.isfile(like):
        raise RandomGGUFError(f"--like model not found: {like}")
    try:
        reader = GGUFReader(like)
    except (ValueError, OSError) as e:
        raise RandomGGUFError(f"cannot read {like} as GGUF: {e}") from None
    meta, n_tokens = _scalar_metadata(reader)
    types = {t.name: GGMLQuantizationType(t.tensor_type).name for t in reader.tensors if len(t.shape) == 2}
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return spec_from(meta, n_tokens, types, has_output, like, qtype, seed)


def write_like(out: str, like: str, qtype: str | None = None, seed: int = 0) -> RandomModelSpec:
    spec = spec_like(like, qtype, seed)
    try:
        write_random_gguf(out, spec)
    except ValueError as e:  # a width that is not a multiple of the chosen block size
        raise RandomGGUFError(str(e)) from None
    return spec
