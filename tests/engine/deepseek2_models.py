"""Random-weight deepseek2 GGUFs for the family's tests, and a plain float64 reference.

`write_random_deepseek2(path, DeepSeek2Spec(...))` writes a loadable GGUF with the tensor
names, shapes and metadata keys of llama.cpp's converter for deepseek2: multi-head latent
attention (`attn_q`, or `attn_q_a` + `attn_q_a_norm` + `attn_q_b` with a q bottleneck;
`attn_kv_a_mqa`, `attn_kv_a_norm`, and `attn_kv_b` or, as newer conversions write it, its
halves `attn_k_b` [H, kv_lora_rank, nope] and `attn_v_b` [H, v, kv_lora_rank] with the head's
widths in `attention.key_length_mla` / `value_length_mla`), leading dense layers, routed
experts stacked in 3-D tensors with the router `ffn_gate_inp` in F32, the shared experts
`ffn_*_shexp`, and for sigmoid gating the expert bias `exp_probs_b.bias` and expert groups.
Matrices are random in one tensor type; the vocabulary is the small SentencePiece one of
tests/gemma_models.py.
`reference_logits(path, tokens)` is the textbook forward pass written from the GGUF alone
(gguf-py dequantizes the weights), in float64 and without the absorbed projections: every
head's keys and values expanded from the latent, adjacent-pair rope on the decoupled part,
llama.cpp's routing (softmax or sigmoid, bias for the choice only, group-limited top-k,
renormalised and scaled).  Neither produces meaningful text.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf import quants as gq

from gemma_models import vocabulary
from moe_models import read_weights


@dataclass(frozen=True)
class DeepSeek2Spec:
    qtype: str = "F32"  # matrices and experts (Q4_0 needs widths divisible by 32)
    n_layer: int = 3
    n_dense: int = 1  # leading layers with a dense FFN
    n_embd: int = 64
    n_ff: int = 96  # the dense layers' width
    n_head: int = 4
    q_lora_rank: int = 32  # 0: attn_q directly
    kv_lora_rank: int = 32
    nope: int = 16  # a head's unrotated key dimensions
    rope: int = 16  # its rotated ones (shared by all heads for the key)
    v_dim: int = 24
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_shared: int = 1
    gating: str = "softmax"  # softmax (V2: no bias, no groups) | sigmoid (V3: bias, groups)
    n_groups: int = 4  # sigmoid only
    n_groups_used: int = 2
    weights_norm: bool = False
    weights_scale: float = 1.0
    split_kv_b: bool = False  # attn_k_b / attn_v_b instead of attn_kv_b
    yarn_factor: float = 0.0  # > 0: rope.scaling yarn with this factor
    n_ctx: int = 256
    rope_base: float = 10000.0
    router_scale: float = 3.0  # spreads the router's scores so that top-k is clear-cut
    seed: int = 0


def _encode(w: np.ndarray, qtype: QT) -> np.ndarray:
    return w.astype(np.float32) if qtype == QT.F32 else gq.quantize(w.astype(np.float32), qtype)


def write_random_deepseek2(path: str | os.PathLike, spec: DeepSeek2Spec) -> str:
    path = os.fspath(path)
    rng = np.random.default_rng(spec.seed)
    a = "deepseek2"
    tokens, types, scores = vocabulary()
    H, hd = spec.n_head, spec.nope + spec.rope
    w = GGUFWriter(path, a)
    w.add_name("random-deepseek2")
    keys = [("block_count", spec.n_layer), ("context_length", spec.n_ctx), ("embedding_length", spec.n_embd),
            ("feed_forward_length", spec.n_ff), ("attention.head_count", H),
            ("attention.kv_lora_rank", spec.kv_lora_rank), ("rope.dimension_count", spec.rope),
            ("expert_count", spec.n_expert), ("expert_used_count", spec.n_expert_used),
            ("expert_feed_forward_length", spec.n_ff_exp), ("expert_shared_count", spec.n_shared),
            ("leading_dense_block_count", spec.n_dense),
            ("expert_gating_func", 1 if spec.gating == "softmax" else 2)]
    if spec.q_lora_rank:
        keys.append(("attention.q_lora_rank", spec.q_lora_rank))
    if spec.split_kv_b:  # the latent cache's rows as llama.cpp's MQA view, the heads' widths in *_mla
        keys += [("attention.head_count_kv", 1), ("attention.key_length", spec.kv_lora_rank + spec.rope),
                 ("attention.value_length", spec.kv_lora_rank), ("attention.key_length_mla", hd),
                 ("attention.value_length_mla", spec.v_dim)]
    else:
        keys += [("attention.head_count_kv", H), ("attention.key_length", hd), ("attention.value_length", spec.v_dim)]
    if spec.gating == "sigmoid":
        keys += [("expert_group_count", spec.n_groups), ("expert_group_used_count", spec.n_groups_used)]
    for key, value in keys:
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", spec.rope_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{a}.expert_weights_scale", spec.weights_scale)
    w.add_bool(f"{a}.expert_weights_norm", spec.weights_norm)
    if spec.yarn_factor:
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", spec.yarn_factor)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", spec.n_ctx // 4)
        w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_uint32("tokenizer.ggml.bos_token_id", 2)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    w.add_uint32("tokenizer.ggml.padding_token_id", 0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)

    qtype = QT[spec.qtype]

    def random(*shape: int, scale: float | None = None) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * (scale or shape[-1] ** -0.5)

    def tensor(name: str, *shape: int, t: QT = qtype, scale: float | None = None) -> None:
        w.add_tensor(name, _encode(random(*shape, scale=scale), t), raw_dtype=t)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32))

    E, d, f, rank = spec.n_expert, spec.n_embd, spec.n_ff_exp, spec.kv_lora_rank
    tensor("token_embd.weight", len(tokens), d, t=QT.F32, scale=1.0)
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", d)
        if spec.q_lora_rank:
            tensor(p + "attn_q_a.weight", spec.q_lora_rank, d)
            norm(p + "attn_q_a_norm.weight", spec.q_lora_rank)
            tensor(p + "attn_q_b.weight", H * hd, spec.q_lora_rank)
        else:
            tensor(p + "attn_q.weight", H * hd, d)
        tensor(p + "attn_kv_a_mqa.weight", rank + spec.rope, d)
        norm(p + "attn_kv_a_norm.weight", rank)
        kv_b = random(H, spec.nope + spec.v_dim, rank)
        if spec.split_kv_b:  # as llama.cpp's converter splits kv_b_proj
            k_b = np.ascontiguousarray(kv_b[:, : spec.nope].transpose(0, 2, 1))  # [H, rank, nope]
            v_b = np.ascontiguousarray(kv_b[:, spec.nope:])  # [H, v, rank]
            w.add_tensor(p + "attn_k_b.weight", _encode(k_b, qtype), raw_dtype=qtype)
            w.add_tensor(p + "attn_v_b.weight", _encode(v_b, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(p + "attn_kv_b.weight", _encode(kv_b.reshape(-1, rank), qtype), raw_dtype=qtype)
        tensor(p + "attn_output.weight", d, H * spec.v_dim)
        norm(p + "ffn_norm.weight", d)
        if i < spec.n_dense:
            tensor(p + "ffn_gate.weight", spec.n_ff, d)
            tensor(p + "ffn_up.weight", spec.n_ff, d)
            tensor(p + "ffn_down.weight", d, spec.n_ff)
            continue
        tensor(p + "ffn_gate_inp.weight", E, d, t=QT.F32, scale=spec.router_scale * d ** -0.5)
        if spec.gating == "sigmoid":
            w.add_tensor(p + "exp_probs_b.bias", (0.3 * rng.standard_normal(E)).astype(np.float32))
        tensor(p + "ffn_gate_exps.weight", E, f, d)
        tensor(p + "ffn_up_exps.weight", E, f, d)
        tensor(p + "ffn_down_exps.weight", E, d, f)
        if spec.n_shared:
            width = f * spec.n_shared
            tensor(p + "ffn_gate_shexp.weight", width, d)
            tensor(p + "ffn_up_shexp.weight", width, d)
            tensor(p + "ffn_down_shexp.weight", d, width)
    norm("output_norm.weight", d)
    tensor("output.weight", len(tokens), d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclass
class Reference:
    logits: np.ndarray  # [T, n_vocab] float64
    margins: list[float]  # per routed layer and token: the k-th selection score minus the (k+1)-th


def yarn(meta: dict, d: int, base: float) -> tuple[np.ndarray, float]:
    """(inverse frequencies of the rotated pairs, attention logits' factor) written from ggml's
    YaRN definition: per pair, a ramp between the interpolated (divided by the factor) and the
    original frequency over the dimensions whose wavelengths fit 32 to 1 times into the
    original context; logits scaled by (1 + log_multiplier * ln factor)^2."""
    a = "deepseek2"
    inv = base ** (-np.arange(0, d, 2) / d)
    if meta.get(f"{a}.rope.scaling.type") != "yarn":
        return inv, 1.0
    factor, orig = meta[f"{a}.rope.scaling.factor"], meta[f"{a}.rope.scaling.original_context_length"]

    def dim(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0, math.floor(dim(32))), min(d - 1, math.ceil(dim(1)))
    ramp = 1 - np.clip((np.arange(d // 2) - low) / max(0.001, high - low), 0, 1)
    mscale = 1 + meta[f"{a}.rope.scaling.yarn_log_multiplier"] * math.log(factor)
    return inv * (ramp + (1 - ramp) / factor), mscale ** 2


def reference_logits(path: str, tokens: list[int]) -> Reference:
    meta, W = read_weights(path)
    a = "deepseek2"
    n_layer, H = meta[f"{a}.block_count"], meta[f"{a}.attention.head_count"]
    hd = meta.get(f"{a}.attention.key_length_mla", meta[f"{a}.attention.key_length"])
    dv = meta.get(f"{a}.attention.value_length_mla", meta[f"{a}.attention.value_length"])
    rope_d, rank = meta[f"{a}.rope.dimension_count"], meta[f"{a}.attention.kv_lora_rank"]
    nope = hd - rope_d
    eps, base = meta[f"{a}.attention.layer_norm_rms_epsilon"], meta[f"{a}.rope.freq_base"]
    E, k = meta[f"{a}.expert_count"], meta[f"{a}.expert_used_count"]
    sigmoid = meta[f"{a}.expert_gating_func"] == 2
    groups, groups_used = meta.get(f"{a}.expert_group_count", 0), meta.get(f"{a}.expert_group_used_count", 0)
    renorm, wscale = meta[f"{a}.expert_weights_norm"], meta[f"{a}.expert_weights_scale"]
    n_dense = meta[f"{a}.leading_dense_block_count"]
    inv, logit_factor = yarn(meta, rope_d, base)
    T = len(tokens)
    pos = np.arange(T)
    margins: list[float] = []

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x):  # [T, ..., rope_d]: adjacent pairs (2i, 2i+1) turn by position * inv[i]
        ang = pos[:, None] * inv[None, :]
        shape = (T,) + (1,) * (x.ndim - 2) + (rope_d // 2,)
        cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        return out

    def swiglu(h, gate, up, down):
        g = h @ gate.T
        return (g / (1.0 + np.exp(-g)) * (h @ up.T)) @ down.T

    x = W["token_embd.weight"][tokens]
    for i in range(n_layer):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        if p + "attn_q_a.weight" in W:
            q = norm(h @ W[p + "attn_q_a.weight"].T, W[p + "attn_q_a_norm.weight"]) @ W[p + "attn_q_b.weight"].T
        else:
            q = h @ W[p + "attn_q.weight"].T
        q = q.reshape(T, H, hd)
        kv = h @ W[p + "attn_kv_a_mqa.weight"].T
        c, k_pe = norm(kv[:, :rank], W[p + "attn_kv_a_norm.weight"]), rope(kv[:, rank:])
        if p + "attn_kv_b.weight" in W:
            kv_b = W[p + "attn_kv_b.weight"].reshape(H, nope + dv, rank)
            w_k, w_v = kv_b[:, :nope], kv_b[:, nope:]
        else:
            w_k, w_v = W[p + "attn_k_b.weight"].transpose(0, 2, 1), W[p + "attn_v_b.weight"]
        k_nope = np.einsum("hnr,tr->thn", w_k, c)  # every head's keys and values, expanded
        v = np.einsum("hvr,tr->thv", w_v, c)
        keys = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None], (T, H, rope_d))], axis=-1)
        qs = np.concatenate([q[:, :, :nope], rope(q[:, :, nope:])], axis=-1)
        out = np.zeros((T, H, dv))
        for hh in range(H):
            s = np.where(pos[None, :] <= pos[:, None], qs[:, hh] @ keys[:, hh].T * logit_factor / np.sqrt(hd), -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, hh]
        x = x + out.reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        if i < n_dense:
            x = x + swiglu(h, W[p + "ffn_gate.weight"], W[p + "ffn_up.weight"], W[p + "ffn_down.weight"])
            continue
        logits = h @ W[p + "ffn_gate_inp.weight"].T
        if sigmoid:
            probs = 1.0 / (1.0 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
        select = probs + W.get(p + "exp_probs_b.bias", 0.0)
        moe = np.zeros_like(x)
        for t in range(T):
            sel = select[t].copy()
            if groups > 1 and groups_used < groups:
                g = sel.reshape(groups, -1)
                best = np.sort(g, axis=-1)[:, -2:].sum(-1)
                ranked_groups = np.argsort(-best, kind="stable")
                margins.append(float(best[ranked_groups[groups_used - 1]] - best[ranked_groups[groups_used]]))
                for dropped in ranked_groups[groups_used:]:
                    g[dropped] = -np.inf
                sel = g.reshape(-1)
            ranked = np.argsort(-sel, kind="stable")
            chosen = ranked[:k]
            margins.append(float(sel[ranked[k - 1]] - sel[ranked[k]]) if k < E else 1.0)
            weights = probs[t, chosen]
            if renorm:
                weights = weights / weights.sum()
            for e, wt in zip(chosen, weights * wscale):
                moe[t] += wt * swiglu(h[t], W[p + "ffn_gate_exps.weight"][e], W[p + "ffn_up_exps.weight"][e],
                                      W[p + "ffn_down_exps.weight"][e])
        if p + "ffn_up_shexp.weight" in W:
            moe += swiglu(h, W[p + "ffn_gate_shexp.weight"], W[p + "ffn_up_shexp.weight"],
                          W[p + "ffn_down_shexp.weight"])
        x = x + moe
    logits = norm(x, W["output_norm.weight"]) @ W["output.weight"].T
    return Reference(logits, margins)
