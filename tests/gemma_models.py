"""Random-weight gemma2/gemma3 GGUFs for the family's tests (the engine's and the disk cache's),
and a plain float64 reference.

`write_random_gemma(path, GemmaSpec(...))` writes a loadable GGUF with the tensor names and
metadata keys llama.cpp's converter writes for Gemma (norm weights stored as 1 + w, as the
converter stores them), random weights of one tensor type, and a small SentencePiece
vocabulary with Gemma's control tokens (`<bos>`, `<eos>`, `<start_of_turn>`, `<end_of_turn>`).
`reference_logits(path, tokens)` is the forward pass written from the Gemma papers'
definitions and the GGUF conventions alone (weights dequantized by gguf-py, norms with the
1 + w of the checkpoints, windowed causal masks spelled out position by position), in float64.
Neither produces meaningful text.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter
from gguf import quants as gq

# Blocks of the k-quant types: (values per block, bytes per block, offsets of the f16 scale fields).
_KQUANT = {QT.Q4_K: (256, 144, (0, 2)), QT.Q6_K: (256, 210, (208,))}

CONTROL, NORMAL, BYTE = 3, 1, 6
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["\u2581", "\u2581t", "he", "\u2581the", "user", "model", "\u2581a"]


@dataclass(frozen=True)
class GemmaSpec:
    arch: str = "gemma3"  # gemma2 | gemma3
    qtype: str = "F32"
    n_layer: int = 6
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_ctx: int = 256
    window: int | None = 4
    pattern: int | None = None  # None: the family's own (not written)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_base: float = 1_000_000.0
    local_rope_base: float | None = None  # written as rope.freq_base_swa when set
    rope_scale: float | None = None  # linear rope scaling (global layers), written when set
    embed_qtype: str = "Q8_0"
    seed: int = 0


def vocabulary() -> tuple[list[str], list[int], list[float]]:
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [CONTROL] * len(SPECIALS) + [BYTE] * 256 + [NORMAL] * len(PIECES)
    scores = [0.0] * (len(SPECIALS) + 256) + [-float(i) for i in range(len(PIECES))]
    return tokens, types, scores


def _random_kquant(qtype: QT, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    per, nbytes, offsets = _KQUANT[qtype]
    rows, cols = w.shape
    raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    for off in offsets:  # small valid scales, so that the values stay in a sane range
        d = (rng.random((rows, cols // per, 1)) * 0.0002 + 0.00005).astype(np.float16)
        raw[..., off: off + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


def _encode(w: np.ndarray, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    if qtype == QT.F32:
        return w.astype(np.float32)
    if qtype in _KQUANT:
        return _random_kquant(qtype, w, rng)
    return gq.quantize(w.astype(np.float32), qtype)


def write_random_gemma(path: str | os.PathLike, spec: GemmaSpec) -> str:
    path = os.fspath(path)
    rng = np.random.default_rng(spec.seed)
    a = spec.arch
    tokens, types, scores = vocabulary()
    w = GGUFWriter(path, a)
    w.add_name(f"random-{a}")
    for key, value in [("block_count", spec.n_layer), ("context_length", spec.n_ctx),
                       ("embedding_length", spec.n_embd), ("feed_forward_length", spec.n_ff),
                       ("attention.head_count", spec.n_head), ("attention.head_count_kv", spec.n_head_kv),
                       ("attention.key_length", spec.head_dim), ("attention.value_length", spec.head_dim)]:
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", spec.rope_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    if spec.window is not None:
        w.add_uint32(f"{a}.attention.sliding_window", spec.window)
    if spec.pattern is not None:
        w.add_uint32(f"{a}.attention.sliding_window_pattern", spec.pattern)
    if spec.local_rope_base is not None:
        w.add_float32(f"{a}.rope.freq_base_swa", spec.local_rope_base)
    if spec.rope_scale is not None:
        w.add_string(f"{a}.rope.scaling.type", "linear")
        w.add_float32(f"{a}.rope.scaling.factor", spec.rope_scale)
    if spec.attn_softcap is not None:
        w.add_float32(f"{a}.attn_logit_softcapping", spec.attn_softcap)
    if spec.final_softcap is not None:
        w.add_float32(f"{a}.final_logit_softcapping", spec.final_softcap)
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

    qtype, etype = QT[spec.qtype], QT[spec.embed_qtype]

    def matrix(name: str, rows: int, cols: int, t: QT = qtype, scale: float | None = None) -> None:
        m = rng.standard_normal((rows, cols)).astype(np.float32) * (scale or cols ** -0.5)
        w.add_tensor(name, _encode(m, t, rng), raw_dtype=t)

    def norm(name: str, n: int) -> None:  # stored as 1 + w, w small, as the converter writes it
        w.add_tensor(name, (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32))

    q_dim, kv_dim = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    matrix("token_embd.weight", len(tokens), spec.n_embd, etype, scale=0.2)
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", spec.n_embd)
        matrix(p + "attn_q.weight", q_dim, spec.n_embd)
        matrix(p + "attn_k.weight", kv_dim, spec.n_embd)
        matrix(p + "attn_v.weight", kv_dim, spec.n_embd)
        if a == "gemma3":
            norm(p + "attn_q_norm.weight", spec.head_dim)
            norm(p + "attn_k_norm.weight", spec.head_dim)
        matrix(p + "attn_output.weight", spec.n_embd, q_dim)
        norm(p + "post_attention_norm.weight", spec.n_embd)
        norm(p + "ffn_norm.weight", spec.n_embd)
        matrix(p + "ffn_gate.weight", spec.n_ff, spec.n_embd)
        matrix(p + "ffn_up.weight", spec.n_ff, spec.n_embd)
        matrix(p + "ffn_down.weight", spec.n_embd, spec.n_ff)
        norm(p + "post_ffw_norm.weight", spec.n_embd)
    norm("output_norm.weight", spec.n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclass
class Reference:
    logits: np.ndarray  # [T, n_vocab] float64, after any final soft-capping
    max_score: float  # the largest |attention score| before soft-capping
    max_logit: float  # the largest |logit| before soft-capping


def reference_logits(path: str, tokens: list[int]) -> Reference:
    r = GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items()}
    a = meta["general.architecture"]
    W = {t.name: gq.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(tuple(reversed(t.shape.tolist())))
         for t in r.tensors}
    n_layer, n_embd = meta[f"{a}.block_count"], meta[f"{a}.embedding_length"]
    n_head, n_kv, hd = meta[f"{a}.attention.head_count"], meta[f"{a}.attention.head_count_kv"], \
        meta[f"{a}.attention.key_length"]
    eps = meta[f"{a}.attention.layer_norm_rms_epsilon"]
    window = meta.get(f"{a}.attention.sliding_window")
    pattern = meta.get(f"{a}.attention.sliding_window_pattern", {"gemma2": 2, "gemma3": 6}[a])
    global_base = meta[f"{a}.rope.freq_base"]
    local_base = meta.get(f"{a}.rope.freq_base_swa", 10000.0 if a == "gemma3" else global_base)
    global_scale = meta.get(f"{a}.rope.scaling.factor", 1.0)  # linear: global layers only
    attn_cap = meta.get(f"{a}.attn_logit_softcapping")
    final_cap = meta.get(f"{a}.final_logit_softcapping")
    T = len(tokens)
    pos = np.arange(T)
    max_score = 0.0

    def norm(x, stored):  # the file stores 1 + w (the converter adds the 1); Gemma scales by 1 + w
        w = stored - 1.0
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)

    def rope(x, base, scale):  # [T, heads, hd], dimension i paired with i + hd/2
        ang = (pos / scale)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def gelu_tanh(g):
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))

    x = W["token_embd.weight"][tokens] * np.sqrt(n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        local = window is not None and i % pattern < pattern - 1
        h = norm(x, W[p + "attn_norm.weight"])
        q, k, v = (h @ W[p + f"attn_{n}.weight"].T for n in "qkv")
        q, k, v = q.reshape(T, n_head, hd), k.reshape(T, n_kv, hd), v.reshape(T, n_kv, hd)
        if a == "gemma3":
            q, k = norm(q, W[p + "attn_q_norm.weight"]), norm(k, W[p + "attn_k_norm.weight"])
        base, scale = (local_base, 1.0) if local else (global_base, global_scale)
        q, k = rope(q, base, scale), rope(k, base, scale)
        visible = pos[None, :] <= pos[:, None]  # [query, key]
        if local:
            visible &= pos[:, None] - pos[None, :] < window
        out = np.zeros((T, n_head, hd))
        for hh in range(n_head):
            kv = hh // (n_head // n_kv)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(hd)
            max_score = max(max_score, float(np.abs(s).max()))
            if attn_cap:
                s = attn_cap * np.tanh(s / attn_cap)
            s = np.where(visible, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + norm(out.reshape(T, -1) @ W[p + "attn_output.weight"].T, W[p + "post_attention_norm.weight"])
        h = norm(x, W[p + "ffn_norm.weight"])
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        x = x + norm((gelu_tanh(g) * u) @ W[p + "ffn_down.weight"].T, W[p + "post_ffw_norm.weight"])
    logits = norm(x, W["output_norm.weight"]) @ W.get("output.weight", W["token_embd.weight"]).T
    max_logit = float(np.abs(logits).max())
    if final_cap:
        logits = final_cap * np.tanh(logits / final_cap)
    return Reference(logits, max_score, max_logit)


def with_types_dequantized(src: str, dst: str | os.PathLike, keep: frozenset[QT]) -> str:
    """A copy of GGUF `src` at `dst` whose tensors of types outside `keep` are dequantized to
    float32 by gguf-py (metadata and all other tensors as they are): a real file whose types
    the engine cannot load yet, made loadable for tests only."""
    dst = os.fspath(dst)
    r = GGUFReader(src)
    w = GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        if t.tensor_type in keep:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # data: the file's rows of blocks
        else:
            values = gq.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            w.add_tensor(t.name, values.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
