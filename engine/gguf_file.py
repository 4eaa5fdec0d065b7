"""Read a GGUF file once into immutable records: metadata values and tensor descriptors.

`read_gguf(path)` memory-maps the file through `gguf.GGUFReader`; tensor data stays a
zero-copy numpy view until a loader converts it.  Errors (missing file, not a GGUF, a
truncated file) surface as `GGUFError` with the path in the message.

Which keys and tensors the engine reads (the GGUF mapping):
  general.architecture, general.name                         -> ModelConfig.arch, model name
  {arch}.block_count / context_length / embedding_length /
  feed_forward_length / attention.head_count(_kv) /
  attention.key_length / attention.layer_norm_rms_epsilon /
  rope.freq_base / rope.dimension_count / vocab_size         -> ModelConfig fields
  tokenizer.ggml.* and tokenizer.chat_template                -> engine.tokenizer / engine.chat_template
  token_embd, output_norm, output (optional: tied to token_embd when absent), rope_freqs
  (optional per-dimension frequency factors), and per block N: blk.N.attn_norm,
  attn_q/k/v (+ .bias), attn_q_norm/attn_k_norm, attn_output, ffn_norm, ffn_gate/up/down.
It does not interpret the tensors; see engine.quants and engine.weights.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader


class GGUFError(Exception):
    """The file is missing, unreadable or not a valid GGUF."""


@dataclass(frozen=True)
class TensorRecord:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: (rows, cols) for matrices, i.e. GGUF's ne reversed
    data: np.ndarray  # raw view: typed for float types, uint8 bytes for block formats

    @property
    def n_cols(self) -> int:
        return self.shape[-1]


@dataclass(frozen=True)
class GGUFContents:
    path: str
    metadata: Mapping[str, Any]
    tensors: Mapping[str, TensorRecord]
    file_size: int


def read_gguf(path: str | os.PathLike) -> GGUFContents:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"model file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"not a GGUF file (bad magic {magic!r}): {path}")
    try:
        reader = GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items()}
        tensors = {
            t.name: TensorRecord(
                name=t.name,
                qtype=GGMLQuantizationType(t.tensor_type),
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                data=t.data,
            )
            for t in reader.tensors
        }
    except (ValueError, IndexError, KeyError, OSError, TypeError) as e:
        raise GGUFError(f"cannot read GGUF {path}: {e}") from e
    return GGUFContents(path=path, metadata=metadata, tensors=tensors, file_size=os.path.getsize(path))
