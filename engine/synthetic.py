"""Write GGUF files with random weights: tiny models for tests, same-shape models for benchmarks.

`write_random_gguf(path, spec)` writes a complete, loadable GGUF of the llama family with
random weights of the chosen tensor type (or of a per-tensor mixture imitating one of
llama.cpp's `_M` recipes, `spec.mixture`: Q4_K_M, Q5_K_M, Q3_K_M), and either a small byte-level ChatML tokenizer of
its own (256 byte tokens, 3 merges, 3 specials) or the tokenizer metadata copied from another GGUF
(`spec.tokenizer_from`), so that a model of the same shape as a real one can be benchmarked
where the real weights cannot go.  Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/F16/BF16/F32 are quantized with
`gguf.quants.quantize`; the k-quants and IQ4_NL/IQ4_XS are random bytes with small valid scales.
Writes go to a temporary file renamed into place.  It does not produce meaningful text.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, LlamaFileType, quants

from engine.gguf_file import read_gguf
from engine.quants import BLOCK

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


@dataclass(frozen=True)
class RandomModelSpec:
    arch: str = "llama"  # llama | qwen2 | qwen3
    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None  # None: n_embd // n_head
    n_ctx: int = 256
    qtype: str = "Q4_1"  # type of the 2-D weights
    embed_qtype: str = "Q8_0"
    tied_output: bool = True
    rope_base: float = 10000.0
    seed: int = 0
    tokenizer_from: str | None = None  # copy tokenizer metadata (and vocab size) from this GGUF
    mixture: str | None = None  # a MIXTURES recipe: per-tensor types instead of qtype / embed_qtype
    name: str = "random"
    extra_metadata: dict = field(default_factory=dict)


# Types gguf cannot quantize, written as random blocks: byte offsets of their float16 scale
# fields (d, and dmin where there is one), and a factor on the scale so that the largest
# weight is about Q4_K's (whose factor, like Q6_K's, is 1 so that files written before keep
# their bytes).
RANDOM_BLOCKS = {
    QT.Q4_K: ((0, 2), 1.0),
    QT.Q6_K: ((208,), 1.0),
    QT.Q5_K: ((0, 2), 945 / 1953),  # Q4_K's largest |sc * q| is 63 * 15, Q5_K's 63 * 31
    QT.Q3_K: ((108,), 945 / 128),  # |sc| <= 32, |q| <= 4
    QT.Q2_K: ((80, 82), 945 / 45),  # sc <= 15, q <= 3
    QT.IQ4_NL: ((0,), 945 / 127),  # levels up to 127
    QT.IQ4_XS: ((0,), 945 / (32 * 127)),
}


def random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `qtype`'s blocks with small positive float16 scales: every other field
    (sub-block scales, codes, high bits) takes all its values."""
    per, nbytes = BLOCK[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    offsets, factor = RANDOM_BLOCKS[qtype]
    for off in offsets:
        d = ((rng.random((rows, cols // per, 1)) * 0.002 + 0.0005) * factor).astype(np.float16)
        raw[..., off: off + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


def _encode(w: np.ndarray, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    if qtype == QT.F32:
        return w.astype(np.float32)
    if qtype in RANDOM_BLOCKS:
        return random_blocks(qtype, w.shape[0], w.shape[1], rng)
    return quants.quantize(w.astype(np.float32), qtype)


def more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get a larger type: the first
    and last eighth, and every third layer between."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


@dataclass(frozen=True)
class Mixture:
    """One of llama.cpp's `_M` recipes, reduced to the tensors this writer emits: `pick(role,
    layer, n_layer)` is a layer matrix's type ("attn_q", ..., "ffn_down"), `output` the head's
    (and the embedding's when the head is tied to it); everything else is `base`."""

    base: QT
    output: QT
    file_type: int  # gguf.LlamaFileType
    pick: Callable[[str, int, int], QT | None]


def _k_m(role: str, layer: int, n_layer: int) -> QT | None:
    """Q4_K_M and Q5_K_M: Q6_K for attn_v and ffn_down in the more_bits layers."""
    return QT.Q6_K if role in ("attn_v", "ffn_down") and more_bits(layer, n_layer) else None


def _q3_k_m(role: str, layer: int, n_layer: int) -> QT | None:
    if role == "attn_v":
        return QT.Q5_K if layer < 2 else QT.Q4_K
    if role == "ffn_down":
        return QT.Q5_K if layer < n_layer // 16 else QT.Q4_K if more_bits(layer, n_layer) else None
    return QT.Q4_K if role == "attn_output" else None


MIXTURES = {
    "Q4_K_M": Mixture(QT.Q4_K, QT.Q6_K, int(LlamaFileType.MOSTLY_Q4_K_M), _k_m),
    "Q5_K_M": Mixture(QT.Q5_K, QT.Q6_K, int(LlamaFileType.MOSTLY_Q5_K_M), _k_m),
    "Q3_K_M": Mixture(QT.Q3_K, QT.Q6_K, int(LlamaFileType.MOSTLY_Q3_K_M), _q3_k_m),
}
# What llama.cpp writes instead of a type whose 256-wide blocks do not tile a row (the 576
# columns of SmolLM2-135M's matrices, say).
ROW_FALLBACK = {QT.Q2_K: QT.IQ4_NL, QT.Q3_K: QT.IQ4_NL, QT.IQ4_XS: QT.IQ4_NL, QT.Q4_K: QT.Q5_0,
                QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}


def mixture_type(mixture: Mixture, role: str, layer: int, n_layer: int, cols: int) -> QT:
    """The type `mixture` gives a matrix of `cols` columns (role "token_embd" is the tied head's
    table; "output" the head), after llama.cpp's fallback for rows the blocks do not tile."""
    t = mixture.output if role in ("output", "token_embd") else mixture.pick(role, layer, n_layer) or mixture.base
    return ROW_FALLBACK.get(t, t) if cols % BLOCK[t][0] else t


def write_random_gguf(path: str | os.PathLike, spec: RandomModelSpec) -> str:
    path = os.fspath(path)
    rng = np.random.default_rng(spec.seed)
    head_dim = spec.head_dim or spec.n_embd // spec.n_head
    tok_meta: dict = {}
    if spec.tokenizer_from:
        src = read_gguf(spec.tokenizer_from).metadata
        tok_meta = {k: v for k, v in src.items() if k.startswith("tokenizer.")}
        n_vocab = len(tok_meta["tokenizer.ggml.tokens"])
    else:
        merged = ["\u0120t", "he", "\u0120the"]  # a few merges so the BPE has something to do
        tokens = byte_unicode() + merged + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        n_vocab = len(tokens)
        tok_meta = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (256 + len(merged)) + [3, 3, 3],
            "tokenizer.ggml.merges": ["\u0120 t", "h e", "\u0120t he"],
            "tokenizer.ggml.bos_token_id": n_vocab - 2,
            "tokenizer.ggml.eos_token_id": n_vocab - 1,
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": CHATML,
        }

    tmp = f"{path}.tmp.{os.getpid()}"
    w = GGUFWriter(tmp, spec.arch)
    a = spec.arch
    w.add_name(spec.name)
    w.add_uint32(f"{a}.block_count", spec.n_layer)
    w.add_uint32(f"{a}.context_length", spec.n_ctx)
    w.add_uint32(f"{a}.embedding_length", spec.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", spec.n_ff)
    w.add_uint32(f"{a}.attention.head_count", spec.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", spec.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", head_dim)
    w.add_uint32(f"{a}.attention.value_length", head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", head_dim)
    w.add_float32(f"{a}.rope.freq_base", spec.rope_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{a}.vocab_size", n_vocab)
    for key, value in {**tok_meta, **spec.extra_metadata}.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)

    qtype, etype = QT[spec.qtype], QT[spec.embed_qtype]
    mixture = MIXTURES[spec.mixture] if spec.mixture else None
    if mixture is not None and not spec.extra_metadata.get("general.file_type"):
        w.add_uint32("general.file_type", mixture.file_type)

    def matrix(name: str, rows: int, cols: int, t: QT | None = None, scale: float | None = None) -> None:
        role, layer = name.split(".")[-2], int(name.split(".")[1]) if name.startswith("blk.") else 0
        if mixture is not None:
            if role == "token_embd" and not spec.tied_output:
                t = mixture.base if cols % BLOCK[mixture.base][0] == 0 else ROW_FALLBACK[mixture.base]
            else:
                t = mixture_type(mixture, role, layer, spec.n_layer, cols)
        t = t or qtype
        if cols % BLOCK[t][0]:
            raise ValueError(f"{name}: {cols} columns is not a multiple of the {t.name} block size {BLOCK[t][0]}")
        m = rng.standard_normal((rows, cols)).astype(np.float32) * (scale or cols ** -0.5)
        w.add_tensor(name, _encode(m, t, rng), raw_dtype=t)

    def vector(name: str, n: int, around: float = 1.0, spread: float = 0.1) -> None:
        w.add_tensor(name, (around + spread * rng.standard_normal(n)).astype(np.float32))

    q_dim, kv_dim = spec.n_head * head_dim, spec.n_head_kv * head_dim
    matrix("token_embd.weight", n_vocab, spec.n_embd, etype, scale=1.0)
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", spec.n_embd)
        matrix(p + "attn_q.weight", q_dim, spec.n_embd)
        matrix(p + "attn_k.weight", kv_dim, spec.n_embd)
        matrix(p + "attn_v.weight", kv_dim, spec.n_embd)
        if a == "qwen2":
            for x, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                vector(p + f"attn_{x}.bias", n, around=0.0, spread=0.5)
        if a == "qwen3":
            vector(p + "attn_q_norm.weight", head_dim)
            vector(p + "attn_k_norm.weight", head_dim)
        matrix(p + "attn_output.weight", spec.n_embd, q_dim)
        vector(p + "ffn_norm.weight", spec.n_embd)
        matrix(p + "ffn_gate.weight", spec.n_ff, spec.n_embd)
        matrix(p + "ffn_up.weight", spec.n_ff, spec.n_embd)
        matrix(p + "ffn_down.weight", spec.n_embd, spec.n_ff)
    vector("output_norm.weight", spec.n_embd)
    if not spec.tied_output:
        matrix("output.weight", n_vocab, spec.n_embd)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
