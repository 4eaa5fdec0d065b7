"""Write GGUF files with random weights: tiny models for tests, same-shape models for benchmarks.

`write_random_gguf(path, spec)` writes a complete, loadable GGUF of the llama family with
random weights of the chosen tensor type (or of a per-tensor mixture imitating one of
llama.cpp's `_M` recipes, `spec.mixture`: Q4_K_M, Q5_K_M, Q3_K_M), and either a small byte-level ChatML tokenizer of
its own (256 byte tokens, 3 merges, 3 specials) or the tokenizer metadata copied from another GGUF
(`spec.tokenizer_from`), so that a model of the same shape as a real one can be benchmarked
where the real weights cannot go.  Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/F16/BF16/F32 are quantized with
`gguf.quants.quantize`; the k-quants and IQ4_NL/IQ4_XS are random bytes with small valid scales.
Writes go to a temporary file renamed into place.  It does not produce meaningful text.

`write_moe_gguf(path, spec)` writes the mixture-of-experts families the same way, for speed
runs at real sizes: `QwenMoeSpec` (qwen3moe, qwen2moe) and `DeepSeek2Spec` (deepseek2 with
latent attention as llama.cpp's current converter writes it), with named shapes in `PRESETS`
(`qwen3-30b-a3b`, `deepseek-v2-lite`, and tiny ones for a small CPU).  Layer matrices are one
type (default Q4_K, llama.cpp's Q5_0/Q8_0 fallback where 256-wide blocks do not tile a row), the
embedding Q4_K and the output head Q6_K as a Q4_K_M file holds them, routers and norms F32.
The file is streamed: slabs of random blocks with small valid scales (any STREAM_TYPES type,
never quantized) made by worker threads and written in order, so a 17 GB file never sits in
memory; its bytes depend on the spec, its seed and SLAB_BYTES, not on the thread count.  The
byte-level tokenizer is widened to the preset's vocabulary with ordinary filler tokens and
names a pre-tokenizer llama.cpp knows.  `python -m engine.synthetic --preset NAME -o FILE`
is its command line.
"""
from __future__ import annotations

import itertools
import os
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, LlamaFileType, quants
from gguf.constants import GGML_QUANT_SIZES

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


MERGED = ["\u0120t", "he", "\u0120the"]  # a few merges so the BPE has something to do
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def filler_tokens(n: int, taken: set[str]) -> list[str]:
    """n distinct ordinary byte-level tokens not in `taken`: every pair of byte stand-ins, then
    every triple, in order (tokens no merge produces, so they only widen the vocabulary)."""
    chars = byte_unicode()
    out: list[str] = []
    width = 2
    while len(out) < n:
        for combo in itertools.product(chars, repeat=width):
            token = "".join(combo)
            if token not in taken:
                out.append(token)
                if len(out) == n:
                    break
        width += 1
    return out


def byte_level_tokenizer(n_vocab: int | None = None, pre: str = "gpt-2") -> dict:
    """Metadata of a small byte-level ChatML tokenizer: the 256 byte tokens, 3 merges, then
    (when `n_vocab` asks for more) ordinary filler tokens, and the 3 specials last (BOS and EOS
    the last two).  `pre` is the pre-tokenizer name written: by default GPT-2's under the name
    llama.cpp knows it by (it refuses to load a file saying "gpt2"; this engine reads both), so
    llama.cpp can run the same random files; the MoE presets name their real models' ones."""
    base = byte_unicode() + MERGED
    n_fill = 0 if n_vocab is None else n_vocab - len(base) - len(SPECIALS)
    if n_fill < 0:
        raise ValueError(f"a byte-level vocabulary needs at least {len(base) + len(SPECIALS)} tokens, not {n_vocab}")
    tokens = base + filler_tokens(n_fill, set(base)) + SPECIALS
    n = len(tokens)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (n - len(SPECIALS)) + [3] * len(SPECIALS),
        "tokenizer.ggml.merges": ["\u0120 t", "h e", "\u0120t he"],
        "tokenizer.ggml.bos_token_id": n - 2,
        "tokenizer.ggml.eos_token_id": n - 1,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


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


def add_metadata(w: GGUFWriter, items: dict) -> None:
    """Write plain Python values as GGUF keys: bool, int as uint32, float as float32, str, list."""
    for key, value in items.items():
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


def write_random_gguf(path: str | os.PathLike, spec: RandomModelSpec) -> str:
    path = os.fspath(path)
    rng = np.random.default_rng(spec.seed)
    head_dim = spec.head_dim or spec.n_embd // spec.n_head
    tok_meta: dict = {}
    if spec.tokenizer_from:
        src = read_gguf(spec.tokenizer_from).metadata
        tok_meta = {k: v for k, v in src.items() if k.startswith("tokenizer.")}
    else:
        tok_meta = byte_level_tokenizer()
    n_vocab = len(tok_meta["tokenizer.ggml.tokens"])

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
    add_metadata(w, {**tok_meta, **spec.extra_metadata})

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


# ---------------------------------------------------------------- mixture-of-experts families, streamed

# The scale fields of every block type the streaming writer emits (byte offsets of their float16
# d, and dmin where there is one) and the largest |code x sub-scale| a block can hold, by which
# d is divided so that a row's weights are about 1/sqrt(width) whatever the type.
STREAM_BLOCKS: dict[QT, tuple[tuple[int, ...], float]] = {
    QT.Q4_0: ((0,), 8), QT.Q4_1: ((0, 2), 15), QT.Q5_0: ((0,), 16), QT.Q5_1: ((0, 2), 31), QT.Q8_0: ((0,), 127),
    QT.Q4_K: ((0, 2), 945), QT.Q5_K: ((0, 2), 1953), QT.Q6_K: ((208,), 4064), QT.Q3_K: ((108,), 128),
    QT.Q2_K: ((80, 82), 45), QT.IQ4_NL: ((0,), 127), QT.IQ4_XS: ((0,), 4064),
}
STREAM_TYPES = ("F32", "F16", *(t.name for t in STREAM_BLOCKS))
# llama.cpp's general.file_type for a file of mostly one type (the nearest named recipe).
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "Q4_K": "MOSTLY_Q4_K_S", "Q5_K": "MOSTLY_Q5_K_S",
              "Q3_K": "MOSTLY_Q3_K_S", "Q2_K": "MOSTLY_Q2_K"}
SLAB_BYTES = 32 << 20  # bytes of random data one worker makes at a time


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a streamed file: its name, numpy-order shape ([..., rows, cols]), type and
    how its values are drawn ("matrix": random blocks; "norm": 1 + noise; "vector": noise of
    `scale`; "router": Gaussian of `scale`, for the float32 routers and gates)."""

    name: str
    shape: tuple[int, ...]
    qtype: QT
    kind: str = "matrix"
    scale: float = 0.1

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def nbytes(self) -> int:
        per, size = GGML_QUANT_SIZES[self.qtype]
        return self.rows * (self.shape[-1] // per) * size


def fitted(qtype: QT, cols: int) -> QT:
    """`qtype`, or llama.cpp's fallback where its blocks do not tile a row of `cols` (Q4_K ->
    Q5_0 for DeepSeek-V2-Lite's 1408-wide experts, as its Q4_K files hold them)."""
    per = GGML_QUANT_SIZES[qtype][0]
    t = ROW_FALLBACK.get(qtype, qtype) if cols % per else qtype
    if cols % GGML_QUANT_SIZES[t][0]:
        raise ValueError(f"{cols} columns fit neither {qtype.name} nor its fallback {t.name}")
    return t


class _Planner:
    """Collects a family's tensor plans with its type rules: layer matrices in `qtype` (fitted
    to their width), the embedding in `embed`, the output head in `output`, routers F32."""

    def __init__(self, qtype: str, embed: str, output: str):
        self.qtype, self.embed, self.output = QT[qtype], QT[embed], QT[output]
        self.plans: list[TensorPlan] = []

    def matrix(self, name: str, *shape: int, t: QT | None = None) -> None:
        self.plans.append(TensorPlan(name, shape, fitted(t or self.qtype, shape[-1])))

    def norm(self, name: str, n: int) -> None:
        self.plans.append(TensorPlan(name, (n,), QT.F32, "norm"))

    def vector(self, name: str, n: int, scale: float) -> None:
        self.plans.append(TensorPlan(name, (n,), QT.F32, "vector", scale))

    def router(self, name: str, *shape: int, scale: float) -> None:
        self.plans.append(TensorPlan(name, shape, QT.F32, "router", scale))


@dataclass(frozen=True)
class QwenMoeSpec:
    """A qwen3moe or qwen2moe file: llama attention (qwen3moe: per-head q/k norms; qwen2moe: q/k/v
    biases and a gated shared expert of width `n_ff_shexp`), routed experts stacked in 3-D
    tensors, the router `ffn_gate_inp` in F32, an untied output head."""

    arch: str = "qwen3moe"  # qwen3moe | qwen2moe
    n_layer: int = 2
    n_embd: int = 256
    n_ff: int = 512  # the dense width the converter writes (unused by the MoE blocks)
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 256
    n_ff_shexp: int = 512  # qwen2moe only
    n_vocab: int = 512
    n_ctx: int = 4096
    rope_base: float = 1_000_000.0
    norm_eps: float = 1e-6
    qtype: str = "Q4_K"
    embed_qtype: str = "Q4_K"
    output_qtype: str = "Q6_K"
    router_scale: float = 3.0  # spreads the router's probabilities so that top-k is clear-cut
    seed: int = 0
    name: str = "random-qwen-moe"

    @property
    def pre_tokenizer(self) -> str:
        return "qwen2"

    def metadata(self) -> dict:
        a = self.arch
        meta = {f"{a}.block_count": self.n_layer, f"{a}.context_length": self.n_ctx,
                f"{a}.embedding_length": self.n_embd, f"{a}.feed_forward_length": self.n_ff,
                f"{a}.attention.head_count": self.n_head, f"{a}.attention.head_count_kv": self.n_head_kv,
                f"{a}.attention.key_length": self.head_dim, f"{a}.attention.value_length": self.head_dim,
                f"{a}.rope.freq_base": float(self.rope_base),
                f"{a}.attention.layer_norm_rms_epsilon": float(self.norm_eps),
                f"{a}.expert_count": self.n_expert, f"{a}.expert_used_count": self.n_expert_used,
                f"{a}.expert_feed_forward_length": self.n_ff_exp, f"{a}.vocab_size": self.n_vocab}
        if a == "qwen2moe":
            meta[f"{a}.expert_shared_feed_forward_length"] = self.n_ff_shexp
        return meta

    def tensors(self) -> list[TensorPlan]:
        if self.arch not in ("qwen3moe", "qwen2moe"):
            raise ValueError(f"QwenMoeSpec writes qwen3moe or qwen2moe, not {self.arch!r}")
        P = _Planner(self.qtype, self.embed_qtype, self.output_qtype)
        d, E, f = self.n_embd, self.n_expert, self.n_ff_exp
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        P.matrix("token_embd.weight", self.n_vocab, d, t=P.embed)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            P.norm(p + "attn_norm.weight", d)
            P.matrix(p + "attn_q.weight", q_dim, d)
            P.matrix(p + "attn_k.weight", kv_dim, d)
            P.matrix(p + "attn_v.weight", kv_dim, d)
            if self.arch == "qwen2moe":
                for x, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                    P.vector(p + f"attn_{x}.bias", n, 0.1)
            else:
                P.norm(p + "attn_q_norm.weight", self.head_dim)
                P.norm(p + "attn_k_norm.weight", self.head_dim)
            P.matrix(p + "attn_output.weight", d, q_dim)
            P.norm(p + "ffn_norm.weight", d)
            P.router(p + "ffn_gate_inp.weight", E, d, scale=self.router_scale * d ** -0.5)
            P.matrix(p + "ffn_gate_exps.weight", E, f, d)
            P.matrix(p + "ffn_up_exps.weight", E, f, d)
            P.matrix(p + "ffn_down_exps.weight", E, d, f)
            if self.arch == "qwen2moe":
                P.router(p + "ffn_gate_inp_shexp.weight", d, scale=d ** -0.5)
                P.matrix(p + "ffn_gate_shexp.weight", self.n_ff_shexp, d)
                P.matrix(p + "ffn_up_shexp.weight", self.n_ff_shexp, d)
                P.matrix(p + "ffn_down_shexp.weight", d, self.n_ff_shexp)
        P.norm("output_norm.weight", d)
        P.matrix("output.weight", self.n_vocab, d, t=P.output)
        return P.plans


@dataclass(frozen=True)
class DeepSeek2Spec:
    """A deepseek2 file as llama.cpp's current converter writes it: multi-head latent attention
    with `attn_kv_b` split into `attn_k_b` [H, kv_lora_rank, nope] and `attn_v_b` [H, v_head,
    kv_lora_rank] (the cache's MQA view in key_length / value_length, the heads' widths in the
    *_mla keys), an optional q bottleneck (`q_lora_rank`; 0: `attn_q`), `n_dense` leading dense
    layers, routed experts plus `n_shared` shared ones, softmax or sigmoid gating (sigmoid adds
    the expert bias and groups), optional YaRN.  llama.cpp reads `q_lora_rank` except from
    "lite" files (26 or 27 layers), so other layer counts need one."""

    n_layer: int = 3
    n_dense: int = 1
    n_embd: int = 256
    n_ff: int = 512  # the dense layers' width
    n_head: int = 4
    q_lora_rank: int = 256
    kv_lora_rank: int = 256
    qk_nope: int = 64
    qk_rope: int = 32
    v_head: int = 64
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 256
    n_shared: int = 1
    gating: str = "softmax"  # softmax (V2) | sigmoid (V3: expert bias, groups)
    n_groups: int = 1
    n_groups_used: int = 1
    weights_norm: bool = False
    weights_scale: float = 1.0
    yarn_factor: float = 0.0  # > 0: rope.scaling yarn with this factor over `yarn_original_ctx`
    yarn_original_ctx: int = 4096
    yarn_log_multiplier: float = 0.0707  # as the converter writes 0.1 * mscale_all_dim
    n_vocab: int = 512
    n_ctx: int = 4096
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    qtype: str = "Q4_K"
    embed_qtype: str = "Q4_K"
    output_qtype: str = "Q6_K"
    router_scale: float = 3.0
    seed: int = 0
    name: str = "random-deepseek2"

    arch = "deepseek2"

    @property
    def pre_tokenizer(self) -> str:
        return "deepseek-llm"

    def metadata(self) -> dict:
        a = self.arch
        meta = {f"{a}.block_count": self.n_layer, f"{a}.context_length": self.n_ctx,
                f"{a}.embedding_length": self.n_embd, f"{a}.feed_forward_length": self.n_ff,
                f"{a}.attention.head_count": self.n_head, f"{a}.attention.head_count_kv": 1,
                f"{a}.attention.key_length": self.kv_lora_rank + self.qk_rope,
                f"{a}.attention.value_length": self.kv_lora_rank,
                f"{a}.attention.key_length_mla": self.qk_nope + self.qk_rope,
                f"{a}.attention.value_length_mla": self.v_head,
                f"{a}.attention.kv_lora_rank": self.kv_lora_rank,
                f"{a}.rope.dimension_count": self.qk_rope, f"{a}.rope.freq_base": float(self.rope_base),
                f"{a}.attention.layer_norm_rms_epsilon": float(self.norm_eps),
                f"{a}.leading_dense_block_count": self.n_dense,
                f"{a}.expert_count": self.n_expert, f"{a}.expert_used_count": self.n_expert_used,
                f"{a}.expert_feed_forward_length": self.n_ff_exp, f"{a}.expert_shared_count": self.n_shared,
                f"{a}.expert_weights_scale": float(self.weights_scale), f"{a}.expert_weights_norm": self.weights_norm,
                f"{a}.expert_gating_func": 1 if self.gating == "softmax" else 2, f"{a}.vocab_size": self.n_vocab}
        if self.q_lora_rank:
            meta[f"{a}.attention.q_lora_rank"] = self.q_lora_rank
        if self.gating == "sigmoid":
            meta[f"{a}.expert_group_count"] = self.n_groups
            meta[f"{a}.expert_group_used_count"] = self.n_groups_used
        if self.yarn_factor:
            meta.update({f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": float(self.yarn_factor),
                         f"{a}.rope.scaling.original_context_length": self.yarn_original_ctx,
                         f"{a}.rope.scaling.yarn_log_multiplier": float(self.yarn_log_multiplier)})
        return meta

    def tensors(self) -> list[TensorPlan]:
        if self.gating not in ("softmax", "sigmoid"):
            raise ValueError(f"gating is softmax or sigmoid, not {self.gating!r}")
        P = _Planner(self.qtype, self.embed_qtype, self.output_qtype)
        d, E, f, H, rank = self.n_embd, self.n_expert, self.n_ff_exp, self.n_head, self.kv_lora_rank
        hd = self.qk_nope + self.qk_rope
        P.matrix("token_embd.weight", self.n_vocab, d, t=P.embed)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            P.norm(p + "attn_norm.weight", d)
            if self.q_lora_rank:
                P.matrix(p + "attn_q_a.weight", self.q_lora_rank, d)
                P.norm(p + "attn_q_a_norm.weight", self.q_lora_rank)
                P.matrix(p + "attn_q_b.weight", H * hd, self.q_lora_rank)
            else:
                P.matrix(p + "attn_q.weight", H * hd, d)
            P.matrix(p + "attn_kv_a_mqa.weight", rank + self.qk_rope, d)
            P.norm(p + "attn_kv_a_norm.weight", rank)
            P.matrix(p + "attn_k_b.weight", H, rank, self.qk_nope)
            P.matrix(p + "attn_v_b.weight", H, self.v_head, rank)
            P.matrix(p + "attn_output.weight", d, H * self.v_head)
            P.norm(p + "ffn_norm.weight", d)
            if i < self.n_dense:
                P.matrix(p + "ffn_gate.weight", self.n_ff, d)
                P.matrix(p + "ffn_up.weight", self.n_ff, d)
                P.matrix(p + "ffn_down.weight", d, self.n_ff)
                continue
            P.router(p + "ffn_gate_inp.weight", E, d, scale=self.router_scale * d ** -0.5)
            if self.gating == "sigmoid":
                P.vector(p + "exp_probs_b.bias", E, 0.3)
            P.matrix(p + "ffn_gate_exps.weight", E, f, d)
            P.matrix(p + "ffn_up_exps.weight", E, f, d)
            P.matrix(p + "ffn_down_exps.weight", E, d, f)
            if self.n_shared:
                P.matrix(p + "ffn_gate_shexp.weight", f * self.n_shared, d)
                P.matrix(p + "ffn_up_shexp.weight", f * self.n_shared, d)
                P.matrix(p + "ffn_down_shexp.weight", d, f * self.n_shared)
        P.norm("output_norm.weight", d)
        P.matrix("output.weight", self.n_vocab, d, t=P.output)
        return P.plans


MoeSpec = QwenMoeSpec | DeepSeek2Spec

# Named shapes: the two benchmark models as their Hugging Face configs and llama.cpp's
# converter describe them, and tiny ones a 2-core CPU decodes quickly.
PRESETS: dict[str, MoeSpec] = {
    "qwen3-30b-a3b": QwenMoeSpec(
        arch="qwen3moe", n_layer=48, n_embd=2048, n_ff=6144, n_head=32, n_head_kv=4, head_dim=128, n_expert=128,
        n_expert_used=8, n_ff_exp=768, n_vocab=151936, n_ctx=40960, name="random Qwen3-30B-A3B shape"),
    "deepseek-v2-lite": DeepSeek2Spec(
        n_layer=27, n_dense=1, n_embd=2048, n_ff=10944, n_head=16, q_lora_rank=0, kv_lora_rank=512, qk_nope=128,
        qk_rope=64, v_head=128, n_expert=64, n_expert_used=6, n_ff_exp=1408, n_shared=2, gating="softmax",
        yarn_factor=40.0, yarn_original_ctx=4096, n_vocab=102400, n_ctx=163840,
        name="random DeepSeek-V2-Lite shape"),
    "qwen3moe-tiny": QwenMoeSpec(
        arch="qwen3moe", n_layer=4, n_embd=512, n_ff=1024, n_head=8, n_head_kv=2, head_dim=64, n_expert=32,
        n_expert_used=4, n_ff_exp=256, n_vocab=4096, name="random tiny qwen3moe"),
    "qwen2moe-tiny": QwenMoeSpec(
        arch="qwen2moe", n_layer=4, n_embd=512, n_ff=1024, n_head=8, n_head_kv=8, head_dim=64, n_expert=16,
        n_expert_used=4, n_ff_exp=256, n_ff_shexp=512, n_vocab=4096, name="random tiny qwen2moe"),
    "deepseek2-tiny": DeepSeek2Spec(
        n_layer=4, n_dense=1, n_embd=512, n_ff=1024, n_head=8, q_lora_rank=256, kv_lora_rank=256, qk_nope=64,
        qk_rope=32, v_head=64, n_expert=32, n_expert_used=4, n_ff_exp=256, n_shared=2, n_vocab=4096,
        name="random tiny deepseek2"),
}


def _fill_slab(plan: TensorPlan, index: int, start: int, stop: int, seed: int) -> np.ndarray:
    """Rows [start, stop) of tensor number `index`, a contiguous array of the file's bytes; each
    slab draws from its own generator seeded by (seed, tensor, first row), so the bytes do not
    depend on the threads."""
    bits = np.random.SFC64(np.random.SeedSequence([seed, index, start]))
    cols, n = plan.shape[-1], stop - start
    if plan.qtype in (QT.F32, QT.F16):
        rng = np.random.Generator(bits)
        values = rng.standard_normal(n * cols, dtype=np.float32)
        if plan.kind == "norm":
            values = 1.0 + 0.1 * values
        elif plan.kind in ("vector", "router"):
            values *= plan.scale
        else:
            values *= cols ** -0.5
        return values.astype(np.float32 if plan.qtype == QT.F32 else np.float16)
    per, size = GGML_QUANT_SIZES[plan.qtype]
    blocks = n * (cols // per)
    words = bits.random_raw(-(-blocks * size // 8)).view(np.uint16)[: blocks * size // 2]
    words = words.reshape(blocks, size // 2)  # every block size and scale offset is even
    offsets, largest = STREAM_BLOCKS[plan.qtype]
    # Scales in [s, 2s) with s a power of two near 1 / (largest * sqrt(cols)): the exponent
    # bits of s and the random mantissa already in the field, changed in place.
    top = np.float16(1.0 / (largest * cols ** 0.5)).view(np.uint16) & np.uint16(0xFC00)
    for off in offsets:
        field = words[:, off // 2]
        field &= np.uint16(0x03FF)
        field |= top
    return words.view(np.uint8)


def _slabs(plans: list[TensorPlan]) -> list[tuple[int, int, int]]:
    """(tensor index, first row, end row) of every slab, in file order."""
    out = []
    for i, plan in enumerate(plans):
        step = max(1, SLAB_BYTES // max(1, plan.nbytes // plan.rows))
        out += [(i, r, min(r + step, plan.rows)) for r in range(0, plan.rows, step)]
    return out


@dataclass(frozen=True)
class WriteReport:
    path: str
    nbytes: int  # the file's size
    seconds: float
    n_tensors: int

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")


def moe_metadata(spec: MoeSpec) -> dict:
    """Every metadata key a streamed file holds, tokenizer included (in writing order)."""
    meta = {"general.name": spec.name}
    file_type = FILE_TYPES.get(spec.qtype, f"MOSTLY_{spec.qtype}")
    if file_type in LlamaFileType.__members__:
        meta["general.file_type"] = int(LlamaFileType[file_type])
    return {**meta, **spec.metadata(), **byte_level_tokenizer(spec.n_vocab, spec.pre_tokenizer)}


def write_moe_gguf(path: str | os.PathLike, spec: MoeSpec, threads: int | None = None) -> WriteReport:
    """Write `spec` as a GGUF streamed in slabs of random blocks: header and tensor table through
    gguf's writer, then each tensor's bytes as worker threads produce them, in order, never the
    whole file in memory (about `threads` x 2 slabs of SLAB_BYTES at a time).  Types: any of
    STREAM_TYPES; blocks are random bytes with small valid scales, not quantized values."""
    t0 = time.perf_counter()
    path = os.fspath(path)
    plans = spec.tensors()
    for plan in plans:
        if plan.qtype.name not in STREAM_TYPES:
            raise ValueError(f"{plan.name}: type {plan.qtype.name} cannot be streamed "
                             f"(one of {', '.join(STREAM_TYPES)})")
    threads = threads or os.cpu_count() or 1
    tmp = f"{path}.tmp.{os.getpid()}"
    w = GGUFWriter(tmp, spec.arch)
    try:
        add_metadata(w, {k: v for k, v in moe_metadata(spec).items() if k != "general.architecture"})
        for plan in plans:
            w.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes, raw_dtype=plan.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        out = w.fout[0]
        align = w.data_alignment
        out.write(b"\0" * (-out.tell() % align))
        slabs = _slabs(plans)
        ends = {i: stop for i, _start, stop in slabs}  # a tensor's last slab ends at its last row
        with ThreadPoolExecutor(max_workers=threads) as pool:
            pending: deque = deque()
            queue = iter(slabs)
            for job in itertools.islice(queue, 2 * threads):
                pending.append((job, pool.submit(_fill_slab, plans[job[0]], *job, spec.seed)))
            while pending:
                (i, _start, stop), future = pending.popleft()
                out.write(future.result())
                if stop == ends[i]:
                    out.write(b"\0" * (-plans[i].nbytes % align))
                job = next(queue, None)
                if job is not None:
                    pending.append((job, pool.submit(_fill_slab, plans[job[0]], *job, spec.seed)))
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return WriteReport(path, os.path.getsize(path), time.perf_counter() - t0, len(plans))


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.synthetic --preset NAME [--qtype Q4_K] [--layers N] -o FILE`."""
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser(prog="python -m engine.synthetic",
                                     description="Write a random-weight mixture-of-experts GGUF of a named shape "
                                                 "(for speed tests only).")
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("-o", "--output", required=True, help="GGUF file to write (atomically)")
    parser.add_argument("--qtype", choices=STREAM_TYPES, default=None,
                        help="type of the layer matrices and the embedding (default: the preset's, Q4_K)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="worker threads (default: all cores)")
    args = parser.parse_args(argv)
    spec = PRESETS[args.preset]
    changes: dict = {"seed": args.seed}
    if args.qtype:
        changes.update(qtype=args.qtype, embed_qtype=args.qtype)
    if args.layers is not None:
        if args.layers < 1:
            parser.error("--layers must be at least 1")
        changes["n_layer"] = args.layers
    spec = dataclasses.replace(spec, **changes)
    try:
        report = write_moe_gguf(args.output, spec, args.threads)
    except (ValueError, OSError) as e:
        print(f"python -m engine.synthetic: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {report.path}: {spec.arch} ({args.preset}), {spec.n_layer} layers, {report.n_tensors} tensors, "
          f"{report.nbytes / 1e9:.2f} GB in {report.seconds:.1f} s ({report.bytes_per_s / 1e6:.0f} MB/s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
