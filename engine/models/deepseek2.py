"""The deepseek2 family (DeepSeek-V2, V2-Lite, V3, R1 in llama.cpp's GGUF): multi-head latent
attention and a mixture of experts with shared experts.

Attention (MLA), per layer, with llama.cpp's tensor names and H heads of key width
`head_dim` = nope + rope (`ModelConfig.rope_dim` rotated dimensions last) and value width
`head_dim_v`:

- queries: `attn_q` [H * head_dim, n_embd], or with a q bottleneck (`q_lora_rank`) `attn_q_a`,
  an RMSNorm by `attn_q_a_norm` and `attn_q_b`; each head's last `rope_dim` dimensions rotate;
- `attn_kv_a_mqa` [kv_lora_rank + rope_dim, n_embd] gives one latent row per token: its first
  `kv_lora_rank` values, RMS-normed by `attn_kv_a_norm`, are the compressed keys and values of
  every head, the rest is one rotated key part shared by all heads;
- `attn_kv_b` [H * (nope + head_dim_v), kv_lora_rank] (or, in files converted for llama.cpp's
  latent cache, its halves `attn_k_b` [H, kv_lora_rank, nope] and `attn_v_b` [H, head_dim_v,
  kv_lora_rank]) expands the latent into each head's unrotated key and its value.

The cache keeps, per layer and position, only the normed latent and the rotated key part
(engine.kvcache.CacheLayout(1, 1, kv_lora_rank + rope_dim)): `kv_bytes_per_token` is
n_layer * (kv_lora_rank + rope_dim) * element size, instead of n_layer * H * (head_dim +
head_dim_v) * element size for the same heads cached as keys and values.  Attention never expands the
cache: the up-projections are absorbed into the query and the output (q_nope . (W_k c) =
(W_k^T q_nope) . c, and sum_j p_j W_v c_j = W_v sum_j p_j c_j), so a query attends in latent
space to [absorbed q_nope, q_rope] . [latent, key rope] and its latent output goes through W_v.
W_k and W_v are held in float32, each head's rows contiguous as the file stores `attn_k_b`
[H, kv_lora_rank, nope] and `attn_v_b` [H, head_dim_v, kv_lora_rank], so that a decoding row's two
products are row-major matrix-vector products (on CPU 2.2x and 3.2x faster than through the
transposed layout at DeepSeek-V2-Lite's shapes).  On CUDA with packed weights, where the file
splits them in a 4- to 8-bit grouped type, they are also held as the file has them
(engine.cuda_moe's stacked matrices, a quarter of the float32 bytes or less), and decoding
steps of up to `HEAD_STACK_ROWS` rows take them there: one indexed product per (row, head),
its inputs rounded to bfloat16 as every quantized product's are.  On CPU every row attends
alone (decode steps, batched rows and prefill chunks alike, with the same operations on the
same shapes), so prefill, token-by-token decoding and batched decoding compute the same bits;
other devices attend a prefill chunk, and a decoding step's rows of one pool, in one masked
batch.  Rope turns adjacent pairs (llama.cpp's rope type for deepseek2); YaRN scaling in the
metadata (`rope.scaling.type` yarn) blends interpolated and original frequencies per
dimension and scales the attention logits by mscale^2 with mscale = 1 +
`rope.scaling.yarn_log_multiplier` * ln(factor), as llama.cpp does for this family.

FFN: the first `leading_dense_block_count` layers have a dense SwiGLU (`ffn_gate/up/down`);
the others a routed mixture (engine.models.qwen_moe's experts and dispatch) plus the shared
experts (`ffn_*_shexp`, one SwiGLU every token runs, ungated).  Routing follows llama.cpp:
softmax or sigmoid scores (`expert_gating_func`); the expert bias `exp_probs_b` is added for
the selection only; with `expert_group_count` > 1 a token's experts come from the
`expert_group_used_count` groups whose two best biased scores sum highest; the top-k (ties to
the lower index) are weighted by their unbiased scores, renormalised where
`expert_weights_norm` says so, then multiplied by `expert_weights_scale`.  The router stays
float32, one row at a time.  The dense and shared FFNs add into the residual themselves
(`Expert.add_to`: fused SwiGLU, fused add), and on CPU the routed ones too (qwen_moe's
`add_experts_cpu`).  On CUDA with packed weights the routed experts are engine.cuda_moe's
stacked experts (engine.models.qwen_moe.routed_experts), routed by
engine.cuda_moe.route_grouped (this rule in one kernel) and added to the residual stream with
no read-back to the host; elsewhere the per-expert dispatch, which reads the routing back once
per layer.  On CUDA every RMSNorm is one float32 Triton kernel (engine.cuda_elementwise).

On CUDA with the experts stacked (or none), decoding steps and short prefills are captured in
CUDA graphs (engine.cuda_graphs, through `graph_step`): the same projections, norms and FFN as
the eager step, with the attention of each row done by engine.cuda_attention's latent kernel,
which reads the row's cache address and position from the graph's table, stores its new cache
row and attends in latent space (queries and probabilities in the cache's dtype, float32
accumulation, where the eager step widens the cache to float32).  The latent's norm and the
rope rotations that feed it are one kernel there (`latent_inputs`), and the absorbed products
are the eager step's.  Greedy sessions then run steps ahead as the llama family's
do.

`DeepSeek2Model` implements `engine.protocols.Network`; it is registered for deepseek2 in
engine.models.ARCHITECTURES.  It reads no files and knows nothing of tokens' text or sessions.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np
import torch

from engine import cuda_attention, cuda_elementwise, cuda_graphs, cuda_moe
from engine.config import ModelConfig, UnsupportedModel
from engine.errors import Cancelled
from engine.gguf_file import GGUFContents, TensorRecord
from engine.kernels import CpuKernels
from engine.kvcache import CacheLayout, KVCache
from engine.models.common import CachedNetwork
from engine.models.llama import TorchKernels
from engine.models.qwen_moe import (Expert, add_experts_cpu, experts_nbytes, float32_rows, mix_experts,
                                    routed_experts, stacks_experts, swiglu_expert)
from engine.weights import DenseLinear, Embedding, Linear, build_linear, to_float

# llama.cpp's floor on the sum that renormalised routing weights are divided by.
MIN_WEIGHT_SUM = 6.103515625e-5

ROW_LANES = 64
"""`sigmoid_rows` pads each row to a multiple of this many elements (a multiple of every CPU
path's float vector loop)."""


def sigmoid_rows(scores: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid of [T, n] scores with each row's bits independent of T.  torch runs an
    elementwise op over the flat tensor in vectors and the last few elements by a scalar
    loop, whose sigmoid rounds differently; with n not a multiple of the vector loop (a small
    expert count), an element's path, and so its bits, would depend on how many rows came
    before it.  Each row is padded to `ROW_LANES` elements so every element takes the vector
    path, in the same lane, for any T."""
    T, n = scores.shape
    width = -(-n // ROW_LANES) * ROW_LANES
    if width == n:
        return torch.sigmoid(scores)
    padded = scores.new_zeros(T, width)
    padded[:, :n] = scores
    return torch.sigmoid(padded)[:, :n]


# Router scores -> each expert's weight, by `ModelConfig.expert_gating`; each row's result
# independent of the other rows (softmax works row by row).
GATING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda scores: torch.softmax(scores, dim=-1),
    "sigmoid": sigmoid_rows,
}


def route(scores: torch.Tensor, k: int, gating: str, bias: torch.Tensor | None = None, n_groups: int = 0,
          n_groups_used: int = 0, normalise: bool = False, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router scores [T, n_expert] -> (expert ids [T, k], float32 weights [T, k]) by llama.cpp's
    rule (see the module docstring).  Of equal selection scores the lower index comes first."""
    scores = scores.float()
    probs = GATING[gating](scores)
    select = probs if bias is None else probs + bias
    if n_groups > 1 and n_groups_used < n_groups:
        T, E = select.shape
        grouped = select.view(T, n_groups, E // n_groups)
        best = torch.topk(grouped, min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, n_groups]
        kept = torch.sort(best, dim=-1, descending=True, stable=True).indices[:, :n_groups_used]
        dropped = torch.ones_like(best, dtype=torch.bool).scatter_(1, kept, False)
        select = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(T, E)
    # A stable sort, not topk: topk's order among equal scores is unspecified.
    ids = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(1, ids)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
    return ids, weights * scale


def yarn_rope(cfg: ModelConfig, meta: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of the rope_dim/2 pairs, float64; the attention logits' factor
    mscale^2) for the metadata's rope scaling: none, or YaRN as ggml computes it (beta_fast
    32, beta_slow 1, the rope's magnitude left at 1 for this family)."""
    a = cfg.arch
    d = cfg.rope_dim
    inv = cfg.rope_base ** -(torch.arange(0, d, 2, dtype=torch.float64) / d)
    kind = meta.get(f"{a}.rope.scaling.type") or "none"
    factor = float(meta.get(f"{a}.rope.scaling.factor") or 1.0)
    if kind == "none" or factor == 1.0:
        return inv, 1.0
    if kind != "yarn":
        raise UnsupportedModel(f"rope scaling {kind!r} ({a}.rope.scaling.type)")
    orig = float(meta.get(f"{a}.rope.scaling.original_context_length") or cfg.n_ctx_train)
    beta_fast = float(meta.get(f"{a}.rope.scaling.yarn_beta_fast") or 32.0)
    beta_slow = float(meta.get(f"{a}.rope.scaling.yarn_beta_slow") or 1.0)

    def corr_dim(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(d - 1.0, math.ceil(corr_dim(beta_slow)))
    pair = torch.arange(d // 2, dtype=torch.float64)
    extrapolated = 1 - ((pair - low) / max(0.001, high - low)).clamp(0, 1)  # 1: keep the original frequency
    inv = inv * (extrapolated + (1 - extrapolated) / factor)
    mscale = 1.0 + float(meta.get(f"{a}.rope.scaling.yarn_log_multiplier") or 0.0) * math.log(factor)
    return inv, mscale * mscale


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [..., rope_dim] with its adjacent pairs turned by `rope` (complex, broadcast to
    [..., rope_dim / 2]): a new float32 tensor."""
    pairs = torch.view_as_complex(x.float().contiguous().view(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rope).flatten(-2)


HEAD_STACK_ROWS = cuda_moe.GEMV_MAX_ROWS
"""Rows up to which the absorbed products read the per-head stacks (`MlaBlock.k_stack`); more
rows (prefill chunks, wide decoding steps) take the float32 batched products."""


def head_stack(record: TensorRecord, shape: tuple[int, int, int],
               device: torch.device) -> "cuda_moe.StackedWeight | None":
    """attn_k_b or attn_v_b, [H, rows, k] in the file (or its rows as one matrix), as
    engine.cuda_moe holds stacked matrices, where that keeps its values exact (the 4- to 8-bit
    grouped types, k a whole number of groups); else None."""
    if cuda_moe.stack_format([record.qtype]) == "bf16" or record.shape[-1] != shape[2] \
            or math.prod(record.shape) != math.prod(shape):
        return None
    try:
        return cuda_moe.StackedWeight([TensorRecord(record.name, record.qtype, shape, record.data)], device)
    except ValueError:  # inputs not a whole number of groups
        return None


class MlaBlock:
    """One layer's weights: latent attention and a dense or mixture FFN."""

    def __init__(self, cfg: ModelConfig, t: dict[str, TensorRecord], i: int, fmt: str, device: torch.device,
                 cpu: CpuKernels | None):
        p = f"blk.{i}."
        H, rank = cfg.n_head, cfg.kv_lora_rank
        nope, dv = cfg.head_dim - cfg.rope_dim, cfg.head_dim_v or cfg.head_dim

        def vec(name: str) -> torch.Tensor:
            return torch.from_numpy(to_float(t[p + name]).reshape(-1)).to(device)

        def dense(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(device)

        self.attn_norm = vec("attn_norm.weight")
        self.ffn_norm = vec("ffn_norm.weight")
        self.kv_a_norm = vec("attn_kv_a_norm.weight")
        # q (or q's bottleneck) and the latent row read the same normed input: one matmul.
        q_in = "attn_q_a.weight" if cfg.q_lora_rank else "attn_q.weight"
        self.w_in: Linear = build_linear([t[p + q_in], t[p + "attn_kv_a_mqa.weight"]], fmt, device, cpu=cpu)
        self.q_a_norm = vec("attn_q_a_norm.weight") if cfg.q_lora_rank else None
        self.w_q_b: Linear | None = build_linear([t[p + "attn_q_b.weight"]], fmt, device, cpu=cpu) \
            if cfg.q_lora_rank else None
        def up(name: str, *shape: int) -> np.ndarray:
            w = to_float(t[p + name])
            if w.size != math.prod(shape):
                raise UnsupportedModel(f"{p}{name} has shape {tuple(w.shape)}, not {' x '.join(map(str, shape))} "
                                       f"(heads x widths from the metadata)")
            return w.reshape(shape)

        if p + "attn_kv_b.weight" in t:
            kv_b = up("attn_kv_b.weight", H, nope + dv, rank)
            w_k, w_v = kv_b[:, :nope].transpose(0, 2, 1), kv_b[:, nope:]
        else:
            w_k = up("attn_k_b.weight", H, rank, nope)
            w_v = up("attn_v_b.weight", H, dv, rank)
        self.w_k = dense(w_k)  # [H, rank, nope]: w_k @ q_nope [H, nope, 1] -> the absorbed query
        self.w_v = dense(w_v)  # [H, dv, rank]: w_v @ latent output [H, rank, 1] -> the heads' values
        self.k_stack = self.v_stack = None  # the same matrices as the file holds them (CUDA, few rows)
        if stacks_experts(device, fmt) and p + "attn_k_b.weight" in t:
            self.k_stack = head_stack(t[p + "attn_k_b.weight"], (H, rank, nope), device)
            self.v_stack = head_stack(t[p + "attn_v_b.weight"], (H, dv, rank), device)
        self.wo: Linear = build_linear([t[p + "attn_output.weight"]], fmt, device, cpu=cpu)
        self.dense: Expert | None = None
        self.experts: list[Expert] | cuda_moe.StackedExperts = []
        self.router: Linear | None = None
        self.bias: torch.Tensor | None = None
        self.shared: Expert | None = None
        if i < cfg.n_layer_dense_lead:
            self.dense = swiglu_expert(t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"], t[p + "ffn_down.weight"], fmt,
                                       device, cpu)
            return
        self.experts = routed_experts(t, p, cfg.n_expert, fmt, device, cpu)
        self.router = float32_rows(to_float(t[p + "ffn_gate_inp.weight"]).reshape(cfg.n_expert, cfg.n_embd), device)
        if p + "exp_probs_b.bias" in t:
            self.bias = vec("exp_probs_b.bias")
        if p + "ffn_up_shexp.weight" in t:
            self.shared = swiglu_expert(t[p + "ffn_gate_shexp.weight"], t[p + "ffn_up_shexp.weight"],
                                        t[p + "ffn_down_shexp.weight"], fmt, device, cpu)

    @property
    def nbytes(self) -> int:
        mats = [self.w_in, self.w_q_b, self.wo, self.dense, self.shared, self.router]
        vecs = [self.attn_norm, self.ffn_norm, self.kv_a_norm, self.q_a_norm, self.bias, self.w_k, self.w_v,
                self.k_stack, self.v_stack]
        return (sum(m.nbytes for m in mats if m is not None) + sum(v.nbytes for v in vecs if v is not None)
                + experts_nbytes(self.experts))


class DeepSeek2Model(CachedNetwork):
    """engine.protocols.Network for deepseek2 files (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, gguf: GGUFContents, fmt: str, device: torch.device,
                 cpu_kernels: CpuKernels | None = None):
        if cfg.kv_lora_rank <= 0:
            raise UnsupportedModel(f"{cfg.arch} without attention.kv_lora_rank in its metadata")
        if not 2 <= cfg.rope_dim < cfg.head_dim or cfg.rope_dim % 2:
            raise UnsupportedModel(f"rope dim {cfg.rope_dim} for key width {cfg.head_dim}")
        if cfg.n_layer_dense_lead < cfg.n_layer and not 0 < cfg.n_expert_used <= cfg.n_expert:
            raise UnsupportedModel(f"{cfg.n_expert_used} experts used of {cfg.n_expert}")
        if cfg.n_expert_groups > 1 and (cfg.n_expert % cfg.n_expert_groups or cfg.n_group_used < 1):
            raise UnsupportedModel(f"{cfg.n_expert} experts in {cfg.n_expert_groups} groups, "
                                   f"{cfg.n_group_used} used")
        t = dict(gguf.tensors)
        self.cfg = cfg
        self.device = device
        self.fmt = fmt
        self.cpu_kernels = cpu_kernels if device.type == "cpu" else None
        if device.type == "cpu" and cpu_kernels is None:
            raise ValueError("a CPU model needs a CPU kernel path (engine.kernels.cpu_kernels)")
        try:
            self.blocks = [MlaBlock(cfg, t, i, fmt, device, self.cpu_kernels) for i in range(cfg.n_layer)]
            self.embed = Embedding(t["token_embd.weight"], fmt, device)
            self.out_norm = torch.from_numpy(to_float(t["output_norm.weight"]).reshape(-1)).to(device)
        except KeyError as e:
            raise UnsupportedModel(f"GGUF lacks tensor {e.args[0]}") from None
        self.head_is_table = "output.weight" not in t and self.embed.table is not None
        if self.head_is_table:
            self.output: Linear = DenseLinear(self.embed.table)
        else:
            self.output = build_linear([t.get("output.weight", t["token_embd.weight"])], fmt, device,
                                       cpu=self.cpu_kernels)
        # Whether every row attends alone, in prefill chunks as in decoding steps, so that they
        # compute the same bits (CPU); else a chunk's rows, and a step's rows of one pool,
        # attend in one masked batch (other devices).
        self.rows_alone = device.type == "cpu"
        # The llama family's norm: on CPU the compiled kernel, in prefill and decoding alike.
        self.ops = TorchKernels(torch.tensor(cfg.norm_eps, dtype=torch.float32, device=device), cfg.n_ff,
                                self.cpu_kernels)
        # On CUDA with Triton each norm is one float32 kernel instead of torch's five (a decoding
        # step has 3 a layer), in eager and replayed steps alike, so both route on the same scores.
        self.fused_norm = device.type == "cuda" and cuda_attention.AVAILABLE
        self.renormalise = bool(cfg.expert_weights_norm)  # llama.cpp's default for this family: no
        inv, logit_factor = yarn_rope(cfg, gguf.metadata)
        self.scale = logit_factor / math.sqrt(cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.n_ctx_train, dtype=torch.float64), inv)
        self.rope = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)  # [n_ctx, rope/2]
        # CUDA: decoding steps and short prefills replay captured graphs (engine.cuda_graphs)
        # where no step waits for the host, i.e. the routed experts are stacked and routed on
        # the device (or there are none).
        no_read_back = stacks_experts(device, fmt) or cfg.n_layer_dense_lead >= cfg.n_layer
        self.decode_graphs = cuda_graphs.DecodeGraphs(self) if no_read_back and cuda_graphs.usable(device) else None

    # -- the Network contract -------------------------------------------------------------

    def cache_layout(self) -> CacheLayout:
        """One row per layer and position: the normed latent, then the rotated key part."""
        return CacheLayout(1, 1, self.cfg.kv_lora_rank + self.cfg.rope_dim)

    @property
    def attention_path(self) -> str:
        if self.decode_graphs is not None and self.decode_graphs.enabled:
            return f"latent attention, absorbed projections (Triton kernels in CUDA graphs, {self.device.type})"
        return f"latent attention, absorbed projections (torch ops, {self.device.type})"

    def work_bytes(self, n_tokens: int, ctx: int) -> int:
        """Working buffers of one step of `n_tokens` rows against `ctx` positions: float32
        activations (residual, norms, projections, latent rows, absorbed queries, outputs),
        routing buffers, one layer's cache read as float32, scores, one row of logits."""
        cfg = self.cfg
        T, H = n_tokens, cfg.n_head
        row = cfg.kv_lora_rank + cfg.rope_dim
        attn = cfg.q_lora_rank + H * cfg.head_dim + row + H * (row + (cfg.head_dim_v or cfg.head_dim))
        width = max(cfg.n_ff, cfg.n_ff_exp * max(1, cfg.n_expert_used))
        ffn = cfg.n_expert_used * cfg.n_embd + 3 * width + cfg.n_expert
        return 4 * T * (4 * cfg.n_embd + attn + ffn) + 4 * (ctx * row + H * T * ctx) + 4 * cfg.n_vocab

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, logits: str = "last",
                cancel: Callable[[], bool] | None = None) -> torch.Tensor | None:
        T = tokens.shape[0]
        if T == 1 and logits == "last" and start == cache.n:  # a decode step: one code path for all
            if cancel is not None and cancel():
                raise Cancelled("cancelled before a one-token step")
            return self.forward_rows(tokens, [cache])[0]
        end = start + T
        cache.reserve(end)
        done, out = self.graph_prefill(tokens, start, cache, logits, cancel)
        if done:
            return out
        x = self.embed(tokens)
        rope = self.rope[start:end]
        for li, blk in enumerate(self.blocks):
            if cancel is not None and cancel():  # cache.n is still `start`: nothing half-done is visible
                raise Cancelled(f"cancelled in layer {li} of a {T}-token step")
            q, rows = self._project(blk, x, rope)
            layer = cache.layer_k[li][0]  # [capacity, kv_lora_rank + rope_dim]
            layer[start:end] = rows.to(layer.dtype)
            if self.rows_alone:
                # Widened once for the chunk, not once per row (exact: the rows see the same values).
                lat = layer[:end].float()
                out = torch.stack([self._attend_row(blk, q[i], lat[: start + i + 1]) for i in range(T)])
            else:
                out = self._attend_chunk(blk, q, layer[:end], start)
            blk.wo.accumulate(x, out)
            self.feed_forward(blk, x)
        cache.n = end
        if logits == "last":
            return self._head(x[-1:])[0]
        if logits == "all":
            return self._head(x)
        return None

    @torch.inference_mode()
    def forward_rows(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """tokens [N], caches N distinct caches -> logits [N, n_vocab] (float32)."""
        pos = [c.n for c in caches]
        for c in caches:
            c.reserve(c.n + 1)
        x = self.embed(tokens)
        rope = self.rope[torch.tensor(pos, device=self.device)]
        attend = self._row_attention(caches, pos)
        for li, blk in enumerate(self.blocks):
            q, rows = self._project(blk, x, rope)
            blk.wo.accumulate(x, attend(li, blk, q, rows))
            self.feed_forward(blk, x)
        for c, p in zip(caches, pos):
            c.n = p + 1
        return self._head(x)

    def graph_workspace(self, n_rows: int, n_ctx: int, out_dtype: torch.dtype) -> cuda_attention.Workspace:
        """engine.cuda_graphs.GraphNetwork: the latent attention kernel's scratch (its outputs
        float32, whatever `out_dtype`: they go through W_v, not straight into a matmul)."""
        return cuda_attention.Workspace.latent(n_rows, self.cfg.n_head, self.cfg.kv_lora_rank, n_ctx, self.device)

    def graph_step(self, table: torch.Tensor, base: torch.Tensor, work: cuda_attention.Workspace,
                   kernels: Any, shared: bool) -> torch.Tensor:
        """engine.cuda_graphs.GraphNetwork: forward_rows's step with each row's cache read from
        the table by the latent attention kernel.  With `kernels` set (the graphs' `fused`) the
        latent's norm and the rotations are one kernel (cuda_attention.latent_inputs) and the
        absorbed query goes to the attention as the batched product leaves it; None keeps
        `_project`'s torch ops.  The other norms are the model's own in both, so eager and
        replayed steps route on the same scores."""
        cfg = self.cfg
        B, H, rank, nope = table.shape[0], cfg.n_head, cfg.kv_lora_rank, cfg.head_dim - cfg.rope_dim
        x = self.embed(table[:, cuda_attention.TOKEN])
        rope = self.rope[table[:, cuda_attention.POS]]  # [B, rope/2]
        turns = torch.view_as_real(rope).contiguous()  # [B, rope/2, 2]: cos, sin
        for li, blk in enumerate(self.blocks):
            if kernels is not None:
                q, kv = self._projections(blk, x)
                q_rope, rows = cuda_attention.latent_inputs(q, kv, turns, blk.kv_a_norm, cfg.norm_eps, H, nope)
                q_lat = self._absorbed(blk, q.view(B, H, cfg.head_dim)[:, :, :nope])  # [B, H, rank]
            else:
                q, rows = self._project(blk, x, rope)
                both = self._absorb(blk, q)
                q_lat, q_rope = both[:, :, :rank], both[:, :, rank:]
            lat = cuda_attention.latent_attention(q_lat, q_rope, rows, table, li, base, work, self.scale,
                                                  store_first=shared)
            blk.wo.accumulate(x, self._values(blk, lat.view(B, H, rank)))
            self.feed_forward(blk, x)
        return self._head(x)

    # -- the computation ------------------------------------------------------------------

    def _row_attention(self, caches: list[KVCache], pos: list[int]) -> Callable[..., torch.Tensor]:
        """attend(layer, block, q [N, H, head_dim], rows [N, width]) -> [N, H * dv] for one
        decoding step: stores each row's latent at its position and attends each row to its
        own cache.  Rows alone (CPU) attend one by one; otherwise rows of one pool attend in
        one batch over the longest row's length, each masked to its own (positions past a
        shorter row's end are zero-filled pool memory, finite under the mask)."""
        pool = caches[0].pool
        if self.rows_alone or len(caches) == 1 or pool is None or any(c.pool is not pool for c in caches):
            def attend(li: int, blk: MlaBlock, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
                layers = [c.layer_k[li][0] for c in caches]
                for i, (layer, p) in enumerate(zip(layers, pos)):
                    layer[p] = rows[i].to(layer.dtype)
                return torch.stack([self._attend_row(blk, q[i], layer[: p + 1])
                                    for i, (layer, p) in enumerate(zip(layers, pos))])
            return attend
        slots = [c.slot for c in caches]
        where = pool.row_index(slots, pos)  # one row per (slot, position) in a one-part layout
        picked = torch.tensor(slots, device=self.device)
        L = max(pos) + 1
        hidden = torch.arange(L, device=self.device)[None, :] > torch.tensor(pos, device=self.device)[:, None]

        def attend_pooled(li: int, blk: MlaBlock, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            pool.layer_rows[li].index_copy_(0, where, rows.to(pool.kv.dtype))
            lat = pool.layer_kv[li][0, :, 0, :L].index_select(0, picked)  # [N, L, width]
            return self._attend_rows_masked(blk, q, lat, hidden)
        return attend_pooled

    def _attend_rows_masked(self, blk: MlaBlock, q: torch.Tensor, lat: torch.Tensor,
                            hidden: torch.Tensor) -> torch.Tensor:
        """N rows' queries [N, H, head_dim] against their own latents [N, L, width], positions
        where `hidden` [N, L] is True left out: [N, H * dv]."""
        lat = lat.float()
        scores = torch.bmm(self._absorb(blk, q), lat.transpose(1, 2))  # [N, H, L]
        probs = torch.softmax((scores * self.scale).masked_fill_(hidden[:, None], float("-inf")), dim=-1)
        return self._values(blk, torch.bmm(probs, lat[:, :, :self.cfg.kv_lora_rank]))

    def _absorb(self, blk: MlaBlock, q: torch.Tensor) -> torch.Tensor:
        """N rows' queries [N, H, head_dim] -> [N, H, kv_lora_rank + rope_dim] (contiguous):
        each head's unrotated part through its W_k, its rotated part as it is."""
        nope = self.cfg.head_dim - self.cfg.rope_dim
        return torch.cat([self._absorbed(blk, q[:, :, :nope]), q[:, :, nope:]], dim=2)

    @staticmethod
    def _absorbed(blk: MlaBlock, q_nope: torch.Tensor) -> torch.Tensor:
        """Each head's unrotated query [N, H, nope] through its W_k: [N, H, kv_lora_rank] float32
        (possibly a view).  A few rows on CUDA read the file's matrices (`k_stack`, their
        inputs rounded to bfloat16 as every quantized product's are); else float32 W_k."""
        if blk.k_stack is not None and q_nope.shape[0] <= HEAD_STACK_ROWS:
            return cuda_moe.matrix_products(q_nope, blk.k_stack)
        return torch.bmm(q_nope.transpose(0, 1), blk.w_k.transpose(1, 2)).transpose(0, 1)

    @staticmethod
    def _values(blk: MlaBlock, lat: torch.Tensor) -> torch.Tensor:
        """Each head's attention-weighted latent [N, H, kv_lora_rank] through its W_v: [N, H * dv]
        (`v_stack` for a few rows on CUDA, as `_absorbed`)."""
        N, H = lat.shape[:2]
        out = torch.empty((N, H, blk.w_v.shape[1]), dtype=torch.float32, device=lat.device)
        if blk.v_stack is not None and N <= HEAD_STACK_ROWS:
            cuda_moe.matrix_products(lat, blk.v_stack, out=out)
        else:  # written through its [H, N, dv] view: the batched product's own layout, no copy after
            torch.bmm(lat.transpose(0, 1), blk.w_v.transpose(1, 2), out=out.transpose(0, 1))
        return out.view(N, -1)

    def _projections(self, blk: MlaBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, H * head_dim], latent rows [T, kv_lora_rank + rope_dim]) of x's T rows as
        the projections give them (float32, neither normed nor rotated; possibly slices of one
        wider tensor)."""
        both = blk.w_in(self.norm(x, blk.attn_norm)).float()
        split = both.shape[1] - self.cfg.kv_lora_rank - self.cfg.rope_dim
        if blk.w_q_b is not None:
            return blk.w_q_b(self.norm(both[:, :split], blk.q_a_norm)).float(), both[:, split:]
        return both[:, :split], both[:, split:]

    def _project(self, blk: MlaBlock, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, H, head_dim] float32, latent rows [T, kv_lora_rank + rope_dim] float32)
        of x's T rows, the rope parts of both rotated by `rope` [T, rope_dim/2]."""
        cfg = self.cfg
        T, H, rank, nope = x.shape[0], cfg.n_head, cfg.kv_lora_rank, cfg.head_dim - cfg.rope_dim
        q, kv = self._projections(blk, x)
        q = q.reshape(T, H, cfg.head_dim)
        q = torch.cat([q[:, :, :nope], _rotate(q[:, :, nope:], rope.unsqueeze(1))], dim=2)
        latent = self.norm(kv[:, :rank], blk.kv_a_norm)
        return q, torch.cat([latent, _rotate(kv[:, rank:], rope)], dim=1)

    def _attend_row(self, blk: MlaBlock, q: torch.Tensor, lat: torch.Tensor) -> torch.Tensor:
        """One row's queries [H, head_dim] against its cached rows [L, rank + rope] -> [H * dv]:
        the query absorbed into latent space, softmax, the latent output through W_v."""
        nope, rank = self.cfg.head_dim - self.cfg.rope_dim, self.cfg.kv_lora_rank
        lat = lat.float()
        if blk.k_stack is not None:  # CUDA: the per-head stacks, as a few pooled rows take them
            absorbed = self._absorbed(blk, q[None, :, :nope])[0]
        else:
            # Each vector goes in as a transposed row ([H, 1, n] viewed as [H, n, 1]): BLAS then
            # runs a matrix-vector product, where a unit-stride column took a general GEMM at
            # about 6x the time (torch 2.13, measured at DeepSeek-V2-Lite's shapes).
            absorbed = torch.bmm(blk.w_k, q[:, None, :nope].transpose(1, 2))[:, :, 0]  # [H, rank]
        scores = torch.cat([absorbed, q[:, nope:]], dim=1) @ lat.T  # [H, L]
        probs = torch.softmax(scores * self.scale, dim=-1)
        if blk.v_stack is not None:
            return self._values(blk, (probs @ lat[:, :rank])[None]).reshape(-1)
        return torch.bmm(blk.w_v, (probs @ lat[:, :rank])[:, None].transpose(1, 2)).reshape(-1)

    def _attend_chunk(self, blk: MlaBlock, q: torch.Tensor, lat: torch.Tensor, start: int) -> torch.Tensor:
        """Every row of a chunk at once (positions start..), causally masked: [T, H * dv]."""
        T = q.shape[0]
        nope, rank = self.cfg.head_dim - self.cfg.rope_dim, self.cfg.kv_lora_rank
        lat = lat.float()
        absorbed = torch.bmm(q[:, :, :nope].transpose(0, 1), blk.w_k.transpose(1, 2))  # [H, T, rank]
        scores = torch.cat([absorbed, q[:, :, nope:].transpose(0, 1)], dim=2) @ lat.T  # [H, T, L]
        hidden = torch.arange(lat.shape[0], device=q.device)[None, :] > \
            (start + torch.arange(T, device=q.device))[:, None]
        probs = torch.softmax((scores * self.scale).masked_fill_(hidden, float("-inf")), dim=-1)
        out = torch.bmm(probs @ lat[:, :rank], blk.w_v.transpose(1, 2))  # [H, T, dv]
        return out.transpose(0, 1).reshape(T, -1)

    def feed_forward(self, blk: MlaBlock, x: torch.Tensor) -> None:
        """x += the block's dense FFN, or its routed experts plus its shared ones, of x."""
        cfg = self.cfg
        h = self.norm(x, blk.ffn_norm)
        cpu = x.device.type == "cpu"
        if blk.dense is not None:
            blk.dense.add_to(x, h)
            return
        rule = (cfg.n_expert_used, cfg.expert_gating, blk.bias, cfg.n_expert_groups, cfg.n_group_used,
                self.renormalise, cfg.expert_weights_scale)
        if isinstance(blk.experts, cuda_moe.StackedExperts):  # CUDA: routed in one kernel, nothing read back
            ids, weights = cuda_moe.route_grouped(blk.router(h), *rule, min_sum=MIN_WEIGHT_SUM)
            if blk.shared is not None:
                blk.shared.add_to(x, h)
            blk.experts(h, ids, weights, into=x)
            return
        ids, weights = route(blk.router(h), *rule)
        if cpu:  # the routed experts, then the shared ones, added into the residual row by row
            add_experts_cpu(blk.experts, x, h, ids, weights)
            if blk.shared is not None:
                blk.shared.add_to(x, h)
            return
        acc = mix_experts(blk.experts, h, ids, weights)
        if blk.shared is not None:
            acc = acc + blk.shared(h)
        x += acc

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x's rows (float32), each row on its own."""
        if self.fused_norm:
            return cuda_elementwise.rms_norm(x, weight, self.cfg.norm_eps, torch.float32)
        return self.ops.norm(x, weight)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h, self.out_norm)).float()
