"""The architecture registry: GGUF `general.architecture` -> the network that runs it.

Each entry names the module under engine/models/ and the class in it that implements
`engine.protocols.Network` for that architecture, plus the variant switches the family's
config reads (`ModelConfig.rope_style`, `qkv_bias`, `qk_norm`).  A new family is one module
here and one line in `ARCHITECTURES`; nothing else in the engine learns its name.
Entries are looked up lazily (`network_class` imports the module on first use), so this
module imports nothing of the engine and the config can read the table without a cycle.
It does not build networks (engine.model does) nor read GGUF files.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One registry entry: where its network class lives and the family's variant switches."""

    module: str  # engine.models.<module>
    network: str  # the class, called as network(cfg, gguf_contents, weights_format, device, cpu_kernels)
    # "norm" rotates adjacent pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM, which the llama converter
    # prepares q/k weights for); "neox" rotates dimension i with i + head_dim/2.
    rope_style: str = "norm"
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaModel"),
    "qwen2": Architecture("llama", "LlamaModel", rope_style="neox", qkv_bias=True),
    "qwen3": Architecture("llama", "LlamaModel", rope_style="neox", qk_norm=True),
    # Routed experts (and qwen2moe's shared one) on the llama attention: engine.models.qwen_moe.
    "qwen2moe": Architecture("qwen_moe", "QwenMoeModel", rope_style="neox", qkv_bias=True),
    "qwen3moe": Architecture("qwen_moe", "QwenMoeModel", rope_style="neox", qk_norm=True),
    # Soft-capping, window pattern and rope bases come from engine.models.gemma's own table.
    "gemma2": Architecture("gemma", "GemmaModel", rope_style="neox"),
    "gemma3": Architecture("gemma", "GemmaModel", rope_style="neox", qk_norm=True),
    # The llama network with fused tensors and LongRoPE tables (engine.models.phi3).
    "phi3": Architecture("phi3", "Phi3Model", rope_style="neox"),
    # Multi-head latent attention with a latent cache, routed and shared experts (engine.models.deepseek2).
    "deepseek2": Architecture("deepseek2", "DeepSeek2Model"),
}


def network_class(arch: str) -> type:
    """The network class registered for `arch` (a KeyError names an unregistered one)."""
    entry = ARCHITECTURES[arch]
    return getattr(importlib.import_module(f"engine.models.{entry.module}"), entry.network)


__all__ = ["ARCHITECTURES", "Architecture", "network_class"]
