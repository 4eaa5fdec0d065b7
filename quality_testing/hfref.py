"""The independent reference: Hugging Face transformers running the same GGUF in float32.

transformers dequantizes the GGUF's tensors to float32 and runs its own llama
implementation (its own attention, RoPE and norms), so agreement with it checks the
engine's maths, not just its arithmetic. `load_reference(gguf_path)` returns the model
and a tokenizer; `reference_logits(model, ids, positions)` the float32 logits
[len(positions), n_vocab] for the next token after each position, from one forward pass
that keeps only those rows (a 7K-token prompt would otherwise need 1.4 GB of logits).

The tokenizer: transformers' GGUF loader does not know the `smollm` pre-tokenizer name
and falls back to GPT-2's split, which differs only where two or more whitespace
characters precede a digit; for such GGUFs the model's own pre-tokenizer (single digits,
then the byte-level split) is restored so that ids are comparable exactly.
It does not run the engine and writes nothing.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np


def reference_name() -> str:
    import transformers

    return f"transformers-{transformers.__version__}/float32"


def load_reference(gguf_path: str, tokenizer: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) from transformers, float32, in eval mode; takes ~15 s for the embedded model.
    `tokenizer`, when given, is transformers' tokenizer already built from this same GGUF (about 4 s
    saved); its pre-tokenizer is replaced as below, so pass a copy of one that others share."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    folder, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if _gguf_pre(gguf_path) == "smollm":
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return model, tok


def _gguf_pre(path: str) -> str | None:
    from engine.gguf_file import read_gguf

    return read_gguf(path).metadata.get("tokenizer.ggml.pre")


def reference_ids(tok: Any, text: str) -> list[int]:
    """Token ids of a prompt whose special-token text is parsed, as the engine's `prompt_ids` does."""
    return list(tok.encode(text, add_special_tokens=False))


def reference_logits(model: Any, ids: Sequence[int], positions: Sequence[int] | None = None) -> np.ndarray:
    """float32 logits [P, n_vocab] after each position (all positions when None)."""
    import torch

    keep = 0 if positions is None else torch.tensor(list(positions), dtype=torch.long)
    with torch.inference_mode():
        out = model(torch.tensor([list(ids)], dtype=torch.long), logits_to_keep=keep, use_cache=False)
    return out.logits[0].float().numpy()
