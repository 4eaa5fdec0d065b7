"""The llama family forward pass: llama (SmolLM2, TinyLlama, Llama 3.x), qwen2, qwen3.

One decoder-only transformer: RMSNorm, grouped-query attention with RoPE, SwiGLU FFN,
tied or separate output head.  The variants differ only in q/k/v bias (qwen2), per-head
q/k RMSNorm (qwen3) and the RoPE pairing; neox pairing (i, i + d/2) is turned into the
adjacent-pair layout (2i, 2i+1) at load time by permuting the q/k output rows (attention
scores are invariant under the same permutation of q and k), so one rope kernel serves all.

`LlamaModel.forward(tokens, start, cache, logits=...)` evaluates T new tokens at positions
[start, start+T) against `cache`, writes their keys/values and returns float32 logits for
the last position ([n_vocab]), for every position ([T, n_vocab]) or nothing.
`LlamaModel.forward_rows(tokens, caches)` is batched decoding: one new token for each of N
independent sequences, each at the end of its own cache.  The matmuls (where the weights are
read) run once for all rows; attention runs row by row against each row's own cache with
the same code as single-row decoding, so no row's cache is copied or padded.
Residual stream, norms, rope and attention run in float32; matmuls in the weights' own
compute dtype (see engine.weights).  It reads no files beyond the given records and knows
nothing of tokens' text or sessions.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import ModelConfig, UnsupportedModel
from engine.errors import Cancelled
from engine.gguf_file import GGUFContents, TensorRecord
from engine.kvcache import KVCache
from engine.weights import Linear, build_linear, dense_dtype, to_float


def _neox_to_pairs(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that turns per-head halves [x0..x(d/2-1), y0..] into pairs [x0, y0, x1, y1, ...]."""
    half = head_dim // 2
    within = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


class Block:
    def __init__(self, cfg: ModelConfig, t: dict[str, TensorRecord], i: int, fmt: str, device: torch.device):
        p = f"blk.{i}."

        def vec(name: str) -> torch.Tensor:
            return torch.from_numpy(to_float(t[p + name]).reshape(-1)).to(device)

        perm = None
        if cfg.rope_style == "neox":
            q_perm = _neox_to_pairs(cfg.n_head, cfg.head_dim)
            k_perm = cfg.q_dim + _neox_to_pairs(cfg.n_head_kv, cfg.head_dim)
            v_rows = cfg.q_dim + cfg.kv_dim + np.arange(cfg.kv_dim)
            perm = np.concatenate([q_perm, k_perm, v_rows])
        qkv = [t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"]]
        biases = [t[p + f"attn_{x}.bias"] for x in "qkv"] if cfg.qkv_bias else None
        self.wqkv: Linear = build_linear(qkv, fmt, device, biases=biases, row_perm=perm)
        self.wo: Linear = build_linear([t[p + "attn_output.weight"]], fmt, device)
        self.w_gate_up: Linear = build_linear([t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]], fmt, device)
        self.w_down: Linear = build_linear([t[p + "ffn_down.weight"]], fmt, device)
        self.attn_norm = vec("attn_norm.weight")
        self.ffn_norm = vec("ffn_norm.weight")
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            half_perm = _neox_to_pairs(1, cfg.head_dim)
            self.q_norm = vec("attn_q_norm.weight")[half_perm]
            self.k_norm = vec("attn_k_norm.weight")[half_perm]

    @property
    def nbytes(self) -> int:
        vecs = [self.attn_norm, self.ffn_norm] + [v for v in (self.q_norm, self.k_norm) if v is not None]
        mats = [self.wqkv, self.wo, self.w_gate_up, self.w_down]
        return sum(m.nbytes for m in mats) + sum(v.nbytes for v in vecs)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, gguf: GGUFContents, fmt: str, device: torch.device):
        if cfg.rope_dim != cfg.head_dim:
            raise UnsupportedModel(f"partial rotary embeddings (rope dim {cfg.rope_dim} < head dim {cfg.head_dim})")
        t = dict(gguf.tensors)
        required = ["token_embd.weight", "output_norm.weight"]
        missing = [n for n in required if n not in t]
        if missing:
            raise UnsupportedModel(f"GGUF lacks tensors: {', '.join(missing)}")
        self.cfg = cfg
        self.device = device
        self.fmt = fmt
        try:
            self.blocks = [Block(cfg, t, i, fmt, device) for i in range(cfg.n_layer)]
        except KeyError as e:
            raise UnsupportedModel(f"GGUF lacks tensor {e.args[0]}") from None
        # The embedding table doubles as the output head when the model ties them.
        emb = to_float(t["token_embd.weight"])
        self.embed = torch.from_numpy(emb).to(device=device, dtype=dense_dtype(fmt, device, normalized_input=True))
        self.out_norm = torch.from_numpy(to_float(t["output_norm.weight"]).reshape(-1)).to(device)
        self.output: Linear | None = build_linear([t["output.weight"]], fmt, device, normalized_input=True) if "output.weight" in t else None
        self._rope_tables(t.get("rope_freqs.weight"))

    def _rope_tables(self, freq_factors: TensorRecord | None) -> None:
        cfg = self.cfg
        inv = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        if freq_factors is not None:  # Llama 3.1-style long-context scaling, precomputed by the converter
            inv = inv / torch.from_numpy(to_float(freq_factors).reshape(-1)).double()
        angles = torch.outer(torch.arange(cfg.n_ctx_train, dtype=torch.float64), inv)
        self.rope = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(self.device)  # [ctx, d/2]

    @property
    def weight_bytes(self) -> int:
        out = self.output.nbytes if self.output is not None else 0
        return sum(b.nbytes for b in self.blocks) + self.embed.nbytes + self.out_norm.nbytes + out

    def new_cache(self, n_ctx: int, dtype: torch.dtype = torch.float32) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, n_ctx, dtype, self.device)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = self._norm(h, self.out_norm)
        if self.output is not None:
            return self.output(h)
        return F.linear(h.to(self.embed.dtype), self.embed)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Spelled out: faster than F.rms_norm's composite on CPU for one row, and identical maths.
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.cfg.norm_eps) * w

    def _qkv(self, blk: Block, h: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections with rope applied: q [T, H, D], k and v [T, Hkv, D]."""
        T = h.shape[0]
        H, Hkv, D = self.cfg.n_head, self.cfg.n_head_kv, self.cfg.head_dim
        qkv = blk.wqkv(h).float()  # [T, (H + 2*Hkv) * D]
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
        if blk.q_norm is None:  # q and k are adjacent: rotate both in one complex multiply
            qk = torch.view_as_complex(qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D // 2, 2)) * rope
            qk = torch.view_as_real(qk).view(T, H + Hkv, D)
            return qk[:, :H], qk[:, H:], v
        q = self._norm(qkv[:, : H * D].view(T, H, D), blk.q_norm)
        k = self._norm(qkv[:, H * D: (H + Hkv) * D].view(T, Hkv, D), blk.k_norm)
        q = torch.view_as_real(torch.view_as_complex(q.view(T, H, D // 2, 2)) * rope).view(T, H, D)
        k = torch.view_as_real(torch.view_as_complex(k.view(T, Hkv, D // 2, 2)) * rope).view(T, Hkv, D)
        return q, k, v

    def _attend(self, q: torch.Tensor, li: int, cache: KVCache, start: int, end: int,
                mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """q [T, H, D] against cached positions [0, end) -> [T, H * D]."""
        T, H, D = q.shape
        Hkv = self.cfg.n_head_kv
        keys, vals = cache.layer_k[li][:, :end], cache.layer_v[li][:, :end]  # [Hkv, end, D]
        if T == 1:
            # One query row: plain batched matmuls over the kv heads beat SDPA's dispatch cost.
            qg = q.view(Hkv, H // Hkv, D).to(keys.dtype)
            scores = torch.baddbmm(qg.new_empty(()), qg, keys.transpose(1, 2), beta=0.0, alpha=D ** -0.5)
            return torch.bmm(torch.softmax(scores.float(), dim=-1).to(vals.dtype), vals).view(1, H * D)
        att = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0).to(keys.dtype), keys.unsqueeze(0), vals.unsqueeze(0),
            attn_mask=mask, is_causal=causal, enable_gqa=True,
        )  # [1, H, T, D]
        return att[0].transpose(0, 1).reshape(T, H * D)

    @torch.inference_mode()
    def forward_rows(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """tokens [N], caches N distinct caches -> logits [N, n_vocab] (float32)."""
        cfg = self.cfg
        pos = [c.n for c in caches]
        for c in caches:
            c.reserve(c.n + 1)
        rope = self.rope[torch.tensor(pos, device=self.device)].unsqueeze(1)  # [N, 1, D/2]
        x = self.embed[tokens].float()  # [N, n_embd]
        for li, blk in enumerate(self.blocks):
            q, k, v = self._qkv(blk, self._norm(x, blk.attn_norm), rope)
            rows = []
            for i, (c, p) in enumerate(zip(caches, pos)):
                c.layer_k[li][:, p] = k[i]
                c.layer_v[li][:, p] = v[i]
                rows.append(self._attend(q[i: i + 1], li, c, p, p + 1, None, False))
            x += blk.wo(torch.cat(rows))
            gate, up = blk.w_gate_up(self._norm(x, blk.ffn_norm)).split(cfg.n_ff, dim=-1)
            x += blk.w_down(F.silu(gate) * up)
        for c, p in zip(caches, pos):
            c.n = p + 1
        return self.head(x).float()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, logits: str = "last",
                cancel: Callable[[], bool] | None = None) -> torch.Tensor | None:
        cfg = self.cfg
        T = tokens.shape[0]
        end = start + T
        cache.reserve(end)
        rope = self.rope[start:end].unsqueeze(1)  # [T, 1, D/2]
        mask, causal = None, T > 1 and start == 0
        if T > 1 and start > 0:  # causal with the past visible: row i sees positions <= start + i
            pos = torch.arange(end, device=self.device)
            mask = pos[None, :] <= (start + torch.arange(T, device=self.device))[:, None]
        x = self.embed[tokens].float()  # [T, n_embd] residual stream, float32
        for li, blk in enumerate(self.blocks):
            if cancel is not None and cancel():  # cache.n is still `start`: nothing half-done is visible
                raise Cancelled(f"cancelled in layer {li} of a {T}-token step")
            q, k, v = self._qkv(blk, self._norm(x, blk.attn_norm), rope)
            cache.layer_k[li][:, start:end] = k.transpose(0, 1)
            cache.layer_v[li][:, start:end] = v.transpose(0, 1)
            x += blk.wo(self._attend(q, li, cache, start, end, mask, causal))
            gate, up = blk.w_gate_up(self._norm(x, blk.ffn_norm)).split(cfg.n_ff, dim=-1)
            x += blk.w_down(F.silu(gate) * up)
        cache.n = end
        if logits == "last":
            return self.head(x[-1:])[0].float()
        if logits == "all":
            return self.head(x).float()
        return None
