"""Random-weight phi3 and Mistral-style llama GGUFs for the tests, and a plain float64 reference.

`write_random_phi3(path, Phi3Spec(...))` writes a loadable GGUF with the tensor names and
metadata keys of llama.cpp's converter: for phi3 the fused `attn_qkv` and `ffn_up` (gate rows,
then up rows), a separate output head, `rope.dimension_count` below the head dim where the spec
asks for partial rotary, the LongRoPE factor tensors and their metadata where asked; for llama
separate q/k/v and gate/up tensors and a tied head.  `attention.sliding_window` is written
where the spec has a window.  The vocabulary is gemma_models' small SentencePiece one.
`reference_logits(path, tokens, n_ctx)` is the forward pass written from those conventions
alone, in float64: weights dequantized by gguf-py, rope on adjacent pairs (llama) or halves
(phi3) of the first rope_dim dimensions, LongRoPE's short or long factors picked by `n_ctx`
against the original context, and the window spelled out as a mask.
Neither produces meaningful text.
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
class Phi3Spec:
    arch: str = "phi3"  # phi3 | llama (a Mistral-style file: the window in llama's metadata)
    qtype: str = "F32"
    n_layer: int = 2
    n_embd: int = 128
    n_ff: int = 96
    n_head: int = 4  # head dim n_embd / n_head, as the files leave it unstated
    n_head_kv: int = 2
    rope_dim: int | None = None  # None: head_dim (written either way)
    n_ctx: int = 64
    window: int | None = 4
    long_rope: bool = False  # LongRoPE factor tensors and metadata
    original_ctx: int = 32
    attn_factor: float | None = None
    rope_base: float = 10000.0
    embed_qtype: str = "Q8_0"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def _encode(w: np.ndarray, qtype: QT) -> np.ndarray:
    return w.astype(np.float32) if qtype == QT.F32 else gq.quantize(w.astype(np.float32), qtype)


def write_random_phi3(path: str | os.PathLike, spec: Phi3Spec) -> str:
    path = os.fspath(path)
    rng = np.random.default_rng(spec.seed)
    a = spec.arch
    tokens, types, scores = vocabulary()
    w = GGUFWriter(path, a)
    w.add_name(f"random-{a}")
    for key, value in [("block_count", spec.n_layer), ("context_length", spec.n_ctx),
                       ("embedding_length", spec.n_embd), ("feed_forward_length", spec.n_ff),
                       ("attention.head_count", spec.n_head), ("attention.head_count_kv", spec.n_head_kv),
                       ("rope.dimension_count", spec.rope_dim or spec.head_dim)]:
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", spec.rope_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    if spec.window is not None:
        w.add_uint32(f"{a}.attention.sliding_window", spec.window)
    if spec.long_rope:
        w.add_uint32(f"{a}.rope.scaling.original_context_length", spec.original_ctx)
        if spec.attn_factor is not None:
            w.add_float32(f"{a}.rope.scaling.attn_factor", spec.attn_factor)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_uint32("tokenizer.ggml.bos_token_id", 2)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)

    qtype, etype = QT[spec.qtype], QT[spec.embed_qtype]

    def matrix(name: str, rows: int, cols: int, t: QT = qtype, scale: float | None = None) -> None:
        m = rng.standard_normal((rows, cols)).astype(np.float32) * (scale or cols ** -0.5)
        w.add_tensor(name, _encode(m, t), raw_dtype=t)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32))

    q_dim, kv_dim = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    matrix("token_embd.weight", len(tokens), spec.n_embd, etype, scale=0.5)
    if spec.long_rope:  # factors near 1 for short contexts, larger (slower turns) for long ones
        half = (spec.rope_dim or spec.head_dim) // 2
        w.add_tensor("rope_factors_short.weight", (1.0 + 0.2 * rng.random(half)).astype(np.float32))
        w.add_tensor("rope_factors_long.weight", (1.0 + 8.0 * rng.random(half)).astype(np.float32))
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", spec.n_embd)
        if a == "phi3":
            matrix(p + "attn_qkv.weight", q_dim + 2 * kv_dim, spec.n_embd)
        else:
            matrix(p + "attn_q.weight", q_dim, spec.n_embd)
            matrix(p + "attn_k.weight", kv_dim, spec.n_embd)
            matrix(p + "attn_v.weight", kv_dim, spec.n_embd)
        matrix(p + "attn_output.weight", spec.n_embd, q_dim)
        norm(p + "ffn_norm.weight", spec.n_embd)
        if a == "phi3":
            matrix(p + "ffn_up.weight", 2 * spec.n_ff, spec.n_embd)
        else:
            matrix(p + "ffn_gate.weight", spec.n_ff, spec.n_embd)
            matrix(p + "ffn_up.weight", spec.n_ff, spec.n_embd)
        matrix(p + "ffn_down.weight", spec.n_embd, spec.n_ff)
    norm("output_norm.weight", spec.n_embd)
    if a == "phi3":
        matrix("output.weight", len(tokens), spec.n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_logits(path: str, tokens: list[int], n_ctx: int | None = None) -> np.ndarray:
    """[T, n_vocab] float64 logits of `tokens` from position 0, for a cache of `n_ctx`
    positions (LongRoPE's choice; default the training context)."""
    r = GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items()}
    a = meta["general.architecture"]
    W = {t.name: gq.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(tuple(reversed(t.shape.tolist())))
         for t in r.tensors}
    n_layer, n_ff = meta[f"{a}.block_count"], meta[f"{a}.feed_forward_length"]
    n_head, n_kv = meta[f"{a}.attention.head_count"], meta[f"{a}.attention.head_count_kv"]
    hd = meta[f"{a}.embedding_length"] // n_head
    rd = meta.get(f"{a}.rope.dimension_count", hd)
    eps, base = meta[f"{a}.attention.layer_norm_rms_epsilon"], meta[f"{a}.rope.freq_base"]
    window = meta.get(f"{a}.attention.sliding_window")
    T = len(tokens)
    pos = np.arange(T)

    inv = base ** (-np.arange(0, rd, 2) / rd)
    magnitude = 1.0
    if "rope_factors_long.weight" in W:
        n_ctx = n_ctx or meta[f"{a}.context_length"]
        long = n_ctx > meta[f"{a}.rope.scaling.original_context_length"]
        inv = inv / W["rope_factors_long.weight" if long else "rope_factors_short.weight"]
        magnitude = meta.get(f"{a}.rope.scaling.attn_factor", 1.0)
    ang = pos[:, None] * inv[None, :]
    cos, sin = (magnitude * np.cos(ang))[:, None, :], (magnitude * np.sin(ang))[:, None, :]

    def rope(x):  # [T, heads, hd]: the first rd dimensions turn, the rest pass
        turned, rest = x[..., :rd], x[..., rd:]
        if a == "llama":  # adjacent pairs
            u, v = turned[..., 0::2], turned[..., 1::2]
            out = np.stack([u * cos - v * sin, v * cos + u * sin], axis=-1).reshape(turned.shape)
        else:  # halves: dimension i with i + rd/2
            u, v = turned[..., : rd // 2], turned[..., rd // 2:]
            out = np.concatenate([u * cos - v * sin, v * cos + u * sin], axis=-1)
        return np.concatenate([out, rest], axis=-1)

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    visible = pos[None, :] <= pos[:, None]  # [query, key]
    if window:
        visible &= pos[:, None] - pos[None, :] < window
    x = W["token_embd.weight"][tokens]
    for i in range(n_layer):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        if p + "attn_qkv.weight" in W:
            qkv = h @ W[p + "attn_qkv.weight"].T
            q, k, v = np.split(qkv, [n_head * hd, (n_head + n_kv) * hd], axis=1)
        else:
            q, k, v = (h @ W[p + f"attn_{n}.weight"].T for n in "qkv")
        q, k = rope(q.reshape(T, n_head, hd)), rope(k.reshape(T, n_kv, hd))
        v = v.reshape(T, n_kv, hd)
        out = np.zeros((T, n_head, hd))
        for hh in range(n_head):
            kv = hh // (n_head // n_kv)
            s = np.where(visible, q[:, hh] @ k[:, kv].T / np.sqrt(hd), -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        if p + "ffn_gate.weight" in W:
            g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        else:  # fused: gate rows first
            g, u = np.split(h @ W[p + "ffn_up.weight"].T, [n_ff], axis=1)
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    return norm(x, W["output_norm.weight"]) @ W.get("output.weight", W["token_embd.weight"]).T
