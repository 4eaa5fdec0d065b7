"""The forward pass against a plain float64 reference, for every architecture and weight type.

The reference below is written from the GGUF conventions alone: weights dequantized by
gguf-py, rope on adjacent pairs for llama (the layout llama.cpp's converter writes) and on
halves for qwen2/qwen3, grouped-query attention spelled out head by head.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf import quants as gq

import engine

ARCHS = ["llama", "qwen2", "qwen3"]
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def reference_logits(path: str, tokens: list[int]) -> np.ndarray:
    r = GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items()}
    arch = meta["general.architecture"]
    W = {t.name: gq.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(tuple(reversed(t.shape.tolist())))
         for t in r.tensors}
    n_layer, n_head = meta[f"{arch}.block_count"], meta[f"{arch}.attention.head_count"]
    n_kv, hd = meta[f"{arch}.attention.head_count_kv"], meta[f"{arch}.attention.key_length"]
    eps, base = meta[f"{arch}.attention.layer_norm_rms_epsilon"], meta[f"{arch}.rope.freq_base"]
    T = len(tokens)

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    ang = np.arange(T)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]  # [T, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # [T, heads, hd]
        if arch == "llama":
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    x = W["token_embd.weight"][tokens]
    for i in range(n_layer):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        q, k, v = (h @ W[p + f"attn_{n}.weight"].T + W.get(p + f"attn_{n}.bias", 0.0) for n in "qkv")
        q, k, v = q.reshape(T, n_head, hd), k.reshape(T, n_kv, hd), v.reshape(T, n_kv, hd)
        if arch == "qwen3":
            q, k = norm(q, W[p + "attn_q_norm.weight"]), norm(k, W[p + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        out = np.zeros((T, n_head, hd))
        causal = np.tril(np.ones((T, T), dtype=bool))
        for hh in range(n_head):
            kv = hh // (n_head // n_kv)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    head = W.get("output.weight", W["token_embd.weight"])
    return norm(x, W["output_norm.weight"]) @ head.T


TOKENS = [5, 77, 130, 2, 250, 9, 9, 41, 200, 13, 66, 101, 3]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_matches_float64_reference(tiny_gguf, arch, qtype):
    path = tiny_gguf(arch, qtype)
    ref = reference_logits(path, TOKENS)
    scale = np.abs(ref).max()
    exact = engine.load_model(path, weights="float32")
    got = exact.net.forward(torch.tensor(TOKENS), 0, exact.new_session().cache, logits="all").double().numpy()
    assert np.abs(got - ref).max() <= 2e-5 * scale
    fast = engine.load_model(path)
    got = fast.net.forward(torch.tensor(TOKENS), 0, fast.new_session().cache, logits="all").double().numpy()
    # Packed path: bfloat16/float16 matmul inputs; about 2-3 significant digits on random weights.
    assert np.abs(got - ref).max() <= 5e-2 * scale
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decode_equals_full_forward(tiny_gguf, arch):
    m = engine.load_model(tiny_gguf(arch, "F32"), weights="float32")
    full = m.net.forward(torch.tensor(TOKENS), 0, m.new_session().cache, logits="all")
    s = m.new_session()
    s.sync(TOKENS[:4])
    rows = [s.logits]
    for t in TOKENS[4:]:
        s.eval(t)
        rows.append(s.logits)
    torch.testing.assert_close(torch.stack(rows), full[3:], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_pass(tiny_gguf):
    m = engine.load_model(tiny_gguf("qwen2", "F32"), weights="float32")
    ids = (TOKENS * 4)[:50]
    one = m.new_session()
    one.sync(ids)
    m.prefill_chunk = 7
    chunked = m.new_session()
    chunked.sync(ids)
    torch.testing.assert_close(chunked.logits, one.logits, rtol=1e-4, atol=1e-4)

