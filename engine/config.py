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


# llama.cpp's expert_gating_func values; 0 (unset) is softmax, as llama.cpp reads older files.
EXPERT_GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}


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
    # Mixture-of-experts layers (qwen2moe, qwen3moe, deepseek2); 0 where the family has none.
    n_expert: int = 0  # {arch}.expert_count
    n_expert_used: int = 0  # {arch}.expert_used_count: experts each token is routed to
    n_ff_exp: int = 0  # {arch}.expert_feed_forward_length: one routed expert's hidden width
    n_ff_shexp: int = 0  # {arch}.expert_shared_feed_forward_length: the shared expert's (0: none)
    expert_weights_norm: bool | None = None  # {arch}.expert_weights_norm where stated; None: the family's rule
    # deepseek2 (engine.models.deepseek2): multi-head latent attention and its routing.
    q_lora_rank: int = 0  # {arch}.attention.q_lora_rank: width of q's low-rank bottleneck (0: none)
    kv_lora_rank: int = 0  # {arch}.attention.kv_lora_rank: width of the cached latent
    # {arch}.attention.value_length (value_length_mla where a file has it): a head's value
    # width where it differs from the key's `head_dim`; 0: equal.
    head_dim_v: int = 0
    n_expert_shared: int = 0  # {arch}.expert_shared_count: shared experts fused into one FFN
    expert_weights_scale: float = 1.0  # {arch}.expert_weights_scale: the routed weights' factor
    expert_gating: str = "softmax"  # {arch}.expert_gating_func: "softmax" or "sigmoid" scores
    n_layer_dense_lead: int = 0  # {arch}.leading_dense_block_count: first layers with a dense FFN
    n_expert_groups: int = 0  # {arch}.expert_group_count: groups of experts (0 or 1: no groups)
    n_group_used: int = 0  # {arch}.expert_group_used_count: groups a token's experts come from

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
        # A deepseek2 file converted for llama.cpp's latent cache states a head's own widths in
        # the *_mla keys (its key_length/value_length then describe that cache's rows).
        head_dim = int(meta.get(f"{arch}.attention.key_length_mla") or get("attention.key_length", n_embd // n_head))
        head_dim_v = int(meta.get(f"{arch}.attention.value_length_mla") or meta.get(f"{arch}.attention.value_length")
                         or 0)
        gating = int(meta.get(f"{arch}.expert_gating_func") or 0)
        if gating not in EXPERT_GATING:
            raise UnsupportedModel(f"{arch}.expert_gating_func {gating} (supported: softmax 1, sigmoid 2)")
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
            q_lora_rank=int(meta.get(f"{arch}.attention.q_lora_rank") or 0),
            kv_lora_rank=int(meta.get(f"{arch}.attention.kv_lora_rank") or 0),
            head_dim_v=0 if head_dim_v == head_dim else head_dim_v,
            n_expert_shared=int(meta.get(f"{arch}.expert_shared_count") or 0),
            expert_weights_scale=float(meta.get(f"{arch}.expert_weights_scale") or 1.0),
            expert_gating=EXPERT_GATING[gating],
            n_layer_dense_lead=int(meta.get(f"{arch}.leading_dense_block_count") or 0),
            n_expert_groups=int(meta.get(f"{arch}.expert_group_count") or 0),
            n_group_used=int(meta.get(f"{arch}.expert_group_used_count") or 0),
        )
