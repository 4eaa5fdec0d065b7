"""The Gemma family forward pass: gemma2 and gemma3 (text decoder only).

One decoder-only transformer, different from the llama family in these ways, each read from
the GGUF's metadata (`GemmaParams.from_metadata`):

- token embeddings are multiplied by sqrt(n_embd) (the head, tied to the table, is not);
- every block normalises before *and after* attention and after the FFN as well
  (`post_attention_norm`, `post_ffw_norm`), and the FFN is GeGLU with tanh-approximated GELU;
- the norms are RMSNorm with (1 + w): llama.cpp's converter stores 1 + w in the file, so the
  weights are used as stored (transformers' GGUF loader subtracts the 1 again);
- gemma3 normalises q and k per head (RMSNorm over head_dim);
- queries are scaled by `attention.scale` where the file has it, else by
  query_pre_attn_scalar^-0.5, which is head_dim except in the 27B shapes, where it is
  n_embd / n_head (the file does not store it; the rule is llama.cpp's and the checkpoints');
- gemma2 soft-caps attention scores and the final logits, cap * tanh(x / cap), with the caps
  `attn_logit_softcapping` and `final_logit_softcapping` (where present, also for gemma3);
- layers alternate sliding-window (local) and global attention: of every `pattern` layers the
  last is global (gemma2: 2, gemma3: 6, or `attention.sliding_window_pattern`); a local layer's
  query at position p sees keys at p - window + 1 .. p (`attention.sliding_window`);
- local and global layers have their own rope base (gemma3: `rope.freq_base_swa`, default
  10000, and `rope.freq_base`), and a linear rope scaling in the metadata applies to the global
  layers only; rope rotates dimension i with i + head_dim/2 (neox pairing).

The KV cache (engine.kvcache) keeps every position of the global layers and bounds the local
layers to a ring (`cache_layout`): each keeps its last 2 * window - 1 positions, position p in
slot p % size, so a forward step may store up to `window` positions (longer ones run in
pieces of that many rows) and its first query still finds the window before it.  A cache of
n positions therefore holds n per global layer and min(n, 2 * window - 1) per local layer
(`kv_bytes`; `kv_bytes_per_token` counts the global layers only), and decoding far past the
window grows only the global layers.  A ring forgets: a session truncating to a prefix whose
window the ring has overwritten recomputes from the start (engine.session), and every step
refuses a start whose window is gone (`KVCache.will_write`) rather than read stale keys.
`bounded_cache = False` (before making caches) keeps every position on every layer, the
reference the ring is tested against.

On CPU with a compiled kernel path (engine.kernels) every row attends through the kernels'
attention (`attention` for a decoding step's rows, `prefill_attention` for a chunk's), which
read a ring layer's keys at slot p % size and take the window and the score cap themselves;
q/k norms and rope are one op (`rotate_halves`), the norms and the GeGLU one op each.  Both
attention ops compute a row by the same operations, fixed by its span of keys alone, so a row
decoded in a batch, alone, or prefilled, from a ring or from a full cache, computes the same
bits (with the row-independent matmul kernels of engine.weights).  A decoding layer whose
matrices are plain int4 or int8 runs each half as one op of those same kernels
(`gemma_attention_block`, `gemma_ffn_block`: the same bits without the Python between them).
Elsewhere (CUDA, the `torch` path, head dims the kernels do not take, bfloat16 caches) attention runs in torch
ops: on CUDA a prefill chunk attends in one masked batch and decode rows one by one, and no
graphs are captured (the family has no `graph_step`: its windowed ring caches have no graph
path; `decode_graphs` stays None and engine.models.common decodes eagerly).
The residual stream, norms, rope, attention and soft-capping run in float32; matmuls in the
weights' compute dtype (engine.weights).

`GemmaModel` implements `engine.protocols.Network` and is registered for gemma2 and gemma3 in
engine.models.ARCHITECTURES.  It reads no files beyond the given records and knows nothing
of tokens' text, chat templates or sessions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from engine.config import ModelConfig, UnsupportedModel
from engine.errors import Cancelled
from engine.gguf_file import GGUFContents, TensorRecord
from engine.kernels import ATTENTION_CACHE_DTYPES, CpuKernels, attention_fits
from engine.kvcache import CacheLayout, KVCache, Ring
from engine.models.common import CachedNetwork
from engine.weights import DenseLinear, Embedding, Linear, build_linear, to_float


@dataclass(frozen=True)
class GemmaVariant:
    """What a Gemma generation fixes that its files do not state."""

    window_pattern: int  # of every this many layers the last is global, the others local
    local_rope_base: float | None  # None: local layers share the global base
    wide_query_layers: int  # the 27B shape (this many layers) scales queries by n_embd/n_head


VARIANTS: dict[str, GemmaVariant] = {
    "gemma2": GemmaVariant(window_pattern=2, local_rope_base=None, wide_query_layers=46),
    "gemma3": GemmaVariant(window_pattern=6, local_rope_base=10000.0, wide_query_layers=62),
}


@dataclass(frozen=True)
class GemmaParams:
    """The Gemma-specific hyperparameters, from the metadata and the variant's defaults."""

    window: int | None  # keys a local layer's query sees, itself included; None: no local layers
    pattern: int
    local_rope_base: float
    global_rope_base: float
    global_rope_scale: float  # positions are divided by this on global layers (linear scaling)
    query_scale: float
    attn_softcap: float | None
    final_softcap: float | None

    @classmethod
    def from_metadata(cls, cfg: ModelConfig, meta: Mapping[str, Any]) -> "GemmaParams":
        arch = cfg.arch
        variant = VARIANTS[arch]

        def get(key: str) -> Any:
            return meta.get(f"{arch}.{key}")

        window = get("attention.sliding_window")
        pattern = int(get("attention.sliding_window_pattern") or variant.window_pattern)
        if pattern < 1:
            raise UnsupportedModel(f"{arch}.attention.sliding_window_pattern is {pattern}")
        scaling = get("rope.scaling.type")
        scale = 1.0
        if scaling not in (None, "none", "linear"):
            raise UnsupportedModel(f"rope scaling {scaling!r} ({arch}.rope.scaling.type)")
        if scaling == "linear":
            scale = float(get("rope.scaling.factor") or 1.0)
        query = get("attention.scale")
        if query is None:
            wide = cfg.n_layer == variant.wide_query_layers
            query = (cfg.n_embd / cfg.n_head if wide else cfg.head_dim) ** -0.5
        local_base = get("rope.freq_base_swa") or variant.local_rope_base or cfg.rope_base
        caps = [get("attn_logit_softcapping"), get("final_logit_softcapping")]
        attn_cap, final_cap = (float(c) if c else None for c in caps)
        return cls(window=int(window) if window else None, pattern=pattern, local_rope_base=float(local_base),
                   global_rope_base=cfg.rope_base, global_rope_scale=scale, query_scale=float(query),
                   attn_softcap=attn_cap, final_softcap=final_cap)

    def is_local(self, layer: int) -> bool:
        return self.window is not None and layer % self.pattern < self.pattern - 1

    def first_visible(self, layer: int, pos: int) -> int:
        """The first cached position a query at `pos` attends to in `layer`."""
        return max(0, pos + 1 - self.window) if self.is_local(layer) else 0


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap), or x where there is no cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last axis (weight already holds Gemma's 1 + w)."""
    ss = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (ss * ss / x.shape[-1] + eps).rsqrt() * weight


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rope of x [T, heads, D] with cos/sin [T, 1, D/2]: dimension i turns with i + D/2."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class GemmaBlock:
    def __init__(self, cfg: ModelConfig, t: dict[str, TensorRecord], i: int, fmt: str, device: torch.device,
                 cpu: CpuKernels | None):
        p = f"blk.{i}."

        def vec(name: str) -> torch.Tensor:
            return torch.from_numpy(to_float(t[p + name]).reshape(-1)).to(device)

        qkv = [t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"]]
        self.wqkv: Linear = build_linear(qkv, fmt, device, cpu=cpu)
        self.wo: Linear = build_linear([t[p + "attn_output.weight"]], fmt, device, cpu=cpu)
        self.w_gate_up: Linear = build_linear([t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]], fmt, device,
                                              cpu=cpu)
        self.w_down: Linear = build_linear([t[p + "ffn_down.weight"]], fmt, device, cpu=cpu)
        self.attn_norm = vec("attn_norm.weight")
        self.post_attn_norm = vec("post_attention_norm.weight")
        self.ffn_norm = vec("ffn_norm.weight")
        self.post_ffn_norm = vec("post_ffw_norm.weight")
        self.q_norm = vec("attn_q_norm.weight") if cfg.qk_norm else None
        self.k_norm = vec("attn_k_norm.weight") if cfg.qk_norm else None

    @property
    def nbytes(self) -> int:
        vecs = [self.attn_norm, self.post_attn_norm, self.ffn_norm, self.post_ffn_norm]
        vecs += [v for v in (self.q_norm, self.k_norm) if v is not None]
        mats = [self.wqkv, self.wo, self.w_gate_up, self.w_down]
        return sum(m.nbytes for m in mats) + sum(v.nbytes for v in vecs)


class GemmaModel(CachedNetwork):
    def __init__(self, cfg: ModelConfig, gguf: GGUFContents, fmt: str, device: torch.device,
                 cpu_kernels: CpuKernels | None = None):
        if cfg.rope_dim != cfg.head_dim:
            raise UnsupportedModel(f"partial rotary embeddings (rope dim {cfg.rope_dim} < head dim {cfg.head_dim})")
        if cfg.head_dim % 2 or cfg.n_head % cfg.n_head_kv:
            raise UnsupportedModel(f"head layout {cfg.n_head}x{cfg.head_dim} over {cfg.n_head_kv} kv heads")
        t = dict(gguf.tensors)
        if "token_embd.weight" not in t or "output_norm.weight" not in t:
            raise UnsupportedModel("GGUF lacks tensors: token_embd.weight or output_norm.weight")
        self.cfg = cfg
        self.params = GemmaParams.from_metadata(cfg, gguf.metadata)
        self.device = device
        self.fmt = fmt
        self.cpu_kernels = cpu_kernels if device.type == "cpu" else None
        if device.type == "cpu" and cpu_kernels is None:
            raise ValueError("a CPU model needs a CPU kernel path (engine.kernels.cpu_kernels)")
        # The compiled RMSNorm and GeGLU where the path has them: one op each where torch
        # dispatches seven and three, six norms a layer (prefill and decoding both use them).
        self._fused_norm = self.cpu_kernels.rms_norm if self.cpu_kernels is not None else None
        self._fused_geglu = self.cpu_kernels.geglu if self.cpu_kernels is not None else None
        # The compiled attention, rope and layer ops (see the module docstring); None: torch's.
        compiled = self.cpu_kernels is not None and self.cpu_kernels.rotate_halves is not None
        self.kernels: CpuKernels | None = self.cpu_kernels if compiled and attention_fits(cfg.head_dim) else None
        self.block_ops = self.kernels  # None: decoding layers call the same kernels one by one
        try:
            self.blocks = [GemmaBlock(cfg, t, i, fmt, device, self.cpu_kernels) for i in range(cfg.n_layer)]
        except KeyError as e:
            raise UnsupportedModel(f"GGUF lacks tensor {e.args[0]}") from None
        self.embed = Embedding(t["token_embd.weight"], fmt, device)
        # float32 sqrt(n_embd), as the reference implementations round it
        self.embed_scale = torch.tensor(math.sqrt(cfg.n_embd), dtype=torch.float32, device=device)
        self.out_norm = torch.from_numpy(to_float(t["output_norm.weight"]).reshape(-1)).to(device)
        self.head_is_table = "output.weight" not in t and self.embed.table is not None
        if self.head_is_table:
            self.output: Linear = DenseLinear(self.embed.table)
        else:
            self.output = build_linear([t.get("output.weight", t["token_embd.weight"])], fmt, device,
                                       cpu=self.cpu_kernels)
        half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        prm = self.params
        # Inverse frequencies per layer kind, with the global layers' linear scaling folded in.
        self.inv_freq = {True: prm.local_rope_base ** -half,
                         False: prm.global_rope_base ** -half / prm.global_rope_scale}
        # A prefill chunk attends in one masked batch (CUDA), or row by row as decoding does
        # (CPU: prefill and decoding then agree bit for bit).
        self.batched_prefill = device.type != "cpu"
        # Local layers in a ring of their last 2 * window - 1 positions (see the module docstring).
        self.bounded_cache = True

    def cache_layout(self) -> CacheLayout:
        """K and V of every kv head; the local layers in a ring (while `bounded_cache`)."""
        full = super().cache_layout()
        prm = self.params
        local = tuple(li for li in range(self.cfg.n_layer) if prm.is_local(li))
        if not self.bounded_cache or not local:
            return full
        return CacheLayout.keys_values(full.heads, full.width, Ring(local, prm.window, 2 * prm.window - 1))

    # --- Network: accounting and banners ---

    @property
    def attention_path(self) -> str:
        window = f", sliding window {self.params.window}" if self.params.window else ""
        if self.kernels is not None:
            return f"compiled kernel ({self.kernels.name}{window})"
        return f"torch ops ({self.device.type}{window})"

    def work_bytes(self, n_tokens: int, ctx: int) -> int:
        """Float32 activations of one step of `n_tokens` against `ctx` positions (residual,
        norms, qkv and its rotated copies, attention output, gate/up), the attention scores and
        one row of logits."""
        cfg = self.cfg
        T = n_tokens
        acts = 4 * T * (cfg.n_embd * 6 + 3 * (cfg.q_dim + 2 * cfg.kv_dim) + 3 * cfg.n_ff)
        return acts + 4 * cfg.n_head * T * ctx + 4 * cfg.n_vocab

    # --- the layers ---

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last axis (the compiled op on CPU, rows of any leading shape)."""
        if self._fused_norm is None:
            return rms_norm(x, weight, self.cfg.norm_eps)
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        return self._fused_norm(rows, weight, self.cfg.norm_eps).view(x.shape)

    def _rope(self, positions: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [T, 1, D/2] float32 at `positions` for local (True) and global layers,
        from float64 angles: a position's values do not depend on the others."""
        pos = positions.to(device="cpu", dtype=torch.float64)
        out = {}
        for local, inv in self.inv_freq.items():
            ang = torch.outer(pos, inv).unsqueeze(1)
            out[local] = (ang.cos().float().to(self.device), ang.sin().float().to(self.device))
        return out

    def _qkv(self, blk: GemmaBlock, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] (scaled), k and v [T, Hkv, D], float32, q and k normed and rotated."""
        cfg = self.cfg
        T, H, Hkv, D = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qkv = blk.wqkv(self._norm(x, blk.attn_norm)).float()
        q = qkv[:, : H * D].view(T, H, D)
        k = qkv[:, H * D: (H + Hkv) * D].view(T, Hkv, D)
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
        if blk.q_norm is not None:
            q, k = self._norm(q, blk.q_norm), self._norm(k, blk.k_norm)
        q, k = rotate_halves(q, *rope), rotate_halves(k, *rope)
        return q * self.params.query_scale, k, v

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """One row's scaled queries [Hkv, G, D] against keys/vals [Hkv, L, D] -> [Hkv, G, D]."""
        if keys.dtype != torch.float32:  # attention in float32 on every device
            keys, vals = keys.float(), vals.float()
        scores = softcap(torch.bmm(q, keys.transpose(1, 2)), self.params.attn_softcap)
        return torch.bmm(torch.softmax(scores, dim=-1), vals)

    def _attend_row(self, li: int, q: torch.Tensor, cache: KVCache, pos: int) -> torch.Tensor:
        """[H * D] attention of one query row at `pos` to its cache (which holds it already)."""
        cfg = self.cfg
        lo = self.params.first_visible(li, pos)
        q = q.reshape(cfg.n_head_kv, cfg.n_head // cfg.n_head_kv, cfg.head_dim)
        keys, vals = cache.positions(li, lo, pos + 1)
        return self._attend_one(q, keys, vals).reshape(-1)

    def _attend_chunk(self, li: int, q: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """[T, H * D] attention of a chunk's T rows (positions start..) in one masked batch
        (causal, and the window on local layers): the prefill where `batched_prefill` is set."""
        cfg = self.cfg
        T, end = q.shape[0], start + q.shape[0]
        lo = self.params.first_visible(li, start)
        G = cfg.n_head // cfg.n_head_kv
        keys, vals = cache.positions(li, lo, end).float()  # [Hkv, L, D] each
        qh = q.view(T, cfg.n_head_kv, G, cfg.head_dim).permute(1, 0, 2, 3).reshape(cfg.n_head_kv, T * G, -1)
        scores = softcap(torch.bmm(qh, keys.transpose(1, 2)), self.params.attn_softcap)  # [Hkv, T*G, L]
        qpos = torch.arange(start, end, device=q.device).repeat_interleave(G)[:, None]
        kpos = torch.arange(lo, end, device=q.device)[None, :]
        hidden = kpos > qpos
        if self.params.is_local(li):
            hidden |= kpos <= qpos - self.params.window
        probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
        out = torch.bmm(probs, vals).view(cfg.n_head_kv, T, G, cfg.head_dim)
        return out.permute(1, 0, 2, 3).reshape(T, -1)

    def _ffn(self, blk: GemmaBlock, x: torch.Tensor) -> None:
        """x += the post-normed GeGLU FFN of x."""
        n_ff = self.cfg.n_ff
        gate_up = blk.w_gate_up(self._norm(x, blk.ffn_norm)).float()
        if self._fused_geglu is not None:
            act = self._fused_geglu(gate_up)
        else:
            act = F.gelu(gate_up[:, :n_ff], approximate="tanh") * gate_up[:, n_ff:]
        x += self._norm(blk.w_down(act).float(), blk.post_ffn_norm)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) * self.embed_scale

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.output(self._norm(h, self.out_norm)).float()
        return softcap(logits, self.params.final_softcap)

    # --- Network: forward passes ---

    @torch.inference_mode()
    def forward_rows(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """tokens [N], caches N distinct caches -> logits [N, n_vocab] (float32), one new token
        at the end of each cache; each row attends to its own cache at its own length."""
        pos = [c.n for c in caches]
        for c in caches:
            c.will_write(c.n, c.n + 1)
        ropes = self._rope(torch.tensor(pos))
        x = self._embed(tokens)
        if self._compiled_for(caches[0]):
            self._decode_layers_compiled(x, ropes, caches, pos)
        else:
            for li, blk in enumerate(self.blocks):
                q, k, v = self._qkv(blk, x, ropes[self.params.is_local(li)])
                kv = torch.stack([k, v], dim=1).unsqueeze(3)  # [N, 2, Hkv, 1, D]
                rows = []
                for i, (c, p) in enumerate(zip(caches, pos)):
                    c.store(li, p, kv[i])
                    rows.append(self._attend_row(li, q[i], c, p))
                x += self._norm(blk.wo(torch.stack(rows)).float(), blk.post_attn_norm)
                self._ffn(blk, x)
        logits = self.head(x)
        for c, p in zip(caches, pos):
            c.n = p + 1
        return logits

    def _compiled_for(self, cache: KVCache) -> bool:
        """Whether steps on `cache` take the compiled path (a bfloat16 cache keeps torch's)."""
        return self.kernels is not None and cache.kv.dtype in ATTENTION_CACHE_DTYPES

    def _layer_attention(self, li: int) -> tuple[int, float, float]:
        """(window, query scale, score cap) as the compiled attention takes them (0: none)."""
        prm = self.params
        return (prm.window if prm.is_local(li) else 0), prm.query_scale, prm.attn_softcap or 0.0

    def _rotate(self, blk: GemmaBlock, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The compiled path's q/k/v [T, (H + 2 Hkv) D] float32: normed, projected, q and k
        normed per head and rotated in place (what gemma_attention_block computes first)."""
        qkv = blk.wqkv(self._norm(x, blk.attn_norm)).float()
        cos, sin = (t.view(t.shape[0], -1) for t in rope)
        self.kernels.rotate_halves(qkv, self.cfg.n_head, blk.q_norm, blk.k_norm, self.cfg.norm_eps, cos, sin)
        return qkv

    def _decode_layers_compiled(self, x: torch.Tensor, ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                                caches: list[KVCache], pos: list[int]) -> None:
        """The layers of a decoding step on the compiled path, x [N, n_embd] updated in place:
        a layer half whose matrices the block ops take is one op, the others the same kernels
        called from here."""
        k, N, eps = self.kernels, x.shape[0], self.cfg.norm_eps
        fused = self.block_ops is not None
        for li, blk in enumerate(self.blocks):
            window, scale, cap = self._layer_attention(li)
            rope = ropes[self.params.is_local(li)]
            kv = [c.layer_kv[li] for c in caches]
            qkv_w, wo_w = blk.wqkv.vector_operands(N), blk.wo.vector_operands(N)
            if fused and qkv_w is not None and wo_w is not None:
                cos, sin = (t.view(N, -1) for t in rope)
                k.gemma_attention_block(x, blk.attn_norm, blk.post_attn_norm, eps, qkv_w, blk.q_norm, blk.k_norm,
                                        cos, sin, kv, pos, window, scale, cap, wo_w)
            else:
                att = k.attention(self._rotate(blk, x, rope), kv, pos, scale, window, cap)
                x += self._norm(blk.wo(att).float(), blk.post_attn_norm)
            gate_up, down = blk.w_gate_up.vector_operands(N), blk.w_down.vector_operands(N)
            if fused and gate_up is not None and down is not None:
                k.gemma_ffn_block(x, blk.ffn_norm, blk.post_ffn_norm, eps, gate_up, down)
            else:
                self._ffn(blk, x)

    def _prefill_attention(self, li: int, blk: GemmaBlock, x: torch.Tensor,
                           rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, start: int) -> torch.Tensor:
        """[T, H * D] attention of a chunk on the compiled path: its keys and values stored,
        then each row attended as a decoding step attends it."""
        cfg = self.cfg
        T, H, Hkv, D = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qkv = self._rotate(blk, x, rope)
        kv = qkv[:, H * D:].view(T, 2, Hkv, D).permute(1, 2, 0, 3)  # [2, Hkv, T, D]
        cache.store(li, start, kv)
        window, scale, cap = self._layer_attention(li)
        return self.kernels.prefill_attention(qkv[:, : H * D], cache.layer_kv[li], start, scale, window, cap)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, logits: str = "last",
                cancel: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """T new tokens at positions [start, start + T) against `cache`: logits for the last
        position ([n_vocab]), for every position ([T, n_vocab], "all") or none (None)."""
        T = tokens.shape[0]
        if T == 1 and logits == "last" and start == cache.n:  # a decode step: one code path for all
            if cancel is not None and cancel():
                raise Cancelled("cancelled before a one-token step")
            return self.forward_rows(tokens, [cache])[0]
        ring = cache.layout.ring
        if ring is not None and T > ring.step:
            return self._forward_pieces(tokens, start, cache, logits, cancel, ring.step)
        end = start + T
        cache.will_write(start, end)
        ropes = self._rope(torch.arange(start, end))
        x = self._embed(tokens)
        for li, blk in enumerate(self.blocks):
            if cancel is not None and cancel():  # cache.n is still `start`: nothing half-done is visible
                raise Cancelled(f"cancelled in layer {li} of a {T}-token step")
            rope = ropes[self.params.is_local(li)]
            if self._compiled_for(cache):
                att = self._prefill_attention(li, blk, x, rope, cache, start)
            else:
                q, k, v = self._qkv(blk, x, rope)
                cache.store(li, start, torch.stack([k, v]).transpose(1, 2))  # [2, Hkv, T, D]
                if self.batched_prefill:
                    att = self._attend_chunk(li, q, cache, start)
                else:  # row by row, exactly as decoding attends
                    att = torch.stack([self._attend_row(li, q[i], cache, start + i) for i in range(T)])
            x += self._norm(blk.wo(att).float(), blk.post_attn_norm)
            self._ffn(blk, x)
        cache.n = end
        if logits == "last":
            return self.head(x[-1:])[0]
        if logits == "all":
            return self.head(x)
        return None

    def _forward_pieces(self, tokens: torch.Tensor, start: int, cache: KVCache, logits: str,
                        cancel: Callable[[], bool] | None, step: int) -> torch.Tensor | None:
        """`forward` of more positions than a ring takes at once, `step` rows at a time (on CPU
        the same bits as one chunk: rows are computed independently).  Cancelled part-way, the
        cache is left valid at `start`, as after a cancelled chunk."""
        outs, T = [], tokens.shape[0]
        try:
            for i in range(0, T, step):
                wanted = "none" if logits == "last" and i + step < T else logits
                outs.append(self.forward(tokens[i: i + step], start + i, cache, wanted, cancel))
        except Cancelled:
            cache.n = start
            raise
        if logits == "last":
            return outs[-1]
        return torch.cat(outs) if logits == "all" else None
