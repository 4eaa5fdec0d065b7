"""The phi3 family (Phi-3, Phi-3.5 and Phi-4-mini text models): the llama network, other tensors.

A phi3 GGUF describes the llama family's decoder (RMSNorm, grouped-query attention, SwiGLU,
separate output head) with these differences, all taken care of at load time, so the forward
pass, the CPU kernels, batching and the sliding window are engine.models.llama's own:

- q, k and v are one tensor, `attn_qkv.weight` (rows q, then k, then v), and the FFN's gate and
  up halves are one tensor, `ffn_up.weight` (2 * n_ff rows: gate first, then up, the order the
  SwiGLU of llama.cpp and of the checkpoints reads them); files with separate `attn_q/k/v` are
  read as well;
- rope is neox-style (dimension i turns with i + rope_dim/2) and may be partial: only the first
  `phi3.rope.dimension_count` dimensions of a head turn (Phi-4-mini: 96 of 128), the rest pass
  through;
- LongRoPE: `rope_factors_short.weight` and `rope_factors_long.weight` divide the rotated
  pairs' frequencies.  As in llama.cpp, the long factors apply where the context a cache is
  made for exceeds `phi3.rope.scaling.original_context_length` (default: the training
  context), the short ones otherwise; the choice is per cache and fixed for its lifetime, so a
  session's numbers never depend on how far it has got.  `phi3.rope.scaling.attn_factor`,
  where present, scales the rotated pairs (cos and sin) with either table, as llama.cpp (its
  rope attention factor) and transformers' LongRoPE do; absent, it is 1;
- `phi3.attention.sliding_window`, where present, windows every layer (ModelConfig's
  `sliding_window`, honoured by engine.models.llama with llama.cpp's rule: a query sees the
  window's positions up to its own).  llama.cpp's loader currently turns Phi's window off;
  this engine honours what the file states.

`Phi3Model` implements `engine.protocols.Network` and is registered for phi3 in
engine.models.ARCHITECTURES.  It does not read files, tokens or chat templates.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from engine.config import ModelConfig, UnsupportedModel
from engine.gguf_file import GGUFContents, TensorRecord
from engine.kernels import CpuKernels
from engine.models.llama import Block, LlamaModel
from engine.weights import to_float


class Phi3Block(Block):
    @staticmethod
    def qkv_records(t: dict[str, TensorRecord], p: str) -> list[TensorRecord]:
        if p + "attn_qkv.weight" in t:
            return [t[p + "attn_qkv.weight"]]
        return Block.qkv_records(t, p)

    @staticmethod
    def gate_up_records(t: dict[str, TensorRecord], p: str) -> list[TensorRecord]:
        return [t[p + "ffn_up.weight"]]


def _check_fused(cfg: ModelConfig, t: dict[str, TensorRecord]) -> None:
    """Fused tensors of the wrong height would split q/k/v or gate/up in the wrong place silently."""
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        want = {p + "attn_qkv.weight": cfg.q_dim + 2 * cfg.kv_dim, p + "ffn_up.weight": 2 * cfg.n_ff}
        for name, rows in want.items():
            if name in t and t[name].shape[0] != rows:
                raise UnsupportedModel(f"{name} has {t[name].shape[0]} rows, not {rows}")


def original_context(cfg: ModelConfig, meta: Mapping[str, Any]) -> int:
    """The context LongRoPE's short factors serve, up to and including."""
    return int(meta.get(f"{cfg.arch}.rope.scaling.original_context_length") or cfg.n_ctx_train)


class Phi3Model(LlamaModel):
    block_class = Phi3Block

    def __init__(self, cfg: ModelConfig, gguf: GGUFContents, fmt: str, device: torch.device,
                 cpu_kernels: CpuKernels | None = None):
        t = dict(gguf.tensors)
        _check_fused(cfg, t)
        self.original_ctx = original_context(cfg, gguf.metadata)
        self.rope_magnitude = float(gguf.metadata.get(f"{cfg.arch}.rope.scaling.attn_factor") or 1.0)
        super().__init__(cfg, gguf, fmt, device, cpu_kernels)

    def rope_tables(self, t: dict[str, TensorRecord]) -> None:
        """`self.rope` from the short factors (or none), `self.rope_long` from the long ones
        (None without LongRoPE tensors: every context then uses `self.rope`)."""
        inv = self.inverse_frequencies()

        def scaled(name: str) -> torch.Tensor:
            factors = torch.from_numpy(to_float(t[name]).reshape(-1)).double()
            if factors.numel() != inv.numel():
                raise UnsupportedModel(f"{name} has {factors.numel()} factors, not rope dim / 2 = {inv.numel()}")
            return self.rope_table(inv / factors, self.rope_magnitude)

        long_name, short_name = "rope_factors_long.weight", "rope_factors_short.weight"
        self.rope = scaled(short_name) if short_name in t else self.rope_table(inv, self.rope_magnitude)
        self.rope_long = scaled(long_name) if long_name in t else None
        self.rope_by_context = self.rope_long is not None

    def rope_for(self, n_ctx: int) -> torch.Tensor:
        """llama.cpp's rule: the long factors for a context past the original one."""
        return self.rope_long if self.rope_long is not None and n_ctx > self.original_ctx else self.rope
