"""Random-weight qwen3moe/qwen2moe GGUFs for the family's tests, and a plain float64 reference.

`write_random_moe(path, MoeSpec(...))` writes a loadable GGUF with the tensor names, shapes and
metadata keys of llama.cpp's converter for these families: experts stacked in 3-D tensors
(`blk.N.ffn_{gate,up,down}_exps`, torch order [n_expert, rows, cols]), the router
`ffn_gate_inp` kept in F32 (as llama.cpp's quantizer keeps it), and for qwen2moe the shared
expert (`ffn_{gate,up,down}_shexp`) with its gate `ffn_gate_inp_shexp` [n_embd], plus q/k/v
biases; qwen3moe has per-head q/k norms instead.  Matrices are random in one tensor type; the
vocabulary is the small SentencePiece one of tests/gemma_models.py.
`reference_logits(path, tokens)` is the forward pass written from the families' definitions
and the GGUF alone (gguf-py dequantizes the weights), in float64: softmax routing over all
experts, top-k, renormalised for qwen3moe (or as `expert_weights_norm` says), each token's
experts evaluated one by one.  Neither produces meaningful text.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter
from gguf import quants as gq

from gemma_models import vocabulary


@dataclass(frozen=True)
class MoeSpec:
    arch: str = "qwen3moe"  # qwen3moe | qwen2moe
    qtype: str = "F32"  # matrices and experts (Q4_0 needs widths divisible by 32)
    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 96  # the dense width the converter writes; unused by the MoE blocks
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 64
    n_ff_shexp: int = 128  # qwen2moe only
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_ctx: int = 256
    rope_base: float = 1_000_000.0
    weights_norm: bool | None = None  # written as expert_weights_norm when set
    router_scale: float = 3.0  # spreads the router's probabilities so that top-k is clear-cut
    seed: int = 0


def _encode(w: np.ndarray, qtype: QT) -> np.ndarray:
    return w.astype(np.float32) if qtype == QT.F32 else gq.quantize(w.astype(np.float32), qtype)


def write_random_moe(path: str | os.PathLike, spec: MoeSpec) -> str:
    path = os.fspath(path)
    rng = np.random.default_rng(spec.seed)
    a = spec.arch
    tokens, types, scores = vocabulary()
    w = GGUFWriter(path, a)
    w.add_name(f"random-{a}")
    keys = [("block_count", spec.n_layer), ("context_length", spec.n_ctx), ("embedding_length", spec.n_embd),
            ("feed_forward_length", spec.n_ff), ("attention.head_count", spec.n_head),
            ("attention.head_count_kv", spec.n_head_kv), ("attention.key_length", spec.head_dim),
            ("attention.value_length", spec.head_dim), ("expert_count", spec.n_expert),
            ("expert_used_count", spec.n_expert_used), ("expert_feed_forward_length", spec.n_ff_exp)]
    if a == "qwen2moe":
        keys.append(("expert_shared_feed_forward_length", spec.n_ff_shexp))
    for key, value in keys:
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", spec.rope_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    if spec.weights_norm is not None:
        w.add_bool(f"{a}.expert_weights_norm", spec.weights_norm)
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

    def tensor(name: str, *shape: int, t: QT = qtype, scale: float | None = None) -> None:
        m = rng.standard_normal(shape).astype(np.float32) * (scale or shape[-1] ** -0.5)
        w.add_tensor(name, _encode(m, t), raw_dtype=t)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32))

    def vector(name: str, n: int, scale: float) -> None:
        w.add_tensor(name, (scale * rng.standard_normal(n)).astype(np.float32))

    E, d, f = spec.n_expert, spec.n_embd, spec.n_ff_exp
    q_dim, kv_dim = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    tensor("token_embd.weight", len(tokens), d, t=QT.F32, scale=1.0)
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", d)
        tensor(p + "attn_q.weight", q_dim, d)
        tensor(p + "attn_k.weight", kv_dim, d)
        tensor(p + "attn_v.weight", kv_dim, d)
        if a == "qwen2moe":
            for n, width in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                vector(p + f"attn_{n}.bias", width, 0.1)
        else:
            norm(p + "attn_q_norm.weight", spec.head_dim)
            norm(p + "attn_k_norm.weight", spec.head_dim)
        tensor(p + "attn_output.weight", d, q_dim)
        norm(p + "ffn_norm.weight", d)
        tensor(p + "ffn_gate_inp.weight", E, d, t=QT.F32, scale=spec.router_scale * d ** -0.5)
        tensor(p + "ffn_gate_exps.weight", E, f, d)
        tensor(p + "ffn_up_exps.weight", E, f, d)
        tensor(p + "ffn_down_exps.weight", E, d, f)
        if a == "qwen2moe":
            vector(p + "ffn_gate_inp_shexp.weight", d, d ** -0.5)
            tensor(p + "ffn_gate_shexp.weight", spec.n_ff_shexp, d)
            tensor(p + "ffn_up_shexp.weight", spec.n_ff_shexp, d)
            tensor(p + "ffn_down_shexp.weight", d, spec.n_ff_shexp)
    norm("output_norm.weight", d)
    tensor("output.weight", len(tokens), d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_weights(path: str) -> tuple[dict, dict]:
    """(metadata, float64 tensors in torch order) of a GGUF, as gguf-py reads them."""
    r = GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items()}
    W = {t.name: gq.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(tuple(reversed(t.shape.tolist())))
         for t in r.tensors}
    return meta, W


@dataclass
class Reference:
    logits: np.ndarray  # [T, n_vocab] float64
    margins: list[float]  # per layer and token: the k-th probability minus the (k+1)-th


def reference_logits(path: str, tokens: list[int]) -> Reference:
    meta, W = read_weights(path)
    a = meta["general.architecture"]
    n_layer, n_head, n_kv = meta[f"{a}.block_count"], meta[f"{a}.attention.head_count"], \
        meta[f"{a}.attention.head_count_kv"]
    hd = meta[f"{a}.attention.key_length"]
    eps, base = meta[f"{a}.attention.layer_norm_rms_epsilon"], meta[f"{a}.rope.freq_base"]
    E, k = meta[f"{a}.expert_count"], meta[f"{a}.expert_used_count"]
    renorm = meta.get(f"{a}.expert_weights_norm", a == "qwen3moe")
    T = len(tokens)
    pos = np.arange(T)
    margins: list[float] = []

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x):  # [T, heads, hd]: dimension i turns with i + hd/2 (neox)
        ang = pos[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def silu(g):
        return g / (1.0 + np.exp(-g))

    def swiglu(h, gate, up, down):
        return (silu(h @ gate.T) * (h @ up.T)) @ down.T

    x = W["token_embd.weight"][tokens]
    for i in range(n_layer):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        q, kk, v = (h @ W[p + f"attn_{n}.weight"].T + W.get(p + f"attn_{n}.bias", 0.0) for n in "qkv")
        q, kk, v = q.reshape(T, n_head, hd), kk.reshape(T, n_kv, hd), v.reshape(T, n_kv, hd)
        if p + "attn_q_norm.weight" in W:
            q, kk = norm(q, W[p + "attn_q_norm.weight"]), norm(kk, W[p + "attn_k_norm.weight"])
        q, kk = rope(q), rope(kk)
        out = np.zeros((T, n_head, hd))
        for hh in range(n_head):
            g = hh // (n_head // n_kv)
            s = np.where(pos[None, :] <= pos[:, None], q[:, hh] @ kk[:, g].T / np.sqrt(hd), -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, g]
        x = x + out.reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        logits = h @ W[p + "ffn_gate_inp.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        moe = np.zeros_like(x)
        for t in range(T):
            ranked = np.argsort(-probs[t], kind="stable")
            chosen = ranked[:k]
            weights = probs[t, chosen] / (probs[t, chosen].sum() if renorm else 1.0)
            margins.append(float(probs[t, ranked[k - 1]] - probs[t, ranked[k]]) if k < E else 1.0)
            for e, wt in zip(chosen, weights):
                moe[t] += wt * swiglu(h[t], W[p + "ffn_gate_exps.weight"][e], W[p + "ffn_up_exps.weight"][e],
                                      W[p + "ffn_down_exps.weight"][e])
        if p + "ffn_up_shexp.weight" in W:
            gate = 1.0 / (1.0 + np.exp(-(h @ W[p + "ffn_gate_inp_shexp.weight"])))
            moe += gate[:, None] * swiglu(h, W[p + "ffn_gate_shexp.weight"], W[p + "ffn_up_shexp.weight"],
                                          W[p + "ffn_down_shexp.weight"])
        x = x + moe
    logits = norm(x, W["output_norm.weight"]) @ W["output.weight"].T
    return Reference(logits, margins)
