"""Model hyper-parameters, derived from GGUF metadata.

`ModelConfig.from_metadata(meta)` validates the architecture against the registry
(engine.models.ARCHITECTURES, which also gives the family's variant switches) and reads the
numbers; an unsupported architecture raises `UnsupportedModel` naming it and the supported ones.
It does not look at tensors (shape checks happen where weights are built).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from engine.models import ARCHITECTURES


class UnsupportedModel(Exception):
    """The GGUF describes an architecture, tensor type or layout the engine cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rope_base: float
    rope_dim: int
    norm_eps: float
    rope_style: str
    qkv_bias: bool
    qk_norm: bool
    # `{arch}.attention.sliding_window`: keys a query sees, itself included (None: all). The llama
    # family windows every layer with it; gemma decides per layer (engine.models.gemma).
    sliding_window: int | None = None
    # Mixture-of-experts layers (qwen2moe, qwen3moe); 0 where the family has none.
    n_expert: int = 0  # {arch}.expert_count
    n_expert_used: int = 0  # {arch}.expert_used_count: experts each token is routed to
    n_ff_exp: int = 0  # {arch}.expert_feed_forward_length: one routed expert's hidden width
    n_ff_shexp: int = 0  # {arch}.expert_shared_feed_forward_length: the shared expert's (0: none)
    expert_weights_norm: bool | None = None  # {arch}.expert_weights_norm where stated; None: the family's rule

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "ModelConfig":
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModel(
                f"unsupported architecture {arch!r} (supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        variant = ARCHITECTURES[arch]

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise UnsupportedModel(f"GGUF metadata lacks {arch}.{key}")
            return value

        n_embd = int(get("embedding_length"))
        n_head = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", n_embd // n_head))
        n_expert = int(meta.get(f"{arch}.expert_count") or 0)
        n_expert_used = int(meta.get(f"{arch}.expert_used_count") or 0)
        n_ff_exp = int(meta.get(f"{arch}.expert_feed_forward_length") or 0)
        # A file without a dense width (an MoE-only stack) takes its experts' for n_ff.
        n_ff = int(get("feed_forward_length", n_ff_exp or None))
        norm = meta.get(f"{arch}.expert_weights_norm")
        tokens = meta.get("tokenizer.ggml.tokens")
        n_vocab = int(get("vocab_size", len(tokens) if tokens is not None else None))
        window = meta.get(f"{arch}.attention.sliding_window")
        return cls(
            arch=arch,
            n_layer=int(get("block_count")),
            n_embd=n_embd,
            n_ff=n_ff,
            n_head=n_head,
            n_head_kv=int(get("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=int(get("context_length")),
            rope_base=float(get("rope.freq_base", 10000.0)),
            rope_dim=int(get("rope.dimension_count", head_dim)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_style=variant.rope_style,
            qkv_bias=variant.qkv_bias,
            qk_norm=variant.qk_norm,
            sliding_window=int(window) if window else None,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            n_ff_exp=n_ff_exp,
            n_ff_shexp=int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            expert_weights_norm=None if norm is None else bool(norm),
        )
