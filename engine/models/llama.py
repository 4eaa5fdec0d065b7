"""The llama family forward pass: llama (SmolLM2, TinyLlama, Llama 3.x, Mistral), qwen2, qwen3.

One decoder-only transformer: RMSNorm, grouped-query attention with RoPE, SwiGLU FFN,
tied or separate output head.  The variants differ only in q/k/v bias (qwen2), per-head
q/k RMSNorm (qwen3) and the RoPE pairing; neox pairing (i, i + d/2) is turned into the
adjacent-pair layout (2i, 2i+1) at load time by permuting the q/k output rows (attention
scores are invariant under the same permutation of q and k), so one rope kernel serves all.
Partial rotary embeddings (rope_dim < head_dim) turn only each head's first rope_dim
dimensions: the rope table multiplies the remaining pairs by exactly 1.
A sliding window in the metadata (`ModelConfig.sliding_window`, Mistral-style files) applies
to every layer: a query at position p attends to positions p - window + 1 .. p, on every path
below (the compiled kernels take the window as an argument), while the cache keeps every
position as it does without a window.
Subclasses change only what is loaded (engine.models.phi3: `Block.qkv_records` /
`gate_up_records` name the fused tensors, `rope_tables` / `rope_for` give the rotations).

`LlamaModel` implements `engine.protocols.Network` and is registered for llama, qwen2 and
qwen3 in engine.models.ARCHITECTURES.  A family with this attention and another FFN subclasses
it through three public hooks, `block_class` (whose `build_ffn` and `ffn_bytes` it overrides),
`feed_forward` and `captures_graphs` (engine.models.qwen_moe does).
`LlamaModel.forward(tokens, start, cache, logits=...)` evaluates T new tokens at positions
[start, start+T) against `cache`, writes their keys/values and returns float32 logits for
the last position ([n_vocab]), for every position ([T, n_vocab]) or nothing.
`LlamaModel.forward_rows(tokens, caches)` is decoding: one new token for each of N
independent sequences, each at the end of its own cache (N = 1 is a session's own decode
step, so a row decoded in a batch and alone run the same code).  The matmuls (where the
weights are read) run once for all rows, with kernels whose result for a row does not depend
on the other rows.  Each row attends to its own cache at its own length, never padded to a
common one: torch's batched attention over padded rows is not bitwise equal to one row at
its own length (its kernels block the key axis by its size), and the activations' rounding to
bfloat16 at the int4 matmuls amplifies a last-bit difference into other greedy tokens within
a few dozen steps.  On CPU the compiled kernel (engine.kernels) stores and attends every row
of a layer in one call, each (row, kv head) on one thread; where it cannot be built, torch
matmuls attend row by row.  With that kernel, each half of a decoding layer whose matrices are
plain int4 runs as one compiled op of the same kernels (`decode_layers_in_blocks`), the same
bits without a dozen dispatches between them.  Either way batched and single decoding agree exactly.  A prefill
chunk's rows attend the same way on CPU (the kernel's prefill op, or the torch-ops rows), and
its matmuls are the same row-independent kernels, so a prompt prefilled in chunks, scored
position by position or decoded token by token gives the same logits bit for bit (the `amx`
path aside, whose tile kernel for 32 rows and more sums in another order).  On CUDA (where no
kernel is bitwise row-invariant anyway) rows of one `KVPool` attend in one masked batch, and a
prefill chunk in one scaled-dot-product call.  Caches may hold float16 (see engine.model.kv_cache_dtype); CPU attention reads them
into float32.
Residual stream, norms, rope and attention run in float32; matmuls in the weights' own
compute dtype (see engine.weights).  Decoding is dispatch-bound on CPU (a token of SmolLM2 is
about a thousand small tensor operations next to 5 ms of matmuls), so the code favours
fewer operations: rope rotates q and k in place inside the fused qkv output, one copy stores
a layer's K and V, and the norm takes its mean square from one fused vector norm.
It reads no files beyond the given records and knows nothing of tokens' text or sessions.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.config import ModelConfig, UnsupportedModel
from engine.errors import Cancelled
from engine.gguf_file import GGUFContents, TensorRecord
from engine import cuda_attention, cuda_elementwise, cuda_graphs
from engine.kernels import ATTENTION_CACHE_DTYPES, CpuKernels, attention_fits
from engine.kvcache import KVCache, KVPool
from engine.models.common import CachedNetwork
from engine.weights import DenseLinear, Embedding, Linear, build_linear, to_float

# Prefill attention off the CPU: flash attention for a causal chunk from position 0 in a 16-bit
# cache, the memory-efficient kernel where a mask is needed or the cache is float32, the math
# path where neither applies.  Not cuDNN's attention, which torch prefers on Hopper: it builds
# an execution plan for every new shape, and each prompt length is one (about 70 ms per new
# length on an H200, 42 ms on an H100, against a 25 ms prefill of 91 tokens), so short cases of
# varied lengths paid it again and again, although at 2048 positions it attends 1.5x faster.
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Whether a CUDA prefill chunk's queries, keys and values are made by one kernel
# (cuda_attention.prefill_inputs: turned, stored, the queries laid out for the attention) where
# torch's ops take a cast, the complex product, the cache store and two copies.  The same values
# (tests/engine/test_cuda_attention.py); read when a model is loaded.  An H100's 2048-token
# prefill of the Llama-3.2-1B shape: 1.029x.
PREFILL_INPUTS_KERNEL = True


def flash_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's flash attention runs an unmasked prefill call of these keys, so that its
    grouped heads need no repeating (`enable_gqa`; where flash cannot run, the memory-efficient
    kernel would refuse them and the math path take them, far slower).  An H100's attention of
    2048 positions of the Llama-3.2-1B shape: 93 us grouped, 98 us repeated."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and cuda_attention.device_capability(device.index) >= (8, 0))


class StepKernels(Protocol):
    """A forward pass's elementwise work: the block and output RMSNorms (not qwen3's per-head
    ones) and the SwiGLU.  `TorchKernels` is the model's own; engine.cuda_graphs passes fused
    kernels to `LlamaModel.decode_layers` instead."""

    out_dtype: torch.dtype | None  # what fused CUDA kernels write (engine.weights.SwiGLUKernels)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def swiglu(self, gate_up: torch.Tensor, op_dtype: torch.dtype | None = None) -> torch.Tensor:
        """silu(gate) * up, each op rounded as torch's on tensors of `op_dtype` (default
        gate_up's own: another where gate_up holds values of it exactly, `Linear.narrow`)."""
        ...


class TorchKernels:
    """StepKernels in torch ops, float32 (the CPU path, eager CUDA decoding, and CUDA prefill
    where no decoding graphs run: elsewhere `prefill_kernels` are the graphs' own).  On CPU
    the compiled kernels' `rms_norm` and `swiglu` (engine.kernels) replace the norm's five torch
    ops for [rows, n_embd] inputs (and for per-head [T, heads, D] ones, the heads taken as rows)
    and the SwiGLU's three, the same ops in prefill and decoding."""

    out_dtype = None  # torch ops: each result in its inputs' dtype

    def __init__(self, eps: torch.Tensor, n_ff: int, cpu: CpuKernels | None = None):
        self.eps = eps  # a device scalar: no host value enters the expression
        self.n_ff = n_ff
        self.fused_norm = cpu.rms_norm if cpu is not None else None
        self.fused_swiglu = cpu.swiglu if cpu is not None else None
        self.eps_value = float(eps)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_norm is not None and x.dim() == 2:
            return self.fused_norm(x, weight, self.eps_value)
        if self.fused_norm is not None and x.dim() > 2 and x.dtype == torch.float32:
            # Per-head norms (qwen3's q/k, [T, heads, D]): the heads as rows, one op.
            return self.fused_norm(x.reshape(-1, x.shape[-1]), weight, self.eps_value).view(x.shape)
        # mean(x^2) + eps as |x|^2 / n + eps: two fused operations instead of four.
        ss = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x * torch.addcmul(self.eps, ss, ss, value=1.0 / x.shape[-1]).rsqrt_() * weight

    def swiglu(self, gate_up: torch.Tensor, op_dtype: torch.dtype | None = None) -> torch.Tensor:
        if op_dtype is not None:
            gate_up = gate_up.to(op_dtype)
        if self.fused_swiglu is not None and gate_up.dtype == torch.float32 and gate_up.shape[-1] == 2 * self.n_ff:
            return self.fused_swiglu(gate_up)
        return F.silu(gate_up[:, : self.n_ff]) * gate_up[:, self.n_ff:]


def _neox_to_pairs(n_heads: int, head_dim: int, rope_dim: int | None = None) -> np.ndarray:
    """Row order that turns each head's rotated halves [x0..x(r/2-1), y0..y(r/2-1)] (r = rope_dim,
    default head_dim) into pairs [x0, y0, x1, y1, ...], the head's unrotated rest kept after them."""
    half = (rope_dim or head_dim) // 2
    pairs = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    within = np.concatenate([pairs, np.arange(2 * half, head_dim)])
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


class Block:
    """One layer's weights.  `qkv_records` and `gate_up_records` name the GGUF tensors of the two
    fused matmuls; a family storing them fused already (engine.models.phi3) overrides them."""

    @staticmethod
    def qkv_records(t: dict[str, TensorRecord], p: str) -> list[TensorRecord]:
        """The q, k and v rows of layer prefix `p`, in that order."""
        return [t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"]]

    @staticmethod
    def gate_up_records(t: dict[str, TensorRecord], p: str) -> list[TensorRecord]:
        """The FFN's gate rows, then its up rows."""
        return [t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]]

    def __init__(self, cfg: ModelConfig, t: dict[str, TensorRecord], i: int, fmt: str, device: torch.device,
                 cpu: CpuKernels | None):
        p = f"blk.{i}."

        def vec(name: str) -> torch.Tensor:
            return torch.from_numpy(to_float(t[p + name]).reshape(-1)).to(device)

        perm = None
        if cfg.rope_style == "neox":
            q_perm = _neox_to_pairs(cfg.n_head, cfg.head_dim, cfg.rope_dim)
            k_perm = cfg.q_dim + _neox_to_pairs(cfg.n_head_kv, cfg.head_dim, cfg.rope_dim)
            v_rows = cfg.q_dim + cfg.kv_dim + np.arange(cfg.kv_dim)
            perm = np.concatenate([q_perm, k_perm, v_rows])
        biases = [t[p + f"attn_{x}.bias"] for x in "qkv"] if cfg.qkv_bias else None
        self.wqkv: Linear = build_linear(self.qkv_records(t, p), fmt, device, biases=biases, row_perm=perm, cpu=cpu)
        self.wo: Linear = build_linear([t[p + "attn_output.weight"]], fmt, device, cpu=cpu)
        self.attn_norm = vec("attn_norm.weight")
        self.ffn_norm = vec("ffn_norm.weight")
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            half_perm = _neox_to_pairs(1, cfg.head_dim, cfg.rope_dim)
            self.q_norm = vec("attn_q_norm.weight")[half_perm]
            self.k_norm = vec("attn_k_norm.weight")[half_perm]
        self.build_ffn(cfg, t, p, fmt, device, cpu)

    def build_ffn(self, cfg: ModelConfig, t: dict[str, TensorRecord], p: str, fmt: str, device: torch.device,
                  cpu: CpuKernels | None) -> None:
        """The dense SwiGLU FFN's matrices; a family with another FFN overrides this (and
        `ffn_bytes`, and its network's `feed_forward`): engine.models.qwen_moe."""
        self.w_gate_up: Linear = build_linear(self.gate_up_records(t, p), fmt, device, cpu=cpu).for_swiglu()
        self.w_down: Linear = build_linear([t[p + "ffn_down.weight"]], fmt, device, cpu=cpu)

    @property
    def ffn_bytes(self) -> int:
        return self.w_gate_up.nbytes + self.w_down.nbytes

    @property
    def nbytes(self) -> int:
        vecs = [self.attn_norm, self.ffn_norm] + [v for v in (self.q_norm, self.k_norm) if v is not None]
        return self.wqkv.nbytes + self.wo.nbytes + self.ffn_bytes + sum(v.nbytes for v in vecs)


class LlamaModel(CachedNetwork):
    block_class: type[Block] = Block  # a family with other tensor names overrides its records
    # True where the rotations depend on the context a cache was made for (phi3's LongRoPE):
    # then `rope_for` picks them per cache, and CUDA graphs (one table) do not apply.
    rope_by_context = False
    # Whether decoding steps may be captured in CUDA graphs: not where the FFN reads routing
    # decisions back to the host (engine.models.qwen_moe).
    captures_graphs = True
    # Whether `feed_forward` is the block's dense SwiGLU, which a decoding step may run as one op
    # on CPU (a family with another FFN sets False: engine.models.qwen_moe).
    dense_ffn = True

    def __init__(self, cfg: ModelConfig, gguf: GGUFContents, fmt: str, device: torch.device,
                 cpu_kernels: CpuKernels | None = None):
        if cfg.rope_dim > cfg.head_dim or cfg.rope_dim % 2 or cfg.rope_dim < 2:
            raise UnsupportedModel(f"rope dim {cfg.rope_dim} for head dim {cfg.head_dim}")
        if cfg.sliding_window is not None and cfg.sliding_window < 1:
            raise UnsupportedModel(f"sliding window {cfg.sliding_window}")
        t = dict(gguf.tensors)
        required = ["token_embd.weight", "output_norm.weight"]
        missing = [n for n in required if n not in t]
        if missing:
            raise UnsupportedModel(f"GGUF lacks tensors: {', '.join(missing)}")
        self.cfg = cfg
        self.device = device
        self.fmt = fmt
        # The CPU path's kernels (engine.kernels); None on other devices.
        self.cpu_kernels = cpu_kernels if device.type == "cpu" else None
        if device.type == "cpu" and cpu_kernels is None:
            raise ValueError("a CPU model needs a CPU kernel path (engine.kernels.cpu_kernels)")
        try:
            self.blocks = [self.block_class(cfg, t, i, fmt, device, self.cpu_kernels) for i in range(cfg.n_layer)]
        except KeyError as e:
            raise UnsupportedModel(f"GGUF lacks tensor {e.args[0]}") from None
        self.embed = Embedding(t["token_embd.weight"], fmt, device)
        self.out_norm = torch.from_numpy(to_float(t["output_norm.weight"]).reshape(-1)).to(device)
        # A tied head reuses the embedding table where one is resident, else gets its own kernel.
        self.head_is_table = "output.weight" not in t and self.embed.table is not None
        if self.head_is_table:
            self.output: Linear = DenseLinear(self.embed.table)
        else:
            self.output = build_linear([t.get("output.weight", t["token_embd.weight"])], fmt, device,
                                       cpu=self.cpu_kernels)
        self.torch_kernels = TorchKernels(torch.tensor(cfg.norm_eps, dtype=torch.float32, device=device), cfg.n_ff,
                                          self.cpu_kernels)
        # qwen3's per-head q/k norms on CUDA: one float32 kernel in place (eager and replayed steps).
        self.cuda_head_norms = device.type == "cuda" and cuda_attention.AVAILABLE
        self.cuda_prefill_inputs = PREFILL_INPUTS_KERNEL and device.type == "cuda" and cuda_attention.AVAILABLE
        # The compiled kernel stores and attends all rows of a decode step in one call (CPU,
        # float32 or float16 caches), the window included; None keeps the torch-ops path.
        fits = device.type == "cpu" and attention_fits(cfg.head_dim)
        self.attention_kernel = self.cpu_kernels.attention if fits and self.cpu_kernels else None
        # Where the compiled kernel attends, each half of a decoding layer whose matrices allow it
        # runs as one op of the same kernels (engine/kernels/block.cpp): the same bits, without
        # the dozen dispatches between them.  None keeps the step in Python.
        blocks_fit = self.attention_kernel is not None and self.cpu_kernels.attention_block is not None
        self.block_ops = self.cpu_kernels if blocks_fit else None
        # Every layer attends to the last `window` positions only (Mistral-style files); None: all.
        self.window = cfg.sliding_window
        self.rope_tables(t)
        # CUDA: decoding steps replay captured graphs (engine.cuda_graphs); None decodes eagerly.
        # Their attention sees every cached position and their rope one table, so a window or
        # per-context rotations keep decoding eager.
        graphs_fit = self.window is None and not self.rope_by_context and self.captures_graphs
        self.decode_graphs = cuda_graphs.DecodeGraphs(self) if graphs_fit and cuda_graphs.usable(device) else None
        # A short CUDA prefill chunk is bound by launching its kernels from Python (40 tokens of
        # the 135M shape: 17-19 ms, 3 ms of it on the GPU): where the graphs run, prefill takes
        # their one-kernel norms and SwiGLU too, not torch's six and three.
        self.prefill_kernels: StepKernels = self.torch_kernels
        if self.decode_graphs is not None:
            self.prefill_kernels = cuda_elementwise.FusedStepKernels(cfg.norm_eps, self.decode_graphs.compute_dtype())

    def inverse_frequencies(self) -> torch.Tensor:
        """base^(-2i / rope_dim) for the rope_dim/2 rotated pairs, float64."""
        cfg = self.cfg
        return cfg.rope_base ** -(torch.arange(0, cfg.rope_dim, 2, dtype=torch.float64) / cfg.rope_dim)

    def rope_table(self, inv_freq: torch.Tensor, magnitude: float = 1.0) -> torch.Tensor:
        """[n_ctx_train, head_dim/2] complex64 rotations of the pairs at every position: angle
        position * inv_freq[i] and length `magnitude` for the rotated pairs; the pairs past
        rope_dim (partial rotary) are multiplied by exactly 1."""
        cfg = self.cfg
        angles = torch.outer(torch.arange(cfg.n_ctx_train, dtype=torch.float64), inv_freq)
        turned = torch.polar(torch.full_like(angles, magnitude), angles)
        still = torch.ones(cfg.n_ctx_train, cfg.head_dim // 2 - inv_freq.numel(), dtype=turned.dtype)
        return torch.cat([turned, still], dim=1).to(torch.complex64).to(self.device)

    def rope_tables(self, t: dict[str, TensorRecord]) -> None:
        """Sets `self.rope`, the rotations `rope_for` returns."""
        inv = self.inverse_frequencies()
        if "rope_freqs.weight" in t:  # Llama 3.1-style long-context scaling, precomputed by the converter
            inv = inv / torch.from_numpy(to_float(t["rope_freqs.weight"]).reshape(-1)).double()
        self.rope = self.rope_table(inv)

    def rope_for(self, n_ctx: int) -> torch.Tensor:
        """The rotation table a cache of `n_ctx` positions uses (here always `self.rope`)."""
        return self.rope

    @property
    def attention_path(self) -> str:
        """How decode steps attend, for banners and benchmark headers."""
        path = self._attention_path()
        return path if self.window is None else f"{path}, sliding window {self.window}"

    def _attention_path(self) -> str:
        if self.attention_kernel is not None:
            return f"compiled CPU kernel ({self.cpu_kernels.name})"
        if self.decode_graphs is not None and self.decode_graphs.enabled:
            return f"Triton kernels in CUDA graphs ({self.device.type})"
        if self.device.type != "cpu":
            return f"torch ops ({self.device.type})"
        if self.cpu_kernels is not None and self.cpu_kernels.attention is None:
            return f"torch ops (CPU kernels {self.cpu_kernels.describe()})"
        return f"torch ops (no kernel for head dim {self.cfg.head_dim})"

    def work_bytes(self, n_tokens: int, ctx: int) -> int:
        """Working buffers of one forward step of `n_tokens` new tokens against `ctx` positions:
        float32 activations (residual, norms, qkv, attention output, gate/up) and attention
        scores, plus one row of logits."""
        cfg = self.cfg
        T = n_tokens
        acts = 4 * T * (cfg.n_embd * 4 + cfg.q_dim + 2 * cfg.kv_dim + 2 * cfg.n_ff) + 4 * cfg.n_head * T * ctx
        return acts + 4 * cfg.n_vocab

    def head(self, h: torch.Tensor, ops: StepKernels | None = None) -> torch.Tensor:
        return self.output((ops or self.torch_kernels).norm(h, self.out_norm)).float()

    def _qkv(self, blk: Block, x: torch.Tensor, rope: torch.Tensor | None, ops: StepKernels) -> torch.Tensor:
        """[T, (H + 2*Hkv) * D] float32 projections of x's T rows, q and k rotated in place by
        `rope` (None: left unrotated, for an attention that turns them itself)."""
        T = x.shape[0]
        H, Hkv, D = self.cfg.n_head, self.cfg.n_head_kv, self.cfg.head_dim
        qkv = blk.wqkv(ops.norm(x, blk.attn_norm)).float()  # a fresh tensor: safe to modify
        if blk.q_norm is not None and self.cuda_head_norms:
            cuda_elementwise.head_norms_(qkv, blk.q_norm, blk.k_norm, H, Hkv, self.cfg.norm_eps)
        elif blk.q_norm is not None:
            norm = self.torch_kernels.norm
            qkv[:, : H * D] = norm(qkv[:, : H * D].view(T, H, D), blk.q_norm).view(T, H * D)
            qkv[:, H * D: (H + Hkv) * D] = norm(qkv[:, H * D: (H + Hkv) * D].view(T, Hkv, D),
                                                blk.k_norm).view(T, Hkv * D)
        if rope is not None:
            torch.view_as_complex(qkv.view(T, -1, D // 2, 2))[:, : H + Hkv].mul_(rope)
        return qkv

    def _prefill_inputs(self, blk: Block, x: torch.Tensor, li: int, cache: KVCache, start: int, turns: torch.Tensor,
                        ops: StepKernels) -> torch.Tensor:
        """A CUDA prefill chunk's projections, its keys and values stored at start.. and its
        queries returned [T, H, D] in the cache's dtype, turned by `turns` (cuda_attention's
        `rope_pairs` table; `prefill_inputs`).  The projections enter as the product left them
        (cuBLAS's bfloat16 for int4 matrices of many rows); where head norms modify them, as
        `_qkv` leaves them unturned (float32, normed)."""
        if blk.q_norm is None:
            qkv, _ = blk.wqkv.narrow(ops.norm(x, blk.attn_norm))
        else:
            qkv = self._qkv(blk, x, None, ops)
        return cuda_attention.prefill_inputs(qkv, cache.layer_kv[li], start, self.cfg.n_head, self.cfg.n_head_kv,
                                             self.cfg.head_dim, turns)

    def feed_forward(self, blk: Block, x: torch.Tensor, ops: StepKernels) -> None:
        """x += the block's SwiGLU FFN of x (a family with another FFN overrides this)."""
        blk.w_down.accumulate(x, blk.w_gate_up.swiglu(ops.norm(x, blk.ffn_norm), ops))

    @staticmethod
    def _attend_one(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """One row's queries q [Hkv, G, D], already scaled by 1/sqrt(D), against keys/vals
        [Hkv, L, D] -> [Hkv, G, D]."""
        # Plain batched matmuls over the kv heads: cheaper to dispatch than SDPA for one row, and
        # unlike SDPA's one-row kernel their result does not depend on the number of threads.
        if keys.device.type == "cpu" and keys.dtype != torch.float32:  # CPU matmuls in float32
            keys, vals = keys.float(), vals.float()
        elif keys.dtype != torch.float32:
            q = q.to(keys.dtype)
        probs = torch.softmax(torch.bmm(q, keys.transpose(1, 2)), dim=-1, dtype=torch.float32)
        return torch.bmm(probs if vals.dtype == torch.float32 else probs.to(vals.dtype), vals)

    def _row_attention(self, caches: list[KVCache], pos: list[int],
                       kernel: Callable[[int], tuple[list[torch.Tensor], list[int]]] | None = None
                       ) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """attend(layer, qkv [N, ...]) -> [N, H * D] for one decode step: stores each row's K and V
        at its position, then attends each row to its own cache: all rows in one call of the
        compiled kernel on CPU, else one row after another (on CUDA, rows pooled together attend
        in one masked batch: see _pooled_attention).  `kernel`: _kernel_rows's, where the caller
        has it already."""
        H, Hkv, D = self.cfg.n_head, self.cfg.n_head_kv, self.cfg.head_dim
        qd = H * D
        lo = [self.first_visible(p) for p in pos]
        kernel = kernel or self._kernel_rows(caches, pos)
        if kernel is not None:
            op, window = self.attention_kernel, self.window or 0
            return lambda li, qkv: op(qkv, *kernel(li), D ** -0.5, window)
        pool = caches[0].pool
        if len(caches) > 1 and pool is not None and all(c.pool is pool for c in caches):
            where = pool.row_index([c.slot for c in caches], pos)

            def store(li: int, qkv: torch.Tensor) -> None:
                pool.layer_rows[li].index_copy_(0, where, qkv[:, qd:].reshape(-1, D).to(pool.kv.dtype))
            if self.device.type == "cuda":
                return self._pooled_attention(pool, [c.slot for c in caches], pos, lo, store)
        else:
            def store(li: int, qkv: torch.Tensor) -> None:
                for i, (c, p) in enumerate(zip(caches, pos)):
                    c.layer_kv[li][:, :, p] = qkv[i, qd:].view(2, Hkv, D)

        N, attend_one = len(caches), self._attend_one

        def attend(li: int, qkv: torch.Tensor) -> torch.Tensor:
            store(li, qkv)
            q = (qkv[:, :qd] * D ** -0.5).view(N, Hkv, -1, D)
            rows = [attend_one(q[i], c.layer_k[li][:, first: p + 1], c.layer_v[li][:, first: p + 1])
                    for i, (c, p, first) in enumerate(zip(caches, pos, lo))]
            return (rows[0] if N == 1 else torch.stack(rows)).view(N, qd)
        return attend

    def _kernel_rows(self, caches: list[KVCache], pos: list[int]
                     ) -> Callable[[int], tuple[list[torch.Tensor], list[int]]] | None:
        """where(layer) -> (each row's cache of that layer, each row's position): the compiled
        attention kernel's arguments for one decode step (the window is the kernel's own
        argument); None where it does not run."""
        if self.attention_kernel is None or caches[0].kv.dtype not in ATTENTION_CACHE_DTYPES:
            return None
        layers = [c.layer_kv for c in caches]
        return lambda li: ([kv[li] for kv in layers], pos)

    def _pooled_attention(self, pool: KVPool, slots: list[int], pos: list[int], lo: list[int],
                          store: Callable[[int, torch.Tensor], None]) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """CUDA only: all rows attend in one batch over the longest row's length, each masked to
        its own.  On the GPU the row-by-row loop is bound by kernel launches, and the GPU's
        matmul kernels already round differently for different row counts, so bitwise equality
        with single-row decoding is not on offer there either (tests bound the difference)."""
        H, Hkv, D = self.cfg.n_head, self.cfg.n_head_kv, self.cfg.head_dim
        N, G, L = len(slots), H // Hkv, max(pos) + 1
        kpos = torch.arange(L, device=self.device)[None, :]
        hidden = kpos > torch.tensor(pos, device=self.device)[:, None]
        if self.window is not None:
            hidden |= kpos < torch.tensor(lo, device=self.device)[:, None]
        hidden = hidden.view(N, 1, 1, L)
        first = slots[0]
        gather = None if slots == list(range(first, first + N)) else torch.tensor(slots, device=self.device)

        def attend(li: int, qkv: torch.Tensor) -> torch.Tensor:
            store(li, qkv)
            kv = pool.layer_kv[li][:, :, :, :L]  # [2, slots, Hkv, L, D]
            kv = kv[:, first: first + N] if gather is None else kv.index_select(1, gather)
            keys, vals = kv[0].flatten(0, 1), kv[1].flatten(0, 1)  # [N * Hkv, L, D]
            q = (qkv[:, : H * D] * D ** -0.5).reshape(N * Hkv, G, D).to(keys.dtype)
            scores = torch.bmm(q, keys.transpose(1, 2)).float().view(N, Hkv, G, L)
            probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
            return torch.bmm(probs.view(N * Hkv, G, L).to(vals.dtype), vals).view(N, H * D)
        return attend

    @torch.inference_mode()
    def forward_rows(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """tokens [N], caches N distinct caches -> logits [N, n_vocab] (float32)."""
        pos = [c.n for c in caches]
        for c in caches:
            c.reserve(c.n + 1)
        kernel = self._kernel_rows(caches, pos)
        attend = self._row_attention(caches, pos, kernel)
        tables = [self.rope_for(c.n_ctx) for c in caches]
        if len(pos) == 1:
            rope = tables[0][pos[0]: pos[0] + 1].unsqueeze(1)  # [1, 1, D/2]
        elif all(tb is tables[0] for tb in tables):
            rope = tables[0][torch.tensor(pos, device=self.device)].unsqueeze(1)  # [N, 1, D/2]
        else:  # rows made for contexts on both sides of a LongRoPE switch
            rope = torch.stack([tb[p] for tb, p in zip(tables, pos)]).view(len(pos), 1, -1)
        if kernel is not None and self.block_ops is not None:
            logits = self.decode_layers_in_blocks(tokens, rope, attend, kernel)
        else:
            logits = self.decode_layers(tokens, rope, attend)
        for c, p in zip(caches, pos):
            c.n = p + 1
        return logits

    def decode_layers(self, tokens: torch.Tensor, rope: torch.Tensor | None,
                      attend: Callable[[int, torch.Tensor], torch.Tensor],
                      ops: StepKernels | None = None) -> torch.Tensor:
        """The body of a decoding step: tokens [N], rope [N, 1, D/2] at each row's position (None
        where `attend` turns q and k itself) and
        attend(layer, qkv [N, ...]) -> [N, H * D] (which stores the new keys and values) ->
        logits [N, n_vocab] float32.  `ops` replaces the norms and the SwiGLU (default: the
        model's torch ops), e.g. by fused kernels.  It launches no host synchronisation, so a
        CUDA graph can capture it (engine.cuda_graphs)."""
        ops = ops or self.torch_kernels
        x = self.embed(tokens)  # [N, n_embd] residual stream, float32
        for li, blk in enumerate(self.blocks):
            blk.wo.accumulate(x, attend(li, self._qkv(blk, x, rope, ops)))
            self.feed_forward(blk, x, ops)
        return self.head(x, ops)

    def graph_workspace(self, n_rows: int, n_ctx: int, out_dtype: torch.dtype) -> cuda_attention.Workspace:
        """engine.cuda_graphs.GraphNetwork: the Triton decode attention's scratch."""
        cfg = self.cfg
        return cuda_attention.Workspace(n_rows, cfg.n_head, cfg.head_dim, n_ctx, cfg.n_head_kv, self.device, out_dtype,
                                        max_programs=cuda_attention.PIECE_PROGRAMS)

    def graph_step(self, table: torch.Tensor, base: torch.Tensor, work: cuda_attention.Workspace,
                   kernels: StepKernels | None, shared: bool) -> torch.Tensor:
        """engine.cuda_graphs.GraphNetwork: decode_layers with the Triton attention reading each
        row's cache from the table (and, with cuda_attention.ROPE_IN_ATTENTION, turning q and k by
        each row's position as it loads them)."""
        H, Hkv, D = self.cfg.n_head, self.cfg.n_head_kv, self.cfg.head_dim
        if cuda_attention.ROPE_IN_ATTENTION:
            rope, turns = None, cuda_attention.rope_pairs(self.rope)
        else:
            rope, turns = self.rope[table[:, cuda_attention.POS]].unsqueeze(1), None  # [B, 1, D/2]

        def attend(li: int, qkv: torch.Tensor) -> torch.Tensor:
            return cuda_attention.decode_attention(qkv, table, li, base, work, H, Hkv, D, store_first=shared,
                                                   rope=turns)
        return self.decode_layers(table[:, cuda_attention.TOKEN], rope, attend, kernels)

    def decode_layers_in_blocks(self, tokens: torch.Tensor, rope: torch.Tensor,
                                attend: Callable[[int, torch.Tensor], torch.Tensor],
                                where: Callable[[int], tuple[list[torch.Tensor], list[int]]]) -> torch.Tensor:
        """decode_layers on CPU, each layer half whose matrices are int4 or int8 with nothing around
        them in one op of the compiled kernels (`block_ops`), the others as decode_layers runs
        them: the same kernels in the same order, so the same bits."""
        N = tokens.shape[0]
        ops, fused = self.torch_kernels, self.block_ops
        eps, scale, window = ops.eps_value, self.cfg.head_dim ** -0.5, self.window or 0
        turns = torch.view_as_real(rope).reshape(N, -1)  # [N, D]: (cos, sin) per pair
        x = self.embed(tokens)
        for li, blk in enumerate(self.blocks):
            qkv, wo = blk.wqkv.vector_operands(N), blk.wo.vector_operands(N)
            if qkv is not None and wo is not None and blk.q_norm is None:
                fused.attention_block(x, blk.attn_norm, eps, qkv, turns, *where(li), window, scale, wo)
            else:
                blk.wo.accumulate(x, attend(li, self._qkv(blk, x, rope, ops)))
            gate_up = blk.w_gate_up.vector_operands(N) if self.dense_ffn else None
            down = blk.w_down.vector_operands(N) if gate_up is not None else None
            if down is not None:
                fused.ffn_block(x, blk.ffn_norm, eps, gate_up, down)
            else:
                self.feed_forward(blk, x, ops)
        return self.head(x, ops)

    def _prefill_attention(self, li: int, q: torch.Tensor, cache: KVCache, start: int, mask: torch.Tensor | None,
                           causal: bool) -> torch.Tensor:
        """[T, H * D] attention of q's T rows (positions start..) to the cache, which holds their
        keys and values already.  On CPU each row attends exactly as a decoding step at its
        position would (the compiled kernel's prefill op, or the torch-ops path row by row), so
        a prompt's prefill and its tokens decoded one by one give the same numbers; on other
        devices one scaled-dot-product call."""
        T = q.shape[0]
        H, Hkv, D = self.cfg.n_head, self.cfg.n_head_kv, self.cfg.head_dim
        end = start + T
        if self.device.type == "cpu":
            if self.attention_kernel is not None and cache.kv.dtype in ATTENTION_CACHE_DTYPES:
                # Each row by the operations its decoding step runs, its window included.
                return self.cpu_kernels.prefill_attention(q, cache.layer_kv[li], start, D ** -0.5, self.window or 0)
            rows = (q * D ** -0.5).view(T, Hkv, H // Hkv, D)
            spans = [slice(self.first_visible(start + i), start + i + 1) for i in range(T)]
            return torch.stack([self._attend_one(rows[i], cache.layer_k[li][:, spans[i]], cache.layer_v[li][:, spans[i]])
                                for i in range(T)]).view(T, H * D)
        return self._fused_attention(li, q.view(T, H, D).to(cache.kv.dtype), cache, end, mask, causal)

    def _fused_attention(self, li: int, q: torch.Tensor, cache: KVCache, end: int, mask: torch.Tensor | None,
                         causal: bool) -> torch.Tensor:
        """[T, H * D] attention of q [T, H, D] (the cache's dtype; rows at end - T..) to the
        cache's first `end` positions, which hold their keys and values already: one
        scaled-dot-product call."""
        T, H, D = q.shape
        Hkv = self.cfg.n_head_kv
        keys, vals = cache.layer_k[li][:, :end], cache.layer_v[li][:, :end]  # [Hkv, end, D]
        qh = q.transpose(0, 1).unsqueeze(0)
        grouped = H != Hkv and mask is None and flash_takes(q.device, keys.dtype, D)
        if H != Hkv and not grouped:
            # The memory-efficient kernel, which the masked chunks need, does not take grouped
            # heads: each kv head is repeated for its queries, a copy of `end` positions of a
            # few MB at most.
            keys, vals = keys.repeat_interleave(H // Hkv, dim=0), vals.repeat_interleave(H // Hkv, dim=0)
        # (the backends are chosen once per chunk, in `forward`: entering sdpa_kernel costs more
        # host time than a small chunk's attention)
        att = F.scaled_dot_product_attention(qh, keys.unsqueeze(0), vals.unsqueeze(0), attn_mask=mask,
                                             is_causal=causal, enable_gqa=grouped)  # [1, H, T, D]
        return att[0].transpose(0, 1).reshape(T, H * D)

    def first_visible(self, pos: int) -> int:
        """The first cached position a query at `pos` attends to (llama.cpp's window rule: the
        `window` positions up to and including its own)."""
        return 0 if self.window is None else max(0, pos + 1 - self.window)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, logits: str = "last",
                cancel: Callable[[], bool] | None = None) -> torch.Tensor | None:
        T = tokens.shape[0]
        if T == 1 and logits == "last" and start == cache.n:  # a decode step: one code path for all
            if cancel is not None and cancel():
                raise Cancelled("cancelled before a one-token step")
            return self.forward_rows(tokens, [cache])[0]
        H, Hkv, D = self.cfg.n_head, self.cfg.n_head_kv, self.cfg.head_dim
        end = start + T
        cache.reserve(end)
        done, out = self.graph_prefill(tokens, start, cache, logits, cancel)
        if done:
            return out
        rope = self.rope_for(cache.n_ctx)[start:end].unsqueeze(1)  # [T, 1, D/2]
        mask, causal = None, T > 1 and start == 0
        windowed = self.window is not None and end > self.window
        if (T > 1 and start > 0 or windowed) and self.device.type != "cpu":
            # causal, the past visible: row i sees start + i and before (within the window)
            pos = torch.arange(end, device=self.device)
            qpos = (start + torch.arange(T, device=self.device))[:, None]
            mask = pos[None, :] <= qpos
            if windowed:
                mask &= pos[None, :] > qpos - self.window
            causal = False
        x = self.embed(tokens)  # [T, n_embd] residual stream, float32
        ops = self.prefill_kernels
        turns = cuda_attention.rope_pairs(self.rope_for(cache.n_ctx)) if self.cuda_prefill_inputs else None
        with sdpa_kernel(PREFILL_SDPA_BACKENDS) if self.device.type != "cpu" else contextlib.nullcontext():
            for li, blk in enumerate(self.blocks):
                if cancel is not None and cancel():  # cache.n is still `start`: nothing half-done is visible
                    raise Cancelled(f"cancelled in layer {li} of a {T}-token step")
                if self.cuda_prefill_inputs:
                    q = self._prefill_inputs(blk, x, li, cache, start, turns, ops)
                    blk.wo.accumulate(x, self._fused_attention(li, q, cache, end, mask, causal))
                else:
                    qkv = self._qkv(blk, x, rope, ops)
                    cache.layer_kv[li][:, :, start:end] = qkv[:, H * D:].view(T, 2, Hkv, D).permute(1, 2, 0, 3)
                    blk.wo.accumulate(x, self._prefill_attention(li, qkv[:, : H * D], cache, start, mask, causal))
                self.feed_forward(blk, x, ops)
        cache.n = end
        if logits == "last":
            return self.head(x[-1:], ops)[0]
        if logits == "all":
            return self.head(x, ops)
        return None
